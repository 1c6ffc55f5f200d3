"""Predict step time and peak memory of a plan from recorded traces: the predictor's entry point.

Step time: each recorded step position is built into a global graph (all ranks joined through
their collectives) and replayed; the prediction is the median of the replayed steps. Peak memory:
the liveness model of each rank (`memory.py`); the prediction is the largest rank's peak.

A plan is priced as transforms of the recorded graph and liveness: per-layer precision
(`precision.py`) and per-op-type precision (`op_precision.py`, time only). A plan with decisions
this version cannot price yet (fused regions, activation policies) is refused with a
message naming them, never silently priced as if empty. Horovod's tensor fusion (``communication``:
fusion threshold and cycle time; ``buckets``: gradient groups) is priced by regrouping the recorded
all-reduces (`tensor_fusion.py`, time only) on traces with Horovod's timeline records; on others it
is refused, saying what is missing.
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
from qsync_callback.predictor.op_precision import apply_op_precision, check_op_precision_plan
from qsync_callback.predictor.precision import apply_precision, check_precision_plan, precision_lives
from qsync_callback.predictor.replay import replay
from qsync_callback.predictor.tensor_fusion import (
    AllreduceCost,
    apply_fusion,
    can_price_fusion,
    check_buckets,
    fit_allreduce_cost,
    fusion_correction_us,
)
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
            ("fused_regions", plan.fused_regions),
            ("activation", plan.activation),
        )
        if decisions
    ]
    if unpriced:
        raise QSyncInputError(
            f"{source}: this version prices precision plans only; "
            f"the plan's {', '.join(unpriced)} decisions cannot be priced yet"
        )
    if plan.buckets or plan.communication:
        reason = can_price_fusion(traces)
        if reason is not None:
            names = ", ".join(
                n for n, d in (("buckets", plan.buckets), ("communication", plan.communication)) if d
            )
            raise QSyncInputError(f"{source}: the plan's {names} decisions cannot be priced: {reason}")
    check_precision_plan(traces, plan.precision, source)
    check_op_precision_plan(traces, plan.op_precision, source)


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
        self._fusion: tuple[AllreduceCost, list[float]] | None = None  # fitted when first needed

    def predict(self, plan: Plan | None = None, plan_source: str = "<plan>") -> Prediction:
        """Price ``plan`` (default: the recorded configuration)."""
        precision: dict[str, str] = {}
        if plan is not None:
            check_plan(self.traces, plan, plan_source)
            precision = plan.precision
        graphs = [apply_precision(g, self.traces, precision) if precision else g for g in self._graphs]
        if plan is not None and plan.op_precision:
            graphs = [apply_op_precision(g, self.traces, plan.op_precision) for g in graphs]
        corrections = [0.0] * len(graphs)
        if plan is not None and (plan.buckets or plan.communication):
            graphs, corrections = self._apply_fusion(graphs, plan, plan_source)
        replays = [replay(g) for g in graphs]
        step_us = [r.step_us + c for r, c in zip(replays, corrections, strict=True)]
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

    @property
    def graphs(self) -> list[nx.DiGraph]:
        """The recorded steps' global graphs (do not change them: `predict` prices copies)."""
        return self._graphs

    def fusion_cost(self) -> AllreduceCost:
        """The all-reduce cost fitted on the recorded responses (once per predictor)."""
        return self._fused()[0]

    def _fused(self) -> tuple[AllreduceCost, list[float]]:
        if self._fusion is None:
            cost = fit_allreduce_cost(self._graphs, self.traces[0].world_size)
            settings = self.traces[0].communication
            self._fusion = (cost, [fusion_correction_us(g, cost, settings) for g in self._graphs])
        return self._fusion

    def _apply_fusion(
        self, graphs: Sequence[nx.DiGraph], plan: Plan, source: str
    ) -> tuple[list[nx.DiGraph], list[float]]:
        """The graphs regrouped by the plan's fusion settings (the recorded ones where it sets none)
        and buckets, and each recorded step's correction (`tensor_fusion.fusion_correction_us`)."""
        check_buckets(self._graphs[0], plan.buckets, source)
        cost, corrections = self._fused()
        settings = {**self.traces[0].communication, **plan.communication}
        threshold, cycle = int(settings["fusion_threshold_bytes"]), float(settings["cycle_time_ms"])
        return [apply_fusion(g, cost, threshold, cycle, plan.buckets) for g in graphs], corrections


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
