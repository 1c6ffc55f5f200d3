"""What the tuning loop needs from a Lightning run (`qsync_callback.tuning_loop.Integration`): its
ranks (the strategy's collectives), a torch recorder per window, the torch appliers, and Lightning's
rank-zero log and logger."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info

from qsync_callback.activation_trial import activation_trials_for
from qsync_callback.appliers.malloc_thresholds import MallocThresholdApplier
from qsync_callback.appliers.torch_activation import ActivationApplier
from qsync_callback.appliers.torch_ddp_buckets import DDPBucketApplier
from qsync_callback.appliers.torch_precision import precision_applier
from qsync_callback.appliers.torch_regions import RegionApplier
from qsync_callback.malloc_thresholds import recorded_thresholds
from qsync_callback.predictor.compiled_regions import payback_gate
from qsync_callback.recorder.torch_recorder import TorchRecorder, batch_shapes_of, torch_fingerprint
from qsync_callback.tuning_loop import Applier

METRIC_PREFIX = "qsync/"


class StrategyCollective:
    """The trainer's ranks, through its strategy (gloo on CPU, NCCL on GPU)."""

    def __init__(self, trainer: pl.Trainer):
        self.trainer = trainer
        self.rank = trainer.global_rank
        self.world_size = trainer.world_size

    def all_true(self, flag: bool) -> bool:
        if self.world_size == 1:
            return bool(flag)
        return bool(self.trainer.strategy.reduce_boolean_decision(bool(flag), all=True))

    def gather_strings(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order (the strategy's all_gather of byte tensors)."""
        if self.world_size == 1:
            return [text]
        strategy = self.trainer.strategy
        device = strategy.root_device
        data = torch.tensor(bytearray(text.encode()), dtype=torch.uint8, device=device)
        sizes = strategy.all_gather(torch.tensor([data.numel()], device=device)).view(-1).tolist()
        padded = torch.zeros(max(max(sizes), 1), dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        gathered = strategy.all_gather(padded).cpu()
        return [bytes(gathered[i, : sizes[i]].tolist()).decode() for i in range(len(sizes))]


class LightningRun:
    """One Lightning training run, as the tuning loop sees it; ``batch`` is the first step's."""

    def __init__(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        precisions: tuple[str, ...],
        activation: bool = True,
        regions: bool = True,
        activation_trial_rounds: int = 0,
    ):
        self.trainer = trainer
        self.pl_module = pl_module
        self.collective = StrategyCollective(trainer)
        self.job = f"{type(pl_module).__module__}.{type(pl_module).__qualname__}"
        self.precisions = precisions
        self.activation = activation  # the activation lever is allowed: record what it needs
        self.regions = regions  # the regions lever is allowed: compile modules to calibrate on
        # measure what the activation policies cost the steps (`activation_trial.py`)
        self.activation_trial_rounds = activation_trial_rounds
        self._recorder: TorchRecorder | None = None
        self._batch_shapes = batch_shapes_of(batch)
        self._fingerprint: dict[str, Any] = {}
        self._appliers = {
            "precision": precision_applier(pl_module),
            # one object: the loop polls its failure(); its CPU store copies in the training thread,
            # so that an offloaded tensor is gone once its consumer ran (a backlog would keep it
            # alive) and no copy competes with the step's ops for the cores
            # (`predictor.activation.overlaps`)
            "activation": ActivationApplier(pl_module),
            # keyed by its plan field (`tuning_loop.apply_plan`); one object for the run: a plan applied
            # again (the loop's turns) runs the graphs its first apply compiled
            "fused_regions": RegionApplier(pl_module),
            "malloc_thresholds": MallocThresholdApplier(self._recorded_thresholds),
        }
        if isinstance(trainer.strategy.model, torch.nn.parallel.DistributedDataParallel):  # world size > 1
            self._appliers["buckets"] = DDPBucketApplier(lambda: trainer.strategy.model, self._set_ddp)

    def _recorded_thresholds(self) -> dict[str, int] | None:
        """glibc malloc's thresholds the recorded steps ran under (None before a window closed)."""
        trace = self._recorder.trace if self._recorder is not None else None
        return recorded_thresholds(trace) if trace is not None else None

    def _set_ddp(self, wrapper: torch.nn.parallel.DistributedDataParallel) -> None:
        """The strategy runs its next step through ``wrapper``; a static graph's first iteration,
        which Lightning flushes itself under manual optimization, is the new wrapper's again."""
        self.trainer.strategy.model = wrapper
        if hasattr(self.trainer.strategy, "_pl_static_graph_delay_done"):
            self.trainer.strategy._pl_static_graph_delay_done = False

    def fingerprint(self) -> dict[str, Any]:
        self._fingerprint = torch_fingerprint(
            self.pl_module, self._batch_shapes, self.trainer.world_size, self.pl_module.device.type
        )
        return self._fingerprint

    def new_recorder(
        self, trace_dir: Path, warmup_steps: int, profile_steps: int, measure_steps: int, *, planning: bool
    ) -> TorchRecorder:
        device = self.pl_module.device
        name = f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else device.type
        self._recorder = TorchRecorder(
            self.pl_module,
            self.trainer.optimizers,
            trace_dir,
            warmup_steps=warmup_steps,
            profile_steps=profile_steps,
            measure_steps=measure_steps,
            ddp_module=self.trainer.strategy.model,
            rank=self.trainer.global_rank,
            world_size=self.trainer.world_size,
            device=name,
            fingerprint=self._fingerprint,
            probe_precisions=self.precisions if planning else (),
            layer_statistics=planning,
            activation_costs=planning and self.activation,
            offload_stats=self._appliers["activation"].step_stats,
            trial=activation_trials_for(
                self._appliers["activation"], self.activation_trial_rounds, looks=self.trainer.world_size == 1
            )
            if planning and self.activation_trial_rounds
            else None,
            compiled_regions=payback_gate if planning and self.regions else None,
            steps_left=self._steps_left(),
            partial_last_batch=self._partial_last_batch(),
        )
        return self._recorder

    def _partial_last_batch(self) -> bool | None:
        """Whether an epoch of the training data ends with a smaller batch (a new shape, which a
        compiled region compiles again for), or None where the data loader does not say."""
        loader = self.trainer.train_dataloader
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        batch_size = getattr(loader, "batch_size", None)
        if batch_size is None or sampler is None or not hasattr(sampler, "__len__"):
            return None
        return not loader.drop_last and len(sampler) % batch_size != 0

    def _steps_left(self) -> int | None:
        """The optimizer steps the run has left (from ``max_steps`` or ``max_epochs`` and the data),
        or None where Lightning cannot tell (an iterable dataset without a length)."""
        total = self.trainer.estimated_stepping_batches
        return None if total == float("inf") else max(int(total) - self.trainer.global_step, 0)

    def appliers(self) -> Mapping[str, Applier]:
        recorder, activation = self._recorder, self._appliers["activation"]
        if recorder is not None and recorder.module_calls is not None:  # the calls the window counted
            activation.calls_per_step, activation.call_problems = (
                recorder.module_calls,
                recorder.call_problems,
            )
        return self._appliers

    def log(self, text: str) -> None:
        rank_zero_info(text)

    def log_metrics(self, report: Mapping[str, Any]) -> None:
        if self.trainer.logger is not None:
            self.trainer.logger.log_metrics(report_metrics(report), step=self.trainer.global_step)


def report_metrics(report: Mapping[str, Any]) -> dict[str, float]:
    """The report's headline figures, named for the logger (``qsync/...``)."""
    figures = {
        "measured_step_ms": report["measured"]["step_ms"],
        "predicted_step_ms": report["predicted"]["step_ms"],
        "measured_peak_bytes": report["measured"]["peak_bytes"],
        "predicted_peak_bytes": report["predicted"]["peak_bytes"],
        "step_ms_error_pct": report["error_pct"]["step_ms"],
        "peak_bytes_error_pct": report["error_pct"]["peak_bytes"],
    }
    return {METRIC_PREFIX + k: float(v) for k, v in figures.items() if v is not None}
