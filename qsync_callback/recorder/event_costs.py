"""Solve what a profiler adds per recorded event of each kind from calibration loops, for both
recorders (`overhead.py` for torch, `tf_recorder.ProfilerCalibration` for TensorFlow)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


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
