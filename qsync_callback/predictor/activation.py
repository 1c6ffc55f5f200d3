"""What a per-module activation policy does to the recorded step: recompute and offload priced as
changes to the recorded graph and liveness (G10's inactive periods; checkpointing as PyTorch's
non-reentrant `torch.utils.checkpoint` runs it).

A policy names a **module**: a recorded layer, or any module holding recorded layers (a block such
as ``net.0``, whose name is a dotted prefix of its layers' names; `module_layers`). Checkpointing a
single leaf saves little (it keeps its input, and its output is saved by the next layer); a block
drops everything saved inside it.

A module's ops in one recorded step (`ModuleSpan`): the forward ops of its layers, with, for a
block, the ops of no layer between them and after them up to the next layer's op (a residual add
written in the block's ``forward``); and the backward ops of its layers, with, for a block, the ops
of no layer before them back to the previous layer's (the add's backward runs before the block's).
A layer's span is its own ops: the ops of no layer after it (a functional GELU after an
``nn.Linear``) run in its caller's forward, outside its hooks and its checkpoint. The ops of no
layer before the model's first layer or after its last (the loss) belong to no module.

What it saved: the recorded activations (born in forward, freed in backward, `memory.TensorLife`)
freed by one of its backward ops: born in its forward (``inside``), or born before it and last held
by it (``held``: its input, say). Those its last forward op made are its output (``outputs``): the
next module holds them too (it is handed them; it saves them where it needs them), so neither
policy frees them; an offload still copies them.

- **Recompute.** The forward keeps the module's input and drops what the module saves inside: each
  such tensor dies at the end of the op after the one that made it (its consumer), instead of in
  backward. Right before the module's first backward op, its forward runs again (the forward ops'
  time and host gaps, at the plan's precision, times what a recompute trial measured the run's
  steps to pay over that price, where one told that apart from the price (`price_stands`):
  ``Trace.activation_costs["recompute"]["in_step"]``, `activation_trial`, `recompute_trials`), and
  the tensors are made again then, all of them, with the largest total of the forward's own
  temporaries alive at once; they die where they died in the recording.
- **Offload.** Every tensor it saved (``inside``, ``held`` and ``outputs``) of at least
  `MIN_OFFLOAD_BYTES` is copied to the store on a copy lane of its own (one queue for both
  directions, in request order; each copy takes ``alpha + beta * bytes`` of that direction,
  `Trace.activation_costs["copy"]`, times what an offload trial measured the run's steps to pay
  over that price, where one measured a change: ``["copy"]["in_step"]["factor"]``,
  `activation_trial`): a copy to the store is requested when the op that made the tensor ends (for
  ``held``: the module's first forward op), and the tensor is freed when both its copy is done and
  its consumer has run. The copies back are requested when the backward reaches the next offloaded
  module in forward order (its first backward op starts; the last one offloaded: its own first
  backward op), and the tensor is alive again from then. The module's first backward op waits until
  its tensors are back: only a late copy costs time. That is the CUDA tier (copies on a side
  stream); on the CPU's disk tier (`overlaps`) each copy to the store is waited for by the op that
  made the tensor, and each copy back by the module's first backward op, whole: the copies run on
  the cores the step runs on, and the tensor is freed when its consumer has run. What it ``held``
  (its input) is copied too but counted as still alive: its caller may hold it for longer than the
  record shows (a residual block's input, used again by the add after the block's first op, was
  measured not to come down at the peak in some runs), so the predicted peak errs high rather than
  low. An input that a backward outside the module frees last (a ReLU's output, which the ReLU
  saved) is not the module's: the applier leaves it where it is, and it is neither copied nor freed
  here.

Time is priced on the compiled graphs (`replay.CompiledGraph`), on top of the precision plan's op
durations: the recompute's time is added to the module's first backward op; an offload's wait is
found by replaying once, laying out the copy lane on the replayed times, and adding each module's
wait to its first backward op (twice: the second pass sees the first's waits). Memory is priced on
the recorded clock as synthetic tensors (`memory.lifetime_events`), merged into the curve.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import KEEP, MIN_OFFLOAD_BYTES, OFFLOAD, RECOMPUTE, holds, module_layers
from qsync_callback.predictor.graph import op_node
from qsync_callback.predictor.memory import Events, TensorLife, lifetime_events
from qsync_callback.predictor.replay import CompiledGraph
from qsync_callback.recorder.copy_costs import copies_us
from qsync_callback.recorder.trace import Op, Trace

_REMADE_US = 1e-3  # the recompute's tensors are made this long before the first backward op


def nested_pairs(names: Sequence[str]) -> list[tuple[str, str]]:
    """The (outer, inner) pairs of ``names`` where one module holds the other."""
    return [(a, b) for a in names for b in names if a != b and holds(a, b)]


@dataclass
class ModuleSpan:
    """One module's ops and saved tensors in one recorded step (see the module docstring)."""

    forward: list[Op]
    backward: list[Op]
    inside: list[TensorLife] = field(default_factory=list)
    held: list[TensorLife] = field(default_factory=list)
    outputs: list[TensorLife] = field(default_factory=list)
    forward_temporaries: int = 0  # the most bytes of its forward's own temporaries alive at once
    freed_at: dict[int, float] = field(default_factory=dict)  # id(life) -> its consumer's end

    @property
    def saved(self) -> list[TensorLife]:
        """What an offload copies to the store: everything the module saved."""
        return self.inside + self.held + self.outputs

    @property
    def first_backward(self) -> Op:
        return self.backward[0]


