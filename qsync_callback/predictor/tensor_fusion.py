"""Price tensor fusion on a step graph: Horovod's fusion threshold, cycle time and gradient groups,
and DDP's gradient buckets.

The recorded step graph (`graph.py`) has one collective node per Horovod response, made of
``parts`` (the collective ops, each with its tensors, the ops on every rank that launched it and
those that waited for it). A plan's communication settings and buckets regroup the tensors into
new responses, modelled on Horovod's background loop (one per process, in lockstep through the
coordinator):

- a tensor is ready when its launching op has ended on every rank (times from a replay);
- a group (a plan bucket, or a recorded grouped op when the plan names none) is ready when its
  last tensor is; other tensors go alone, as Horovod does for the variables in no group;
- every cycle (``cycle_time_ms``; the first one a ``phase`` of a cycle after the first ready
  tensor) the ready groups are packed, in order of readiness, into responses of at most
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

DDP (`recorder/ddp_buckets.py`) has no background loop: its reducer all-reduces bucket k as soon as
the bucket's last gradient is ready and bucket k-1 was launched, so a DDP grouping is priced with
``in_order``: each bucket is one response, in bucket order, with no cycle, threshold or delay. A
gradient is ready when the last backward op of the layer that owns its parameter has ended on
every rank (its ``AccumulateGrad`` is one of them); a gradient of no recorded layer is ready when
its recorded bucket was launched. Every bucket is waited for by the recorded waiters after backward
(DDP's finalize copies the buckets back into the gradients in order before the optimizer runs, and
which copy goes with which new bucket is not recorded; a recorded waiter inside backward is where
the training thread stalled beside the all-reduce on a shared core, not a use of its result). The
buckets' all-reduce cost has no delay. Its ``alpha + beta * b`` is fitted on the all-reduces the
recorder timed alone at several sizes (``allreduce_us``, averaged over the ranks; in relative error:
the sizes span 4 KiB to 16 MiB, and a fit in absolute error follows the largest alone, whose noise
then sets ``alpha``, at times to below 0): the recorded
buckets are one or two sizes and cannot tell a per-collective cost from a per-byte one (with a single
size the fit has no ``alpha``, and every split looks free). The recorded buckets (each node's span,
from the last rank's launch to the first rank's wait) then set ``beta`` where they cost more per
byte than alone: on a CPU they run beside backward and share its cores. Without a timing alone, the
recorded buckets are fitted as Horovod's responses are.

On a CPU the all-reduces do not overlap backward for free: gloo reduces on the cores that run
backward, so the part of each all-reduce that the replay runs beside backward ops is added to the
step (`shared_core_us`), in a plan's figure and in the correction alike. A GPU's collectives run
beside its kernels and are not charged.
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
from qsync_callback.plan import holds
from qsync_callback.predictor.graph import ALL_REDUCE, is_all_reduce
from qsync_callback.predictor.replay import CompiledGraph, replay
from qsync_callback.recorder.trace import Trace

HOROVOD, DDP = "horovod", "ddp"  # the collective libraries whose fusion is priced
PASSES = 2  # readiness from the recorded graph, then from the first transformed graph
# Horovod's loop ticks at a phase the step does not set, so whether a tensor made ready just before a
# tick waits a whole cycle is a draw: a plan is priced at each of these phases of the first cycle
# and its step is their mean (`predict.Predictor`), at the middle one alone the step would jump by
# up to a cycle as a plan moves a tensor's readiness across a tick
CYCLE_PHASES = (0.0, 0.25, 0.5, 0.75)
MIDDLE_PHASE = 0.5


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
    launch: tuple[str, ...]  # the nodes whose end makes it ready (its layer's or its part's launch)


def can_price_fusion(traces: Sequence[Trace]) -> str | None:
    """None if the traces have what pricing fusion needs, otherwise why not."""
    library = traces[0].communication.get("library")
    if library not in (HOROVOD, DDP):
        return (
            "only Horovod's tensor fusion and DDP's buckets can be priced (the traces record neither "
            "Horovod's settings nor DDP's buckets)"
        )
    if len(traces) < 2:
        return "a single process all-reduces nothing"
    tensors = [
        t
        for trace in traces
        for op in trace.ops
        if op.kind == "comm" and op.collective
        for t in op.collective.get("tensors", [])
    ]
    if library == DDP and not tensors:
        return "no recorded all-reduce carried one of DDP's buckets"
    if library == HOROVOD and not any(t.get("timeline") for t in tensors):
        return "the traces have no collective records from Horovod's timeline"
    if any(t.get("bytes") is None for t in tensors):
        return "some all-reduced tensors have no known size"
    return None


def collective_names(graph: nx.DiGraph) -> set[str]:
    """Names a plan's bucket may use: every all-reduced tensor's name and variable."""
    return {n for t in _tensors(graph) for n in (t.name, t.variable) if n}


def all_reduces(graph: nx.DiGraph) -> list[str]:
    """The step's all-reduce nodes (those that carry tensors)."""
    return [n for n, a in graph.nodes(data=True) if is_all_reduce(a)]


