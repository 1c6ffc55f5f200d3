"""Items handed to child processes that one item may take down (`child_runner.py`), with a child
module of the tests' own (`child_items.py`)."""

import time

from qsync_callback.child_runner import run_in_children


def _run(items, seconds=60.0):
    reported = {}
    run_in_children("child_items", items, time.monotonic() + seconds, reported.__setitem__, {"factor": 2})
    return reported


def test_each_item_is_reported_in_order_a_failure_as_none():
    assert _run([1, 2, "fail", 3]) == {0: 2, 1: 4, 2: None, 3: 6}


def test_a_crash_loses_only_its_item_and_a_new_child_takes_the_rest():
    assert _run([1, "crash", 2, "crash", 3]) == {0: 2, 1: None, 2: 4, 3: None, 4: 6}


def test_at_the_deadline_the_child_is_killed_and_the_rest_is_not_reported():
    start = time.monotonic()
    assert _run([1, "hang", 2], seconds=3.0) == {0: 2}
    assert time.monotonic() - start < 30


def test_no_items_start_no_child():
    assert _run([]) == {}
