"""Predict step time and peak memory of a plan from recorded traces: the predictor's entry point.

Step time: each recorded step position is built into a global graph (all ranks joined through
their collectives) and replayed; the prediction is the median of the replayed steps. Peak memory:
the liveness model of each rank (`memory.py`); the prediction is the largest rank's peak.

A plan is priced as transforms of the recorded graph and liveness. This version prices the
recorded configuration (an empty plan); a plan with decisions it cannot price yet is refused with
a message naming them, never silently priced as if it were empty.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan, fingerprint_mismatches
from qsync_callback.predictor.graph import build_global_graph
from qsync_callback.predictor.memory import predict_memory
from qsync_callback.predictor.replay import replay
from qsync_callback.recorder.trace import Trace


@dataclass
class Prediction:
    """What a plan is predicted to do, per step (milliseconds) and at peak (bytes)."""

    step_ms: float
    peak_bytes: int
    replayed_step_ms: list[float]
    per_rank_peak_bytes: list[int]
    critical_path_share: dict[str, float] = field(default_factory=dict)
    memory_breakdown: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def check_plan(traces: Sequence[Trace], plan: Plan, source: str = "<plan>") -> None:
    """Refuse a plan made for another run, or with decisions this version cannot price."""
    mismatches = fingerprint_mismatches(plan.fingerprint, traces[0].fingerprint)
    if mismatches:
        raise QSyncInputError(f"{source}: made for another run ({'; '.join(mismatches[:3])})")
    layers = [layer["name"] for layer in traces[0].layers]
    if layers:
        plan.validate_for(layers, source=source)
    unpriced = [
        name
        for name, decisions in (
            ("precision", plan.precision),
            ("buckets", plan.buckets),
            ("fused_regions", plan.fused_regions),
            ("activation", plan.activation),
        )
        if decisions
    ]
    if unpriced:
        raise QSyncInputError(
            f"{source}: this version prices only the recorded configuration; "
            f"the plan's {', '.join(unpriced)} decisions cannot be priced yet"
        )


def predict(traces: Sequence[Trace], plan: Plan | None = None, plan_source: str = "<plan>") -> Prediction:
    """Price ``plan`` (default: the recorded configuration) on the recorded ``traces`` (one per rank)."""
    if not traces:
        raise QSyncInputError("no traces to predict from")
    if plan is not None:
        check_plan(traces, plan, plan_source)
    positions = min(len(t.steps) for t in traces)
    replays = [replay(build_global_graph(traces, pos)) for pos in range(positions)]
    step_us = [r.step_us for r in replays]
    median_us = statistics.median(step_us)
    typical = min(replays, key=lambda r: abs(r.step_us - median_us))
    memory = [predict_memory(t) for t in traces]
    largest = max(memory, key=lambda m: m.peak_bytes)
    return Prediction(
        step_ms=median_us / 1e3,
        peak_bytes=largest.peak_bytes,
        replayed_step_ms=[us / 1e3 for us in step_us],
        per_rank_peak_bytes=[m.peak_bytes for m in memory],
        critical_path_share=typical.critical_share,
        memory_breakdown=largest.breakdown,
    )
