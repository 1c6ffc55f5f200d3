"""Verify an applied plan: measured against predicted, and whether to keep it or roll back.

After a plan is applied the run is recorded again. The plan is kept unless:

- the loss stopped being finite on any rank; or
- the run got more than ``SLOWER_TOLERANCE`` (2%) slower than the measured baseline, except when
  the plan was needed to fit a memory budget the baseline was predicted to exceed: such a plan may
  cost time, and it is the better one if its measured peak is below the baseline's (the report
  says whether it is within the budget too).

Rolling back means returning to the best measured configuration; with one plan tried, the baseline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qsync_callback.plan import Plan
from qsync_callback.recorder.trace import Trace
from qsync_callback.report import build_report, error_pct

SLOWER_TOLERANCE = 0.02


def verify_plan(
    plan: Plan,
    baseline: Mapping[str, Any],
    traces: Sequence[Trace],
    *,
    loss_finite: bool,
    memory_budget: int | None = None,
) -> dict[str, Any]:
    """Compare the run recorded under ``plan`` (``traces``) with the plan's prediction and with the
    ``baseline`` report; return the figures and ``decision`` ("keep" or "roll back") with its reason."""
    measured = build_report(traces)["measured"]
    predicted = plan.prediction or {}
    baseline_ms = baseline["measured"]["step_ms"]
    for_memory = memory_budget is not None and baseline["predicted"]["peak_bytes"] > memory_budget
    if not loss_finite:
        decision, reason = "roll back", "the loss stopped being finite"
    elif for_memory:
        peak, baseline_peak = measured["peak_bytes"], baseline["measured"]["peak_bytes"]
        lower = peak is not None and baseline_peak is not None and peak < baseline_peak
        fits = peak is not None and peak <= memory_budget
        decision = "keep" if lower else "roll back"
        reason = (
            f"needed for the memory budget: measured peak {'below' if lower else 'not below'} the "
            f"baseline's, {'within' if fits else 'over'} the budget"
        )
    elif baseline_ms and measured["step_ms"] and measured["step_ms"] > baseline_ms * (1 + SLOWER_TOLERANCE):
        slower = 100 * (measured["step_ms"] / baseline_ms - 1)
        decision, reason = "roll back", f"{slower:.1f}% slower than the baseline"
    else:
        decision, reason = "keep", "not slower than the baseline"
    return {
        "decision": decision,
        "reason": reason,
        "baseline_step_ms": baseline_ms,
        "baseline_peak_bytes": baseline["measured"]["peak_bytes"],
        "memory_budget": memory_budget,
        "measured": {"step_ms": measured["step_ms"], "peak_bytes": measured["peak_bytes"]},
        "predicted": {"step_ms": predicted.get("step_ms"), "peak_bytes": predicted.get("peak_bytes")},
        "error_pct": {
            "step_ms": error_pct(predicted.get("step_ms"), measured["step_ms"]),
            "peak_bytes": error_pct(predicted.get("peak_bytes"), measured["peak_bytes"]),
        },
        "plan": plan.to_dict(),
    }
