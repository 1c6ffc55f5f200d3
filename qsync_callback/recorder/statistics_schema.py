"""The schema of the per-layer value statistics the recorder gathers for QSync's precision
indicator (`layer_statistics.py` writes it, `predictor/indicator.py` reads it), and its check.

A document is ``{"format": "qsync-layer-statistics", "version": 1, "layers": {name: layer}}``;
each layer has ``kind`` (one of `LAYER_KINDS`), ``fan_in``, ``depth``, ``calls``, ``input_grad``
and, per tensor role (`TENSOR_ROLES`), the fields `TENSOR_FIELDS`: element count, summed squares,
squared amax times elements, the count and summed squares of elements below fp16's smallest
normal (`FP16_NORMAL_MIN`), and amax.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qsync_callback.errors import QSyncInputError

STATISTICS_FORMAT = "qsync-layer-statistics"
STATISTICS_VERSION = 1
TENSOR_ROLES = ("input", "weight", "output", "grad_output", "grad_weight")
TENSOR_FIELDS = ("numel", "sumsq", "amax_sq_numel", "under_count", "under_sumsq", "amax")
LAYER_KINDS = ("linear", "conv1d", "conv2d")
FP16_NORMAL_MIN = 2.0**-14


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_amount(value: Any) -> bool:
    """A non-negative number; inf allowed (a tensor held an inf or NaN), NaN not."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def _check_layer(name: str, layer: Any, where: str) -> None:
    if not isinstance(layer, Mapping):
        raise QSyncInputError(f"{where}: layer {name!r} is not an object")
    if layer.get("kind") not in LAYER_KINDS:
        raise QSyncInputError(
            f"{where}: layer {name!r} has kind {layer.get('kind')!r}, not one of {LAYER_KINDS}"
        )
    fan_in, depth = layer.get("fan_in"), layer.get("depth")
    if not (_is_count(fan_in) and fan_in > 0):
        raise QSyncInputError(f"{where}: layer {name!r} has fan_in {fan_in!r}, not a positive integer")
    if depth is not None and not (_is_count(depth) and depth > 0):
        raise QSyncInputError(f"{where}: layer {name!r} has depth {depth!r}, not a positive integer or null")
    if not _is_count(layer.get("calls")):
        raise QSyncInputError(f"{where}: layer {name!r} has calls {layer.get('calls')!r}, not a count")
    if not isinstance(layer.get("input_grad"), bool):
        raise QSyncInputError(f"{where}: layer {name!r} has no boolean input_grad")
    tensors = layer.get("tensors")
    if not isinstance(tensors, Mapping) or set(tensors) != set(TENSOR_ROLES):
        raise QSyncInputError(f"{where}: layer {name!r} needs tensors {', '.join(TENSOR_ROLES)}")
    for role in TENSOR_ROLES:
        stats = tensors[role]
        if not isinstance(stats, Mapping) or set(stats) != set(TENSOR_FIELDS):
            raise QSyncInputError(f"{where}: {name}.{role} needs the fields {', '.join(TENSOR_FIELDS)}")
        if not _is_count(stats["numel"]):
            raise QSyncInputError(f"{where}: {name}.{role}.numel is {stats['numel']!r}, not a count")
        bad = [field for field in TENSOR_FIELDS[1:] if not _is_amount(stats[field])]
        if bad:
            raise QSyncInputError(f"{where}: {name}.{role}.{bad[0]} is {stats[bad[0]]!r}, not a number >= 0")


def check_statistics(data: Any, source: str = "layer statistics") -> dict[str, dict[str, Any]]:
    """The layers of a ``LayerStatistics.to_dict()`` document, validated; any problem raises
    ``QSyncInputError`` naming ``source``."""
    if not isinstance(data, Mapping):
        raise QSyncInputError(f"{source}: layer statistics must be a JSON object")
    if data.get("format") != STATISTICS_FORMAT or data.get("version") != STATISTICS_VERSION:
        raise QSyncInputError(
            f"{source}: not {STATISTICS_FORMAT} version {STATISTICS_VERSION} "
            f"(format {data.get('format')!r}, version {data.get('version')!r})"
        )
    layers = data.get("layers")
    if not isinstance(layers, Mapping):
        raise QSyncInputError(f"{source}: 'layers' must be an object")
    for name, layer in layers.items():
        _check_layer(name, layer, source)
    return dict(layers)