def _tensors(graph: nx.DiGraph) -> list[CollectiveTensor]:
    out = []
    last_backward = _last_backward(graph)
    for node in all_reduces(graph):
        for part in graph.nodes[node]["parts"]:
            for t in part["tensors"]:
                ranks = {graph.nodes[n]["rank"] for n in part["launch"]}
                own = tuple(
                    sorted(
                        last_backward[(t["layer"], r)] for r in ranks if (t.get("layer"), r) in last_backward
                    )
                )
                launch = own if own and len(own) == len(ranks) else tuple(part["launch"])
                out.append(
                    CollectiveTensor(
                        t["name"], t.get("variable"), int(t.get("bytes") or 0), t.get("dtype"), part, launch
                    )
                )
    return out


def _last_backward(graph: nx.DiGraph) -> dict[tuple[str, int], str]:
    """The op after which each (layer, rank)'s gradients are ready: its last recorded backward op or,
    for a layer inside a compiled region (the ops `compiled_regions.apply_regions` marks with their
    ``region``), the region's last backward op where that is later. A compiled region's backward is
    one graph: its parameters' gradients all come out at its end."""

    def later(node: str, than: str | None) -> bool:
        return than is None or graph.nodes[node]["recorded_start"] > graph.nodes[than]["recorded_start"]

    out: dict[tuple[str, int], str] = {}
    region_ends: dict[tuple[str, int], str] = {}
    for node, attrs in graph.nodes(data=True):
        if attrs["kind"] != "backward":
            continue
        layer, region, rank = attrs["layer"], attrs.get("region"), attrs["rank"]
        if layer is not None and later(node, out.get((layer, rank))):
            out[layer, rank] = node
        if region is not None and later(node, region_ends.get((region, rank))):
            region_ends[region, rank] = node
    for (layer, rank), node in out.items():
        for (region, r), end in region_ends.items():
            if r == rank and holds(region, layer) and later(end, node):
                out[layer, rank] = end
    return out


def collective_tensors(graph: nx.DiGraph, ends: Mapping[str, float]) -> list[CollectiveTensor]:
    """The all-reduced tensors of ``graph``, in order of readiness by the replayed ``ends``."""
    return sorted(_tensors(graph), key=lambda t: max((ends[n] for n in t.launch), default=0.0))


def fit_allreduce_cost(
    graphs: Sequence[nx.DiGraph],
    world_size: int,
    library: str = HOROVOD,
    alone: Sequence[Mapping[str, Sequence[float]]] = (),
) -> AllreduceCost:
    """Fit the response cost on the recorded responses of ``graphs`` (see the module docstring),
    or, given each rank's all-reduces timed alone (``alone``: DDP's ``allreduce_us``), on those with
    the recorded ones' per-byte cost where it is higher; QSyncInputError if none was recorded
    (Horovod: with its timeline)."""
    sizes, durations, delays = [], [], []
    for graph in graphs:
        for node in all_reduces(graph):
            tensors = [t for p in graph.nodes[node]["parts"] for t in p["tensors"]]
            records = [t["timeline"] for t in tensors if t.get("timeline")]
            if not tensors or (library == HOROVOD and len(records) != len(tensors)):
                continue
            sizes.append(sum(int(t.get("bytes") or 0) for t in tensors))
            durations.append(graph.nodes[node]["dur"])
            delays.extend(r["op_us"][0] - r["negotiate_us"][1] for r in records if r.get("negotiate_us"))
    if not sizes:
        what = "Horovod response" if library == HOROVOD else "bucket all-reduce"
        raise QSyncInputError(f"no recorded {what} to fit the all-reduce cost on")
    x, y = np.array(sizes, float), np.array(durations, float)
    if alone:
        timed = np.mean([a["us"] for a in alone], axis=0)
        alpha, beta = _line(np.array(alone[0]["bytes"], float), timed, weights=1.0 / np.maximum(timed, 1e-9))
        beside = float(((y - alpha) @ x) / (x @ x)) if x @ x > 0 else 0.0
        return AllreduceCost(alpha, max(beta, beside), 0.0, world_size, len(sizes))
    if len(set(sizes)) >= 2:
        alpha, beta = _line(x, y)
    else:
        alpha, beta = 0.0, float(y.sum() / max(x.sum(), 1.0))
    delay = max(0.0, statistics.median(delays)) if delays else 0.0
    return AllreduceCost(float(alpha), float(beta), delay, world_size, len(sizes))


