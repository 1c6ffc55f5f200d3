"""Calibrate what recording adds to a step, per recorded event, on this machine.

Measured, not assumed: three tight loops run inside the recording's first profiler session and
again in its last (shapes and memory on, as the recording is), each repeat timed twice back to
back: recorded, and unrecorded (the profiler's record functions switched off for the thread, the
layer hooks removed), so that the machine's drift cancels in each pair; a loop's extra time in a
round is the median over its repeats of the pair's difference, so that one slow moment moves
nothing, and its extra time is the lower of the two rounds', so that a slow stretch as long as a
whole round (the profiler's first buffers taking fresh pages, another process on a core) does not
either (`overhead_per_event`):

- ``op``: an in-place add of one small tensor to another (one op event, no allocation);
- ``memory``: the same add out of place (one op event, and an allocation and a free);
- ``range``: a call of an ``nn.Identity`` carrying the recorder's layer hooks: what a hooked layer
  adds, hooks and range.

With record functions off the profiler still records allocations (not the frees), so the memory
loop's unrecorded half keeps part of its memory events' cost and a memory event comes out somewhat
cheaper than it is; it is the cheapest kind by far (under 0.1 us here).

Each loop's recorded halves run in ``qsync::calibration::<loop>`` ranges, and the trace conversion
counts the events of each kind (`kineto.event_kind`) the profiler recorded there
(`kineto.calibration_event_counts`), rather than assuming what a loop body records (adding a Python
scalar instead of a tensor, for one, records four more ops nested in the add, converting the
scalar, and four memory events). A loop's extra time per iteration is the sum over kinds of its
events per iteration times the cost of one event of that kind; the three loops give three
equations for the three costs (0.50-1.18 us per op, at most 0.13 us per memory event and 2.8-5.0 us
per hooked layer, over the 21 one-process runs of `benchmarks/prediction_accuracy.py` in
session 7: the trace's ``profiler_overhead_us``).

In a whole training step recording costs more than these hot loops say: the interpreter runs cold
between large ops, the profiler's buffers grow, and the recorder's own hooks (layer ranges, the
storage watch of `live_memory.py`) run. Whole steps of the benchmark models cost up to 26 times
the loops' figure (session 7's prediction-accuracy table, benchmarks/README.md): no loop is a
steady stand-in for a real step. Nor is a neighbour: the unprofiled step after a profiler session
takes thousands of page faults more under glibc malloc (the session's buffers are handed back to
the system, and the step takes pages again), and the allocator's thresholds, raised by the
profiler's large blocks, make the steps after the window take none where those before it took
thousands.

So the loops give what an op, a memory event and a layer range cost each, and the run's measured
steps give the rest (`event_costs.calibrate_on_steps`): the recorded steps' median less the unprofiled steps'
median (the measured step time's own samples) is what recording added to a step, and what that shows
beyond the loops' share is a slowdown of the whole step, taken off each op and each idle time in
proportion (for a small model most of it lies between the ops: the recorder's Python hooks); where
the recorded steps ran faster, each op and idle time is lengthened in proportion instead. The
replay of the recorded configuration then matches the measured step time by construction (its error
checks the replay, not the profiler's cost), and a plan's prediction is the measured step with the
ops the plan changes re-costed: a real prediction, judged by verify.

Timing the loops inside the recording's own profiler session (before its first step, in a
``qsync::calibration`` range) costs no extra profiler start and stop. The normalized trace keeps
the figures (``profiler_overhead_us``) and each op's share of them, so the replay can predict the
run without the profiler.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from qsync_callback.quiet_profiler import quiet_kineto
from qsync_callback.recorder.event_costs import event_costs
from qsync_callback.recorder.kineto import CALIBRATION_LOOP_PREFIX
from qsync_callback.recorder.layer_ranges import LayerRanges

EVENT_KINDS = ("op", "memory", "range")
_LOOPS = 100
_REPEATS = 10


def profiler_kwargs(device: str) -> dict:
    """The profiler configuration used for recording (and so for calibration); Kineto's console
    lines are silenced before the session starts (`quiet_profiler`)."""
    quiet_kineto()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return {"activities": activities, "record_shapes": True, "profile_memory": True}


def _recorded_extra(name: str, loop: Callable[[], None], hooks: LayerRanges | None = None) -> float:
    """Median over repeats of (recorded - unrecorded) seconds per iteration of ``loop``; the
    recorded half in a ``qsync::calibration::<name>`` range (with ``hooks`` installed)."""
    extras = []
    for _ in range(_REPEATS):
        if hooks is not None:
            hooks.install()
        try:
            with torch.profiler.record_function(CALIBRATION_LOOP_PREFIX + name):
                start = time.perf_counter()
                loop()
                recorded = time.perf_counter() - start
        finally:
            if hooks is not None:
                hooks.remove()
        torch._C._autograd._enable_record_function(False)
        try:
            start = time.perf_counter()
            loop()
            unrecorded = time.perf_counter() - start
        finally:
            torch._C._autograd._enable_record_function(True)
        extras.append(recorded - unrecorded)
    return statistics.median(extras) / _LOOPS


def calibration_extra_times() -> dict[str, float]:
    """Seconds the active profiler adds per iteration of each calibration loop (`_recorded_extra`);
    call it inside a profiler session configured as the recording is."""
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

    return {
        "op": _recorded_extra("op", in_place),
        "memory": _recorded_extra("memory", allocating),
        "range": _recorded_extra("range", module_calls, LayerRanges({"calibration": module})),
    }


def overhead_per_event(
    rounds: Sequence[Mapping[str, float]], event_counts: Mapping[str, Mapping[str, int]]
) -> dict[str, float]:
    """Microseconds recording adds per recorded op, memory event and layer range
    (`event_costs.event_costs`).

    ``rounds``: each round's seconds per iteration the profiler added to each loop
    (`calibration_extra_times`), of which each loop's lowest counts; ``event_counts``: the events of
    each kind recorded in each loop's ranges, over all its repeats of every round
    (`kineto.calibration_event_counts`)."""
    extra = {loop: min(r[loop] for r in rounds) for loop in rounds[0]}
    iterations = _LOOPS * _REPEATS * len(rounds)
    per_iteration = {
        loop: {kind: n / iterations for kind, n in event_counts.get(loop, {}).items()} for loop in extra
    }
    return event_costs(EVENT_KINDS, {loop: seconds * 1e6 for loop, seconds in extra.items()}, per_iteration)
