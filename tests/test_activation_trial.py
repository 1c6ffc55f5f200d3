"""The activation trials (`activation_trial.py`): which modules they act on, what the offload trial
counts and how it prices it, what the recompute trial measures, the order they run in, and what they
leave behind, on a real model, applier and disk store in a plain loop."""

import os
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qsync_callback.activation_trial import (
    PRECISE_ENOUGH,
    OffloadTrial,
    RecomputeTrial,
    TrialSequence,
    activation_trials_for,
    recompute_trial_modules,
    trial_modules,
)
from qsync_callback.appliers.torch_activation import ActivationApplier
from qsync_callback.offload_store import DIRECTORY_PREFIX
from qsync_callback.plan import module_layers
from qsync_callback.recorder.copy_costs import DIRECTIONS, copies_us, copy_costs
from qsync_callback.report import format_activation_trial

from tracebuilder import trace

BATCH, WIDTH = 256, 512  # a hidden activation of 512 KiB: over the store's least size


class Net(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 64))
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.body(x))


def _offload_dirs() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(DIRECTORY_PREFIX)}


def _priced_ms(fit, copies, nbytes):
    """What the fit prices a trial's copies each way, in ms, as the trial's result does."""
    return sum(copies_us(fit, d, nbytes[d], copies[d]) for d in ("to_store", "from_store")) / 1e3


