"""Horovod timeline conversion: a real timeline written by Horovod in a one-process run, a small file
in the exact layout Horovod 0.28.1 writes (a fused response of two tensors, then a single one),
an unterminated file, and truncated or corrupt files; and a two-process run under ``horovodrun
--gloo`` whose recorder records the timeline, from which the planner prices gradient groups and
fusion settings, and whose next launch runs a plan with the fusion settings in effect."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qsync_callback.cli import main as qsync_main
from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.planner.tensor_fusion import choose_groups
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.horovod_timeline import load_timeline, read_timeline, tensor_key
from qsync_callback.recorder.trace import load_trace_dir

from tf_launch import EXAMPLE, SHORT_TURNS, run_horovod

MIB = 2**20

START = 1_795_338_642_559_448  # start_time_since_epoch_in_micros
SCOPE = "DistributedGradientTape_Allreduce"
A = f"{SCOPE}/cond/then/_0/{SCOPE}/cond/HorovodAllreduce_a_0"
B = f"{SCOPE}/cond_1/then/_8/{SCOPE}/cond_1/HorovodAllreduce_b_0"


def _timeline_text(terminated: bool = True) -> str:
    """Two steps' records as Horovod writes them: step 1 fuses a and b (one response, through the
    fusion buffer), step 2 runs b alone."""
    head = [
        '{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros":'
        + f"{START}}}}}",
        '{"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}',
        f'{{"name": "process_name", "ph": "M", "pid": 1, "args": {{"name": "{A}"}}}}',
        '{"name": "process_sort_index", "ph": "M", "pid": 1, "args": {"sort_index": 1}}',
    ]
    events = [
        '{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 100, "pid": 1}',
        f'{{"name": "process_name", "ph": "M", "pid": 2, "args": {{"name": "{B}"}}}}',
        '{"name": "process_sort_index", "ph": "M", "pid": 2, "args": {"sort_index": 2}}',
        '{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 150, "pid": 2}',
        '{"ph": "i", "name": "CYCLE_START", "ts": 160, "s": "g"}',
        '{"ph": "E", "ts": 200, "pid": 1}',
        '{"ph": "E", "ts": 201, "pid": 2}',
        '{"ph": "B", "name": "ALLREDUCE", "ts": 210, "pid": 1}',
        '{"ph": "B", "name": "ALLREDUCE", "ts": 211, "pid": 2}',
        '{"ph": "B", "name": "MEMCPY_IN_FUSION_BUFFER", "ts": 215, "pid": 1}',
        '{"ph": "B", "name": "MEMCPY_IN_FUSION_BUFFER", "ts": 215, "pid": 2}',
        '{"ph": "E", "ts": 220, "pid": 1}',
        '{"ph": "E", "ts": 220, "pid": 2}',
        '{"ph": "B", "name": "GLOO_ALLREDUCE", "ts": 221, "pid": 1}',
        '{"ph": "B", "name": "GLOO_ALLREDUCE", "ts": 221, "pid": 2}',
        '{"ph": "E", "ts": 400, "pid": 1}',
        '{"ph": "E", "ts": 400, "pid": 2}',
        '{"ph": "B", "name": "MEMCPY_OUT_FUSION_BUFFER", "ts": 401, "pid": 1}',
        '{"ph": "B", "name": "MEMCPY_OUT_FUSION_BUFFER", "ts": 401, "pid": 2}',
        '{"ph": "E", "ts": 410, "pid": 1}',
        '{"ph": "E", "ts": 410, "pid": 2}',
        '{"ph": "E", "ts": 412, "pid": 1, "args": {"dtype": "float32", "shape": "[32, 64]"}}',
        '{"ph": "E", "ts": 413, "pid": 2, "args": {"dtype": "float32", "shape": "[64]"}}',
        '{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 1000, "pid": 2}',
        '{"ph": "E", "ts": 1050, "pid": 2}',
        '{"ph": "B", "name": "ALLREDUCE", "ts": 1060, "pid": 2}',
        '{"ph": "B", "name": "GLOO_ALLREDUCE", "ts": 1061, "pid": 2}',
        '{"ph": "E", "ts": 1100, "pid": 2}',
        '{"ph": "E", "ts": 1101, "pid": 2, "args": {"dtype": "float32", "shape": "[64]"}}',
    ]
    body = "[\n" + ",\n".join(head) + ",\n" + ",".join(events)
    return body + "]" if terminated else body + ","


def test_fused_response_and_single_tensor_in_horovods_layout(tmp_path):
    path = tmp_path / "timeline.json"
    path.write_text(_timeline_text())
    records = read_timeline(path)
    assert [(tensor_key(r.name), r.response) for r in records] == [
        ("HorovodAllreduce_a_0", 0),
        ("HorovodAllreduce_b_0", 0),
        ("HorovodAllreduce_b_0", 1),
    ]
    a, b, b_alone = records
    assert (a.op, a.start_us, a.end_us) == ("ALLREDUCE", START + 210, START + 412)
    assert a.negotiate_us == (START + 100, START + 200) and b.negotiate_us == (START + 150, START + 201)
    assert [p.name for p in a.phases] == [
        "MEMCPY_IN_FUSION_BUFFER",
        "GLOO_ALLREDUCE",
        "MEMCPY_OUT_FUSION_BUFFER",
    ]
    assert (a.phases[1].start_us, a.phases[1].end_us) == (START + 221, START + 400)
    assert (a.dtype, a.shape, a.bytes) == ("float32", [32, 64], 8192) and b.bytes == 256
    assert [p.name for p in b_alone.phases] == ["GLOO_ALLREDUCE"] and b_alone.key == "HorovodAllreduce_b_0"
    assert b_alone.to_dict() == {
        "response": 1,
        "op_us": [START + 1060, START + 1101],
        "negotiate_us": [START + 1000, START + 1050],
        "phases_us": {"GLOO_ALLREDUCE": [START + 1061, START + 1100]},
    }


def test_unterminated_and_empty_timelines_are_read(tmp_path):
    path = tmp_path / "running.json"
    path.write_text(_timeline_text(terminated=False))  # the run is still writing it
    assert len(read_timeline(path)) == 3
    path.write_text(_timeline_text()[:-1])  # no closing bracket, no trailing comma
    assert len(read_timeline(path)) == 3
    path.write_text("")  # Horovod writes nothing when no collective ran
    assert load_timeline(path) == [] and read_timeline(path) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_timeline_text()[:-60], "truncated or corrupt"),
        (_timeline_text().replace('"ts": 412', '"ts": 4x2'), "truncated or corrupt"),
        ('{"traceEvents": []}', "not a Horovod timeline"),
        ("[1, 2]", "not a Horovod timeline"),
        ('[{"ph": "B", "name": "ALLREDUCE", "pid": 1}]', "malformed Horovod timeline record"),
    ],
)
def test_truncated_or_corrupt_timeline_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "timeline.json"
    path.write_text(text)
    with pytest.raises(QSyncInputError, match=message) as caught:
        read_timeline(path)
    assert str(caught.value).startswith(str(path)) and "\n" not in str(caught.value)
    with pytest.raises(QSyncInputError, match="cannot read the Horovod timeline"):
        read_timeline(tmp_path / "missing.json")


def test_real_timeline_from_a_one_process_horovod_run(tmp_path):
    """Horovod writes the timeline of two all-reduces in a ``tf.function`` (one process: Horovod
    still runs its loop); each is found with its dtype, shape and phases."""
    script = textwrap.dedent(
        """
        import os, sys
        os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"
        import horovod.tensorflow as hvd
        import tensorflow as tf
        hvd.init()

        @tf.function
        def step(a, b):
            return hvd.allreduce(a, name="first"), hvd.allreduce(b, name="second")

        a, b = tf.ones((8, 4)), tf.ones((3,), tf.float64)
        step(a, b)
        hvd.start_timeline(sys.argv[1])
        step(a, b)
        hvd.stop_timeline()
        """
    )
    path = tmp_path / "timeline.json"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    run = subprocess.run(
        [sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    records = {r.key: r for r in read_timeline(Path(path))}
    assert sorted(records) == ["first", "second"]
    first, second = records["first"], records["second"]
    assert (first.dtype, first.shape, first.bytes) == ("float32", [8, 4], 128)
    assert (second.dtype, second.shape, second.bytes) == ("float64", [3], 24)
    assert first.response != second.response  # different dtypes are never fused
    for r in records.values():
        assert r.op == "ALLREDUCE" and "GLOO_ALLREDUCE" in [p.name for p in r.phases]
        assert r.negotiate_us[0] <= r.negotiate_us[1] <= r.start_us < r.end_us
        assert abs(r.start_us / 1e6 - path.stat().st_mtime) < 60  # on the wall clock


def test_two_processes_record_the_timeline_and_plan_from_it(tmp_path, capsys):
    out = tmp_path / "qsync"
    window = ["--warmup-steps", "2", "--profile-steps", "2", "--measure-steps", "2", "--verify-steps", "2"]
    example = [str(EXAMPLE), "--batch-size", "16", "--output-dir", str(out)]
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    run = run_horovod([*example, "--mode", "apply", "--horovod-timeline", *window, *SHORT_TURNS], env)

    traces = load_trace_dir(out / "trace")
    assert sorted(p.name for p in (out / "trace" / "rank0" / "horovod_timeline").iterdir()) == [
        "step3.json",
        "step5.json",
    ]
    assert not (out / "trace" / "rank1" / "horovod_timeline").exists()  # only the coordinator writes
    variables = {"fc1/kernel:0", "fc1/bias:0", "fc2/kernel:0", "fc2/bias:0", "head/kernel:0", "head/bias:0"}
    for trace in traces:
        assert trace.communication["fusion_threshold_bytes"] == 128 * MIB
        tensors = [t for o in trace.ops if o.kind == "comm" for t in o.collective["tensors"]]
        assert {t["variable"] for t in tensors} == variables and all(t["bytes"] > 0 for t in tensors)
        assert all(("timeline" in t) == (trace.rank == 0) for t in tensors)
    assert traces[0].communication["timeline"] == "horovod_timeline"

    # the planner priced gradient groups from the timeline, and the fusion settings for the next launch
    groups = choose_groups(Predictor(traces))
    name = f"gradient groups ({len(groups.plan.buckets)})"
    assert re.search(rf"{re.escape(name)}\s+{groups.prediction.step_ms:.2f} ms predicted", run.stdout)
    plan_file = tmp_path / "groups.json"
    groups.plan.save(plan_file)
    capsys.readouterr()
    assert qsync_main(["predict", str(out / "trace"), "--plan", str(plan_file), "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["step_ms"]
    assert predicted == pytest.approx(groups.prediction.step_ms, rel=1e-6)

    # a plan whose fusion threshold and cycle time the next launch's environment sets is applied
    settings = {"fusion_threshold_bytes": 16 * MIB, "cycle_time_ms": 2.0}
    plan = Plan(fingerprint=traces[0].fingerprint, communication=settings)
    plan.save(tmp_path / "fusion.json")
    env.update({"HOROVOD_FUSION_THRESHOLD": str(16 * MIB), "HOROVOD_CYCLE_TIME": "2"})
    window = ["--warmup-steps", "2", "--profile-steps", "1", "--measure-steps", "0"]
    run = run_horovod([*example, "--mode", "record", "--plan", str(tmp_path / "fusion.json"), *window], env)
    assert "at step 0 (2 communication)" in run.stdout  # both settings in effect
    recorded = load_trace_dir(out / "trace")[0].communication
    assert (recorded["fusion_threshold_bytes"], recorded["cycle_time_ms"]) == (16 * MIB, 2.0)
