"""Convert a torch.profiler (Kineto) Chrome trace into the normalized trace's ops and memory events.

What the torch recorder puts into the profiled window, and this module reads back:
- ``qsync::step#<k>`` ranges on the training thread bound each step;
- ``qsync::layer::<name>`` ranges (opened by module hooks, `layer_ranges.py`; recorded as
  ``cpu_op`` events) attribute forward ops to layers, and those and the ``qsync::module::<name>``
  ranges of the blocks holding layers attribute them to their innermost module;
- ``qsync::calibration::<loop>`` ranges hold the profiled half of the overhead calibration loops
  (`overhead.py`), whose events `calibration_event_counts` counts;
- ``qsync::clock_sync`` marks the moment all ranks left a barrier (the common clock's zero);
- ``qsync::freed#<address>`` marks the moment a storage live at a recorded step's start was freed
  (`live_memory.StorageWatch`), for the measured peak.

Graph nodes are the outermost ``cpu_op`` events of each thread (user annotations and layer ranges
are context, not nodes) and the collectives on communication threads (``gloo:*``; NCCL kernels on
GPU streams).
Backward ops are linked to their forward op, and so to a layer, by autograd's sequence number.
Each DDP bucket's all-reduce depends on the op that launched it, and the ops that copy the reduced
bucket back into the gradients depend on it (matched by element count, in bucket order).

Profiler overhead: each recorded event costs a calibrated time by its kind (`event_kind`; figures
from ``overhead.py``); the cost of events nested in a node goes to its ``overhead_us``, the cost of
the node's own event and of events between nodes goes to the next node's ``gap_overhead_us``.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from qsync_callback.recorder.trace import Op, Step

STEP_PREFIX = "qsync::step#"
LAYER_PREFIX = "qsync::layer::"
MODULE_PREFIX = "qsync::module::"
RANGE_PREFIXES = (LAYER_PREFIX, MODULE_PREFIX)
CALIBRATION_RANGE = "qsync::calibration"
CALIBRATION_LOOP_PREFIX = CALIBRATION_RANGE + "::"
MEMORY_EVENT = "[memory]"
CLOCK_SYNC = "qsync::clock_sync"
FREED_PREFIX = "qsync::freed#"
BACKWARD_PREFIX = "autograd::engine::evaluate_function"
ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"
OPTIMIZER_ZERO_GRAD_PREFIX = "Optimizer.zero_grad#"
DATA_LOADER_PREFIX = "enumerate(DataLoader)#"  # a DataLoader iterator's fetch of one batch
DDP_COPY_BACK = "copy_bucket_to_grad"
C10D_PREFIX = "c10d::"
_COMM_NAME = re.compile(r"^(gloo|nccl|mpi|ucc):(?!barrier)(\w+)", re.IGNORECASE)
FLOAT_DTYPES = ("float", "double", "c10::BFloat16", "c10::Half")  # Kineto's names of float dtypes
DTYPE_BYTES = {  # bytes per element, by Kineto's dtype names
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "short int": 2,
}


def float_dtype(dtypes: Sequence[str]) -> str | None:
    """The first floating-point dtype of an op's inputs (Kineto's names), None where it has none."""
    return next((d for d in dtypes if d in FLOAT_DTYPES), None)


_DEVICE_TYPE = {"cpu": 0, "cuda": 1}


class _Event:
    """A Kineto complete event ('X') with what the conversion needs."""

    __slots__ = ("name", "cat", "tid", "ts", "dur", "args", "node_id")

    def __init__(self, raw: Mapping[str, Any]):
        self.name: str = raw.get("name", "")
        self.cat: str = raw.get("cat", "")
        self.tid = raw.get("tid")
        self.ts: float = float(raw["ts"])
        self.dur: float = float(raw.get("dur", 0.0))
        self.args: Mapping[str, Any] = raw.get("args") or {}
        self.node_id: int | None = None

    @property
    def end(self) -> float:
        return self.ts + self.dur


def convert_kineto(
    raw: Mapping[str, Any],
    device: str = "cpu",
    overhead_us: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Read a Kineto trace dict; return steps, ops, memory events, clock zero and allocator figures.

    Returns a dict with keys ``steps`` (list[Step]), ``ops`` (list[Op]), ``memory_events``,
    ``clock_sync_us`` (None when no sync mark was recorded), ``allocator_counter`` (by step, the
    memory events of the trace's device as ``[ts, addr, bytes, rise]``: ``rise`` the allocator's
    "Total Allocated" after the event less its value at the step's start) and ``freed_marks`` (by
    step, ``[ts, address]`` of each ``qsync::freed#`` mark).
    Raises ValueError if the trace holds no ``qsync::step#`` ranges.
    """
    overhead_us = dict(overhead_us or {})
    events = [_Event(e) for e in raw.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    memory = _memory_records(raw)

    step_events = sorted((e for e in events if e.name.startswith(STEP_PREFIX)), key=lambda e: e.ts)
    if not step_events:
        raise ValueError("no qsync::step# ranges in the profiler trace")
    main_tid = step_events[0].tid
    steps = [Step(int(e.name[len(STEP_PREFIX) :]), e.ts, e.end) for e in step_events]
    step_starts = [s.start_us for s in steps]

    def step_of(ts: float) -> int | None:
        i = bisect.bisect_right(step_starts, ts) - 1
        return steps[i].index if i >= 0 and ts < steps[i].end_us else None

    sync = [e for e in events if e.name == CLOCK_SYNC]
    clock_sync_us = sync[-1].end if sync else None

    by_tid: dict[Any, list[_Event]] = defaultdict(list)
    for e in events:
        by_tid[e.tid].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e.ts, -e.dur))

    ops: list[Op] = []
    node_events: dict[Any, list[_Event]] = {}
    for tid, evs in by_tid.items():
        nodes = _thread_nodes(evs, main=(tid == main_tid))
        kept = []
        for e in nodes:
            step = step_of(e.ts)
            if step is None:
                continue
            e.node_id = len(ops)
            ops.append(_make_op(e, step, tid, main_tid))
            kept.append(e)
        node_events[tid] = kept

    main_events = by_tid.get(main_tid, [])
    _classify_main_thread(main_events, ops, steps)
    _attribute_layers(main_events, ops)
    _link_collectives(ops, node_events, main_tid, main_events)
    _attribute_overhead(by_tid, node_events, memory, ops, overhead_us, step_of)
    mem_events, op_bytes, counter = _memory_events(memory, node_events, device, step_of)
    for op_id, nbytes in op_bytes.items():
        ops[op_id].bytes = nbytes
    freed: dict[int, list[list[float]]] = defaultdict(list)
    for e in events:
        if e.name.startswith(FREED_PREFIX) and (step := step_of(e.ts)) is not None:
            freed[step].append([e.ts, int(e.name[len(FREED_PREFIX) :])])
    return {
        "steps": steps,
        "ops": ops,
        "memory_events": mem_events,
        "clock_sync_us": clock_sync_us,
        "allocator_counter": dict(counter),
        "freed_marks": dict(freed),
    }


