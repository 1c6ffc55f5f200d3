"""The 95% band of a mean estimated from its own samples: Student's t, one degree of freedom fewer
than the samples. Their spread is estimated from them, so a band of 2 standard errors (a normal's)
is too narrow over a few samples (at 3 Student's factor is 4.30, at 6 2.57, at 18 2.11)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from functools import cache

from scipy import stats


@cache
def band_factor(samples: int) -> float:
    """How many standard errors of the mean of ``samples`` samples their 95% band spans: Student's t
    at 97.5% with ``samples - 1`` degrees of freedom (at least 2 samples)."""
    return float(stats.t.ppf(0.975, samples - 1))


def mean_band(samples: Sequence[float]) -> float:
    """Half the width of the 95% band of ``samples``' mean (`band_factor` standard errors); 0 under
    two samples, whose spread cannot be estimated."""
    if len(samples) < 2:
        return 0.0
    return band_factor(len(samples)) * statistics.stdev(samples) / len(samples) ** 0.5
