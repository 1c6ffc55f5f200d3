"""Build the data-flow graph of one recorded step: per rank, and globally across ranks.

Nodes are ops (``"r<rank>/<op id>"``), one start and one end sentinel per rank
(``"r<rank>/start"``, ``"r<rank>/end"``), and, in the global graph, one node per collective
(``"comm/<k>"``) that stands for one collective of the step on every rank: the k-th (by time), or,
where every rank names its collectives uniquely (Horovod: the op's name), the one of that name; and
where Horovod's timeline says which tensors were fused into one response, one node per response.
A collective node's ``parts`` list what it was made of, one entry per joined collective op:
``{"key", "tensors", "launch": [nodes], "consumers": [nodes]}`` (the ops on every rank that it
waited for and that waited for it), so that a what-if can regroup them (`tensor_fusion.py`).
Node attributes:

- ``queue``: where it runs, ``"r<rank>/<thread>"``; ops on one queue run one at a time, in order;
- ``dur``: microseconds, the recorded duration less the profiler's own share (`Trace.own_us`);
- ``gap``: microseconds the queue sat idle before the op once everything it waits for was done
  (host work between ops: Python, the dispatcher), less the profiler's share;
- ``kind``, ``name``, ``layer``, ``module`` (the innermost module that ran it: `Op`), ``rank``,
  ``bytes``, ``collective``, ``op_id``, and ``shapes`` and ``dtypes`` (its inputs', as recorded);
- ``region``, on a plan's graph only: the compiled region a backward op is part of
  (`compiled_regions.apply_regions`).

Edges: queue order (``kind="order"``) and waits across queues (``kind="dep"``): a collective waits
for the op that launched it, the op that consumes a collective waits for it, and a rank's step end
waits for the last op of each compute thread ("main", and the ``tid:*`` threads where TensorFlow's
executor runs the ops) that ended within the step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import networkx as nx

from qsync_callback.recorder.horovod_timeline import tensor_key
from qsync_callback.recorder.trace import Op, Trace, clock_offsets_us

ALL_REDUCE = "all_reduce"  # a collective's ``op`` (`recorder/trace.py`)


def is_all_reduce(attrs: Mapping[str, Any]) -> bool:
    """Whether a node (its attributes) is an all-reduce that carries tensors."""
    collective = attrs.get("collective") or {}
    return attrs["kind"] == "comm" and bool(attrs.get("parts")) and collective.get("op") == ALL_REDUCE


def start_node(rank: int) -> str:
    return f"r{rank}/start"


def end_node(rank: int) -> str:
    return f"r{rank}/end"


def op_node(rank: int, op_id: int) -> str:
    return f"r{rank}/{op_id}"


def _add_sentinels(graph: nx.DiGraph, rank: int) -> None:
    common = {
        "dur": 0.0,
        "gap": 0.0,
        "queue": f"r{rank}/main",
        "rank": rank,
        "layer": None,
        "bytes": 0,
        "collective": None,
        "op_id": None,
    }
    graph.add_node(start_node(rank), name="step start", kind="sentinel", **common)
    graph.add_node(end_node(rank), name="step end", kind="sentinel", **common)


def _is_compute(thread: str) -> bool:
    """The training thread, or another host thread running ops (TF's executor threads)."""
    return thread == "main" or thread.startswith("tid:")


def _add_rank(graph: nx.DiGraph, trace: Trace, step_index: int, offset_us: float) -> dict[str, float]:
    """Add one rank's step to ``graph``; return recorded (aligned) start and end times by node."""
    rank = trace.rank
    step = next(s for s in trace.steps if s.index == step_index)
    ops = [op for op in trace.ops if op.step == step_index]
    _add_sentinels(graph, rank)
    times = {start_node(rank): (step.start_us + offset_us, step.start_us + offset_us)}
    by_queue: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        node = op_node(rank, op.id)
        graph.add_node(
            node,
            name=op.name,
            kind=op.kind,
            queue=f"r{rank}/{op.thread}",
            dur=trace.own_us(op),
            gap_overhead=trace.gap_overhead_us(op),
            gap_kept=trace.gap_kept(op),
            rank=rank,
            layer=op.layer,
            module=op.module,
            shapes=op.input_shapes,
            dtypes=op.input_dtypes,
            bytes=op.bytes,
            collective=op.collective,
            op_id=op.id,
        )
        times[node] = (op.start_us + offset_us, op.end_us + offset_us)
        by_queue[op.thread].append(op)
    for thread, queue_ops in by_queue.items():
        queue_ops.sort(key=lambda o: o.start_us)
        for a, b in zip(queue_ops, queue_ops[1:], strict=False):
            graph.add_edge(op_node(rank, a.id), op_node(rank, b.id), kind="order")
        first = op_node(rank, queue_ops[0].id)
        if thread == "main" or not queue_ops[0].deps:
            graph.add_edge(start_node(rank), first, kind="order")
    ids = {op.id for op in ops}
    for op in ops:
        for dep in op.deps:
            if dep in ids:
                graph.add_edge(op_node(rank, dep), op_node(rank, op.id), kind="dep")
    # the step ends after the last op of every compute thread it waited for (one that ended in it)
    waited = [q[-1] for thread, q in by_queue.items() if _is_compute(thread) and q[-1].end_us <= step.end_us]
    for last in waited:
        kind = "order" if last.thread == "main" else "dep"
        graph.add_edge(op_node(rank, last.id), end_node(rank), kind=kind)
    if not waited:
        graph.add_edge(start_node(rank), end_node(rank), kind="order")
    times[end_node(rank)] = (step.end_us + offset_us, step.end_us + offset_us)
    return times


def _set_gaps(graph: nx.DiGraph, times: dict[str, tuple[float, float]]) -> None:
    """gap = recorded start - latest recorded end among its predecessors, less profiler overhead
    (``gap_overhead``, then the share ``gap_kept`` of the rest: `Trace.gap_kept`)."""
    for node in graph.nodes:
        preds = list(graph.predecessors(node))
        start = times[node][0]
        ready = max((times[p][1] for p in preds), default=start)
        attrs = graph.nodes[node]
        attrs["gap"] = max(0.0, start - ready - attrs.pop("gap_overhead", 0.0)) * attrs.pop("gap_kept", 1.0)
        attrs["recorded_start"] = start


def build_step_graph(trace: Trace, step_index: int) -> nx.DiGraph:
    """The data-flow graph of one rank's recorded step (collectives kept per rank)."""
    graph = nx.DiGraph(step=step_index, ranks=[trace.rank])
    times = _add_rank(graph, trace, step_index, 0.0)
    _set_gaps(graph, times)
    return graph


def build_global_graph(traces: Sequence[Trace], step_position: int) -> nx.DiGraph:
    """The step at ``step_position`` (0 = first recorded) of every rank, joined by collectives.

    A collective node starts when the last rank has launched it and ends when the first rank saw it
    complete (times on the common clock), or spans the response's execution in Horovod's timeline;
    every rank's launching op precedes it and every rank's waiting op follows it. The collective
    nodes form one queue, in order of their start.
    """
    if len(traces) == 1:
        return build_step_graph(traces[0], traces[0].steps[step_position].index)
    graph = nx.DiGraph(step=step_position, ranks=[t.rank for t in traces])
    times: dict[str, tuple[float, float]] = {}
    per_rank_comms: list[list[str]] = []
    offsets = clock_offsets_us(traces)
    for trace, offset in zip(traces, offsets, strict=True):
        step_index = trace.steps[step_position].index
        times.update(_add_rank(graph, trace, step_index, offset))
        comms = sorted(
            (n for n, a in graph.nodes(data=True) if a["rank"] == trace.rank and a["kind"] == "comm"),
            key=lambda n: times[n][0],
        )
        per_rank_comms.append(comms)
    joined = _join_ranks(graph, per_rank_comms)
    merged = []
    for k, (members, span) in enumerate(_by_response(graph, joined, offsets)):
        merged.append(_merge_collective(graph, times, f"comm/{k}", members, span))
    merged.sort(key=lambda n: times[n][0])
    for a, b in zip(merged, merged[1:], strict=False):
        graph.add_edge(a, b, kind="order")
    _set_gaps(graph, times)
    return graph


def _join_ranks(graph: nx.DiGraph, per_rank_comms: list[list[str]]) -> list[list[str]]:
    """Each collective's node on every rank: by name (and first tensor, where the op names its
    tensors: DDP's buckets) where every rank has the same names, the j-th of a repeated name with
    the j-th (by start time); otherwise the k-th of each rank (by start time). Gloo runs collectives
    on two threads, so the k-th to start need not be the same collective on every rank."""
    keys = [[_join_key(graph.nodes[n]) for n in comms] for comms in per_rank_comms]
    keys = [[(key, k[:i].count(key)) for i, key in enumerate(k)] for k in keys]  # the j-th of each name
    if all(set(k) == set(keys[0]) and len(k) == len(keys[0]) for k in keys):
        by_key = [dict(zip(k, comms, strict=True)) for k, comms in zip(keys, per_rank_comms, strict=True)]
        return [[nodes[key] for nodes in by_key] for key in keys[0]]
    count = min(len(c) for c in per_rank_comms)
    return [[comms[k] for comms in per_rank_comms] for k in range(count)]


def _join_key(attrs: dict) -> tuple[str, str | None]:
    tensors = _tensors(attrs)
    return tensor_key(attrs["name"]), tensors[0]["name"] if tensors else None


def _by_response(
    graph: nx.DiGraph, joined: list[list[str]], offsets: Sequence[float]
) -> list[tuple[list[list[str]], tuple[float, float] | None]]:
    """Joined collectives grouped by the Horovod response that carried them (from the timeline's
    records on some rank's nodes), with the response's execution span on the common clock; a
    collective with no record is a group of its own, with no span."""
    groups: dict[int, tuple[list[list[str]], list[float]]] = {}
    out: list[tuple[list[list[str]], tuple[float, float] | None]] = []
    for members in joined:
        record = None
        for node in members:
            records = [t["timeline"] for t in _tensors(graph.nodes[node]) if t.get("timeline")]
            if records:
                offset = offsets[graph.graph["ranks"].index(graph.nodes[node]["rank"])]
                record = (records[0]["response"], [r["op_us"][i] + offset for r in records for i in (0, 1)])
                break
        if record is None:
            out.append(([members], None))
            continue
        response, bounds = record
        if response not in groups:
            groups[response] = ([], [])
            out.append((groups[response][0], None))
        groups[response][0].append(members)
        groups[response][1].extend(bounds)
    spans = {id(g[0]): (min(g[1]), max(g[1])) for g in groups.values()}
    return [(members, spans.get(id(members), span)) for members, span in out]


def _merge_collective(
    graph: nx.DiGraph,
    times: dict[str, tuple[float, float]],
    merged: str,
    joined: list[list[str]],
    span: tuple[float, float] | None,
) -> str:
    """Replace the nodes of ``joined`` (collective ops, each on every rank) by one node ``merged``
    that waits for all their launches and that all their consumers wait for."""
    nodes = [n for members in joined for n in members]
    if span is None:
        start = max(times[m][0] for m in nodes)
        span = (start, max(start, min(times[m][1] for m in nodes)))
    parts = []
    for members in joined:
        attrs = [graph.nodes[m] for m in members]
        tensors = next((a["collective"]["tensors"] for a in attrs if _tensors(a)), [])
        launch = {p for m in members for p in graph.predecessors(m) if not _is_comm(graph, p)}
        consumers = {s for m in members for s in graph.successors(m) if not _is_comm(graph, s)}
        key = tensor_key(attrs[0]["name"])
        parts.append(
            {"key": key, "tensors": tensors, "launch": sorted(launch), "consumers": sorted(consumers)}
        )
    first = graph.nodes[nodes[0]]
    collective = dict(first["collective"] or {})
    if any(p["tensors"] for p in parts):
        collective["tensors"] = [t for p in parts for t in p["tensors"]]
        collective["bytes"] = sum(int(t.get("bytes") or 0) for t in collective["tensors"])
    attrs = {**first, "queue": "comm", "rank": None, "dur": span[1] - span[0], "gap_overhead": 0.0}
    graph.add_node(merged, **{**attrs, "collective": collective, "parts": parts})
    times[merged] = span
    for m in nodes:
        for p in graph.predecessors(m):
            if not _is_comm(graph, p):
                graph.add_edge(p, merged, kind=graph.edges[p, m]["kind"])
        for s in graph.successors(m):
            if not _is_comm(graph, s):
                graph.add_edge(merged, s, kind=graph.edges[m, s]["kind"])
    graph.remove_nodes_from(nodes)
    return merged


def _tensors(attrs: dict) -> list:
    return (attrs["collective"] or {}).get("tensors") or []


def _is_comm(graph: nx.DiGraph, node: str) -> bool:
    return graph.nodes[node]["kind"] == "comm"
