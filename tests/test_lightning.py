"""QSyncCallback in real Lightning training: 1 process in-process, 2 processes under DDP (gloo)."""

import csv
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback import QSyncCallback
from qsync_callback.recorder.trace import load_trace_dir

from report_checks import assert_prediction_replays_the_recorded_steps

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_lightning.py"


class TinyModel(pl.LightningModule):
    def __init__(self, fail_at_step: int | None = None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
        self.fail_at_step = fail_at_step

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at_step:
            raise RuntimeError("the user's model failed")
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader():
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(512, 32, generator=g), torch.randint(0, 4, (512,), generator=g)),
        batch_size=32,
    )


def _fit(tmp_path, callback, max_steps=20, model=None, logger=False):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[callback],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model or TinyModel(), _loader())
    return trainer


def _check_report(report, world_size, trace_dir):
    assert report["world_size"] == world_size and report["device"] == "cpu"
    measured, predicted = report["measured"], report["predicted"]
    assert measured["step_ms"] > 0 and predicted["step_ms"] > 0
    # accuracy against the measured steps is benchmarks/prediction_accuracy.py's
    assert_prediction_replays_the_recorded_steps(report, load_trace_dir(trace_dir))
    assert predicted["peak_bytes"] == pytest.approx(measured["peak_bytes"], rel=0.05)
    assert report["ops"] and report["ops"][0]["ms_per_step"] > 0
    assert set(predicted["critical_path_share"]) == {"compute", "communication", "host"}
    assert sum(predicted["critical_path_share"].values()) == pytest.approx(1)


def test_one_process_reports_and_logs(tmp_path):
    logger = CSVLogger(tmp_path, name="logs")
    callback = QSyncCallback(warmup_steps=3, profile_steps=3, measure_steps=5)
    trainer = _fit(tmp_path, callback, logger=logger)
    assert trainer.global_step == 20
    out = Path(logger.log_dir) / "qsync"
    report = json.loads((out / "report.json").read_text())
    _check_report(report, 1, out / "trace")
    assert callback.report["predicted"]["step_ms"] == report["predicted"]["step_ms"]
    raw = json.loads((out / "trace" / "rank0" / "kineto.json").read_text())
    assert "traceEvents" in raw
    (trace,) = load_trace_dir(out / "trace")
    assert trace.fingerprint["layers"] == ["net.0", "net.1", "net.2"]
    assert len(trace.measured["step_ms"]) >= 5
    assert len(trace.measured["page_faults"]) == len(trace.measured["step_ms"])
    assert trace.measured["steps_after_window"] == 5  # measure_steps: timed after the window closed
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        columns = next(csv.reader(f))
    assert "qsync/predicted_step_ms" in columns and "qsync/measured_peak_bytes" in columns
    assert not torch._C._autograd._profiler_enabled()


def test_record_mode_writes_traces_only(tmp_path):
    _fit(
        tmp_path,
        QSyncCallback(
            mode="record", warmup_steps=2, profile_steps=1, measure_steps=2, output_dir=tmp_path / "q"
        ),
    )
    assert (tmp_path / "q" / "trace" / "rank0" / "trace.json").exists()
    assert not (tmp_path / "q" / "report.json").exists()


def test_own_failure_warns_once_and_training_goes_on(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, QSyncCallback(warmup_steps=2, profile_steps=2, output_dir=blocker / "qsync"))
    ours = [w for w in caught if "QSyncCallback steps aside" in str(w.message)]
    assert len(ours) == 1 and "a_file" in str(ours[0].message)
    assert trainer.global_step == 20
    assert not torch._C._autograd._profiler_enabled()


def test_training_shorter_than_the_window_warns_and_finishes(tmp_path):
    with pytest.warns(RuntimeWarning, match="ended before the recorded window was complete"):
        trainer = _fit(
            tmp_path, QSyncCallback(warmup_steps=3, profile_steps=5, output_dir=tmp_path / "q"), max_steps=5
        )
    assert trainer.global_step == 5
    assert not torch._C._autograd._profiler_enabled()


def test_user_failure_inside_the_window_stops_the_profiler(tmp_path):
    with pytest.raises(RuntimeError, match="the user's model failed"):
        _fit(
            tmp_path,
            QSyncCallback(warmup_steps=2, profile_steps=4, output_dir=tmp_path / "q"),
            model=TinyModel(fail_at_step=3),
        )
    assert not torch._C._autograd._profiler_enabled()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="mode"):
        QSyncCallback(mode="apply-everything")
    with pytest.raises(ValueError, match="warmup_steps"):
        QSyncCallback(warmup_steps=1)


def test_two_processes_under_ddp(tmp_path):
    """The example, as a user runs it, on 2 CPU processes (DDP over gloo)."""
    out = tmp_path / "qsync"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--devices",
            "2",
            "--max-steps",
            "30",
            "--batch-size",
            "64",
            "--output-dir",
            str(out),
            "--root-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "qsync report" in result.stdout + result.stderr
    report = json.loads((out / "report.json").read_text())
    _check_report(report, 2, out / "trace")
    traces = load_trace_dir(out / "trace")
    assert [t.rank for t in traces] == [0, 1]
    for trace in traces:
        params = trace.resident_bytes["parameters"]
        assert trace.resident_bytes["gradient_buckets"] == params  # DDP's buckets hold every gradient
        comms = [op for op in trace.ops if op.kind == "comm"]
        assert any(c.collective["op"] == "all_reduce" and c.collective["numel"] > 0 for c in comms)
        assert all(c.deps for c in comms)
        waiters = [op for op in trace.ops if any(d in {c.id for c in comms} for d in op.deps)]
        assert waiters, "every step's main thread waits for its all-reduce"
