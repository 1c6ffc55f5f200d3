"""What a per-op-type precision plan (``Plan.op_precision``, TensorFlow's auto-mixed-precision unit)
does to the recorded step, as a graph transform on the recorded fp32 trace.

It reads the trace's ``precision_costs["op_types"]`` (schema in `recorder/trace.py`; written by
`recorder/tf_op_types.py`): the op type of each recorded op, the float tensors
that flow between ops with their fp32 bytes, per op type the measured time of its ops at fp32 (the
recorded steps) and at the low precision (profiled steps of the framework's own rewrite), and the
measured cost per byte of the casts that rewrite inserted.

- Time: every op of a changed type keeps its recorded duration times its type's measured ratio
  (``<p>_us / fp32_us``, summed over the same ops in both runs).
- Calibration on the rewrite's own timed calls: the bf16 probe times its unprofiled reading calls
  in turns with the recorded step (``turns``), so the uniform rewrite's change against the recorded
  configuration is measured as the loop's turns measure a plan's (`rewrite_change`: the rounds'
  mean or median change, the less noisy, over every rank's slowest blocks). That change on the
  recorded configuration's predicted step, less the rewrite's replayed figure (the bf16 ops'
  profiled times, which the profiler slowed otherwise than it slowed the recorded ones, the host
  gaps that do not shrink with them), is added to a plan in proportion to the share of the
  rewrite's changed fp32 op time that the plan changes (`changed_share`; all of it for the rewrite
  itself, whose predicted change is then the measured one, none for a plan that changes nothing).
  Only where the measured change tells itself from the replay: two figures, each with its 95% band
  (the turns', and the replayed steps' median's), within their combined band of each other (the
  root of the sum of squares, as verify combines two medians' noise) differ by chance, and the
  replay stands. So it does where the turns cannot tell the rewrite from the recorded configuration
  (their change within its band of none): they cannot say which of the two is the faster, and the
  plan is left to verify's turns, which run as long as they need to tell. The probe's six rounds of
  four calls resolve a large change and not a small one in a noisy run (two processes of the
  example's MLP, session 45: -5.0% +- 8.7, where the loop's turns measured the plan 5-11% faster in
  the other launches). Before the turns, ten calls of the rewrite timed after the recorded
  configuration's took a drift of the machine between the two whole (`recorder/tf_op_types.py`).
- Data: the tensors between ops on different threads become edges of the graph, so that a
  consumer waits for its producer rather than for the host gap recorded in front of it (TF's
  executor threads take ops as their inputs are ready; see `_add_data_edges`).
- Followers: an op whose type the plan does not name but which the uniform rewrite ran at the
  low precision (``low_ops``: TF's infer and clear lists, ops fused into an allowed root) follows
  the ops upstream of it, as TF paints such ops after low-precision ones: it runs at the low
  precision when a tensor reaches it from an op of a changed type through followers only (its
  duration then scaled by its type's ratio where measured, else kept), and otherwise at fp32.
- Casts: where a tensor flows between ops that now run at different precisions, one cast node per
  tensor and direction, priced ``bytes * us_per_byte`` of that direction. A cast to the low
  precision goes on the consuming op's queue right before its first consumer (the framework casts
  a tensor once for all its consumers); a cast back goes on the producing op's queue right after
  it. Ops the trace gives no type (inputs, variables, ops of other threads) count as fp32.

- Memory (`op_type_lives`): a recorded allocation made by an op that now runs at a 16-bit
  precision and outliving it is resized by what the uniform rewrite's profiled steps allocated for
  that op and kept past it over what the recorded steps did (``allocated``; half where the rewrite
  did not run it low). Its scratch (what it allocates and frees before it ends) is the rewrite's
  (``scratch``: the most of it alive at once, from the op's start to its end), in place of the
  recorded one: oneDNN's low-precision kernels can take far more than the fp32 ones (a
  convolution's filter gradient in bf16 on a CPU without native bf16: 26 MiB, where fp32 took
  none the allocator counted). Each cast
  of a producer's output to the other precision is a new tensor, one for all its consumers there:
  to the low precision from the start of the first of them, back to fp32 from the producer's end,
  to the end of the last of them; its bytes as the rewrite's own cast of that output allocated
  (``cast_allocated``; none where the rewrite crossed precisions there without one: a cast fused
  into its consumer, or one too small for the allocator's count), else half the fp32 bytes to the
  low precision and the fp32 bytes back.

The plan's op types not in the table, and precisions not measured, are refused
(`check_op_precision_plan`), never priced as if unchanged.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import networkx as nx

from qsync_callback.alternation import less_noisy_change, paired_change
from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import FULL_PRECISION
from qsync_callback.predictor.memory import TensorLife
from qsync_callback.predictor.precision import _insert
from qsync_callback.recorder.trace import OP_TYPE_COSTS, Op, Trace


def op_type_table(trace: Trace) -> Mapping:
    """The trace's per-op-type costs (empty if it has none)."""
    return trace.precision_costs.get(OP_TYPE_COSTS, {})


