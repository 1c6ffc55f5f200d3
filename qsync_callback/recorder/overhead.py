"""Calibrate what torch.profiler itself adds to a step, per recorded event, on this machine.

Measured, not assumed: three tight loops are timed once before the recording's profiler starts
and once inside it (best of a few repeats each), with the profiler configured as the recording is
(shapes and memory on):

- ``op``: an in-place add on a small tensor (one ``cpu_op`` event, no allocation);
- ``memory``: an out-of-place add (one ``cpu_op`` event plus one allocation and one free), minus
  ``op``, halved: the cost of one memory event;
- ``range``: a call of a module carrying the recorder's layer hooks (one ``user_annotation`` event)
  inside the profiler, against the same call without hooks before it.

Timing the profiled half inside the recording's own profiler session (before its first step, in
a ``qsync::calibration`` range) costs no extra profiler start and stop. The normalized trace keeps
the figures (``profiler_overhead_us``) and each op's share of them, so the replay can predict the
run without the profiler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from qsync_callback.recorder.layer_ranges import LayerRanges

CALIBRATION_RANGE = "qsync::calibration"
_LOOPS = 200
_REPEATS = 5


def _best_time(fn: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(_REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best / _LOOPS


def profiler_kwargs(device: str) -> dict:
    """The profiler configuration used for recording (and so for calibration)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return {"activities": activities, "record_shapes": True, "profile_memory": True}


def calibration_loop_times(with_layer_hooks: bool) -> dict[str, float]:
    """Seconds per iteration of each calibration loop, under whatever profiler is active now.

    ``with_layer_hooks``: the module loop runs with the recorder's layer hooks installed (as when
    recording) or without (as when not)."""
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

    ranges = LayerRanges({"calibration": module})
    if with_layer_hooks:
        ranges.install()
    try:
        return {
            "op": _best_time(in_place),
            "memory": _best_time(allocating),
            "range": _best_time(module_calls),
        }
    finally:
        ranges.remove()


def overhead_per_event(plain: Mapping[str, float], profiled: Mapping[str, float]) -> dict[str, float]:
    """Microseconds the profiler adds per recorded op, memory event and layer range."""
    op = max(0.0, (profiled["op"] - plain["op"]) * 1e6)
    memory = max(0.0, ((profiled["memory"] - plain["memory"]) * 1e6 - op) / 2)
    range_ = max(0.0, (profiled["range"] - plain["range"]) * 1e6)
    return {"op": round(op, 3), "memory": round(memory, 3), "range": round(range_, 3)}
