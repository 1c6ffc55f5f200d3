"""Measured cost inputs of the precision planner: cast costs per device and per-layer probes.

Two measurements, both taken on the device they describe:

- **Cast costs** (``fit_cast_costs``, cached per device by ``cast_costs``): the time of each storage
  cast the LP modules do (fp32 <-> bf16, fp32 <-> fp16, bf16 <-> fp16, fp32 -> int8 quantization,
  int8 -> fp32 dequantization), timed on tensors of 1e3 .. 4e6 elements and fitted as
  ``cost_us = alpha * numel + beta``. tf32 is a math mode, not a storage type: it has no casts.
- **Layer probes** (``probe_layer_costs``): forward and backward time of one Linear/Conv1d/Conv2d
  at each precision its LP module runs on the device, and the bytes autograd saves for backward at
  that precision, on a private copy of the layer's parameters.

Timings are wall-clock (``time.perf_counter``) with the device synchronized before and after the
timed call, so on CUDA they include launch overhead, as the training step pays it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from qsync_callback.allocator_profile import allocator_totals, profiled_events
from qsync_callback.cache import default_cache_dir
from qsync_callback.errors import QSyncInputError
from qsync_callback.host_cpu import cpu_description
from qsync_callback.jsonio import read_cache_document, write_cache_document
from qsync_callback.lp.modules import (
    CAST_DTYPES,
    LPLinear,
    LPModule,
    _normalize,
    _quantize,
    _rebuild,
    lp_class_for,
    supported_precisions,
)
from qsync_callback.plan import PRECISIONS

CAST_PAIRS: tuple[tuple[str, str], ...] = (
    ("fp32", "bf16"),
    ("bf16", "fp32"),
    ("fp32", "fp16"),
    ("fp16", "fp32"),
    ("bf16", "fp16"),
    ("fp16", "bf16"),
    ("fp32", "int8"),
    ("int8", "fp32"),
)
"""Every cast the cost model knows, as (src, dst); a device gets those whose two ends it supports."""

CAST_SIZES: tuple[int, ...] = tuple(round(1e3 * 4000 ** (i / 5)) for i in range(6))
"""Tensor sizes (elements) the casts are timed on: 6 geometric steps from 1e3 to 4e6."""

_PROBE_FORWARD = "qsync::probe_forward"
_PROBE_BACKWARD = "qsync::probe_backward"
_PROBE_RANGES = (_PROBE_FORWARD, _PROBE_BACKWARD)
CACHE_FORMAT = "qsync-cast-costs"
CACHE_VERSION = 1
_COST_FIELDS = ("alpha_us_per_element", "beta_us", "r2")
_FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --- the fit -------------------------------------------------------------------------------------


def fit_linear_cost(
    sizes: Sequence[float], times_us: Sequence[float], relative: bool = True
) -> dict[str, float]:
    """Least-squares fit of ``time_us = alpha * size + beta``; returns alpha, beta and r2.

    With ``relative`` (the default) each point is weighted by ``1 / time**2``, i.e. the fit
    minimizes the squared *relative* error: the timed sizes span more than three decades, and an
    unweighted fit would let the largest tensor decide alpha and leave beta (what the many small
    tensors of a model pay) to noise. ``relative=False`` is the ordinary least-squares fit.

    Costs are not negative: if the best line has ``beta < 0`` the fit is redone through the origin
    (``beta = 0``), and if ``alpha < 0`` it becomes the constant (weighted) mean time. ``r2`` is the
    coefficient of determination in the fit's own weighting (ordinary R^2 for ``relative=False``):
    1 for points on the line. Raises ValueError for mismatched lengths, fewer than two distinct
    sizes, or (with ``relative``) a time that is not positive.
    """
    xs, ys = [float(s) for s in sizes], [float(t) for t in times_us]
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} sizes but {len(ys)} times")
    if len(set(xs)) < 2:
        raise ValueError("fitting a line needs at least two distinct sizes")
    if not all(math.isfinite(v) for v in xs + ys):
        raise ValueError("sizes and times must be finite")
    if relative and min(ys) <= 0:
        raise ValueError("a relative fit needs positive times")
    ws = [1.0 / (y * y) for y in ys] if relative else [1.0] * len(ys)
    total = sum(ws)
    x_mean = sum(w * x for w, x in zip(ws, xs, strict=True)) / total
    y_mean = sum(w * y for w, y in zip(ws, ys, strict=True)) / total
    sxx = sum(w * (x - x_mean) ** 2 for w, x in zip(ws, xs, strict=True))
    sxy = sum(w * (x - x_mean) * (y - y_mean) for w, x, y in zip(ws, xs, ys, strict=True))
    alpha = sxy / sxx
    beta = y_mean - alpha * x_mean
    if beta < 0:
        beta = 0.0
        sxy0 = sum(w * x * y for w, x, y in zip(ws, xs, ys, strict=True))
        alpha = sxy0 / sum(w * x * x for w, x in zip(ws, xs, strict=True))
    if alpha < 0:
        alpha, beta = 0.0, y_mean
    ss_res = sum(w * (y - alpha * x - beta) ** 2 for w, x, y in zip(ws, xs, ys, strict=True))
    ss_tot = sum(w * (y - y_mean) ** 2 for w, y in zip(ws, ys, strict=True))
    if ss_tot > 0:
        r2 = 1.0 - ss_res / ss_tot
    else:  # every time equal: a flat line explains them all
        r2 = 1.0 if ss_res == 0 else 0.0
    return {"alpha_us_per_element": alpha, "beta_us": beta, "r2": r2}


# --- timing --------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


def _best_time_us(
    fn: Callable[[], object],
    device: torch.device,
    min_repeats: int = 5,
    max_repeats: int = 50,
    budget_s: float = 0.01,
) -> float:
    """Best (minimum) time of ``fn`` in microseconds, after one untimed warm-up call.

    Repeats at least ``min_repeats`` times, then until ``budget_s`` of timed calls have run or
    ``max_repeats`` is reached. The result of each call is freed after its timer stops, so the
    time covers computing (and allocating) the result, not freeing it.
    """
    fn()
    best, spent = math.inf, 0.0
    for count in range(1, max_repeats + 1):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        elapsed = time.perf_counter() - start
        del result
        best, spent = min(best, elapsed), spent + elapsed
        if count >= min_repeats and spent >= budget_s:
            break
    return best * 1e6


def _round_robin_us(
    keys: Sequence[str],
    run: Callable[[str], tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]],
    device: torch.device,
    repeats: int,
) -> dict[str, tuple[float, float]]:
    """Median microseconds of a forward and of its backward, per key: ``run(key)`` prepares and
    runs one forward, returning its output and the gradient to give it (a function of the output).
    One untimed round, then ``repeats`` timed rounds, each running every key once in turn (so that
    a machine whose speed drifts slows them alike); the device is synchronized around each part."""
    forward: dict[str, list[float]] = {key: [] for key in keys}
    backward: dict[str, list[float]] = {key: [] for key in keys}
    for step in range(repeats + 1):  # step 0 is the warm-up
        for key in keys:
            _sync(device)
            start = time.perf_counter()
            out, gradient = run(key)
            _sync(device)
            middle = time.perf_counter()
            out.backward(gradient(out))
            _sync(device)
            end = time.perf_counter()
            del out
            if step:
                forward[key].append((middle - start) * 1e6)
                backward[key].append((end - middle) * 1e6)
    return {key: (statistics.median(forward[key]), statistics.median(backward[key])) for key in keys}


# --- cast costs ----------------------------------------------------------------------------------


def _storage_precisions(device: torch.device, precisions: Iterable[str] | None) -> set[str]:
    supported = supported_precisions(device)
    if precisions is None:
        return set(supported) - {"tf32"}
    wanted = set(precisions)
    unknown = sorted(wanted - set(PRECISIONS))
    if unknown:
        raise ValueError(f"unknown precision(s) {', '.join(unknown)}; known: {', '.join(PRECISIONS)}")
    refused = [p for p in PRECISIONS if p in wanted and p not in supported]
    if refused:
        raise ValueError(f"{', '.join(refused)} do(es) not run on {device} (it runs {', '.join(supported)})")
    return wanted - {"tf32"}


def cast_pairs(device: torch.device | str, precisions: Iterable[str] | None = None) -> list[str]:
    """The cast names (``"src->dst"``) ``fit_cast_costs`` measures on ``device`` for ``precisions``
    (default: every precision the device supports)."""
    have = _storage_precisions(_normalize(device), precisions)
    return [f"{src}->{dst}" for src, dst in CAST_PAIRS if src in have and dst in have]


def _cast_op(src: str, dst: str, x: torch.Tensor) -> Callable[[], object]:
    """The timed cast of ``x`` (fp32) converted to ``src`` beforehand, untimed."""
    if dst == "int8":  # symmetric per-tensor quantization, exactly as the LP modules do it
        return lambda: _quantize(x)
    if src == "int8":  # dequantization, as the int8 backward does it
        q, scale = _quantize(x)
        return lambda: q.to(torch.float32) * scale
    source, dtype = x.to(_FLOAT_DTYPES[src]), _FLOAT_DTYPES[dst]
    return lambda: source.to(dtype)


def fit_cast_costs(
    device: torch.device | str, precisions: Iterable[str] | None = None
) -> dict[str, dict[str, float]]:
    """Time every storage cast between ``precisions`` on ``device`` and fit its cost per element.

    The casts (see ``cast_pairs``): ``x.to(dtype)`` between fp32, bf16 and fp16; ``fp32->int8`` is
    the LP modules' own symmetric per-tensor quantization (``qsync_callback.lp.modules._quantize``,
    a private function, imported here so there is one copy of it: scale = max|x| / 127, then round
    and clamp to [-127, 127]), scale included; ``int8->fp32`` is dequantization ``q.to(fp32) *
    scale`` as the int8 backward does it. tf32 is not a storage type and has no casts.

    Each cast runs on random tensors of ``CAST_SIZES`` elements (1e3 .. 4e6; from a private
    generator, so the global RNG is untouched); the best of several repeats is kept per size (at
    least 5, up to 10 ms of repeats) and ``fit_linear_cost`` fits ``cost_us = alpha * numel +
    beta`` through the six points. About 0.4 s on a 2-core CPU. Returns ``{"fp32->bf16":
    {"alpha_us_per_element": .., "beta_us": .., "r2": ..}, ...}``.

    On CPU the large sizes also pay the page faults of freshly mapped outputs and temporaries (the
    quantization makes three fp32 temporaries), which depend on the state of the C heap: a real
    cost of CPU training, but not a linear one; ``r2`` says how well the line holds.
    """
    device = _normalize(device)
    pairs = cast_pairs(device, precisions)
    generator = torch.Generator(device=device).manual_seed(0)
    times: dict[str, list[float]] = {pair: [] for pair in pairs}
    for size in CAST_SIZES:
        x = torch.randn(size, generator=generator, device=device)
        for pair in pairs:
            src, dst = pair.split("->")
            times[pair].append(_best_time_us(_cast_op(src, dst, x), device))
        del x
    return {pair: fit_linear_cost(CAST_SIZES, times[pair]) for pair in pairs}


# --- the per-device cache ------------------------------------------------------------------------


def device_name(device: torch.device | str) -> str:
    """The device as what is measured on it depends on: on the CPU its model name and precision
    extensions (`host_cpu.cpu_description`), on CUDA its name and compute capability."""
    device = _normalize(device)
    if device.type == "cpu":
        return f"cpu: {cpu_description()}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda: {torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    return device.type


def cache_key(device: torch.device | str) -> dict[str, Any]:
    """What a cached cast-cost fit is valid for: the device (`device_name`), the torch version (and
    its CUDA version) and ``torch.get_num_threads()``."""
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
    }


def cache_path(
    device: torch.device | str,
    cache_dir: str | os.PathLike[str] | None = None,
    kind: str = "cast-costs",
    key: Mapping[str, Any] | None = None,
) -> str:
    """The cache file of a ``kind`` of fit (the cast costs; the offload copy costs) for ``device``:
    named by a hash of ``key``, by default ``cache_key(device)``."""
    text = json.dumps(cache_key(device) if key is None else key, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    directory = default_cache_dir() if cache_dir is None else os.fspath(cache_dir)
    return os.path.join(directory, f"{kind}-{digest}.json")


def cached_fit(
    path: str,
    what: str,
    document_format: str,
    key: Mapping[str, Any],
    costs_problem: Callable[[Any], str | None],
    fit: Callable[[], dict[str, Any]],
) -> tuple[dict[str, Any], bool]:
    """A fit of ``what`` (``"cast-cost"``, ``"copy-cost"``) cached in the JSON file ``path``: its
    ``costs`` and True where the file is a valid ``document_format`` (version `CACHE_VERSION`)
    document made for exactly ``key`` whose costs ``costs_problem`` finds nothing wrong with,
    without fitting anything; else ``fit()`` and False, written there atomically. A file that
    cannot be read, is not JSON or holds no valid fit for this key is never trusted: it is refitted
    and overwritten, with a one-line warning. A cache that cannot be written only warns."""
    data, problem = read_cache_document(path, document_format, CACHE_VERSION, key, f"{what} cache")
    if data is not None:
        problem = costs_problem(data.get("costs"))
        if problem is None:
            return data["costs"], True
    if problem is not None:
        warnings.warn(f"{path}: ignoring the {what} cache ({problem}); refitting", stacklevel=3)
    costs = fit()
    try:
        write_cache_document(path, document_format, CACHE_VERSION, key, {"costs": costs}, f"{what} cache", 2)
    except (OSError, QSyncInputError) as error:
        warnings.warn(f"cannot write the {what} cache: {error}", stacklevel=3)
    return costs, False


def _cast_costs_problem(costs: Any, pairs: list[str]) -> str | None:
    """Why ``costs`` is not a fit of every cast of ``pairs``; None if it is."""
    if not isinstance(costs, dict) or sorted(costs) != sorted(pairs):
        return "does not hold this device's casts"
    for pair, fit in costs.items():
        if not isinstance(fit, dict) or sorted(fit) != sorted(_COST_FIELDS):
            return f"bad entry for {pair}"
        values = [fit[name] for name in _COST_FIELDS]
        if not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
        ):
            return f"bad numbers for {pair}"
        if fit["alpha_us_per_element"] < 0 or fit["beta_us"] < 0:
            return f"negative cost for {pair}"
    return None


def cast_costs(
    device: torch.device | str, cache_dir: str | os.PathLike[str] | None = None
) -> dict[str, dict[str, float]]:
    """``fit_cast_costs(device)``, cached in a JSON file per device (``cache_path``, `cached_fit`):
    a valid cache file for this exact ``cache_key`` is returned as it is, without timing anything."""
    device = _normalize(device)
    pairs = cast_pairs(device)
    costs, _ = cached_fit(
        cache_path(device, cache_dir),
        "cast-cost",
        CACHE_FORMAT,
        cache_key(device),
        lambda costs: _cast_costs_problem(costs, pairs),
        lambda: fit_cast_costs(device),
    )
    return {pair: {name: float(fit[name]) for name in _COST_FIELDS} for pair, fit in costs.items()}


# --- layer probes --------------------------------------------------------------------------------


def _private_lp(module: nn.Module) -> LPModule:
    """An LP module of ``module``'s class and configuration on its own copies of the parameters and
    buffers, without the original's hooks (a recorder's hooks must not fire, or be deep-copied)."""
    stock = module.to_stock() if isinstance(module, LPModule) else module
    lp_cls = lp_class_for(stock)
    if lp_cls is None:
        raise TypeError(f"probe_layer_costs needs a Linear, Conv1d or Conv2d, not {type(module).__name__}")
    if next(stock.children(), None) is not None:
        raise ValueError(f"the {type(module).__name__} has child modules (a parametrization?)")
    twin = _rebuild(type(stock), stock)  # modules.py's private rebuild: config only, fresh hook dicts
    with torch.no_grad():
        for name, param in twin._parameters.items():
            if param is not None:
                twin._parameters[name] = nn.Parameter(param.detach().clone(), param.requires_grad)
        for name, buffer in twin._buffers.items():
            if buffer is not None:
                twin._buffers[name] = buffer.detach().clone()
    return lp_cls.from_module(twin)


def _saved_bytes(
    module: nn.Module, x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> int:
    """Bytes autograd saves for backward in one forward of ``module`` on ``x`` (``forward(x)``,
    default ``module(x)``): each saved tensor counted once per storage, the module's own parameters left out
    (as the recorder counts)."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> int:
        # keep the size, not the tensor: no backward runs here, and a graph holding its own output
        # (ReLU saves its result) would be a reference cycle that is never freed
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return storage.nbytes()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda nbytes: nbytes):
        out = (forward or module)(x)
    del out
    return sum(seen.values())


