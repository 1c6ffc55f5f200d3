"""Solve what a profiler adds per recorded event of each kind from calibration loops, and what
recording added to the recorded steps beyond that, from the run's own unprofiled steps, for both
recorders (`overhead.py` for torch, `tf_recorder.ProfilerCalibration` for TensorFlow)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import numpy as np

from qsync_callback.recorder.trace import Trace


def event_costs(
    kinds: Sequence[str], extra_us: Mapping[str, float], events: Mapping[str, Mapping[str, float]]
) -> dict[str, float]:
    """Microseconds per recorded event of each of ``kinds``.

    ``extra_us``: microseconds the profiler added per iteration of each loop; ``events``: the events
    of each kind one iteration of the loop recorded. The costs solve, by least squares, extra time =
    events @ cost per event over the loops, none negative: a kind whose cost comes out negative
    (noise: one kind may cost far less than another) is set to 0 and the others are solved again
    without it, so that its loop's time still informs them; a kind no loop records comes out 0."""
    loops = sorted(extra_us.keys() & events.keys())
    counts = np.array([[events[loop].get(k, 0) for k in kinds] for loop in loops], dtype=float)
    extra = np.array([extra_us[loop] for loop in loops], dtype=float)
    costs = np.zeros(len(kinds))
    kept = [j for j in range(len(kinds)) if loops and counts[:, j].any()]
    while kept:
        solved = np.linalg.lstsq(counts[:, kept], extra, rcond=None)[0]
        if solved.min() >= 0:
            costs[kept] = solved
            break
        kept.pop(int(solved.argmin()))
    return {kind: round(float(c), 3) for kind, c in zip(kinds, costs, strict=True)}


def calibrate_on_steps(trace: Trace, plain_ms: Sequence[float]) -> dict[str, float | None]:
    """What recording added to ``trace``'s recorded steps beyond the loops' per-event costs, for
    ``trace.measured["profiler_share"]`` (which `Trace.own_us`, `Trace.gap_overhead_us` and
    `Trace.gap_kept` apply).

    ``in_step_ms``: the recorded steps' median time less the median of ``plain_ms`` (the unprofiled
    steps' times, the measured step time's samples); ``loops_share_ms``: the median over recorded
    steps of the ops' ``overhead_us`` and ``gap_overhead_us`` (the loops' costs per event). If the
    steps show more, the rest is a ``slowdown`` of the whole step: the fraction of the recorded
    median less the loops' share that it is, by which every op but a collective, and the idle time
    before it, runs shorter without the profiler; if less, ``scale`` (below 1) shrinks the loops'
    shares to it. Recorded steps faster than the unprofiled ones take nothing off (``scale`` 0) and
    give a negative ``slowdown``, the fraction of the recorded median they were faster by: without
    the profiler every op but a collective, and the idle time before it, runs that much longer.
    A correction one way only leans the prediction low wherever drift makes the recorded steps the
    faster (the Horovod accuracy table of `benchmarks/README.md` compares a run before this with one
    after). Without unprofiled steps nothing changes (1 and 0)."""
    loops_us: dict[int, float] = {step.index: 0.0 for step in trace.steps}
    for op in trace.ops:
        if op.step in loops_us:
            loops_us[op.step] += op.overhead_us + op.gap_overhead_us
    profiled_ms = [(step.end_us - step.start_us) / 1e3 for step in trace.steps]
    loops_ms = statistics.median(loops_us.values()) / 1e3 if loops_us else 0.0
    figures: dict[str, float | None] = {
        "in_step_ms": None,
        "loops_share_ms": loops_ms,
        "scale": 1.0,
        "slowdown": 0.0,
    }
    if not profiled_ms or not plain_ms:
        return figures
    recorded_ms = statistics.median(profiled_ms)
    in_step = recorded_ms - statistics.median(plain_ms)
    figures["in_step_ms"] = in_step
    if in_step < loops_ms:
        if loops_ms > 0:
            figures["scale"] = max(0.0, in_step) / loops_ms
        if in_step < 0 and recorded_ms > 0:
            figures["slowdown"] = in_step / recorded_ms
    elif recorded_ms > loops_ms:
        figures["slowdown"] = (in_step - loops_ms) / (recorded_ms - loops_ms)
    return figures
