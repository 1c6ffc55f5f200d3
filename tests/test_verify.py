"""verify.py's one rule: keep or roll back on differences beyond the measured noise, else keep the
cheaper configuration; and the noise of a median it rests on."""

import random
import statistics

import pytest

from qsync_callback.alternation import less_noisy_change
from qsync_callback.mean_band import combined_noise_pct, median_band, median_noise_pct
from qsync_callback.plan import Plan
from qsync_callback.report import (
    NOISY_PAGE_FAULTS,
    RECORD_AGAIN_MIN_STEPS,
    RECORD_AGAIN_NOISE_PCT,
    build_report,
    format_summary,
    format_verification,
    too_noisy_to_plan,
)
from qsync_callback.verify import KEEP, ROLL_BACK, can_tell, verify_plan

from tracebuilder import op, trace

PLAN = Plan(precision={"fc": "bf16"}, prediction={"step_ms": 9.0, "peak_bytes": 1000})


def _run(step_ms, peak_bytes=1000, step_peaks=()):
    """A one-rank recording whose unprofiled steps took ``step_ms`` and whose peak was ``peak_bytes``
    (``step_peaks``: each step's, where the allocator gives one)."""
    measured = {"step_ms": list(step_ms), "peak_bytes": peak_bytes}
    if step_peaks:
        measured["step_peak_bytes"] = list(step_peaks)
    return trace(
        [op(0, "aten::mm", "forward", "main", 0.0, 100.0)],
        step_end=120.0,
        measured=measured,
        resident_bytes={"parameters": peak_bytes},  # the predicted peak, too
    )


def _samples(median, spread_pct, n=10, seed=0):
    """``n`` steps around ``median`` spread uniformly over ``spread_pct`` percent of it."""
    rng = random.Random(seed)
    half = median * spread_pct / 200
    values = [median + rng.uniform(-half, half) for _ in range(n)]
    shift = median - statistics.median(values)
    return [v + shift for v in values]


def _verify(baseline_ms, plan_ms, *, baseline_peak=1000, plan_peak=1000, loss_finite=True, budget=None):
    baseline = build_report([_run(baseline_ms, baseline_peak)])
    return verify_plan(
        PLAN, baseline, [_run(plan_ms, plan_peak)], loss_finite=loss_finite, memory_budget=budget
    )


def test_the_noise_of_a_median_shrinks_with_samples_and_grows_with_spread():
    assert median_noise_pct([10.0, 10.0]) is None and median_band([10.0, 10.0]) is None
    # the band in the samples' own unit, the noise in % of their median (a change's median may be 0)
    samples = [8.0, 9.0, 10.0, 12.0, 15.0]
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    assert median_band(samples) == pytest.approx(2 * 1.2533 * (q3 - q1) / 1.349 / 5**0.5)
    assert median_noise_pct(samples) == pytest.approx(100 * median_band(samples) / 10.0)
    assert median_band([s - 10.0 for s in samples]) == pytest.approx(median_band(samples))
    assert median_noise_pct([10.0] * 9) == 0.0
    tight, wide = median_noise_pct(_samples(10, 4, n=20)), median_noise_pct(_samples(10, 40, n=20))
    assert 0 < tight < wide
    assert median_noise_pct(_samples(10, 40, n=80, seed=1)) < median_noise_pct(_samples(10, 40, n=10, seed=1))
    # one slow outlier does not make a steady run noisy
    assert median_noise_pct([10.0] * 9 + [30.0]) == 0.0


def test_a_recording_is_too_noisy_to_plan_on_over_its_noise_bound_from_enough_steps():
    def noise_and_why(steps):
        report = build_report([_run(steps)])
        return report["measured"]["step_ms_noise_pct"], too_noisy_to_plan(report)

    steady, why = noise_and_why(_samples(10, 30, n=RECORD_AGAIN_MIN_STEPS))
    assert steady < RECORD_AGAIN_NOISE_PCT and why is None
    busy = _samples(10, 120, n=RECORD_AGAIN_MIN_STEPS, seed=2)
    noise, why = noise_and_why(busy)
    assert noise > RECORD_AGAIN_NOISE_PCT
    assert why.startswith("the measured step time 10.00 ms is known only to +-") and "busy" in why
    assert f"median of {RECORD_AGAIN_MIN_STEPS} steps" in why
    # as spread, from fewer steps: the band says more about their count than about the machine
    noise, why = noise_and_why(busy[: RECORD_AGAIN_MIN_STEPS - 1])
    assert noise > RECORD_AGAIN_NOISE_PCT and why is None
    # scaled to the bound, then 1% past it
    bound = RECORD_AGAIN_NOISE_PCT / noise_and_why(busy)[0]
    at_bound = [10 + (s - 10) * bound for s in busy]
    assert noise_and_why(at_bound)[0] == pytest.approx(RECORD_AGAIN_NOISE_PCT)
    assert noise_and_why([10 + (s - 10) * bound * 1.01 for s in busy])[1] is not None


