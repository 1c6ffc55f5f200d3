"""Calibrate what torch.profiler itself adds to a step, per recorded event, on this machine.

Measured, not assumed: three tight loops run once without and once under a profiler configured as
the recording is (shapes and memory on), best of a few repeats each:

- ``op``: an in-place add on a small tensor (one ``cpu_op`` event, no allocation);
- ``memory``: an out-of-place add (one ``cpu_op`` event plus one allocation and one free), minus
  ``op``, halved: the cost of one memory event;
- ``range``: a call of a module carrying the recorder's layer hooks (one ``user_annotation`` event)
  under the profiler, against the same call without hooks or profiler.

The normalized trace keeps these figures (``profiler_overhead_us``) and each op's share of them, so
the replay can predict the run without the profiler.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from qsync_callback.recorder.layer_ranges import LayerRanges

_LOOPS = 600
_REPEATS = 5


def _best_time(fn: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(_REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def profiler_kwargs(device: str) -> dict:
    """The profiler configuration used for recording (and so for calibration)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return {"activities": activities, "record_shapes": True, "profile_memory": True}


def calibrate_profiler_overhead(device: str = "cpu") -> dict[str, float]:
    """Microseconds the profiler adds per recorded op, memory event and layer range."""
    x = torch.zeros(8)
    module = torch.nn.Identity()

    def in_place() -> None:
        for _ in range(_LOOPS):
            x.add_(1.0)

    def allocating() -> None:
        for _ in range(_LOOPS):
            x.add(1.0)

    def module_calls() -> None:
        for _ in range(_LOOPS):
            module(x)

    plain = {"op": _best_time(in_place), "memory": _best_time(allocating), "range": _best_time(module_calls)}
    ranges = LayerRanges({"calibration": module})
    with torch.profiler.profile(**profiler_kwargs(device)):
        profiled_op = _best_time(in_place)
        profiled_alloc = _best_time(allocating)
        ranges.install()
        try:
            profiled_range = _best_time(module_calls)
        finally:
            ranges.remove()
    per_call = 1e6 / _LOOPS
    op = max(0.0, (profiled_op - plain["op"]) * per_call)
    memory = max(0.0, ((profiled_alloc - plain["memory"]) * per_call - op) / 2)
    range_ = max(0.0, (profiled_range - plain["range"]) * per_call)
    return {"op": round(op, 3), "memory": round(memory, 3), "range": round(range_, 3)}