def _line(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> tuple[float, float]:
    """``alpha + beta * x`` by least squares, each residual times its weight, neither below 0."""
    beta, alpha = np.polyfit(x, y, 1, w=weights)
    if beta < 0:
        return float(y.mean()), 0.0
    if alpha < 0:
        return 0.0, float((x @ y) / (x @ x))
    return float(alpha), float(beta)


def check_buckets(
    graph: nx.DiGraph, buckets: Sequence[Sequence[str]], source: str, complete: bool = False
) -> None:
    """QSyncInputError if a bucket names no all-reduced tensor or variable, or one twice; with
    ``complete`` (DDP's buckets), also if a bucket is empty or a gradient is in none."""
    known = collective_names(graph)
    seen: set[str] = set()
    for bucket in buckets:
        if complete and not bucket:
            raise QSyncInputError(f"{source}: an empty bucket")
        for name in bucket:
            if name not in known:
                raise QSyncInputError(f"{source}: bucket entry {name!r} is not an all-reduced gradient")
            if name in seen:
                raise QSyncInputError(f"{source}: {name!r} is in more than one bucket")
            seen.add(name)
    missing = sorted(t.name for t in _tensors(graph) if t.name not in seen) if complete and buckets else []
    if missing:
        raise QSyncInputError(
            f"{source}: DDP all-reduces every gradient in some bucket; in none: {', '.join(missing)}"
        )


def apply_fusion(
    graph: nx.DiGraph,
    cost: AllreduceCost,
    threshold_bytes: int,
    cycle_ms: float,
    buckets: Sequence[Sequence[str]] = (),
    in_order: bool = False,
    ends: Mapping[str, float] | None = None,
    phase: float = MIDDLE_PHASE,
) -> nx.DiGraph:
    """A copy of ``graph`` with its all-reduces regrouped into the responses Horovod would form
    with these settings and buckets, its loop's first tick ``phase`` of a cycle after the first
    ready tensor, or, ``in_order``, into DDP's buckets, one response each in their order (see the
    module docstring). ``ends``: ``graph``'s replayed end times, where the caller has them (the
    first pass replays ``graph`` otherwise)."""
    out = graph
    # DDP's buckets are waited for after backward, so regrouping them moves no backward op: the
    # recorded graph's readiness is the transformed graph's, and one pass is enough
    for k in range(1 if in_order else PASSES):
        replayed = ends if k == 0 and ends is not None else replay(out).end
        out = _regroup(graph, replayed, cost, threshold_bytes, cycle_ms * 1e3, buckets, in_order, phase)
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
    in_order: bool,
    phase: float,
) -> nx.DiGraph:
    tensors = _tensors(graph)
    if not tensors:
        return graph.copy()

    def ready_of(t: CollectiveTensor) -> float:
        return max((ends[n] for n in t.launch if n in ends), default=0.0)

    if in_order:
        responses = [(group, 0.0) for group in _groups(tensors, buckets)]
        recorded_waiters = {n for t in tensors for n in t.part["consumers"]}
        every_waiter = {
            n for n in recorded_waiters if graph.nodes[n]["kind"] != "backward"
        } or recorded_waiters
    else:
        groups = sorted(_groups(tensors, buckets), key=lambda g: max(ready_of(t) for t in g))
        responses = _simulate(groups, ready_of, cost, threshold, cycle_us, phase)
    out = graph.copy()
    out.remove_nodes_from(all_reduces(graph))
    previous = None
    upstream: set[str] = set()  # ops the responses so far wait for, directly or not
    for k, (members, gap) in enumerate(responses):
        node = f"comm/fused{k}"
        nbytes = sum(t.bytes for t in members)
        launch = sorted({n for t in members for n in t.launch})
        _add_ancestors(out, launch, upstream)
        # a recorded waiter that runs before a launch of this (later, larger) response cannot wait for
        # it: the recorded waiter was found by time, for the recorded grouping
        waiters = every_waiter if in_order else {n for t in members for n in t.part["consumers"]}
        consumers = sorted(waiters - upstream)
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


