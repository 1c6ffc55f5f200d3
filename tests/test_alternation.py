"""The baseline and the plan in turns (`qsync_callback.alternation`): the schedule, the change and
its noise from every rank's block times, and the loop running it in real Lightning training."""

import json
import mmap
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from test_precision_apply import _apply_callback, _fit, _lp_precisions

from qsync_callback.alternation import (
    BASELINE,
    BLOCK_SECONDS,
    BLOCK_STEPS,
    LOOKS,
    MEDIAN_ROUNDS,
    MOST_BLOCK_STEPS,
    PAGE_FAULTS,
    PLAN,
    ROUNDS,
    SETTLE_STEPS,
    Alternation,
    BlockTimes,
    block_steps_for,
    paired_change,
)
from qsync_callback.mean_band import (
    _stays_within,
    band_factor,
    mean_band,
    median_band,
    median_noise_pct,
    sequential_level,
)
from qsync_callback.plan import Plan

from apply_script import run_two_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import turns_decisions  # noqa: E402 - the benchmark's simulated launches of the loop's own rule


def test_each_round_runs_a_baseline_block_then_a_plan_block_of_settle_and_timed_steps():
    schedule = Alternation(rounds=2)
    length = SETTLE_STEPS + BLOCK_STEPS
    assert schedule.most_rounds == LOOKS * 2 and schedule.done_step == 2 * LOOKS * 2 * length
    switches = {step: schedule.switch_at(step) for step in range(schedule.done_step + length)}
    assert {s: c for s, c in switches.items() if c} == {
        k * length: (BASELINE, PLAN)[k % 2] for k in range(2 * schedule.most_rounds)
    }
    timed = [schedule.timed_block(step) for step in range(schedule.done_step + 3)]
    # the step after each switch settles; the boundary after the last block times nothing more
    assert timed[: SETTLE_STEPS + 1] == [None] * (SETTLE_STEPS + 1)
    assert timed[SETTLE_STEPS + 1] == (0, BASELINE)
    assert timed[length + SETTLE_STEPS] is None and timed[length + SETTLE_STEPS + 1] == (0, PLAN)
    last = schedule.most_rounds - 1
    assert timed[schedule.done_step] == (last, PLAN) and timed[schedule.done_step + 1] is None
    for round_ in range(schedule.most_rounds):
        for config in (BASELINE, PLAN):
            assert timed.count((round_, config)) == BLOCK_STEPS
    # the turns look after 2 rounds, 4, ... and not at the end, where they stop anyway
    looks = [step for step in range(schedule.done_step + length) if schedule.look_at(step)]
    assert looks == [2 * k * 2 * length for k in range(1, LOOKS)]
    one = Alternation(rounds=1)
    assert [step for step in range(one.done_step + 1) if one.look_at(step)] == [
        k * 2 * length for k in range(1, LOOKS)
    ]


def test_a_blocks_timed_steps_take_about_block_seconds_within_bounds():
    assert block_steps_for(None) == block_steps_for(0.0) == BLOCK_STEPS
    assert block_steps_for(1000.0) == BLOCK_STEPS and block_steps_for(0.5) == MOST_BLOCK_STEPS
    for step_ms in (17.0, 25.0, 40.0):
        steps = block_steps_for(step_ms)
        assert (steps - 1) * step_ms < 1e3 * BLOCK_SECONDS <= steps * step_ms
    long = Alternation(rounds=2, block_steps=10)
    assert long.block_length == SETTLE_STEPS + 10
    assert long.done_step == 2 * long.most_rounds * long.block_length
    timed = [long.timed_block(step) for step in range(long.done_step + 1)]
    assert timed.count((0, BASELINE)) == timed.count((long.most_rounds - 1, PLAN)) == 10