def test_a_slowdown_beyond_the_noise_is_rolled_back():
    result = _verify(_samples(10, 2), _samples(10.5, 2))
    assert result["decision"] == ROLL_BACK and result["reason"].startswith("5.0% slower")
    assert result["step_ms_change_pct"] == pytest.approx(5.0)


def test_a_speedup_beyond_the_noise_is_kept():
    result = _verify(_samples(10, 2), _samples(9, 2))
    assert result["decision"] == KEEP and result["reason"].startswith("10.0% faster")


def test_the_same_slowdown_in_a_noisy_run_is_no_decision_and_keeps_the_recorded_configuration():
    result = _verify(_samples(10, 60), _samples(10.5, 60))
    assert result["noise_pct"] > 5
    assert result["decision"] == ROLL_BACK and result["reason"].startswith("could not tell")
    assert "the recorded configuration" in result["reason"]


def test_no_decision_keeps_a_plan_that_uses_less_memory():
    result = _verify(_samples(10, 60), _samples(10.5, 60), plan_peak=900)
    assert result["decision"] == KEEP
    assert result["reason"].endswith("keeping the cheaper configuration, the plan, which uses less memory")


def test_no_decision_never_counts_fixed_malloc_thresholds_as_less_memory():
    fixed = Plan(malloc_thresholds={"mmap_threshold_bytes": 2**22}, prediction=PLAN.prediction)
    baseline = build_report([_run(_samples(10, 60), 1000)])
    result = verify_plan(fixed, baseline, [_run(_samples(10.5, 60), 900)], loss_finite=True)
    assert result["decision"] == ROLL_BACK
    said = "keeping the cheaper configuration, the recorded configuration (the plan keeps freed heap mapped"
    assert said in result["reason"]
    faster = verify_plan(fixed, baseline, [_run(_samples(5, 10), 1000)], loss_finite=True)
    assert faster["decision"] == KEEP  # faster beyond the noise: kept like any plan


def test_no_decision_counts_less_memory_only_below_every_baseline_steps_peak():
    """TF's allocator moves a step's peak with the order its threads run ops in: a plan whose peak is
    below the baseline's largest step's but not below its smallest step's is not the cheaper one."""
    baseline = build_report([_run(_samples(10, 60), 1000, step_peaks=[900, 1000, 950])])
    within = verify_plan(PLAN, baseline, [_run(_samples(10.5, 60), 950)], loss_finite=True)
    assert within["decision"] == ROLL_BACK and within["reason"].endswith("the recorded configuration")
    below = verify_plan(PLAN, baseline, [_run(_samples(10.5, 60), 899)], loss_finite=True)
    assert below["decision"] == KEEP and below["reason"].endswith("the plan, which uses less memory")
    at = verify_plan(PLAN, baseline, [_run(_samples(10.5, 60), 900)], loss_finite=True)
    assert at["decision"] == ROLL_BACK


def test_within_the_tolerance_a_quiet_run_cannot_tell_either():
    """1% slower on a quiet machine: beyond the noise, within the 2% a plan may cost."""
    result = _verify([10.0] * 10, [10.1] * 10)
    assert result["noise_pct"] == 0.0 and result["decision"] == ROLL_BACK
    assert result["reason"].startswith("could not tell: +1.0%")


def test_identical_runs_reach_the_same_decision():
    first = _verify(_samples(10, 30, seed=3), _samples(10.2, 30, seed=4))
    again = _verify(_samples(10, 30, seed=3), _samples(10.2, 30, seed=4))
    assert first == again


