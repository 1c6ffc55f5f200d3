"""Activation plans (recompute, offload) chosen, applied, verified and kept in real Lightning
training; the offload store's fault rolls the plan back; what the recording gives the planner."""

import json
import logging
import os
import tempfile

import pytest
import pytorch_lightning as pl
import torch
from test_precision_apply import _apply_callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback import QSyncCallback
from qsync_callback.offload_store import DIRECTORY_PREFIX
from qsync_callback.plan import Plan
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.trace import load_trace_dir
from qsync_callback.report import format_activation_trial


class Block(nn.Module):
    """A residual block: what its two Linears and ReLU save is dropped by a recompute of the block."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class ResidualMLP(pl.LightningModule):
    def __init__(self, width: int = 256, depth: int = 4):
        super().__init__()
        self.stem = nn.Linear(64, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 8)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(self.blocks(self.stem(x))), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def residual_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512 * 4, 64, generator=g), torch.randint(0, 8, (512 * 4,), generator=g))
    return DataLoader(data, batch_size=512)


def _fit(callback, max_steps=40):
    pl.seed_everything(0, verbose=False)
    model = ResidualMLP()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[callback] if callback else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, residual_loader())
    return model


def _callback(tmp_path, **kwargs):
    """`_apply_callback`'s short windows, for an 85% budget met by activation policies alone."""
    options = dict(memory_budget="85%", levers=("activation",), plan_cache=False)
    return _apply_callback(tmp_path, **{**options, **kwargs})


def _offload_dirs() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(DIRECTORY_PREFIX)}


def test_an_activation_plan_meets_the_budget_live_and_is_kept(tmp_path, caplog):
    before = _offload_dirs()
    callback = _callback(tmp_path, activation_trial_rounds=2)
    with caplog.at_level(logging.INFO):
        model = _fit(callback, max_steps=160)  # the trials: 2 rounds each, up to 6 while too noisy
    out = tmp_path / "q"
    trace = load_trace_dir(out / "trace")[0]
    # the recording counted every module's calls and fitted the store's copy cost
    assert trace.activation_costs["copy"]["tier"] == "disk"
    assert trace.activation_costs["refused"].get("blocks.0.act") is None
    # ... and tried offloading the outermost modules in its last steps, in turns with the recorded
    # configuration: what the store moved each step, and the step's change over the fit's price
    trial = trace.activation_costs["copy"]["in_step"]
    assert trial["modules"] == ["blocks", "head", "stem"] and trial["rounds"] in (2, 4, 6)
    # each step moved what the blocks and the head save, each way; the stem saves its input, the
    # batch, which the offload leaves where it is (the caller holds it)
    saved = trace.saved_activation_bytes
    moved = sum(saved[name] for name in saved if name.startswith(("blocks.", "head")))
    assert trial["bytes_per_step"] == {"to_store": moved, "from_store": moved}
    assert trial["priced_ms"] > 0
    assert trial["factor"] is None or trial["factor"] == pytest.approx(
        trial["change_ms"] / trial["priced_ms"]
    )
    assert ("note" in trial) == (trial["factor"] is None)
    assert format_activation_trial("offload", trial) in caplog.text  # printed with the plan's table
    # ... then recomputing them, in turns too: the step's change, which the predictor takes its
    # factor on (against the same recompute priced on the recorded steps), printed with the table
    measured = trace.activation_costs["recompute"]["in_step"]
    assert measured["modules"] == ["blocks"] and measured["rounds"] in (2, 4, 6)  # the block among them
    assert ("note" in measured) == (
        "change_ms" not in measured or measured["change_ms"] <= measured["noise_ms"]
    )
    priced = Predictor([trace]).activation.recompute_trials[0]
    assert priced["priced_ms"] > 0
    assert format_activation_trial("recompute", priced) in caplog.text
    assert "qsync memory plan (meets the constraints; chosen: activation)" in caplog.text
    verification = json.loads((out / "verification.json").read_text())
    kept = Plan.load(out / "plan.json")
    assert kept.activation and not kept.precision
    assert verification["decision"] == "keep", verification["reason"]
    budget = callback.constraints.memory_budget
    assert verification["predicted"]["peak_bytes"] <= budget
    # measured (live storages and the allocator's counter, not the predictor) within the budget
    assert verification["measured"]["peak_bytes"] <= budget
    assert verification["measured"]["peak_bytes"] < verification["baseline_peak_bytes"]
    assert len(model.losses) == 160 and all(torch.isfinite(torch.tensor(model.losses)))
    assert _offload_dirs() <= before  # the store's files went with the end of training


