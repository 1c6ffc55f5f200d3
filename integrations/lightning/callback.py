"""QSyncCallback: a thin adapter from Lightning's hooks to the record -> predict -> plan -> apply ->
verify loop.

Step by step, counted at ``on_train_batch_start``:

- ``warmup_steps`` steps run untouched (the last one under the profiler, unrecorded);
- ``profile_steps`` steps are recorded on every rank, every other step, the steps between them
  timed (`TorchRecorder`); then each rank writes its raw and normalized trace to
  ``<output_dir>/trace/rank<k>/``;
- ``measure_steps`` more steps run without the profiler and are timed;
- then rank 0 gathers every rank's trace, predicts, prints the summary, writes
  ``<output_dir>/report.json`` and logs the figures to the trainer's logger (modes "report" and
  "apply"; mode "record" stops after writing the traces).

Mode "apply" also gathers the precision indicator's statistics in the first steps and probes each
layer at each precision after the window; rank 0 then plans (`planner/precision.py`), prints the
plan and sends it to every rank; all ranks switch to it at the same step boundary. The run is
recorded again (``verify_steps`` steps, in ``<output_dir>/verify/``); rank 0 compares measured
with predicted and decides to keep the plan or roll back to the baseline (`verify.py`), and every
rank follows. What is kept goes to ``<output_dir>/plan.json``, the callback's ``state_dict`` (a
resumed run re-applies it without planning) and the plan cache, from which the next launch of the
same job applies it at step 0 without profiling. ``plan="plan.json"`` applies a given plan at
step 0 in the same way.

The callback never breaks training: any failure of its own warns once, with the cause, and the
callback steps aside (a plan half-applied is undone first). Ranks agree (one all-reduce of a flag)
before each step that involves them all, so a failure on one rank can never leave another waiting.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info

from qsync_callback.cache import cached_plan, store_plan
from qsync_callback.errors import QSyncInputError
from qsync_callback.fail_safe import FailSafe
from qsync_callback.lp.swap import apply_precision_plan, restore
from qsync_callback.plan import PRECISIONS, Plan
from qsync_callback.planner.precision import plan_precision
from qsync_callback.recorder.torch_recorder import TorchRecorder, batch_shapes_of, torch_fingerprint
from qsync_callback.recorder.trace import Trace, rank_trace_path
from qsync_callback.report import (
    REPORT_FILE,
    build_report,
    format_precision_plan,
    format_summary,
    format_verification,
    write_report,
)
from qsync_callback.units import parse_bytes, parse_share
from qsync_callback.verify import verify_plan

MODES = ("record", "report", "apply")
METRIC_PREFIX = "qsync/"
PLAN_FILE = "plan.json"
VERIFICATION_FILE = "verification.json"
VERIFY_WARMUP_STEPS = 4  # after switching: two cold steps, one timed, one under the profiler unrecorded
DEFAULT_PRECISIONS = ("fp32", "bf16", "fp16", "int8")


class QSyncCallback(pl.Callback):
    """Record a few steps of the live run, report measured against predicted step time and memory,
    and (mode "apply") switch the run to the best per-layer precision plan.

    Args:
        mode: "record" (write traces only), "report" (also predict, print and write report.json) or
            "apply" (also plan, apply, verify and keep).
        warmup_steps: steps before the recorded window (at least 2).
        profile_steps: steps recorded under the profiler.
        measure_steps: unprofiled steps timed after each window.
        output_dir: where traces, the report and the plan go; default ``<trainer.log_dir>/qsync``.
        memory_budget: mode "apply": the largest predicted peak memory allowed, in bytes, as text
            ("2GB", "512MiB"), or as a share of the recorded configuration's predicted peak ("90%").
        max_step_time: mode "apply": the longest predicted step allowed, in seconds; default: 5%
            over the fastest plan's predicted step time.
        precisions: the precisions a plan may use (fp32 always included; those a layer cannot run
            on this device are left out for it).
        verify_steps: steps recorded after applying a plan.
        best_effort: mode "apply": when no plan meets ``memory_budget`` / ``max_step_time``, apply
            the closest one (the least-memory plan, or the least-violating) instead of none.
        plan: a plan file to apply at step 0, without recording or planning.
        plan_cache: where kept plans live between launches: True for the user's cache directory,
            a directory, or False for none.
    """

    def __init__(
        self,
        mode: str = "report",
        warmup_steps: int = 10,
        profile_steps: int = 5,
        measure_steps: int = 10,
        output_dir: str | Path | None = None,
        *,
        memory_budget: str | int | None = None,
        max_step_time: float | None = None,
        precisions: Iterable[str] = DEFAULT_PRECISIONS,
        verify_steps: int = 3,
        best_effort: bool = False,
        plan: str | Path | None = None,
        plan_cache: bool | str | Path = True,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if warmup_steps < 2 or profile_steps < 1 or measure_steps < 0 or verify_steps < 1:
            raise ValueError(
                "need warmup_steps >= 2, profile_steps >= 1, measure_steps >= 0 and verify_steps >= 1"
            )
        self.precisions = ("fp32", *(p for p in dict.fromkeys(precisions) if p != "fp32"))
        unknown = [p for p in self.precisions if p not in PRECISIONS]
        if unknown:
            raise ValueError(
                f"unknown precision(s) {', '.join(unknown)}; choose from {', '.join(PRECISIONS)}"
            )
        if max_step_time is not None and not max_step_time > 0:
            raise ValueError(f"max_step_time must be a positive number of seconds, not {max_step_time!r}")
        self.mode = mode
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.measure_steps = measure_steps
        self.verify_steps = verify_steps
        self.best_effort = best_effort
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.memory_budget_share = parse_share(memory_budget) if memory_budget is not None else None
        self.memory_budget = (
            parse_bytes(memory_budget)
            if memory_budget is not None and self.memory_budget_share is None
            else None
        )
        self.max_step_ms = max_step_time * 1e3 if max_step_time is not None else None
        self.plan_path = Path(plan) if plan is not None else None
        self.plan_cache_dir = None if isinstance(plan_cache, bool) else Path(plan_cache)
        self.use_plan_cache = plan_cache is not False
        self.report: dict[str, Any] | None = None
        self.verification: dict[str, Any] | None = None
        self.plan: Plan | None = None  # the plan in force (applied and kept), on every rank
        self._recorder: TorchRecorder | None = None
        self._model: pl.LightningModule | None = None
        self._phase = "baseline"
        self._window_start = 0
        self._steps = 0
        self._fingerprint: dict[str, Any] = {}
        self._lp_modules: dict = {}
        self._loss_finite = True
        self._resume_plan: Plan | None = None
        self._safe = FailSafe("QSyncCallback", self._close)
        self._finished = False

    @property
    def applies_plans(self) -> bool:
        return self.mode == "apply" or self.plan_path is not None

    # ----------------------------------------------------------------- Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._finished:
            return
        self._safe.run(self._resolve_output_dir, trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._finished:
            return
        step = self._steps
        self._steps += 1
        if step == 0:
            self._safe.run(self._start, trainer, pl_module, batch)
            if self.applies_plans and self._apply_start_plan(trainer, pl_module):
                return
        self._window_step(trainer, pl_module, step - self._window_start)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._phase == "verify" and not self._finished:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all()):
                self._loss_finite = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._finished:
            return
        if self._recorder is not None and self._recorder.trace is None and self._safe.ok:
            self._safe.fail("training ended before the recorded window was complete; nothing was recorded")
        self._window_done(trainer, pl_module)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def state_dict(self) -> dict[str, Any]:
        return {
            "finished": self._finished,
            "output_dir": str(self.output_dir) if self.output_dir else None,
            "plan": self.plan.to_dict() if self.plan is not None and not self.plan.is_empty else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._finished = bool(state_dict.get("finished", False))
        if state_dict.get("output_dir") and self.output_dir is None:
            self.output_dir = Path(state_dict["output_dir"])
        if state_dict.get("plan") is not None:
            self._resume_plan = Plan.from_dict(
                state_dict["plan"], source="the checkpoint's QSyncCallback state"
            )
            self._finished = False  # re-apply it at the first step of the resumed run

    # ----------------------------------------------------------------- the recorded window

    def _resolve_output_dir(self, trainer: pl.Trainer) -> None:
        if self.output_dir is None:
            base = trainer.log_dir or trainer.default_root_dir
            self.output_dir = Path(base) / "qsync"
        self.output_dir = Path(trainer.strategy.broadcast(str(self.output_dir), src=0))

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        if self.output_dir is None:
            self._resolve_output_dir(trainer)
        self._model = pl_module
        device = pl_module.device
        self._fingerprint = torch_fingerprint(
            pl_module, batch_shapes_of(batch), trainer.world_size, device.type
        )
        self._recorder = self._new_recorder(
            trainer, pl_module, self.output_dir, self.warmup_steps, self.profile_steps
        )

    def _new_recorder(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, where: Path, warmup: int, profile: int
    ) -> TorchRecorder:
        device = pl_module.device
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        planning = self.mode == "apply" and self._phase == "baseline"
        return TorchRecorder(
            pl_module,
            trainer.optimizers,
            where / "trace",
            warmup_steps=warmup,
            profile_steps=profile,
            ddp_module=trainer.strategy.model,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            device=device.type if device.type != "cuda" else f"cuda ({device_name})",
            fingerprint=self._fingerprint,
            probe_precisions=self.precisions if planning else (),
            layer_statistics=planning,
        )

    def _window_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """Drive the recorder at the boundary before local ``step`` of its window; the agreement
        points are reached by every rank whatever its state, so that no rank waits alone."""
        recorder = self._recorder
        warmup = self.warmup_steps if self._phase == "baseline" else VERIFY_WARMUP_STEPS
        open_at = warmup - 1
        if step == open_at and not self._agree(trainer):  # also the clock-sync barrier
            return
        if recorder is not None and self._safe.ok:
            self._safe.run(recorder.step_boundary)
        if step == open_at - 1:
            # calibrate before the ranks meet at the clock-sync barrier, and agree first
            if recorder is not None:
                self._safe.run(recorder.prepare_window)
            if not self._agree(trainer):
                return
            recorder.restart_step_clock()
        if recorder is not None and step in recorder.session_end_steps:
            # the unprofiled step after a session starts together on all ranks
            if not self._agree(trainer):
                return
            recorder.restart_step_clock()
        if recorder is not None and step == recorder.close_step + self.measure_steps:
            self._window_done(trainer, pl_module)

    def _window_done(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save the measured steps into the trace, then report, plan or verify."""
        recorder = self._recorder
        ok = self._safe.ok and recorder is not None and recorder.trace is not None
        if ok:
            ok = self._safe.run(recorder.save)
        if not self._agree(trainer, ok) or self.mode == "record":
            self._finished = True
            self._close()
            return
        self._close()
        texts = self._exchange(trainer, json.dumps(recorder.trace.to_dict()))
        traces = None
        if trainer.global_rank == 0 and texts is not None:
            traces = self._safe.run(_parse_traces, texts)
        if self._phase == "baseline":
            self._after_baseline(trainer, pl_module, traces)
        else:
            self._after_verify(trainer, pl_module, traces)

    # ----------------------------------------------------------------- report, plan, apply, verify

    def _after_baseline(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, traces: list | None
    ) -> None:
        plan_text = ""
        if traces is not None:
            self._safe.run(self._report, trainer, traces)
            if self.mode == "apply" and self.report is not None:
                plan_text = self._safe.run(self._plan, traces) or ""
        if self.mode != "apply":
            self._finished = True
            return
        plan_text = (self._exchange(trainer, plan_text) or [""])[0]
        if not plan_text:
            self._finished = True
            return
        if self._apply(trainer, pl_module, Plan.from_json(plan_text, source="rank 0's plan")):
            self._phase = "verify"
            self._window_start = self._steps - 1
            self._recorder = self._safe.run(
                self._new_recorder,
                trainer,
                pl_module,
                self.output_dir / "verify",
                VERIFY_WARMUP_STEPS,
                self.verify_steps,
            )
            self._window_step(trainer, pl_module, 0)

    def _report(self, trainer: pl.Trainer, traces: list[Trace]) -> None:
        for trace in traces:
            path = rank_trace_path(self.output_dir / "trace", trace.rank)
            if not path.exists():
                trace.save(path)
        self.report = build_report(traces)
        write_report(self.report, self.output_dir / REPORT_FILE)
        rank_zero_info(format_summary(self.report) + f"\n  written to {self.output_dir}")
        if trainer.logger is not None:
            trainer.logger.log_metrics(_metrics(self.report), step=trainer.global_step)

    def _plan(self, traces: list[Trace]) -> str:
        """Rank 0: choose the plan; its JSON if it changes anything, else "" (and keep the baseline)."""
        if self.memory_budget_share is not None:
            self.memory_budget = int(self.memory_budget_share * self.report["predicted"]["peak_bytes"])
        try:
            choice, indicator = plan_precision(
                traces,
                self.precisions,
                max_step_ms=self.max_step_ms,
                memory_budget=self.memory_budget,
                best_effort=self.best_effort,
            )
        except QSyncInputError as error:
            rank_zero_info(f"qsync: no plan applied: {error}")
            return ""
        rank_zero_info(format_precision_plan(choice, indicator, self.report["predicted"], traces[0].layers))
        if not (choice.feasible or self.best_effort):
            rank_zero_info(
                "qsync: no plan meets the constraints; keeping the recorded configuration "
                "(best_effort=True applies the closest plan)"
            )
            return ""
        if choice.plan.is_empty:
            rank_zero_info("qsync: the recorded configuration is the plan; nothing to apply")
            self._keep(choice.plan)
            return ""
        return choice.plan.to_json()

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, plan: Plan) -> bool:
        """Switch every rank to ``plan`` at this step boundary; all ranks or none."""
        swapped = self._safe.run(apply_precision_plan, pl_module, plan.precision)
        if not self._agree(trainer, swapped is not None):
            if swapped is not None:
                restore(pl_module, swapped)
            return False
        self._lp_modules, self.plan = swapped, plan
        return True

    def _after_verify(self, trainer: pl.Trainer, pl_module: pl.LightningModule, traces: list | None) -> None:
        self._finished = True
        loss_finite = self._loss_finite
        if trainer.world_size > 1:
            loss_finite = bool(trainer.strategy.reduce_boolean_decision(loss_finite, all=True))
        decision = ""
        if traces is not None:
            decision = self._safe.run(self._verify, traces, loss_finite) or ""
        decision = (self._exchange(trainer, decision) or [""])[0]
        if decision != "keep":
            self._rollback()
        if trainer.global_rank == 0:
            self._safe.run(self._keep, self.plan if decision == "keep" else Plan.empty(self._fingerprint))

    def _verify(self, traces: list[Trace], loss_finite: bool) -> str:
        self.verification = verify_plan(
            self.plan, self.report, traces, loss_finite=loss_finite, memory_budget=self.memory_budget
        )
        write_report(self.verification, self.output_dir / VERIFICATION_FILE)
        rank_zero_info(format_verification(self.verification))
        return self.verification["decision"]

    def _rollback(self) -> None:
        """Back to the stock layers (the recorded configuration)."""
        if self._lp_modules:
            restore(self._model, self._lp_modules)
        self._lp_modules, self.plan = {}, None

    def _keep(self, plan: Plan) -> None:
        """Rank 0: write the plan in force to ``plan.json`` and the plan cache."""
        plan.save(self.output_dir / PLAN_FILE)
        if self.use_plan_cache:
            path = store_plan(plan, self.plan_cache_dir)
            rank_zero_info(f"qsync: plan kept in {self.output_dir / PLAN_FILE} and {path}")

    def _apply_start_plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """At step 0: apply a resumed, given or cached plan (rank 0 finds it, every rank applies it).
        Returns True when the callback is done: mode "apply" with a plan applied, or a failure. In
        modes "record" and "report" the run under the plan is then recorded and reported."""
        found = ""
        if trainer.global_rank == 0:
            found = self._safe.run(self._find_start_plan) or ""
        found = (self._exchange(trainer, found) or [""])[0]
        if not self._agree(trainer):
            return True
        if not found:
            return False
        plan = Plan.from_json(found, source="rank 0's plan")
        if not self._apply(trainer, pl_module, plan):
            return True
        rank_zero_info(f"qsync: applied the plan at step 0 ({len(plan.precision)} layers set)")
        if self.mode == "apply":
            self._finished = True
            self._close()
        return self._finished

    def _find_start_plan(self) -> str:
        """Rank 0: the JSON of the plan to apply at step 0, or "" if there is none. A given plan
        that cannot be applied raises QSyncInputError; a kept one only says why it is not used."""
        if self._resume_plan is not None or self.plan_path is not None:
            plan = self._resume_plan or Plan.load(self.plan_path)
            source = "the checkpoint's plan" if self._resume_plan is not None else str(self.plan_path)
            plan.check_for(self._fingerprint, source=source)
        else:
            plan, why_not = (
                cached_plan(self._fingerprint, self.plan_cache_dir) if self.use_plan_cache else (None, None)
            )
            if why_not:
                rank_zero_info(f"qsync: not applying the kept plan: {why_not}; planning afresh")
            if plan is None:
                return ""
            source = "the plan cache"
        rank_zero_info(f"qsync: applying the plan from {source}")
        return plan.to_json()

    # ----------------------------------------------------------------- failure handling

    def _agree(self, trainer: pl.Trainer, ok: bool | None = None) -> bool:
        """All ranks go on only if every rank is still healthy (one all-reduce of a flag)."""
        ok = self._safe.ok if ok is None else bool(ok)
        if trainer.world_size > 1:
            ok = bool(trainer.strategy.reduce_boolean_decision(ok, all=True))
        if not ok:
            if self._safe.ok:
                self._safe.fail("another rank failed; this rank steps aside too")
            self._finished = True
            if self._phase == "verify":
                self._rollback()  # a plan is never left in force unverified
        return ok

    def _exchange(self, trainer: pl.Trainer, text: str) -> list[str] | None:
        """Every rank's ``text`` (rank 0's is how it sends to all). Every rank takes part whatever
        its state, so that none waits alone; None if the collective itself failed."""
        try:
            return _gather_strings(trainer, text)
        except Exception as exc:  # noqa: BLE001 - the callback must never break training
            self._safe.fail(f"exchanging with the other ranks failed: {type(exc).__name__}: {exc}")
            return None

    def _close(self) -> None:
        if self._recorder is not None:
            try:
                self._recorder.close()
            except Exception as exc:  # noqa: BLE001
                warnings.warn(
                    f"QSyncCallback could not stop the profiler: {exc}", RuntimeWarning, stacklevel=2
                )


