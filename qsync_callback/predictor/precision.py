"""What a per-layer precision plan does to the recorded step: QSync's cost mapping as changes to
the recorded graph and liveness.

Time. For a layer moved from its recorded precision (fp32) to ``p``, the probes of
`recorder/precision_probes.py` give its forward and backward time at both precisions on the run's
own shapes. The recorded ops keep their in-run durations, scaled by the probes' ratio (the probe
says how much faster or slower ``p`` is; the trace says how long the layer really takes in this
run):

- forward ops: ``dur * compute_p / forward_fp32``, where ``compute_p`` is the probe's forward at
  ``p`` less the casts it contains, and the casts become nodes of their own: before the layer, its
  input and weight cast to ``p`` (for int8: quantized); after it, its output cast back (for int8:
  dequantized). Each is priced by the fitted ``alpha * numel + beta`` of that cast on this device.
  Our LP modules return their input's dtype, so every low-precision layer pays both casts whatever
  its neighbours run (QSync's fused cast between equal neighbours is not modelled: no LP module
  passes a low-precision tensor on);
- backward ops: ``dur * backward_p / backward_fp32`` (the probe's backward includes the casts of
  the gradients).

Memory. At ``p`` the layer saves for backward what the probe measured at ``p`` (its input and,
for bf16/fp16/int8, its weight at that precision), and the fp32 tensors that only this layer kept
alive until its backward are freed after its forward instead. The second amount is read from the
recorded liveness: the activations that died in this layer's backward ops. The difference is a
synthetic tensor alive from the end of the layer's forward until its backward releases what it
saved (when the fp32 tensors died in the recording, else the end of the backward). The
temporaries of the layer's forward and backward change too (a dequantized int8 input in the
backward, say): the probe measured their peak at each precision (`probe_layer_costs`), and the
difference is a synthetic tensor alive while the layer's forward (or backward) ops run.

Pricing. `PrecisionDurations` gives a plan's op durations on the recorded graphs compiled once
(`replay.CompiledGraph`), each cast folded into the op it sits next to, and `PrecisionLives` its
synthetic tensors, gathered once per (layer, precision): no graph is copied, so a planner prices
many plans quickly. `apply_precision` makes the same change on a copy of a graph, with the cast
nodes, for plans whose other decisions transform the graph too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import networkx as nx
import numpy as np

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import FULL_PRECISION
from qsync_callback.predictor.memory import Events, TensorLife, lifetime_events
from qsync_callback.predictor.replay import CompiledGraph
from qsync_callback.recorder.trace import Op, Trace

_CAST_FLOOR = 0.1  # a layer's compute is at least this share of its probed forward, whatever the casts fit


def changed_layers(trace: Trace, precision: Mapping[str, str]) -> dict[str, str]:
    """The layers ``precision`` moves away from what they ran at in ``trace``."""
    return {name: p for name, p in precision.items() if p != trace.precision.get(name, FULL_PRECISION)}


def check_precision_plan(traces: Sequence[Trace], precision: Mapping[str, str], source: str) -> None:
    """Refuse a precision plan the traces cannot price: a layer recorded at another precision than
    fp32, a layer with no probe, or a precision the probe did not run (the layer cannot run it
    here, or it was not among the precisions asked for)."""
    for trace in traces:
        changed = changed_layers(trace, precision)
        if not changed:
            continue
        recorded_low = [n for n in changed if trace.precision.get(n, FULL_PRECISION) != FULL_PRECISION]
        if recorded_low:
            raise QSyncInputError(
                f"{source}: layer {recorded_low[0]!r} was recorded at {trace.precision[recorded_low[0]]}; "
                "precision plans are priced from a run recorded at fp32"
            )
        layers = trace.precision_costs.get("layers", {})
        if not layers:
            raise QSyncInputError(
                f"{source}: the trace of rank {trace.rank} has no per-precision costs; record it with "
                "QSyncCallback(mode='apply') or with precisions to probe"
            )
        for name, p in changed.items():
            if name not in layers:
                raise QSyncInputError(
                    f"{source}: layer {name!r} has no probe in the trace (not a Linear/Conv?)"
                )
            if p not in layers[name]["costs"] or FULL_PRECISION not in layers[name]["costs"]:
                probed = ", ".join(layers[name]["costs"]) or "none"
                raise QSyncInputError(f"{source}: layer {name!r} at {p} has no probe (probed here: {probed})")


def cast_us(costs: Mapping, pair: str, numel: int) -> float:
    """Fitted time of one cast of ``numel`` elements (0 for a pair with no fit, e.g. tf32)."""
    fit = costs.get("casts", {}).get(pair)
    if fit is None:
        return 0.0
    return fit["alpha_us_per_element"] * numel + fit["beta_us"]


def input_scale(entry: Mapping, op: Op | None) -> float:
    """Elements of ``op``'s first input (a layer's first forward op in one step) over those the
    layer was probed at: below 1 for a partial batch (an epoch's last), whose activations, saved
    tensors and casts are that much smaller; 1 where the op has no usable shape."""
    shape = op.input_shapes[0] if op is not None and op.input_shapes else None
    if not (isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape)):
        return 1.0
    probed = entry.get("input_numel") or 0
    return math.prod(shape) / probed if probed > 0 else 1.0


def layer_casts_us(costs: Mapping, layer: str, precision: str, scale: float = 1.0) -> tuple[float, float]:
    """(before, after) cast time of ``layer`` at ``precision``: input and weight to it, output back;
    the activations' element counts times ``scale`` (`input_scale`)."""
    if precision in (FULL_PRECISION, "tf32"):
        return 0.0, 0.0
    entry = costs["layers"][layer]
    to, back = f"{FULL_PRECISION}->{precision}", f"{precision}->{FULL_PRECISION}"
    before = cast_us(costs, to, round(entry["input_numel"] * scale)) + cast_us(
        costs, to, entry["weight_numel"]
    )
    return before, cast_us(costs, back, round(entry["output_numel"] * scale))


def layer_time_scales(costs: Mapping, layer: str, precision: str) -> tuple[float, float]:
    """(forward, backward) factors on the layer's recorded op durations at ``precision``."""
    probes = costs["layers"][layer]["costs"]
    base, low = probes[FULL_PRECISION], probes[precision]
    before, after = layer_casts_us(costs, layer, precision)
    compute = max(low["forward_us"] - before - after, _CAST_FLOOR * low["forward_us"])
    return compute / max(base["forward_us"], 1e-9), low["backward_us"] / max(base["backward_us"], 1e-9)


def _layer_move(
    trace: Trace, layer: str, precision: str, first: Op | None
) -> tuple[float, float, float, float]:
    """What moving ``layer`` to ``precision`` does in one step whose first forward op of the layer is
    ``first``: (forward scale, backward scale, cast time before it, cast time after it)."""
    costs = trace.precision_costs
    forward_scale, backward_scale = layer_time_scales(costs, layer, precision)
    before_us, after_us = layer_casts_us(costs, layer, precision, input_scale(costs["layers"][layer], first))
    return forward_scale, backward_scale, before_us, after_us


def _layer_nodes(graph: nx.DiGraph) -> dict[tuple[int, str], tuple[list[str], list[str]]]:
    """Per (rank, layer): its forward nodes in ``graph`` by recorded start, and its backward nodes."""
    groups: dict[tuple[int, str], tuple[list[str], list[str]]] = {}
    for node, attrs in graph.nodes(data=True):
        if (
            attrs["layer"] is not None
            and attrs["kind"] in ("forward", "backward")
            and attrs["rank"] is not None
        ):
            forward, backward = groups.setdefault((attrs["rank"], attrs["layer"]), ([], []))
            (forward if attrs["kind"] == "forward" else backward).append(node)
    for forward, _ in groups.values():
        forward.sort(key=lambda n: graph.nodes[n]["recorded_start"])
    return groups


def _insert(graph: nx.DiGraph, anchor: str, node: str, attrs: dict, before: bool) -> None:
    """Put ``node`` on ``anchor``'s queue right before (taking its predecessors and host gap) or
    right after it (taking its successors)."""
    graph.add_node(node, **attrs)
    if before:
        for pred in list(graph.predecessors(anchor)):
            graph.add_edge(pred, node, **graph.edges[pred, anchor])
            graph.remove_edge(pred, anchor)
        graph.nodes[node]["gap"], graph.nodes[anchor]["gap"] = graph.nodes[anchor]["gap"], 0.0
        graph.add_edge(node, anchor, kind="order")
    else:
        for succ in list(graph.successors(anchor)):
            graph.add_edge(node, succ, **graph.edges[anchor, succ])
            graph.remove_edge(anchor, succ)
        graph.add_edge(anchor, node, kind="order")


def apply_precision(graph: nx.DiGraph, traces: Sequence[Trace], precision: Mapping[str, str]) -> nx.DiGraph:
    """A copy of a step's graph (`build_global_graph`) with the layers in ``precision`` repriced and
    their cast nodes added (see the module docstring)."""
    out = graph.copy()
    groups = _layer_nodes(graph)
    for trace in {t.rank: t for t in traces}.values():
        rank = trace.rank
        ops = {op.id: op for op in trace.ops}
        for layer, p in changed_layers(trace, precision).items():
            forward, backward = groups.get((rank, layer), ([], []))
            first = graph.nodes[forward[0]] if forward else None
            forward_scale, backward_scale, before_us, after_us = _layer_move(
                trace, layer, p, ops.get(first["op_id"]) if first else None
            )
            for node in forward:
                out.nodes[node]["dur"] *= forward_scale
            for node in backward:
                out.nodes[node]["dur"] *= backward_scale
            if first is None:
                continue
            common = {
                "kind": "cast",
                "queue": first["queue"],
                "rank": rank,
                "layer": layer,
                "bytes": 0,
                "collective": None,
                "op_id": None,
                "gap": 0.0,
                "recorded_start": first["recorded_start"],
            }
            if before_us:
                _insert(
                    out,
                    forward[0],
                    f"r{rank}/cast/{layer}/in",
                    {**common, "name": f"qsync::cast_{FULL_PRECISION}_{p}", "dur": before_us},
                    before=True,
                )
            if after_us:
                _insert(
                    out,
                    forward[-1],
                    f"r{rank}/cast/{layer}/out",
                    {**common, "name": f"qsync::cast_{p}_{FULL_PRECISION}", "dur": after_us},
                    before=False,
                )
    return out


class PrecisionDurations:
    """Per-layer precision plans priced on compiled step graphs without copying them: each plan is
    the op durations it gives (`apply_precision`'s rescaling) with every cast folded into the op it
    would be inserted next to. A cast node right before an op takes over its predecessors and host
    gap and is its only predecessor; one right after takes over its successors and is their
    predecessor in its place: either way the replay ends every other op at the same time as with
    the op lasting the cast's time longer. The one difference is the order in which a successor
    that waits for several consults them (it breaks ties for the critical path): the cast after an
    op comes last, which the replay is told (``moved``)."""

    def __init__(
        self, graphs: Sequence[nx.DiGraph], compiled: Sequence[CompiledGraph], traces: Sequence[Trace]
    ):
        self._traces = list({t.rank: t for t in traces}.values())
        self._compiled = list(compiled)
        groups = [_layer_nodes(g) for g in graphs]
        self._keys = {key: k for k, key in enumerate(sorted({key for g in groups for key in g}))}
        none = len(self._keys)
        ops = {t.rank: {op.id: op for op in t.ops} for t in self._traces}
        self._forward_key: list[np.ndarray] = []
        self._backward_key: list[np.ndarray] = []
        self._first: list[np.ndarray] = []
        self._last: list[np.ndarray] = []
        self._first_op: list[list[Op | None]] = []
        for graph, comp, group in zip(graphs, self._compiled, groups, strict=True):
            forward_key = np.full(len(comp.nodes), none, dtype=np.int64)
            backward_key = np.full(len(comp.nodes), none, dtype=np.int64)
            first = np.full(none, -1, dtype=np.int64)
            last = np.full(none, -1, dtype=np.int64)
            first_op: list[Op | None] = [None] * none
            for (rank, layer), (forward, backward) in group.items():
                k = self._keys[(rank, layer)]
                forward_key[[comp.index[n] for n in forward]] = k
                backward_key[[comp.index[n] for n in backward]] = k
                if forward:
                    first[k], last[k] = comp.index[forward[0]], comp.index[forward[-1]]
                    first_op[k] = ops.get(rank, {}).get(graph.nodes[forward[0]]["op_id"])
            self._forward_key.append(forward_key)
            self._backward_key.append(backward_key)
            self._first.append(first)
            self._last.append(last)
            self._first_op.append(first_op)
        self._moves: dict[tuple[int, str], tuple[float, float, np.ndarray, np.ndarray]] = {}

    def _move(
        self, trace: Trace, k: int, layer: str, precision: str
    ) -> tuple[float, float, np.ndarray, np.ndarray]:
        """`_layer_move` of key ``k`` at ``precision``, with the casts per graph (0 where the layer
        has no forward op)."""
        if (k, precision) not in self._moves:
            moves = [_layer_move(trace, layer, precision, first_op[k]) for first_op in self._first_op]
            before = np.array(
                [m[2] if first[k] >= 0 else 0.0 for m, first in zip(moves, self._first, strict=True)]
            )
            after = np.array(
                [m[3] if first[k] >= 0 else 0.0 for m, first in zip(moves, self._first, strict=True)]
            )
            self._moves[(k, precision)] = (moves[0][0], moves[0][1], before, after)
        return self._moves[(k, precision)]

    def __call__(
        self, precision: Mapping[str, str], graphs: Sequence[int] | None = None
    ) -> list[tuple[np.ndarray, frozenset[int]]]:
        """Per compiled graph (or those at positions ``graphs``): the op durations under
        ``precision`` and the ops whose folded cast would follow them (`CompiledGraph.run`)."""
        positions = range(len(self._compiled)) if graphs is None else graphs
        keys, forward, backward, before, after = [], [], [], [], []
        for trace in self._traces:
            for layer, p in changed_layers(trace, precision).items():
                k = self._keys.get((trace.rank, layer))
                if k is None:
                    continue
                move = self._move(trace, k, layer, p)
                keys.append(k)
                forward.append(move[0])
                backward.append(move[1])
                before.append(move[2])
                after.append(move[3])
        if not keys:
            return [(self._compiled[g].dur, frozenset()) for g in positions]
        forward_scale = np.ones(len(self._keys) + 1)
        backward_scale = np.ones(len(self._keys) + 1)
        forward_scale[keys] = forward
        backward_scale[keys] = backward
        before_us, after_us = np.array(before), np.array(after)
        out = []
        for g in positions:
            comp = self._compiled[g]
            dur = comp.dur * forward_scale[self._forward_key[g]] * backward_scale[self._backward_key[g]]
            first, last = self._first[g][keys], self._last[g][keys]
            present = first >= 0
            dur[first[present]] += before_us[present, g]
            dur[last[present]] += after_us[present, g]
            followed = last[present & (after_us[:, g] != 0)]
            moved = frozenset(i for i in followed.tolist() if i in comp.feeds_join)
            out.append((dur, moved))
        return out


class PrecisionLives:
    """The synthetic tensors a precision plan adds to one rank's memory curve, from what its
    recorded steps say of every layer (gathered once): per changed layer and recorded step, its
    saved-for-backward bytes, alive from the end of its forward until its backward lets them go
    (when the recorded fp32 ones died, else the backward's end), and the change in its forward's
    and backward's temporaries, alive while they run."""

    def __init__(self, trace: Trace, lives: Sequence[TensorLife]):
        self.trace = trace
        self._freed: dict[tuple[int, str], int] = {}
        self._released: dict[tuple[int, str], float] = {}  # when the layer's backward let them go
        for life in lives:
            death = life.death_op
            if (
                life.category == "activations"
                and death is not None
                and death.kind == "backward"
                and death.layer is not None
                and (life.birth_op is None or life.birth_op.layer != death.layer)  # an input, not its own
            ):
                key = (life.step, death.layer)
                self._freed[key] = self._freed.get(key, 0) + life.bytes
                self._released[key] = max(self._released.get(key, life.death_us), life.death_us)
        spans: dict[tuple[int, str, str], list[float]] = {}
        self._first_forward: dict[tuple[int, str], Op] = {}
        for op in trace.ops:
            if op.layer is not None and op.kind in ("forward", "backward"):
                span = spans.setdefault((op.step, op.layer, op.kind), [op.start_us, op.end_us])
                span[0], span[1] = min(span[0], op.start_us), max(span[1], op.end_us)
                held = self._first_forward.get((op.step, op.layer))
                if op.kind == "forward" and (held is None or op.start_us < held.start_us):
                    self._first_forward[(op.step, op.layer)] = op
        self._spans: dict[str, list[tuple[int, str, float, float]]] = {}
        for (step, layer, kind), (start, end) in sorted(spans.items()):
            self._spans.setdefault(layer, []).append((step, kind, start, end))
        self._events: dict[tuple[str, str], dict[int, Events]] = {}
        self._backward_end = {
            (step, layer): end for (step, layer, kind), (_, end) in spans.items() if kind == "backward"
        }

    def __call__(self, precision: Mapping[str, str]) -> list[dict[int, Events]]:
        """The synthetic tensors of ``precision``, per changed layer (`memory.lifetime_events`)."""
        out = []
        for layer, p in changed_layers(self.trace, precision).items():
            if (layer, p) not in self._events:
                self._events[(layer, p)] = lifetime_events(self._lives(layer, p))
            out.append(self._events[(layer, p)])
        return out

    def _lives(self, layer: str, precision: str) -> list[TensorLife]:
        """The synthetic tensors of ``layer`` moved to ``precision`` (see the class docstring)."""
        entry = self.trace.precision_costs["layers"][layer]
        low, base = entry["costs"][precision], entry["costs"][FULL_PRECISION]
        extra = []
        for step, kind, start, end in self._spans.get(layer, []):
            scale = input_scale(entry, self._first_forward.get((step, layer)))
            transient = low.get(f"{kind}_transient_bytes", 0) - base.get(f"{kind}_transient_bytes", 0)
            extra.append(
                TensorLife(-1, int(transient * scale), step, start, end, None, None, "temporaries", layer)
            )
            backward_end = self._backward_end.get((step, layer))
            if kind == "forward" and backward_end is not None:
                saved = _saved_bytes(low, scale) - self._freed.get((step, layer), 0)
                release = self._released.get((step, layer), backward_end)
                extra.append(TensorLife(-1, saved, step, end, release, None, None, "activations", layer))
        return extra


def _saved_bytes(probe: Mapping, scale: float) -> int:
    """What a layer saves for backward in a step whose activations are ``scale`` times the probe's:
    the activations scaled, the low-precision weight copy not."""
    if "saved_activation_bytes" not in probe:
        return int(probe["saved_bytes"] * scale)
    return int(probe["saved_activation_bytes"] * scale + probe.get("saved_weight_bytes", 0))
