"""Several plans measured in turns with the recorded configuration, in one Lightning run.

Fresh processes of one configuration differ by more than many plans change (glibc's allocator
regime, a drift of the machine's speed), so plans measured each in its own process cannot be
ranked to a few percent. `PlansInTurns` applies each plan live, through the appliers the callback
uses (`tuning_loop.apply_plan`: precision, activation policies and compiled regions, a region
compiled in its plan's first block, in a step not timed), at step boundaries of one run. After
`WARMUP_STEPS` untimed steps of the recorded configuration (a process's first steps run slow: its
caches and allocator are cold), every round runs, for each plan in turn (the order rotated by one
each round), a block of the recorded configuration and then a block of the plan. A block's first
`alternation.SETTLE_STEPS` steps after the switch are not timed, the next
`alternation.BLOCK_STEPS` are, from the start of one step to the start of the next, the switching
itself outside them. Each plan's change against the recorded configuration is
`alternation.paired_change` over its rounds (a block of the plan against the baseline block right
before it): a drift of the machine's speed cancels in each pair, as in the loop's own turns.

A plan that fixes glibc malloc's thresholds is undone to the thresholds the recorded steps ran
under (``malloc_in_force``, each rank's, from the recording's traces), as the loop's undo does.

A "plan" may also be `WHOLE_MODEL`: the LightningModule compiled whole, the way Lightning compiles
a model given to ``fit`` compiled (`compile_whole_model`), so that a plan and the whole model compiled
are each measured against the recorded configuration in the same rounds.

A benchmark runs them in a fresh process of its own script (`measure_in_turns`), whose worker mode
"turns" calls `turns_worker`. With ``after_recording`` the process first records and reports a
window as a user's run does (``QSyncCallback(mode="report")``, its defaults), and the warm-up starts
once its report is out: the loop applies a plan in the process that recorded, whose allocator the
recording's own allocations and frees left in another regime than a fresh process's (the
benchmarks' ResNet: 2 page faults a step in its recording, 4,200-5,700 in fresh turns processes,
session 45).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from models import get_model, timed_fit
from pytorch_lightning.utilities.compile import from_compiled, to_uncompiled
from runs import launch, stderr_tail

from qsync_callback import QSyncCallback
from qsync_callback.alternation import BASELINE, BLOCK_STEPS, PAGE_FAULTS, PLAN, SETTLE_STEPS, paired_change
from qsync_callback.appliers.malloc_thresholds import MallocThresholdApplier
from qsync_callback.appliers.torch_activation import ActivationApplier
from qsync_callback.appliers.torch_precision import precision_applier
from qsync_callback.appliers.torch_regions import RegionApplier
from qsync_callback.mean_band import combined_noise_pct
from qsync_callback.page_faults import minor_page_faults
from qsync_callback.plan import Plan
from qsync_callback.recorder.torch_recorder import window_close_step
from qsync_callback.tuning_loop import LoopSettings, apply_plan

BLOCK_LENGTH = SETTLE_STEPS + BLOCK_STEPS
WARMUP_STEPS = 5
TURN_ROUNDS = 6
TURNS_FILE = "turns.json"
WHOLE_MODEL = "whole model"  # in a turns listing: the LightningModule compiled whole


def compile_whole_model(module: pl.LightningModule) -> Callable[[], None]:
    """Compile ``module`` whole, in place, as Lightning compiles a model given to ``fit`` compiled
    (`from_compiled`: its forward and step methods under one ``torch.compile``); the undo
    (`to_uncompiled`). Dynamo keeps its graphs per code object: compiled again after an undo, the
    module runs them again without compiling."""
    from_compiled(torch.compile(module))
    return lambda: to_uncompiled(module)


class PlansInTurns(pl.Callback):
    """``plans`` (each a `Plan` or `WHOLE_MODEL`) in turns with the recorded configuration for
    ``rounds`` rounds (see the module docstring); the run needs `steps` steps. `results` gives each
    plan's `paired_change`."""

    def __init__(
        self,
        plans: Sequence[Plan | str],
        rounds: int,
        warmup_steps: int = WARMUP_STEPS,
        malloc_in_force: Sequence[Mapping[str, int]] | None = None,
        ready: Callable[[], bool] | None = None,
    ):
        self.plans = list(plans)
        self._malloc_in_force = malloc_in_force  # per rank: what a malloc plan's undo sets
        self._ready = ready  # the warm-up starts at the first step it says True (None: at once)
        self._warmup = warmup_steps
        # per step after the warm-up: (round, plan index, configuration, timed); the block it is in
        self._schedule = [
            (r, i, config, k >= SETTLE_STEPS)
            for r in range(rounds)
            for j in range(len(self.plans))
            for i in [(j + r) % len(self.plans)]
            for config in (BASELINE, PLAN)
            for k in range(BLOCK_LENGTH)
        ]
        # per plan, as `alternation.BlockTimes.record` gives a rank's: each block's step times (ms)
        # by configuration and round, and their page faults under PAGE_FAULTS
        self._records: list[dict[str, Any]] = [
            {
                BASELINE: [[] for _ in range(rounds)],
                PLAN: [[] for _ in range(rounds)],
                PAGE_FAULTS: {BASELINE: [[] for _ in range(rounds)], PLAN: [[] for _ in range(rounds)]},
            }
            for _ in self.plans
        ]
        self._appliers: dict[str, Any] = {}
        self._module: pl.LightningModule | None = None
        self._undo = None
        self._started = 0.0
        self._started_faults = 0
        self._step = 0  # the run's steps started so far

    @property
    def steps(self) -> int:
        """The steps the warm-up and the turns take, and one more whose start ends the last timed
        step (after `ready` said True; the steps after them run the recorded configuration)."""
        return self._warmup + len(self._schedule) + 1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._appliers = {
            "precision": precision_applier(pl_module),
            "activation": ActivationApplier(pl_module),
            "fused_regions": RegionApplier(pl_module),
            "malloc_thresholds": MallocThresholdApplier(
                lambda: self._malloc_in_force[trainer.global_rank] if self._malloc_in_force else None
            ),
        }
        self._module = pl_module

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now, faults = time.perf_counter(), minor_page_faults()
        if self._ready is not None and not self._ready():
            return
        self._ready = None
        step, self._step = self._step - self._warmup, self._step + 1  # this step, in the turns
        if step < 0 or step > len(self._schedule):  # the warm-up, or steps after the turns
            return
        if step > 0:
            r, i, config, timed = self._schedule[step - 1]
            if timed:
                self._records[i][config][r].append((now - self._started) * 1e3)
                self._records[i][PAGE_FAULTS][config][r].append(faults - self._started_faults)
        if step == len(self._schedule):
            self._close()  # the step that ends the last timed one runs the recorded configuration
        elif step < len(self._schedule):
            if step % BLOCK_LENGTH == 0:
                self._switch(*self._schedule[step][1:3])
            self._started, self._started_faults = time.perf_counter(), minor_page_faults()

    def _switch(self, index: int, config: str) -> None:
        """Undo what is in force; apply plan ``index`` where the block is the plan's."""
        self._close()
        plan = self.plans[index]
        if config == PLAN and plan == WHOLE_MODEL:
            self._undo = compile_whole_model(self._module)
        elif config == PLAN:
            self._undo = apply_plan(plan, self._appliers)

    def _close(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def results(self) -> list[dict[str, Any]]:
        """Per plan, in ``plans``' order: `paired_change` of its rounds, with their page faults."""
        return [paired_change([record]) for record in self._records]


def turns_worker(model: str, run_dir: Path, plan_files: Path, batches: int | None = None) -> None:
    """The plans listed in ``plan_files`` (JSON: the plans' paths or `WHOLE_MODEL`, the rounds and
    the processes, as `measure_in_turns` writes them) in turns with the recorded configuration, in
    one training run of ``model`` (in a subprocess; under DDP on more than one process, each rank
    applying each plan at the same step; ``batches``: `timed_fit`'s); each plan's `paired_change` in
    ``run_dir / TURNS_FILE``, in the list's order, from rank 0's clock (DDP's all-reduces keep the
    ranks' steps in step). The listing's ``after_recording``: the turns follow a recorded window (see
    the module docstring)."""
    listing = json.loads(plan_files.read_text())
    plans = [path if path == WHOLE_MODEL else Plan.load(path) for path in listing["plans"]]
    callbacks: list[pl.Callback] = []
    window, ready = 0, None
    if listing.get("after_recording"):
        recording = QSyncCallback(mode="report", output_dir=run_dir / "recorded", plan_cache=False)
        s = LoopSettings()  # the window's steps, its report out at the boundary after the last
        window = window_close_step(s.warmup_steps, s.profile_steps) + s.measure_steps + 1
        callbacks.append(recording)
        ready = lambda: recording.report is not None  # noqa: E731
    in_force = listing.get("malloc_in_force")
    turns = PlansInTurns(plans, listing["rounds"], malloc_in_force=in_force, ready=ready)
    trainer, *_ = timed_fit(
        get_model(model), window + turns.steps, [*callbacks, turns], listing["procs"], batches=batches
    )
    if trainer.global_rank == 0:
        (run_dir / TURNS_FILE).write_text(json.dumps(turns.results()))


def measure_in_turns(
    script: Path,
    model: str,
    files: Mapping[str, Path | str],
    run_dir: Path,
    timeout: float,
    rounds: int = TURN_ROUNDS,
    procs: int = 1,
    malloc_in_force: Sequence[Mapping[str, int]] | None = None,
    after_recording: bool = False,
) -> dict[str, Any]:
    """Run the plans in ``files`` (saved plans' paths or `WHOLE_MODEL`, by key) in turns for
    ``rounds`` rounds in one fresh run of ``script``'s worker mode "turns" on ``procs`` processes
    (``malloc_in_force``: `PlansInTurns`'; ``after_recording``: `turns_worker`'s); each key's
    `paired_change`, or none where the run failed (said on stderr)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    listing = run_dir.with_name(f"{run_dir.name}-plans.json")
    plans = [str(path) for path in files.values()]
    listing.write_text(
        json.dumps(
            {
                "plans": plans,
                "rounds": rounds,
                "procs": procs,
                "malloc_in_force": malloc_in_force,
                "after_recording": after_recording,
            }
        )
    )
    args = ["--worker", model, "--worker-mode", "turns", "--worker-plan", str(listing)]
    rc, _ = launch(script, [*args, "--worker-dir", str(run_dir)], run_dir, timeout)
    if rc != 0 or not (run_dir / TURNS_FILE).exists():
        print(f"[benchmark] {run_dir.name} FAILED (exit {rc}):\n{stderr_tail(run_dir)}", file=sys.stderr)
        return {}
    return dict(zip(files, json.loads((run_dir / TURNS_FILE).read_text()), strict=True))


def in_turns_change(row: Mapping[str, Any]) -> tuple[float, float] | None:
    """A plan's change against the recorded configuration in turns, in %, from its ``in_turns``
    (one `paired_change` per process): the mean over the processes, and its noise (theirs
    combined, over their number); None where no process timed it."""
    measured = [t for t in row.get("in_turns", []) if t["change_pct"] is not None]
    if not measured:
        return None
    noise = combined_noise_pct(*(t["noise_pct"] for t in measured)) / len(measured)
    return sum(t["change_pct"] for t in measured) / len(measured), noise


def page_faults_cell(row: Mapping[str, Any]) -> str:
    """A plan row's page faults a step in turns, "baseline / plan" (the median over the processes
    that counted them; "-" where none did): a configuration run right after another can fault more
    than it does alone, and the change in turns holds that."""
    counted = [t["page_faults_per_step"] for t in row.get("in_turns", []) if t.get("page_faults_per_step")]
    if not counted:
        return "-"
    baseline, plan = (statistics.median(c[config] for c in counted) for config in (BASELINE, PLAN))
    return f"{baseline:.0f} / {plan:.0f}"


def turns_cell(row: Mapping[str, Any]) -> tuple[str, float | None]:
    """A plan row's table cell for its change in turns, "predicted / measured (+-noise)" ("-" where
    no process timed it; "n/a" for the predicted change where the row has none), and its step error in
    turns: the predicted step against the measured one, both referred to the recorded configuration's,
    in % (None where not timed or not predicted)."""
    turned = in_turns_change(row)
    if turned is None:
        return "-", None
    predicted = row["predicted_change_pct"]
    measured = f"{turned[0]:+.1f}% (+-{turned[1]:.1f})"
    if predicted is None:  # a configuration the predictor does not price (the whole model compiled)
        return f"n/a / {measured}", None
    return f"{predicted:+.1f}% / {measured}", 100.0 * ((100 + predicted) / (100 + turned[0]) - 1)
