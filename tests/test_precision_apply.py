"""QSyncCallback(mode="apply") in real Lightning training: plan, switch, verify, keep, re-apply."""

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback import QSyncCallback
from qsync_callback.cache import plan_cache_path
from qsync_callback.lp import LPModule
from qsync_callback.plan import Plan

SCRIPT = Path(__file__).resolve().parent / "apply_script.py"


class GeluNet(pl.LightningModule):
    """Activations dominate its peak (no optimizer state, a wide batch), so a memory budget bites;
    each Linear after a GELU is the only holder of its input, which a lower precision frees."""

    def __init__(self, width: int = 256, depth: int = 8):
        super().__init__()
        layers = [torch.nn.Linear(64, width), torch.nn.GELU()]
        for _ in range(depth - 2):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 8))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader(batch_size=512):
    g = torch.Generator().manual_seed(0)
    n = batch_size * 8
    return DataLoader(
        TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 8, (n,), generator=g)),
        batch_size=batch_size,
    )


def _fit(callback, model=None, max_steps=30, batch_size=512, **trainer_options):
    """Train ``model`` (a GeluNet by default) with ``callback`` (one, a list, or None)."""
    pl.seed_everything(0, verbose=False)
    model = model or GeluNet()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=callback if isinstance(callback, list) else [callback] if callback else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_options,
    )
    trainer.fit(model, _loader(batch_size))
    return model


def _lp_precisions(model):
    return {name: m.precision for name, m in model.named_modules() if isinstance(m, LPModule)}


def _apply_callback(tmp_path, out="q", **kwargs):
    options = dict(
        mode="apply",
        warmup_steps=3,
        profile_steps=2,
        measure_steps=3,
        verify_steps=2,
        output_dir=tmp_path / out,
        memory_budget="90%",
        max_step_time=60.0,  # seconds: this test is about memory, not this shared CPU's speed
        precisions=("fp32", "bf16", "int8"),
        plan_cache=tmp_path / "cache",
        activation_trial_rounds=0,  # tests of the trials ask for them (test_activation_lightning.py)
    )
    options.update(kwargs)
    return QSyncCallback(**options)


def test_memory_budget_plan_is_applied_verified_kept_and_reused(tmp_path, caplog):
    callback = _apply_callback(tmp_path)
    model = _fit(callback)
    out = tmp_path / "q"
    kept = Plan.load(out / "plan.json")
    assert kept.precision, "a 90% budget needs some layer below fp32"
    assert set(kept.precision) <= {f"net.{2 * i}" for i in range(8)}
    verification = json.loads((out / "verification.json").read_text())
    assert verification["decision"] == "keep", verification["reason"]
    budget = callback.constraints.memory_budget
    assert verification["predicted"]["peak_bytes"] <= budget < callback.report["predicted"]["peak_bytes"]
    # the plan's peak, predicted from the fp32 recording, against the peak measured under it (live
    # tensors and the allocator's counter, not the predictor): the 5% the issue asks of the memory model
    assert verification["measured"]["peak_bytes"] == pytest.approx(
        verification["predicted"]["peak_bytes"], rel=0.05
    )
    assert verification["measured"]["peak_bytes"] < verification["baseline_peak_bytes"]
    # the live model runs the plan, on the very Parameters the optimizer holds
    assert _lp_precisions(model) == kept.precision
    assert callback.plan.precision == kept.precision
    assert callback.state_dict()["plan"]["precision"] == kept.precision
    assert all(torch.isfinite(torch.tensor(model.losses)))
    assert (out / "verify" / "trace" / "rank0" / "trace.json").exists()
    job = f"{GeluNet.__module__}.GeluNet"
    assert plan_cache_path(job, kept.constraints, kept.fingerprint["device"], tmp_path / "cache").exists()

    # the next launch of the same job applies the kept plan at step 0, without recording
    again = _apply_callback(tmp_path, out="q2")
    with caplog.at_level(logging.INFO):
        model = _fit(again)
    assert _lp_precisions(model) == kept.precision
    assert not (tmp_path / "q2" / "trace").exists()
    assert "applied the plan from the plan cache" in caplog.text

    # another batch size is another run: the kept plan is not applied, and the log says why
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _fit(_apply_callback(tmp_path, out="q3", mode="report"), batch_size=256)
        _fit(
            _apply_callback(tmp_path, out="q4", profile_steps=1, measure_steps=1), batch_size=256, max_steps=9
        )
    assert "not applying the kept plan" in caplog.text and "batch_shapes" in caplog.text


