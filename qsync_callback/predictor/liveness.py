"""Tensor liveness of recorded steps (G10's tool): each tensor saved for backward with its inactive
period, each op's kernels, and the memory curve split by kind. Pure functions over traces, their
replay and (for kernels) the profiler's own trace; `qsync_callback.liveness_report` writes them.

**Saved tensors.** The ``activations`` of `memory.tensor_lifetimes`: born in a forward op (``made
by``), freed in a backward op (``freed by``). The trace has no per-op tensor addresses, so the
uses in between are read from what links the two phases:

- ``saved by``: the forward op whose backward freed it, by autograd's sequence number (the forward
  op with the largest number not above the freeing op's: an outermost op's nested ops take the
  numbers after its own). Its backward released the tensor, so it held it: it read or made it in
  forward. Where the freeing op has no number (``AccumulateGrad``), or the link lands before the
  op that made the tensor, it is the op that made it.
- ``last use in forward``: the last op of the saving layer's forward run that holds the saving op
  (the consecutive forward ops of that layer on its thread); the saving op itself where it runs
  in no layer. Autograd packs what a layer saves while its forward runs, and a per-layer policy
  (offload, recompute) acts on the layer as a whole: the tensor can leave once that run is over.
- ``first use in backward``: the first op of the freeing op's layer's backward run that holds the
  freeing op (the layer's backward ops unpack what it saved); the freeing op itself where it runs
  in no layer.
- ``inactive period``: from the replayed end of the last use in forward to the replayed start of
  the first use in backward: the time an offload has to move the tensor out and back. A tensor
  a later layer reads too (a layer's output that the next one saves) is used inside that period
  as well: the trace cannot tell, so the period is the saving layer's.

Times are the replay's (`replay.replay` of each recorded step's global graph, the recorded
configuration with the profiler's share removed), in microseconds from the step's start.

**Kernels.** Per recorded op, the events of the profiler's own (Kineto) trace that ran inside it:
on CPU every nested op event on its thread (``depth`` 1 for a direct child, ``self_us`` its
duration less its children's); on CUDA the device kernels, copies and memsets launched from inside
it (matched by correlation id); an op recorded on a device stream is its own one kernel. An op with
none lists none.

**Memory curve.** Per step, the bytes alive of each kind (`KINDS`) at each moment, on the trace's
own clock: the resident bytes at the step's start (``parameters``: parameters and buffers;
``gradients``: gradients and DDP's buckets; ``optimizer_state``; ``other``: the rest), then each
birth and death of `memory.tensor_lifetimes` in `memory.lifetime_events`' order (the predictor's
curve, so the peak equals `memory.predict_memory`'s), one point per distinct time (the level after
all its events). A resident tensor freed in the step comes off the resident gradients first (last
step's, which ``zero_grad(set_to_none=True)`` frees), then the other resident bytes, the optimizer
state and the parameters.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from qsync_callback.errors import QSyncInputError
from qsync_callback.predictor.graph import build_global_graph
from qsync_callback.predictor.memory import CURVE_CATEGORIES, TensorLife, lifetime_events, tensor_lifetimes
from qsync_callback.predictor.replay import replay
from qsync_callback.recorder.kineto import STEP_PREFIX
from qsync_callback.recorder.trace import Op, Trace

KINDS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
_RESIDENT_KIND = {
    "parameters": "parameters",
    "buffers": "parameters",
    "gradients": "gradients",
    "gradient_buckets": "gradients",
    "optimizer_state": "optimizer_state",
}  # any other resident bytes: "other"
_FREED_RESIDENT_FROM = ("gradients", "other", "optimizer_state", "parameters")
_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass
class SavedTensor:
    """One tensor saved for backward in one recorded step (see the module docstring)."""

    rank: int
    step: int
    bytes: int
    layer: str | None
    made_by: Op
    saved_by: Op
    freed_by: Op
    last_forward_use: Op
    first_backward_use: Op
    last_forward_use_end_us: float  # replayed, from the step's start
    first_backward_use_start_us: float

    @property
    def inactive_us(self) -> float:
        return self.first_backward_use_start_us - self.last_forward_use_end_us


@dataclass
class Kernel:
    """One event that ran inside a recorded op (trace clock, microseconds)."""

    name: str
    start_us: float
    dur_us: float
    self_us: float
    depth: int


@dataclass
class StepCurve:
    """One rank's memory curve over one recorded step: bytes alive of each kind from each time on."""

    rank: int
    step: int
    start_us: float
    end_us: float
    times_us: np.ndarray
    by_kind: dict[str, np.ndarray]

    @cached_property
    def total(self) -> np.ndarray:
        return np.sum([self.by_kind[kind] for kind in KINDS], axis=0)

    @cached_property
    def peak_index(self) -> int:
        return int(np.argmax(self.total))

    @property
    def peak_bytes(self) -> int:
        return int(self.total[self.peak_index])

    def at(self, index: int) -> dict[str, int]:
        """Bytes of each kind at point ``index``."""
        return {kind: int(self.by_kind[kind][index]) for kind in KINDS}


