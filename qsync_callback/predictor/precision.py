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
  Neighbours at the same bf16/fp16 precision in an ``nn.Sequential`` are linked, as the live run
  links them (`precision_links`): the first keeps its output at the precision and the second takes
  it as it is, so neither cast between them is paid, and the pass-through layers between them
  (ReLU, dropout, pooling) run at the precision, their durations scaled by their own probes;
- backward ops: ``dur * backward_p / backward_fp32`` (the probe's backward includes the casts of
  the gradients; those a link saves are taken off).

Memory. At ``p`` the layer saves for backward what the probe measured at ``p`` (its input and,
for bf16/fp16/int8, its weight at that precision), and the fp32 tensors that only this layer kept
alive until its backward are freed after its forward instead. The second amount is read from the
recorded liveness: the activations that died in this layer's backward ops. The difference is a
synthetic tensor alive from the end of the layer's forward until its backward releases what it
saved (when the fp32 tensors died in the recording, else the end of the backward). The
temporaries of the layer's forward and backward change too (a dequantized int8 input in the
backward, say): the probe measured their peak at each precision (`probe_layer_costs`), and the
difference is a synthetic tensor alive while the layer's forward (or backward) ops run. A layer
that receives a linked input saves that tensor, not a copy of its own: it saves nothing more, and
the input itself shrinks (where it died in this layer's backward, as the freed fp32 tensors above;
where a pass-through layer also saved it, through that layer's probe). A pass-through layer in a
link saves what its probe saved at the precision instead of at fp32. And inside a link the
gradients flow back at the precision too: the gradient a pass-through or receiving layer's backward
hands to the layer before it (a recorded temporary born in its backward, freed in another layer's)
shrinks to the precision's element size.

Pricing. `PrecisionDurations` gives a plan's op durations on the recorded graphs compiled once
(`replay.CompiledGraph`), each cast folded into the op it sits next to, and `PrecisionLives` its
synthetic tensors, gathered once per (layer, precision): no graph is copied, so a planner prices
many plans quickly. `apply_precision` makes the same change on a copy of a graph, with the cast
nodes, for plans whose other decisions transform the graph too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import networkx as nx
import numpy as np

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import FULL_PRECISION
from qsync_callback.precision_links import ELEMENT_BYTES, precision_links
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


class LayerMove(NamedTuple):
    """One layer a plan changes: an LP layer at ``precision``, its output kept at it for a linked
    neighbour (``passes``) or its input arriving at it from one (``receives``); or a pass-through
    layer a link runs at ``precision`` (``passed``; `precision_links`)."""

    layer: str
    precision: str
    passes: bool = False
    receives: bool = False
    passed: bool = False


def plan_moves(trace: Trace, precision: Mapping[str, str]) -> list[LayerMove]:
    """The layers ``precision`` changes in ``trace``'s run, with its links (`precision_links`) as
    the live run forms them from the trace's layer table."""
    changed = changed_layers(trace, precision)
    links = precision_links(trace.layers, changed)
    sources, targets = {link.source for link in links}, {link.target for link in links}
    moves = [LayerMove(name, p, name in sources, name in targets) for name, p in changed.items()]
    passed = {name: link.precision for link in links for name in link.between}
    return moves + [LayerMove(name, p, passed=True) for name, p in passed.items()]


def layer_casts_us(
    costs: Mapping, move: LayerMove, scale: float = 1.0, links: bool = True
) -> tuple[float, float]:
    """(before, after) cast time of an LP layer's ``move``: its weight and (unless it receives a
    linked input) its input to the move's precision, and (unless it passes its output on) its output
    back; the activations' element counts times ``scale`` (`input_scale`). ``links=False``: the
    casts of the layer alone, as its probe ran it."""
    if move.precision in (FULL_PRECISION, "tf32") or move.passed:
        return 0.0, 0.0
    entry = costs["layers"][move.layer]
    to, back = f"{FULL_PRECISION}->{move.precision}", f"{move.precision}->{FULL_PRECISION}"
    before = cast_us(costs, to, entry["weight_numel"])
    if not (links and move.receives):
        before += cast_us(costs, to, round(entry["input_numel"] * scale))
    after = 0.0 if links and move.passes else cast_us(costs, back, round(entry["output_numel"] * scale))
    return before, after


def layer_time_scales(costs: Mapping, move: LayerMove) -> tuple[float, float]:
    """(forward, backward) factors on the layer's recorded op durations under ``move``: the
    probes' ratios, less the casts a link saves in the backward (the gradient of a passed output
    arrives at the low precision, that of a received input stays at it); the forward's casts are
    nodes of their own (`layer_casts_us`)."""
    if move.passed:
        probes = costs.get("pass_through", {}).get(move.layer, {}).get("costs", {})
        if move.precision not in probes:  # never ran in the recorded steps: nothing to scale
            return 1.0, 1.0
        base, low = probes[FULL_PRECISION], probes[move.precision]
        return low["forward_us"] / max(base["forward_us"], 1e-9), low["backward_us"] / max(
            base["backward_us"], 1e-9
        )
    entry = costs["layers"][move.layer]
    base, low = entry["costs"][FULL_PRECISION], entry["costs"][move.precision]
    before, after = layer_casts_us(costs, move, links=False)
    compute = max(low["forward_us"] - before - after, _CAST_FLOOR * low["forward_us"])
    to, back = f"{FULL_PRECISION}->{move.precision}", f"{move.precision}->{FULL_PRECISION}"
    saved_casts = (cast_us(costs, to, entry["output_numel"]) if move.passes else 0.0) + (
        cast_us(costs, back, entry["input_numel"]) if move.receives else 0.0
    )
    backward = max(low["backward_us"] - saved_casts, _CAST_FLOOR * low["backward_us"])
    return compute / max(base["forward_us"], 1e-9), backward / max(base["backward_us"], 1e-9)


def _layer_move(trace: Trace, move: LayerMove, first: Op | None) -> tuple[float, float, float, float]:
    """What ``move`` does in one step whose first forward op of the layer is ``first``: (forward
    scale, backward scale, cast time before it, cast time after it)."""
    costs = trace.precision_costs
    forward_scale, backward_scale = layer_time_scales(costs, move)
    if move.passed:
        return forward_scale, backward_scale, 0.0, 0.0
    before_us, after_us = layer_casts_us(costs, move, input_scale(costs["layers"][move.layer], first))
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
        for move in plan_moves(trace, precision):
            layer, p = move.layer, move.precision
            forward, backward = groups.get((rank, layer), ([], []))
            first = graph.nodes[forward[0]] if forward else None
            forward_scale, backward_scale, before_us, after_us = _layer_move(
                trace, move, ops.get(first["op_id"]) if first else None
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
        self._moves: dict[tuple[int, LayerMove], tuple[float, float, np.ndarray, np.ndarray]] = {}

    def _move(self, trace: Trace, k: int, move: LayerMove) -> tuple[float, float, np.ndarray, np.ndarray]:
        """`_layer_move` of key ``k``, with the casts per graph (0 where the layer has no forward
        op)."""
        if (k, move) not in self._moves:
            moves = [_layer_move(trace, move, first_op[k]) for first_op in self._first_op]
            before = np.array(
                [m[2] if first[k] >= 0 else 0.0 for m, first in zip(moves, self._first, strict=True)]
            )
            after = np.array(
                [m[3] if first[k] >= 0 else 0.0 for m, first in zip(moves, self._first, strict=True)]
            )
            self._moves[(k, move)] = (moves[0][0], moves[0][1], before, after)
        return self._moves[(k, move)]

    def __call__(
        self, precision: Mapping[str, str], graphs: Sequence[int] | None = None
    ) -> list[tuple[np.ndarray, frozenset[int]]]:
        """Per compiled graph (or those at positions ``graphs``): the op durations under
        ``precision`` and the ops whose folded cast would follow them (`CompiledGraph.run`)."""
        positions = range(len(self._compiled)) if graphs is None else graphs
        keys, forward, backward, before, after = [], [], [], [], []
        for trace in self._traces:
            for move in plan_moves(trace, precision):
                k = self._keys.get((trace.rank, move.layer))
                if k is None:
                    continue
                forward_scale, backward_scale, before_us, after_us = self._move(trace, k, move)
                keys.append(k)
                forward.append(forward_scale)
                backward.append(backward_scale)
                before.append(before_us)
                after.append(after_us)
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
        self._passed_back: dict[str, list[TensorLife]] = {}  # per layer: the gradients it hands on
        for life in lives:
            birth, death = life.birth_op, life.death_op
            born, died = (None if op is None else op.layer for op in (birth, death))
            if born == died:  # not handed from one layer to another
                continue
            if (
                life.category == "temporaries"
                and born is not None
                and birth.kind == "backward"
                and death is not None
            ):
                self._passed_back.setdefault(born, []).append(life)
            if life.category == "activations" and died is not None and death.kind == "backward":
                key = (life.step, died)  # an input saved for this layer's backward, freed there
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
        self._move_lives: dict[LayerMove, list[TensorLife]] = {}
        self._events: dict[LayerMove, dict[int, Events]] = {}
        self._backward_end = {
            (step, layer): end for (step, layer, kind), (_, end) in spans.items() if kind == "backward"
        }

    def __call__(self, precision: Mapping[str, str]) -> list[dict[int, Events]]:
        """The synthetic tensors of ``precision``, per layer it changes (`memory.lifetime_events`)."""
        out = []
        for move in plan_moves(self.trace, precision):
            if move not in self._events:
                self._events[move] = lifetime_events(self._kept_lives(move))
            out.append(self._events[move])
        return out

    def saved(self, precision: Mapping[str, str]) -> list[TensorLife]:
        """The synthetic tensors of ``precision`` that stand for the change in what its layers save
        for backward (category ``activations``, each with its ``layer``)."""
        return [
            life
            for move in plan_moves(self.trace, precision)
            for life in self._kept_lives(move)
            if life.category == "activations"
        ]

    def _kept_lives(self, move: LayerMove) -> list[TensorLife]:
        """`_lives` of ``move``, made once."""
        if move not in self._move_lives:
            self._move_lives[move] = self._lives(move)
        return self._move_lives[move]

    def _lives(self, move: LayerMove) -> list[TensorLife]:
        """The synthetic tensors of ``move`` (see the class docstring)."""
        layer = move.layer
        if move.passed:
            return self._pass_through_lives(move)
        entry = self.trace.precision_costs["layers"][layer]
        low, base = entry["costs"][move.precision], entry["costs"][FULL_PRECISION]
        extra = []
        for step, kind, start, end in self._spans.get(layer, []):
            scale = input_scale(entry, self._first_forward.get((step, layer)))
            transient = low.get(f"{kind}_transient_bytes", 0) - base.get(f"{kind}_transient_bytes", 0)
            extra.append(
                TensorLife(-1, int(transient * scale), step, start, end, None, None, "temporaries", layer)
            )
            backward_end = self._backward_end.get((step, layer))
            if kind == "forward" and backward_end is not None:
                activations, weight = _saved_bytes(low, scale)
                saved = activations - self._freed.get((step, layer), 0)
                if move.receives:  # it saves the low-precision tensor it is given, no copy of its own
                    saved = min(saved, 0)
                saved += weight
                release = self._released.get((step, layer), backward_end)
                extra.append(TensorLife(-1, saved, step, end, release, None, None, "activations", layer))
        return extra + (self._gradients_handed_on(move) if move.receives else [])

    def _gradients_handed_on(self, move: LayerMove) -> list[TensorLife]:
        """Inside a link the gradients flow back at its precision too: what the backward of a
        pass-through or receiving layer hands to the layer before it shrinks to that precision's
        element size (recorded lives, negative synthetic tensors of the difference)."""
        shrink = 1 - ELEMENT_BYTES[move.precision] / ELEMENT_BYTES[FULL_PRECISION]
        return [
            TensorLife(
                -1,
                -int(life.bytes * shrink),
                life.step,
                life.birth_us,
                life.death_us,
                None,
                None,
                "temporaries",
                move.layer,
            )
            for life in self._passed_back.get(move.layer, [])
        ]

    def _pass_through_lives(self, move: LayerMove) -> list[TensorLife]:
        """A pass-through layer run at a link's precision saves what its probe saved at it instead
        of at fp32, from the end of its forward to the end of its backward, and hands its gradient
        on at the precision."""
        entry = self.trace.precision_costs.get("pass_through", {}).get(move.layer)
        if entry is None or move.precision not in entry["costs"]:  # it never ran in the recorded steps
            return self._gradients_handed_on(move)
        change = entry["costs"][move.precision]["saved_bytes"] - entry["costs"][FULL_PRECISION]["saved_bytes"]
        return self._gradients_handed_on(move) + [
            TensorLife(
                -1,
                int(change * input_scale(entry, self._first_forward.get((step, move.layer)))),
                step,
                end,
                self._backward_end[(step, move.layer)],
                None,
                None,
                "activations",
                move.layer,
            )
            for step, kind, _, end in self._spans.get(move.layer, [])
            if kind == "forward" and (step, move.layer) in self._backward_end
        ]


def _saved_bytes(probe: Mapping, scale: float) -> tuple[int, int]:
    """What a layer saves for backward in a step whose activations are ``scale`` times the probe's:
    (activations, scaled; its low-precision weight copy, not scaled). A probe without the split
    counts all it saved as activations."""
    if "saved_activation_bytes" not in probe:
        return int(probe["saved_bytes"] * scale), 0
    return int(probe["saved_activation_bytes"] * scale), int(probe.get("saved_weight_bytes", 0))
