"""Verify an applied plan: measured against predicted, and whether to keep it or roll back.

After a plan is applied the run is recorded again, and the plan's measured step time (the median
of the slowest rank's unprofiled steps) is compared with the baseline's; when the loop then ran
the baseline and the plan in turns (`alternation.py`), the change measured in turns is the one
decided on (the windows' comparison is kept beside it), since a drift of the machine's speed
between the two windows cancels there. A difference is a difference only beyond its noise (of
the two medians, `mean_band.median_noise_pct`, combined; in turns, `alternation.paired_change`'s, of
the rounds' mean or of their median, whichever is the less noisy, `alternation.less_noisy_change`): a
decision on less than that is no decision. The plan is:

- rolled back if the loss stopped being finite on any rank;
- when it was needed to fit a memory budget the baseline was predicted to exceed: kept if its
  measured peak is below the baseline's (it may cost time: the reason says how much, and whether
  it is within the budget too), else rolled back;
- rolled back if it is slower than the baseline by more than ``SLOWER_TOLERANCE`` (2%) and more
  than the noise;
- kept if it is faster by more than the noise and by more than ``LEAST_KEPT_GAIN`` (1%): a quiet
  launch's turns narrow their noise to about 1% by the end of training (`benchmarks/README.md`'s
  decision_repeatability table), and a gain under that is told in some launches and not in their
  twins (`benchmarks/turns_decisions.py`'s quiet cases);
- otherwise the run could not tell, and it keeps the cheaper configuration: the plan if its
  measured peak is below the baseline's smallest step's (less memory, not measurably slower: TF's
  allocator moves a step's peak with the order its threads run ops in, `benchmarks/README.md`'s TF
  memory table gives the spread, so a peak within the baseline's steps' range is no less memory),
  else the recorded configuration (no change); a plan that fixes malloc's thresholds is never the
  cheaper one (it keeps freed heap mapped between steps, which no measured peak counts). The reason
  says so, with the figures.

Rolling back means returning to the last kept configuration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qsync_callback.alternation import MEDIAN_SAID, less_noisy_change
from qsync_callback.mean_band import change_pct, combined_noise_pct
from qsync_callback.plan import Plan
from qsync_callback.planner import NO_DECISION_GAIN
from qsync_callback.recorder.trace import Trace
from qsync_callback.report import build_report, error_pct

SLOWER_TOLERANCE = NO_DECISION_GAIN  # the planners' least predicted gain is what a plan may lose
LEAST_KEPT_GAIN = 0.01
KEEP, ROLL_BACK = "keep", "roll back"


def can_tell(change_pct: float, noise_pct: float, least_gain_pct: float = 100 * LEAST_KEPT_GAIN) -> bool:
    """Whether a measured change says anything: slower beyond its noise and the tolerance, or faster
    beyond its noise and the least gain kept (``least_gain_pct``, the loop's `LEAST_KEPT_GAIN`)."""
    return change_pct > max(100 * SLOWER_TOLERANCE, noise_pct) or change_pct < -max(least_gain_pct, noise_pct)


def decided_on_memory(baseline: Mapping[str, Any], memory_budget: int | None) -> bool:
    """Whether a plan is decided on its peak: it was needed for a budget the baseline exceeded."""
    return memory_budget is not None and baseline["predicted"]["peak_bytes"] > memory_budget


def verify_plan(
    plan: Plan,
    baseline: Mapping[str, Any],
    traces: Sequence[Trace],
    *,
    loss_finite: bool,
    memory_budget: int | None = None,
    alternation: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Compare the run recorded under ``plan`` (``traces``) with the plan's prediction and with the
    ``baseline`` report; return the figures and ``decision`` ("keep" or "roll back") with its reason.

    With ``alternation`` (`alternation.paired_change`, at least one round) the step-time decision
    rests on the baseline and the plan run in turns; else on the two windows' medians."""
    measured = build_report(traces)["measured"]
    predicted = plan.prediction or {}
    baseline_ms = baseline["measured"]["step_ms"]
    peak, baseline_peak = measured["peak_bytes"], baseline["measured"]["peak_bytes"]
    lower_peak = peak is not None and baseline_peak is not None and peak < baseline_peak
    baseline_smallest = baseline["measured"].get("peak_bytes_min") or baseline_peak
    below_every_step = peak is not None and baseline_smallest is not None and peak < baseline_smallest
    windows_noise = combined_noise_pct(
        baseline["measured"].get("step_ms_noise_pct"), measured.get("step_ms_noise_pct")
    )
    windows_change = change_pct(measured["step_ms"], baseline_ms)
    in_turns = alternation is not None and alternation.get("rounds", 0) > 0
    decided_on = less_noisy_change(alternation) if in_turns else None
    change, noise = (
        (decided_on["change_pct"], decided_on["noise_pct"]) if decided_on else (windows_change, windows_noise)
    )
    against = "the baseline" if decided_on is None else "the baseline in turns"
    if decided_on is not None and decided_on["estimate"] == "median":
        against += f" ({MEDIAN_SAID})"
    if not loss_finite:
        decision, reason = ROLL_BACK, "the loss stopped being finite"
    elif decided_on_memory(baseline, memory_budget):
        fits = peak is not None and peak <= memory_budget
        decision = KEEP if lower_peak else ROLL_BACK
        reason = (
            f"needed for the memory budget: measured peak {'below' if lower_peak else 'not below'} the "
            f"baseline's, {'within' if fits else 'over'} the budget"
        )
        if change is not None:
            reason += f"; step time {change:+.1f}% against {against} (noise +-{noise:.1f}%)"
    elif change is None:
        decision, reason = KEEP, "no step time measured to compare"
    elif can_tell(change, noise) and change > 0:
        decision, reason = ROLL_BACK, f"{change:.1f}% slower than {against} (noise +-{noise:.1f}%)"
    elif can_tell(change, noise):
        decision, reason = KEEP, f"{-change:.1f}% faster than {against} (noise +-{noise:.1f}%)"
    else:
        plan_cheaper = below_every_step and not plan.malloc_thresholds
        decision = KEEP if plan_cheaper else ROLL_BACK
        cheaper = "the plan, which uses less memory" if plan_cheaper else "the recorded configuration"
        if plan.malloc_thresholds:
            cheaper += " (the plan keeps freed heap mapped between steps)"
        reason = (
            f"could not tell: {change:+.1f}% against {against} is within the noise (+-{noise:.1f}%), "
            f"the {100 * SLOWER_TOLERANCE:.0f}% allowed slower or the {100 * LEAST_KEPT_GAIN:.0f}% a kept "
            f"plan must gain; keeping the cheaper configuration, {cheaper}"
        )
    return {
        "decision": decision,
        "reason": reason,
        "baseline_step_ms": baseline_ms,
        "baseline_peak_bytes": baseline_peak,
        "step_ms_change_pct": change,
        "noise_pct": noise,
        "estimate": decided_on["estimate"] if decided_on is not None else None,
        "windows": {"step_ms_change_pct": windows_change, "noise_pct": windows_noise},
        "alternation": dict(alternation) if alternation is not None else None,
        "memory_budget": memory_budget,
        "measured": {
            "step_ms": measured["step_ms"],
            "step_ms_noise_pct": measured.get("step_ms_noise_pct"),
            "peak_bytes": peak,
        },
        "predicted": {"step_ms": predicted.get("step_ms"), "peak_bytes": predicted.get("peak_bytes")},
        # the change as predicted, against the recorded configuration's prediction: what the measured
        # change checks, free of the drift between the baseline window and the verify window
        "predicted_change_pct": change_pct(predicted.get("step_ms"), baseline["predicted"]["step_ms"]),
        "error_pct": {
            "step_ms": error_pct(predicted.get("step_ms"), measured["step_ms"]),
            "peak_bytes": error_pct(predicted.get("peak_bytes"), peak),
        },
        "plan": plan.to_dict(),
    }