def uniform_op_types(table: Mapping, low: str) -> list[str]:
    """Op types of ``table`` measured at ``low`` on every one of their ops (what the framework's own
    rewrite ran there): the per-op-type picture of its uniform rewrite."""
    costs = table.get("costs", {})
    return sorted(
        t for t, c in costs.items() if c.get(f"{low}_us") is not None and c["measured_ops"] == c["ops"]
    )


def rewrite_reading(table: Mapping, op_precision: Mapping[str, str]) -> int | None:
    """The most the allocator read in use under the uniform rewrite, in the probe's profiled steps
    (``recorded_peak_bytes``) and its reading calls (``step_peak_bytes``), where ``op_precision``
    is that rewrite (its changed op types exactly `uniform_op_types` at one precision); else None."""
    changed = changed_op_types(op_precision)
    precisions = set(changed.values())
    if len(precisions) != 1 or sorted(changed) != uniform_op_types(table, precisions.pop()):
        return None
    readings = [*table.get("step_peak_bytes", ()), table.get("recorded_peak_bytes")]
    return max((r for r in readings if r is not None), default=None)


def rewrite_change(traces: Sequence[Trace]) -> dict[str, Any] | None:
    """The uniform rewrite's step-time change against the recorded configuration in the probe's
    turns, over every rank (`alternation.paired_change`: each block the slowest rank's), as the
    loop's turns decide on it (`alternation.less_noisy_change`: ``change_pct``, ``noise_pct`` and
    ``estimate``); None where a rank's probe timed no round."""
    turns = [op_type_table(trace).get("turns") for trace in traces]
    if not all(turns):
        return None
    return less_noisy_change(paired_change(turns))


def changed_share(table: Mapping, op_precision: Mapping[str, str]) -> float:
    """The share of the uniform rewrite's changed op time (the recorded fp32 time of its op types,
    `uniform_op_types`) that ``op_precision`` changes: 1 for the rewrite, 0 for a plan that changes
    nothing or moves op types to more than one precision."""
    changed = changed_op_types(op_precision)
    precisions = set(changed.values())
    if len(precisions) != 1:
        return 0.0
    fp32_us = {t: c[f"{FULL_PRECISION}_us"] for t, c in table.get("costs", {}).items()}
    total = sum(fp32_us[t] for t in uniform_op_types(table, precisions.pop()))
    if total <= 0:
        return 0.0
    return sum(fp32_us.get(t, 0.0) for t in changed) / total


def changed_op_types(op_precision: Mapping[str, str]) -> dict[str, str]:
    """The op types ``op_precision`` moves away from fp32 (the trace was recorded at fp32)."""
    return {t: p for t, p in op_precision.items() if p != FULL_PRECISION}


def check_op_precision_plan(traces: Sequence[Trace], op_precision: Mapping[str, str], source: str) -> None:
    """Refuse a plan the traces cannot price: a trace without per-op-type costs, an op type with no
    measured time at the plan's precision, a precision whose casts were not measured."""
    changed = changed_op_types(op_precision)
    if not changed:
        return
    for trace in traces:
        table = op_type_table(trace)
        if not table.get("costs"):
            raise QSyncInputError(
                f"{source}: the trace of rank {trace.rank} has no per-op-type precision costs; record it "
                "with the Horovod + TensorFlow Recorder in mode 'apply'"
            )
        if trace.precision:
            raise QSyncInputError(f"{source}: op-type plans are priced from a run recorded at fp32")
        for op_type, p in changed.items():
            cost = table["costs"].get(op_type, {})
            if cost.get(f"{p}_us") is None:
                measured = ", ".join(sorted(table["costs"])) or "none"
                raise QSyncInputError(
                    f"{source}: op type {op_type!r} at {p} was not measured (measured: {measured})"
                )
            for pair in (f"{FULL_PRECISION}->{p}", f"{p}->{FULL_PRECISION}"):
                if pair not in table.get("casts", {}):
                    raise QSyncInputError(f"{source}: no measured {pair} casts to price op type {op_type!r}")


