"""Predict a training step before running one: ``qsync estimate`` and `estimate`.

The LightningModule's step is traced on fake tensors (`recorder/symbolic_trace.py`: no real
compute, no real memory), its ops priced by the learned per-op model of this device
(`predictor/op_cost_model.py`, trained on the ops of the runs recorded here) or, before any run
was recorded here, on this machine's roofline (`recorder/roofline.py`, `predictor/op_costs.py`;
``symbolic.durations`` says which); with a learned model the step's distinct ops are also timed
alone on made-up values, in a child process, within `PROBE_SECONDS` (`probe_order`: the op types
it never saw first, then the rest by their share of the step), and priced on both
(`predictor/op_costs.py`). The trace goes through the same predictor as a recorded one: peak
memory by kind (parameters, gradients, optimizer state, activations, temporaries), step time,
the top ops. The result has the schema of ``report.json`` with ``predicted`` and no ``measured``, and a
``symbolic`` entry saying how the figures were made and the step's FLOPs.

A model that needs real values (``.item()``, a shape that depends on the data) cannot run on fake
tensors: the estimate says which op needed them and traces two real steps of a copy instead
(``symbolic.tensors`` says so).

The batch is the first batch of the module's own ``train_dataloader()``, or one made from
``--batch-shape``: tensors of those shapes, ``float32`` by default, ``SHAPE:DTYPE`` for another
(``64,784 64:int64`` is an (x, y) pair). From the loader, a few more batches are fetched and timed
(`recorder/data_loading.py`: the only other real data touched), as a step also fetches its next
batch; with ``--batch-shape`` the step's time leaves that out, and ``symbolic.data_loading`` says so.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qsync_callback.errors import QSyncInputError
from qsync_callback.predictor.op_cost_model import OpCostModel, device_model
from qsync_callback.predictor.op_costs import priced
from qsync_callback.recorder.data_loading import DataLoading
from qsync_callback.recorder.kineto import FLOAT_DTYPES
from qsync_callback.recorder.op_dataset import remember_probes
from qsync_callback.recorder.op_probes import SCRATCH_SECONDS, probe
from qsync_callback.recorder.op_samples import OpSample, op_key
from qsync_callback.recorder.roofline import roofline
from qsync_callback.recorder.symbolic_trace import SymbolicTraceError, symbolic_trace
from qsync_callback.recorder.trace import Trace
from qsync_callback.report import build_report
from qsync_callback.units import format_bytes

PROBE_SECONDS = 5.0  # the most an estimate spends timing ops alone (`probe_order`)
DTYPE_NAMES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


def estimate_trace(
    module: nn.Module,
    batch: Any,
    device: str = "cpu",
    cache_dir: str | None = None,
    cost_model: OpCostModel | None = None,
    learned: bool = True,
    probe_seconds: float = PROBE_SECONDS,
    tvm: bool = False,
    scratch_seconds: float = SCRATCH_SECONDS,
    data: DataLoading | None = None,
    precision: str | int = "32-true",
) -> Trace:
    """The symbolic trace of one training step of ``module`` on ``batch`` at the Trainer's
    ``precision`` (`symbolic_trace`), its ops priced by
    ``cost_model``, else this device's learned model (``learned``), else the roofline. With a
    learned model, its distinct ops are timed alone (`recorder/op_probes.py`, in `probe_order`,
    within ``probe_seconds``) and join the device's data set. ``tvm``: the learned model reads TVM's
    features of each op too (`predictor/tvm_features.py`). ``scratch_seconds``: the most spent
    measuring its kernels' scratch (`symbolic_trace`). ``data``: the step's data loader's fetch of a
    batch (`recorder/data_loading.py`), added to the step (`op_costs.priced`)."""
    if cost_model is None and learned:
        cost_model = device_model(device, cache_dir, tvm=tvm)
    wanted = cost_model is not None and (probe_seconds > 0 or cost_model.tvm)
    distinct_ops: dict[tuple, OpSample] | None = {} if wanted else None
    try:
        trace = symbolic_trace(
            module,
            batch,
            device,
            distinct_ops=distinct_ops,
            scratch_seconds=scratch_seconds,
            precision=precision,
        )
    except SymbolicTraceError as error:  # the model needs values: two real steps instead
        warnings.warn(f"{error}; tracing two real steps of a copy of the model instead", stacklevel=2)
        distinct_ops = None if distinct_ops is None else {}
        trace = symbolic_trace(
            module,
            batch,
            device,
            fake=False,
            distinct_ops=distinct_ops,
            scratch_seconds=scratch_seconds,
            precision=precision,
        )
        trace.symbolic["tensors"] = f"real: {error}"
    probed = []
    if cost_model is not None and distinct_ops and probe_seconds > 0:
        probed = probe(probe_order(trace, distinct_ops.values(), cost_model), device, probe_seconds)
        if probed:
            remember_probes(probed, device, cache_dir)
    dtypes = {d for op in trace.ops if op.flops for d in op.input_dtypes if d in FLOAT_DTYPES}
    calls = {key: sample.call for key, sample in (distinct_ops or {}).items()}
    return priced(trace, roofline(device, dtypes, cache_dir), cost_model, probed, calls, data)


def probe_order(trace: Trace, samples: Iterable[OpSample], cost_model: OpCostModel) -> list[OpSample]:
    """The distinct ops of ``trace`` in the order an estimate times them alone: the op types
    ``cost_model`` never saw measured first (it has no price of their own for them), then the others
    by the time it prices them at in the step (each op's price times how often it runs), the
    largest first, so that a time limit leaves out the ops that matter least."""
    runs = collections.Counter(op_key(op.name, op.input_shapes, op.input_dtypes) for op in trace.ops)
    samples = list(samples)
    prices = cost_model.predict_us([dataclasses.asdict(s) for s in samples])
    order = sorted(
        range(len(samples)),
        key=lambda i: (
            samples[i].name in cost_model.known_types,
            -prices[i] * runs[op_key(samples[i].name, samples[i].shapes, samples[i].dtypes)],
        ),
    )
    return [samples[i] for i in order]


def estimate(
    module: nn.Module,
    batch: Any,
    device: str = "cpu",
    top: int = 10,
    cost_model: OpCostModel | None = None,
    learned: bool = True,
    tvm: bool = False,
    data: DataLoading | None = None,
    precision: str | int = "32-true",
) -> dict[str, Any]:
    """The estimate of one training step of LightningModule ``module`` on ``batch`` (see the module
    docstring), as a ``report.json``-shaped dict; ``cost_model``, ``learned``, ``tvm``, ``data``
    (`recorder/data_loading.first_batch_and_fetch` of the module's loader) and ``precision`` (the
    Trainer's) as `estimate_trace`."""
    trace = estimate_trace(
        module, batch, device, cost_model=cost_model, learned=learned, tvm=tvm, data=data, precision=precision
    )
    report = build_report([trace], top=top)
    for measured_only in (
        "measured",
        "error_pct",
        "profiler_overhead_us",
        "profiler_share",
        "recorded_steps",
    ):
        report.pop(measured_only, None)
    report["symbolic"] = {**trace.symbolic, "flops": sum(op.flops for op in trace.ops), "ops": len(trace.ops)}
    return report


def format_estimate(report: dict[str, Any], top: int = 10) -> str:
    """The estimate as lines for a terminal."""
    predicted = report["predicted"]
    lines = [
        f"qsync estimate (symbolic: no step run; {report['symbolic']['batch']}; "
        f"precision {report['symbolic']['precision']})",
        f"  predicted step time {predicted['step_ms']:.2f} ms   "
        f"peak memory {format_bytes(predicted['peak_bytes'])}",
        f"  FLOPs per step {report['symbolic']['flops'] / 1e9:.2f} G over {report['symbolic']['ops']} ops",
        "  peak by kind: "
        + ", ".join(f"{kind} {format_bytes(b)}" for kind, b in predicted["memory_breakdown"].items() if b),
        f"  durations: {report['symbolic']['durations']}",
        f"  data loading: {report['symbolic']['data_loading']}",
        f"  top ops by predicted time (of {len(report['ops'])} shown):",
    ]
    for op in report["ops"][:top]:
        lines.append(
            f"    {op['name'][:40]:<40} {op['kind']:<9} {op['ms_per_step']:8.2f} ms  "
            f"{op['calls_per_step']:g} calls ({100 * op['share']:.0f}%)"
        )
    return "\n".join(lines)


def load_module(target: str) -> nn.Module:
    """``FILE:CLASS``: the class from that Python file, built with no arguments."""
    path_text, _, name = target.rpartition(":")
    path = Path(path_text)
    if not path_text or not name or not path.is_file():
        raise QSyncInputError(
            f"{target}: expected FILE:CLASS, a Python file and a LightningModule class in it"
        )
    spec = importlib.util.spec_from_file_location(f"qsync_estimate_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise QSyncInputError(f"{path}: cannot be imported as Python")
    source = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))  # the file's own imports of its neighbours
    try:
        spec.loader.exec_module(source)
    finally:
        sys.path.remove(str(path.resolve().parent))
    cls = getattr(source, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise QSyncInputError(f"{target}: {path} has no nn.Module class {name!r}")
    try:
        return cls()
    except TypeError as error:
        raise QSyncInputError(f"{target}: cannot be built with no arguments ({error})") from error


def train_dataloader(module: nn.Module) -> Iterable | None:
    """The module's ``train_dataloader()``, or None where it has none."""
    loader_of = getattr(module, "train_dataloader", None)
    try:
        return loader_of() if callable(loader_of) else None
    except Exception as error:  # noqa: BLE001 - Lightning's hook, not overridden, raises its own kind
        if type(error).__name__ == "MisconfigurationException":
            return None
        raise


def batch_from_shapes(text: Sequence[str]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Tensors of ``SHAPE[:DTYPE]`` each (``64,784``, ``64:int64``), zeros: a fake run reads no value."""
    tensors = []
    for item in text:
        shape_text, _, dtype_name = item.partition(":")
        try:
            shape = [int(d) for d in shape_text.split(",")]
        except ValueError:
            raise QSyncInputError(
                f"--batch-shape: {item!r} is not SHAPE[:DTYPE] (64,784 or 64:int64)"
            ) from None
        dtype = DTYPE_NAMES.get(dtype_name or "float32")
        if dtype is None or any(d <= 0 for d in shape):
            raise QSyncInputError(
                f"--batch-shape: {item!r}: positive sizes and a dtype of {', '.join(DTYPE_NAMES)}"
            )
        tensors.append(torch.zeros(shape, dtype=dtype))
    return tensors[0] if len(tensors) == 1 else tuple(tensors)
