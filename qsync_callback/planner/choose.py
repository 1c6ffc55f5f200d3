"""Choose the plan for a recorded run: every planner whose lever is allowed and whose inputs the
traces carry, under one set of `Constraints`.

Today that is the per-layer precision planner (`precision.py`: traces recorded with per-layer
probes and layer statistics); under a memory budget with the activation lever allowed on a torch
run, precision and per-module recompute/offload chosen together (`memory_plan.py`); for
TensorFlow runs the op-type and gradient-groups planner (`tf_plans.py`: traces with op-type costs or
Horovod's settings); and on a torch run under DDP with the buckets lever allowed, DDP's gradient
buckets (`ddp_buckets.py`), on top of the precision plan where there is one (activation policies
and buckets are not priced together yet); and on a torch run recorded for them with the regions
lever allowed, the modules to compile (`compiled_regions.py`), on top of both; and on a torch run on
the CPU with the allocator lever allowed and no memory budget, glibc malloc's thresholds
(`malloc_thresholds.py`: they trade resident memory for time), on top of all of them. A new plan
kind adds its planner here, next to a predictor transform and an applier; never a branch in an
integration.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qsync_callback.errors import QSyncInputError
from qsync_callback.mean_band import median_noise_pct
from qsync_callback.plan import Constraints, Plan
from qsync_callback.planner import PlanChoice
from qsync_callback.planner.compiled_regions import choose_regions, format_region_plan
from qsync_callback.planner.ddp_buckets import choose_buckets, format_bucket_plan
from qsync_callback.planner.malloc_thresholds import choose_malloc_thresholds, format_malloc_plan
from qsync_callback.planner.memory_plan import plan_memory
from qsync_callback.planner.precision import plan_precision
from qsync_callback.planner.tf_plans import choose_tf_plan, has_tf_candidates
from qsync_callback.predictor.predict import Prediction, Predictor
from qsync_callback.predictor.tensor_fusion import DDP, can_price_fusion
from qsync_callback.recorder.trace import Trace
from qsync_callback.report import format_memory_plan, format_precision_plan, slowest_rank


def choose_plan(traces: Sequence[Trace], constraints: Constraints, recorded: Mapping[str, Any]) -> PlanChoice:
    """The best plan for ``traces`` under ``constraints`` (a memory budget in bytes by now);
    ``recorded`` is the recorded configuration's prediction (report["predicted"]), for the table.
    Raises QSyncInputError when no allowed lever can be planned from these traces."""
    if _plans_memory(traces, constraints):
        choice = plan_memory(traces, constraints)
        table = format_memory_plan(choice, recorded, _noise(traces))
        return PlanChoice(choice.chosen.plan, choice.feasible, table)
    chosen: PlanChoice | None = None
    if "precision" in constraints.levers and traces and traces[0].precision_costs.get("layers"):
        choice, indicator = plan_precision(
            traces,
            constraints.precisions,
            max_step_ms=constraints.max_step_ms,
            memory_budget=constraints.memory_budget,
            best_effort=constraints.best_effort,
        )
        choice.plan.constraints = constraints.to_dict()
        table = format_precision_plan(choice, indicator, recorded, traces[0].layers, _noise(traces))
        chosen = PlanChoice(choice.plan, choice.feasible, table)
    elif has_tf_candidates(traces):
        return choose_tf_plan(traces, constraints)
    on_top = [
        planner
        for wanted, planner in (
            (_plans_buckets, _plan_buckets),
            (_plans_regions, _plan_regions),
            (_plans_malloc, _plan_malloc),
        )
        if wanted(traces, constraints)
    ]
    if on_top:
        predictor = Predictor(traces)  # one for both: its graphs and fits do not depend on the plan
        for planner in on_top:
            chosen = _on_top(traces, constraints, chosen, predictor, planner)
    if chosen is not None:
        return chosen
    if "precision" in constraints.levers:
        raise QSyncInputError(
            "the trace has no layer statistics and per-layer precision probes to plan from; record it "
            "with QSyncCallback(mode='apply')"
        )
    budget_note = (
        " (the allocator lever is not pulled under a memory budget: it trades resident memory for time)"
        if "allocator" in constraints.levers and constraints.budgeted
        else ""
    )
    raise QSyncInputError(
        f"nothing to plan: the levers allowed ({', '.join(constraints.levers)}) have no planner for "
        f"what these traces recorded{budget_note}"
    )


def _plans_memory(traces: Sequence[Trace], constraints: Constraints) -> bool:
    """Whether a budget is to be met with the activation lever: a torch run with layers, a budget,
    the lever allowed (and, where precision is allowed too, the probes it needs recorded: else the
    precision planner says what is missing)."""
    return (
        "activation" in constraints.levers
        and (
            "precision" not in constraints.levers or bool(traces and traces[0].precision_costs.get("layers"))
        )
        and constraints.memory_budget is not None
        and bool(traces)
        and traces[0].framework == "torch"
        and bool(traces[0].layers)
    )


def _plans_buckets(traces: Sequence[Trace], constraints: Constraints) -> bool:
    """Whether DDP's buckets are to be chosen: the lever allowed, on traces that price them."""
    return (
        "buckets" in constraints.levers
        and bool(traces)
        and traces[0].communication.get("library") == DDP
        and can_price_fusion(traces) is None
    )