def test_training_that_ends_during_the_trials_says_so_and_leaves_nothing_offloaded(tmp_path):
    before = _offload_dirs()
    callback = _callback(tmp_path, activation_trial_rounds=6)  # 120 steps after the measured ones
    model = _fit(callback, max_steps=20)
    costs = load_trace_dir(tmp_path / "q" / "trace")[0].activation_costs
    ended = {"rounds": 6, "note": "training ended before the trial's last round"}
    assert costs["copy"]["in_step"] == {"modules": ["blocks", "head", "stem"], **ended, "factor": None}
    assert costs["recompute"]["in_step"] == {"modules": ["blocks"], **ended}
    assert not [name for name, module in model.named_modules() if "forward" in module.__dict__]
    assert _offload_dirs() <= before


def test_a_recompute_only_plan_trains_bit_identically(tmp_path):
    plain = _fit(None, max_steps=20)
    plan_file = tmp_path / "plan.json"
    Plan(activation={"blocks.0": "recompute", "blocks.2": "recompute"}).save(plan_file)
    planned = _fit(
        QSyncCallback(mode="apply", plan=plan_file, plan_cache=False, output_dir=tmp_path), max_steps=20
    )
    assert planned.losses == plain.losses
    assert "forward" in planned.blocks[0].__dict__  # still wrapped: the plan stays in force


def test_a_run_with_offload_reports_the_bytes_moved_per_step_and_the_bandwidth(tmp_path, caplog):
    plan_file = tmp_path / "plan.json"
    Plan(activation={"blocks.1": "offload"}).save(plan_file)
    out = tmp_path / "q"
    callback = QSyncCallback(
        mode="report", plan=plan_file, plan_cache=False, output_dir=out, warmup_steps=3, profile_steps=2
    )
    with caplog.at_level(logging.INFO):
        _fit(callback, max_steps=16)
    moved = json.loads((out / "report.json").read_text())["measured"]["offload"]["cpu"]
    # blocks.1 saves two storages of 512x256 floats: its input (fc1's; blocks.0's sum, which no
    # backward of blocks.0 saved) and the ReLU's output (the ReLU's and fc2's), each written once and
    # read back once in every step counted
    activation = 512 * 256 * 4
    assert moved["tier"] == "disk"
    assert moved["to_store_bytes"] == moved["from_store_bytes"] == 2 * activation
    assert moved["to_store_bytes_per_s"] > 0 and moved["from_store_bytes_per_s"] > 0
    assert moved["waited_ms"] > 0
    assert "offload (cpu, disk): per step 1.0 MiB out at" in caplog.text


def test_an_offload_store_that_fails_rolls_the_plan_back_and_training_goes_on(tmp_path, caplog, monkeypatch):
    plan_file = tmp_path / "plan.json"
    Plan(activation={"blocks.1": "offload"}).save(plan_file)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no" / "such" / "dir"))  # a real fault
    with caplog.at_level(logging.INFO):
        callback = QSyncCallback(mode="apply", plan=plan_file, plan_cache=False, output_dir=tmp_path / "q")
        model = _fit(callback, max_steps=6)
    assert "the plan in force failed" in caplog.text and "rolled back" in caplog.text
    assert "forward" not in model.blocks[1].__dict__  # undone
    assert len(model.losses) == 6
    assert callback.plan is None  # no plan in force: the recorded configuration
    assert Plan.load(tmp_path / "q" / "plan.json").is_empty  # the recorded configuration is kept


def test_two_ddp_processes_apply_verify_and_keep_the_same_activation_plan(tmp_path):
    from apply_script import run_two_ranks

    result = run_two_ranks(tmp_path, steps=60, kind="activation")
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    verification = json.loads((tmp_path / "verification.json").read_text())
    kept = Plan.load(tmp_path / "plan.json")
    # after training a kept plan with an offload policy is undone whole (its stores closed); one of
    # recompute policies alone stays in force
    offloads = "offload" in kept.activation.values()
    in_force = [] if offloads else sorted(kept.activation)
    assert verification["decision"] != "keep" or kept.activation
    assert ranks[0]["wrapped"] == ranks[1]["wrapped"] == in_force
    assert all(r["losses_finite"] and r["steps"] == 60 for r in ranks)
    # each rank ran its own offload and recompute trials, on the same modules, over the same steps
    traces = load_trace_dir(tmp_path / "trace")
    trials = [t.activation_costs["copy"]["in_step"] for t in traces]
    assert [t["modules"] for t in trials] == [["blocks", "head", "stem"]] * 2
    assert trials[0]["bytes_per_step"] == trials[1]["bytes_per_step"]
    recomputed = [t.activation_costs["recompute"]["in_step"] for t in traces]
    assert [(t["modules"], t["rounds"]) for t in recomputed] == [(["blocks"], 1)] * 2