def test_a_memory_plan_is_decided_on_memory_and_a_non_finite_loss_always_rolls_back():
    slower_but_smaller = _verify(_samples(10, 2), _samples(12, 2), plan_peak=900, budget=950)
    assert slower_but_smaller["decision"] == KEEP and "within the budget" in slower_but_smaller["reason"]
    not_smaller = _verify(_samples(10, 2), _samples(9, 2), plan_peak=1000, budget=950)
    assert not_smaller["decision"] == ROLL_BACK
    infinite = _verify(_samples(10, 2), _samples(5, 2), loss_finite=False)
    assert infinite["decision"] == ROLL_BACK and infinite["reason"] == "the loss stopped being finite"


def test_the_verification_says_the_page_faults_a_step_in_turns_where_they_are_many():
    baseline = build_report([_run(_samples(10, 2))])
    turns = {"rounds": 2, "change_pct": -25.0, "noise_pct": 3.0, "baseline_ms": [10.0, 10.0]}
    turns["plan_ms"] = [7.5, 7.5]

    def lines(faults):
        alternation = {**turns, "page_faults_per_step": faults}
        verified = verify_plan(
            PLAN, baseline, [_run(_samples(8, 2))], loss_finite=True, alternation=alternation
        )
        assert verified["alternation"]["page_faults_per_step"] == faults
        return format_verification(verified).split("\n")

    said = [line for line in lines({"baseline": 12224.0, "plan": 3040.0}) if "page faults" in line]
    assert said == [
        "  in turns    page faults a step: baseline 12224, plan 3040 (fresh pages the allocator took again; "
        "a configuration run right after another can take thousands more a step than it does alone, and "
        "the change holds their cost)"
    ]
    few = NOISY_PAGE_FAULTS - 1
    assert not [line for line in lines({"baseline": few, "plan": 0.0}) if "page faults" in line]
    assert [line for line in lines({"baseline": 0.0, "plan": few + 1}) if "page faults" in line]
    assert not [line for line in lines(None) if "page faults" in line]


def test_in_turns_the_change_measured_in_turns_decides_and_the_windows_stand_beside_it():
    """The plan's window ran in a slow stretch of the machine (+20% against the baseline window);
    run in turns with the baseline, the plan was 10% faster: that is what decides."""
    baseline = build_report([_run(_samples(10, 2))])
    turns = {"rounds": 3, "change_pct": -10.0, "noise_pct": 2.0, "baseline_ms": [], "plan_ms": []}
    in_turns = verify_plan(PLAN, baseline, [_run(_samples(12, 2))], loss_finite=True, alternation=turns)
    assert in_turns["decision"] == KEEP
    assert in_turns["reason"] == "10.0% faster than the baseline in turns (noise +-2.0%)"
    assert in_turns["windows"]["step_ms_change_pct"] == pytest.approx(20.0)
    assert in_turns["alternation"] == turns
    recorded = baseline["predicted"]["step_ms"]
    assert in_turns["predicted_change_pct"] == pytest.approx(100 * (9.0 / recorded - 1))
    no_round = verify_plan(
        PLAN, baseline, [_run(_samples(12, 2))], loss_finite=True, alternation={**turns, "rounds": 0}
    )
    assert no_round["decision"] == ROLL_BACK
    assert no_round["reason"].startswith("20.0% slower than the baseline (")


def test_a_memory_plan_says_what_it_costs_in_turns():
    baseline = build_report([_run(_samples(10, 2))])
    turns = {"rounds": 2, "change_pct": 7.5, "noise_pct": 1.5, "baseline_ms": [], "plan_ms": []}
    result = verify_plan(
        PLAN, baseline, [_run(_samples(10, 2), 900)], loss_finite=True, memory_budget=950, alternation=turns
    )
    assert result["decision"] == KEEP
    assert result["reason"].endswith("; step time +7.5% against the baseline in turns (noise +-1.5%)")


def test_the_noise_of_a_difference_adds_the_medians_noise_in_quadrature():
    assert combined_noise_pct(3.0, 4.0) == pytest.approx(5.0)
    assert combined_noise_pct(None, 2.0) == pytest.approx(2.0)
    assert combined_noise_pct() == 0.0