def op_precisions(table: Mapping, op_precision: Mapping[str, str]) -> dict[str, str]:
    """The precision each op runs at under ``op_precision``: ops of the types it moves at theirs,
    and the followers (module docstring; ops of a type the plan names, at fp32 or not, never
    follow) reached from them at theirs; ops not listed run at fp32."""
    types = table.get("ops", {})
    changed = changed_op_types(op_precision)
    precisions = {name: changed[t] for name, t in types.items() if t in changed}
    followers = {name for name in table.get("low_ops", []) if types.get(name) not in op_precision}
    consumers: dict[str, list[str]] = {}
    for producer, consumer, _ in table.get("edges", []):
        consumers.setdefault(producer, []).append(consumer)
    frontier = list(precisions)
    while frontier:
        name = frontier.pop()
        for consumer in consumers.get(name, []):
            if consumer in followers and consumer not in precisions:
                precisions[consumer] = precisions[name]
                frontier.append(consumer)
    return precisions


def type_ratio(table: Mapping, op_type: str, precision: str) -> float:
    """Measured time at ``precision`` over fp32 of ``op_type``'s ops."""
    cost = table["costs"][op_type]
    return cost[f"{precision}_us"] / max(cost[f"{FULL_PRECISION}_us"], 1e-9)


def _add_data_edges(
    graph: nx.DiGraph,
    out: nx.DiGraph,
    nodes: Mapping[tuple[int, str], list[str]],
    rank: int,
    edges: Sequence[Sequence],
) -> None:
    """Make the tensors between ops on different queues edges of ``out``, and take the wait for them
    out of the consumer's host gap: ``gap = recorded start - latest recorded end of its predecessors``
    (as `graph.py` computes it), now over the data predecessors too. Replayed as recorded, the step
    is unchanged; with ops made faster, a consumer on another thread starts earlier. Only edges that
    point forward in recorded time are added (so the graph stays acyclic)."""
    changed = set()
    for producer, consumer, _ in edges:
        for src in nodes.get((rank, producer), []):
            for dst in nodes.get((rank, consumer), []):
                a, b = graph.nodes[src], graph.nodes[dst]
                if a["queue"] != b["queue"] and a["recorded_start"] + a["dur"] <= b["recorded_start"]:
                    if not out.has_edge(src, dst):
                        out.add_edge(src, dst, kind="dep")
                        changed.add(dst)
    for node in changed:
        start = graph.nodes[node]["recorded_start"]
        ready = max(graph.nodes[p]["recorded_start"] + graph.nodes[p]["dur"] for p in out.predecessors(node))
        out.nodes[node]["gap"] = min(out.nodes[node]["gap"], max(0.0, start - ready))


def apply_op_precision(
    graph: nx.DiGraph, traces: Sequence[Trace], op_precision: Mapping[str, str]
) -> nx.DiGraph:
    """A copy of a step's graph (`build_global_graph`) with the ops of changed types rescaled and
    the cast nodes added (see the module docstring)."""
    changed = changed_op_types(op_precision)
    out = graph.copy()
    if not changed:
        return out
    nodes: dict[tuple[int, str], list[str]] = {}
    for node, attrs in graph.nodes(data=True):
        if attrs["rank"] is not None and attrs["kind"] not in ("comm", "sentinel"):
            nodes.setdefault((attrs["rank"], attrs["name"]), []).append(node)
    for trace in traces:
        table = op_type_table(trace)
        types = table.get("ops", {})
        _add_data_edges(graph, out, nodes, trace.rank, table.get("edges", []))

        precisions = op_precisions(table, op_precision)

        def precision_of(name: str, precisions: Mapping = precisions) -> str:
            return precisions.get(name, FULL_PRECISION)

        for name, p in precisions.items():
            if types.get(name) in table["costs"]:
                ratio = type_ratio(table, types[name], p)
                for node in nodes.get((trace.rank, name), []):
                    out.nodes[node]["dur"] *= ratio
        casts: dict[tuple[str, str], tuple[str, int]] = {}  # (tensor, to) -> (anchor node, bytes)
        for producer, consumer, nbytes in table.get("edges", []):
            src, dst = precision_of(producer), precision_of(consumer)
            if src == dst:
                continue
            anchors = nodes.get((trace.rank, consumer if dst != FULL_PRECISION else producer))
            if not anchors:
                continue
            anchor = anchors[0] if dst != FULL_PRECISION else anchors[-1]
            known = casts.get((producer, dst))
            start = graph.nodes[anchor]["recorded_start"]
            if known is None or start < graph.nodes[known[0]]["recorded_start"]:
                casts[(producer, dst)] = (anchor, int(nbytes))
        for (producer, dst), (anchor, nbytes) in sorted(casts.items()):
            src = precision_of(producer)
            attrs = graph.nodes[anchor]
            _insert(
                out,
                anchor,
                f"r{trace.rank}/cast/{producer}/{dst}",
                {
                    "name": f"qsync::cast_{src}_{dst}:{producer}",
                    "kind": "cast",
                    "queue": attrs["queue"],
                    "rank": trace.rank,
                    "layer": attrs["layer"],
                    "bytes": nbytes,
                    "collective": None,
                    "op_id": None,
                    "gap": 0.0,
                    "recorded_start": attrs["recorded_start"],
                    "dur": nbytes * table["casts"][f"{src}->{dst}"]["us_per_byte"],
                },
                before=dst != FULL_PRECISION,
            )
    return out