def _add_ancestors(graph: nx.DiGraph, nodes: Sequence[str], seen: set[str]) -> None:
    """Add ``nodes`` and their ancestors to ``seen``, which holds the ancestors of each of its
    nodes already: a walk stops at a node seen, so that all the responses' walks together visit
    each node once."""
    stack = [n for n in nodes if n not in seen]
    seen.update(stack)
    while stack:
        for p in graph.predecessors(stack.pop()):
            if p not in seen:
                seen.add(p)
                stack.append(p)


def _simulate(
    groups: list[list[CollectiveTensor]],
    ready_of: Any,
    cost: AllreduceCost,
    threshold: int,
    cycle_us: float,
    phase: float,
) -> list[tuple[list[CollectiveTensor], float]]:
    """Horovod's loop over ``groups`` (sorted by readiness), its first tick ``phase`` of a cycle
    after the first group is ready: the responses in execution order, each with the time the loop
    added after it could have started (its gap)."""
    ready = [max(ready_of(t) for t in g) for g in groups]
    pending = list(range(len(groups)))
    tick = ready[0] + cycle_us * phase
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


def regroup(
    graph: nx.DiGraph,
    cost: AllreduceCost,
    settings: Mapping[str, Any],
    buckets: Sequence[Sequence[str]] = (),
    ends: Mapping[str, float] | None = None,
    phase: float = MIDDLE_PHASE,
) -> nx.DiGraph:
    """`apply_fusion` as the recorded library does it: Horovod with ``settings``' fusion threshold
    and cycle time (a run's recorded ones, with a plan's on top), its loop at ``phase``; DDP in
    bucket order."""
    if settings.get("library") == DDP:
        return apply_fusion(graph, cost, 0, 0.0, buckets, in_order=True, ends=ends)
    threshold, cycle = int(settings["fusion_threshold_bytes"]), float(settings["cycle_time_ms"])
    return apply_fusion(graph, cost, threshold, cycle, buckets, ends=ends, phase=phase)


def loop_phases(settings: Mapping[str, Any]) -> tuple[float, ...]:
    """The phases of the first cycle a plan with ``settings`` is priced at: `CYCLE_PHASES` for
    Horovod's loop with a cycle, the middle one alone where no loop ticks (DDP, a cycle of 0)."""
    if settings.get("library") == DDP or float(settings.get("cycle_time_ms") or 0.0) <= 0.0:
        return (MIDDLE_PHASE,)
    return CYCLE_PHASES


def shared_core_us(graph: nx.DiGraph, compiled: CompiledGraph | None = None) -> float:
    """How long the replayed step's all-reduces run beside its backward ops (between each one's
    start and the end of the last backward op): on a CPU, compute time they take from backward.
    ``compiled``: ``graph`` compiled already, where the caller has it."""
    compiled = compiled or CompiledGraph(graph)
    timing = compiled.run()
    backward = [i for i, kind in enumerate(compiled.kinds) if kind == "backward"]
    if not backward:
        return 0.0
    last = float(timing.end[backward].max())
    spans = (compiled.index[n] for n in all_reduces(graph))
    return sum(max(0.0, min(float(timing.end[i]), last) - float(timing.start[i])) for i in spans)


def fusion_correction_us(
    graph: nx.DiGraph,
    cost: AllreduceCost,
    settings: Mapping[str, Any],
    shared_cores: bool = False,
    compiled: CompiledGraph | None = None,
    phase: float = MIDDLE_PHASE,
) -> float:
    """The recorded graph's replayed step time less the model's for the recorded settings (its
    loop at ``phase``): what the model misses on this step (added to a plan's step time, so that
    plans are priced by the difference the model sees); ``shared_cores``: the model's step includes
    `shared_core_us`. ``compiled``: ``graph`` compiled already, where the caller has it."""
    compiled = compiled or CompiledGraph(graph)
    recorded = compiled.run()
    modelled = regroup(graph, cost, settings, ends=compiled.end_times(recorded), phase=phase)
    priced = CompiledGraph(modelled)
    charged = shared_core_us(modelled, priced) if shared_cores else 0.0
    return recorded.step_us - priced.run().step_us - charged
