"""Price Horovod's tensor fusion: fusion threshold, cycle time and gradient groups, on a step graph.

The recorded step graph (`graph.py`) has one collective node per Horovod response, made of
``parts`` (the collective ops, each with its tensors, the ops on every rank that launched it and
those that waited for it). A plan's communication settings and buckets regroup the tensors into
new responses, modelled on Horovod's background loop (one per process, in lockstep through the
coordinator):

- a tensor is ready when its launching op has ended on every rank (times from a replay);
- a group (a plan bucket, or a recorded grouped op when the plan names none) is ready when its
  last tensor is; other tensors go alone, as Horovod does for the variables in no group;
- every cycle (``cycle_time_ms``; the first one half a cycle after the first ready tensor, the
  expected phase) the ready groups are packed, in order of readiness, into responses of at most
  ``fusion_threshold_bytes`` (0: no fusion; a larger tensor goes alone; the threshold splits a
  group that does not fit); responses run one after the other, and the next cycle starts a cycle
  after this one or when the last response ended, whichever is later;
- a response node waits for its tensors' launches and their consumers wait for it; its gap is the
  time the loop added after its last tensor was ready (the wait for the cycle, the decision-to-
  execution delay), its duration the fitted all-reduce cost.

Fitted from the recorded collectives (`fit_allreduce_cost`, every recorded step): the execution of
a response of ``b`` bytes costs ``alpha + beta * b`` microseconds (least squares over the
responses' spans in Horovod's timeline, for the traces' world size; with a single recorded size,
``alpha = 0`` and ``beta`` its mean per byte), and a response starts ``delay`` microseconds after
the coordinator's decision (median over the recorded tensors of the timeline's ``ALLREDUCE`` start
less its ``NEGOTIATE_ALLREDUCE`` end). Readiness comes from replaying the graph being transformed,
then once more from the transformed graph's replay. The model's own error on the recorded
settings is not taken out here (`fusion_correction_us` gives it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from qsync_callback.errors import QSyncInputError
from qsync_callback.predictor.replay import replay
from qsync_callback.recorder.trace import Trace

ALL_REDUCE = "all_reduce"
PASSES = 2  # readiness from the recorded graph, then from the first transformed graph


@dataclass
class AllreduceCost:
    """Fitted cost of one Horovod response (see the module docstring)."""

    alpha_us: float
    beta_us_per_byte: float
    delay_us: float
    world_size: int
    responses: int  # how many recorded responses it was fitted on

    def us(self, nbytes: int) -> float:
        return self.alpha_us + self.beta_us_per_byte * nbytes

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class CollectiveTensor:
    """One all-reduced tensor of a step graph and the recorded collective op it came from."""

    name: str
    variable: str | None
    bytes: int
    dtype: str | None
    part: dict  # the recorded part it came from (launch and consumer nodes)


def fusion_settings(traces: Sequence[Trace]) -> dict[str, Any]:
    """The recorded run's Horovod settings (``fusion_threshold_bytes``, ``cycle_time_ms``)."""
    return dict(traces[0].communication)


def can_price_fusion(traces: Sequence[Trace]) -> str | None:
    """None if the traces have what pricing fusion needs, otherwise why not."""
    comm = traces[0].communication
    if comm.get("library") != "horovod":
        return "only Horovod's tensor fusion can be priced (the traces record no Horovod settings)"
    if len(traces) < 2:
        return "a single process all-reduces nothing"
    tensors = [
        t
        for trace in traces
        for op in trace.ops
        if op.kind == "comm" and op.collective
        for t in op.collective.get("tensors", [])
    ]
    if not any(t.get("timeline") for t in tensors):
        return "the traces have no collective records from Horovod's timeline"
    if any(t.get("bytes") is None for t in tensors):
        return "some all-reduced tensors have no known size"
    return None


def collective_names(graph: nx.DiGraph) -> set[str]:
    """Names a plan's bucket may use: every all-reduced tensor's name and variable."""
    return {n for t in _tensors(graph) for n in (t.name, t.variable) if n}


def _comm_nodes(graph: nx.DiGraph) -> list[str]:
    return [
        n
        for n, a in graph.nodes(data=True)
        if a["kind"] == "comm" and a.get("parts") and (a["collective"] or {}).get("op") == ALL_REDUCE
    ]


