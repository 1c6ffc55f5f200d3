"""The Horovod + TensorFlow Recorder in real training: one process in this process (``hvd.init()``
works without a launcher), two processes under ``horovodrun --gloo`` running the example; bad
input; faults, after which training goes on and no profiler session is left running."""

import json
import math
import os
import re
import shutil
import warnings

import horovod.tensorflow as hvd
import pytest
import tensorflow as tf

from qsync_callback.cli import main as qsync_main
from qsync_callback.integrations.horovod_tf import Recorder, patch_horovod, profile
from qsync_callback.recorder.trace import load_trace_dir

from keras_steps import mlp_and_step
from report_checks import assert_prediction_replays_the_recorded_steps
from tf_launch import EXAMPLE, run_horovod

WINDOW = {"warmup_steps": 2, "profile_steps": 2, "measure_steps": 3}
RECORDED = [3, 5]  # warm-up session at call 1, settle at 2, recorded every other call from 3
CALLS = 10  # the report comes at the start of the call after the last measured one (5 + 3 + 1)


@pytest.fixture(scope="module")
def keras():
    """An initialized Horovod, a small Keras model and its traced train step."""
    hvd.init()
    model, optimizer, train_step = mlp_and_step(32, 16, distributed=True)
    batch = (tf.random.normal((8, 16)), tf.zeros((8,), tf.int32))
    return model, optimizer, train_step, batch


def _no_profiler_running():
    with pytest.raises(tf.errors.UnavailableError):
        tf.profiler.experimental.stop()


def _qsync_warnings(caught):
    return [str(w.message) for w in caught if "qsync Recorder" in str(w.message)]


def _run(step, batch, calls=CALLS, on_call=None):
    """Call ``step`` ``calls`` times; returns the results and the recorder's warnings."""
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(calls):
            if on_call is not None:
                on_call(k)
            results.append(step(*batch))
    return results, _qsync_warnings(caught)


def _finite_loss(value):
    return isinstance(value, tf.Tensor) and math.isfinite(float(value))


# ----------------------------------------------------------------------------- one process


@pytest.fixture(scope="module")
def recorded(keras, tmp_path_factory):
    """A dPRO-style script (``hvd.Recorder``, ``@hvd.profile``) recorded and reported in this process."""
    model, optimizer, train_step, batch = keras
    out = tmp_path_factory.mktemp("hvd_tf") / "qsync"
    patch_horovod()
    recorder = hvd.Recorder(model=model, batch_size=8, output_dir=out, optimizer=optimizer, **WINDOW)
    returned = []

    @hvd.profile(recorder)
    def step(x, y):
        result = (train_step(x, y), object())
        returned.append(result)
        return result

    results, warned = _run(step, batch)
    return recorder, out, results, returned, warned


def test_patch_horovod_hangs_recorder_and_profile_on_horovod():
    patch_horovod()
    assert hvd.Recorder is Recorder and hvd.profile is profile


def test_step_results_come_back_unchanged(recorded):
    recorder, _, results, returned, warned = recorded
    assert warned == [] and recorder.failure is None and recorder.finished
    assert len(results) == CALLS and all(r is s for r, s in zip(results, returned, strict=True))
    assert all(_finite_loss(loss) for loss, _ in results)
    _no_profiler_running()