def _extend(ordered: list[Op], lo: int, hi: int, forward: bool, block: bool) -> list[Op]:
    """The ops of ``ordered`` (one step, one phase, by start) from the module's first member (at
    ``lo``) to its last (at ``hi``); for a ``block`` (a module that is not itself a layer), with the
    ops of no layer after the last (forward) or before the first (backward) up to the nearest op of
    a layer (none where no op of a layer lies beyond them). A layer's own ops are all in its range:
    the ops of no layer after it run in its caller's forward, outside its hooks and its checkpoint."""
    if not block:
        return ordered[lo : hi + 1]
    if forward:
        k = hi + 1
        while k < len(ordered) and ordered[k].layer is None:
            k += 1
        if k < len(ordered):
            hi = k - 1
    else:
        k = lo - 1
        while k >= 0 and ordered[k].layer is None:
            k -= 1
        if k >= 0:
            lo = k + 1
    return ordered[lo : hi + 1]


def _bounds(ordered: Sequence[Op]) -> dict[str, tuple[int, int]]:
    """Per layer: the first and last position of its ops in ``ordered``."""
    bounds: dict[str, tuple[int, int]] = {}
    for k, op in enumerate(ordered):
        if op.layer is not None:
            first, _ = bounds.get(op.layer, (k, k))
            bounds[op.layer] = (first, k)
    return bounds


def module_spans(
    trace: Trace, lives: Sequence[TensorLife], modules: Sequence[str]
) -> dict[tuple[int, str], ModuleSpan]:
    """Per (recorded step, module): its `ModuleSpan`, for the modules with forward and backward ops
    on the training thread in that step."""
    members_of = module_layers([layer["name"] for layer in trace.layers])
    by_step: dict[int, dict[str, list[Op]]] = {}
    for op in trace.ops:
        if op.thread == "main" and op.kind in ("forward", "backward"):
            by_step.setdefault(op.step, {"forward": [], "backward": []})[op.kind].append(op)
    spans: dict[tuple[int, str], ModuleSpan] = {}
    for step, phases in by_step.items():
        forward = sorted(phases["forward"], key=lambda o: o.start_us)
        backward = sorted(phases["backward"], key=lambda o: o.start_us)
        forward_at, backward_at = _bounds(forward), _bounds(backward)
        for name in modules:
            layers = members_of.get(name, frozenset())
            fwd = [forward_at[layer] for layer in layers if layer in forward_at]
            bwd = [backward_at[layer] for layer in layers if layer in backward_at]
            if fwd and bwd:
                block = layers != {name}
                spans[(step, name)] = ModuleSpan(
                    _extend(forward, min(a for a, _ in fwd), max(b for _, b in fwd), True, block),
                    _extend(backward, min(a for a, _ in bwd), max(b for _, b in bwd), False, block),
                )
    _attach_lives(spans, lives)
    return spans