def _tensors(graph: nx.DiGraph) -> list[CollectiveTensor]:
    out = []
    for node in _comm_nodes(graph):
        for part in graph.nodes[node]["parts"]:
            for t in part["tensors"]:
                out.append(
                    CollectiveTensor(
                        t["name"], t.get("variable"), int(t.get("bytes") or 0), t.get("dtype"), part
                    )
                )
    return out


def collective_tensors(graph: nx.DiGraph, ends: Mapping[str, float]) -> list[CollectiveTensor]:
    """The all-reduced tensors of ``graph``, in order of readiness by the replayed ``ends``."""
    return sorted(_tensors(graph), key=lambda t: max((ends[n] for n in t.part["launch"]), default=0.0))


def fit_allreduce_cost(graphs: Sequence[nx.DiGraph], world_size: int) -> AllreduceCost:
    """Fit the response cost on the recorded responses of ``graphs`` (see the module docstring);
    QSyncInputError if none was recorded with Horovod's timeline."""
    sizes, durations, delays = [], [], []
    for graph in graphs:
        for node in _comm_nodes(graph):
            tensors = [t for p in graph.nodes[node]["parts"] for t in p["tensors"]]
            records = [t["timeline"] for t in tensors if t.get("timeline")]
            if not records or len(records) != len(tensors):
                continue
            sizes.append(sum(int(t.get("bytes") or 0) for t in tensors))
            durations.append(graph.nodes[node]["dur"])
            delays.extend(r["op_us"][0] - r["negotiate_us"][1] for r in records if r.get("negotiate_us"))
    if not sizes:
        raise QSyncInputError("no recorded Horovod response to fit the all-reduce cost on")
    x, y = np.array(sizes, float), np.array(durations, float)
    if len(set(sizes)) >= 2:
        beta, alpha = np.polyfit(x, y, 1)
        if beta < 0:
            alpha, beta = float(y.mean()), 0.0
        elif alpha < 0:
            alpha, beta = 0.0, float((x @ y) / (x @ x))
    else:
        alpha, beta = 0.0, float(y.sum() / max(x.sum(), 1.0))
    delay = max(0.0, statistics.median(delays)) if delays else 0.0
    return AllreduceCost(float(alpha), float(beta), delay, world_size, len(sizes))


def check_buckets(graph: nx.DiGraph, buckets: Sequence[Sequence[str]], source: str) -> None:
    """QSyncInputError if a bucket names no all-reduced tensor or variable, or one twice."""
    known = collective_names(graph)
    seen: set[str] = set()
    for bucket in buckets:
        for name in bucket:
            if name not in known:
                raise QSyncInputError(f"{source}: bucket entry {name!r} is not an all-reduced gradient")
            if name in seen:
                raise QSyncInputError(f"{source}: {name!r} is in more than one bucket")
            seen.add(name)


def apply_fusion(
    graph: nx.DiGraph,
    cost: AllreduceCost,
    threshold_bytes: int,
    cycle_ms: float,
    buckets: Sequence[Sequence[str]] = (),
) -> nx.DiGraph:
    """A copy of ``graph`` with its all-reduces regrouped into the responses Horovod would form
    with these settings and buckets (see the module docstring)."""
    out = graph
    for _ in range(PASSES):
        out = _regroup(graph, replay(out).end, cost, threshold_bytes, cycle_ms * 1e3, buckets)
    return out


def _groups(
    tensors: list[CollectiveTensor], buckets: Sequence[Sequence[str]]
) -> list[list[CollectiveTensor]]:
    """The units Horovod negotiates: the buckets' tensors (in bucket order), then every other tensor
    alone; with no buckets, the recorded collective ops."""
    if not buckets:
        by_part: dict[int, list[CollectiveTensor]] = {}
        for t in tensors:
            by_part.setdefault(id(t.part), []).append(t)
        return list(by_part.values())
    index = {n: t for t in tensors for n in (t.name, t.variable) if n}
    groups = [[index[n] for n in bucket] for bucket in buckets]
    grouped = {id(t) for g in groups for t in g}
    return groups + [[t] for t in tensors if id(t) not in grouped]


