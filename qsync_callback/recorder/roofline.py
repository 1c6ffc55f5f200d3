"""This machine's roofline: what an op costs before any op of the model has run.

Three figures, measured once per device and cached (`lp.costs.cached_fit`, file kind ``roofline``):

- ``op_us``: one tiny op (an add of one-element tensors) called from Python, the least over
  repeats: the dispatcher's and the interpreter's cost that every op pays;
- ``bytes_per_us``: an add of three `BANDWIDTH_BYTES` tensors (two read, one written), the least
  over repeats: the memory bandwidth a pointwise op reaches;
- ``flops_per_us``, per float dtype asked for: a square matmul, the least over repeats (not assumed:
  bf16 was 0.37x fp32's time on one of these CPUs and 40x on another).

The least over repeats keeps a brief stall out, not a machine busy throughout: measured beside
another job, the matmul rate came out at half the idle machine's (33 against 72 GFLOP/s here).
Delete the cache file (its path is in ``source``) to measure again. `predictor/op_costs.py`
prices an op from them. They are the fallback a learned per-op model
replaces where it has data, and a prediction made from them says so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import torch

from qsync_callback.lp.costs import cache_key, cache_path, cached_fit

CACHE_KIND = "roofline"
CACHE_FORMAT = "qsync-roofline"
REPEATS = 5
TINY_OP_CALLS = 2000
BANDWIDTH_BYTES = 32 << 20
MATMUL_SIZE = {torch.float32: 512, torch.float64: 384}  # other dtypes: `SMALL_MATMUL`
SMALL_MATMUL = 192  # for dtypes this CPU may run slowly (fp16 was 150x fp32's time on one)
DTYPES = {
    "float": torch.float32,
    "double": torch.float64,
    "c10::BFloat16": torch.bfloat16,
    "c10::Half": torch.float16,
}


def _least_us(run: Any, calls: int = 1) -> float:
    run()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        times.append((time.perf_counter() - start) * 1e6 / calls)
    return min(times)


def fit_roofline(device: torch.device, dtypes: Iterable[str]) -> dict[str, Any]:
    """The three figures on ``device`` (see the module docstring), matmul rates for ``dtypes``
    (Kineto's names: ``"float"``, ``"c10::BFloat16"``...); unknown names are left out."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    one = torch.ones(1, device=device)
    op_us = _least_us(lambda: torch.add(one, one), TINY_OP_CALLS)
    n = BANDWIDTH_BYTES // 4
    a, b, out = (torch.ones(n, device=device) for _ in range(3))

    def add() -> None:
        torch.add(a, b, out=out)
        sync()

    bytes_per_us = 3 * BANDWIDTH_BYTES / max(_least_us(add) - op_us, 1e-3)
    flops_per_us = {}
    for name in sorted(set(dtypes)):
        dtype = DTYPES.get(name)
        if dtype is None:
            continue
        size = MATMUL_SIZE.get(dtype, SMALL_MATMUL)
        x = torch.ones(size, size, device=device, dtype=dtype)

        def matmul(x: torch.Tensor = x) -> None:
            torch.mm(x, x)
            sync()

        flops_per_us[name] = 2 * size**3 / max(_least_us(matmul) - op_us, 1e-3)
    return {"op_us": op_us, "bytes_per_us": bytes_per_us, "flops_per_us": flops_per_us}


def _problem(costs: Any) -> str | None:
    if not isinstance(costs, dict) or not all(k in costs for k in ("op_us", "bytes_per_us", "flops_per_us")):
        return "not a roofline"
    figures = [costs["op_us"], costs["bytes_per_us"], *costs["flops_per_us"].values()]
    if not all(isinstance(v, (int, float)) and v > 0 for v in figures):
        return "a figure that is not a positive number"
    return None


def roofline(
    device: torch.device | str,
    dtypes: Iterable[str] = ("float",),
    cache_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """`fit_roofline` for ``device`` and ``dtypes``, cached per device and dtypes; ``source`` says
    whether it was measured now or read from which file."""
    device = torch.device(device)
    names = sorted({d for d in dtypes if d in DTYPES} | {"float"})
    key = {**cache_key(device), "dtypes": names}
    path = cache_path(device, cache_dir, kind=CACHE_KIND, key=key)
    costs, cached = cached_fit(
        path, "roofline", CACHE_FORMAT, key, _problem, lambda: fit_roofline(device, names)
    )
    return {
        **costs,
        "source": f"cache {path}" if cached else f"measured on {key['device']} now, cached in {path}",
    }
