"""Run by `tests/test_child_runner.py` as a child of `child_runner.run_in_children`: a child that
takes 2 s to start (as one importing torch on a busy machine), then doubles each number."""

import time

from qsync_callback.child_runner import serve

time.sleep(2.0)


def handle(item, request):
    return item * 2


if __name__ == "__main__":
    serve(handle)
