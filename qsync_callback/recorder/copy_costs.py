"""The offload tier's copy cost on this machine: ``time = alpha + beta * bytes``, each way, cached
per device like the cast costs (`qsync_callback.lp.costs.cast_costs`).

`fit_copy_costs` measures with the real store (`qsync_callback.offload_store.store_for`: files on
local disk for the CPU, pinned host memory for CUDA): tensors of `COPY_SIZES` bytes (64 KiB .. 32
MiB) are put in it and got back, `COPY_REPEATS` times each after one untimed round. What is timed
is what the pricing charges (`qsync_callback.predictor.activation`):

- on the disk tier, the training thread's own wait: the wall time of `put` (the applier's store
  writes synchronously, so `put` returns when the file is written) and of `prefetch` + `get` (the
  read queued on the store's thread, waited for) + `release` (the file's removal, which the
  training thread runs when autograd frees the saved tensor in backward). Besides the file's write
  and read this holds the hand-over to the store's thread and back, which the store's own clock
  leaves out: about 0.3 ms a write on this 2-core VM, a quarter of a 4 MiB write, and what made the
  pricing run short by that much per offloaded tensor when it used the store's clock. The removal
  was timed here at 17-21% of the write and read together (1 MiB: 0.07 ms against 0.31; 16 MiB:
  0.86 against 5.2): a file's pages go back to the kernel;
- on the CUDA tier, the copies' own time on the side stream (CUDA events around each copy,
  `OffloadStore.step_stats`): the training thread does not wait for them, the replay's copy lane
  does.

The median per size is fitted by `fit_linear_cost` (least squares weighted to the relative error,
as the cast costs are: the sizes span three decades); the medians are returned beside the fit, with
its r2, since a copy's cost need not be linear over that span (a buffer big enough to be mapped
afresh by the C allocator pays its page faults on every read back), and so is the bandwidth
measured at the largest size. About 0.4 s of copies and evictions on the disk here.

On the disk tier a write lands in the kernel's page cache and a read of a file just written comes
from it; that is also what the store meets in training while the machine has memory to spare.

What it does not meet in training is a page cache still in the CPU's caches. Between an offloaded
tensor's write in forward and its read in backward the step streams far more than the last-level
cache through it, so the read copies from main memory. Timed in a loop of nothing else, a read
came from the cache: on a 2-core AMD EPYC (32 MiB L3), reading back 1 MiB took 0.08 ms right after
its write and 0.36 ms after 256 MiB had been touched in between, 4 MiB 0.26 and 0.63 ms, 16 MiB
(half the L3) 1.49 and 1.63 ms. So on the disk tier the fit evicts the caches between each put and
its get (`EVICTION_CACHES` times the largest cache sysfs names, `host_cpu.largest_cache_bytes`,
written over, at most `EVICTION_MOST`; `EVICTION_BYTES` where sysfs names none); the put's source
is a tensor just made, as a saved tensor usually is.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from qsync_callback.host_cpu import largest_cache_bytes
from qsync_callback.lp.costs import cache_key, cache_path, cached_fit, fit_linear_cost
from qsync_callback.offload_store import store_for

COPY_SIZES: tuple[int, ...] = (2**16, 2**18, 2**20, 2**22, 2**24, 2**25)
"""Bytes of the tensors moved: 64 KiB, 256 KiB, 1 MiB, 4 MiB, 16 MiB, 32 MiB."""
COPY_REPEATS = 5
EVICTION_CACHES = 2
EVICTION_BYTES = 64 * 2**20  # what is written over where sysfs names no cache
EVICTION_MOST = 512 * 2**20  # nor more than this, whatever cache a VM's sysfs names
CACHE_KIND = "copy-costs"
CACHE_FORMAT = "qsync-copy-costs"
DIRECTIONS = ("to_store", "from_store")
_FIT_FIELDS = ("alpha_us", "us_per_byte", "r2", "bytes_per_s", "median_us")


def _key(device: torch.device, directory: str | os.PathLike[str] | None) -> dict[str, Any]:
    """What a fit is valid for: the device's `cache_key`, the tier, and on the CPU the directory the
    files go under (its disk)."""
    if device.type == "cpu":
        where = os.path.realpath(tempfile.gettempdir() if directory is None else os.fspath(directory))
        return {
            **cache_key(device),
            "tier": "disk",
            "directory": where,
            "clock": "training thread, the file's removal included",
            "reads": "after the CPU's caches are evicted",
        }
    return {**cache_key(device), "tier": "pinned", "clock": "copy stream"}


def fit_copy_costs(
    device: torch.device | str, directory: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """Measure the copies to ``device``'s offload tier and back, and fit each direction (see the
    module docstring). Returns ``{"tier": .., "device": .., "sizes": [...], "to_store": {"alpha_us":
    .., "us_per_byte": .., "r2": .., "bytes_per_s": .., "median_us": [one per size]}, "from_store":
    {...}, "source": "measured"}``; OSError if the store could not write."""
    device = torch.device(device)
    store = store_for(device, directory, synchronous=True)
    evict = _cache_evictor() if store.tier == "disk" else lambda: None
    times: dict[str, dict[int, list[float]]] = {d: {size: [] for size in COPY_SIZES} for d in DIRECTIONS}
    try:
        for round_ in range(COPY_REPEATS + 1):  # round 0 warms the store up
            for size in COPY_SIZES:
                waited = {}
                tensor = torch.ones(size, dtype=torch.uint8, device=device)
                start = time.perf_counter()
                key = store.put(tensor)
                waited["to_store"] = time.perf_counter() - start
                del tensor
                store.flush()
                evict()
                start = time.perf_counter()
                store.prefetch([key])
                store.get(key)
                store.release(key)
                waited["from_store"] = time.perf_counter() - start
                store.flush()
                stats = store.step_stats()
                if round_:
                    for direction in DIRECTIONS:
                        seconds = waited[direction] if store.tier == "disk" else stats[direction]["seconds"]
                        times[direction][size].append(seconds * 1e6)
        failure = store.failure()
    finally:
        store.close()
    if failure is not None:
        raise OSError(f"cannot measure the offload copy costs: {failure}")
    out: dict[str, Any] = {"tier": store.tier, "device": str(device), "sizes": list(COPY_SIZES)}
    for direction in DIRECTIONS:
        medians = [statistics.median(times[direction][size]) for size in COPY_SIZES]
        fit = fit_linear_cost(COPY_SIZES, medians)
        out[direction] = {
            "alpha_us": fit["beta_us"],
            "us_per_byte": fit["alpha_us_per_element"],
            "r2": fit["r2"],
            "bytes_per_s": COPY_SIZES[-1] / (medians[-1] / 1e6),
            "median_us": medians,
        }
    out["source"] = "measured"
    return out


def _cache_evictor() -> Callable[[], None]:
    """What evicts the CPU's caches: a write over a buffer `EVICTION_CACHES` times the largest
    cache (see the module docstring)."""
    largest = largest_cache_bytes()
    nbytes = EVICTION_BYTES if largest is None else min(EVICTION_CACHES * largest, EVICTION_MOST)
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    return lambda: buffer.add_(1)


def copies_us(costs: Mapping[str, Any], direction: str, nbytes: float, copies: float = 1) -> float:
    """What the fit ``costs`` (`fit_copy_costs`' result) prices ``copies`` copies of ``nbytes`` bytes
    in all, in ``direction`` ("to_store" or "from_store"), in us; the fit is linear, so the sizes
    need not be known one by one."""
    fit = costs[direction]
    return float(copies * fit["alpha_us"] + fit["us_per_byte"] * nbytes)


def _costs_problem(costs: Any, tier: str) -> str | None:
    """Why ``costs`` is not a copy-cost fit of ``tier`` at `COPY_SIZES`; None if it is."""
    if not isinstance(costs, dict) or costs.get("tier") != tier or costs.get("sizes") != list(COPY_SIZES):
        return "does not hold this tier's fit"
    for direction in DIRECTIONS:
        fit = costs.get(direction)
        if not isinstance(fit, dict) or sorted(fit) != sorted(_FIT_FIELDS):
            return f"bad entry for {direction}"
        medians = fit["median_us"]
        if not isinstance(medians, list) or len(medians) != len(COPY_SIZES):
            return f"bad medians for {direction}"
        values = [*(fit[name] for name in _FIT_FIELDS if name != "median_us"), *medians]
        if not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
        ):
            return f"bad numbers for {direction}"
        if fit["alpha_us"] < 0 or fit["us_per_byte"] < 0 or fit["bytes_per_s"] <= 0:
            return f"negative cost for {direction}"
    return None


def copy_costs(
    device: torch.device | str,
    directory: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """``fit_copy_costs(device, directory)``, cached in a JSON file per device and tier (and, on the
    CPU, per directory), as the cast costs are (``lp.costs.cached_fit``, file kind ``copy-costs``):
    a valid cache file for this key is returned without copying anything, its ``source`` saying
    which file."""
    device = torch.device(device)
    key = _key(device, directory)
    path = cache_path(device, cache_dir, kind=CACHE_KIND, key=key)
    fitted: dict[str, Any] = {}

    def fit() -> dict[str, Any]:
        fitted.update(fit_copy_costs(device, directory))
        return {name: value for name, value in fitted.items() if name != "source"}

    costs, cached = cached_fit(
        path, "copy-cost", CACHE_FORMAT, key, lambda costs: _costs_problem(costs, key["tier"]), fit
    )
    return {**costs, "source": f"cache {path}"} if cached else fitted
