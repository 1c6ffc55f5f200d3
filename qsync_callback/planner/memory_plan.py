"""Meet a memory budget with every lever allowed: per-layer precision and per-module activation
policies chosen together, for the least predicted step time.

The candidates, each priced by the full predictor:

- **precision alone** (`precision.plan_precision` under the budget: QSync's allocator, the
  indicator as today), where the precision lever is allowed;
- **activation on top of precision**: the precision plan chosen with no budget (the fastest the
  indicator allows, or none), then the activation policies of least cost that bring it within the
  budget (`activation.choose_activation`), where both levers are allowed;
- **activation alone** (`activation.choose_activation` on the recorded precision).

Of those that meet the budget (and the step-time limit, if one is set) the fastest is chosen; the
indicator breaks a tie (the plan that lowers less precision). Where none meets the budget, it is
refused with one message naming the closest plan (the least predicted peak) and its peak; with best
effort that plan is returned, marked as not meeting the constraints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import OFFLOAD, RECOMPUTE, Constraints, Plan
from qsync_callback.planner.activation import ActivationChoice, choose_activation
from qsync_callback.planner.precision import budget_refusal, describe_choice, plan_precision
from qsync_callback.predictor.predict import Prediction, Predictor
from qsync_callback.recorder.trace import Trace


@dataclass
class MemoryCandidate:
    """One way of meeting the budget: its plan, prediction, summed indicator (0: no precision
    lowered), and the activation choice it holds (None: precision only)."""

    name: str
    plan: Plan
    prediction: Prediction
    indicator: float
    activation: ActivationChoice | None = None


@dataclass
class MemoryChoice:
    """The chosen candidate, whether it meets the constraints, every candidate priced, and the
    trials that calibrated the activation policies' prices (``trials``: the offload trial's and the
    recompute trial's results, `activation_trial`, the latter with its factor as the predictor took
    it; absent: none ran, or the activation lever was not allowed)."""

    chosen: MemoryCandidate
    feasible: bool
    memory_budget: int
    max_step_ms: float | None
    candidates: list[MemoryCandidate] = field(default_factory=list)
    trials: dict[str, dict[str, Any]] = field(default_factory=dict)


def _meets(candidate: MemoryCandidate, budget: int, max_step_ms: float | None) -> bool:
    prediction = candidate.prediction
    return prediction.peak_bytes <= budget and (max_step_ms is None or prediction.step_ms <= max_step_ms)


def _indicator(precision: Mapping[str, str], indicator: Mapping[str, Mapping[str, float]]) -> float:
    return sum(indicator.get(layer, {}).get(p, 0.0) for layer, p in precision.items())


def plan_memory(traces: Sequence[Trace], constraints: Constraints) -> MemoryChoice:
    """The fastest plan under ``constraints.memory_budget`` (bytes) with the levers they allow (see
    the module docstring)."""
    budget = constraints.memory_budget
    assert budget is not None, "plan_memory needs a budget in bytes (Constraints.resolved)"
    predictor = Predictor(traces)
    candidates: list[MemoryCandidate] = []
    base_precision: dict[str, str] = {}
    indicator: Mapping[str, Mapping[str, float]] = {}
    precision_allowed = "precision" in constraints.levers and traces[0].precision_costs.get("layers")
    if precision_allowed:
        under_budget, indicator = plan_precision(
            traces,
            constraints.precisions,
            max_step_ms=constraints.max_step_ms,
            memory_budget=budget,
            best_effort=True,  # its closest plan, where it cannot meet the budget, is a candidate too
            predictor=predictor,
        )
        plan = under_budget.plan
        candidates.append(
            MemoryCandidate("precision", plan, under_budget.prediction, _indicator(plan.precision, indicator))
        )
        fastest, _ = plan_precision(
            traces, constraints.precisions, max_step_ms=constraints.max_step_ms, predictor=predictor
        )
        base_precision = dict(fastest.plan.precision)
    trials: dict[str, dict[str, Any]] = {}
    if "activation" in constraints.levers:
        offload_trial = traces[0].activation_costs.get("copy", {}).get("in_step")
        recompute_trial = predictor.activation.recompute_trials[0]
        trials = {
            policy: trial
            for policy, trial in ((OFFLOAD, offload_trial), (RECOMPUTE, recompute_trial))
            if trial is not None
        }
        tops = [("activation", {})]
        if base_precision:
            tops.insert(0, ("precision + activation", base_precision))
        for name, precision in tops:
            choice = choose_activation(predictor, precision, budget)
            plan = Plan(precision=dict(precision), activation=dict(choice.activation))
            candidates.append(
                MemoryCandidate(name, plan, choice.prediction, _indicator(precision, indicator), choice)
            )
    meeting = [c for c in candidates if _meets(c, budget, constraints.max_step_ms)]
    if meeting:
        chosen = min(meeting, key=lambda c: (round(c.prediction.step_ms, 3), c.indicator))
    else:
        chosen = min(candidates, key=lambda c: (c.prediction.peak_bytes, c.prediction.step_ms))
        if not constraints.best_effort and chosen.prediction.peak_bytes > budget:
            raise QSyncInputError(budget_refusal(budget, chosen.prediction, describe_plan(chosen.plan)))
    chosen.plan.prediction = chosen.prediction.figures()
    chosen.plan.constraints = constraints.to_dict()
    chosen.plan.fingerprint = dict(traces[0].fingerprint)
    return MemoryChoice(chosen, bool(meeting), budget, constraints.max_step_ms, candidates, trials)


def describe_plan(plan: Plan) -> str:
    """A plan's lowered layers (`describe_choice`) and its activation policies, in a few words."""
    policies = ", ".join(f"{module} {policy}" for module, policy in sorted(plan.activation.items()))
    if not plan.precision:
        return policies or describe_choice({})
    return ", ".join(filter(None, (describe_choice(plan.precision), policies)))
