"""The band of a mean estimated from its own samples: Student's t, one degree of freedom fewer than
the samples (and the band of a median, `median_band`, from their interquartile range). Their
spread is estimated from them, so a band of 2 standard errors (a normal's) is too narrow over a few
samples (95%: at 3 Student's factor is 4.30, at 6 2.57, at 18 2.11).

A mean looked at again and again as its samples grow (the loop's turns, `alternation.py`) gets more
chances to stray past a 95% band: each look is tested at the lower level that `sequential_level`
gives (O'Brien and Fleming's boundary), so that all of them together stray no more often than one
look at 95% would.

Step times' changes and noise are said in % of a reference: `change_pct`, `median_noise_pct` (a
median's band), `combined_noise_pct` (of a difference of medians)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from functools import cache

import numpy as np
from scipy import optimize, stats

LEVEL = 0.05  # a band's two-sided level: the chance that a mean of 0 falls outside it
GRID_STEP = 0.01  # the grid of `sequential_level`'s running sum, in standard deviations of one sample


@cache
def band_factor(samples: int, level: float = LEVEL) -> float:
    """How many standard errors of the mean of ``samples`` samples their band spans at the two-sided
    ``level``: Student's t at ``1 - level / 2`` with ``samples - 1`` degrees of freedom (at least 2
    samples)."""
    return float(stats.t.isf(level / 2, samples - 1))  # isf: finite at levels far under 1e-16


def mean_band(samples: Sequence[float]) -> float:
    """Half the width of the 95% band of ``samples``' mean (`band_factor` standard errors); 0 under
    two samples, whose spread cannot be estimated."""
    if len(samples) < 2:
        return 0.0
    return band_factor(len(samples)) * statistics.stdev(samples) / len(samples) ** 0.5


def median_band(samples: Sequence[float]) -> float | None:
    """How far the median of ``samples`` may be from the typical value by chance, in their unit: the
    half-width of its 95% band (2 standard errors of a median, 1.2533 sigma / sqrt(n), with sigma
    from the interquartile range, IQR / 1.349, so that a few outliers do not inflate it). None under
    3 samples."""
    if len(samples) < 3:
        return None
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return 2 * 1.2533 * (q3 - q1) / 1.349 / len(samples) ** 0.5


def median_noise_pct(samples: Sequence[float]) -> float | None:
    """`median_band` of step times in percent of their median: how far the median may be from the
    machine's typical step by chance. Two medians whose difference is within their combined noise
    cannot be told apart. None under 3 samples."""
    band = median_band(samples)
    return None if band is None else 100.0 * band / statistics.median(samples)


def change_pct(value: float | None, reference: float | None) -> float | None:
    """How much ``value`` differs from ``reference``, in % of it (None without both)."""
    return 100.0 * (value / reference - 1) if value and reference else None


def combined_noise_pct(*noise_pcts: float | None) -> float:
    """The noise of a difference of medians, from each median's (`median_noise_pct`; None: 0)."""
    return sum((n or 0.0) ** 2 for n in noise_pcts) ** 0.5


def _stays_within(threshold: float, looks: int) -> float:
    """The chance that a running sum of ``looks`` unit normal steps stays within ``threshold *
    sqrt(looks)`` after every step (a mean of 0 looked at ``looks`` times within O'Brien and
    Fleming's boundary): its density carried from step to step on a grid and cut at the bound
    (Armitage, McPherson and Rowe's recursion)."""
    bound = threshold * math.sqrt(looks)
    reach = math.ceil(bound / GRID_STEP)
    spacing = bound / reach  # the grid ends on the bound
    weights = np.full(2 * reach + 1, spacing)
    weights[[0, -1]] /= 2  # the trapezoid rule
    step = stats.norm.pdf(spacing * np.arange(-2 * reach, 2 * reach + 1))
    density = stats.norm.pdf(spacing * np.arange(-reach, reach + 1))
    for _ in range(looks - 1):
        density = np.convolve(density * weights, step)[2 * reach : 4 * reach + 1]
    return float((density * weights).sum())


@cache
def _boundary(looks: int, overall: float) -> float:
    """O'Brien and Fleming's constant for ``looks`` equally spaced looks at two-sided level ``overall``."""
    if looks == 1:
        return float(stats.norm.isf(overall / 2))
    return float(optimize.brentq(lambda c: 1 - _stays_within(c, looks) - overall, 1.0, 5.0, xtol=1e-5))


def sequential_level(fraction: float, looks: int, overall: float = LEVEL) -> float:
    """The two-sided level at which a look at a growing sample is tested, ``fraction`` of the way
    to the most it may grow to, when it is looked at ``looks`` times equally spaced: O'Brien and
    Fleming's boundary, under which a mean of 0 strays past the band at any look with chance
    ``overall``. Early looks are held to a far lower level (they only decide on a change far past
    the noise), the last to a little under ``overall`` (8 looks at 5%: the first under 0.0001%, the
    fourth 0.34%, the last 3.8%)."""
    return float(2 * stats.norm.sf(_boundary(looks, overall) / math.sqrt(fraction)))
