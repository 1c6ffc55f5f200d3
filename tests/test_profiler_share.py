"""What recording adds to a step, measured against the run's unprofiled steps (`overhead.py`)."""

import pytest

from qsync_callback.predictor.graph import build_step_graph
from qsync_callback.predictor.replay import replay
from qsync_callback.recorder.event_costs import calibrate_on_steps
from qsync_callback.recorder.trace import Op, Step, Trace

from tracebuilder import op


def _recorded(steps: list[int], op_us: float, overhead_us: float, gap_overhead_us: float) -> Trace:
    """One op a step on the main thread, 10 us after its step's start, and a collective."""
    ops, trace_steps = [], []
    for k in steps:
        start = 1000.0 * k
        trace_steps.append(Step(k, start, start + 10 + op_us + 5))
        shares = {"overhead_us": overhead_us, "gap_overhead_us": gap_overhead_us}
        reduce = {"op": "all_reduce", "numel": 4, "bytes": 16}
        ops += [
            op(len(ops), "aten::mm", "forward", "main", start + 10, op_us, k, **shares),
            op(len(ops) + 1, "gloo:all_reduce", "comm", "comm:0", start + 10, op_us, k, collective=reduce),
        ]
    return Trace(
        rank=0,
        world_size=1,
        device="cpu",
        steps=trace_steps,
        ops=ops,
        profiler_overhead_us={"op": 0.5, "memory": 0.1, "range": 2.0},
    )


def _ops(trace: Trace) -> tuple[list[Op], list[Op]]:
    return [o for o in trace.ops if o.collective is None], [o for o in trace.ops if o.collective]


def test_what_the_steps_show_beyond_the_loops_slows_the_whole_step_in_proportion():
    # recorded steps last 10 + 500 + 5 = 515 us; unprofiled ones 475 us (median): recording added 40 us,
    # the loops account for 10 + 5 of it, the rest (25 us) is 5% of the step less the loops' share
    trace = _recorded([1, 3], op_us=500.0, overhead_us=10.0, gap_overhead_us=5.0)
    figures = calibrate_on_steps(trace, [0.470, 0.475, 0.490])
    assert figures == pytest.approx(
        {"in_step_ms": 0.040, "loops_share_ms": 0.015, "scale": 1.0, "slowdown": 0.05}
    )
    trace.measured["profiler_share"] = figures
    mm, collectives = _ops(trace)
    assert [trace.own_us(op) for op in mm] == pytest.approx([490 * 0.95, 490 * 0.95])
    assert [trace.gap_overhead_us(op) for op in mm] == pytest.approx([5.0, 5.0])
    assert [trace.gap_kept(op) for op in mm] == pytest.approx([0.95, 0.95])
    assert [trace.own_us(op) for op in collectives] == pytest.approx([500.0, 500.0])
    assert [trace.gap_kept(op) for op in collectives] == [1.0, 1.0]
    # the replay of a recorded step is then the unprofiled steps' time (its 5 us tail after the last
    # op is no op's gap, and stays)
    main_only = Trace(rank=0, world_size=1, device="cpu", steps=trace.steps[:1], ops=mm[:1])
    main_only.measured["profiler_share"] = figures
    assert replay(build_step_graph(main_only, 1)).step_us == pytest.approx((10 - 5) * 0.95 + 490 * 0.95 + 5)


def test_steps_that_show_less_than_the_loops_scale_the_loops_down():
    trace = _recorded([1, 3], op_us=500.0, overhead_us=10.0, gap_overhead_us=5.0)
    trace.measured["profiler_share"] = calibrate_on_steps(trace, [0.509, 0.400, 0.600])  # 6 us of 15
    assert trace.measured["profiler_share"]["scale"] == pytest.approx(0.4)
    assert trace.measured["profiler_share"]["slowdown"] == 0.0
    mm, _ = _ops(trace)
    assert [trace.own_us(op) for op in mm] == pytest.approx([496.0, 496.0])
    assert [trace.gap_overhead_us(op) for op in mm] == pytest.approx([2.0, 2.0])
    # none at all when the recorded steps ran faster than the unprofiled ones: they run longer instead
    faster = calibrate_on_steps(trace, [0.600])
    assert faster["scale"] == 0.0 and faster["slowdown"] == pytest.approx(-0.085 / 0.515)


def test_without_unprofiled_steps_or_a_share_the_loops_costs_stay():
    trace = _recorded([1, 3], op_us=500.0, overhead_us=10.0, gap_overhead_us=5.0)
    figures = calibrate_on_steps(trace, [])
    assert figures == {"in_step_ms": None, "loops_share_ms": 0.015, "scale": 1.0, "slowdown": 0.0}
    trace.measured["profiler_share"] = figures
    assert trace.own_us(trace.ops[0]) == 490.0
    # no loops' share at all (no event counted): what the steps show is all slowdown
    trace = _recorded([1], op_us=500.0, overhead_us=0.0, gap_overhead_us=0.0)
    assert calibrate_on_steps(trace, [0.3]) == pytest.approx(
        {"in_step_ms": 0.215, "loops_share_ms": 0.0, "scale": 1.0, "slowdown": 0.215 / 0.515}
    )
    # ... and recorded steps faster than the unprofiled ones, with no loops' share, lengthen the step
    # to theirs (a Horovod rank whose calibration found no per-event cost once divided by that 0 here)
    figures = calibrate_on_steps(trace, [0.9])
    assert figures == pytest.approx(
        {"in_step_ms": -0.385, "loops_share_ms": 0.0, "scale": 1.0, "slowdown": -0.385 / 0.515}
    )
    trace.measured["profiler_share"] = figures
    assert trace.own_us(trace.ops[0]) == pytest.approx(500.0 * 0.9 / 0.515)
    main_only = Trace(rank=0, world_size=1, device="cpu", steps=trace.steps, ops=_ops(trace)[0])
    main_only.measured["profiler_share"] = figures
    assert replay(build_step_graph(main_only, 1)).step_us == pytest.approx(900.0, rel=0.02)
    # a trace with no recorded step, or one whose recorded step took no time, changes nothing
    empty = Trace(rank=0, world_size=1, device="cpu", steps=[], ops=[])
    assert calibrate_on_steps(empty, [0.5]) == {
        "in_step_ms": None,
        "loops_share_ms": 0.0,
        "scale": 1.0,
        "slowdown": 0.0,
    }
    instant = Trace(rank=0, world_size=1, device="cpu", steps=[Step(1, 0.0, 0.0)], ops=[])
    assert calibrate_on_steps(instant, [0.5]) == {
        "in_step_ms": -0.5,
        "loops_share_ms": 0.0,
        "scale": 1.0,
        "slowdown": 0.0,
    }
    # a trace without the figures (an older one) takes the loops' costs as they are
    trace = _recorded([1], op_us=500.0, overhead_us=10.0, gap_overhead_us=5.0)
    assert (trace.own_us(trace.ops[0]), trace.gap_overhead_us(trace.ops[0])) == (490.0, 5.0)
