"""What a per-layer precision plan does to the recorded step: QSync's cost mapping as graph and
liveness transforms.

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
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import networkx as nx

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import FULL_PRECISION
from qsync_callback.predictor.memory import TensorLife
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
    by_rank = {t.rank: t for t in traces}
    ops_by_rank = {t.rank: {op.id: op for op in t.ops} for t in traces}
    layer_nodes: dict[tuple[int, str, str], list[str]] = {}
    for node, attrs in graph.nodes(data=True):
        if (
            attrs["layer"] is not None
            and attrs["kind"] in ("forward", "backward")
            and attrs["rank"] is not None
        ):
            layer_nodes.setdefault((attrs["rank"], attrs["layer"], attrs["kind"]), []).append(node)
    for rank, trace in by_rank.items():
        costs = trace.precision_costs
        for layer, p in changed_layers(trace, precision).items():
            forward_scale, backward_scale = layer_time_scales(costs, layer, p)
            forward = sorted(
                layer_nodes.get((rank, layer, "forward"), []), key=lambda n: graph.nodes[n]["recorded_start"]
            )
            for node in forward:
                out.nodes[node]["dur"] *= forward_scale
            for node in layer_nodes.get((rank, layer, "backward"), []):
                out.nodes[node]["dur"] *= backward_scale
            if not forward:
                continue
            first = graph.nodes[forward[0]]
            scale = input_scale(costs["layers"][layer], ops_by_rank[rank].get(first["op_id"]))
            before_us, after_us = layer_casts_us(costs, layer, p, scale)
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


def precision_lives(
    trace: Trace, lives: Sequence[TensorLife], precision: Mapping[str, str]
) -> list[TensorLife]:
    """Synthetic tensors for what each changed layer adds to (or takes from) the memory curve, per
    recorded step: its saved-for-backward bytes, alive from the end of its forward until its
    backward lets them go (when the recorded fp32 ones died, else the backward's end), and the
    change in its forward's and backward's temporaries, alive while they run."""
    changed = changed_layers(trace, precision)
    if not changed:
        return []
    freed: dict[tuple[int, str], int] = {}
    released: dict[tuple[int, str], float] = {}  # when the layer's backward let its saved tensors go
    for life in lives:
        death = life.death_op
        if (
            life.category == "activations"
            and death is not None
            and death.kind == "backward"
            and death.layer in changed
            and (life.birth_op is None or life.birth_op.layer != death.layer)  # an input, not its own
        ):
            key = (life.step, death.layer)
            freed[key] = freed.get(key, 0) + life.bytes
            released[key] = max(released.get(key, life.death_us), life.death_us)
    spans: dict[tuple[int, str, str], list[float]] = {}
    first_forward: dict[tuple[int, str], Op] = {}
    for op in trace.ops:
        if op.layer in changed and op.kind in ("forward", "backward"):
            span = spans.setdefault((op.step, op.layer, op.kind), [op.start_us, op.end_us])
            span[0], span[1] = min(span[0], op.start_us), max(span[1], op.end_us)
            held = first_forward.get((op.step, op.layer))
            if op.kind == "forward" and (held is None or op.start_us < held.start_us):
                first_forward[(op.step, op.layer)] = op
    layers = trace.precision_costs["layers"]
    extra = []
    for (step, layer, kind), (start, end) in sorted(spans.items()):
        costs = layers[layer]["costs"]
        low, base = costs[changed[layer]], costs[FULL_PRECISION]
        scale = input_scale(layers[layer], first_forward.get((step, layer)))
        transient = low.get(f"{kind}_transient_bytes", 0) - base.get(f"{kind}_transient_bytes", 0)
        extra.append(
            TensorLife(-1, int(transient * scale), step, start, end, None, None, "temporaries", layer)
        )
        backward = spans.get((step, layer, "backward"))
        if kind == "forward" and backward is not None:
            saved = _saved_bytes(low, scale) - freed.get((step, layer), 0)
            release = released.get((step, layer), backward[1])
            extra.append(TensorLife(-1, saved, step, end, release, None, None, "activations", layer))
    return extra


def _saved_bytes(probe: Mapping, scale: float) -> int:
    """What a layer saves for backward in a step whose activations are ``scale`` times the probe's:
    the activations scaled, the low-precision weight copy not."""
    if "saved_activation_bytes" not in probe:
        return int(probe["saved_bytes"] * scale)
    return int(probe["saved_activation_bytes"] * scale + probe.get("saved_weight_bytes", 0))
