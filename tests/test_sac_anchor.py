"""benchmarks/sac_anchor.py: torch's own SAC solver (SACEstimator + sac_milp) over real benchmark
models on CPU, its plans in our vocabulary, and its op-level policy applied to a real training step."""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import sac_anchor  # noqa: E402
from models import get_model  # noqa: E402


@dataclass
class Collected:
    model: nn.Module
    batch: tuple[torch.Tensor, torch.Tensor]
    stats: sac_anchor.SacStats
    model_untouched: bool  # weights, batch-norm statistics and gradients as before collecting


def _collect(name):
    torch.manual_seed(0)
    spec = get_model(name)
    model, batch = spec.build(), next(iter(spec.dataloader(1)))
    before = {key: t.clone() for key, t in model.state_dict().items()}
    stats = sac_anchor.collect_sac_stats(
        model, batch, sac_anchor.lightning_loss, make_optimizer=sac_anchor.lightning_optimizer
    )
    same_state = all(torch.equal(t, before[key]) for key, t in model.state_dict().items())
    return Collected(model, batch, stats, same_state and all(p.grad is None for p in model.parameters()))


@pytest.fixture(scope="module")
def resnet():
    return _collect("resnet")


@pytest.fixture(scope="module")
def mlp():
    return _collect("mlp")


def _non_leaf_modules(model):
    return {name for name, module in model.named_modules() if name and next(module.children(), None)}


def test_torch_estimator_modes_say_what_they_need():
    errors = sac_anchor.torch_estimator_errors()
    assert set(errors) == set(sac_anchor.TORCH_ESTIMATOR_MODES)
    if torch.cuda.is_available():
        assert errors == dict.fromkeys(sac_anchor.TORCH_ESTIMATOR_MODES, "")
    else:
        assert "needs to access CUDA" in errors["operator-level-cost-model"]
        assert "dummy base class Event" in errors["operator-level-benchmark"]


def test_the_measurement_says_how_it_was_taken(resnet):
    stats = resnet.stats
    assert resnet.model_untouched  # a fake copy ran, not the model
    summary = stats.summary()
    assert summary["torch_estimator_errors"] == sac_anchor.torch_estimator_errors()
    assert summary["estimator"] == sac_anchor.CPU_ESTIMATOR
    assert summary["tradeoff_fit"]
    # The step was timed op by op: the estimator's forward and backward take real time.
    assert stats.baseline_compute_ms > 0
    # Batch-norm activations dominate this model: the forward/backward peak is far above the
    # optimizer step's, and sac_milp's model of it is close to MemTracker's.
    assert stats.fwd_bwd_peak_bytes > 4 * stats.optimizer_peak_bytes
    assert stats.model_baseline_peak_bytes == pytest.approx(stats.fwd_bwd_peak_bytes, rel=0.05)


def test_generous_budget_recomputes_nothing(resnet, mlp):
    for stats in (resnet.stats, mlp.stats):
        result = sac_anchor.solve_sac_plan(stats, 2 * stats.tracked_peak_bytes)
        assert result.fits and result.reason == ""
        assert result.recompute == {} and result.discard == {} and result.predicted_recompute_ms == 0
        assert result.predicted_peak_bytes == stats.tracked_peak_bytes


def test_tight_budget_recomputes_real_modules(resnet):
    model, stats = resnet.model, resnet.stats
    budget = int(0.8 * stats.tracked_peak_bytes)
    result = sac_anchor.solve_sac_plan(stats, budget)
    assert result.fits, result.reason
    assert result.recompute and set(result.recompute.values()) == {"recompute"}
    assert set(result.recompute) == set(result.discard) <= _non_leaf_modules(model)
    assert all(0 < share <= 1 for share in result.discard.values())
    assert result.predicted_recompute_ms > 0 and result.whole_module_recompute_ms > 0
    # sac_milp rounds each share to 4 decimals, so its plan may overshoot by a few hundred bytes.
    assert result.predicted_peak_bytes <= budget * 1.0001
    # The whole-module projection discards at least what sac_milp asked for.
    assert result.whole_module_peak_bytes <= result.predicted_peak_bytes
    assert set(result.op_policies) == set(result.recompute)
    for name, policy in result.op_policies.items():
        assert policy.ops == list(stats.sac_stats[f"{stats.root}.{name}"].func_names)
        assert len(policy.save) == len(policy.ops)
    written = json.loads(json.dumps(result.to_dict()))
    assert written["recompute"] == result.recompute and written["measurement"]["tracked_peak_bytes"] > 0


