"""QSyncCallback: a thin adapter from Lightning's hooks to the record -> predict -> report loop.

Step by step, counted at ``on_train_batch_start``:

- ``warmup_steps`` steps run untouched (the last one under the profiler, unrecorded);
- ``profile_steps`` steps are recorded on every rank, every other step, the steps between them
  timed (`TorchRecorder`); then each rank writes its raw and normalized trace to
  ``<output_dir>/trace/rank<k>/``;
- ``measure_steps`` more steps run without the profiler and are timed;
- then (mode "report") rank 0 gathers every rank's trace, predicts, prints the summary, writes
  ``<output_dir>/report.json`` and logs the figures to the trainer's logger.

The callback never breaks training: any failure of its own warns once, with the cause, and the
callback steps aside. Ranks agree (one all-reduce of a flag) before each step that involves them
all, so a failure on one rank can never leave another waiting.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info

from qsync_callback.recorder.torch_recorder import TorchRecorder, batch_shapes_of, torch_fingerprint
from qsync_callback.recorder.trace import Trace, rank_trace_path
from qsync_callback.report import REPORT_FILE, build_report, format_summary, write_report

MODES = ("record", "report")
METRIC_PREFIX = "qsync/"


class QSyncCallback(pl.Callback):
    """Record a few steps of the live run and report measured against predicted step time and memory.

    Args:
        mode: "record" (write traces only) or "report" (also predict, print and write report.json).
        warmup_steps: steps before the recorded window (at least 2).
        profile_steps: steps recorded under the profiler.
        measure_steps: unprofiled steps timed after the window before reporting.
        output_dir: where traces and the report go; default ``<trainer.log_dir>/qsync``.
    """

    def __init__(
        self,
        mode: str = "report",
        warmup_steps: int = 10,
        profile_steps: int = 5,
        measure_steps: int = 10,
        output_dir: str | Path | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if warmup_steps < 2 or profile_steps < 1 or measure_steps < 0:
            raise ValueError("need warmup_steps >= 2, profile_steps >= 1 and measure_steps >= 0")
        self.mode = mode
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.measure_steps = measure_steps
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.report: dict[str, Any] | None = None
        self._recorder: TorchRecorder | None = None
        self._steps = 0
        self._failed: str | None = None
        self._finished = False

    # ----------------------------------------------------------------- Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._finished:
            return
        self._guard(self._resolve_output_dir, trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._finished:
            return
        step = self._steps
        self._steps += 1
        open_at = self.warmup_steps - 1
        if step == 0:
            self._guard(self._start, trainer, pl_module, batch)
        if step == open_at and not self._agree(trainer):  # also the clock-sync barrier
            return
        recorder = self._recorder
        if recorder is not None and self._failed is None:
            self._guard(recorder.step_boundary)
        if step == open_at - 1:
            # calibrate before the ranks meet at the clock-sync barrier, and agree first
            if recorder is not None:
                self._guard(recorder.prepare_window)
            if not self._agree(trainer):
                return
            recorder.restart_step_clock()
        if recorder is not None and step in recorder.session_end_steps:
            # the unprofiled step after a session starts together on all ranks
            if not self._agree(trainer):
                return
            recorder.restart_step_clock()
        if recorder is not None and step == recorder.close_step + self.measure_steps:
            self._finish(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._finished:
            return
        if self._recorder is not None and self._recorder.trace is None and self._failed is None:
            self._fail("training ended before the recorded window was complete; nothing was recorded")
        self._finish(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def state_dict(self) -> dict[str, Any]:
        return {"finished": self._finished, "output_dir": str(self.output_dir) if self.output_dir else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._finished = bool(state_dict.get("finished", False))
        if state_dict.get("output_dir") and self.output_dir is None:
            self.output_dir = Path(state_dict["output_dir"])

    # ----------------------------------------------------------------- the loop

    def _resolve_output_dir(self, trainer: pl.Trainer) -> None:
        if self.output_dir is None:
            base = trainer.log_dir or trainer.default_root_dir
            self.output_dir = Path(base) / "qsync"
        self.output_dir = Path(trainer.strategy.broadcast(str(self.output_dir), src=0))

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        if self.output_dir is None:
            self._resolve_output_dir(trainer)
        device = pl_module.device
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self._recorder = TorchRecorder(
            pl_module,
            trainer.optimizers,
            self.output_dir / "trace",
            warmup_steps=self.warmup_steps,
            profile_steps=self.profile_steps,
            ddp_module=trainer.strategy.model,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            device=device.type if device.type != "cuda" else f"cuda ({device_name})",
            fingerprint=torch_fingerprint(pl_module, batch_shapes_of(batch), trainer.world_size, device.type),
        )

    def _finish(self, trainer: pl.Trainer) -> None:
        """Save the measured steps into the trace and, in mode "report", report on rank 0."""
        self._finished = True
        recorder = self._recorder
        ok = self._failed is None and recorder is not None and recorder.trace is not None
        if ok:
            ok = self._guard(recorder.save)
        if not self._agree(trainer, ok) or self.mode != "report":
            self._close()
            return
        texts = self._guard(_gather_strings, trainer, json.dumps(recorder.trace.to_dict()))
        if trainer.global_rank == 0 and texts is not None:
            self._guard(self._report, trainer, texts)
        self._close()

    def _report(self, trainer: pl.Trainer, texts: list[str]) -> None:
        traces = [Trace.from_dict(json.loads(t), source=f"rank {i} trace") for i, t in enumerate(texts)]
        for trace in traces:
            path = rank_trace_path(self.output_dir / "trace", trace.rank)
            if not path.exists():
                trace.save(path)
        self.report = build_report(traces)
        write_report(self.report, self.output_dir / REPORT_FILE)
        rank_zero_info(format_summary(self.report) + f"\n  written to {self.output_dir}")
        if trainer.logger is not None:
            trainer.logger.log_metrics(_metrics(self.report), step=trainer.global_step)

    # ----------------------------------------------------------------- failure handling

    def _guard(self, fn, *args: Any) -> Any:
        """Run ``fn``; on failure warn once, stop recording and step aside. Returns fn's result or None."""
        if self._failed is not None:
            return None
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 - the callback must never break training
            self._fail(f"{type(exc).__name__}: {exc}")
            return None
        return True if result is None else result

    def _fail(self, cause: str) -> None:
        if self._failed is None:
            self._failed = cause
            warnings.warn(f"QSyncCallback steps aside: {cause}", RuntimeWarning, stacklevel=3)
        self._close()

    def _agree(self, trainer: pl.Trainer, ok: bool | None = None) -> bool:
        """All ranks go on only if every rank is still healthy (one all-reduce of a flag)."""
        ok = self._failed is None if ok is None else bool(ok)
        if trainer.world_size > 1:
            ok = bool(trainer.strategy.reduce_boolean_decision(ok, all=True))
        if not ok:
            if self._failed is None:
                self._fail("another rank failed; this rank steps aside too")
            self._finished = True
        return ok

    def _close(self) -> None:
        if self._recorder is not None:
            try:
                self._recorder.close()
            except Exception as exc:  # noqa: BLE001
                warnings.warn(
                    f"QSyncCallback could not stop the profiler: {exc}", RuntimeWarning, stacklevel=2
                )


def _gather_strings(trainer: pl.Trainer, text: str) -> list[str]:
    """Every rank's ``text``, in rank order (via the strategy's all_gather of byte tensors)."""
    if trainer.world_size == 1:
        return [text]
    device = trainer.strategy.root_device
    data = torch.tensor(bytearray(text.encode()), dtype=torch.uint8, device=device)
    sizes = trainer.strategy.all_gather(torch.tensor([data.numel()], device=device)).view(-1).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
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