@dataclass
class RankLiveness:
    """One rank's liveness: its curves and saved tensors per step, replayed op times (op id ->
    start, end in microseconds from the step's start) and kernels (None: no profiler trace read)."""

    trace: Trace
    curves: list[StepCurve]
    saved: list[SavedTensor]
    replayed: dict[int, tuple[float, float]]
    replayed_step_us: dict[int, float]
    kernels: dict[int, list[Kernel]] | None = None
    kineto_pid: int | str | None = None  # the training process's id in the profiler trace


@dataclass
class Liveness:
    """Every rank's liveness, and notes on what could not be read (no profiler trace, say)."""

    ranks: list[RankLiveness]
    notes: list[str] = field(default_factory=list)

    @property
    def peak_curve(self) -> StepCurve:
        """The step curve with the largest peak (the first such, by rank then step)."""
        return max((c for r in self.ranks for c in r.curves), key=lambda c: c.peak_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak_curve.peak_bytes


def memory_curves(trace: Trace, lives: Sequence[TensorLife]) -> list[StepCurve]:
    """Each recorded step's curve by kind (see the module docstring), in step order."""
    resident = dict.fromkeys(KINDS, 0)
    for name, nbytes in trace.resident_bytes.items():
        resident[_RESIDENT_KIND.get(name, "other")] += int(nbytes)
    codes_of = {category: code for code, category in enumerate(CURVE_CATEGORIES)}
    events = lifetime_events(lives)
    curves = []
    for step in sorted(trace.steps, key=lambda s: s.start_us):
        times, deltas, codes = events.get(step.index, (np.zeros(0), np.zeros(0), np.zeros(0, dtype=int)))
        deltas = deltas.astype(np.int64)
        changes = {kind: np.zeros(len(deltas), dtype=np.int64) for kind in KINDS}
        for kind in KINDS:
            if kind in codes_of:
                mask = codes == codes_of[kind]
                changes[kind][mask] = deltas[mask]
        left = dict(resident)
        for i in np.flatnonzero(codes == codes_of["resident"]):
            freed = -int(deltas[i])
            for kind in _FREED_RESIDENT_FROM:
                taken = min(freed, left[kind])
                changes[kind][i] -= taken
                left[kind] -= taken
                freed -= taken
            changes["other"][i] -= freed  # more freed than was resident: the trace disagrees with itself
        last_of_time = np.flatnonzero(np.append(times[1:] != times[:-1], True)) if len(times) else []
        end_us = max(step.end_us, float(times[-1])) if len(times) else step.end_us
        by_kind = {}
        for kind in KINDS:
            level = resident[kind] + np.cumsum(changes[kind])[last_of_time]
            by_kind[kind] = np.concatenate(
                ([resident[kind]], level, level[-1:] if len(level) else [resident[kind]])
            )
        point_times = np.concatenate(([step.start_us], times[last_of_time], [end_us]))
        curves.append(StepCurve(trace.rank, step.index, step.start_us, step.end_us, point_times, by_kind))
    return curves


def replayed_times(
    traces: Sequence[Trace],
) -> tuple[list[dict[int, tuple[float, float]]], list[dict[int, float]]]:
    """Per rank (in the order of ``traces``): each op's replayed start and end (microseconds from
    its step's start) and each step's replayed time, from the replay of every recorded step position
    (`graph.build_global_graph`: all ranks joined; a collective joined across ranks has no times of
    its own rank's op)."""
    position_of = {trace.rank: k for k, trace in enumerate(traces)}
    ops: list[dict[int, tuple[float, float]]] = [{} for _ in traces]
    steps: list[dict[int, float]] = [{} for _ in traces]
    for position in range(min(len(t.steps) for t in traces)):
        graph = build_global_graph(traces, position)
        result = replay(graph)
        for row in result.timeline(graph):
            attrs = graph.nodes[row["node"]]
            if attrs["rank"] is not None and attrs["op_id"] is not None:
                ops[position_of[attrs["rank"]]][attrs["op_id"]] = (row["start_us"], row["end_us"])
        for k, trace in enumerate(traces):
            steps[k][trace.steps[position].index] = result.step_us
    return ops, steps


def _runs(ops: Sequence[Op]) -> tuple[dict[int, Op], dict[int, Op]]:
    """For each op: the first and the last op of its run (the consecutive ops of its thread, in
    time order, of its kind and its layer; an op of no layer is a run of its own)."""
    first_of: dict[int, Op] = {}
    last_of: dict[int, Op] = {}
    by_queue: dict[tuple[int, str], list[Op]] = defaultdict(list)
    for op in ops:
        by_queue[(op.step, op.thread)].append(op)
    for queue in by_queue.values():
        queue.sort(key=lambda o: o.start_us)
        run: list[Op] = []
        for op in [*queue, None]:
            if run and (op is None or op.layer is None or (op.layer, op.kind) != (run[0].layer, run[0].kind)):
                for member in run:
                    first_of[member.id], last_of[member.id] = run[0], run[-1]
                run = []
            if op is not None:
                run.append(op)
    return first_of, last_of


def _saver(freed_by: Op, made_by: Op, by_seq: Mapping[int, tuple[list[int], list[Op]]]) -> Op:
    """The forward op whose backward is ``freed_by`` (see the module docstring), or ``made_by``."""
    if freed_by.seq is None or freed_by.step not in by_seq:
        return made_by
    seqs, ops = by_seq[freed_by.step]
    i = bisect.bisect_right(seqs, freed_by.seq) - 1
    if i < 0 or not (made_by.start_us <= ops[i].start_us <= freed_by.start_us):
        return made_by
    return ops[i]


def saved_tensors(
    trace: Trace, lives: Sequence[TensorLife], replayed: Mapping[int, tuple[float, float]]
) -> list[SavedTensor]:
    """The tensors saved for backward (see the module docstring) in the steps whose ops have
    replayed times in ``replayed`` (op id -> start, end), in the order of ``lives``."""
    first_of, last_of = _runs(trace.ops)
    by_seq: dict[int, tuple[list[int], list[Op]]] = {}
    forward: dict[int, list[Op]] = defaultdict(list)
    for op in trace.ops:
        if op.kind == "forward" and op.seq is not None:
            forward[op.step].append(op)
    for step, ops in forward.items():
        ops.sort(key=lambda o: o.seq)
        by_seq[step] = ([o.seq for o in ops], ops)
    saved = []
    for life in lives:
        if life.category != "activations" or life.death_op.id not in replayed:
            continue
        saver = _saver(life.death_op, life.birth_op, by_seq)
        last_forward, first_backward = last_of[saver.id], first_of[life.death_op.id]
        saved.append(
            SavedTensor(
                rank=trace.rank,
                step=life.step,
                bytes=life.bytes,
                layer=saver.layer,
                made_by=life.birth_op,
                saved_by=saver,
                freed_by=life.death_op,
                last_forward_use=last_forward,
                first_backward_use=first_backward,
                last_forward_use_end_us=replayed[last_forward.id][1],
                first_backward_use_start_us=replayed[first_backward.id][0],
            )
        )
    return saved


def op_kernels(
    trace: Trace, raw: Mapping[str, Any], source: str = "<profiler trace>"
) -> dict[int, list[Kernel]]:
    """Each recorded op's kernels (see the module docstring), by op id, from ``raw``: the Kineto
    trace ``trace`` was converted from. Raises QSyncInputError naming ``source`` if ``raw`` has no
    ``qsync::step#`` ranges (not such a trace)."""
    events = [
        e
        for e in raw.get("traceEvents") or []
        if isinstance(e, Mapping)
        and e.get("ph") == "X"
        and _is_number(e.get("ts"))
        and _is_number(e.get("dur", 0))
    ]
    steps = sorted(
        (e for e in events if str(e.get("name", "")).startswith(STEP_PREFIX)), key=lambda e: e["ts"]
    )
    if not steps:
        raise QSyncInputError(f"{source}: no qsync::step# ranges: not the profiler trace of this recording")
    main_tid = steps[0].get("tid")
    by_thread: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    launched: dict[Any, list[Mapping[str, Any]]] = defaultdict(list)
    for e in events:
        cat = e.get("cat", "")
        if cat in _DEVICE_CATEGORIES:
            launched[(e.get("args") or {}).get("correlation")].append(e)
        if cat in ("cpu_op", *_DEVICE_CATEGORIES, *_LAUNCH_CATEGORIES) and not str(
            e.get("name", "")
        ).startswith("qsync::"):
            by_thread["main" if e.get("tid") == main_tid else str(e.get("tid"))].append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    starts = {key: [e["ts"] for e in thread] for key, thread in by_thread.items()}
    on_device = trace.device.startswith("cuda")
    kernels: dict[int, list[Kernel]] = {}
    for op in trace.ops:
        key = "main" if op.thread == "main" else op.thread.partition(":")[2]
        thread, at = by_thread.get(key, []), starts.get(key, [])
        i = bisect.bisect_left(at, op.start_us)
        while i < len(thread) and thread[i]["ts"] == op.start_us and thread[i].get("name") != op.name:
            i += 1
        if i == len(thread) or thread[i]["ts"] != op.start_us:
            kernels[op.id] = []
            continue
        event = thread[i]
        if event.get("cat") in _DEVICE_CATEGORIES:
            kernels[op.id] = [_kernel(event, event["dur"], 0)]
            continue
        nested = _nested(thread, i)
        if on_device:
            found = [
                k
                for e in nested
                if e.get("cat") in _LAUNCH_CATEGORIES
                for k in launched.get((e.get("args") or {}).get("correlation"), [])
            ]
            kernels[op.id] = [_kernel(k, k.get("dur", 0), 1) for k in sorted(found, key=lambda k: k["ts"])]
        else:
            kernels[op.id] = _with_depth([e for e in nested if e.get("cat") == "cpu_op"])
    return kernels


def _kineto_pid(raw: Mapping[str, Any]) -> int | str | None:
    """The process id of the training thread's events (its ``qsync::step#`` ranges) in ``raw``."""
    for e in raw.get("traceEvents") or []:
        if isinstance(e, Mapping) and str(e.get("name", "")).startswith(STEP_PREFIX):
            return e.get("pid")
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _nested(thread: Sequence[Mapping[str, Any]], i: int) -> list[Mapping[str, Any]]:
    """The events of ``thread`` (sorted by start, longest first) inside its ``i``-th event."""
    end = thread[i]["ts"] + thread[i].get("dur", 0)
    inside = []
    for e in thread[i + 1 :]:
        if e["ts"] >= end:
            break
        inside.append(e)
    return inside


def _kernel(event: Mapping[str, Any], self_us: float, depth: int) -> Kernel:
    return Kernel(
        str(event.get("name", "")), float(event["ts"]), float(event.get("dur", 0)), float(self_us), depth
    )


def _with_depth(events: Sequence[Mapping[str, Any]]) -> list[Kernel]:
    """``events`` (sorted by start, longest first) as kernels with their nesting depth and self time."""
    kernels: list[Kernel] = []
    open_: list[tuple[float, Kernel]] = []  # (end, kernel) of the enclosing events
    for e in events:
        while open_ and e["ts"] >= open_[-1][0]:
            open_.pop()
        kernel = _kernel(e, e.get("dur", 0), len(open_) + 1)
        if open_:
            open_[-1][1].self_us -= kernel.dur_us
        kernels.append(kernel)
        open_.append((kernel.start_us + kernel.dur_us, kernel))
    return kernels


def analyse_liveness(
    traces: Sequence[Trace],
    raw_traces: Sequence[Mapping[str, Any] | None] | None = None,
    raw_sources: Sequence[str] | None = None,
) -> Liveness:
    """Every rank's memory curves, saved tensors, replayed op times and, where its profiler trace is
    given (``raw_traces``, by position; named in errors as ``raw_sources`` says), kernels."""
    replayed, step_us = replayed_times(traces)
    raws = list(raw_traces) if raw_traces is not None else [None] * len(traces)
    sources = (
        list(raw_sources) if raw_sources is not None else [f"rank {t.rank}'s profiler trace" for t in traces]
    )
    ranks = []
    for trace, ops, steps, raw, source in zip(traces, replayed, step_us, raws, sources, strict=True):
        lives = tensor_lifetimes(trace)
        ranks.append(
            RankLiveness(
                trace=trace,
                curves=memory_curves(trace, lives),
                saved=saved_tensors(trace, lives, ops),
                replayed=ops,
                replayed_step_us=steps,
                kernels=op_kernels(trace, raw, source) if raw is not None else None,
                kineto_pid=_kineto_pid(raw) if raw is not None else None,
            )
        )
    return Liveness(ranks)