def _attach_lives(spans: dict[tuple[int, str], ModuleSpan], lives: Sequence[TensorLife]) -> None:
    """Give each span the activations it saved, when each would be freed by its consumer, and its
    forward's most temporaries alive at once."""
    saved_by: dict[int, list[TensorLife]] = {}  # backward op id -> the activations it freed
    made_by: dict[int, list[TensorLife]] = {}  # forward op id -> the temporaries it made
    for life in lives:
        if life.birth_op is None or life.death_op is None:
            continue
        if life.category == "activations":
            saved_by.setdefault(life.death_op.id, []).append(life)
        elif life.category == "temporaries":
            made_by.setdefault(life.birth_op.id, []).append(life)
    for span in spans.values():
        position = {op.id: k for k, op in enumerate(span.forward)}
        last = span.forward[-1].id
        for op in span.backward:
            for life in saved_by.get(op.id, ()):
                born = life.birth_op.id
                if born == last:
                    span.outputs.append(life)
                elif born in position:
                    span.inside.append(life)
                    consumer = span.forward[min(position[born] + 1, len(span.forward) - 1)]
                    span.freed_at[id(life)] = consumer.end_us
                else:
                    span.held.append(life)
                    span.freed_at[id(life)] = max(life.birth_us, span.forward[0].end_us)
        temporaries = [
            change
            for op in span.forward
            for life in made_by.get(op.id, ())
            if life.death_op.id in position
            for change in ((life.birth_us, life.bytes), (life.death_us, -life.bytes))
        ]
        temporaries.sort()
        span.forward_temporaries = int(max(np.cumsum([b for _, b in temporaries]), default=0))


def _remade_at(span: ModuleSpan) -> float:
    """When a recompute makes the module's tensors again: just before its first backward op."""
    return span.first_backward.start_us - _REMADE_US


def price_stands(change_ms: float, noise_ms: float, priced_ms: float, price: str) -> str | None:
    """Why a recompute trial's measured change (``change_ms`` +- ``noise_ms``) leaves the recompute
    priced by ``price`` alone (``priced_ms``: the recorded forward's), or None where it tells itself
    from that price: a factor taken on a change within its noise of the price would move every
    module's price by chance. On this 2-core VM a whole-model trial's noise was +-1.1 to +-7.7 ms on
    changes of 4-46 ms. The offload trial is not held to it (`activation_trial`: the copy-cost fit
    it is priced against moves between measurements by more than that)."""
    if abs(change_ms - priced_ms) <= noise_ms:
        return (
            f"the step's change ({change_ms:+.2f} ms) is within its noise (+-{noise_ms:.2f} ms) of "
            f"{price} ({priced_ms:.2f} ms)"
        )
    return None


def _copy_us(costs: Mapping, direction: str, nbytes: int) -> float:
    """The copy's time by the fit, times what the step was measured to pay over the fit's price where
    an offload trial measured it (`activation_trial`)."""
    factor = (costs.get("in_step") or {}).get("factor") or 1.0
    return copies_us(costs, direction, nbytes) * factor


def overlaps(costs: Mapping) -> bool:
    """Whether the store's copies overlap the training thread's work: on CUDA (a side stream), not
    on the CPU's disk tier, whose writes the training thread waits for (the store runs them
    synchronously: a backlog of writes would keep the tensors alive) and whose reads share the
    cores the step's ops run on (their time is the step's)."""
    return costs.get("tier", "disk") != "disk"


