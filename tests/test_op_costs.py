"""A symbolic trace's ops priced on a roofline or by the learned model (`predictor/op_costs.py`), on
hand-made traces."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_callback.predictor.op_cost_model import HostTime, OpCostModel
from qsync_callback.predictor.op_costs import op_us, priced
from qsync_callback.recorder.op_samples import OpSample
from qsync_callback.recorder.trace import Op, Step, Trace

from tracebuilder import op_samples

COSTS = {"op_us": 2.0, "bytes_per_us": 64.0, "flops_per_us": {"float": 100.0, "c10::BFloat16": 400.0}}


def _op(i, name="aten::add", shapes=((4, 8),), dtypes=("float",), flops=0.0, nbytes=0):
    return Op(
        i, name, "forward", "main", float(i), 1.0, 1,
        input_shapes=[list(s) for s in shapes], input_dtypes=list(dtypes), flops=flops, bytes=nbytes,
    )  # fmt: skip


def test_an_op_costs_the_per_op_time_and_the_larger_of_its_flops_and_its_bytes():
    assert op_us(_op(0, flops=800), COSTS) == 2.0 + max(800 / 100, 128 / 64)  # compute: 10 us
    assert op_us(_op(0, nbytes=128), COSTS) == 2.0 + (128 + 128) / 64  # read and written: 6 us
    # the rate of its first floating-point input's dtype; a long index input does not count
    bf16 = _op(0, shapes=((4,), (4, 8)), dtypes=("long int", "c10::BFloat16"), flops=800)
    assert op_us(bf16, COSTS) == 2.0 + max(800 / 400, (32 + 64) / 64)
    # a dtype with no measured rate takes fp32's
    assert op_us(_op(0, dtypes=("c10::Half",), flops=8000), COSTS) == 2.0 + 8000 / 100
    assert op_us(_op(0, shapes=((),), dtypes=("float",)), COSTS) == 2.0  # a scalar moves nothing counted
    # FLOPs on integer inputs alone: at fp32's rate
    assert op_us(_op(0, shapes=((1,),), dtypes=("long int",), flops=8000), COSTS) == 2.0 + 8000 / 100


def test_ops_run_one_after_another_and_memory_moves_with_them():
    ops = [_op(0, flops=800), _op(1, nbytes=128)]
    trace = Trace(0, 1, "cpu", [Step(1, 0.0, 2.0)], ops, memory_events=[[1.0, 1, 128, 1], [1.5, 1, -128, 1]])
    out = priced(trace, COSTS)
    assert [(op.start_us, op.dur_us) for op in out.ops] == [(0.0, 10.0), (10.0, 6.0)]
    assert out.memory_events == [[10.0, 1, 128, 1], [13.0, 1, -128, 1]]  # halfway through op 1
    assert out.steps[0].end_us == 16.0
    assert trace.ops[0].dur_us == 1.0 and trace.memory_events[0][0] == 1.0  # the trace given is unchanged
    assert out.symbolic["durations"].startswith("predicted by this machine's roofline")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 4096)), min_size=1, max_size=12),
    st.lists(st.floats(0, 0.99), max_size=8),
)
def test_priced_ops_tile_the_step_and_each_event_stays_inside_its_op(figures, fractions):
    ops = [_op(i, flops=float(f), nbytes=b) for i, (f, b) in enumerate(figures)]
    events = [[k % len(ops) + x, k, 64, k % len(ops)] for k, x in enumerate(fractions)]
    out = priced(Trace(0, 1, "cpu", [Step(1, 0.0, float(len(ops)))], ops, memory_events=events), COSTS)
    for before, after in zip(out.ops, out.ops[1:], strict=False):
        assert after.start_us == pytest.approx(before.end_us)
    assert out.steps[0].end_us == pytest.approx(out.ops[-1].end_us)
    assert all(op.dur_us == pytest.approx(op_us(op, COSTS)) for op in out.ops)
    for (ts, *_), (new_ts, *_) in zip(events, out.memory_events, strict=True):
        op = out.ops[int(ts)]
        assert op.start_us <= new_ts < op.end_us + 1e-9


def test_the_learned_model_prices_each_op_and_adds_the_host_time_it_fitted():
    host = HostTime(500.0, 4.0, 0.01)  # a step, an op, a byte allocated
    traces = [
        {
            "source": f"hand-made {n}",
            "ops": op_samples(60),
            "steps": [{"ops": n, "out_bytes": b, "ops_us": 100.0 * n, "step_us": 100.0 * n + host.at(n, b)}],
        }
        for n, b in ((2, 4096), (40, 1024), (200, 65536), (90, 0))
    ]
    model = OpCostModel(traces)
    for n, b in ((4, 896), (150, 60000)):
        assert model.host.at(n, b) == pytest.approx(host.at(n, b))
    ops = [
        _op(0, "aten::mm", ((8, 16), (16, 4)), ("float", "float"), flops=2.0 * 8 * 16 * 4, nbytes=128),
        _op(1, "aten::add", ((8, 16), (8, 16)), ("float", "float"), nbytes=512),
        _op(2, "aten::max_pool2d_with_indices", ((2, 4, 8, 8),), nbytes=256),
        _op(3, "aten::bernoulli_", ((8, 16),)),
    ]
    probed = [
        OpSample("aten::bernoulli_", [[8, 16]], ["float"], 0.0, 0, 77.0),
        OpSample("aten::mm", [[8, 16], [16, 4]], ["float", "float"], 0.0, 0, 50.0),
    ]
    events = [[1.5, 1, 512, 1], [2.25, 1, -512, 2]]
    out = priced(Trace(0, 1, "cpu", [Step(1, 0.0, 4.0)], ops, memory_events=events), COSTS, model, probed)
    as_samples = [
        {
            "name": op.name,
            "shapes": op.input_shapes,
            "dtypes": op.input_dtypes,
            "flops": op.flops,
            "out_bytes": op.bytes,
        }
        for op in ops[:3]
    ]
    expected = [*model.predict_us(as_samples), 77.0]  # a type it never saw, at its time alone
    expected[0] = (expected[0] * 50.0) ** 0.5  # a type it knows: the geometric mean of the two
    clock, starts = 0.0, []
    for op, duration in zip(out.ops, expected, strict=True):
        starts.append(clock)
        assert op.start_us == pytest.approx(clock) and op.dur_us == pytest.approx(duration)
        clock += duration
    # and the host's time at its end, for its 4 ops and the 896 bytes they allocate
    assert out.steps[0].end_us == pytest.approx(clock + host.at(4, 128 + 512 + 256))
    assert [e[0] for e in out.memory_events] == pytest.approx(
        [starts[1] + 0.5 * expected[1], starts[2] + 0.25 * expected[2]]
    )
    said = out.symbolic["durations"]
    assert said.startswith("predicted by the learned per-op model")
    assert "timed alone on made-up tensors: aten::bernoulli_;" in said
    assert "; 1 distinct ops of types it knows also timed alone, each at the geometric mean" in said
    assert said.endswith("priced from their features alone: aten::max_pool2d_with_indices")


def test_a_trace_is_priced_at_the_thread_count_it_was_traced_at():
    """A data set recorded at 1 and 2 threads (the same ops, twice as long at 1): a trace traced
    at 1 thread is priced at 1, one at 2 at 2, whatever this process runs at."""
    traces = [
        {
            "source": f"at {threads}",
            "threads": threads,
            "ops": [{**op, "us": op["us"] * slowdown} for op in op_samples(80)],
        }
        for threads, slowdown in ((1, 2.0), (2, 1.0))
    ]
    model = OpCostModel(traces)
    ops = [
        _op(i, "aten::mm", ((64, 128), (128, 32)), ("float", "float"), flops=2.0 * 64 * 128 * 32)
        for i in range(3)
    ]
    steps = {}
    for threads in (1, 2):
        trace = Trace(0, 1, "cpu", [Step(1, 0.0, 3.0)], ops, symbolic={"threads": threads})
        steps[threads] = priced(trace, COSTS, model).ops[0].dur_us
    assert 1.6 < steps[1] / steps[2] < 2.4


def test_at_a_thread_count_the_data_set_never_ran_the_prices_shift_by_what_the_probes_took():
    """A model recorded at 2 threads only, pricing a trace traced at 1 thread: every price it
    gives is scaled by the ops of types it knows timed alone over its prices of them; at 2
    threads, none is."""
    model = OpCostModel([{"source": "at 2", "threads": 2, "ops": op_samples(80)}])
    mm = _op(
        0, "aten::mm", ((64, 128), (128, 32)), ("float", "float"), flops=2.0 * 64 * 128 * 32, nbytes=8192
    )
    add = _op(1, "aten::add", ((64, 32), (64, 32)), ("float", "float"), nbytes=8192)
    as_sample = {"name": "aten::mm", "shapes": mm.input_shapes, "dtypes": mm.input_dtypes, "flops": mm.flops}
    price = model.predict_us([{**as_sample, "out_bytes": mm.bytes}])[0]
    probed = [OpSample("aten::mm", mm.input_shapes, mm.input_dtypes, mm.flops, mm.bytes, 3.0 * price)]
    durations, said = {}, {}
    for threads in (1, 2):
        trace = Trace(0, 1, "cpu", [Step(1, 0.0, 2.0)], [mm, add], symbolic={"threads": threads})
        out = priced(trace, COSTS, model, probed)
        durations[threads], said[threads] = [op.dur_us for op in out.ops], out.symbolic["durations"]
    assert durations[1][0] == pytest.approx(3.0 * price)  # the probe, and the shifted price: the same
    assert durations[1][1] == pytest.approx(3.0 * durations[2][1])  # an op not timed alone, shifted
    assert durations[2][0] == pytest.approx((3.0 * price * price) ** 0.5)  # at 2 threads: the blend
    assert "none at 1 thread(s): its prices times 3.00" in said[1] and "none at" not in said[2]


def test_ops_of_a_dtype_the_model_never_measured_shift_by_what_their_type_took_timed_alone():
    """A model trained on fp32 ops only, pricing a bf16 step (a bf16-mixed Trainer's): a bf16 op's
    price is scaled by what the bf16 ops of its type took timed alone over its prices of them, by
    all the bf16 ops timed alone where none of its type was; fp32 ops keep their prices; a model
    that measured bf16 ops shifts none."""
    fp32 = op_samples(80)
    muls = [{**op, "name": "aten::mul"} for op in fp32 if op["name"] == "aten::add"]
    model = OpCostModel([{"source": "fp32", "threads": 2, "ops": fp32 + muls}])
    bf16 = ("c10::BFloat16", "c10::BFloat16")
    mm = _op(0, "aten::mm", ((64, 128), (128, 32)), bf16, flops=2.0 * 64 * 128 * 32, nbytes=4096)
    mm_other = _op(1, "aten::mm", ((32, 64), (64, 16)), bf16, flops=2.0 * 32 * 64 * 16, nbytes=1024)
    add = _op(2, "aten::add", ((64, 32), (64, 32)), bf16, nbytes=4096)
    mul = _op(3, "aten::mul", ((64, 32), (64, 32)), bf16, nbytes=4096)
    add_fp32 = _op(4, "aten::add", ((64, 32), (64, 32)), ("float", "float"), nbytes=8192)
    ops = [mm, mm_other, add, mul, add_fp32]
    prices = model.predict_us(
        [
            {"name": o.name, "shapes": o.input_shapes, "dtypes": o.input_dtypes, "flops": o.flops}
            | {"out_bytes": o.bytes, "threads": 2}
            for o in ops
        ]
    )
    probed = [
        OpSample(o.name, o.input_shapes, o.input_dtypes, o.flops, o.bytes, ratio * prices[o.id])
        for o, ratio in ((mm, 0.4), (add, 2.0))
    ]
    trace = Trace(0, 1, "cpu", [Step(1, 0.0, 5.0)], ops, symbolic={"threads": 2})
    out = priced(trace, COSTS, model, probed)
    durations = [op.dur_us for op in out.ops]
    assert durations[0] == pytest.approx(0.4 * prices[0])  # its probe and its shifted price agree
    assert durations[1] == pytest.approx(0.4 * prices[1])  # not timed alone: its type's factor
    assert durations[2] == pytest.approx(2.0 * prices[2])
    all_bf16 = (0.4 * prices[0] + 2.0 * prices[2]) / (prices[0] + prices[2])
    assert durations[3] == pytest.approx(all_bf16 * prices[3])  # none of its type timed alone
    assert durations[4] == pytest.approx(prices[4])  # fp32: measured, not shifted
    assert f"c10::BFloat16 times {all_bf16:.2f}" in out.symbolic["durations"]

    measured_bf16 = [{**op, "dtypes": list(bf16)} for op in fp32]
    knows_bf16 = OpCostModel([{"source": "both", "threads": 2, "ops": fp32 + muls + measured_bf16}])
    again = priced(trace, COSTS, knows_bf16, probed)
    unshifted = knows_bf16.predict_us(
        [{"name": o.name, "shapes": o.input_shapes, "dtypes": o.input_dtypes, "flops": o.flops}
         | {"out_bytes": o.bytes, "threads": 2} for o in ops]
    )  # fmt: skip
    assert again.ops[3].dur_us == pytest.approx(unshifted[3])
    assert "dtype measured" not in again.symbolic["durations"]