def test_one_process_writes_its_trace_and_raw_profiles(recorded, keras):
    recorder, out, _, _, _ = recorded
    model = keras[0]
    (trace,) = load_trace_dir(out / "trace")
    assert (trace.rank, trace.world_size, trace.framework, trace.device) == (0, 1, "tensorflow", "cpu")
    assert [s.index for s in trace.steps] == RECORDED
    assert [layer["name"] for layer in trace.layers] == ["hidden", "head"]
    assert {op.kind for op in trace.ops} == {"forward", "backward", "update"}
    assert any(op.thread.startswith("tid:") for op in trace.ops)
    weights = sum(w.numpy().nbytes for w in model.trainable_weights)
    assert trace.resident_bytes["parameters"] == weights
    assert trace.resident_bytes["optimizer_state"] > weights  # momentum slots and the iteration count
    # timed: call 0 and 1 are not (tracing, warm-up session), 2 settles; 4, then 6, 7, 8 after the window
    assert len(trace.measured["step_ms"]) == 4 and all(t > 0 for t in trace.measured["step_ms"])
    assert trace.fingerprint["batch_shapes"] == [[8, 16], [8]] and trace.fingerprint["batch_size"] == 8
    assert trace.fingerprint["layers"] == ["hidden", "head"] and trace.fingerprint["world_size"] == 1
    raw = out / "trace" / "rank0" / trace.raw_trace
    assert sorted(p.name for p in raw.iterdir()) == [f"step{k}" for k in RECORDED]
    assert all(list((raw / f"step{k}").rglob("*.xplane.pb")) for k in RECORDED)
    # the profiler's cost per event, calibrated before the window, is charged to the recorded ops,
    # never more than the step (the replay subtracts it); on these 0.5 ms steps the calibration's
    # noise has taken it just past half the step in a whole-suite run, so half is no bound here
    assert set(trace.profiler_overhead_us) == {"op", "executor", "other"}
    assert all(0 <= c < 100 for c in trace.profiler_overhead_us.values())
    for step in trace.steps:
        charged = sum(op.overhead_us + op.gap_overhead_us for op in trace.ops if op.step == step.index)
        assert charged < step.dur_us
        assert (charged > 0) == any(trace.profiler_overhead_us.values())
    # what recording added beyond the per-event costs, from the timed calls (`calibrate_on_steps`)
    share = trace.measured["profiler_share"]
    assert share["loops_share_ms"] >= 0 and share["in_step_ms"] is not None
    assert 0 <= share["scale"] <= 1 and share["slowdown"] < 1
    assert (share["slowdown"] < 0) == (share["in_step_ms"] < 0)
    # every session on one clock: the recorded steps in call order, in this run's wall-clock time
    assert trace.steps[0].end_us < trace.steps[1].start_us
    assert abs(trace.steps[0].start_us / 1e6 - (out / "report.json").stat().st_mtime) < 60


def test_one_process_report_matches_the_lightning_report(recorded):
    recorder, out, _, _, _ = recorded
    report = json.loads((out / "report.json").read_text())
    assert report == json.loads(json.dumps(recorder.report))
    assert report["world_size"] == 1 and report["framework"] == f"tensorflow {tf.__version__}"
    assert report["recorded_steps"] == RECORDED and report["measured"]["step_ms_samples"] == 4
    assert_prediction_replays_the_recorded_steps(report, load_trace_dir(out / "trace"))
    assert report["predicted"]["critical_path_share"]["compute"] > 0  # the step waits for TF's threads
    # TF's allocator's own peaks (this model's tensors are all under the 256 KiB it counts: none is
    # allocated in the step, so the prediction is the bytes in use when the window opened)
    (trace,) = load_trace_dir(out / "trace")
    assert report["measured"]["peak_bytes"] == max(trace.measured["step_peak_bytes"])
    assert trace.memory_events == [] and trace.allocator["name"] == "mklcpu"
    assert report["predicted"]["peak_bytes"] == trace.allocator["in_use_bytes"]
    assert {row["kind"] for row in report["ops"]} <= {"forward", "backward", "update"}


