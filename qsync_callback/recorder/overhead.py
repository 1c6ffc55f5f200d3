"""Calibrate what recording adds to a step, per recorded event, on this machine.

Measured, not assumed: three tight loops are timed once before the recording's profiler starts
and once inside it (best of a few repeats each), with the profiler configured as the recording is
(shapes and memory on):

- ``op``: an in-place add of one small tensor to another (one op event, no allocation);
- ``memory``: the same add out of place (one op event, and an allocation and a free);
- ``range``: a call of an ``nn.Identity`` carrying the recorder's layer hooks (inside the profiler)
  against the same call without hooks (before it): what a hooked layer adds, hooks and range.

Each loop's profiled half runs in a ``qsync::calibration::<loop>`` range, and the trace conversion
counts the events of each kind (`kineto.event_kind`) the profiler recorded there
(`kineto.calibration_event_counts`), rather than assuming what a loop body records (adding a Python
scalar instead of a tensor, for one, records four more ops nested in the add, converting the
scalar, and four memory events). A loop's extra time per iteration is the sum over kinds of its
events per iteration times the cost of one event of that kind; the three loops give three
equations for the three costs (about 0.4 us per op, under 0.1 us per memory event and about 2 us
per hooked layer here).

In a whole training step the profiler costs more per event than in these hot loops: 0.5 to 0.8 us
(CNN and MLP steps under Lightning, about 1400 events each, profiled against unprofiled steps), and
a hooked layer about 20 us (from the trace of a real forward against one without hooks), as the
interpreter runs cold between large ops. A tiny linear layer's forward and backward as the op loop
measured 0.4 to 0.7 us per event from run to run: no steadier a stand-in for a real step. What is
left, 0.3 to 0.8 ms per such step (0.6 to 1.5 %), the prediction still carries.

Timing the profiled half inside the recording's own profiler session (before its first step, in
a ``qsync::calibration`` range) costs no extra profiler start and stop. The normalized trace keeps
the figures (``profiler_overhead_us``) and each op's share of them, so the replay can predict the
run without the profiler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from qsync_callback.quiet_profiler import quiet_kineto
from qsync_callback.recorder.kineto import CALIBRATION_LOOP_PREFIX
from qsync_callback.recorder.layer_ranges import LayerRanges

EVENT_KINDS = ("op", "memory", "range")
_LOOPS = 100
_REPEATS = 10


def _best_time(name: str, fn: Callable[[], None]) -> float:
    best = float("inf")
    with torch.profiler.record_function(CALIBRATION_LOOP_PREFIX + name):
        for _ in range(_REPEATS):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    return best / _LOOPS


def profiler_kwargs(device: str) -> dict:
    """The profiler configuration used for recording (and so for calibration); Kineto's console
    lines are silenced before the session starts (`quiet_profiler`)."""
    quiet_kineto()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return {"activities": activities, "record_shapes": True, "profile_memory": True}


def calibration_loop_times(with_layer_hooks: bool) -> dict[str, float]:
    """Seconds per iteration of each calibration loop, under whatever profiler is active now; each
    loop's repeats run in a ``qsync::calibration::<loop>`` range.

    ``with_layer_hooks``: the module loop runs with the recorder's layer hooks installed (as when
    recording) or without (as when not)."""
    x, y = torch.zeros(8), torch.ones(8)
    module = torch.nn.Identity()

    def in_place() -> None:
        for _ in range(_LOOPS):
            x.add_(y)

    def allocating() -> None:
        for _ in range(_LOOPS):
            x.add(y)

    def module_calls() -> None:
        for _ in range(_LOOPS):
            module(x)

    ranges = LayerRanges({"calibration": module})
    if with_layer_hooks:
        ranges.install()
    try:
        return {
            "op": _best_time("op", in_place),
            "memory": _best_time("memory", allocating),
            "range": _best_time("range", module_calls),
        }
    finally:
        ranges.remove()


def overhead_per_event(
    plain: Mapping[str, float],
    profiled: Mapping[str, float],
    event_counts: Mapping[str, Mapping[str, int]],
) -> dict[str, float]:
    """Microseconds recording adds per recorded op, memory event and layer range.

    ``plain`` and ``profiled``: `calibration_loop_times` before and inside the profiler;
    ``event_counts``: the events of each kind recorded in each loop's range, over all its repeats
    (`kineto.calibration_event_counts`). The costs solve, by least squares, extra time per iteration
    = events per iteration @ cost per event over the loops, none negative: a kind whose cost comes
    out negative (noise: a memory event costs far less than an op, and the loops are timed at two
    moments of a drifting machine) is set to 0 and the others are solved again without it, so
    that its loop's time still informs them; a cost no loop's events determine comes out 0."""
    loops = sorted(plain.keys() & profiled.keys())
    counts = np.zeros((len(loops), len(EVENT_KINDS)))
    for i, loop in enumerate(loops):
        for j, kind in enumerate(EVENT_KINDS):
            counts[i, j] = event_counts.get(loop, {}).get(kind, 0) / (_LOOPS * _REPEATS)
    extra_us = np.array([(profiled[loop] - plain[loop]) * 1e6 for loop in loops])
    costs = np.zeros(len(EVENT_KINDS))
    kept = list(range(len(EVENT_KINDS)))
    while kept:
        solved = np.linalg.lstsq(counts[:, kept], extra_us, rcond=None)[0]
        if solved.min() >= 0:
            costs[kept] = solved
            break
        kept.pop(int(solved.argmin()))
    return {kind: round(float(c), 3) for kind, c in zip(EVENT_KINDS, costs, strict=True)}
