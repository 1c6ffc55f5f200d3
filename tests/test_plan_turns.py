"""benchmarks/plan_turns.py and memory_plans.py's use of it: plans applied live in turns with the
recorded configuration in a real Lightning run, each in force in its own blocks only."""

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import compiled_regions  # noqa: E402
import memory_plans  # noqa: E402
from plan_turns import (  # noqa: E402
    BLOCK_LENGTH,
    WHOLE_MODEL,
    PlansInTurns,
    in_turns_change,
    page_faults_cell,
)

from qsync_callback import QSyncCallback  # noqa: E402
from qsync_callback.alternation import BLOCK_STEPS  # noqa: E402
from qsync_callback.plan import Plan  # noqa: E402


class CountedBlock(nn.Module):
    """Linear, ReLU, Linear; counts its forward's runs in ``calls[name]`` (a recompute runs it again
    in backward)."""

    def __init__(self, name, calls, width_out):
        super().__init__()
        self.name, self.calls = name, calls
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, width_out)

    def forward(self, x):
        self.calls[self.name] += 1
        return self.fc2(torch.relu(self.fc1(x)))


class Blocks(pl.LightningModule):
    """Two `CountedBlock`s; their forward runs are noted per step."""

    def __init__(self):
        super().__init__()
        self.calls = {"net.0": 0, "net.1": 0}
        self.net = nn.Sequential(CountedBlock("net.0", self.calls, 16), CountedBlock("net.1", self.calls, 4))
        self.per_step: list[dict[str, int]] = []
        self.compiled_steps: list[bool] = []  # per step: compiled whole, as Lightning's `from_compiled`
        self.frames_compiled: list[int] = []  # per step: the frames dynamo has compiled so far

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.per_step.append(dict(self.calls))
        self.compiled_steps.append(self._compiler_ctx is not None)
        self.frames_compiled.append(torch._dynamo.utils.counters["frames"]["ok"])
        self.calls.update(dict.fromkeys(self.calls, 0))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(model, callback, before=(), max_steps=None):
    """Fit ``model`` with ``callback`` (a `PlansInTurns`) after the callbacks ``before``, for its
    steps (or ``max_steps``)."""
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps or callback.steps,
        callbacks=[*before, callback],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8))


def test_each_plan_is_in_force_in_its_own_blocks_only_and_timed_in_every_round():
    torch.manual_seed(0)
    model = Blocks()
    plans = [Plan(activation={"net.0": "recompute"}), Plan(activation={"net.1": "recompute"})]
    turns = PlansInTurns(plans, rounds=2, warmup_steps=3)
    _fit(model, turns)
    expected = [{"net.0": 1, "net.1": 1}] * 3  # the warm-up: the recorded configuration, untimed
    for r in range(2):
        for j in range(2):
            recomputed = f"net.{(j + r) % 2}"  # the order rotates by one each round
            expected += [{"net.0": 1, "net.1": 1}] * BLOCK_LENGTH
            expected += [{"net.0": 1, "net.1": 1, recomputed: 2}] * BLOCK_LENGTH
    assert model.per_step[: len(expected)] == expected
    assert model.per_step[len(expected) :] == [{"net.0": 1, "net.1": 1}]  # undone for the last step
    for result in turns.results():
        assert result["rounds"] == 2
        assert len(result["baseline_ms"]) == len(result["plan_ms"]) == 2
        assert result["change_pct"] is not None
        assert set(result["page_faults_per_step"]) == {"baseline", "plan"}
    record = turns._records[0]
    for config in ("baseline", "plan"):  # every timed step has its time and its page faults
        assert all(len(block) == BLOCK_STEPS for block in record[config])
        assert all(len(block) == BLOCK_STEPS for block in record["page_faults"][config])


def test_turns_after_a_recording_start_their_warm_up_once_its_report_is_out(tmp_path):
    torch.manual_seed(0)
    model = Blocks()
    recording = QSyncCallback(
        mode="report", warmup_steps=2, profile_steps=1, measure_steps=2, output_dir=tmp_path, plan_cache=False
    )
    turns = PlansInTurns(
        [Plan(activation={"net.1": "recompute"})],
        rounds=1,
        warmup_steps=2,
        ready=lambda: recording.report is not None,
    )
    reported = ReportSeen(recording)
    _fit(model, turns, before=[recording, reported], max_steps=30)  # steps after the turns change nothing
    first_reported = reported.steps.index(True)  # the step at whose start the report was out
    first_recomputed = next(i for i, calls in enumerate(model.per_step) if calls["net.1"] == 2)
    # the warm-up's 2 steps and the baseline's block, then the plan's block
    assert first_recomputed == first_reported + 2 + BLOCK_LENGTH
    assert all(calls["net.1"] == 1 for calls in model.per_step[first_recomputed + BLOCK_LENGTH :])
    assert turns.results()[0]["rounds"] == 1


class ReportSeen(pl.Callback):
    """Per step: whether ``recording``'s report was out at its start."""

    def __init__(self, recording):
        self.recording, self.steps = recording, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append(self.recording.report is not None)