def _transient_bytes(lp: LPModule, x: torch.Tensor, grad: torch.Tensor) -> tuple[int, int]:
    """Bytes one forward and one backward of ``lp`` hold at their peak beyond what they keep: the
    forward's temporaries (peak less what is still allocated when it returns: output and saved
    tensors), and the backward's peak over what was allocated when it started. Read from the
    profiler's allocation events (`allocator_profile.py`), the one allocator view on CPU and CUDA."""

    def forward_and_backward() -> None:
        with torch.profiler.record_function(_PROBE_FORWARD):
            out = lp(x)
        with torch.profiler.record_function(_PROBE_BACKWARD):
            out.backward(grad)

    events = profiled_events(forward_and_backward, x.device)
    ranges = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") in _PROBE_RANGES}

    def totals(name: str) -> list[int]:
        return allocator_totals(events, *ranges[name])

    forward, backward = totals(_PROBE_FORWARD), totals(_PROBE_BACKWARD)
    if not forward:
        return 0, 0
    kept = forward[-1]
    return max(forward) - kept, max(max(backward, default=kept) - kept, 0)


def _doubled(lp: LPModule, x: torch.Tensor) -> torch.Tensor:
    """``x`` with twice the batch: concatenated along the batch dimension when there is one, else
    stacked into a batch of two (an unbatched conv input, a 1-D linear input)."""
    batched = x.dim() >= 2 if isinstance(lp, LPLinear) else x.dim() == lp.weight.dim()
    return torch.cat([x, x]) if batched else torch.stack([x, x])


