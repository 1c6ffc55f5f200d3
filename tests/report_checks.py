"""Checks of a report against the traces it was made from, shared by the integrations' tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from qsync_callback.recorder.trace import Trace


def _slowdown(trace: Trace) -> float:
    return (trace.measured.get("profiler_share") or {}).get("slowdown", 0.0)


def profiler_removes_at_most_us(trace: Trace, step_index: int, wall_us: float) -> float:
    """The most the graph takes off recorded step ``step_index`` (of ``wall_us``) for the profiler:
    each op's share (`Trace.own_us`, `Trace.gap_overhead_us`) and the slowdown's share of the idle
    time between the ops (`Trace.gap_kept`), which is at most its share of the wall time. A negative
    slowdown (recorded steps that ran faster than the unprofiled ones) takes nothing off: it
    lengthens the idle time instead, by at most `profiler_adds_at_most_us`."""
    ops = [op for op in trace.ops if op.step == step_index]
    own = sum(op.dur_us - trace.own_us(op) + trace.gap_overhead_us(op) for op in ops)
    return own + max(0.0, _slowdown(trace)) * wall_us


def profiler_adds_at_most_us(trace: Trace, wall_us: float) -> float:
    """The most the graph adds to a recorded step of ``wall_us`` for a negative slowdown: its share
    of the idle time, which is at most its share of the wall time (0 for a positive one)."""
    return max(0.0, -_slowdown(trace)) * wall_us


def assert_prediction_replays_the_recorded_steps(report: Mapping[str, Any], traces: Sequence[Trace]) -> None:
    """The replay reproduces each recorded step (from the first rank's start to the last rank's end)
    less the profiler's own share (what `Trace.own_us` and `Trace.gap_overhead_us` take off), so on
    one rank the predicted step lies between the shortest recorded step less its share and the
    longest; with several ranks it is at most a quarter over the longest (clock alignment and
    modelled collectives).
    The measured steps are not involved: the machine's speed does not move this, a broken graph or
    replay does. Also: the step-time error is what the two figures say."""
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for trace in traces:  # a step of the run spans its ranks, on their common clock
        for step in trace.steps:
            start, end = step.start_us + trace.clock_offset_us, step.end_us + trace.clock_offset_us
            starts[step.index] = min(starts.get(step.index, start), start)
            ends[step.index] = max(ends.get(step.index, end), end)
    walls = [(ends[index] - starts[index]) / 1e3 for index in starts]
    # recorded steps that ran faster than the unprofiled ones are lengthened (a negative slowdown)
    stretch = 1 + max(profiler_adds_at_most_us(t, 1.0) for t in traces)
    predicted, measured = report["predicted"]["step_ms"], report["measured"]["step_ms"]
    if len(traces) == 1:
        unprofiled = [
            wall - profiler_removes_at_most_us(traces[0], index, wall * 1e3) / 1e3
            for index, wall in zip(starts, walls, strict=True)
        ]
        assert 0.99 * min(unprofiled) <= predicted <= 1.01 * stretch * max(walls), (
            predicted,
            unprofiled,
            walls,
        )
    else:  # the replay recomputes the waits recorded in ops, and joins the ranks' clocks and collectives
        assert predicted <= 1.25 * stretch * max(walls), (predicted, walls)
    assert report["error_pct"]["step_ms"] == pytest.approx(100 * abs(predicted - measured) / measured)
