"""What the tuning loop needs from a Horovod + TensorFlow run (`qsync_callback.tuning_loop.Integration`):
its ranks (Horovod's collectives), the fingerprint, a TF recorder per window, the TF appliers, and
a log printed on rank 0."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import horovod
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from qsync_callback.host_cpu import cpu_description
from qsync_callback.integrations.horovod_tf.appliers import rewrite_step, tf_appliers
from qsync_callback.integrations.horovod_tf.fusion import TIMELINE_DIR, Timeline, horovod_settings
from qsync_callback.integrations.horovod_tf.mixed_precision import PRIORLIST_FILE
from qsync_callback.integrations.horovod_tf.train_step import TrainStep
from qsync_callback.recorder.tf_recorder import TFRecorder
from qsync_callback.recorder.trace import rank_trace_path
from qsync_callback.recorder.xspace import keras_layers
from qsync_callback.tuning_loop import Applier

NOT_INITIALIZED = "Horovod is not initialized; call hvd.init() before the first train step"


class HorovodCollective:
    """The job's ranks through Horovod: an all-reduce (min) of a flag, all-gathers of UTF-8 bytes.
    One process when Horovod is not initialized."""

    def __init__(self) -> None:
        initialized = hvd.is_initialized()
        self.rank = hvd.rank() if initialized else 0
        self.world_size = hvd.size() if initialized else 1

    def all_true(self, flag: bool) -> bool:
        if self.world_size == 1:
            return bool(flag)
        return bool(hvd.allreduce(tf.constant(int(flag)), op=hvd.Min, name="qsync.agree").numpy())

    def gather_strings(self, text: str) -> list[str]:
        if self.world_size == 1:
            return [text]
        data = np.frombuffer(text.encode(), dtype=np.uint8)
        sizes = hvd.allgather(tf.constant([data.size], tf.int64), name="qsync.sizes").numpy()
        gathered = hvd.allgather(tf.constant(data), name="qsync.texts").numpy().tobytes()
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        return [gathered[a:b].decode() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass
class HorovodRun:
    """One Horovod + TF training run of ``step``, as the tuning loop sees it. ``probe_bf16``: a
    planning window also measures TF's uniform bf16 rewrite per op type."""

    step: TrainStep
    model: Any
    optimizer: Any
    batch_size: int | None
    output_dir: Path
    probe_bf16: bool

    def __post_init__(self) -> None:
        self.collective = HorovodCollective()
        self.job = job_name(self.model, self.step.python_function)
        self.layers = keras_layers(self.model) if self.model is not None else []
        self._fingerprint: dict[str, Any] = {}

    def fingerprint(self) -> dict[str, Any]:
        if not hvd.is_initialized():
            raise RuntimeError(NOT_INITIALIZED)
        shapes = batch_shapes_of((self.step.args, self.step.kwargs))
        self._fingerprint = tf_fingerprint(self.layers, shapes, self.batch_size, self.collective.world_size)
        return self._fingerprint

    def new_recorder(
        self, trace_dir: Path, warmup_steps: int, profile_steps: int, measure_steps: int, *, planning: bool
    ) -> TFRecorder:
        rank, world_size = self.collective.rank, self.collective.world_size
        timeline = None
        if world_size > 1:
            timeline_dir = rank_trace_path(trace_dir, rank).parent / TIMELINE_DIR
            shutil.rmtree(timeline_dir, ignore_errors=True)
            timeline = Timeline(timeline_dir)
        return TFRecorder(
            self.step,
            trace_dir,
            warmup_steps=warmup_steps,
            profile_steps=profile_steps,
            measure_steps=measure_steps,
            model=self.model,
            optimizer=self.optimizer,
            layers=self.layers,
            fingerprint=self._fingerprint,
            rank=rank,
            world_size=world_size,
            communication={"library": "horovod", **horovod_settings()},
            timeline=timeline,
            switch_to_bf16=(lambda: rewrite_step(self.step, {})) if planning and self.probe_bf16 else None,
        )

    def appliers(self) -> Mapping[str, Applier]:
        variables = self.model.trainable_variables if self.model is not None else []
        layers = [layer["name"] for layer in self.layers]
        return tf_appliers(self.step, layers, variables, self.output_dir / PRIORLIST_FILE)

    def log(self, text: str) -> None:
        print(text, flush=True)

    def log_metrics(self, report: Mapping[str, Any]) -> None:
        """Horovod + TF has no logger of its own: the report is printed and in report.json."""


def job_name(model: Any, step_fn: Callable) -> str:
    """What the plan cache files the run's plans under: the Keras model's class and name, or the
    train step's Python function."""
    if model is not None:
        return f"{type(model).__module__}.{type(model).__qualname__}.{model.name}"
    return f"{step_fn.__module__}.{step_fn.__qualname__}"


def batch_shapes_of(value: Any) -> list[list[int]]:
    """Shapes of the tensors and arrays in a (nested) argument structure, in order."""
    if isinstance(value, (tf.Tensor, np.ndarray)):
        return [[int(d) if d is not None else -1 for d in value.shape]]
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in batch_shapes_of(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in batch_shapes_of(v)]
    return []


def tf_device_name() -> str:
    """The device TF runs the step on, as what is measured on it depends on: its first GPU's name
    (TF's device details), else the CPU's model name and precision extensions
    (`host_cpu.cpu_description`: a CPU of another kind runs bf16 at another speed)."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return f"gpu: {tf.config.experimental.get_device_details(gpus[0]).get('device_name', 'unnamed')}"
    return f"cpu: {cpu_description()}"


def tf_fingerprint(
    layers: Sequence[Mapping[str, Any]], batch_shapes: Sequence, batch_size: int | None, world_size: int
) -> dict[str, Any]:
    """What a plan for this run depends on: structure, batch, device, world size, versions."""
    from qsync_callback import __version__

    structure = [(t["name"], t["type"], t["param_bytes"]) for t in layers]
    return {
        "model": hashlib.sha256(json.dumps(structure).encode()).hexdigest()[:16],
        "layers": [t["name"] for t in layers],
        "batch_shapes": [list(s) for s in batch_shapes],
        "batch_size": batch_size,
        "device": tf_device_name(),
        "world_size": world_size,
        "versions": {
            "tensorflow": tf.__version__,
            "horovod": horovod.__version__,
            "qsync_callback": __version__,
        },
    }