def _run_trial(model: nn.Module, trial, in_force: list | None = None, losses: list | None = None) -> int:
    """The trial's (or trials') boundaries around real training steps of ``model``, until it has
    finished; the boundary at which it did. ``in_force`` gets, per step, the name of the wrapper
    in force on ``model.body`` (None: none); ``losses``, each step's loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(BATCH, 64, generator=torch.Generator().manual_seed(0))
    step = 0
    while True:
        trial.boundary(step)
        if trial.finished:
            return step
        if in_force is not None:
            wrapper = model.body.__dict__.get("forward")
            in_force.append(None if wrapper is None else wrapper.__name__)
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        if losses is not None:
            losses.append(loss.item())
        step += 1


LAYERS = ["body.0", "body.1", "body.2", "head", "blocks.0.attn.q", "blocks.0.mlp", "blocks.1.attn.q", "x"]


def test_the_trial_takes_the_outermost_modules_a_policy_can_reach():
    assert trial_modules(LAYERS, {}) == ["blocks", "body", "head", "x"]
    refused = {"blocks": "not called", "blocks.0": "inplace", "blocks.0.attn": "called twice per step"}
    assert trial_modules(LAYERS, refused) == [
        "blocks.0.attn.q",
        "blocks.0.mlp",
        "blocks.1",
        "body",
        "head",
        "x",
    ]


def test_the_recompute_trial_takes_the_blocks_among_the_modules_or_all_where_none_is_one():
    assert recompute_trial_modules(["blocks", "body", "head", "x"], LAYERS) == ["blocks", "body"]
    assert recompute_trial_modules(["blocks.0.attn.q", "head", "x"], LAYERS) == [
        "blocks.0.attn.q",
        "head",
        "x",
    ]
    assert recompute_trial_modules([], LAYERS) == []


@settings(max_examples=200, deadline=None)
@given(st.sets(st.sampled_from(sorted(module_layers(LAYERS)))))
def test_every_module_that_may_take_a_policy_is_chosen_or_inside_one_chosen_and_none_nest(refused):
    chosen = trial_modules(LAYERS, dict.fromkeys(refused, "refused"))
    assert not set(chosen) & refused
    for name in set(module_layers(LAYERS)) - refused:
        assert sum(name == c or name.startswith(c + ".") for c in chosen) == 1


def test_a_recorders_trials_are_of_its_traces_outermost_modules_offload_on_the_disk_tier_only():
    fit = copy_costs("cpu")
    layers = [{"name": name, "type": "Linear"} for name in ("body.0", "body.2", "head")]
    applier = ActivationApplier(Net())
    disk = trace([], 1.0, layers=layers, activation_costs={"copy": fit, "refused": {"head": "called twice"}})
    trials = activation_trials_for(applier, rounds=3, looks=False)(disk)
    assert [type(t) for t in trials.trials] == [OffloadTrial, RecomputeTrial]
    assert all(t.modules == ["body"] for t in trials.trials)
    assert trials.steps == 60 and not trials.finished
    # both act through the applier given, for the rounds asked; offload priced on the trace's fit
    assert _run_trial(applier.model, trials) == 60
    results = trials.results()
    assert set(results) == {"copy", "recompute"}
    assert results["copy"]["bytes_per_step"]["to_store"] == BATCH * WIDTH * 4
    assert results["copy"]["priced_ms"] == pytest.approx(
        _priced_ms(fit, results["copy"]["copies_per_step"], results["copy"]["bytes_per_step"])
    )
    assert results["recompute"]["modules"] == ["body"] and results["recompute"]["rounds"] == 3
    pinned = trace(
        [], 1.0, layers=layers, activation_costs={"copy": {**fit, "tier": "pinned"}, "refused": {}}
    )
    # CUDA: the copies overlap, the fit prices them; a recompute is tried on every device
    on_cuda = activation_trials_for(applier, rounds=3)(pinned)
    assert [type(t) for t in on_cuda.trials] == [RecomputeTrial] and on_cuda.steps == 30
    # the recompute trial takes the blocks among them: a plan recomputes blocks, not single layers
    both = trace([], 1.0, layers=layers, activation_costs={"copy": fit, "refused": {}})
    offload, recompute = activation_trials_for(applier)(both).trials
    assert (offload.modules, recompute.modules) == (["body", "head"], ["body"])
    leaves = trace([], 1.0, layers=layers, activation_costs={"copy": fit, "refused": {"body": "inplace"}})
    offload, recompute = activation_trials_for(applier)(leaves).trials
    assert offload.modules == recompute.modules == ["body.0", "body.2", "head"]  # no block: the layers
    refused = {"body": "inplace", "body.0": "inplace", "body.2": "inplace", "head": "called twice"}
    none = trace([], 1.0, layers=layers, activation_costs={"copy": fit, "refused": refused})
    nothing = activation_trials_for(applier)(none)
    # over before they start, in no step, and say why
    assert nothing.finished and nothing.steps == 0
    why = {"modules": [], "rounds": 0, "note": "no module can take a policy"}
    assert nothing.results() == {"copy": {**why, "factor": None}, "recompute": why}


def test_copies_are_priced_by_the_fit_each_way():
    fit = {
        "to_store": {"alpha_us": 100.0, "us_per_byte": 0.001},
        "from_store": {"alpha_us": 50.0, "us_per_byte": 0.0005},
    }
    copies, nbytes = {"to_store": 2, "from_store": 2}, {"to_store": 10**6, "from_store": 10**6}
    assert copies_us(fit, "to_store", 10**6, copies=2) == pytest.approx(200 + 1000)
    assert copies_us(fit, "from_store", 10**6) == pytest.approx(50 + 500)
    assert _priced_ms(fit, copies, nbytes) == pytest.approx((200 + 1000 + 100 + 500) / 1e3)


def test_a_trial_counts_the_bytes_moved_prices_them_and_leaves_nothing_behind():
    before = _offload_dirs()
    model = Net()
    fit = copy_costs("cpu")
    trial = OffloadTrial(ActivationApplier(model), ["body", "head"], fit, rounds=2)
    assert trial.steps == 2 * 2 * 5  # planned: 2 rounds of two blocks of 1 + 4 steps
    last = _run_trial(model, trial)
    result = trial.result()
    # it went on by 2 rounds at a time while its change's noise was over a tenth of it, up to 6
    assert last == trial.steps == 10 * result["rounds"] and result["rounds"] in (2, 4, 6)
    if result["rounds"] < 6:
        assert result["noise_ms"] <= PRECISE_ENOUGH * abs(result["change_ms"])
    # body saves its first Linear's input (the batch: its caller holds it, so it stays), the ReLU's
    # output (which the second Linear saves too: one storage, moved once); head saves body's output,
    # 64 KiB: the least size the store moves
    hidden, out = BATCH * WIDTH * 4, BATCH * 64 * 4
    assert result["bytes_per_step"] == {"to_store": hidden + out, "from_store": hidden + out}
    assert result["copies_per_step"] == {"to_store": 2, "from_store": 2}
    assert result["priced_ms"] == pytest.approx(
        _priced_ms(fit, result["copies_per_step"], result["bytes_per_step"])
    )
    assert result["modules"] == ["body", "head"]
    if result["factor"] is None:  # the change was within its noise on this machine at this moment
        assert "within its noise" in result["note"]
    else:
        assert result["factor"] == pytest.approx(result["change_ms"] / result["priced_ms"])
        assert result["change_ms"] > result["noise_ms"]
    assert "forward" not in model.body.__dict__ and "forward" not in model.head.__dict__
    assert _offload_dirs() <= before


@pytest.mark.parametrize(
    ("change_ms", "noise_ms", "factor"),
    [
        (2.0, 0.5, 2.0 / 1.65),  # within its noise of the fit's price (1.65 ms): the fit moves more than that
        (3.3, 0.5, 2.0),
        (0.4, 0.5, None),  # within its noise of nothing
    ],
)
def test_an_offload_trial_prices_the_copies_at_any_change_it_tells_from_nothing(change_ms, noise_ms, factor):
    fit = {
        "to_store": {"alpha_us": 100.0, "us_per_byte": 0.001},
        "from_store": {"alpha_us": 50.0, "us_per_byte": 0.0005},
    }
    trial = OffloadTrial(ActivationApplier(Net()), ["body"], fit, rounds=2)
    measured = {"modules": ["body"], "rounds": 2, "baseline_ms": 10.0, "change_ms": change_ms}
    trial._measured = lambda: {**measured, "noise_ms": noise_ms}  # the rounds' figures (`paired_change`)
    trial._timed_plan_steps = 4  # one copy of 1 MB each way a step
    trial._moved = {"copies": dict.fromkeys(DIRECTIONS, 4), "bytes": dict.fromkeys(DIRECTIONS, 4 * 10**6)}
    result = trial.result()
    assert result["priced_ms"] == pytest.approx(1.65)  # (100 + 1000) + (50 + 500) us
    assert result["factor"] == (None if factor is None else pytest.approx(factor))
    assert ("note" in result) == (factor is None)


def test_a_trial_that_moves_nothing_calibrates_nothing():
    model = Net(width=16)  # every saved tensor under the store's least size
    trial = OffloadTrial(ActivationApplier(model), ["body"], copy_costs("cpu"), rounds=1, looks=False)
    assert _run_trial(model, trial) == 10  # the rounds planned, no more: it may not look
    result = trial.result()
    assert result["factor"] is None and result["note"] == "the trial's offload moved nothing"
    assert result["bytes_per_step"] == {"to_store": 0, "from_store": 0}


def test_a_module_the_applier_refuses_stops_the_trial_with_the_reason_and_changes_nothing():
    model = Net()
    trial = OffloadTrial(ActivationApplier(model), ["body", "nowhere"], copy_costs("cpu"), rounds=1)
    assert _run_trial(model, trial) == 10  # it idles to its planned end: ranks end their windows together
    result = trial.result()
    assert result["factor"] is None
    assert result["note"].startswith("the trial's offload could not be applied: activation: 'nowhere'")
    assert "forward" not in model.body.__dict__


def test_a_store_that_cannot_write_stops_the_trial_and_undoes_it(tmp_path):
    model = Net()
    applier = ActivationApplier(model, directory=str(tmp_path / "missing"))
    trial = OffloadTrial(applier, ["body"], copy_costs("cpu"), rounds=2)
    assert _run_trial(model, trial) == 20
    result = trial.result()
    assert result["factor"] is None
    assert result["note"].startswith("the trial's offload failed: cannot make the offload store of cpu")
    assert "forward" not in model.body.__dict__


def test_the_plan_table_says_what_a_trial_measured_or_why_it_calibrated_nothing():
    measured = {"modules": ["a", "b", "c", "d", "e"], "rounds": 6, "factor": 1.5, "change_ms": 3.0}
    line = format_activation_trial("offload", {**measured, "noise_ms": 0.5, "priced_ms": 2.0})
    assert line == (
        "  offload priced at 1.50 x the copy-cost fit: offload of a, b, c, d, ... in 6 rounds of turns "
        "cost the step +3.00 ms (+-0.50) where the fit prices its copies at 2.00 ms"
    )
    line = format_activation_trial("recompute", {**measured, "noise_ms": 0.5, "priced_ms": 2.0})
    assert line == (
        "  recompute priced at 1.50 x the recorded forward: recompute of a, b, c, d, ... in 6 rounds of "
        "turns cost the step +3.00 ms (+-0.50) where the recorded forward prices it at 2.00 ms"
    )
    line = format_activation_trial(
        "offload", {**measured, "noise_ms": 0.5, "priced_ms": 2.0, "estimate": "median"}
    )
    assert line.endswith(
        "(+-0.50; the rounds' median, the less noisy) where the fit prices its copies at 2.00 ms"
    )
    line = format_activation_trial(
        "offload", {"modules": [], "factor": None, "note": "no module can take a policy"}
    )
    assert line == (
        "  offload priced by the copy-cost fit alone: the offload trial (no module): "
        "no module can take a policy"
    )
    line = format_activation_trial("recompute", {"modules": ["a"], "factor": None, "note": "too noisy"})
    assert line == "  recompute priced by the recorded forward alone: the recompute trial (a): too noisy"


def test_a_recompute_trial_measures_the_change_changes_no_loss_and_leaves_nothing_wrapped():
    model, twin = Net(), Net()
    twin.load_state_dict(model.state_dict())
    in_force: list = []
    losses: list = []
    trial = RecomputeTrial(ActivationApplier(model), ["body", "head"], rounds=2)
    last = _run_trial(model, trial, in_force, losses)
    result = trial.result()
    assert last == trial.steps == 10 * result["rounds"] and result["rounds"] in (2, 4, 6)
    assert result["modules"] == ["body", "head"]
    if "note" in result:  # the change was within its noise on this machine at this moment
        assert "within its noise" in result["note"]
    else:
        assert result["change_ms"] > result["noise_ms"] >= 0
        if result["rounds"] < 6:
            assert result["noise_ms"] <= PRECISE_ENOUGH * abs(result["change_ms"])
    assert result["baseline_ms"] > 0
    # blocks of 1 + 4 steps: the recorded configuration first, then the recompute, in turns
    assert in_force[:10] == [None] * 5 + ["recomputed"] * 5
    assert "forward" not in model.body.__dict__ and "forward" not in model.head.__dict__
    # the trial's steps are training steps: a recompute changes no loss
    expected = []
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.01)
    x = torch.randn(BATCH, 64, generator=torch.Generator().manual_seed(0))
    for _ in losses:
        optimizer.zero_grad()
        loss = twin(x).square().mean()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    assert losses == expected


def test_the_trials_run_one_after_the_other_and_training_that_ends_stops_both():
    model = Net()
    applier = ActivationApplier(model)
    in_force: list = []
    trials = TrialSequence(
        [
            OffloadTrial(applier, ["body"], copy_costs("cpu"), rounds=1, looks=False),
            RecomputeTrial(applier, ["body"], rounds=1, looks=False),
        ]
    )
    assert _run_trial(model, trials, in_force) == 20
    # the recompute trial's boundary 0 is the one that ends the offload trial
    assert in_force == [None] * 5 + ["offloaded"] * 5 + [None] * 5 + ["recomputed"] * 5
    assert all(t.finished for t in trials.trials)
    cut = TrialSequence(
        [
            OffloadTrial(applier, ["body"], copy_costs("cpu"), rounds=1, looks=False),
            RecomputeTrial(applier, ["body"], rounds=1, looks=False),
        ]
    )
    for step in range(8):
        cut.boundary(step)
    assert model.body.__dict__["forward"].__name__ == "offloaded"
    cut.stop("training ended")
    assert cut.finished and "forward" not in model.body.__dict__
    results = cut.results()
    assert results["copy"]["note"] == results["recompute"]["note"] == "training ended"
    assert results["copy"]["factor"] is None
