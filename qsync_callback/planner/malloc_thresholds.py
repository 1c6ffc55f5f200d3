"""Choose whether to fix glibc malloc's thresholds (`qsync_callback.malloc_thresholds`).

One candidate, on top of the plan the other levers chose: the thresholds that cover every rank's
recorded blocks (`predictor.malloc_thresholds.covering_thresholds`), priced by the predictor (the
plan's step less the page faults they save). It is taken when it is predicted more than
`NO_DECISION_GAIN` faster than the plan without it, or when a step waited on at least
`report.NOISY_PAGE_FAULTS` faults (in each step the most any rank took, their mean over the steps:
`predictor.malloc_thresholds.waited_faults`): how many a run takes depends on what moved glibc's
thresholds before, the recorder's own work among it, and the recorded steps can take a sixth of
what the same run's steps take in the verify's turns (`benchmarks/README.md`), so there the turns
decide, as for every plan (verify keeps it only if it measures faster beyond the noise). Otherwise
nothing is fixed, and the table says why (the traces cannot price it, or the faults are too few).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qsync_callback.malloc_thresholds import (
    MMAP_THRESHOLD,
    TRIM_THRESHOLD,
    recorded_thresholds,
    step_allocations,
)
from qsync_callback.plan import Plan
from qsync_callback.planner import NO_DECISION_GAIN
from qsync_callback.predictor.malloc_thresholds import (
    covering_thresholds,
    faults_per_step,
    malloc_problem,
    waited_fault_us,
    waited_faults,
)
from qsync_callback.predictor.predict import Prediction, Predictor
from qsync_callback.report import NOISY_PAGE_FAULTS
from qsync_callback.units import format_bytes


@dataclass
class MallocChoice:
    """The plan with fixed thresholds (None: none fixed), the plan it went on priced (``base``),
    the candidate priced (None: it could not be), and what each rank recorded: the thresholds its
    steps ran under, its faults a step and a fresh page's cost; and the faults a step waited on
    (the most any rank took in it, and what they cost: `waited_faults`, `waited_fault_us`)."""

    plan: Plan | None
    base: Prediction
    prediction: Prediction | None = None
    thresholds: dict[str, int] = field(default_factory=dict)
    largest_bytes: int = 0  # the largest block a recorded step asked for, on any rank
    ranks: list[dict[str, Any]] = field(default_factory=list)
    waited_faults: float = 0.0
    waited_us: float = 0.0
    problem: str | None = None


def choose_malloc_thresholds(predictor: Predictor, base: Plan) -> MallocChoice:
    """Fixed thresholds on top of ``base``, if they are predicted to pay (module docstring)."""
    traces = predictor.traces
    base_prediction = predictor.predict(base)
    problem = malloc_problem(traces)
    if problem is not None:
        return MallocChoice(None, base_prediction, problem=problem)
    ranks = [
        {
            "in_force": recorded_thresholds(trace),
            "faults_per_step": faults_per_step(trace),
            "fresh_page_us": float(trace.measured["malloc"]["fresh_page_us"]),
        }
        for trace in traces
    ]
    thresholds = covering_thresholds(traces)
    candidate = Plan.from_dict({**base.to_dict(), "malloc_thresholds": thresholds, "prediction": None})
    prediction = predictor.predict(candidate)
    waited = waited_faults(traces)
    chosen = waited >= NOISY_PAGE_FAULTS or _predicted_to_pay(prediction, base_prediction)
    if chosen:
        candidate.prediction = prediction.figures()
    largest = max(step_allocations(trace.memory_events)["largest_bytes"] for trace in traces)
    plan = candidate if chosen else None
    return MallocChoice(
        plan, base_prediction, prediction, thresholds, largest, ranks, waited, waited_fault_us(traces)
    )


def _predicted_to_pay(prediction: Prediction, base: Prediction) -> bool:
    """Whether fixed thresholds are predicted more than `NO_DECISION_GAIN` faster than ``base``."""
    return prediction.step_ms < (1 - NO_DECISION_GAIN) * base.step_ms


def format_malloc_plan(choice: MallocChoice) -> str:
    """The thresholds the steps ran under, the faults they took and what fixing them is priced at."""
    lines = ["qsync allocator (glibc malloc's mmap and trim thresholds)"]
    if choice.problem is not None or choice.prediction is None:
        return "\n".join([*lines, f"  not priced: {choice.problem}"])
    for rank, figures in enumerate(choice.ranks):
        in_force, page_us = figures["in_force"], figures["fresh_page_us"]
        faults = figures["faults_per_step"]
        lines.append(
            f"  rank {rank}: steps ran under mmap {format_bytes(in_force[MMAP_THRESHOLD])}, trim "
            f"{format_bytes(in_force[TRIM_THRESHOLD])}; {faults:,.0f} page faults a step (mean) at "
            f"{page_us:.2f} us each = {faults * page_us / 1e3:.2f} ms"
        )
    if len(choice.ranks) > 1:
        lines.append(
            f"  a step waits on the most any rank took in it: {choice.waited_faults:,.0f} page faults a "
            f"step (mean) = {choice.waited_us / 1e3:.2f} ms"
        )
    fixed = (
        f"mmap {format_bytes(choice.thresholds[MMAP_THRESHOLD])}, "
        f"trim {format_bytes(choice.thresholds[TRIM_THRESHOLD])}"
    )
    change = 100 * (choice.prediction.step_ms / choice.base.step_ms - 1)
    lines.append(
        f"  fixed at {fixed}: predicted {choice.prediction.step_ms:.2f} ms/step against "
        f"{choice.base.step_ms:.2f} ({change:+.1f}%); the tensors' peak unchanged, the process keeps up "
        f"to {format_bytes(choice.thresholds[TRIM_THRESHOLD])} of freed heap mapped between steps, and a "
        f"few blocks of up to {format_bytes(choice.largest_bytes)} more where aligned blocks leave gaps"
    )
    if choice.plan is None:
        lines.append(
            f"  not predicted more than {100 * NO_DECISION_GAIN:g}% faster, and under {NOISY_PAGE_FAULTS} "
            "page faults a step: nothing is fixed"
        )
    elif not _predicted_to_pay(choice.prediction, choice.base):
        lines.append(
            f"  tried though not predicted {100 * NO_DECISION_GAIN:g}% faster: a step waited on "
            f"{NOISY_PAGE_FAULTS} or more page faults, whose number moves with glibc's history; "
            "the turns decide"
        )
    return "\n".join(lines)