def test_the_verification_holds_every_figure_it_decided_on():
    baseline_steps, plan_steps = _samples(10, 20, seed=5), _samples(9, 20, seed=6)
    baseline = build_report([_run(baseline_steps, 1000)])
    result = verify_plan(PLAN, baseline, [_run(plan_steps, 800)], loss_finite=True, memory_budget=2000)
    windows_noise = (median_noise_pct(baseline_steps) ** 2 + median_noise_pct(plan_steps) ** 2) ** 0.5
    assert result["noise_pct"] == pytest.approx(windows_noise)
    assert result["windows"] == {"step_ms_change_pct": pytest.approx(-10.0), "noise_pct": result["noise_pct"]}
    assert result["alternation"] is None
    assert result["baseline_step_ms"] == pytest.approx(10.0) and result["baseline_peak_bytes"] == 1000
    assert result["memory_budget"] == 2000
    assert result["measured"] == {
        "step_ms": pytest.approx(9.0),
        "step_ms_noise_pct": pytest.approx(median_noise_pct(plan_steps)),
        "peak_bytes": 800,
    }
    assert result["predicted"] == {"step_ms": 9.0, "peak_bytes": 1000}
    assert result["error_pct"] == {"step_ms": pytest.approx(0.0, abs=1e-9), "peak_bytes": pytest.approx(25.0)}
    assert result["plan"] == PLAN.to_dict()


def test_the_edges_of_the_rule_are_no_decision():
    """A change exactly at the noise, exactly at the 2% a plan may cost, or a gain up to the 1% a kept
    plan must gain, tells nothing."""
    baseline = build_report([_run([10.0] * 10)])

    def in_turns(change, noise, rounds=3):
        turns = {"rounds": rounds, "change_pct": change, "noise_pct": noise, "baseline_ms": [], "plan_ms": []}
        return verify_plan(PLAN, baseline, [_run([10.0] * 10)], loss_finite=True, alternation=turns)

    assert in_turns(3.0, 3.0)["reason"].startswith("could not tell: +3.0% against the baseline in turns")
    assert in_turns(-3.0, 3.0)["reason"].startswith("could not tell: -3.0%")
    assert in_turns(2.0, 0.0)["reason"].endswith(
        "(+-0.0%), the 2% allowed slower or the 1% a kept plan must gain; keeping the cheaper "
        "configuration, the recorded configuration"
    )
    assert in_turns(2.01, 0.0)["reason"] == "2.0% slower than the baseline in turns (noise +-0.0%)"
    # a gain told beyond its noise but under the 1% kept
    small_gain = in_turns(-0.8, 0.7)
    assert small_gain["decision"] == ROLL_BACK and small_gain["reason"].startswith("could not tell: -0.8%")
    assert in_turns(-1.0, 0.0)["decision"] == ROLL_BACK
    assert in_turns(-1.01, 0.0)["reason"] == "1.0% faster than the baseline in turns (noise +-0.0%)"
    # one round is enough to decide on the turns; none, or no count at all, falls back on the windows
    assert in_turns(-5.0, 1.0, rounds=1)["reason"] == "5.0% faster than the baseline in turns (noise +-1.0%)"
    no_count = verify_plan(
        PLAN,
        baseline,
        [_run([10.0] * 10)],
        loss_finite=True,
        alternation={"change_pct": -5.0, "noise_pct": 1.0},
    )
    assert no_count["reason"].startswith("could not tell: +0.0% against the baseline is within")


def test_a_memory_plan_says_whether_its_peak_is_below_the_baseline_and_within_the_budget():
    baseline = build_report([_run(_samples(10, 2), 1000)])

    def memory(plan_peak, budget):
        return verify_plan(
            PLAN, baseline, [_run(_samples(10, 2), plan_peak)], loss_finite=True, memory_budget=budget
        )

    at_budget = memory(950, 950)
    assert at_budget["decision"] == KEEP
    assert at_budget["reason"].startswith(
        "needed for the memory budget: measured peak below the baseline's, within the budget"
    )
    over = memory(990, 950)
    assert over["decision"] == KEEP and "below the baseline's, over the budget" in over["reason"]
    not_below = memory(1000, 950)
    assert (
        not_below["decision"] == ROLL_BACK and "measured peak not below the baseline's" in not_below["reason"]
    )
    # a budget the baseline meets exactly was not what the plan was needed for: decided on time
    assert not memory(900, 1000)["reason"].startswith("needed for the memory budget")


def test_without_a_measured_step_time_the_plan_is_kept_and_the_reason_says_why():
    baseline = build_report([_run(_samples(10, 2))])
    result = verify_plan(PLAN, baseline, [_run([])], loss_finite=True)
    assert result["decision"] == KEEP and result["reason"] == "no step time measured to compare"


