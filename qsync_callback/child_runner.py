"""Run a list of items through a child Python process that one of them may take down: the ops the
estimate times alone (`recorder/op_probes.py`: made-up values can crash a native kernel) and the
calls TVM lowers (`predictor/tvm_features.py`: TVM aborts on some).

The parent (`run_in_children`) starts ``python -m <module>`` with the request as JSON on its stdin,
``{"items": [...], **extra}``; the child (`serve`, called from that module's ``__main__``) handles the
items in order and writes one ``start i`` line before each and one ``done i <result as JSON>`` (or
``failed i``, when the handler raised) after it. A child that dies leaves a ``start`` without its end:
that item is reported as None and a new child takes the items after it; one that dies between two
items (a kernel that corrupted memory may crash the child later) loses none. So does a child that writes
no line for ``item_seconds``: it is killed as hung (a native kernel given made-up values may loop or
wait forever instead of crashing; without the limit one such item spent the whole budget and every
item after it went unreported). At the deadline the child is killed and what is left is not reported;
the time a child takes to start (until its first line: importing torch takes seconds, more on a busy
machine) does not count against the deadline, only against ``item_seconds``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def run_in_children(
    module: str,
    items: Sequence[Any],
    deadline: float,
    report: Callable[[int, Any | None], None],
    extra: Mapping[str, Any] | None = None,
    item_seconds: float = 60.0,
) -> None:
    """Hand ``items`` to children running ``module`` until each is done or ``deadline`` (a
    ``time.monotonic()`` time, moved on by the time each child takes to start) passes;
    ``report(i, result)`` for each item done, ``report(i, None)`` for one that failed, took its child
    down or hung it (no line for ``item_seconds``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    first = 0
    while first < len(items) and time.monotonic() < deadline:
        clock = _ChildClock(deadline, item_seconds)
        child = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )  # fmt: skip
        assert child.stdin is not None and child.stdout is not None
        done = threading.Event()
        watchdog = threading.Thread(target=_watch, args=(child, clock, done), daemon=True)
        watchdog.start()
        try:
            child.stdin.write(json.dumps({**(extra or {}), "items": list(items[first:])}))
            child.stdin.close()
        except BrokenPipeError:
            pass
        started = None  # the item the child is on
        after = first  # the first item not ended
        for line in child.stdout:
            clock.line()
            word, index, *rest = line.split(maxsplit=2)
            started = first + int(index)
            if word in ("done", "failed"):
                report(started, json.loads(rest[0]) if word == "done" else None)
                started, after = None, started + 1
        child.wait()
        done.set()
        watchdog.join()
        deadline = clock.deadline
        if time.monotonic() >= deadline:
            return  # the time ran out (not a failure)
        if started is not None:
            report(started, None)  # the child died on it
            after = started + 1
        elif child.returncode == 0 or after == first:
            return  # all done; or the child died before its first item, and would again
        first = after  # died between two items (a kernel that corrupted memory crashes later)


class _ChildClock:
    """One child's deadline, held while the child starts and moved on by that time at its first
    line, and when its last line came (the child is hung after ``item_seconds`` without one)."""

    def __init__(self, deadline: float, item_seconds: float):
        self.deadline = deadline
        self.item_seconds = item_seconds
        self.last_line = time.monotonic()  # the child's start, until its first line
        self.starting = True

    def line(self) -> None:
        now = time.monotonic()
        if self.starting:
            self.deadline += now - self.last_line
            self.starting = False
        self.last_line = now

    def expired(self) -> bool:
        """Past the deadline (once started), or no line for ``item_seconds``."""
        now = time.monotonic()
        return (not self.starting and now >= self.deadline) or now - self.last_line > self.item_seconds


def _watch(child: subprocess.Popen, clock: _ChildClock, done: threading.Event) -> None:
    """Kill ``child`` once its ``clock`` has expired, unless ``done`` is set first."""
    while not done.wait(0.05):
        if clock.expired():
            child.kill()
            return


def serve(handle: Callable[[Any, Mapping[str, Any]], Any]) -> None:
    """The child's side: the request from stdin, ``handle(item, request)`` for each of its items,
    the lines `run_in_children` reads on stdout. Anything else written to stdout (a library's own
    prints) goes to stderr, so it cannot be taken for a line of the protocol."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    request = json.load(sys.stdin)
    for i, item in enumerate(request["items"]):
        print(f"start {i}", file=out, flush=True)
        try:
            result = handle(item, request)
        except Exception:  # noqa: BLE001 - an item that cannot be handled is reported as failed
            print(f"failed {i}", file=out, flush=True)
            continue
        print(f"done {i} {json.dumps(result)}", file=out, flush=True)