def test_impossible_budget_says_why_and_what_is_closest(resnet):
    model, stats = resnet.model, resnet.stats
    budget = int(0.3 * stats.tracked_peak_bytes)
    result = sac_anchor.solve_sac_plan(stats, budget)
    assert not result.fits and result.recompute == {}
    assert result.milp_peak_bound_bytes == -1
    assert "sac_milp found no plan" in result.reason and "lowest peak" in result.reason
    assert "Infeasible" in " ".join(result.solver_log)
    assert budget < result.lowest_peak_bytes < stats.tracked_peak_bytes
    assert result.closest_discard and set(result.closest_discard) <= _non_leaf_modules(model)


def test_budget_under_the_optimizer_step_is_refused_before_solving(mlp):
    stats = mlp.stats
    # Adam's state and the update's temporaries: the MLP's optimizer step peaks as high as its backward.
    assert stats.optimizer_peak_bytes > 0.9 * stats.fwd_bwd_peak_bytes
    result = sac_anchor.solve_sac_plan(stats, stats.optimizer_peak_bytes - 1)
    assert not result.fits and result.milp_peak_bound_bytes is None
    assert "optimizer step's peak" in result.reason and "sac_milp was not asked" in result.reason
    assert result.lowest_peak_bytes >= stats.optimizer_peak_bytes


def test_a_measured_peak_shifts_the_budget_and_the_predictions(resnet):
    stats = resnet.stats
    budget = int(0.8 * stats.tracked_peak_bytes)
    extra = 5 * 2**20  # the caller's measurement sees 5 MiB more than MemTracker
    tracked = sac_anchor.solve_sac_plan(stats, budget)
    measured = sac_anchor.solve_sac_plan(stats, budget + extra, stats.tracked_peak_bytes + extra)
    assert measured.to_tracker_bytes == -extra
    assert measured.milp_budget_bytes == tracked.milp_budget_bytes
    assert measured.recompute == tracked.recompute
    assert measured.predicted_peak_bytes == tracked.predicted_peak_bytes + extra


def _step(model, batch):
    """Loss, gradients, and MemTracker's bytes alive after the forward, of one real step."""
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, batch)
    with tracker:
        loss = sac_anchor.lightning_loss(model, batch)
        after_forward = sum(s["Total"] for s in tracker.get_tracker_snapshot("current").values())
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], after_forward


def test_op_level_policy_saves_less_and_keeps_the_gradients(resnet):
    model, batch, stats = resnet.model, resnet.batch, resnet.stats
    result = sac_anchor.solve_sac_plan(stats, int(0.8 * stats.tracked_peak_bytes))
    base_loss, base_grads, base_alive = _step(model, batch)

    applied = sac_anchor.apply_sac_op_policy(model, result.op_policies)
    loss, grads, alive = _step(model, batch)
    assert applied.mismatched_ops == {}  # the live forward ran the ops SACEstimator recorded
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(g, b) for g, b in zip(grads, base_grads, strict=True))
    assert alive < base_alive

    applied.undo()
    assert all("forward" not in module.__dict__ for module in model.modules())
    assert _step(model, batch)[2] == base_alive
    model.zero_grad(set_to_none=True)  # torch's trackers keep the parameters: not their gradients too


def test_op_level_policy_refuses_unknown_modules_without_changing_any(resnet):
    model = resnet.model
    policy = sac_anchor.OpPolicy(["relu"], [False])
    with pytest.raises(ValueError, match="no module named nope"):
        sac_anchor.apply_sac_op_policy(model, {"net.3": policy, "nope": policy})
    assert all("forward" not in module.__dict__ for module in model.modules())


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.block(self.block(x)))


def test_a_module_called_twice_is_reported_not_crashed():
    def loss(model, x):
        return model(x).pow(2).mean()

    result = sac_anchor.sac_recompute_plan(_Twice(), torch.randn(4, 8), loss, 10**6)
    assert not result.fits
    assert result.reason.startswith("building the module graph failed")
    assert "block, block.0, block.1 ran more than once" in result.reason


def test_piecewise_fit_stand_in_recovers_a_known_curve():
    x = np.linspace(0, 1, 41)
    y = np.where(x < 0.4, 0.5 * x, 0.2 + 2.0 * (x - 0.4))
    fit = sac_anchor.PiecewiseLinFit(x, y)
    breaks = fit.fit(2)
    assert breaks[0] == 0 and breaks[-1] == 1 and breaks[1] == pytest.approx(0.4, abs=1 / 400)
    assert fit.calc_slopes() == pytest.approx([0.5, 2.0], abs=0.02)
    assert fit.intercepts == pytest.approx([0.0, -0.6], abs=0.02)
    line = sac_anchor.PiecewiseLinFit(x, 3 * x + 1)
    line.fit(1)
    assert line.calc_slopes() == pytest.approx([3.0]) and line.intercepts == pytest.approx([1.0])
    with pytest.raises(ValueError, match="1 or 2 segments"):
        line.fit(3)
