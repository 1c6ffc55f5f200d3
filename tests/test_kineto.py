"""Trace conversion on small hand-written Kineto traces: collectives and their launch and wait ops, layer
ranges, the overhead charged per event and the calibration loops' event counts."""

from qsync_callback.recorder.kineto import calibration_event_counts, convert_kineto

MAIN, GLOO = 1, 2


def _x(name, ts, dur, tid=MAIN, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace():
    bucket = {"Input Dims": [[1000]], "Input type": ["float"]}
    return {
        "traceEvents": [
            _x("qsync::step#3", 0, 200, cat="user_annotation"),
            _x("autograd::engine::evaluate_function: AddmmBackward0", 10, 20),
            # the all-reduce is launched from AccumulateGrad ...
            _x("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 35, 10),
            _x("c10d::allreduce_", 38, 4),
            # ... but gloo's thread starts it while the next backward op already runs
            _x("autograd::engine::evaluate_function: AddmmBackward0", 50, 60),
            _x("gloo:all_reduce", 55, 120, tid=GLOO, cat="user_annotation", **bucket),
            # DDP waits for the bucket, then copies it back into the gradients
            _x("torch.distributed.ddp.reducer::copy_bucket_to_grad", 150, 5),
            _x("aten::copy_", 151, 3, **bucket),
            _x("Optimizer.step#SGD.step", 160, 30, cat="user_annotation"),
            _x("aten::add_", 165, 20),
        ]
    }


def test_collective_depends_on_the_op_that_launched_it_and_is_waited_for():
    converted = convert_kineto(_trace())
    ops = {op.name: op for op in converted["ops"]}
    comm = ops["gloo:all_reduce"]
    launcher = next(op for op in converted["ops"] if "AccumulateGrad" in op.name)
    assert comm.kind == "comm" and comm.collective["numel"] == 1000
    assert comm.deps == [launcher.id]
    copy = ops["torch.distributed.ddp.reducer::copy_bucket_to_grad"]
    assert copy.deps == [comm.id]
    # cut at the waiting op's start: the data had arrived by then
    assert comm.dur_us == 150 - 55
    assert [op.kind for op in converted["ops"] if op.thread == "main"] == [
        "backward",
        "backward",
        "backward",
        "other",
        "update",
    ]


def test_two_buckets_started_out_of_order_on_gloos_two_threads_keep_their_own_launchers():
    """Gloo runs collectives on two threads: the second bucket may start first. Each keeps the op
    that launched it (matched by element count)."""
    first, second = {"Input Dims": [[1000]]}, {"Input Dims": [[3000]]}
    raw = {
        "traceEvents": [
            _x("qsync::step#3", 0, 300, cat="user_annotation"),
            _x("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 10, 10),
            _x("c10d::allreduce_", 12, 4, **{"Input Dims": [[[1000]], []]}),
            _x("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 30, 10),
            _x("c10d::allreduce_", 32, 4, **{"Input Dims": [[[3000]], []]}),
            _x("gloo:all_reduce", 40, 100, tid=GLOO + 1, cat="user_annotation", **second),
            _x("gloo:all_reduce", 60, 90, tid=GLOO, cat="user_annotation", **first),
            _x("torch.distributed.ddp.reducer::copy_bucket_to_grad", 160, 5),
            _x("aten::copy_", 161, 3, **first),
            _x("torch.distributed.ddp.reducer::copy_bucket_to_grad", 170, 5),
            _x("aten::copy_", 171, 3, **second),
            _x("aten::add_", 200, 20),
        ]
    }
    ops = convert_kineto(raw)["ops"]
    launchers = [op for op in ops if "AccumulateGrad" in op.name]
    comms = {op.collective["numel"]: op for op in ops if op.kind == "comm"}
    assert comms[1000].deps == [launchers[0].id] and comms[3000].deps == [launchers[1].id]
    copies = [op for op in ops if "copy_bucket_to_grad" in op.name]
    assert comms[1000].id in copies[0].deps  # the first bucket's copy back waits for it


def _i(ts, tid=MAIN, nbytes=64):
    args = {"Bytes": nbytes, "Addr": 1, "Device Type": 0, "Total Allocated": 64}
    return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "tid": tid, "ts": ts, "args": args}


def test_layer_ranges_recorded_as_cpu_ops_are_context_and_charged_as_ranges():
    raw = {
        "traceEvents": [
            _x("qsync::step#1", 0, 100, cat="user_annotation"),
            _x("qsync::layer::fc", 5, 40),  # a _RecordFunctionFast range: Kineto writes it as a cpu_op
            _x("aten::linear", 10, 30, **{"Sequence number": 4}),
            _x("aten::addmm", 12, 20),
            _i(13),
            _x("Optimizer.step#SGD.step", 50, 30, cat="user_annotation"),
            _x("aten::add_", 55, 20),
        ]
    }
    costs = {"op": 1.0, "memory": 0.5, "range": 7.0}
    ops = {op.name: op for op in convert_kineto(raw, overhead_us=costs)["ops"]}
    assert list(ops) == ["aten::linear", "aten::add_"]
    assert ops["aten::linear"].layer == "fc"
    # the step's and the layer's ranges opened before the op and its own event: its gap; the nested
    # addmm and allocation: its duration
    assert ops["aten::linear"].gap_overhead_us == 1.0 + 7.0 + 1.0
    assert ops["aten::linear"].overhead_us == 1.0 + 0.5
    # a user annotation the run opens anyway costs what an op event costs
    assert ops["aten::add_"].gap_overhead_us == 1.0 + 1.0


def test_calibration_event_counts_are_per_loop_range_and_thread():
    raw = {
        "traceEvents": [
            _x("qsync::calibration", 0, 100, cat="user_annotation"),
            _x("qsync::calibration::op", 0, 30, cat="user_annotation"),
            _x("aten::add_", 1, 5),
            _x("aten::to", 2, 2),
            _i(3),
            _x("aten::add_", 10, 5, tid=GLOO),  # another thread's
            _x("qsync::calibration::range", 40, 30, cat="user_annotation"),
            _x("qsync::layer::calibration", 41, 5),
            _x("qsync::layer::calibration", 51, 5),
            _x("aten::add_", 80, 5),  # after the loops
        ]
    }
    assert calibration_event_counts(raw) == {"op": {"op": 2, "memory": 1}, "range": {"range": 2}}