def _lane(requests: Sequence[tuple[float, float, object]]) -> dict[object, tuple[float, float]]:
    """Lay out copies on one queue in request order: key -> (start, end)."""
    done, free = {}, -np.inf
    for at, took, key in sorted(requests, key=lambda r: r[0]):
        start = max(at, free)
        free = start + took
        done[key] = (start, free)
    return done


def check_activation_plan(traces: Sequence[Trace], activation: Mapping[str, str], source: str) -> None:
    """Refuse an activation plan this trace cannot price or this run cannot carry out: a module of no
    recorded layer, modules nested in each other both with a policy, one the recorder refused (with
    its reason), or an offload where the trace has no fitted copy cost."""
    acting = [name for name, policy in activation.items() if policy != KEEP]
    if not acting:
        return
    modules = module_layers([layer["name"] for layer in traces[0].layers])
    unknown = [name for name in acting if name not in modules]
    if unknown:
        raise QSyncInputError(
            f"{source}: activation names modules that hold no recorded layer: {', '.join(unknown)}"
        )
    nested = nested_pairs(acting)
    if nested:
        outer, inner = nested[0]
        raise QSyncInputError(
            f"{source}: activation: {inner!r} is inside {outer!r}; give a policy to one of them"
        )
    refused = traces[0].activation_costs.get("refused", {})
    for name in acting:
        if name in refused:
            raise QSyncInputError(f"{source}: activation: {name!r} cannot take a policy: {refused[name]}")
    if any(activation[name] == OFFLOAD for name in acting):
        missing = [t.rank for t in traces if "copy" not in t.activation_costs]
        if missing:
            raise QSyncInputError(
                f"{source}: offload cannot be priced: rank {missing[0]}'s trace has no fitted copy cost "
                "(record it with QSyncCallback(mode='apply'))"
            )


