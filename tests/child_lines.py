"""Run by `tests/test_child_runner.py` as a child of `child_runner.run_in_children`, writing the
protocol's lines itself: each item's ``start`` and ``done`` with the item as the result; on "exit
after", both lines, then the process ends with status 1 before the next item starts (a child that
died between two items)."""

import json
import os
import sys

if __name__ == "__main__":
    request = json.load(sys.stdin)
    for i, item in enumerate(request["items"]):
        print(f"start {i}", flush=True)
        print(f"done {i} {json.dumps(item)}", flush=True)
        if item == "exit after":
            os._exit(1)