def test_block_times_time_each_timed_step_from_the_restart_before_it():
    clock = BlockTimes(Alternation(rounds=1))
    for step in range(clock.alternation.done_step + 1):
        clock.boundary(step)
        clock.restart()
        time.sleep(0.002)
    blocks = clock.times[BASELINE] + clock.times[PLAN]
    assert [len(block) for block in blocks] == [BLOCK_STEPS] * 2 * LOOKS
    assert all(2.0 <= ms < 1000 for block in blocks for ms in block)


def _rank(baseline, plan):
    return {BASELINE: [list(b) for b in baseline], PLAN: [list(p) for p in plan]}


def test_block_times_count_each_timed_steps_page_faults():
    """The plan's steps touch 512 fresh pages each (a new anonymous mapping written page by page):
    at least that many minor faults a step, where the baseline's steps touch none of their own."""
    clock = BlockTimes(Alternation(rounds=1))
    page = mmap.PAGESIZE
    for step in range(clock.alternation.done_step + 1):
        clock.boundary(step)
        clock.restart()
        if clock.alternation.timed_block(step + 1) in [(r, PLAN) for r in range(LOOKS)]:
            fresh = mmap.mmap(-1, 512 * page)
            for offset in range(0, 512 * page, page):
                fresh[offset] = 1
            fresh.close()
    record = clock.record()
    assert record[BASELINE] == clock.times[BASELINE] and record[PLAN] == clock.times[PLAN]
    assert record[PAGE_FAULTS] == clock.page_faults
    assert [len(b) for b in clock.page_faults[PLAN]] == [BLOCK_STEPS] * LOOKS
    assert min(f for block in clock.page_faults[PLAN] for f in block) >= 512
    assert statistics.median(f for block in clock.page_faults[BASELINE] for f in block) < 512
    counted = paired_change([json.loads(json.dumps(record))])["page_faults_per_step"]
    assert counted[PLAN] >= 512 > counted[BASELINE]


def test_the_page_faults_a_step_are_the_slowest_ranks_blocks_medians_over_the_rounds():
    quiet = {
        **_rank([[10.0] * 4, [12.0] * 4], [[9.0] * 4, [10.8] * 4]),
        PAGE_FAULTS: {BASELINE: [[100, 300, 200, 200], [400] * 4], PLAN: [[5] * 4, [7] * 4]},
    }
    # one round, one block: the median of its steps
    assert paired_change([quiet])["page_faults_per_step"] == {BASELINE: 300.0, PLAN: 6.0}
    # a second rank slower in round 0's plan block: that block's faults are its, as its times are
    slow = {
        **_rank([[10.0] * 4, [12.0] * 4], [[11.0] * 4, [10.8] * 4]),
        PAGE_FAULTS: {BASELINE: [[0] * 4, [0] * 4], PLAN: [[1000] * 4, [0] * 4]},
    }
    assert paired_change([quiet, slow])["page_faults_per_step"] == {BASELINE: 300.0, PLAN: 503.5}
    # the slowest block of a round on a rank that counted none (times alone): no figure
    bare = _rank([[10.0] * 4, [12.0] * 4], [[11.0] * 4, [10.8] * 4])
    assert paired_change([quiet, bare])["page_faults_per_step"] is None


def test_the_change_is_the_mean_of_the_rounds_on_the_slowest_rank():
    quiet = _rank([[10.0] * 4, [12.0] * 4], [[9.0] * 4, [10.8] * 4])
    result = paired_change([quiet])
    assert result == {
        "rounds": 2,
        "change_pct": pytest.approx(-10.0),
        "noise_pct": pytest.approx(0.0, abs=1e-9),
        "median_change_pct": pytest.approx(-10.0),
        "median_noise_pct": None,  # under MEDIAN_ROUNDS rounds
        "round_changes_pct": [pytest.approx(-10.0), pytest.approx(-10.0)],
        "baseline_ms": [10.0, 12.0],
        "plan_ms": [9.0, 10.8],
        "page_faults_per_step": None,  # times alone: no page faults counted
    }
    # the slowest rank is the one with the largest median, not the largest first step
    spiky = _rank([[10.0] * 4, [12.0] * 4], [[30.0, 1.0, 1.0, 1.0], [10.8] * 4])
    assert paired_change([quiet, spiky])["plan_ms"] == [9.0, 10.8]
    # a second rank slower in round 0's plan block: that block's time is its
    slow = _rank([[10.0] * 4, [12.0] * 4], [[11.0] * 4, [10.8] * 4])
    both = paired_change([quiet, slow])
    assert both["plan_ms"] == [11.0, 10.8] and both["change_pct"] == pytest.approx((10.0 - 10.0) / 2)