class ActivationPricing:
    """Activation policies priced on the recorded graphs (compiled once) and curves of all ranks;
    ``recorded``: per graph, the recorded configuration's op durations (the recompute trials'
    factors are taken against the recompute priced on them)."""

    def __init__(
        self,
        graphs: Sequence[nx.DiGraph],
        compiled: Sequence[CompiledGraph],
        traces: Sequence[Trace],
        lives: Sequence[Sequence[TensorLife]],
        recorded: Sequence[np.ndarray],
    ):
        self._traces = list(traces)
        self._compiled = list(compiled)
        self.modules = sorted(module_layers([layer["name"] for layer in traces[0].layers]))
        self._spans = [
            module_spans(t, rank_lives, self.modules) for t, rank_lives in zip(traces, lives, strict=True)
        ]
        # per graph: (rank, step) of each rank's step in it
        self._steps_in = [[(t.rank, t.steps[g].index) for t in self._traces] for g in range(len(graphs))]
        self._events: dict[tuple[int, str, str, str | None], dict[int, Events]] = {}
        self.recompute_trials = [self._recompute_trial(k, recorded) for k in range(len(self._traces))]

    def spans(self, rank_position: int) -> dict[tuple[int, str], ModuleSpan]:
        """The `ModuleSpan`s of the trace at ``rank_position``."""
        return self._spans[rank_position]

    def _recompute_trial(self, k: int, recorded: Sequence[np.ndarray]) -> dict[str, Any] | None:
        """Rank position ``k``'s recompute trial (`activation_trial.RecomputeTrial`) with its
        ``priced_ms`` (the same recompute priced on the recorded durations, the median over the
        recorded steps; given where the trial could not tell too) and ``factor`` (the measured
        change over that price; None where the trial could not tell its change from nothing or from
        that price, or nothing was priced); None where no trial ran."""
        trial = self._traces[k].activation_costs.get("recompute", {}).get("in_step")
        if trial is None:
            return None
        acting = dict.fromkeys(trial["modules"], RECOMPUTE)
        priced_us = statistics.median(
            sum(self._recompute_added(acting, g, dur, k).values()) for g, dur in enumerate(recorded)
        )
        out = {**trial, "priced_ms": priced_us / 1e3, "factor": None}
        if "note" in trial:
            return out
        if priced_us <= 0:
            return {**out, "note": "the trial's modules recompute nothing in the recorded steps"}
        note = price_stands(
            trial["change_ms"], trial["noise_ms"], priced_us / 1e3, "the recorded forward's price"
        )
        if note is not None:
            return {**out, "note": note}
        return {**out, "factor": trial["change_ms"] * 1e3 / priced_us}

    def _recompute_added(
        self, activation: Mapping[str, str], g: int, dur: np.ndarray, k: int
    ) -> dict[int, float]:
        """Per op index of graph ``g``: the recompute time rank position ``k``'s modules add before it
        (their forward ops' durations ``dur`` and host gaps), as recorded (no trial's factor)."""
        comp = self._compiled[g]
        rank, step = self._steps_in[g][k]
        added: dict[int, float] = {}
        for name, policy in activation.items():
            span = self._spans[k].get((step, name))
            if policy != RECOMPUTE or span is None:
                continue
            ids = [comp.index[op_node(rank, op.id)] for op in span.forward]
            first = comp.index[op_node(rank, span.first_backward.id)]
            added[first] = added.get(first, 0.0) + float(np.sum(dur[ids]) + np.sum(comp.gap[ids]))
        return added

    def recompute_us(self, activation: Mapping[str, str], g: int, dur: np.ndarray) -> dict[int, float]:
        """Per op index of graph ``g``: the recompute time added before it (its module's forward ops'
        durations ``dur`` and host gaps, times its rank's recompute trial's factor where it has one)."""
        added: dict[int, float] = {}
        for k in range(len(self._steps_in[g])):
            trial = self.recompute_trials[k]
            factor = (trial or {}).get("factor") or 1.0
            for index, us in self._recompute_added(activation, g, dur, k).items():
                added[index] = added.get(index, 0.0) + us * factor
        return added

    def durations(
        self,
        activation: Mapping[str, str],
        runs: Sequence[tuple[np.ndarray, frozenset[int]]],
        graphs: Sequence[int],
    ) -> list[tuple[np.ndarray, frozenset[int]]]:
        """``runs`` (op durations per graph at positions ``graphs``, `PrecisionDurations`) with the
        recomputes' time and the offloads' waits added."""
        out = []
        for g, (dur, moved) in zip(graphs, runs, strict=True):
            planned = dur.copy()
            for index, us in self.recompute_us(activation, g, dur).items():
                planned[index] += us
            if any(policy == OFFLOAD for policy in activation.values()):
                base = planned.copy()
                for _ in range(2):
                    waits = self._offload_waits(activation, g, self._compiled[g].run(planned, moved))
                    planned = base.copy()
                    for index, us in waits.items():
                        planned[index] += us
            out.append((planned, moved))
        return out

    def _offloaded(self, activation: Mapping[str, str], k: int, step: int) -> list[tuple[str, ModuleSpan]]:
        """The offloaded modules' spans of rank position ``k`` in ``step``, in forward order."""
        found = [
            (name, self._spans[k][(step, name)])
            for name, policy in activation.items()
            if policy == OFFLOAD and (step, name) in self._spans[k]
        ]
        return sorted(found, key=lambda item: item[1].forward[0].start_us)

    def _copy_requests(
        self,
        offloaded: Sequence[tuple[str, ModuleSpan]],
        costs: Mapping,
        when,
        followers: Mapping[str, ModuleSpan] | None = None,
    ) -> tuple[list[tuple[float, float, object]], dict[str, float]]:
        """The copy lane's requests of ``offloaded`` (to the store, then back) at the times ``when``
        gives an op (``when(op, start=True)``), and each module's time its tensors are asked back
        (at the backward of the next offloaded module, or of its module in ``followers``)."""
        requests: list[tuple[float, float, object]] = []
        asked: dict[str, float] = {}
        for position, (name, span) in enumerate(offloaded):
            inside = {id(life) for life in span.inside}
            moved = [life for life in span.saved if life.bytes >= MIN_OFFLOAD_BYTES]
            trigger = offloaded[position + 1][1] if position + 1 < len(offloaded) else span
            if followers is not None:
                trigger = followers.get(name, span)
            asked[name] = when(trigger.first_backward, True)
            for life in moved:
                made = life.birth_op if id(life) in inside else span.forward[0]
                requests.append(
                    (when(made, False), _copy_us(costs, "to_store", life.bytes), ("out", id(life)))
                )
                requests.append((asked[name], _copy_us(costs, "from_store", life.bytes), ("in", id(life))))
        return requests, asked

    def _offload_waits(self, activation: Mapping[str, str], g: int, timing) -> dict[int, float]:
        """Per op index of graph ``g``: how long it waits for its module's tensors to come back."""
        comp = self._compiled[g]
        waits: dict[int, float] = {}
        for k, (rank, step) in enumerate(self._steps_in[g]):
            offloaded = self._offloaded(activation, k, step)
            if not offloaded:
                continue

            def when(op: Op, start: bool, rank: int = rank) -> float:
                i = comp.index[op_node(rank, op.id)]
                return float(timing.start[i] if start else timing.end[i])

            costs = self._traces[k].activation_costs["copy"]
            if not overlaps(costs):
                for _, span in offloaded:
                    for life in span.saved:
                        if life.bytes >= MIN_OFFLOAD_BYTES:
                            inside = any(op.id == life.birth_op.id for op in span.forward)
                            made = life.birth_op if inside else span.forward[0]
                            for op, direction in ((made, "to_store"), (span.first_backward, "from_store")):
                                i = comp.index[op_node(rank, op.id)]
                                waits[i] = waits.get(i, 0.0) + _copy_us(costs, direction, life.bytes)
                continue
            requests, _ = self._copy_requests(offloaded, costs, when)
            lane = _lane(requests)
            for _, span in offloaded:
                back = max(
                    (lane[key][1] for life in span.saved if (key := ("in", id(life))) in lane),
                    default=-np.inf,
                )
                first = comp.index[op_node(rank, span.first_backward.id)]
                waits[first] = waits.get(first, 0.0) + max(0.0, back - float(timing.start[first]))
        return waits

    def lives(
        self, activation: Mapping[str, str], neighbours_offloaded: bool = False
    ) -> list[list[dict[int, Events]]]:
        """Per rank position: the synthetic tensors of ``activation`` (`memory.lifetime_events`).

        ``neighbours_offloaded``: as if the module after each offloaded one in forward (the
        outermost that starts there) were offloaded too, so its tensors are asked back when the
        backward reaches that one: what an offload frees in any plan it joins (a planner's
        conservative price of one option)."""
        out = []
        for k, trace in enumerate(self._traces):
            rank_events = []
            recompute = sorted(name for name, policy in activation.items() if policy == RECOMPUTE)
            for name in recompute:
                key = (k, name, RECOMPUTE, None)
                if key not in self._events:
                    self._events[key] = lifetime_events(self._recompute_lives(k, name))
                rank_events.append(self._events[key])
            offloaded = tuple(sorted(name for name, policy in activation.items() if policy == OFFLOAD))
            if offloaded:
                key = (k, ",".join(offloaded), OFFLOAD, neighbours_offloaded)
                if key not in self._events:
                    self._events[key] = lifetime_events(
                        self._offload_lives(k, activation, trace, neighbours_offloaded)
                    )
                rank_events.append(self._events[key])
            out.append(rank_events)
        return out

    def away(
        self, activation: Mapping[str, str], k: int, neighbours_offloaded: bool = False
    ) -> dict[tuple[int, str], tuple[float, float]]:
        """Per (step, module) of ``activation`` at rank position ``k``: from the start of the
        module's forward, whose saved tensors are dropped (recompute) or written out (offload) as
        they are saved, until they are back (the recompute makes them again, or their copy back is
        asked for; ``neighbours_offloaded`` as in `lives`). On CUDA a copy out ends a little later."""
        out: dict[tuple[int, str], tuple[float, float]] = {}
        for step in sorted({step for step, _ in self._spans[k]}):
            offloaded = self._offloaded(activation, k, step)
            _, asked = self._recorded_requests(k, step, offloaded, neighbours_offloaded)
            for name, policy in activation.items():
                span = self._spans[k].get((step, name))
                if span is not None:
                    back = _remade_at(span) if policy == RECOMPUTE else asked[name]
                    out[(step, name)] = (span.forward[0].start_us, back)
        return out

    def _recorded_requests(
        self, k: int, step: int, offloaded: Sequence[tuple[str, ModuleSpan]], neighbours_offloaded: bool
    ) -> tuple[list[tuple[float, float, object]], dict[str, float]]:
        """`_copy_requests` of ``offloaded`` at rank position ``k`` in ``step``, on the recorded
        clock (``neighbours_offloaded`` as in `lives`)."""
        if not offloaded:
            return [], {}
        return self._copy_requests(
            offloaded,
            self._traces[k].activation_costs["copy"],
            lambda op, start: op.start_us if start else op.end_us,
            self._followers(k, step, offloaded) if neighbours_offloaded else None,
        )

    def _followers(
        self, k: int, step: int, offloaded: Sequence[tuple[str, ModuleSpan]]
    ) -> dict[str, ModuleSpan]:
        """Per offloaded module: the outermost module that starts where it ends in forward (the one
        whose backward comes first of those that start there)."""
        spans = [span for (s, _), span in self._spans[k].items() if s == step]
        out = {}
        for name, span in offloaded:
            after = [s for s in spans if s.forward[0].start_us >= span.forward[-1].end_us]
            if after:
                first = min(s.forward[0].start_us for s in after)
                out[name] = min(
                    (s for s in after if s.forward[0].start_us == first),
                    key=lambda s: s.first_backward.start_us,
                )
        return out

    def _recompute_lives(self, k: int, name: str) -> list[TensorLife]:
        """Each tensor saved inside the module gone from its consumer's end until the recompute, and
        the recompute's temporaries (see the module docstring)."""
        out = []
        for (step, module), span in self._spans[k].items():
            if module != name:
                continue
            remade = _remade_at(span)
            for life in span.inside:
                gone = span.freed_at[id(life)]
                if gone < remade:
                    out.append(
                        TensorLife(-1, -life.bytes, step, gone, remade, None, None, "activations", name)
                    )
            if span.forward_temporaries:
                out.append(
                    TensorLife(
                        -1,
                        span.forward_temporaries,
                        step,
                        remade,
                        span.first_backward.start_us,
                        None,
                        None,
                        "temporaries",
                        name,
                    )
                )
        return out

    def _offload_lives(
        self, k: int, activation: Mapping[str, str], trace: Trace, neighbours_offloaded: bool
    ) -> list[TensorLife]:
        """Each offloaded tensor gone from when its copy to the store is done (and its consumer has
        run) until its copy back is asked for (see the module docstring and `lives`)."""
        out = []
        steps = {step for step, _ in self._spans[k]}
        for step in sorted(steps):
            offloaded = self._offloaded(activation, k, step)
            if not offloaded:
                continue
            requests, asked = self._recorded_requests(k, step, offloaded, neighbours_offloaded)
            lane = _lane(requests)
            serial = not overlaps(trace.activation_costs["copy"])
            for name, span in offloaded:
                for life in span.inside:  # not ``held``: see the module docstring
                    if life.bytes < MIN_OFFLOAD_BYTES:
                        continue
                    written = span.freed_at[id(life)] if serial else lane[("out", id(life))][1]
                    gone = max(span.freed_at[id(life)], written)
                    if gone < asked[name]:
                        out.append(
                            TensorLife(
                                -1, -life.bytes, step, gone, asked[name], None, None, "activations", name
                            )
                        )
        return out
