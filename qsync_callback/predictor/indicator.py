"""QSync's precision-sensitivity indicator: how much noise running one layer at a lower precision
adds to training, forward and backward, weighted by where the layer sits.

Input: the per-layer statistics of ``recorder/layer_statistics.py`` (``LayerStatistics.to_dict()``),
plain JSON. For a layer ``y = x W^T + b`` (a convolution is the same product on unfolded patches)
with fan-in ``K`` (inputs per output), depth ``d`` (1 = first of ``L`` recorded layers), ``M`` the
multiply-adds of the recorded backward calls (``K`` times the elements of g), and for each of its
tensors ``t`` (input x, weight W, output y, output gradient g, weight gradient gW): ``m2(t)``, the
mean square over the recorded calls, ``E(t)`` its summed squares, and ``s_p(t)``, the mean squared
rounding error per element at precision p:

- floats (tf32, bf16, fp16 with ``b`` = 11, 8, 11 significand bits): round to nearest gives an
  error uniform over half an ulp, relative variance ``rho_p = 4**-b / 6`` averaged over a binade;
  ``s_p(t) = rho_p * m2(t)``. fp16 also has range limits: elements below its smallest normal 2**-14
  keep only an absolute step of 2**-24 (error variance ``min(t**2, 2**-48 / 12)``, flushed to zero
  below), and any tensor with ``amax >= 65504`` overflows (indicator ``inf``);
- int8 (Linear only; fixed point, per-tensor symmetric as in ``lp/modules.py``): step
  ``amax / 127`` per call, uniform error, ``s_p(t) = mean over calls of (amax / 127)**2 / 12``.

Terms, each a noise-to-signal ratio (dimensionless, so that layers compare). A product of two
rounded operands gets, per multiply-add, the error variance ``s(a) m2(b) + s(b) m2(a)`` (independent
errors); the signal is the product's own recorded energy where it is recorded:

- forward, ``r_y = K (s(x) m2(W) + s(W) m2(x)) / m2(y) + rho_out``: noise per output element over
  the output's mean square, plus the rounding of the output itself;
- weight gradient ``g^T x``: ``r_gW = M (s(g) m2(x) + s(x) m2(g)) / E(gW) + rho_out`` (0 for a
  frozen weight). Rounding errors average out over the M / numel(W) terms of each element while a
  coherent gradient adds up, hence the measured E(gW) rather than an estimate;
- input gradient ``g W``: ``r_gx = s(g) / m2(g) + s(W) / m2(W) + rho_out``, the same rule with the
  terms taken as uncorrelated (its energy is not recorded); 0 when the input needs no gradient.

``rho_out = rho_p`` for bf16 and fp16, whose ops write their results (output, gradients) in that
precision; 0 for tf32 (fp32 results) and int8 (dequantized fp32 results and an fp32 g: s(g) = 0).

The indicator weights each term by how many of the training's quantities it reaches, as QSync weights
the forward by the distance to the loss and the backward by the depth (a relative perturbation
passes through a layer at about the same size, so it counts once per quantity it reaches)::

    indicator(layer, p) = (L - d + 1) * r_y + r_gW + (d - 1) * r_gx

forward noise reaches the outputs of this layer and the ``L - d`` after it, input-gradient noise the
weight gradients of the ``d - 1`` layers before it. fp32 is 0. Layers that never ran a training
forward get no entry; a layer without recorded gradients gets no backward terms. Not modelled: the
rounding of the bias, and int8 shapes that fall back to fp32 (``int8_fallbacks``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from qsync_callback.plan import PRECISIONS
from qsync_callback.recorder.statistics_schema import (
    TENSOR_ROLES,
    check_statistics,
)

INT8_KINDS = ("linear",)  # stock PyTorch has no trainable int8 convolution: convs get no int8 entry
FP16_MAX = 65504.0
_FP16_SUBNORMAL_STEP = 2.0**-24
_INT8_MAX = 127
_SIGNIFICAND_BITS = {"tf32": 11, "bf16": 8, "fp16": 11}
_ROUNDED_RESULTS = ("bf16", "fp16")


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def _mean_square(t: Mapping[str, float]) -> float:
    return _ratio(t["sumsq"], t["numel"])


def _rounding_noise(t: Mapping[str, float], precision: str) -> float:
    """Mean squared error per element of ``t`` rounded to ``precision`` (see the module docstring)."""
    if t["numel"] == 0:
        return 0.0
    if precision == "int8":
        return t["amax_sq_numel"] / t["numel"] / (12 * _INT8_MAX**2)
    rho = 4.0 ** -_SIGNIFICAND_BITS[precision] / 6
    if precision != "fp16":
        return rho * t["sumsq"] / t["numel"]
    under = min(t["under_sumsq"], t["under_count"] * _FP16_SUBNORMAL_STEP**2 / 12)
    return (rho * max(t["sumsq"] - t["under_sumsq"], 0.0) + under) / t["numel"]


def _indicator(layer: Mapping[str, Any], precision: str, model_depth: int) -> float:
    if precision == "fp32":
        return 0.0
    tensors = layer["tensors"]
    if any(math.isinf(v) for t in tensors.values() for v in t.values()):
        return math.inf
    if precision == "fp16" and any(t["amax"] >= FP16_MAX for t in tensors.values()):
        return math.inf
    x, w, y, g, grad_w = (tensors[role] for role in TENSOR_ROLES)
    s_x, s_w = _rounding_noise(x, precision), _rounding_noise(w, precision)
    m2_x, m2_w = _mean_square(x), _mean_square(w)
    rho_out = 4.0 ** -_SIGNIFICAND_BITS[precision] / 6 if precision in _ROUNDED_RESULTS else 0.0
    r_y = _ratio(layer["fan_in"] * (s_x * m2_w + s_w * m2_x), _mean_square(y)) + rho_out
    depth = layer["depth"]
    total = (model_depth - depth + 1) * r_y
    if g["numel"]:
        s_g = 0.0 if precision == "int8" else _rounding_noise(g, precision)
        m2_g = _mean_square(g)
        if grad_w["numel"]:
            macs = layer["fan_in"] * g["numel"]
            total += _ratio(macs * (s_g * m2_x + s_x * m2_g), grad_w["sumsq"]) + rho_out
        if layer["input_grad"]:
            total += (depth - 1) * (_ratio(s_g, m2_g) + _ratio(s_w, m2_w) + rho_out)
    return total


def sensitivity(statistics: Mapping[str, Any], precisions: Iterable[str]) -> dict[str, dict[str, float]]:
    """layer -> precision -> indicator (0.0 for fp32, larger is more sensitive; formula in the module
    docstring), for every layer that ran a training forward, in the statistics' order.

    ``precisions`` must be names from ``PRECISIONS`` (ValueError otherwise). A precision the layer's
    kind cannot run is left out of its entry: int8 for Conv1d/Conv2d. Whether the device runs a
    precision (tf32 needs CUDA sm80+) is not checked here: see ``runnable_precisions``.
    """
    wanted = list(dict.fromkeys(precisions))
    unknown = [p for p in wanted if p not in PRECISIONS]
    if unknown:
        raise ValueError(
            f"unknown precision(s) {', '.join(map(repr, unknown))}; known: {', '.join(PRECISIONS)}"
        )
    layers = {
        name: layer
        for name, layer in check_statistics(statistics).items()
        if layer["depth"] is not None and layer["calls"] > 0
    }
    model_depth = max((layer["depth"] for layer in layers.values()), default=0)
    return {
        name: {
            p: _indicator(layer, p, model_depth) for p in wanted if p != "int8" or layer["kind"] in INT8_KINDS
        }
        for name, layer in layers.items()
    }