def _parse_traces(texts: list[str]) -> list[Trace]:
    return [Trace.from_dict(json.loads(t), source=f"rank {i} trace") for i, t in enumerate(texts)]


def _gather_strings(trainer: pl.Trainer, text: str) -> list[str]:
    """Every rank's ``text``, in rank order (via the strategy's all_gather of byte tensors); rank
    0's entry is how rank 0 sends a string to every rank."""
    if trainer.world_size == 1:
        return [text]
    device = trainer.strategy.root_device
    data = torch.tensor(bytearray(text.encode()), dtype=torch.uint8, device=device)
    sizes = trainer.strategy.all_gather(torch.tensor([data.numel()], device=device)).view(-1).tolist()
    padded = torch.zeros(max(max(sizes), 1), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = trainer.strategy.all_gather(padded).cpu()
    return [bytes(gathered[i, : sizes[i]].tolist()).decode() for i in range(len(sizes))]


def _metrics(report: dict[str, Any]) -> dict[str, float]:
    figures = {
        "measured_step_ms": report["measured"]["step_ms"],
        "predicted_step_ms": report["predicted"]["step_ms"],
        "measured_peak_bytes": report["measured"]["peak_bytes"],
        "predicted_peak_bytes": report["predicted"]["peak_bytes"],
        "step_ms_error_pct": report["error_pct"]["step_ms"],
        "peak_bytes_error_pct": report["error_pct"]["peak_bytes"],
    }
    return {METRIC_PREFIX + k: float(v) for k, v in figures.items() if v is not None}