def test_rounds_that_disagree_are_noise_and_an_unfinished_round_does_not_count():
    result = paired_change([_rank([[10.0] * 4, [10.0] * 4], [[9.0] * 4, [11.0] * 4])])
    assert result["change_pct"] == pytest.approx(0.0)
    # two rounds at -10% and +10%: their mean's 95% band on Student's t with 1 degree of freedom
    assert result["noise_pct"] == pytest.approx(12.706 * (200**0.5) / 2**0.5, rel=1e-4)
    # another rule's band, asked for (the benchmark of the rules): 2 standard errors
    normal = paired_change([_rank([[10.0] * 4, [10.0] * 4], [[9.0] * 4, [11.0] * 4])], band=lambda n: 2.0)
    assert normal["noise_pct"] == pytest.approx(2 * (200**0.5) / 2**0.5)
    unfinished = paired_change([_rank([[10.0] * 4, [10.0] * 4], [[9.0] * 4, []])])
    assert unfinished["rounds"] == 1 and unfinished["change_pct"] == pytest.approx(-10.0)
    one_step = paired_change([_rank([[10.0] * 4, [10.0] * 4], [[9.0] * 4, [9.0]])])
    assert one_step["rounds"] == 2  # a block cut short after one timed step still counts
    assert paired_change([_rank([[10.0] * 4], [[]])]) == {
        "rounds": 0,
        "change_pct": None,
        "noise_pct": None,
        "median_change_pct": None,
        "median_noise_pct": None,
        "baseline_ms": [],
        "plan_ms": [],
        "page_faults_per_step": None,
    }


def test_the_blocks_own_noise_shrinks_with_the_rounds_that_agree():
    baseline, plan = [9.0, 10.0, 10.0, 11.0], [8.1, 9.0, 9.0, 9.9]
    each = (median_noise_pct(baseline) ** 2 + median_noise_pct(plan) ** 2) ** 0.5
    for rounds in (1, 2, 4):
        result = paired_change([_rank([baseline] * rounds, [plan] * rounds)])
        assert result["change_pct"] == pytest.approx(-10.0)
        assert result["noise_pct"] == pytest.approx(each / rounds**0.5)


def test_the_rounds_noise_is_a_95_percent_band_on_students_t():
    """A few rounds' spread is estimated from them: the band is wider than 2 standard errors, and
    narrows towards a normal's 1.96 as the rounds grow."""
    assert band_factor(2) == pytest.approx(12.706, rel=1e-4)
    assert band_factor(3) == pytest.approx(4.303, rel=1e-4)
    assert band_factor(18) == pytest.approx(2.110, rel=1e-3)
    factors = [band_factor(n) for n in range(2, 60)]
    assert all(a > b for a, b in zip(factors[:-1], factors[1:], strict=True)) and 1.96 < factors[-1] < 2.01
    changes = [-20.0, -10.0, 0.0]  # three rounds: mean -10%, standard deviation 10%
    result = paired_change([_rank([[10.0] * 4] * 3, [[10.0 * (1 + c / 100)] * 4 for c in changes])])
    assert result["change_pct"] == pytest.approx(-10.0)
    assert result["noise_pct"] == pytest.approx(4.303 * 10.0 / 3**0.5, rel=1e-4)
    assert mean_band(changes) == pytest.approx(result["noise_pct"])
    assert mean_band([-20.0]) == 0.0  # one sample: no spread to estimate
    assert mean_band([-20.0, 0.0]) == pytest.approx(12.706 * 10.0, rel=1e-4)  # sd 10 sqrt(2), over sqrt(2)


