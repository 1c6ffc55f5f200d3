"""Run by `tests/test_child_runner.py` as a child of `child_runner.run_in_children`: doubles a
number, raises on "fail", dies on "crash", hangs on "hang", and prints on stdout as a library might."""

import os
import signal
import time

from qsync_callback.child_runner import serve


def handle(item, request):
    print("a library's own line")  # must not be taken for the protocol's
    if item == "fail":
        raise ValueError(item)
    if item == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if item == "hang":
        time.sleep(60)
    return item * request["factor"]


if __name__ == "__main__":
    serve(handle)
