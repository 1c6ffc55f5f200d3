"""The baseline and the plan in turns, after the verify window: a step-time comparison that a drift
of the machine's speed does not bias.

The verify window measures the plan minutes after the baseline window measured the recorded
configuration; on a shared host the speed of a step drifts by tens of percent over seconds, so the
two medians can differ by more than the plan changes. After the verify window the loop therefore
undoes and re-applies the candidate in turns, ``rounds`` times: each round runs a block of the
recorded configuration, then a block of the plan. A block's first ``SETTLE_STEPS`` steps after the
switch are not timed (the first step after a switch runs with cold caches and allocator), the next
``block_steps`` are, boundary to boundary: as many as take `BLOCK_SECONDS` at the recorded step
time (`block_steps_for`, 4 to 16), so that a fast step's jitter does not swamp a block's median.
Both configurations see the same stretch of the machine within a round, so a drift cancels in that
round's change.

When ``rounds`` rounds cannot tell the plan from the baseline (the change within its noise, see
`verify.can_tell`), the turns go on by ``rounds`` more, up to ``looks`` times as many (the loop's
`LOOKS`). The rounds' noise is a band of their mean on Student's t (`mean_band.band_factor`): a
band of 2 standard errors (a normal's) is too narrow over a few rounds and lets chance decide. Each
look gives chance one more try, so each is tested at the level that holds all ``looks`` of them
together to 5% (`Alternation.band`: O'Brien and Fleming's boundary, `mean_band.sequential_level`),
not at 95% each: the first looks decide only on a change far past the noise, the last is close to
a single look's 95%. Where training ends first, its last look is held to the full level of a
schedule of the looks it took (`Alternation.last_band`). `benchmarks/turns_decisions.py` runs this
code on simulated rounds under each rule (its table in `benchmarks/README.md`).

Up to 32 looks (96 rounds from 3): over two identical launches, the turns reach one outcome on a
plan 5% faster, rounds spreading 12.5% (the two-process Horovod MLP's case), in 95% of simulated
pairs, where 8 looks (24 rounds) left it to chance (50%); a plan that changes nothing runs all the
rounds, and one 10% faster is decided after about 30 rounds instead of 15.

`Alternation` is the schedule (which boundary switches, which step is timed in which block);
`BlockTimes` is one rank's step clock over it; `paired_change` turns every rank's times into the
change and its noise that verify decides on.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qsync_callback.mean_band import (
    band_factor,
    change_pct,
    combined_noise_pct,
    median_band,
    median_noise_pct,
    sequential_level,
)
from qsync_callback.page_faults import minor_page_faults

SETTLE_STEPS = 1
BLOCK_STEPS = 4  # the fewest timed steps a block has; at least 3: the noise of a block's median needs 3
BLOCK_SECONDS = 0.2  # a block times as many steps as take this long, from BLOCK_STEPS to MOST_BLOCK_STEPS
MOST_BLOCK_STEPS = 16
ROUNDS = 3  # the loop's turns' first look is after this many rounds (`alternate_rounds`' default)
LOOKS = 32  # the loop's turns look at their change after rounds, 2 x rounds, ... up to LOOKS x rounds
MEDIAN_ROUNDS = 6  # the fewest rounds whose median has a noise: the fewest whose lowest and highest
# bound it with 95% confidence whatever their distribution (1 - 2 / 2**6 = 96.9%); under that the
# interquartile band of a median (`report.median_band`) is narrower than the rounds can support
BASELINE, PLAN = "baseline", "plan"
MEDIAN_SAID = "the rounds' median, the less noisy"  # where a decision or a cost is the median's
PAGE_FAULTS = "page_faults"


@dataclass(frozen=True)
class Alternation:
    """The schedule: ``rounds`` rounds, then as many more at each look up to ``most_rounds`` (``looks``
    times ``rounds``), counted in step boundaries from the first switch (0)."""

    rounds: int
    looks: int = LOOKS
    block_steps: int = BLOCK_STEPS  # timed steps a block

    @property
    def most_rounds(self) -> int:
        return self.looks * self.rounds

    @property
    def block_length(self) -> int:
        return SETTLE_STEPS + self.block_steps

    def band(self, rounds: int) -> float:
        """How many standard errors of the rounds' mean change the turns decide on at a look after
        ``rounds`` rounds (at least 2): Student's t at the level of a look that far through the
        schedule (`mean_band.sequential_level`)."""
        return band_factor(rounds, sequential_level(rounds / self.most_rounds, self.looks))

    def last_band(self, rounds: int) -> float:
        """The band of the turns' last look, after ``rounds`` rounds: where they ran to the end, that
        of `band`; where training ended first, the last look of a schedule of as many looks as were
        taken (the rounds' last look counted, complete or not), at that schedule's full level. The
        looks before it held to a stricter level than that schedule's own, so all of them together
        still decide on a plan that changes nothing at most 5% of the time."""
        taken = min(math.ceil(rounds / self.rounds), self.looks)
        return band_factor(rounds, sequential_level(1.0, taken))

    @property
    def first_look_step(self) -> int:
        """The boundary at which the first look's rounds have ended (the turns' shortest run)."""
        return 2 * self.rounds * self.block_length

    @property
    def done_step(self) -> int:
        """The boundary at which every block's last step has ended, if the turns run to the end."""
        return 2 * self.most_rounds * self.block_length

    def look_at(self, step: int) -> bool:
        """Whether boundary ``step`` ends a look's rounds short of the last: there the turns stop if
        they can tell the plan from the baseline."""
        round_length = 2 * self.block_length
        done, within = divmod(step, round_length)
        return within == 0 and done < self.most_rounds and done > 0 and done % self.rounds == 0

    def switch_at(self, step: int) -> str | None:
        """The configuration a block starting at boundary ``step`` runs (BASELINE or PLAN), or None."""
        if step >= self.done_step or step % self.block_length:
            return None
        return (BASELINE, PLAN)[(step // self.block_length) % 2]

    def timed_block(self, step: int) -> tuple[int, str] | None:
        """(round, configuration) of the step that ends at boundary ``step``, if it is timed."""
        ended = step - 1
        if not 0 <= ended < self.done_step:
            return None
        block, position = divmod(ended, self.block_length)
        if position < SETTLE_STEPS:
            return None
        return block // 2, (BASELINE, PLAN)[block % 2]


@dataclass
class BlockTimes:
    """One rank's step clock over an `Alternation`: ``times[config][round]`` in ms, and beside them
    ``page_faults[config][round]``, each timed step's minor page faults (`page_faults`)."""

    alternation: Alternation
    times: dict[str, list[list[float]]] = field(init=False)
    page_faults: dict[str, list[list[int]]] = field(init=False)
    _last: float | None = field(default=None, init=False)
    _last_faults: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        rounds = self.alternation.most_rounds
        self.times = {config: [[] for _ in range(rounds)] for config in (BASELINE, PLAN)}
        self.page_faults = {config: [[] for _ in range(rounds)] for config in (BASELINE, PLAN)}

    def boundary(self, step: int) -> None:
        """Boundary ``step`` was reached (before any switch made at it): time the step that ended."""
        now, faults = time.perf_counter(), minor_page_faults()
        block = self.alternation.timed_block(step)
        if block is not None and self._last is not None:
            round_, config = block
            self.times[config][round_].append((now - self._last) * 1e3)
            self.page_faults[config][round_].append(faults - self._last_faults)

    def restart(self) -> None:
        """The next step starts now (after the loop's own work at this boundary)."""
        self._last, self._last_faults = time.perf_counter(), minor_page_faults()

    def record(self) -> dict[str, Any]:
        """The rank's record for `paired_change`: its times, and its page faults under ``page_faults``."""
        return {**self.times, PAGE_FAULTS: self.page_faults}


def less_noisy_change(turns: Mapping[str, Any]) -> dict[str, Any] | None:
    """The change and noise in % that the turns (`alternation.paired_change`) decide on: their
    rounds' mean's, or their median's where its noise is the smaller. A few rounds far off the rest
    (a stall of the disk in an offload trial; the two-process Horovod MLP's rounds, bimodal: most
    near -15%, the rest near 0 to +10%, a few past +30%) widen the mean's band and not the median's,
    and the report measures a median step. ``estimate`` says which ("mean" or
    "median"); None without a round."""
    if turns.get("change_pct") is None:
        return None
    median_noise = turns.get("median_noise_pct")
    if median_noise is not None and median_noise < turns["noise_pct"]:
        return {"change_pct": turns["median_change_pct"], "noise_pct": median_noise, "estimate": "median"}
    return {"change_pct": turns["change_pct"], "noise_pct": turns["noise_pct"], "estimate": "mean"}


def block_steps_for(step_ms: float | None) -> int:
    """How many steps a block of the turns times, at a step of ``step_ms``: as many as take
    `BLOCK_SECONDS`, from `BLOCK_STEPS` to `MOST_BLOCK_STEPS` (`BLOCK_STEPS` where the step time is
    not known). A block's median over a few fast steps moves with each step's jitter (two Horovod
    processes of a 17 ms step on two cores: the rounds' changes spread 11-15% at 4 steps a block)."""
    if step_ms is None or step_ms <= 0:
        return BLOCK_STEPS
    return min(max(math.ceil(BLOCK_SECONDS * 1e3 / step_ms), BLOCK_STEPS), MOST_BLOCK_STEPS)


def paired_change(
    ranks: Sequence[Mapping[str, Any]], band: Callable[[int], float] = band_factor
) -> dict[str, Any]:
    """The plan's step-time change against the recorded configuration, from every rank's block
    times (`BlockTimes.times`, or its `BlockTimes.record` with page faults), over the rounds in which
    both blocks were timed.

    A block's step time is the median of the slowest rank's steps in it (the rank with the largest
    median, as the report measures a step). Each round gives a change in %, plan block against
    baseline block; the change is their mean. Its noise is the larger of two estimates: the blocks'
    own (each median's `median_noise_pct`, combined over the pair and over the rounds) and the
    rounds' disagreement (their mean's band, ``band(rounds)`` standard errors: `band_factor`'s 95%
    unless another rule is asked for; the loop's turns ask their schedule's `Alternation.band`); 0
    where neither can be estimated. Beside them, the rounds' median change and its noise (the larger
    of the blocks' and the rounds' `median_band`, widened as ``band`` widens the mean's over a single
    look's 95%; None under `MEDIAN_ROUNDS`), which a few rounds far off the rest (a stall of the disk,
    say) do not widen; `less_noisy_change` takes the one of the two with the narrower band.
    And the page faults a step of each configuration (``page_faults_per_step``: the median over the
    rounds of the median of the blocks timed; None where a rank recorded none): a configuration run
    right after the other can take thousands more a step than it does alone (`page_faults`), which
    the change holds."""
    rounds, faults = [], []
    for k in range(min(len(rank[BASELINE]) for rank in ranks)):
        blocks, blocks_faults = {}, {}
        for config in (BASELINE, PLAN):
            timed = [(list(rank[config][k]), rank) for rank in ranks if len(rank[config][k]) > 0]
            if len(timed) == len(ranks):
                blocks[config], slowest = max(timed, key=lambda pair: statistics.median(pair[0]))
                stepped = slowest.get(PAGE_FAULTS, {}).get(config, [])
                if k < len(stepped) and stepped[k]:
                    blocks_faults[config] = statistics.median(stepped[k])
        if len(blocks) == 2:
            rounds.append(blocks)
            faults.append(blocks_faults)
    if not rounds:
        nothing = dict.fromkeys(("change_pct", "noise_pct", "median_change_pct", "median_noise_pct"))
        return {"rounds": 0, **nothing, "baseline_ms": [], "plan_ms": [], "page_faults_per_step": None}
    counted = all(len(f) == 2 for f in faults)
    page_faults = {c: statistics.median(f[c] for f in faults) for c in (BASELINE, PLAN)} if counted else None
    baseline_ms = [statistics.median(r[BASELINE]) for r in rounds]
    plan_ms = [statistics.median(r[PLAN]) for r in rounds]
    changes = [change_pct(p, b) for p, b in zip(plan_ms, baseline_ms, strict=True)]
    each = [combined_noise_pct(*(median_noise_pct(r[config]) for config in (BASELINE, PLAN))) for r in rounds]
    blocks_noise = combined_noise_pct(*each) / len(rounds)
    rounds_noise = 0.0
    if len(changes) >= 2:
        rounds_noise = band(len(changes)) * statistics.stdev(changes) / len(changes) ** 0.5
    median_rounds_noise = None
    if len(changes) >= MEDIAN_ROUNDS:
        median_rounds_noise = median_band(changes) * band(len(changes)) / band_factor(len(changes))
    return {
        "rounds": len(rounds),
        "change_pct": statistics.fmean(changes),
        "noise_pct": max(blocks_noise, rounds_noise),
        "median_change_pct": statistics.median(changes),
        "median_noise_pct": None if median_rounds_noise is None else max(blocks_noise, median_rounds_noise),
        "round_changes_pct": changes,
        "baseline_ms": baseline_ms,
        "plan_ms": plan_ms,
        "page_faults_per_step": page_faults,
    }
