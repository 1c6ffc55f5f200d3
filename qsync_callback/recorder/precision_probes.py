"""Per-layer cost of every precision, probed on this device right after a recorded window.

QSync profiles each precision before it plans; so do we, layer by layer, on the shapes the run
really has. Each swappable layer (``swappable_layers``) is probed with ``probe_layer_costs`` at its
recorded input shape (the first input of its first forward op, e.g. ``aten::linear``, in most
recorded steps):
forward and backward time and the bytes saved for backward at every precision, on private copies
of the parameters, so probing leaves training alone. The cast costs (``alpha * numel + beta`` per
pair) come from the per-device cache (``cast_costs``). Element counts of the layer's input, output
and weight are kept so the predictor can price the casts around the layer.

The result is plain JSON (``Trace.precision_costs``)::

    {"precisions": ["fp32", "bf16", ...], "device": "cpu", "probe_s": 1.9,
     "casts": {"fp32->bf16": {"alpha_us_per_element": .., "beta_us": .., "r2": ..}, ...},
     "layers": {"net.0": {"input_shape": [128, 1024], "input_numel": .., "output_numel": ..,
                          "weight_numel": .., "costs": {"fp32": {"forward_us": .., "backward_us": ..,
                          "saved_bytes": .., ...}, "bf16": {...}}}},
     "pass_through": {"net.1": {"input_shape": [128, 256], "input_numel": ..,
                                "costs": {"fp32": {"forward_us": .., "backward_us": ..,
                                                   "saved_bytes": ..}, "bf16": {...}}}}}

The pass-through layers (ReLU, Dropout, pooling, ...) between two probed layers of an
``nn.Sequential`` are probed too, at fp32 and bf16/fp16: a plan that links the layers on either
side (`precision_links`) runs them on the low-precision tensor.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from qsync_callback.lp.costs import cast_costs, probe_layer_costs, probe_pass_through_costs
from qsync_callback.lp.swap import runnable_precisions, swappable_layers
from qsync_callback.plan import FULL_PRECISION
from qsync_callback.precision_links import LINKED_PRECISIONS, pass_through_candidates
from qsync_callback.recorder.trace import Trace

PROBE_REPEATS = 5


def layer_input_shapes(trace: Trace, layers: Iterable[str]) -> dict[str, list[int]]:
    """The input shape of each named layer: the first input of its first forward op in each
    recorded step, the shape most steps had (the larger on a tie: a window that spans an epoch's
    end has one partial batch). Layers that never ran in the recorded steps are left out."""
    wanted = set(layers)
    firsts: dict[tuple[int, str], tuple[float, tuple[int, ...]]] = {}
    for op in trace.ops:
        if op.kind != "forward" or op.layer not in wanted or not op.input_shapes:
            continue
        first = op.input_shapes[0]
        if not (isinstance(first, list) and first and all(isinstance(d, int) for d in first)):
            continue
        key = (op.step, op.layer)
        if key not in firsts or op.start_us < firsts[key][0]:
            firsts[key] = (op.start_us, tuple(first))
    counts: dict[str, Counter[tuple[int, ...]]] = {}
    for (_, layer), (_, shape) in firsts.items():
        counts.setdefault(layer, Counter())[shape] += 1
    return {
        layer: list(max(seen, key=lambda shape: (seen[shape], math.prod(shape))))
        for layer, seen in counts.items()
    }


def _output_numel(module: torch.nn.Module, input_shape: list[int]) -> int:
    """Elements of the layer's output for an input of ``input_shape`` (shape arithmetic on the meta
    device: nothing is computed or allocated)."""
    with torch.device("meta"):
        x = torch.empty(input_shape)
        weight = torch.empty(module.weight.shape)
        if isinstance(module, torch.nn.Linear):
            out = torch.nn.functional.linear(x, weight)
        else:
            out = module._conv_forward(x, weight, None)
    return out.numel()


def probe_precision_costs(model: torch.nn.Module, trace: Trace, precisions: Iterable[str]) -> dict[str, Any]:
    """Probe every swappable layer of ``model`` that ran in ``trace`` at each of ``precisions`` (and
    fp32, the reference) it can run on its device (see the module docstring for the layout)."""
    start = time.perf_counter()
    wanted = list(dict.fromkeys([FULL_PRECISION, *precisions]))
    layers = swappable_layers(model)
    device = next(model.parameters()).device
    shapes = layer_input_shapes(trace, layers)
    probed: dict[str, Any] = {}
    for name, shape in shapes.items():
        module = layers[name]
        runs = [p for p in wanted if p in runnable_precisions(module, device)]
        costs = probe_layer_costs(module, shape, precisions=runs, repeats=PROBE_REPEATS)
        probed[name] = {
            "input_shape": shape,
            "input_numel": math.prod(shape),
            "output_numel": _output_numel(module, shape),
            "weight_numel": module.weight.numel(),
            "costs": costs,
        }
    casts = cast_costs(device)
    return {
        "precisions": wanted,
        "device": device.type,
        "casts": casts,
        "layers": probed,
        "pass_through": _probe_pass_through(model, trace, probed, wanted, device),
        "probe_s": time.perf_counter() - start,
    }


def _probe_pass_through(
    model: torch.nn.Module, trace: Trace, probed: Iterable[str], precisions: list[str], device: torch.device
) -> dict[str, Any]:
    """`probe_pass_through_costs` of every pass-through layer a link between ``probed`` layers could
    cross (`precision_links.pass_through_candidates`), at its recorded input shape."""
    if not set(precisions) & set(LINKED_PRECISIONS):
        return {}
    modules = dict(model.named_modules())
    shapes = layer_input_shapes(trace, pass_through_candidates(trace.layers, list(probed)))
    return {
        name: {
            "input_shape": shape,
            "input_numel": math.prod(shape),
            "costs": probe_pass_through_costs(
                modules[name], shape, device, precisions, repeats=PROBE_REPEATS
            ),
        }
        for name, shape in shapes.items()
    }