def test_a_few_rounds_far_off_the_rest_widen_the_means_band_and_not_the_medians():
    """Eight rounds at -10% and two stalled at +200%: the mean moves and its band spans 0, the
    rounds' median stays at -10% with the band of a median from their interquartile range."""
    changes = [-10.0] * 4 + [200.0] + [-10.0] * 4 + [200.0]
    result = paired_change([_rank([[10.0] * 4] * 10, [[10.0 * (1 + c / 100)] * 4 for c in changes])])
    assert result["change_pct"] == pytest.approx(32.0)
    assert result["noise_pct"] == pytest.approx(band_factor(10) * statistics.stdev(changes) / 10**0.5)
    assert result["noise_pct"] > abs(result["change_pct"])
    assert result["median_change_pct"] == pytest.approx(-10.0)
    assert (
        result["median_noise_pct"] == pytest.approx(median_band(changes))
        and result["median_noise_pct"] == 0.0
    )
    # rounds spread evenly: the median's band is the interquartile range's, in the changes' unit
    spread = [-16.0, -14.0, -12.0, -10.0, -8.0, -6.0, -4.0]
    even = paired_change([_rank([[10.0] * 4] * 7, [[10.0 * (1 + c / 100)] * 4 for c in spread])])
    q1, _, q3 = statistics.quantiles(spread, n=4, method="inclusive")
    assert even["median_change_pct"] == pytest.approx(-10.0)
    assert even["median_noise_pct"] == pytest.approx(2 * 1.2533 * (q3 - q1) / 1.349 / 7**0.5)
    # a look's band wider than a single look's 95% widens the median's band as much as the mean's
    twice = paired_change(
        [_rank([[10.0] * 4] * 7, [[10.0 * (1 + c / 100)] * 4 for c in spread])], lambda n: 2 * band_factor(n)
    )
    assert twice["median_noise_pct"] == pytest.approx(2 * even["median_noise_pct"])
    assert twice["noise_pct"] == pytest.approx(2 * even["noise_pct"])
    # under MEDIAN_ROUNDS rounds a median has no noise to give (its band would be too narrow)
    few = spread[: MEDIAN_ROUNDS - 1]
    short = paired_change([_rank([[10.0] * 4] * len(few), [[10.0 * (1 + c / 100)] * 4 for c in few])])
    assert short["median_change_pct"] == pytest.approx(statistics.median(few))
    assert short["median_noise_pct"] is None and short["noise_pct"] > 0
    enough = spread[:MEDIAN_ROUNDS]  # from MEDIAN_ROUNDS rounds on, it has
    least = paired_change([_rank([[10.0] * 4] * len(enough), [[10.0 * (1 + c / 100)] * 4 for c in enough])])
    assert least["median_noise_pct"] == pytest.approx(median_band(enough))


def test_the_sequential_boundary_is_o_brien_and_flemings():
    """Each look's level is O'Brien and Fleming's: its threshold on the standardized mean is the
    published constant times sqrt(looks / look) (Jennison and Turnbull's table 2.3, two-sided 5%),
    and a mean of 0 looked at every time strays past one of them 5% of the time (random walks)."""
    for looks, constant in ((1, 1.960), (2, 1.977), (3, 2.004), (4, 2.024), (5, 2.040)):
        assert 1 - _stays_within(constant, looks) == pytest.approx(0.05, abs=0.0005)
        for look in range(1, looks + 1):
            threshold = stats.norm.isf(sequential_level(look / looks, looks) / 2)
            assert threshold == pytest.approx(constant * (looks / look) ** 0.5, abs=0.002)
    rng = np.random.default_rng(0)
    walks = rng.standard_normal((100_000, LOOKS)).cumsum(axis=1) / np.sqrt(np.arange(1, LOOKS + 1))
    levels = [sequential_level(look / LOOKS, LOOKS) for look in range(1, LOOKS + 1)]
    strayed = (np.abs(walks) > stats.norm.isf(np.array(levels) / 2)).any(axis=1).mean()
    assert strayed == pytest.approx(0.05, abs=0.003)
    assert (np.abs(walks) > 1.96).any(axis=1).mean() > 0.15  # 95% at every look strays far more often