def _plans_regions(traces: Sequence[Trace], constraints: Constraints) -> bool:
    """Whether compiled regions are to be chosen: the lever allowed, on torch traces recorded for it
    (``Trace.compiled_regions``, with the steps left)."""
    return "regions" in constraints.levers and bool(traces) and bool(traces[0].compiled_regions)


def _plans_malloc(traces: Sequence[Trace], constraints: Constraints) -> bool:
    """Whether malloc's thresholds are to be chosen: the lever allowed, on a torch run on the CPU, with
    no memory budget (fixed thresholds keep freed heap mapped: more resident memory for less time)."""
    return (
        "allocator" in constraints.levers
        and not constraints.budgeted
        and bool(traces)
        and traces[0].framework == "torch"
        and traces[0].device == "cpu"
    )


def _plan_buckets(predictor: Predictor, base: Plan) -> tuple[Plan | None, Prediction, str]:
    """DDP's buckets on top of ``base`` (`_on_top`'s planner)."""
    buckets = choose_buckets(predictor, base)
    return buckets.plan, buckets.recorded.prediction, format_bucket_plan(buckets)


def _plan_regions(predictor: Predictor, base: Plan) -> tuple[Plan | None, Prediction, str]:
    """Compiled regions on top of ``base`` (`_on_top`'s planner)."""
    regions = choose_regions(predictor, base)
    return regions.plan, regions.base, format_region_plan(regions)


def _plan_malloc(predictor: Predictor, base: Plan) -> tuple[Plan | None, Prediction, str]:
    """glibc malloc's thresholds on top of ``base`` (`_on_top`'s planner)."""
    malloc = choose_malloc_thresholds(predictor, base)
    return malloc.plan, malloc.base, format_malloc_plan(malloc)


def _on_top(
    traces: Sequence[Trace],
    constraints: Constraints,
    choice: PlanChoice | None,
    predictor: Predictor,
    planner: Callable[[Predictor, Plan], tuple[Plan | None, Prediction, str]],
) -> PlanChoice:
    """``choice`` (another lever's plan, or none) with ``planner``'s decisions on top: its plan
    (None: nothing to add), the prediction of the plan it went on, and its table, which follows
    the other's."""
    base = choice.plan if choice is not None else Plan.empty(traces[0].fingerprint)
    added, base_prediction, table = planner(predictor, base)
    plan = added or base
    plan.constraints = constraints.to_dict()
    if added is None and choice is None:
        plan.prediction = base_prediction.figures()
    if choice is not None:
        table = f"{choice.table}\n{table}"
    return PlanChoice(plan, choice.feasible if choice is not None else True, table)


def _noise(traces: Sequence[Trace]) -> float | None:
    """The measured step time's noise on the slowest rank (`median_noise_pct`)."""
    slowest = slowest_rank(traces)
    return median_noise_pct(traces[slowest].measured["step_ms"]) if slowest is not None else None
