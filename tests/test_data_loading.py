"""A data loader's fetch of a batch timed before any step (`recorder/data_loading.py`), and what
it adds to an estimated step (`predictor/op_costs.priced`)."""

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from qsync_callback.errors import QSyncInputError
from qsync_callback.recorder.data_loading import DataLoading, first_batch_and_fetch

ITEM_SECONDS = 0.002


class SlowItems(Dataset):
    """Items that take at least ``ITEM_SECONDS`` each to make, as decoding a sample does."""

    def __init__(self, n: int):
        self.n = n
        self.made = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(ITEM_SECONDS)
        self.made += 1
        return torch.full((8,), float(i))


class CountedBatches:
    """An iterable of batches that counts those drawn, with a DataLoader's worker settings."""

    def __init__(self, num_workers: int, prefetch_factor: int | None):
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.drawn = 0

    def __iter__(self):
        while True:
            self.drawn += 1
            yield self.drawn


def test_a_fetch_in_the_step_is_timed_after_the_first_and_adds_all_of_itself():
    items = SlowItems(4 * 10)
    start = time.perf_counter()
    _, timed = first_batch_and_fetch(DataLoader(items, batch_size=4), batches=3, seconds=10.0)
    elapsed_us = (time.perf_counter() - start) * 1e6
    assert timed is not None and timed.workers == 0 and timed.batches == 3
    assert timed.us >= 4 * ITEM_SECONDS * 1e6  # four items of a batch, each slept for
    assert timed.us <= elapsed_us / 2  # the median of three fetches made within the call
    assert items.made == 4 * (1 + 3)  # the first batch untimed, then three: no more drawn
    assert timed.wait_us(123.0) == timed.us
    assert timed.describe().endswith("ms a batch, fetched in the step (the median of 3 timed)")
    assert DataLoading(us=12340.0, batches=5, workers=0).describe() == (
        "12.34 ms a batch, fetched in the step (the median of 5 timed)"
    )


class Bursts(CountedBatches):
    """Batches from two workers that finish together: every other fetch waits for both."""

    def __init__(self):
        super().__init__(num_workers=2, prefetch_factor=1)

    def __iter__(self):
        for k in super().__iter__():
            if k > 1 + 2 and k % 2 == 1:  # past the first and the two made ahead
                time.sleep(2 * ITEM_SECONDS)
            yield k


def test_with_workers_a_fetch_is_their_rate_the_mean_not_the_median_of_a_burst():
    bursts = Bursts()
    start = time.perf_counter()
    _, timed = first_batch_and_fetch(bursts, batches=5, seconds=10.0)
    elapsed_us = (time.perf_counter() - start) * 1e6
    assert bursts.drawn == 1 + 2 + 5
    # of the timed fetches 4 to 8, two waited (5 and 7) and three did not: their median is no wait
    waited_us = 2 * ITEM_SECONDS * 1e6 * sum(1 for k in range(4, 9) if k % 2 == 1)
    assert waited_us / 5 <= timed.us <= elapsed_us / 5


class OneStall(CountedBatches):
    """Batches made in this process, one of them stalled (a collection, a page fault)."""

    def __init__(self):
        super().__init__(num_workers=0, prefetch_factor=None)

    def __iter__(self):
        for k in super().__iter__():
            if k == 3:
                time.sleep(25 * ITEM_SECONDS)
            yield k


def test_in_this_process_a_fetch_is_the_median_one_stall_does_not_move_it():
    _, timed = first_batch_and_fetch(OneStall(), batches=5, seconds=10.0)
    assert timed.batches == 5 and timed.us < 5 * ITEM_SECONDS * 1e6  # the mean would be 10 of them
    assert DataLoading(us=12340.0, batches=3, workers=2).describe() == (
        "12.34 ms a batch, made by 2 workers beside the step (the mean of 3 timed)"
    )


def test_the_batches_workers_made_ahead_are_drawn_before_any_is_timed():
    ahead = CountedBatches(num_workers=2, prefetch_factor=3)
    first, timed = first_batch_and_fetch(ahead, batches=4)
    assert first == 1 and timed.workers == 2  # the first batch drawn is the one given back
    assert ahead.drawn == 1 + 2 * 3 + 4
    plain = CountedBatches(num_workers=0, prefetch_factor=None)
    first, timed = first_batch_and_fetch(plain, batches=4)
    assert first == 1 and timed.workers == 0 and plain.drawn == 1 + 4
    # an iterable that is no DataLoader fetches in this process: no workers, nothing made ahead
    drawn = []
    _, timed = first_batch_and_fetch(drawn.append(k) or k for k in range(10))
    assert timed is not None and timed.workers == 0 and len(drawn) == 1 + timed.batches


def test_a_loader_of_one_batch_has_no_fetch_to_time_and_one_of_none_is_refused():
    first, timed = first_batch_and_fetch(DataLoader(SlowItems(4), batch_size=4))
    assert timed is None and torch.equal(first, torch.arange(4.0)[:, None].expand(4, 8))
    with pytest.raises(QSyncInputError, match="^the data loader gave no batch$"):
        first_batch_and_fetch(DataLoader(SlowItems(0), batch_size=4))


def test_with_workers_the_step_waits_only_for_what_their_making_takes_beyond_it():
    loader = DataLoader(SlowItems(4 * 40), batch_size=4, num_workers=2, prefetch_factor=2)
    _, timed = first_batch_and_fetch(loader, batches=3, seconds=30.0)
    assert timed is not None and timed.workers == 2 and timed.batches == 3
    assert timed.wait_us(timed.us + 1.0) == 0.0
    assert timed.wait_us(timed.us / 4) == pytest.approx(0.75 * timed.us)
    assert timed.describe().endswith("made by 2 workers beside the step (the mean of 3 timed)")
    in_step = DataLoading(us=2000.0, batches=5, workers=0)
    assert in_step.wait_us(1e9) == 2000.0 and "in the step" in in_step.describe()