def _memory_records(raw: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [e for e in raw.get("traceEvents", []) if e.get("name") == MEMORY_EVENT and e.get("ph") == "i"]


def event_kind(cat: str, name: str) -> str | None:
    """What the profiler's cost of recording an event is calibrated as: ``"range"`` (a layer range,
    which the recorder adds, hooks and all), ``"memory"`` (an allocation or free), ``"op"`` (any
    other host-side event: an op, a CUDA runtime call, a user annotation the run opens anyway), or
    None (device activity, which costs the host nothing)."""
    if name.startswith(RANGE_PREFIXES):
        return "range"
    if name == MEMORY_EVENT:
        return "memory"
    if cat in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"):
        return "op"
    return None


def calibration_event_counts(raw: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Events of each kind (`event_kind`) recorded inside each ``qsync::calibration::<loop>`` range
    on its thread, the calibration's own ranges not counted; by loop name, summed over its ranges."""
    loops = [
        _Event(e)
        for e in raw.get("traceEvents", [])
        if e.get("ph") == "X" and "ts" in e and e.get("name", "").startswith(CALIBRATION_LOOP_PREFIX)
    ]
    counts: dict[str, dict[str, int]] = {loop.name[len(CALIBRATION_LOOP_PREFIX) :]: {} for loop in loops}
    for e in raw.get("traceEvents", []):
        name = e.get("name", "")
        kind = event_kind(e.get("cat", ""), name) if e.get("ph") in ("X", "i") and "ts" in e else None
        if kind is None or name.startswith(CALIBRATION_RANGE):
            continue
        ts = float(e["ts"])
        for loop in loops:
            if e.get("tid") == loop.tid and loop.ts <= ts < loop.end:
                found = counts[loop.name[len(CALIBRATION_LOOP_PREFIX) :]]
                found[kind] = found.get(kind, 0) + 1
    return counts


def _thread_nodes(evs: list[_Event], main: bool) -> list[_Event]:
    """Outermost cpu ops of a thread (not layer ranges); on other threads also collectives (which
    are annotations)."""
    nodes: list[_Event] = []
    open_end = -math.inf
    for e in evs:
        is_comm = bool(_COMM_NAME.match(e.name))
        if e.cat not in ("cpu_op", "kernel", "gpu_memcpy", "gpu_memset") and not is_comm:
            continue
        if e.name.startswith((*RANGE_PREFIXES, FREED_PREFIX)):
            continue
        if main and is_comm:
            continue
        if e.ts >= open_end:
            nodes.append(e)
            open_end = e.end
    return nodes


def _make_op(e: _Event, step: int, tid: Any, main_tid: Any) -> Op:
    comm = _COMM_NAME.match(e.name)
    collective = None
    if comm:
        shapes = e.args.get("Input Dims") or []
        numel = sum(math.prod(s) for s in shapes if isinstance(s, list))
        dtype = (e.args.get("Input type") or ["float"])[0]
        collective = {
            "op": comm.group(2).lower(),
            "numel": numel,
            "dtype": dtype,
            "bytes": numel * DTYPE_BYTES.get(dtype, 4),
        }
    if tid == main_tid:
        thread = "main"
    elif comm:
        thread = f"comm:{tid}"
    elif e.cat in ("kernel", "gpu_memcpy", "gpu_memset"):
        thread = f"cuda:{tid}"
    else:
        thread = f"tid:{tid}"
    return Op(
        id=e.node_id,
        name=e.name,
        kind="comm" if comm else ("copy" if e.cat == "gpu_memcpy" else "other"),
        thread=thread,
        start_us=e.ts,
        dur_us=e.dur,
        step=step,
        seq=e.args.get("Sequence number"),
        input_shapes=list(e.args.get("Input Dims") or []),
        input_dtypes=list(e.args.get("Input type") or []),
        collective=collective,
    )


def _intervals(events: list[_Event], prefix: str) -> list[tuple[float, float]]:
    return [(e.ts, e.end) for e in events if e.name.startswith(prefix)]


def _inside(ts: float, intervals: list[tuple[float, float]]) -> bool:
    return any(a <= ts < b for a, b in intervals)


def _classify_main_thread(main_events: list[_Event], ops: list[Op], steps: list[Step]) -> None:
    """Forward, backward, update or other, per op of the main thread.

    A step may hold several forward and backward passes (gradient accumulation: one per
    micro-batch). Backward ops are autograd's; a backward pass ends where the next micro-batch's
    forward begins (its first op inside a layer range), and the ops between the last backward op
    and that one are the next forward's. After the step's last backward op an op is update inside
    ``Optimizer.step#``, else other; ``Optimizer.zero_grad#`` is update wherever it runs."""
    step_ranges = _intervals(main_events, OPTIMIZER_STEP_PREFIX)
    zero_grad_ranges = _intervals(main_events, OPTIMIZER_ZERO_GRAD_PREFIX)
    in_layer = _Cover(_intervals(main_events, LAYER_PREFIX))
    by_step: dict[int, list[Op]] = defaultdict(list)
    for op in ops:
        if op.thread == "main":
            by_step[op.step].append(op)
    for step_ops in by_step.values():
        backward_at = [i for i, op in enumerate(step_ops) if op.name.startswith(BACKWARD_PREFIX)]
        last = backward_at[-1] if backward_at else len(step_ops)
        phase, last_backward = "forward", -1
        for i, op in enumerate(step_ops):
            if _inside(op.start_us, zero_grad_ranges):
                op.kind = "update"
                continue
            if i > last:
                op.kind = "update" if _inside(op.start_us, step_ranges) else "other"
                continue
            if op.name.startswith(BACKWARD_PREFIX):
                phase, last_backward = "backward", i
            elif phase == "backward" and in_layer(op.start_us):
                phase = "forward"  # the next micro-batch
                for between in step_ops[last_backward + 1 : i]:
                    between.kind = "forward"
            op.kind = phase


class _Cover:
    """Whether a time falls in any of some (possibly nested) intervals: merged once, then bisected."""

    def __init__(self, intervals: list[tuple[float, float]]):
        merged: list[list[float]] = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = [start for start, _ in merged]
        self.ends = [end for _, end in merged]

    def __call__(self, ts: float) -> bool:
        i = bisect.bisect_right(self.starts, ts) - 1
        return i >= 0 and ts < self.ends[i]


def _attribute_layers(main_events: list[_Event], ops: list[Op]) -> None:
    """Forward ops take the innermost ``qsync::layer::`` range around them as their layer and the
    innermost range of either kind as their module; backward ops those of the forward op with the
    same autograd sequence number; AccumulateGrad the backward op's before it."""
    seq_owner: dict[int, tuple[str | None, str]] = {}
    open_ranges: list[_Event] = []
    for e in main_events:
        while open_ranges and e.ts >= open_ranges[-1].end:
            open_ranges.pop()
        if e.name.startswith(RANGE_PREFIXES):
            open_ranges.append(e)
            continue
        if e.cat != "cpu_op" or not open_ranges or e.name.startswith(BACKWARD_PREFIX):
            continue
        layer = next(
            (r.name[len(LAYER_PREFIX) :] for r in reversed(open_ranges) if r.name.startswith(LAYER_PREFIX)),
            None,
        )
        inner = open_ranges[-1].name
        module = inner[len(LAYER_PREFIX if inner.startswith(LAYER_PREFIX) else MODULE_PREFIX) :]
        if e.node_id is not None:
            ops[e.node_id].layer, ops[e.node_id].module = layer, module
        seq = e.args.get("Sequence number")
        if seq is not None:
            seq_owner.setdefault(seq, (layer, module))
    previous: tuple[str | None, str | None] = (None, None)
    for op in ops:
        if op.thread != "main" or op.kind != "backward":
            continue
        if ACCUMULATE_GRAD in op.name:
            op.layer, op.module = previous
        elif op.seq is not None and op.seq in seq_owner:
            op.layer, op.module = seq_owner[op.seq]
            previous = (op.layer, op.module)


def _numel_of_first_input(node: _Event, main_events: list[_Event], main_starts: list[float]) -> int:
    """Element count of the first input of ``node`` or, if it records none, of its first child."""
    i = bisect.bisect_left(main_starts, node.ts)
    for e in main_events[i : i + 4]:
        if e.ts > node.end:
            break
        dims = e.args.get("Input Dims") or []
        if dims and isinstance(dims[0], list) and dims[0]:
            return math.prod(dims[0])
    return 0


def _c10d_numel(event: _Event) -> int | None:
    """Element count of a ``c10d::`` launch's tensors (its first input, a list of tensors)."""
    dims = event.args.get("Input Dims") or []
    if dims and isinstance(dims[0], list) and dims[0] and all(isinstance(d, list) for d in dims[0]):
        return sum(math.prod(d) for d in dims[0])
    return None


def _match_launches(comms: list[Op], launches: list[tuple[float, int | None]]) -> list[float]:
    """Each collective's launch time: the first launch not yet taken with its element count, else
    the first not yet taken (a backend with several threads may start a later launch first)."""
    free = list(range(len(launches)))
    out = []
    for comm in comms:
        numel = (comm.collective or {}).get("numel")
        pick = next((i for i in free if launches[i][1] == numel), free[0])
        free.remove(pick)
        out.append(launches[pick][0])
    return out


def _link_collectives(
    ops: list[Op], node_events: dict[Any, list[_Event]], main_tid: Any, main_events: list[_Event]
) -> None:
    """Collective <- the main-thread op that launched it; waiting op <- collective.

    The launching op is the one around the collective's ``c10d::`` launch event: the first launch of
    the step with its element count not taken by a collective that started before it (gloo runs
    collectives on two threads, so a later launch may start first); the backend's thread may start
    the collective while the training thread is already in a later op, so the op running at the
    collective's start is not the launcher. The collectives are then taken in launch order.
    The main thread must have the collective's result by the time it runs the first op that uses
    it: for DDP's k-th bucket, the first of the k-th group of ``copy_bucket_to_grad`` ops (groups
    matched to buckets by element count); elsewhere the first op that starts after the collective
    ends. The thread blocked somewhere between the launch and that op: the waiting op is the one
    after the longest idle gap in that stretch. A collective's duration is cut at its waiting op's
    start: the op could not have started before the data arrived, and the event's tail past that
    point is the backend's bookkeeping.
    """
    main_nodes = node_events.get(main_tid, [])
    main_starts = [e.ts for e in main_events]
    launch_events = [e for e in main_events if e.name.startswith(C10D_PREFIX) and "barrier" not in e.name]
    comm_by_step: dict[int, list[Op]] = defaultdict(list)
    for op in ops:
        if op.kind == "comm":
            comm_by_step[op.step].append(op)
    for step, comms in comm_by_step.items():
        comms.sort(key=lambda o: o.start_us)
        step_nodes = [e for e in main_nodes if ops[e.node_id].step == step]
        starts = [e.ts for e in step_nodes]
        copies = [p for p, e in enumerate(step_nodes) if DDP_COPY_BACK in e.name]
        copy_numel = [_numel_of_first_input(step_nodes[p], main_events, main_starts) for p in copies]
        launches = [
            (e.ts, _c10d_numel(e))
            for e in launch_events
            if step_nodes and starts[0] <= e.ts <= step_nodes[-1].end
        ]
        if len(launches) == len(comms):
            launched = _match_launches(comms, launches)
        else:
            launched = [comm.start_us for comm in comms]
        next_copy = 0
        for comm, launched_at in sorted(zip(comms, launched, strict=True), key=lambda pair: pair[1]):
            launch = bisect.bisect_right(starts, launched_at) - 1
            if launch >= 0:
                comm.deps.append(step_nodes[launch].node_id)
            from_backward = launch >= 0 and ops[step_nodes[launch].node_id].kind == "backward"
            if from_backward and next_copy < len(copies):
                user = copies[next_copy]
                numel, total = (comm.collective or {}).get("numel", 0), 0
                while next_copy < len(copies) and (total < numel or total == 0):
                    total += copy_numel[next_copy]
                    next_copy += 1
            else:
                user = bisect.bisect_left(starts, comm.end_us)
            if user >= len(step_nodes) or user <= launch:
                continue
            waiter = max(range(launch + 1, user + 1), key=lambda p: starts[p] - step_nodes[p - 1].end)
            if starts[waiter] >= comm.start_us:
                ops[step_nodes[waiter].node_id].deps.append(comm.id)
                comm.dur_us = min(comm.dur_us, starts[waiter] - comm.start_us)


def _attribute_overhead(
    by_tid: dict[Any, list[_Event]],
    node_events: dict[Any, list[_Event]],
    memory: list[Mapping[str, Any]],
    ops: list[Op],
    costs: Mapping[str, float],
    step_of,
) -> None:
    if not any(costs.values()):
        return
    stamps: dict[Any, list[tuple[float, str | None, _Event | None]]] = defaultdict(list)
    for tid, evs in by_tid.items():
        stamps[tid].extend((e.ts, event_kind(e.cat, e.name), e) for e in evs)
    for m in memory:
        stamps[m.get("tid")].append((float(m["ts"]), "memory", None))
    for tid, nodes in node_events.items():
        if not nodes:
            continue
        starts = [n.ts for n in nodes]
        for ts, kind, event in stamps.get(tid, []):
            if step_of(ts) is None or kind is None:
                continue
            cost = costs.get(kind, 0.0)
            i = bisect.bisect_right(starts, ts) - 1
            if i >= 0 and nodes[i] is event:
                ops[event.node_id].gap_overhead_us += cost
            elif i >= 0 and ts < nodes[i].end:
                ops[nodes[i].node_id].overhead_us += cost
            elif i + 1 < len(nodes):
                ops[nodes[i + 1].node_id].gap_overhead_us += cost


def _memory_events(
    memory: list[Mapping[str, Any]],
    node_events: dict[Any, list[_Event]],
    device: str,
    step_of,
) -> tuple[list[list], dict[int, int], dict[int, list[list[float]]]]:
    """Allocations and frees of the trace's device inside steps as ``[ts, addr, bytes, op_id]``;
    bytes each op allocated; by step, the events as ``[ts, addr, bytes, rise]``, ``rise`` the
    allocator's "Total Allocated" after the event less its value at the step's start (before the
    step's first event; on CPU the figure also carries whatever earlier sessions counted).

    An event between ops is charged to the op before it on its thread: a tensor is freed when the
    last reference to it goes, right after the op that used it last."""
    device_type = _DEVICE_TYPE["cuda" if device.startswith("cuda") else "cpu"]
    starts = {tid: [n.ts for n in nodes] for tid, nodes in node_events.items()}
    out: list[list] = []
    op_bytes: dict[int, int] = defaultdict(int)
    counter: dict[int, list[list[float]]] = defaultdict(list)
    baselines: dict[int, int] = {}
    for m in sorted(memory, key=lambda m: float(m["ts"])):
        args = m.get("args") or {}
        ts, nbytes = float(m["ts"]), int(args.get("Bytes", 0))
        step = step_of(ts)
        if args.get("Device Type") != device_type or step is None:
            continue
        total = int(args.get("Total Allocated", 0))
        baselines.setdefault(step, total - nbytes)
        op_id = -1
        nodes = node_events.get(m.get("tid"), [])
        i = bisect.bisect_right(starts.get(m.get("tid"), []), ts) - 1
        if i >= 0 and step_of(nodes[i].ts) == step:
            op_id = nodes[i].node_id
            if nbytes > 0 and ts < nodes[i].end:
                op_bytes[op_id] += nbytes
        addr = int(args.get("Addr", 0))
        out.append([ts, addr, nbytes, op_id])
        counter[step].append([ts, addr, nbytes, total - baselines[step]])
    return out, dict(op_bytes), counter
