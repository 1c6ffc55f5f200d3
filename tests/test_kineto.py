"""Trace conversion on a small hand-written Kineto trace: collectives and their launch and wait ops."""

from qsync_callback.recorder.kineto import convert_kineto

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