def probe_layer_costs(
    module: nn.Module,
    input_shape: Sequence[int],
    precisions: Iterable[str] | None = None,
    repeats: int = 5,
) -> dict[str, dict[str, float]]:
    """Forward and backward time, and saved-for-backward bytes, of one layer at each precision.

    ``module`` is an ``nn.Linear``, ``nn.Conv1d`` or ``nn.Conv2d`` (or an LP module); it is probed
    on its weight's device at ``precisions`` (default: every precision its LP module runs there,
    ``allowed_precisions``; one it cannot run raises ValueError). Probing leaves training alone:
    the probe runs an LP module built on private clones of the parameters (not the real ones, whose
    values and ``.grad`` stay as they were; not its hooks, which do not fire), on a random fp32
    input of ``input_shape`` with ``requires_grad`` (so the input gradient is part of the backward)
    and a random output gradient, both from a private generator (the global RNG is untouched).

    One untimed warm-up forward + backward per precision, then ``repeats`` timed rounds, each
    running every precision once in turn (so that a drift of the machine's speed during the probe
    slows every precision alike); ``forward_us`` and ``backward_us`` are the medians, in
    microseconds, of ``lp(x)`` and ``out.backward(grad)``, the device synchronized around each.
    ``saved_bytes`` is what autograd holds for backward after one forward
    (``torch.autograd.graph.saved_tensors_hooks``, once per storage, the probe's parameters left
    out): the activation memory at that precision, including the cast or quantized copies of the
    weight the low-precision backward keeps. It is split by a
    second forward on twice the batch (saved bytes are affine in the batch):
    ``saved_activation_bytes`` grows with the batch, ``saved_weight_bytes`` does not. The int8
    entry also has ``fp32_fallback``: 1.0 if ``_int_mm`` could not take the shape on the device and
    the stock fp32 op ran instead (so the int8 numbers are fp32 ones), else 0.0.

    Returns ``{"fp32": {"forward_us": .., "backward_us": .., "saved_bytes": ..,
    "saved_activation_bytes": .., "saved_weight_bytes": ..}, "bf16": {...}, ...}`` in
    ``PRECISIONS`` order.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, not {repeats}")
    lp = _private_lp(module)
    device = lp.weight.device
    allowed = lp.allowed_precisions(device)
    if precisions is None:
        chosen = list(allowed)
    else:
        wanted = list(dict.fromkeys(precisions))
        refused = [p for p in wanted if p not in allowed]
        if refused:
            names, runs = ", ".join(refused), ", ".join(allowed)
            raise ValueError(f"{type(lp).__name__} cannot run {names} on {device} (it runs {runs})")
        chosen = [p for p in PRECISIONS if p in wanted]
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tuple(input_shape), generator=generator, device=device).requires_grad_()
    grads: list[torch.Tensor] = []  # one output gradient for every precision, made at the first
    params = list(lp.parameters())
    results: dict[str, dict[str, float]] = {}
    fallbacks: dict[str, int] = {}

    def gradient(out: torch.Tensor) -> torch.Tensor:
        if not grads:
            grads.append(torch.randn(out.shape, generator=generator, device=device, dtype=out.dtype))
        return grads[0]

    def run(precision: str) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        lp.precision = precision
        lp.int8_fallbacks = 0
        x.grad = None
        for p in params:
            p.grad = None
        out = lp(x)
        fallbacks[precision] = lp.int8_fallbacks
        return out, gradient

    with torch.enable_grad():
        for precision in chosen:
            lp.precision = precision
            saved = _saved_bytes(lp, x)
            saved_double = _saved_bytes(lp, _doubled(lp, x.detach()).requires_grad_())
            activation = min(max(saved_double - saved, 0), saved)
            results[precision] = {
                "saved_bytes": float(saved),
                "saved_activation_bytes": float(activation),
                "saved_weight_bytes": float(saved - activation),
            }
        times = _round_robin_us(chosen, run, device, repeats)
    for precision in chosen:
        lp.precision = precision
        with torch.enable_grad():
            forward_transient, backward_transient = _transient_bytes(lp, x, grads[0])
        results[precision] = {
            "forward_us": times[precision][0],
            "forward_transient_bytes": float(forward_transient),
            "backward_transient_bytes": float(backward_transient),
            "backward_us": times[precision][1],
            **results[precision],
        }
        if precision == "int8":
            results[precision]["fp32_fallback"] = 1.0 if fallbacks[precision] else 0.0
    return results


def probe_pass_through_costs(
    module: nn.Module,
    input_shape: Sequence[int],
    device: torch.device | str,
    precisions: Iterable[str],
    repeats: int = 5,
) -> dict[str, dict[str, float]]:
    """Forward and backward time and saved-for-backward bytes of a parameter-free layer (one of
    `precision_links.PASS_THROUGH_TYPES`: ReLU, Dropout, MaxPool2d, ...) on ``device``, on an
    input of ``input_shape`` in fp32 and in the dtype of each of ``precisions`` that is computed in
    a float dtype (bf16, fp16; the others are left out): what the layer costs when a link passes it
    a low-precision tensor.

    Timed as ``probe_layer_costs`` times a layer (a warm-up, then ``repeats`` round-robin rounds,
    medians of the synchronized forward and backward); the class's forward is called, not the
    module, so no hook of a recorder fires, and the random number generators are forked, so a
    dropout draws nothing from the run's. ``saved_bytes`` all grows with the batch (no parameters).

    Returns ``{"fp32": {"forward_us": .., "backward_us": .., "saved_bytes": ..}, "bf16": {...}}``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, not {repeats}")
    device = torch.device(device)
    wanted = set(precisions)
    dtypes = {
        "fp32": torch.float32,
        **{p: CAST_DTYPES[p] for p in PRECISIONS if p in wanted & set(CAST_DTYPES)},
    }
    forward_fn = type(module).forward
    generator = torch.Generator(device=device).manual_seed(0)
    base = torch.randn(tuple(input_shape), generator=generator, device=device)
    inputs = {p: base.to(dtype).requires_grad_() for p, dtype in dtypes.items()}
    saved: dict[str, int] = {}

    def run(p: str) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        inputs[p].grad = None
        return forward_fn(module, inputs[p]), torch.ones_like

    forked = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), torch.enable_grad():
        for p, x in inputs.items():
            saved[p] = _saved_bytes(module, x, lambda t: forward_fn(module, t))
        times = _round_robin_us(list(inputs), run, device, repeats)
    return {
        p: {"forward_us": times[p][0], "backward_us": times[p][1], "saved_bytes": float(saved[p])}
        for p in dtypes
    }
