"""TensorFlow's peak memory on real recorded windows: the measured peak of each timed step (TF's own
allocator), the profiled steps' allocations as the trace's memory events and the allocator's own
reading of them, the predicted peak calibrated on it against the measured ones, and no figure where
TF keeps no allocator statistics. The simulation and the plans' pricing on hand-made traces:
`tests/test_bfc_allocator.py`."""

import json

import horovod.tensorflow as hvd
import pytest
import tensorflow as tf

from qsync_callback.integrations.horovod_tf import Recorder, profile
from qsync_callback.predictor.bfc_allocator import SMALL_ALLOCATION
from qsync_callback.recorder.trace import load_trace_dir
from qsync_callback.report import format_summary

from keras_steps import mlp_and_step
from tf_launch import EXAMPLE, run_python

# ----------------------------------------------------------------------------- a real window

WINDOW = {"warmup_steps": 3, "profile_steps": 2, "measure_steps": 6}
CALLS = 3 + 1 + 2 * 2 + 6 + 1


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """An MLP whose activations (128 x 1024 floats, 512 KiB) the CPU allocator counts, recorded."""
    hvd.init()
    model, optimizer, train_step = mlp_and_step(1024, 512)
    batch = (tf.random.normal((128, 512)), tf.zeros((128,), tf.int32))
    out = tmp_path_factory.mktemp("tf_memory") / "qsync"
    recorder = Recorder(model=model, batch_size=128, output_dir=out, optimizer=optimizer, **WINDOW)
    step = profile(recorder)(train_step)
    for _ in range(CALLS):
        step(*batch)
    assert recorder.finished and recorder.failure is None
    return out


def test_each_timed_step_has_its_allocator_peak_and_the_largest_is_measured(recorded):
    (trace_,) = load_trace_dir(recorded / "trace")
    peaks = trace_.measured["step_peak_bytes"]
    assert len(peaks) == len(trace_.measured["step_ms"]) > 0
    assert trace_.measured["peak_bytes"] == max(peaks)
    assert "TensorFlow's allocator (CPU:0" in trace_.measured["peak_source"]
    # the weights (2 MiB of them in one counted tensor) and the step's activations
    assert (
        min(peaks) > trace_.allocator["in_use_bytes"] > trace_.resident_bytes["parameters"] - SMALL_ALLOCATION
    )


def test_the_profiled_steps_allocations_are_the_traces_memory_events(recorded):
    (trace_,) = load_trace_dir(recorded / "trace")
    assert trace_.allocator["name"] == "mklcpu" and trace_.allocator["in_use_bytes"] > 0
    ops = {o.id: o for o in trace_.ops}
    allocations = [e for e in trace_.memory_events if e[2] > 0]
    assert allocations and all(abs(e[2]) >= SMALL_ALLOCATION for e in trace_.memory_events)
    assert all(e[3] in ops and ops[e[3]].step is not None for e in allocations)
    steps = {s.index: s for s in trace_.steps}
    assert all(any(s.start_us <= e[0] <= s.end_us for s in steps.values()) for e in trace_.memory_events)
    frees = [e for e in trace_.memory_events if e[2] < 0]
    assert sum(e[3] >= 0 for e in frees) == len(frees)  # each free put on the op that dropped it


def test_the_predicted_peak_is_calibrated_on_the_recorded_steps_own_readings(recorded):
    report = json.loads((recorded / "report.json").read_text())
    measured, predicted = report["measured"], report["predicted"]
    assert measured["peak_steps"] > 0 and measured["peak_bytes_min"] <= measured["peak_bytes_median"]
    assert predicted["peak_bytes"] is not None and "peak_note" not in predicted
    summary = format_summary(report)
    assert predicted["peak_allocator"] == "mklcpu" and "mklcpu allocator counts its chunks" in summary
    assert "-" not in summary.split("memory at peak")[1].splitlines()[0]  # no negative bytes printed
    # the profile's own readings of the allocator in the recorded steps: over the bytes held when
    # the window opened; for the recorded configuration the prediction is that reading, and says so
    (trace_,) = load_trace_dir(recorded / "trace")
    reading = trace_.allocator["recorded_peak_bytes"]
    assert reading > trace_.allocator["in_use_bytes"] and predicted["peak_bytes"] == reading
    assert "calibrated on what the allocator read in the recorded steps" in summary
    assert "for the configuration recorded it is that reading, not a prediction" in summary
    # the simulation alone is the largest of 40 simulated steps: not under the typical measured step,
    # and over the largest of these few measured ones by at most one chunk of the largest request
    # (from empty regions its chunks can fall where TF's did not); the reading, of steps run as the
    # measured ones, lies within the measured steps' range and a chunk
    largest = max(e[2] for e in trace_.memory_events)
    simulated = predicted["peak_bytes_simulated"]
    assert 0.95 * measured["peak_bytes_median"] <= simulated <= measured["peak_bytes"] + 2 * largest
    assert measured["peak_bytes_min"] - largest <= reading <= measured["peak_bytes"] + largest


def test_without_onednn_no_peak_is_measured_or_predicted_and_the_report_says_why(tmp_path):
    out = tmp_path / "qsync"
    args = [str(EXAMPLE), "--model", "mlp", "--steps", "14", "--batch-size", "64", "--output-dir", str(out)]
    args += ["--warmup-steps", "2", "--profile-steps", "2", "--measure-steps", "3"]
    run = run_python(args, env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    report = json.loads((out / "report.json").read_text())
    assert report["measured"]["peak_bytes"] is None
    assert "keeps no statistics" in report["measured"]["peak_source"]
    assert (
        report["predicted"]["peak_bytes"] is None and "no peak predicted" in report["predicted"]["peak_note"]
    )
    assert "peak memory measured n/a" in run.stdout and "predicted n/a" in run.stdout
    assert "note: no peak predicted" in run.stdout