def test_a_change_tells_only_beyond_its_noise_a_slowdown_beyond_the_tolerance_a_gain_beyond_the_least_kept():
    assert not can_tell(2.0, 0.0) and can_tell(2.01, 0.0)
    assert not can_tell(-1.0, 0.0) and can_tell(-1.01, 0.0) and not can_tell(0.0, 0.0)
    assert not can_tell(-0.8, 0.7) and can_tell(-1.5, 1.4)
    assert not can_tell(3.0, 3.0) and not can_tell(-3.0, 3.0)
    assert can_tell(3.1, 3.0) and can_tell(-3.1, 3.0)


def test_the_report_gives_the_offload_traffic_per_step_and_none_without_it():
    moves = {"bytes": 6 * 2**20, "copies": 3, "seconds": 0.003, "bytes_per_s": 2**31}
    stores = {
        "cpu": {
            "tier": "disk",
            "to_store": moves,
            "from_store": {**moves, "bytes_per_s": 2**32},
            "waited_s": 0.006,
            "late": 0,
        }
    }
    offloaded = _run([10.0] * 5)
    offloaded.measured["offload"] = {"steps": 3, "stores": stores}
    report = build_report([offloaded])
    assert report["measured"]["offload"] == {
        "cpu": {
            "tier": "disk",
            "to_store_bytes": 2 * 2**20,
            "from_store_bytes": 2 * 2**20,
            "to_store_bytes_per_s": 2**31,
            "from_store_bytes_per_s": 2**32,
            "waited_ms": 2.0,
            "late": 0.0,
        }
    }
    assert (
        "offload (cpu, disk): per step 2.0 MiB out at 2.00 GiB/s and 2.0 MiB back at 4.00 GiB/s; "
        "the step waited 2.00 ms on the store, 0.0 reads late"
    ) in format_summary(report)
    assert build_report([_run([10.0] * 5)])["measured"]["offload"] is None
    offloaded.measured["offload"]["steps"] = 0  # no step ended since the counts started: no figure
    assert build_report([offloaded])["measured"]["offload"] is None


def test_the_turns_decide_on_the_rounds_mean_or_their_median_whichever_is_the_less_noisy():
    rounds = {"change_pct": 32.0, "noise_pct": 60.0, "median_change_pct": -10.0, "median_noise_pct": 1.0}
    assert less_noisy_change(rounds) == {"change_pct": -10.0, "noise_pct": 1.0, "estimate": "median"}
    steady = {**rounds, "change_pct": -10.5, "noise_pct": 0.8}
    assert less_noisy_change(steady) == {"change_pct": -10.5, "noise_pct": 0.8, "estimate": "mean"}
    tie = {**rounds, "noise_pct": 1.0}  # equal noise: the mean
    assert less_noisy_change(tie)["estimate"] == "mean"
    few = {**rounds, "median_noise_pct": None}  # under alternation.MEDIAN_ROUNDS rounds
    assert less_noisy_change(few)["estimate"] == "mean"
    assert less_noisy_change({**rounds, "change_pct": None, "noise_pct": None}) is None


def test_verify_decides_on_the_rounds_median_where_it_is_the_less_noisy_and_says_so():
    """Rounds with a few far off the rest: the mean's band spans 0, the median's does not."""
    baseline = build_report([_run([10.0] * 10)])
    turns = {
        "rounds": 40,
        "change_pct": -2.6,
        "noise_pct": 3.1,
        "median_change_pct": -4.1,
        "median_noise_pct": 2.7,
    }
    result = verify_plan(PLAN, baseline, [_run([10.0] * 10)], loss_finite=True, alternation=turns)
    assert result["decision"] == KEEP and result["estimate"] == "median"
    assert result["step_ms_change_pct"] == -4.1 and result["noise_pct"] == 2.7
    assert result["reason"] == (
        "4.1% faster than the baseline in turns (the rounds' median, the less noisy) (noise +-2.7%)"
    )
    # the mean the less noisy: decided on the mean, which cannot tell
    steady = verify_plan(
        PLAN, baseline, [_run([10.0] * 10)], loss_finite=True, alternation={**turns, "median_noise_pct": 4.0}
    )
    assert steady["estimate"] == "mean" and steady["reason"].startswith("could not tell: -2.6% against")