def test_the_whole_model_compiled_is_in_force_in_its_own_blocks_only_and_compiles_once():
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Blocks()
    turns = PlansInTurns([WHOLE_MODEL, Plan(activation={"net.0": "recompute"})], rounds=2, warmup_steps=2)
    _fit(model, turns)
    expected = [False] * 2
    for r in range(2):
        for j in range(2):
            expected += [False] * BLOCK_LENGTH + [(j + r) % 2 == 0] * BLOCK_LENGTH
    assert model.compiled_steps[: len(expected)] == expected
    assert model.compiled_steps[len(expected) :] == [False]
    # the compiled step ran the blocks as eager does
    assert all(calls == {"net.0": 1, "net.1": 1} for calls in model.per_step[: 2 + 2 * BLOCK_LENGTH])
    # compiled in the first compiled block's first step; its second block, a round later, compiled nothing
    first = expected.index(True)
    assert model.frames_compiled[first] > model.frames_compiled[first - 1]
    assert model.frames_compiled[first] == model.frames_compiled[-1]
    assert all(result["change_pct"] is not None for result in turns.results())


def _row(who, change, noise=1.0, within=True, activation=None):
    timed = [] if change is None else [{"change_pct": change, "noise_pct": noise}]
    return {
        "who": who,
        "within_budget": within,
        "in_turns": timed,
        "activation": activation or {},
        "precision": {},
    }


def test_in_turns_change_averages_the_processes_and_combines_their_noise():
    row = _row("x", 10.0, 3.0)
    row["in_turns"].append({"change_pct": 20.0, "noise_pct": 4.0})
    row["in_turns"].append({"change_pct": None, "noise_pct": None})
    assert in_turns_change(row) == (15.0, 2.5)
    assert in_turns_change(_row("x", None)) is None


def test_the_page_faults_cell_gives_each_configurations_median_over_the_processes():
    row = _row("x", 10.0)
    assert page_faults_cell(row) == "-"  # a process that did not count them
    row["in_turns"] = [
        {"page_faults_per_step": {"baseline": 12000.0, "plan": 3000.0}},
        {"page_faults_per_step": {"baseline": 14000.0, "plan": 7001.0}},
        {"page_faults_per_step": None},
    ]
    assert page_faults_cell(row) == "13000 / 5000"


def test_against_best_takes_the_fastest_plan_within_its_budget():
    ours = _row("ours", 10.0, activation={"a": "recompute"})
    rows = [
        ours,
        _row("other", 4.0, activation={"b": "offload"}),
        _row("other", -50.0, within=False),  # over its budget: not a plan to compare with
        _row("sac_ilp", None),
    ]
    verdict = memory_plans._against_best(rows, ours)
    assert verdict.startswith(f"{100 * (110 / 104 - 1):+.1f}% against the fastest (other: b: offload;")
    assert memory_plans._against_best([ours], ours).startswith("+0.0% against the fastest (ours")
    assert memory_plans._against_best(rows, _row("ours", None)) is None
    # our activation-only plan against activation plans only: not against a plan that lowers layers
    lowered = _row("ours", 1.0)
    lowered["precision"] = {"fc": "bf16"}
    alone = _row("ours: activation only", 10.0, activation={"a": "recompute"})
    assert memory_plans._against_best([lowered, alone, rows[1]], alone).startswith(
        f"{100 * (110 / 104 - 1):+.1f}%"
    )
    assert memory_plans._against_best([lowered, alone], lowered).startswith(
        "+0.0% against the fastest (ours: 1"
    )


def test_the_chosen_plan_is_set_against_the_whole_model_measured_in_the_same_rounds():
    def timed(change, noise):
        return {"in_turns": [{"change_pct": change, "noise_pct": noise}]}

    row = {
        "chosen": ["net"],
        "procs": 1,
        "compile_s": {"regions": 31.4, WHOLE_MODEL: 29.4},
        "turns": {"regions": timed(-20.0, 3.0), WHOLE_MODEL: timed(-24.0, 4.0)},
    }
    # the plan's step 0.80 of eager's, the whole model's 0.76: the plan 5.3% slower than the whole model
    assert compiled_regions.against_whole_model(row) == (
        "chosen net: +5.3% (+-5.0) against the whole model compiled (-24.0% against eager); "
        "compile 31.4 s against 29.4 s (fresh runs)"
    )
    # a plan that compiles nothing is eager itself, exactly; under DDP no fresh runs timed the compiles
    eager = {"chosen": [], "procs": 2, "compile_s": {}, "turns": {WHOLE_MODEL: timed(25.0, 6.0)}}
    assert compiled_regions.against_whole_model(eager) == (
        "chosen none (eager): -20.0% (+-6.0) against the whole model compiled (+25.0% against eager)"
    )
    assert compiled_regions.against_whole_model({**eager, "turns": {WHOLE_MODEL: timed(None, None)}}) is None
    assert compiled_regions.against_whole_model({**row, "turns": {"regions": timed(-20.0, 3.0)}}) is None
    # the chosen plan with malloc's thresholds fixed: its own line, named with what the planner said
    fixed = {
        **eager,
        "allocator": {"chosen": True, "faults_per_step": [5968.4, 4000.0]},
        "turns": {WHOLE_MODEL: timed(-8.0, 4.0), "allocator": timed(-9.0, 3.0)},
    }
    assert compiled_regions.against_whole_model(fixed, "allocator") == (
        "chosen eager + malloc thresholds fixed (chosen; recorded 5,968, 4,000 faults a step): -1.1% (+-5.0) "
        "against the whole model compiled (-8.0% against eager)"
    )
    assert compiled_regions.against_whole_model(eager, "allocator") is None  # not in the turns