def test_resumed_state_reapplies_the_plan_without_planning(tmp_path):
    plan = Plan(precision={"net.2": "bf16"})
    state = {"finished": True, "output_dir": str(tmp_path / "q"), "plan": plan.to_dict()}
    callback = _apply_callback(tmp_path, plan_cache=False)
    callback.load_state_dict(state)
    model = _fit(callback, max_steps=3)
    assert _lp_precisions(model) == {"net.2": "bf16"}
    assert not (tmp_path / "q" / "trace").exists()


def test_fp32_plan_is_numerically_identical_to_no_callback(tmp_path):
    plan_file = tmp_path / "fp32.json"
    Plan(precision={f"net.{2 * i}": "fp32" for i in range(8)}).save(plan_file)
    plain = _fit(None, max_steps=20)
    planned = _fit(QSyncCallback(mode="apply", plan=plan_file, plan_cache=False), max_steps=20)
    assert set(_lp_precisions(planned).values()) == {"fp32"}
    assert planned.losses == plain.losses


def test_given_plan_for_another_model_warns_and_changes_nothing(tmp_path):
    plan_file = tmp_path / "other.json"
    Plan(fingerprint={"layers": ["encoder.0"]}, precision={"encoder.0": "bf16"}).save(plan_file)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _fit(QSyncCallback(mode="apply", plan=plan_file, plan_cache=False), max_steps=5)
    ours = [str(w.message) for w in caught if "QSyncCallback steps aside" in str(w.message)]
    assert len(ours) == 1 and "made for another run" in ours[0] and "other.json" in ours[0]
    assert _lp_precisions(model) == {}
    assert len(model.losses) == 5


def test_impossible_budget_gets_one_message_and_nothing_applied(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        model = _fit(_apply_callback(tmp_path, memory_budget="10%", plan_cache=False), max_steps=15)
    assert "below the smallest predicted peak" in caplog.text and "closest plan: net." in caplog.text
    assert _lp_precisions(model) == {}
    assert not (tmp_path / "q" / "plan.json").exists()


def test_impossible_budget_with_best_effort_applies_the_closest_plan(tmp_path):
    callback = _apply_callback(tmp_path, memory_budget="10%", plan_cache=False, best_effort=True)
    _fit(callback, max_steps=24)
    verification = json.loads((tmp_path / "q" / "verification.json").read_text())
    assert verification["predicted"]["peak_bytes"] > callback.constraints.memory_budget  # closest
    assert verification["plan"]["precision"]  # it lowers some layer
    # kept because it lowers the measured peak (the rule for plans made for a memory budget)
    assert verification["measured"]["peak_bytes"] < verification["baseline_peak_bytes"]
    assert verification["decision"] == "keep", verification["reason"]


def test_bad_apply_arguments_are_refused():
    with pytest.raises(ValueError, match="not a size"):
        QSyncCallback(mode="apply", memory_budget="lots")
    with pytest.raises(ValueError, match="precisions: unknown"):
        QSyncCallback(mode="apply", precisions=("fp8",))
    with pytest.raises(ValueError, match="max_step_time"):
        QSyncCallback(mode="apply", max_step_time=-1)


def test_two_processes_plan_switch_and_verify_together(tmp_path):
    """DDP over gloo: rank 0 plans, both ranks switch at the same step and follow one decision."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    kept = Plan.load(tmp_path / "q" / "plan.json")
    verification = json.loads((tmp_path / "q" / "verification.json").read_text())
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert per_rank[0]["precisions"] == per_rank[1]["precisions"]
    if verification["decision"] == "keep":
        assert kept.precision and per_rank[0]["precisions"] == kept.precision
    else:
        assert per_rank[0]["precisions"] == {}
    assert all(r["losses_finite"] for r in per_rank)
    assert per_rank[0]["steps"] == per_rank[1]["steps"] == 30
