"""QSyncCallback: Lightning's hooks, forwarded to the tuning loop (`qsync_callback.tuning_loop`).

The loop records a window of the live run on every rank, reports measured against predicted step
time and memory, and in mode "apply" plans, applies the plan on every rank at one step, verifies
it and keeps it or rolls back. This class only turns Lightning's hooks into the loop's: a step is
an optimizer step (with ``accumulate_grad_batches=N``, N micro-batches), and what the loop needs
from Lightning (ranks, recorder, appliers, log) is `LightningRun`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn

from qsync_callback.activation_trial import TRIAL_ROUNDS
from qsync_callback.alternation import LOOKS, ROUNDS
from qsync_callback.fit_check import DoesNotFit, FitCheck, check_fit
from qsync_callback.integrations.lightning.lightning_run import LightningRun
from qsync_callback.plan import DEFAULT_PRECISIONS, LEVERS, Constraints, Plan
from qsync_callback.tuning_loop import LoopSettings, TuningLoop
from qsync_callback.units import check_count


class QSyncCallback(pl.Callback):
    """Record a few steps of the live run, report measured against predicted step time and memory,
    and (mode "apply") switch the run to the best plan.

    Args:
        mode: "record" (write traces only), "report" (also predict, print and write report.json) or
            "apply" (also plan, apply, verify and keep).
        warmup_steps: optimizer steps before the recorded window (at least 2).
        profile_steps: steps recorded under the profiler (at least 1).
        measure_steps: unprofiled steps timed after each window.
        output_dir: where traces, the report and the plan go; default ``<trainer.log_dir>/qsync``.
        memory_budget: mode "apply": the largest predicted peak allowed: bytes (``6e9``), a size
            ("2GB", "512MiB") or a share of the recorded configuration's predicted peak ("90%").
        max_step_time: mode "apply": the longest predicted step allowed, in seconds; default: 5%
            over the fastest plan's predicted step time.
        precisions: the precisions a plan may use (fp32 always included; those a layer cannot run
            on this device are left out for it).
        levers: what a plan may change: some of "precision", "activation" (per module: keep,
            recompute or offload its saved activations; chosen only to meet ``memory_budget``),
            "regions", "buckets", "allocator" (glibc malloc's thresholds, on a CPU).
        verify_steps: steps recorded after applying a plan.
        alternate_rounds: after those, rounds of the recorded configuration and the plan in turns
            (each a block of 1 + 4 steps of each; 0: none), on which keep or roll back is decided
            (a drift of the machine's speed between the two recorded windows cancels in each round);
            while they cannot tell the plan from the baseline, as many more, up to ``alternate_looks``
            times as many (fewer: a shorter run decides sooner, and says it could not tell more often).
        activation_trial_rounds: mode "apply" with ``memory_budget`` and the "activation" lever:
            after the measured steps, rounds of the recorded configuration and an offload of the
            model's outermost modules in turns (on the CPU), then as many of it and a recompute of
            the blocks among them (each a block of 1 + 4 steps of each; on one process, as many more
            while the change is too noisy, up to 3 times as many: `activation_trial.TRIAL_LOOKS`), to
            measure what each policy costs this run's steps over its price (`activation_trial.py`);
            0: none, the copy-cost fit and the recorded forward alone price them.
        best_effort: mode "apply": when no plan meets ``memory_budget`` / ``max_step_time``, apply
            the closest one (the least-memory plan, or the least-violating) instead of none.
        plan: a plan file to apply at step 0, without recording or planning.
        plan_cache: where kept plans live between launches: True for the user's cache directory,
            a directory, or False for none.
        check_fit: before step 1, trace the step on fake tensors at the Trainer's precision
            (`qsync_callback.fit_check`) and warn when its predicted peak is over ``memory_budget``
            (in bytes or a size) or the device's memory, naming a plan that would fit; the result
            is `fit_check`.
        strict: with ``check_fit``, raise `DoesNotFit` instead of warning.
    """

    def __init__(
        self,
        mode: str = "report",
        warmup_steps: int = 10,
        profile_steps: int = 5,
        measure_steps: int = 10,
        output_dir: str | Path | None = None,
        *,
        memory_budget: str | int | float | None = None,
        max_step_time: float | None = None,
        precisions: Iterable[str] = DEFAULT_PRECISIONS,
        levers: Iterable[str] = LEVERS,
        verify_steps: int = 3,
        alternate_rounds: int = ROUNDS,
        alternate_looks: int = LOOKS,
        activation_trial_rounds: int = TRIAL_ROUNDS,
        best_effort: bool = False,
        plan: str | Path | None = None,
        plan_cache: bool | str | Path = True,
        check_fit: bool = False,
        strict: bool = False,
    ):
        settings = LoopSettings.from_arguments(
            mode,
            warmup_steps,
            profile_steps,
            measure_steps,
            verify_steps,
            output_dir,
            constraints=Constraints.from_arguments(
                memory_budget, max_step_time, precisions, levers, best_effort
            ),
            plan=plan,
            plan_cache=plan_cache,
            alternate_rounds=alternate_rounds,
            alternate_looks=alternate_looks,
        )
        check_count(activation_trial_rounds, "activation_trial_rounds", 0)
        self._activation_trial_rounds = activation_trial_rounds
        self._loop = TuningLoop(settings, who="QSyncCallback")
        self._run: LightningRun | None = None
        self._fit_unchecked = check_fit
        self._strict = strict
        self.fit_check: FitCheck | None = None

    @property
    def mode(self) -> str:
        return self._loop.settings.mode

    @property
    def output_dir(self) -> Path | None:
        return self._loop.output_dir

    @property
    def report(self) -> dict[str, Any] | None:
        return self._loop.report

    @property
    def verification(self) -> dict[str, Any] | None:
        return self._loop.verification

    @property
    def constraints(self) -> Constraints:
        """What plans are chosen under; after the report, a budget share is in bytes."""
        return self._loop.constraints

    @property
    def plan(self) -> Plan | None:
        """The kept plan in force (None: the recorded configuration)."""
        return self._loop.plan

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._loop.output_dir is None:
            base = trainer.log_dir or trainer.default_root_dir
            self._loop.output_dir = Path(trainer.strategy.broadcast(str(Path(base) / "qsync"), src=0))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % max(trainer.accumulate_grad_batches, 1) != 0:
            return
        if self._fit_unchecked:
            self._fit_unchecked = False
            self._check_fit(trainer, pl_module, batch)
        if self._loop.finished and not self._loop.watching:  # a kept offload plan is watched
            return
        if self._run is None:
            constraints = self._loop.settings.constraints
            precisions = constraints.precisions if "precision" in constraints.levers else ()
            self._run = LightningRun(
                trainer,
                pl_module,
                batch,
                precisions,
                "activation" in constraints.levers,
                "regions" in constraints.levers,
                # activation policies are chosen only to meet a memory budget
                self._activation_trial_rounds
                if "activation" in constraints.levers and constraints.budgeted
                else 0,
            )
        self._loop.step_boundary(self._run)

    def _check_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        device = str(pl_module.device)
        try:
            check = check_fit(
                pl_module,
                batch,
                self._loop.settings.constraints,
                device,
                trainer.num_devices,
                trainer.precision,
            )
        except Exception as error:  # noqa: BLE001 - the check must never break training
            rank_zero_warn(
                f"QSyncCallback could not check the fit before step 1: {type(error).__name__}: {error}"
            )
            return
        self.fit_check = check
        if check.fits:
            rank_zero_info(f"QSyncCallback: {check.message()}")
        elif self._strict:
            raise DoesNotFit(check.message())
        else:
            rank_zero_warn(f"QSyncCallback: {check.message()}")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        finite = True
        if self._loop.verifying:  # a plan is on trial: its loss must stay finite
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            finite = not isinstance(loss, torch.Tensor) or bool(torch.isfinite(loss.detach()).all())
        self._loop.step_end(finite)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop.train_end()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._loop.exception()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._loop.close()

    def state_dict(self) -> dict[str, Any]:
        return self._loop.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loop.load_state_dict(state_dict)