def op_type_lives(
    trace: Trace, lives: Sequence[TensorLife], op_precision: Mapping[str, str]
) -> list[TensorLife]:
    """The tensors of ``trace``'s recorded steps (``lives``, `memory.tensor_lifetimes`) under op-type
    plan ``op_precision``: those its low-precision ops make resized, their scratch as the rewrite's,
    and its casts added (see the module docstring)."""
    if not changed_op_types(op_precision):
        return list(lives)
    table = op_type_table(trace)
    precisions = op_precisions(table, op_precision)
    scratch = table.get("scratch")  # None in traces recorded before it was measured

    def low(op: Op | None) -> bool:
        return op is not None and precisions.get(op.name, FULL_PRECISION) != FULL_PRECISION

    out = []
    for life in lives:
        if not low(life.birth_op):
            out.append(life)
        elif scratch is None or life.death_us is None or life.death_us > life.birth_op.end_us:
            out.append(
                dataclasses.replace(life, bytes=int(life.bytes * _made_ratio(table, life.birth_op.name)))
            )
    ran: dict[tuple[int, str], list[Op]] = defaultdict(list)
    for op in trace.ops:
        ran[(op.step, op.name)].append(op)
        if scratch is not None and low(op) and scratch.get(op.name, (0, 0))[1]:
            out.append(
                TensorLife(
                    -1, scratch[op.name][1], op.step, op.start_us, op.end_us, op, op, "temporaries", op.layer
                )
            )
    steps = sorted({op.step for op in trace.ops})
    casts: dict[tuple[int, str, str], list] = {}  # (step, producer, to) -> [bytes, birth op, birth, last use]
    for producer, consumer, nbytes in table.get("edges", []):
        src, dst = precisions.get(producer, FULL_PRECISION), precisions.get(consumer, FULL_PRECISION)
        if src == dst:
            continue
        for step in steps:
            consumers, producers = ran.get((step, consumer), []), ran.get((step, producer), [])
            if not consumers or (dst == FULL_PRECISION and not producers):
                continue
            last = max(consumers, key=lambda o: o.end_us)
            # to the low precision: right before the first consumer; back: right after the producer
            born = (
                min(consumers, key=lambda o: o.start_us)
                if dst != FULL_PRECISION
                else max(producers, key=lambda o: o.end_us)
            )
            at = born.start_us if dst != FULL_PRECISION else born.end_us
            known = casts.setdefault(
                (step, producer, dst), [_cast_bytes(table, producer, consumer, dst, nbytes), born, at, last]
            )
            if at < known[2]:
                known[1:3] = [born, at]
            known[3] = max(known[3], last, key=lambda o: o.end_us)
    for (step, _, _), (nbytes, born, at, last) in sorted(casts.items(), key=lambda item: item[0]):
        out.append(TensorLife(-1, nbytes, step, at, last.end_us, born, last, "temporaries", born.layer))
    return out


def _made_ratio(table: Mapping, name: str) -> float:
    """What op ``name`` makes (allocations that outlive it) at the low precision over at fp32: as
    measured under the uniform rewrite where it ran at it (``allocated``), else half."""
    fp32, low = table.get("allocated", {}).get(name, (0, 0))
    if fp32 and name in table.get("low_ops", ()):
        return low / fp32
    return 0.5


def _cast_bytes(table: Mapping, producer: str, consumer: str, to: str, fp32_bytes: float) -> int:
    """What the cast of ``producer``'s output to precision ``to`` allocates: as measured under the
    uniform rewrite where it cast it (``cast_allocated``; 0 where it crossed precisions there and
    allocated no counted cast: fused, or too small for the allocator's count); else its bytes."""
    measured = table.get("cast_allocated")
    if measured is not None:
        if f"{producer}->{to}" in measured:
            return int(measured[f"{producer}->{to}"])
        uniform = set(table.get("low_ops", ()))
        if (producer in uniform) != (consumer in uniform):
            return 0
    return int(fp32_bytes) // 2 if to != FULL_PRECISION else int(fp32_bytes)
