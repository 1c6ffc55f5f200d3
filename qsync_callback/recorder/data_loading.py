"""A data loader's fetch of one batch, timed before any step: the part of a training step that a
symbolic trace cannot see, as it traces from a batch in hand (`symbolic_trace.py`).

`first_batch_and_fetch` draws batches from the loader, as Lightning's loop does once a step, keeps
the first (the batch an estimate traces its step on: one iterator, so the first batch is fetched
once and the workers started once) and times each ``next()`` in this process after it (the first
starts the iterator, and its workers where it has any). A loader without workers fetches inside the
step, so all of a fetch adds to it. With workers, batches are made in other processes while the
step runs, and the step waits only for what their making takes beyond it (`DataLoading.wait_us`);
the first ``prefetch_factor * num_workers`` fetches after the first come from what the workers made
ahead, so they are drawn and not timed.
A fetch in this process is taken as the median of those timed (a stall in one does not move it);
with workers, as their mean, the rate the workers make batches at: their batches come in bursts
(two workers that finish together make one wait long and the next not at all), which a median
reads as either.
In a recorded step the same fetch is the profiler's ``enumerate(DataLoader)#`` range
(`op_samples.StepSample.data_us`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from qsync_callback.errors import QSyncInputError

BATCHES = 5  # fetches timed, at most
SECONDS = 1.0  # the most spent timing them


@dataclass(frozen=True)
class DataLoading:
    """The time (us) of a batch's fetch in this process, of ``batches`` timed (their median, or
    with workers their mean), and the loader's worker processes (0: it fetches in this process)."""

    us: float
    batches: int
    workers: int

    def wait_us(self, step_us: float) -> float:
        """What fetching a batch adds to a step whose other work takes ``step_us``."""
        return self.us if self.workers == 0 else max(self.us - step_us, 0.0)

    def describe(self) -> str:
        if self.workers == 0:
            return f"{self.us / 1e3:.2f} ms a batch, fetched in the step (the median of {self.batches} timed)"
        return (
            f"{self.us / 1e3:.2f} ms a batch, made by {self.workers} workers beside the step "
            f"(the mean of {self.batches} timed)"
        )


def first_batch_and_fetch(
    loader: Iterable, batches: int = BATCHES, seconds: float = SECONDS
) -> tuple[Any, DataLoading | None]:
    """``loader``'s first batch, and its fetch of a batch timed (see the module docstring) within
    about ``seconds``: None when it has one batch only; `QSyncInputError` when it has none."""
    workers = int(getattr(loader, "num_workers", 0) or 0)
    ahead = workers * int(getattr(loader, "prefetch_factor", 0) or 0)
    iterator = iter(loader)
    times: list[float] = []
    try:
        first = next(iterator)
    except StopIteration:
        raise QSyncInputError("the data loader gave no batch") from None
    deadline = time.monotonic() + seconds
    try:
        for _ in range(ahead):
            next(iterator)
        while len(times) < batches and time.monotonic() < deadline:
            start = time.perf_counter()
            next(iterator)
            times.append((time.perf_counter() - start) * 1e6)
    except StopIteration:
        pass
    finally:
        del iterator  # a loader's workers stop with their iterator
    if not times:
        return first, None
    fetch_us = statistics.median(times) if workers == 0 else statistics.fmean(times)
    return first, DataLoading(fetch_us, len(times), workers)
