"""Items handed to child processes that one item may take down (`child_runner.py`), with a child
module of the tests' own (`child_items.py`)."""

import time

from qsync_callback.child_runner import run_in_children


def _run(items, seconds=60.0, item_seconds=60.0):
    reported = {}
    deadline = time.monotonic() + seconds
    run_in_children("child_items", items, deadline, reported.__setitem__, {"factor": 2}, item_seconds)
    return reported


def test_each_item_is_reported_in_order_a_failure_as_none():
    assert _run([1, 2, "fail", 3]) == {0: 2, 1: 4, 2: None, 3: 6}


def test_a_crash_loses_only_its_item_and_a_new_child_takes_the_rest():
    assert _run([1, "crash", 2, "crash", 3]) == {0: 2, 1: None, 2: 4, 3: None, 4: 6}


def test_at_the_deadline_the_child_is_killed_and_the_rest_is_not_reported():
    start = time.monotonic()
    assert _run([1, "hang", 2], seconds=3.0) == {0: 2}
    assert time.monotonic() - start < 30


def test_a_childs_start_is_not_counted_against_the_deadline():
    """The child takes 2 s to start, the deadline is 1 s away: its items are still done (the time
    is for the items, not for importing a library)."""
    reported = {}
    run_in_children("child_slow_start", [1, 2], time.monotonic() + 1.0, reported.__setitem__)
    assert reported == {0: 2, 1: 4}


def test_an_item_that_hangs_its_child_loses_only_itself_and_a_new_child_takes_the_rest():
    start = time.monotonic()
    assert _run([1, "hang", 2, "hang", 3], seconds=60.0, item_seconds=3.0) == {
        0: 2,
        1: None,
        2: 4,
        3: None,
        4: 6,
    }
    assert time.monotonic() - start < 30  # two hangs of 3 s, not the minute the deadline allows


def test_a_child_that_dies_between_two_items_loses_neither_and_a_new_child_takes_the_rest():
    reported = {}
    items = [1, "exit after", 2, "exit after", 3]
    run_in_children("child_lines", items, time.monotonic() + 60, reported.__setitem__)
    assert reported == dict(enumerate(items))


def test_no_items_start_no_child():
    assert _run([]) == {}