def test_the_turns_band_is_wide_at_the_first_looks_and_near_a_single_looks_at_the_last():
    schedule = Alternation(rounds=3)
    bands = [schedule.band(rounds) for rounds in range(3, schedule.most_rounds + 1, 3)]
    assert all(a > b for a, b in zip(bands[:-1], bands[1:], strict=True))
    assert bands[0] > 100 * band_factor(3)  # 3 rounds decide only on a change far past the noise
    assert band_factor(schedule.most_rounds) < bands[-1] < 1.1 * band_factor(schedule.most_rounds)
    assert band_factor(10, 0.01) == pytest.approx(stats.t.ppf(0.995, 9)) and band_factor(10) == pytest.approx(
        stats.t.ppf(0.975, 9)
    )


def test_the_loops_looks_decide_on_a_plan_that_changes_nothing_in_about_5_percent_of_launches():
    """The turns' own rule at every look, on the benchmark's simulated rounds (a plan that changes
    nothing, rounds spreading 12.5%); 95% at every look decides three times as often."""
    sequential = turns_decisions.simulate("sequential", LOOKS, 0.0, 12.5, runs=600, seed=1)
    student = turns_decisions.simulate("student", LOOKS, 0.0, 12.5, runs=600, seed=1)
    assert sequential["faster"] + sequential["slower"] < 0.08
    assert student["faster"] + student["slower"] > 0.13


def test_the_loop_looks_up_to_thirty_two_times_and_fewer_looks_end_sooner():
    assert LOOKS == 32 and Alternation(rounds=3).most_rounds == 96
    three = Alternation(rounds=3, looks=3)
    assert three.most_rounds == 9 and three.done_step == 2 * 9 * three.block_length
    round_length = 2 * three.block_length
    assert [s for s in range(three.done_step + 1) if three.look_at(s)] == [3 * round_length, 6 * round_length]
    assert three.first_look_step == 3 * round_length


def test_where_training_ends_first_the_last_look_is_held_to_the_full_level_of_the_looks_taken():
    schedule = Alternation(rounds=3)
    # run to the end, the last look is the schedule's own
    assert schedule.last_band(schedule.most_rounds) == schedule.band(schedule.most_rounds)
    # training ended after 10 rounds: the 4th look (3, 6, 9, then 10), at a 4-look schedule's full level
    assert schedule.last_band(10) == pytest.approx(band_factor(10, sequential_level(1.0, 4)))
    assert schedule.last_band(10) < schedule.band(10) / 2  # far narrower than a look 10/96 of the way
    # the looks before it held to the 32-look schedule's stricter levels: a mean of 0 looked at this
    # way strays past one of them at most 5% of the time (random walks, normal rounds)
    rng = np.random.default_rng(2)
    for taken in (2, 4, 10):
        walks = rng.standard_normal((100_000, taken)).cumsum(axis=1) / np.sqrt(np.arange(1, taken + 1))
        levels = [sequential_level(look / LOOKS, LOOKS) for look in range(1, taken)] + [
            sequential_level(1.0, taken)
        ]
        strayed = (np.abs(walks) > stats.norm.isf(np.array(levels) / 2)).any(axis=1).mean()
        assert 0.035 < strayed < 0.0515