def test_qsync_report_and_predict_read_the_traces(recorded, capsys):
    _, out, _, _, _ = recorded
    capsys.readouterr()
    assert qsync_main(["report", str(out / "trace"), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("qsync report: tensorflow") and "world size 1" in text
    assert qsync_main(["predict", str(out / "trace"), "--json"]) == 0
    prediction = json.loads(capsys.readouterr().out)
    report = json.loads((out / "report.json").read_text())
    assert prediction["step_ms"] == pytest.approx(report["predicted"]["step_ms"])


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_at_decoration_time(keras, tmp_path):
    train_step = keras[2]
    recorder = Recorder(output_dir=tmp_path)
    with pytest.raises(TypeError, match="decorates the train step function, not int"):
        profile(recorder)(42)
    with pytest.raises(TypeError, match=r"takes a Recorder \(use @profile\(recorder\)\), not function"):
        profile(lambda: None)
    profile(recorder)(train_step)
    with pytest.raises(ValueError, match="already profiles another train step"):
        profile(recorder)(lambda: None)
    with pytest.raises(ValueError, match="mode:? must be one of record, report, apply"):
        Recorder(mode="replay")
    with pytest.raises(ValueError, match="warmup_steps:? must be an integer of at least 2, not 1"):
        Recorder(warmup_steps=1)
    with pytest.raises(ValueError, match="warmup_steps:? must be an integer of at least 2, not 2.5"):
        Recorder(warmup_steps=2.5)
    with pytest.raises(ValueError, match="batch_size:? must be an integer of at least 1, not 0"):
        Recorder(batch_size=0)
    with pytest.raises(ValueError, match="levers:? must be some of"):
        Recorder(levers=("xla",))
    with pytest.raises(TypeError, match="model: must be a Keras model, not str"):
        Recorder(model="resnet")


def test_recorder_used_before_hvd_init_warns_once_and_steps_aside(keras, tmp_path):
    hvd.shutdown()
    try:
        recorder = Recorder(output_dir=tmp_path / "q", **WINDOW)
        step = profile(recorder)(lambda x: 2 * x)
        results, warned = _run(step, (21,))
    finally:
        hvd.init()
    assert results == [42] * CALLS
    assert len(warned) == 1 and "call hvd.init() before the first train step" in warned[0]
    assert recorder.finished and not (tmp_path / "q").exists()


# ----------------------------------------------------------------------------- faults


def test_profiler_that_fails_to_start_leaves_the_users_session_alone(keras, tmp_path):
    _, _, train_step, batch = keras
    recorder = Recorder(output_dir=tmp_path / "q", **WINDOW)
    step = profile(recorder)(train_step)
    tf.profiler.experimental.start(str(tmp_path / "user"))  # the user's own session
    try:
        results, warned = _run(step, batch)
    finally:
        tf.profiler.experimental.stop()  # still running: the recorder did not stop it
    assert all(_finite_loss(loss) for loss in results)
    assert len(warned) == 1 and "Another profiler is running" in warned[0]
    assert recorder.finished and not (tmp_path / "q" / "report.json").exists()
    assert not (tmp_path / "q" / "trace" / "rank0" / "trace.json").exists()
    _no_profiler_running()


def test_trace_that_cannot_be_written_warns_and_training_goes_on(keras, tmp_path):
    _, _, train_step, batch = keras
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    recorder = Recorder(output_dir=blocker / "qsync", **WINDOW)
    results, warned = _run(profile(recorder)(train_step), batch)
    assert all(_finite_loss(loss) for loss in results)
    assert len(warned) == 1 and str(blocker) in warned[0]
    assert recorder.finished and recorder.failure is not None
    _no_profiler_running()


def test_profile_lost_mid_window_stops_the_profiler(keras, tmp_path):
    """The profile's folder turns into a file during the first recorded step: its session cannot be
    saved; the recorder warns once, steps aside with no session left, and the steps go on."""
    _, _, train_step, batch = keras
    recorder = Recorder(output_dir=tmp_path / "q", **WINDOW)
    profile_dir = tmp_path / "q" / "trace" / "rank0" / "profile"

    def block(call):
        if call == RECORDED[0]:
            shutil.rmtree(profile_dir)
            profile_dir.write_text("")

    results, warned = _run(profile(recorder)(train_step), batch, on_call=block)
    assert all(_finite_loss(loss) for loss in results)
    assert len(warned) == 1 and "is not a directory" in warned[0]
    assert recorder.finished and not (tmp_path / "q" / "trace" / "rank0" / "trace.json").exists()
    _no_profiler_running()


def test_step_that_raises_in_the_window_stops_the_profiler_and_propagates(keras, tmp_path):
    _, _, train_step, batch = keras
    recorder = Recorder(output_dir=tmp_path / "q", **WINDOW)
    calls = []

    @profile(recorder)
    def step(x, y):
        calls.append(None)
        if len(calls) - 1 == RECORDED[0]:
            raise RuntimeError("the user's step failed")
        return train_step(x, y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(RECORDED[0]):
            step(*batch)
        with pytest.raises(RuntimeError, match="the user's step failed"):
            step(*batch)
        _no_profiler_running()
        after = [step(*batch) for _ in range(3)]
    warned = _qsync_warnings(caught)
    assert len(warned) == 1 and "RuntimeError: the user's step failed" in warned[0]
    assert all(_finite_loss(loss) for loss in after) and recorder.finished


# ----------------------------------------------------------------------------- two processes


def test_two_processes_under_horovodrun_record_and_report(tmp_path, capsys):
    out = tmp_path / "qsync"
    example = [str(EXAMPLE), "--steps", str(CALLS + 2), "--batch-size", "16"]
    example += [
        "--warmup-steps",
        "2",
        "--profile-steps",
        "2",
        "--measure-steps",
        "3",
        "--output-dir",
        str(out),
    ]
    run = run_horovod(example)
    assert "qsync report: tensorflow" in run.stdout and "world size 2" in run.stdout
    # by default each process gets cores / processes TF threads, all its threads on a share of the
    # cores of its own (--pin all)
    said = dict(re.findall(r"rank (\d): TF threads (.*)", run.stdout))
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert set(said) == {"0", "1"} and all(
        t.startswith(f"{share} intra-op, {share} inter-op") for t in said.values()
    )
    if len(os.sched_getaffinity(0)) >= 2:
        pinned = [
            set(re.search(r"all threads pinned to cores \[(.*)\]", t).group(1).split(", "))
            for t in said.values()
        ]
        assert all(pinned) and not pinned[0] & pinned[1]

    traces = load_trace_dir(out / "trace")
    assert [t.rank for t in traces] == [0, 1] and {t.world_size for t in traces} == {2}
    assert traces[0].host == traces[1].host
    # Horovod's timeline is opt-in (a core on rank 0 for the whole run): not asked for, not recorded,
    # and the trace says why, with no warning
    assert traces[0].communication["timeline"] is None
    assert "record_horovod_timeline()" in traces[0].communication["timeline_note"]
    assert "timeline is not recorded" not in run.stderr
    for trace in traces:
        assert [s.index for s in trace.steps] == RECORDED
        assert [layer["name"] for layer in trace.layers] == ["fc1", "fc2", "head"]
        assert len(trace.measured["step_ms"]) == 4
        for step in RECORDED:
            comms = [op for op in trace.ops if op.step == step and op.kind == "comm"]
            assert len(comms) == 6 and all(op.collective["op"] == "all_reduce" for op in comms)
            assert all(len(op.collective["tensors"]) == 1 and op.collective["bytes"] > 0 for op in comms)
            assert sorted({op.layer for op in comms}) == ["fc1", "fc2", "head"]
        assert sorted(p.name for p in (out / "trace" / f"rank{trace.rank}" / "profile").iterdir()) == [
            f"step{k}" for k in RECORDED
        ]
    # one clock: the ranks met right before each recorded step
    for a, b in zip(traces[0].steps, traces[1].steps, strict=True):
        assert abs(a.start_us - b.start_us) < 0.5 * max(a.dur_us, b.dur_us) + 20_000

    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2 and report["recorded_steps"] == RECORDED
    assert_prediction_replays_the_recorded_steps(report, traces)
    assert len(report["predicted"]["per_rank_peak_bytes"]) == 2
    assert qsync_main(["report", str(out / "trace")]) == 0
    assert "world size 2" in capsys.readouterr().out
    assert qsync_main(["predict", str(out / "trace")]) == 0
    assert capsys.readouterr().out.startswith("predicted step time")
