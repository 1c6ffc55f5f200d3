"""Bad input: trace directories that are missing, truncated or not ours, and bad plans.

Each gives one clear line naming the file, exit code 2 from the CLI and no traceback."""

import json
import subprocess
import sys

import pytest

from qsync_callback.cli import main
from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.predictor.predict import predict
from qsync_callback.recorder.trace import load_trace_dir, rank_trace_path

from tracebuilder import op, trace


@pytest.fixture
def trace_dir(tmp_path):
    t = trace(
        [op(0, "aten::linear", "forward", "main", 0, 10, layer="fc")],
        step_end=12,
        layers=[{"name": "fc", "type": "Linear", "param_bytes": 4}],
        measured={"step_ms": [0.012, 0.013, 0.011], "peak_bytes": 100},
    )
    t.save(rank_trace_path(tmp_path, 0))
    return tmp_path


def _run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_report_on_a_good_trace(trace_dir, capsys):
    code, out, err = _run_cli(capsys, "report", str(trace_dir))
    assert code == 0 and "qsync report" in out and "predicted 0.01 ms" in out


def test_predict_json_on_a_good_trace(trace_dir, capsys):
    code, out, _ = _run_cli(capsys, "predict", str(trace_dir), "--json")
    assert code == 0
    assert json.loads(out)["step_ms"] == pytest.approx(0.012)


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda p: p.unlink(), "no rank*/trace.json inside"),
        (lambda p: p.write_text(p.read_text()[:40]), "invalid JSON at line 1"),
        (lambda p: p.write_text(""), "trace file is empty"),
        (lambda p: p.write_text('{"traceEvents": []}'), "not a qsync trace"),
        (
            lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "version": 99})),
            "trace version 99",
        ),
        (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "steps": []})), "no recorded steps"),
    ],
)
def test_damaged_trace_gives_one_line_and_exit_code_2(trace_dir, capsys, damage, expected):
    path = rank_trace_path(trace_dir, 0)
    damage(path)
    code, out, err = _run_cli(capsys, "report", str(trace_dir))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and expected in err and "Traceback" not in err


def test_missing_directory_and_missing_rank(tmp_path, trace_dir):
    with pytest.raises(QSyncInputError, match="no such trace directory"):
        load_trace_dir(tmp_path / "nope")
    data = json.loads(rank_trace_path(trace_dir, 0).read_text())
    data["world_size"] = 2
    rank_trace_path(trace_dir, 0).write_text(json.dumps(data))
    with pytest.raises(QSyncInputError, match=r"traces of ranks \[1\] are missing"):
        load_trace_dir(trace_dir)


def test_plan_for_other_layers_is_refused(trace_dir, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    Plan(precision={"not_a_layer": "fp16"}).save(plan_path)
    code, _, err = _run_cli(capsys, "predict", str(trace_dir), "--plan", str(plan_path))
    assert code == 2 and "not_a_layer" in err and str(plan_path) in err


def test_plan_decisions_not_priced_yet_are_refused_not_ignored(trace_dir):
    traces = load_trace_dir(trace_dir)
    with pytest.raises(QSyncInputError, match="activation decisions cannot be priced yet"):
        predict(traces, Plan(activation={"fc": "offload"}))
    with pytest.raises(QSyncInputError, match="no per-precision costs"):
        predict(traces, Plan(precision={"fc": "fp16"}))
    assert predict(traces, Plan.empty()).step_ms == pytest.approx(0.012)


def test_cli_entry_point_runs_as_a_command(trace_dir):
    result = subprocess.run(
        [sys.executable, "-m", "qsync_callback.cli", "report", str(trace_dir / "x")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("qsync: error: ") and "Traceback" not in result.stderr


def test_plan_for_another_run_is_refused(trace_dir):
    traces = load_trace_dir(trace_dir)
    traces[0].fingerprint = {"model": "abc", "world_size": 1}
    with pytest.raises(QSyncInputError, match="made for another run.*world_size: plan made for 2, run has 1"):
        predict(traces, Plan(fingerprint={"model": "abc", "world_size": 2}), plan_source="p.json")


def test_report_notes_page_fault_noise_only_when_there_is_some(trace_dir, capsys):
    code, out, _ = _run_cli(capsys, "report", str(trace_dir))
    assert code == 0 and "page faults" not in out
    path = rank_trace_path(trace_dir, 0)
    data = json.loads(path.read_text())
    data["measured"].update(page_faults=[2000, 2100, 1900], page_size=4096)
    path.write_text(json.dumps(data))
    code, out, _ = _run_cli(capsys, "report", str(trace_dir))
    assert code == 0 and "2000 page faults per step (7.8 MiB of fresh pages)" in out