@settings(max_examples=200, deadline=None)
@given(
    ratio=st.floats(0.5, 2.0),
    drifts=st.lists(st.floats(0.6, 1.6), min_size=1, max_size=5),
    base=st.floats(1.0, 500.0),
)
def test_a_drift_shared_by_both_blocks_of_a_round_cancels(ratio, drifts, base):
    """However the machine's speed drifts from round to round, the plan's change is what it is."""
    baseline = [[base * d] * BLOCK_STEPS for d in drifts]
    plan = [[base * d * ratio] * BLOCK_STEPS for d in drifts]
    result = paired_change([_rank(baseline, plan)])
    assert result["rounds"] == len(drifts)
    assert result["change_pct"] == pytest.approx(100 * (ratio - 1), abs=1e-6)
    assert result["noise_pct"] == pytest.approx(0.0, abs=1e-6)


# ----------------------------------------------------------------- in real Lightning training


def test_the_loop_runs_the_baseline_and_the_plan_in_turns_then_keeps_the_plan_in_force(tmp_path):
    """A 90% budget needs a layer below fp32 (on any CPU); the turns measure what it costs."""
    callback = _apply_callback(tmp_path, plan_cache=False, alternate_rounds=2, alternate_looks=5)
    seen = []

    class Watch(pl.Callback):  # after QSyncCallback: sees each step's configuration
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(dict(_lp_precisions(pl_module)))

    # windows (under 40 steps), then the first look's 2 rounds of blocks as long as they may be
    model = _fit(
        [callback, Watch()], max_steps=40 + Alternation(2, block_steps=MOST_BLOCK_STEPS).first_look_step
    )
    verification = json.loads((tmp_path / "q" / "verification.json").read_text())
    turns = verification["alternation"]
    report = json.loads((tmp_path / "q" / "report.json").read_text())
    assert turns["block_steps"] == block_steps_for(report["measured"]["step_ms"])
    assert turns["most_rounds"] == 2 * 5  # alternate_rounds x alternate_looks
    # decided on its peak: the turns stop at their first look, after 2 rounds
    assert turns["rounds"] == 2 and len(turns["baseline_ms"]) == len(turns["plan_ms"]) == 2
    assert verification["step_ms_change_pct"] == pytest.approx(turns["change_pct"])
    assert verification["windows"]["step_ms_change_pct"] is not None
    assert "against the baseline in turns" in verification["reason"]
    # each configuration's page faults a step in its blocks, counted on the rank
    faults = turns["page_faults_per_step"]
    assert set(faults) == {"baseline", "plan"} and all(f >= 0 for f in faults.values())
    kept = Plan.load(tmp_path / "q" / "plan.json")
    assert verification["decision"] == "keep" and kept.precision
    assert _lp_precisions(model) == kept.precision
    # the model ran the recorded configuration in each baseline block and the plan in each plan block
    switches = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1]]
    assert [bool(seen[i]) for i in switches] == [True, False, True, False, True]  # apply, 2 rounds


def test_two_ranks_switch_together_and_agree_on_the_turns(tmp_path):
    """DDP over gloo: both ranks undo and re-apply at the same boundaries (a rank switching alone
    would hang the other in a collective) and end with the same configuration."""
    steps = 30 + Alternation(ROUNDS, block_steps=MOST_BLOCK_STEPS).first_look_step  # windows, the first look
    result = run_two_ranks(tmp_path, steps=steps)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "steps aside" not in result.stdout + result.stderr
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert per_rank[0]["steps"] == per_rank[1]["steps"] == steps
    assert per_rank[0]["precisions"] == per_rank[1]["precisions"]
    verification = json.loads((tmp_path / "q" / "verification.json").read_text())
    assert verification["alternation"]["rounds"] == 3
    assert set(verification["alternation"]["page_faults_per_step"]) == {"baseline", "plan"}
    kept = Plan.load(tmp_path / "q" / "plan.json")
    assert per_rank[0]["precisions"] == (kept.precision if verification["decision"] == "keep" else {})
