"""Predict step time and peak memory of a plan from recorded traces: the predictor's entry point.

Step time: each recorded step position is built into a global graph (all ranks joined through
their collectives) and replayed; the prediction is the median of the replayed steps. Peak memory:
the liveness model of each rank (`memory.py`); the prediction is the largest rank's peak.

A plan is priced as transforms of the recorded graph and liveness: per-layer precision
(`precision.py`). A plan with decisions this version cannot price yet (buckets, fused regions,
activation policies) is refused with a message naming them, never silently priced as if empty.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import networkx as nx

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.predictor.graph import build_global_graph
from qsync_callback.predictor.memory import predict_memory, tensor_lifetimes
from qsync_callback.predictor.precision import apply_precision, check_precision_plan, precision_lives
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
    layer_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def check_plan(traces: Sequence[Trace], plan: Plan, source: str = "<plan>") -> None:
    """Refuse a plan made for another run, or with decisions this version cannot price."""
    plan.check_for(traces[0].fingerprint, [layer["name"] for layer in traces[0].layers], source=source)
    unpriced = [
        name
        for name, decisions in (
            ("op_precision", plan.op_precision),
            ("buckets", plan.buckets),
            ("fused_regions", plan.fused_regions),
            ("activation", plan.activation),
            ("communication", plan.communication),
        )
        if decisions
    ]
    if unpriced:
        raise QSyncInputError(
            f"{source}: this version prices precision plans only; "
            f"the plan's {', '.join(unpriced)} decisions cannot be priced yet"
        )
    check_precision_plan(traces, plan.precision, source)


class Predictor:
    """Prices plans on one set of recorded traces (one per rank).

    The recorded steps' graphs and tensor lifetimes are built once; each `predict` transforms
    copies of them, so a planner can price many plans quickly.
    """

    def __init__(self, traces: Sequence[Trace]):
        if not traces:
            raise QSyncInputError("no traces to predict from")
        self.traces = list(traces)
        positions = min(len(t.steps) for t in self.traces)
        self._graphs = [build_global_graph(self.traces, pos) for pos in range(positions)]
        self._lives = [tensor_lifetimes(t) for t in self.traces]

    def predict(self, plan: Plan | None = None, plan_source: str = "<plan>") -> Prediction:
        """Price ``plan`` (default: the recorded configuration)."""
        precision: dict[str, str] = {}
        if plan is not None:
            check_plan(self.traces, plan, plan_source)
            precision = plan.precision
        graphs = [apply_precision(g, self.traces, precision) if precision else g for g in self._graphs]
        replays = [replay(g) for g in graphs]
        step_us = [r.step_us for r in replays]
        median_us = statistics.median(step_us)
        typical = min(range(len(replays)), key=lambda i: abs(replays[i].step_us - median_us))
        memory = [
            predict_memory(t, [*lives, *precision_lives(t, lives, precision)])
            for t, lives in zip(self.traces, self._lives, strict=True)
        ]
        largest = max(memory, key=lambda m: m.peak_bytes)
        return Prediction(
            step_ms=median_us / 1e3,
            peak_bytes=largest.peak_bytes,
            replayed_step_ms=[us / 1e3 for us in step_us],
            per_rank_peak_bytes=[m.peak_bytes for m in memory],
            critical_path_share=replays[typical].critical_share,
            memory_breakdown=largest.breakdown,
            layer_ms=_layer_ms(graphs[typical]),
        )


def _layer_ms(graph: nx.DiGraph) -> dict[str, float]:
    """Time of each layer's ops (forward, backward and casts; every rank) in one replayed step."""
    totals: dict[str, float] = {}
    for _, attrs in graph.nodes(data=True):
        if attrs["layer"] is not None and attrs["kind"] in ("forward", "backward", "cast"):
            totals[attrs["layer"]] = totals.get(attrs["layer"], 0.0) + attrs["dur"] / 1e3
    return totals


def predict(traces: Sequence[Trace], plan: Plan | None = None, plan_source: str = "<plan>") -> Prediction:
    """Price ``plan`` (default: the recorded configuration) on the recorded ``traces`` (one per rank)."""
    return Predictor(traces).predict(plan, plan_source)