def _regroup(
    graph: nx.DiGraph,
    ends: Mapping[str, float],
    cost: AllreduceCost,
    threshold: int,
    cycle_us: float,
    buckets: Sequence[Sequence[str]],
) -> nx.DiGraph:
    tensors = _tensors(graph)
    if not tensors:
        return graph.copy()

    def ready_of(t: CollectiveTensor) -> float:
        return max((ends[n] for n in t.part["launch"] if n in ends), default=0.0)

    groups = sorted(_groups(tensors, buckets), key=lambda g: max(ready_of(t) for t in g))
    responses = _simulate(groups, ready_of, cost, threshold, cycle_us)
    out = graph.copy()
    out.remove_nodes_from(_comm_nodes(graph))
    previous = None
    upstream: set[str] = set()  # ops the responses so far wait for, directly or not
    for k, (members, gap) in enumerate(responses):
        node = f"comm/fused{k}"
        nbytes = sum(t.bytes for t in members)
        launch = sorted({n for t in members for n in t.part["launch"]})
        for n in launch:
            if n not in upstream:
                upstream |= nx.ancestors(out, n) | {n}
        # a recorded waiter that runs before a launch of this (later, larger) response cannot wait for
        # it: the recorded waiter was found by time, for the recorded grouping
        consumers = sorted({n for t in members for n in t.part["consumers"]} - upstream)
        part = {
            "key": node,
            "tensors": [
                {"name": t.name, "variable": t.variable, "bytes": t.bytes, "dtype": t.dtype} for t in members
            ],
            "launch": launch,
            "consumers": consumers,
        }
        out.add_node(
            node,
            name=f"fused all-reduce {k} ({len(members)} tensors)",
            kind="comm",
            queue="comm",
            dur=cost.us(nbytes),
            gap=gap,
            rank=None,
            layer=None,
            bytes=nbytes,
            collective={"op": ALL_REDUCE, "bytes": nbytes, "tensors": part["tensors"]},
            parts=[part],
            op_id=None,
        )
        for n in launch:
            out.add_edge(n, node, kind="dep")
        for n in consumers:
            out.add_edge(node, n, kind="dep")
        if previous is not None:
            out.add_edge(previous, node, kind="order")
        previous = node
    return out


def _simulate(
    groups: list[list[CollectiveTensor]],
    ready_of: Any,
    cost: AllreduceCost,
    threshold: int,
    cycle_us: float,
) -> list[tuple[list[CollectiveTensor], float]]:
    """Horovod's loop over ``groups`` (sorted by readiness): the responses in execution order, each
    with the time the loop added after it could have started (its gap)."""
    ready = [max(ready_of(t) for t in g) for g in groups]
    pending = list(range(len(groups)))
    tick = ready[0] + cycle_us / 2
    loop_free = -math.inf  # when the previous response ended
    out: list[tuple[list[CollectiveTensor], float]] = []
    while pending:
        batch = [i for i in pending if ready[i] <= tick]
        if not batch:
            waits = math.ceil((ready[pending[0]] - tick) / cycle_us) if cycle_us > 0 else 0
            tick = max(tick + waits * cycle_us, ready[pending[0]])
            continue
        pending = [i for i in pending if i not in batch]
        start = max(tick + cost.delay_us, loop_free)
        for members in _pack([t for i in batch for t in groups[i]], threshold):
            earliest = max(max(ready_of(t) for t in members), loop_free)
            out.append((members, max(0.0, start - earliest)))
            loop_free = start + cost.us(sum(t.bytes for t in members))
            start = loop_free
        tick = max(tick + cycle_us, loop_free) if cycle_us > 0 else max(loop_free, tick)
    return out


def _pack(tensors: list[CollectiveTensor], threshold: int) -> list[list[CollectiveTensor]]:
    """Consecutive tensors of one dtype fused while their bytes fit the threshold."""
    responses: list[list[CollectiveTensor]] = []
    size = 0
    for t in tensors:
        current = responses[-1] if responses else None
        fits = current is not None and size + t.bytes <= threshold and current[0].dtype == t.dtype
        if fits:
            current.append(t)
            size += t.bytes
        else:
            responses.append([t])
            size = t.bytes
    return responses


def fusion_correction_us(graph: nx.DiGraph, cost: AllreduceCost, settings: Mapping[str, Any]) -> float:
    """The recorded graph's replayed step time less the model's for the recorded settings: what
    the model misses on this step (added to a plan's step time, so that plans are priced by the
    difference the model sees)."""
    modelled = apply_fusion(
        graph, cost, int(settings["fusion_threshold_bytes"]), float(settings["cycle_time_ms"])
    )
    return replay(graph).step_us - replay(modelled).step_us
