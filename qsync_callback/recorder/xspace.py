"""Convert a TensorFlow profiler XSpace (``*.xplane.pb``) into the normalized trace's steps and ops.

What the TF recorder puts into the profiled window, and this module reads back:
- a ``qsync::step`` trace event with a ``step_num`` stat around each step
  (``tf.profiler.experimental.Trace(STEP_NAME, step_num=k, _r=1)``; TensorBoard shows them as steps);
- optionally a ``qsync::clock_sync`` event that marks the moment all ranks left a barrier.

Graph nodes are the outermost TF op events of each host thread (named ``"<op name>:<op type>"``)
and one node per asynchronous collective. Horovod's ops run as async kernels: an
``ExecutorState::ProcessAsync::Start`` event on the executor thread that launched one, a ``::Done``
event on Horovod's background thread when it completed, the two joined by a context id. A
collective runs on Horovod's thread from its launch, or from the previous collective's completion
if that was later, to its own completion: a queue of non-overlapping spans whose sum is the
thread's busy time. It waits for the op that ran last before its launch on the launching thread,
and the first op that starts on a compute thread after its completion (the executor schedules the
consumer from Horovod's completion callback) waits for it. A collective's tensors, sizes and dtypes
are not in the XSpace: the recorder passes them in (``collective_tensors``, from the step
function's graph), keyed by the collective op's own name (`horovod_timeline.tensor_key`); Horovod's
phases come from its timeline. Only the host plane is read.

Kinds come from the op's name scope: ops under ``gradient_tape/`` or ``gradients/`` are backward,
ops under an optimizer's scope (``Adam/``, ``SGD/``, ...) or of an ``Apply*`` type are update,
Horovod's collectives are comm, the rest forward (TF runs independent ops in parallel, so time
order says little: the loss's last ops may run after the first gradient ops). Layers: the longest
Keras layer scope (see ``keras_layers``) found in the op's name at scope boundaries; for a
collective, in the gradient's name that Horovod puts into the op's name.

Memory: the allocator records each allocation and free it makes (``MemoryAllocation`` and
``MemoryDeallocation`` events: the bytes asked for, the address, the op that asked, the
allocator's name, and the bytes it has in use after it, ``bytes_allocated``, chunks as it counts
them); those within the steps become the trace's memory events, and the largest of their
``bytes_allocated`` the recorded steps' own peak (``recorded_peak_bytes``). On the CPU with oneDNN
that allocator (``mklcpu``) sees requests of 256 KiB and more only (`predictor/bfc_allocator.py`),
which are also all that TF's memory statistics count.

Profiler overhead (``overhead_us``: microseconds per recorded event of each kind, `event_kind`,
calibrated by the recorder, `recorder/tf_recorder.py`): every host event in a step but qsync's own
marks costs its kind's figure. An event inside a node (an op that runs nested ops or allocates
inside) goes to that node's ``overhead_us``; a node's own event and an event between nodes go to
the ``gap_overhead_us`` of the next node on the same thread (TF's ``TraceMe`` builds an event's name
before its start and records it after its end: both fall in the thread's idle time). On the
step's calling thread an event after that thread's last node (the function call's own machinery,
run while the executor threads work) goes to the next node of the step on any thread; on other
threads such an event (Horovod's completion events, say) is not charged.
"""

from __future__ import annotations

import bisect
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from qsync_callback.errors import QSyncInputError
from qsync_callback.recorder.horovod_timeline import tensor_key
from qsync_callback.recorder.kineto import CALIBRATION_LOOP_PREFIX, CLOCK_SYNC
from qsync_callback.recorder.trace import Op, Step

STEP_NAME = "qsync::step"
# the allocator's own events (its every allocation and free, with the op that asked and the bytes)
MEMORY_ALLOCATION, MEMORY_DEALLOCATION = "MemoryAllocation", "MemoryDeallocation"
_MEMORY_EVENTS = (MEMORY_ALLOCATION, MEMORY_DEALLOCATION)
XSPACE_SUFFIX = ".xplane.pb"
ASYNC_START = "ExecutorState::ProcessAsync::Start"
ASYNC_DONE = "ExecutorState::ProcessAsync::Done"
# Keras optimizers' name scopes (the optimizer's ``name``); a recorder passes the live one's too.
OPTIMIZER_SCOPES = (
    "Adam",
    "AdamW",
    "Adamax",
    "Nadam",
    "SGD",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "Adafactor",
    "Ftrl",
    "Lion",
    "LossScaleOptimizer",
)
# what one recorded event costs, by kind: "op" an op's execution (a TF op event, an async op's
# launch or completion), "executor" the executor's own bookkeeping (`EXECUTOR_EVENTS`), "other" the
# runtime around them (the eager runtime's events, a function call's, allocations, Python-level marks)
EVENT_KINDS = ("op", "executor", "other")
# the executor's own bookkeeping events, fixed names: one per batch of ready ops it runs, inline ones
# (cheap ops, which get no event of their own) included, and one per parallel loop inside an op. A
# recurrent layer's lowered while loop records thousands a step; each costs a small part of what a
# call's machinery events cost
EXECUTOR_EVENTS = ("ExecutorState::Process", "ParallelFor")
_TF_OP = re.compile(r"^([^:\s][^:]*):([A-Za-z_][\w.]*)$")
_GRADIENT_SCOPE = re.compile(r"(^|/)(gradient_tape|gradients(_\d+)?)/")
_APPLY_TYPE = re.compile(r"^(Resource)?(Sparse)?Apply")
_COLLECTIVE_TYPE = re.compile(r"^Horovod(Grouped)?(Allreduce|Allgather|Broadcast|Alltoall|Reducescatter)")
_COLLECTIVE_OP = {
    "Allreduce": "all_reduce",
    "Allgather": "all_gather",
    "Broadcast": "broadcast",
    "Alltoall": "all_to_all",
    "Reducescatter": "reduce_scatter",
}


def _xplane_pb2():
    """TF's generated XSpace protobuf module (``tsl`` moved under ``tensorflow`` in some releases)."""
    try:
        from tsl.profiler.protobuf import xplane_pb2
    except ImportError:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    return xplane_pb2


def find_xspace(logdir: str | os.PathLike) -> Path:
    """The newest ``*.xplane.pb`` under ``logdir`` (``plugins/profile/<run>/<host>.xplane.pb``);
    QSyncInputError if there is none."""
    files = sorted(Path(logdir).rglob(f"*{XSPACE_SUFFIX}"), key=lambda p: (p.stat().st_mtime, str(p)))
    if not files:
        raise QSyncInputError(f"{logdir}: no *{XSPACE_SUFFIX} profile inside")
    return files[-1]


def load_xspace(path: str | os.PathLike) -> Any:
    """Parse an ``*.xplane.pb`` file into an XSpace message; QSyncInputError names the file."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise QSyncInputError(f"{path}: cannot read the profile ({exc.strerror or exc})") from None
    space = _xplane_pb2().XSpace()
    try:
        space.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError differs between its implementations
        raise QSyncInputError(f"{path}: not a TF profiler XSpace ({type(exc).__name__})") from None
    if not space.planes:
        raise QSyncInputError(f"{path}: the profile holds no planes")
    return space


def keras_layers(model: Any) -> list[dict[str, Any]]:
    """Name, type, own weight bytes and op name scope of each leaf layer of a Keras model.

    Names are paths below the model (``"dense"``, or ``"encoder/dense"`` inside a nested model);
    the scope is the name scope its ops carry (``"<model name>/<path>"``)."""
    table: list[dict[str, Any]] = []

    def visit(layer: Any, path: str) -> None:
        children = list(getattr(layer, "layers", None) or [])
        if not children:
            weight_bytes = sum(math.prod(w.shape) * w.dtype.size for w in layer.weights)
            table.append(
                {
                    "name": path,
                    "type": type(layer).__name__,
                    "param_bytes": int(weight_bytes),
                    "scope": f"{model.name}/{path}",
                }
            )
        for child in children:
            visit(child, f"{path}/{child.name}")

    for child in model.layers:
        visit(child, child.name)
    return table


class _Event:
    """One XEvent with its absolute times (microseconds) and its stats resolved by name."""

    __slots__ = ("name", "line", "start", "end", "stats", "node_id")

    def __init__(self, name: str, line: int, start: float, end: float, stats: dict[str, Any]):
        self.name, self.line, self.start, self.end, self.stats = name, line, start, end, stats
        self.node_id: int | None = None


def _plane_events(plane: Any) -> dict[int, list[_Event]]:
    """Events of a plane by line id, sorted by start (outer before inner at equal starts)."""
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}

    def value(stat: Any) -> Any:
        kind = stat.WhichOneof("value")
        raw = getattr(stat, kind) if kind else None
        return stat_names.get(raw) if kind == "ref_value" else raw

    lines: dict[int, list[_Event]] = {}
    for line in plane.lines:
        base_ps = line.timestamp_ns * 1000
        events = []
        for ev in line.events:
            meta = plane.event_metadata[ev.metadata_id]
            stats = {stat_names.get(s.metadata_id): value(s) for s in (*meta.stats, *ev.stats)}
            start = (base_ps + ev.offset_ps) / 1e6
            events.append(_Event(meta.name, line.id, start, start + ev.duration_ps / 1e6, stats))
        events.sort(key=lambda e: (e.start, -e.end))
        lines[line.id] = events
    return lines


def _outermost(events: Iterable[_Event]) -> list[_Event]:
    """The events of one thread (sorted as by ``_plane_events``) that no other event encloses."""
    nodes, open_end = [], -math.inf
    for e in events:
        if e.start >= open_end:
            nodes.append(e)
            open_end = e.end
    return nodes


def convert_xspace(
    space: Any,
    layers: Sequence[Mapping[str, Any]] = (),
    optimizer_scopes: Iterable[str] = OPTIMIZER_SCOPES,
    step_name: str = STEP_NAME,
    collective_tensors: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    overhead_us: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Read an XSpace; return ``steps`` (list[Step]), ``ops`` (list[Op]), ``clock_sync_us``
    (None when no sync mark was recorded), ``memory_events``, ``allocator`` and
    ``recorded_peak_bytes`` (`_memory_events`).

    ``layers`` is ``keras_layers(model)`` (ops get a layer only where one is given); steps are the
    host events named ``step_name`` that carry a ``step_num`` stat; ``collective_tensors`` maps a
    collective op's key to its tensors (``{"name", "shape", "dtype", "bytes", ...}``, see
    `qsync_callback.recorder.trace.Op`); ``overhead_us`` the profiler's cost per event of each kind
    (`EVENT_KINDS`), charged to the ops as the module docstring says. Times are microseconds on the
    profile's clock. Raises ValueError if the profile has no host plane or no step.
    """
    # "/host:CPU" holds the ops; once XLA has compiled anything in the process, a "/host:metadata"
    # plane comes first
    hosts = [p for p in space.planes if p.name.startswith("/host:")]
    host = next((p for p in hosts if p.name == "/host:CPU"), hosts[0] if hosts else None)
    if host is None:
        raise ValueError("no host plane in the profile")
    lines = _plane_events(host)
    everything = [e for events in lines.values() for e in events]
    markers = sorted(
        (e for e in everything if e.name == step_name and "step_num" in e.stats), key=lambda e: e.start
    )
    if not markers:
        raise ValueError(f"no {step_name!r} step events in the profile")
    steps = [Step(int(e.stats["step_num"]), e.start, e.end) for e in markers]
    step_of = _step_finder(steps)

    ops: list[Op] = []
    op_types: list[str] = []

    def add(e: _Event, name: str, op_type: str, thread: str, start: float, end: float) -> Op | None:
        step = step_of(start)
        if step is None:
            return None
        e.node_id = len(ops)
        ops.append(
            Op(
                id=e.node_id,
                name=name,
                kind="forward",
                thread=thread,
                start_us=start,
                dur_us=end - start,
                step=step.index,
            )
        )
        op_types.append(op_type)
        return ops[-1]

    main_line = markers[0].line
    for line_id, events in lines.items():
        thread = "main" if line_id == main_line else f"tid:{line_id}"
        for e in _outermost(e for e in events if _is_host_op(e)):
            name, op_type = _identity(e)
            add(e, name, op_type, thread, e.start, e.end)
    done_at = _add_collectives(everything, lines, step_of, add, ops, collective_tensors or {})
    _link_consumers(ops, done_at)
    _classify(ops, op_types, optimizer_scopes)
    _attribute_layers(ops, layers)
    if overhead_us and any(overhead_us.values()):
        _attribute_overhead(lines, main_line, ops, overhead_us, step_of)
    sync = [e for e in everything if e.name == CLOCK_SYNC]
    memory_events, allocator, recorded_peak = _memory_events(everything, ops, step_of)
    return {
        "steps": steps,
        "ops": ops,
        "clock_sync_us": sync[-1].end if sync else None,
        "memory_events": memory_events,
        "allocator": allocator,
        "recorded_peak_bytes": recorded_peak,
    }


def _memory_events(
    everything: Iterable[_Event], ops: Sequence[Op], step_of: Callable[[float], Step | None]
) -> tuple[list[list], str | None, int | None]:
    """The allocator's allocations and frees within the steps, as the trace's ``memory_events``
    (``[ts_us, addr, bytes, op_id]``, a free's bytes negative), the allocator's name (that of
    the steps' first allocation), and the most bytes it read in use within the steps (the largest
    ``bytes_allocated`` of those events; None where they carry none). An event's op is the one its
    ``tf_op`` stat names, else (a free names none) the op of its thread it falls in or, between ops,
    the one that ended last before it there (the op that dropped the tensor's last reference); -1
    where none did."""
    by_name: dict[str, list[Op]] = {}
    for op in ops:
        by_name.setdefault(op.name, []).append(op)
    by_line: dict[int, list[_Event]] = {}
    for e in everything:
        if e.node_id is not None:
            by_line.setdefault(e.line, []).append(e)
    for nodes in by_line.values():
        nodes.sort(key=lambda e: e.start)
    starts = {line: [n.start for n in nodes] for line, nodes in by_line.items()}
    events, allocator, peak = [], None, None
    for e in sorted((e for e in everything if e.name in _MEMORY_EVENTS), key=lambda e: e.start):
        nbytes = int(e.stats.get("requested_bytes") or 0)
        if step_of(e.start) is None or nbytes <= 0:
            continue
        named = by_name.get(str(e.stats.get("tf_op")), [])
        op = next((o for o in named if o.start_us <= e.start <= o.end_us), None)
        if op is None and named:
            op = min(named, key=lambda o: abs(o.start_us - e.start))
        if op is None:
            nodes = by_line.get(e.line, [])
            k = bisect.bisect_right(starts.get(e.line, []), e.start) - 1
            if k >= 0 and step_of(nodes[k].start) is step_of(e.start):
                op = ops[nodes[k].node_id]
        signed = nbytes if e.name == MEMORY_ALLOCATION else -nbytes
        events.append([e.start, int(e.stats.get("addr") or 0), signed, op.id if op is not None else -1])
        allocator = allocator or e.stats.get("allocator_name")
        if e.stats.get("bytes_allocated") is not None:
            peak = max(peak or 0, int(e.stats["bytes_allocated"]))
    return events, allocator, peak


def event_kind(name: str) -> str | None:
    """The kind (`EVENT_KINDS`) of a host event by its name; None for qsync's own marks (the step
    and clock marks, calibration ranges), which the recorder does not charge to the step."""
    if name.startswith("qsync::"):
        return None
    if name in (ASYNC_START, ASYNC_DONE) or _TF_OP.match(name):
        return "op"
    if name in EXECUTOR_EVENTS:
        return "executor"
    return "other"


def calibration_event_counts(space: Any) -> dict[str, dict[str, int]]:
    """The host events of each kind recorded inside each ``qsync::calibration::<loop>`` range of
    ``space``, on any thread, over all of that range's repeats: ``{loop: {kind: count}}``."""
    hosts = [p for p in space.planes if p.name.startswith("/host:")]
    host = next((p for p in hosts if p.name == "/host:CPU"), hosts[0] if hosts else None)
    if host is None:
        return {}
    everything = [e for events in _plane_events(host).values() for e in events]
    counts: dict[str, dict[str, int]] = {}
    for loop in (e for e in everything if e.name.startswith(CALIBRATION_LOOP_PREFIX)):
        tally = counts.setdefault(loop.name[len(CALIBRATION_LOOP_PREFIX) :], dict.fromkeys(EVENT_KINDS, 0))
        for e in everything:
            kind = event_kind(e.name)
            if kind is not None and loop.start <= e.start and e.end <= loop.end:
                tally[kind] += 1
    return counts


def _attribute_overhead(
    lines: Mapping[int, list[_Event]],
    main_line: int,
    ops: list[Op],
    costs: Mapping[str, float],
    step_of: Callable[[float], Step | None],
) -> None:
    """Charge every host event of a step its kind's cost (see the module docstring)."""
    compute = [op for op in ops if op.kind != "comm"]
    compute.sort(key=lambda o: o.start_us)
    compute_starts = [op.start_us for op in compute]
    for line_id, events in lines.items():
        nodes = [e for e in events if e.node_id is not None and ops[e.node_id].kind != "comm"]
        starts = [n.start for n in nodes]
        for e in events:
            kind = event_kind(e.name)
            step = step_of(e.start)
            cost = costs.get(kind, 0.0) if kind is not None else 0.0
            if not cost or step is None:
                continue
            i = bisect.bisect_right(starts, e.start) - 1
            if i >= 0 and nodes[i] is e:
                ops[e.node_id].gap_overhead_us += cost
            elif i >= 0 and e.end <= nodes[i].end and ops[nodes[i].node_id].step == step.index:
                ops[nodes[i].node_id].overhead_us += cost
            elif i + 1 < len(nodes) and ops[nodes[i + 1].node_id].step == step.index:
                ops[nodes[i + 1].node_id].gap_overhead_us += cost
            elif line_id == main_line:
                j = bisect.bisect_left(compute_starts, e.start)
                if j < len(compute) and compute[j].step == step.index:
                    compute[j].gap_overhead_us += cost


def _step_finder(steps: list[Step]) -> Callable[[float], Step | None]:
    """A function from a time to the step whose window holds it (None if none does)."""
    starts = [s.start_us for s in steps]

    def step_of(ts: float) -> Step | None:
        i = bisect.bisect_right(starts, ts) - 1
        return steps[i] if i >= 0 and ts < steps[i].end_us else None

    return step_of


def _identity(e: _Event) -> tuple[str, str]:
    """(op name, op type) of an op event or an async op's start event."""
    if e.name in (ASYNC_START, ASYNC_DONE):
        return str(e.stats.get("name", "")), str(e.stats.get("kernel_type", ""))
    return _TF_OP.match(e.name).groups()


def _is_collective(e: _Event) -> bool:
    return e.name in (ASYNC_START, ASYNC_DONE) and bool(_COLLECTIVE_TYPE.match(_identity(e)[1]))


def _is_host_op(e: _Event) -> bool:
    """A synchronous op, or the launch of an async op that is not a collective."""
    if e.name == ASYNC_START:
        return not _is_collective(e)
    return bool(_TF_OP.match(e.name))


def _add_collectives(
    everything: list[_Event],
    lines: dict[int, list[_Event]],
    step_of: Callable[[float], Step | None],
    add: Callable[..., Op | None],
    ops: list[Op],
    collective_tensors: Mapping[str, Sequence[Mapping[str, Any]]],
) -> dict[int, float]:
    """One comm op per collective launched in a step, on the thread that completed it; returns the
    completion time of each by op id.

    Spans on that thread are cut so as not to overlap: a collective runs from its launch or the
    previous completion, whichever is later, to its own completion. A completion the profile lost
    (the last one's event may end after the profiler stopped) is taken as the step's end. A
    collective depends on the op of its step that ran last before its launch on the launching
    thread."""
    done_by_context = {e.stats.get("_c"): e for e in everything if e.name == ASYNC_DONE and _is_collective(e)}
    horovod_lines = [e.line for e in done_by_context.values()]
    pending = []
    for start in everything:
        if start.name != ASYNC_START or not _is_collective(start):
            continue
        done = done_by_context.get(start.stats.get("_p"))
        if done is not None:
            pending.append((done.start, done.line, start))
            continue
        step = step_of(start.start)
        if step is not None:
            line = max(set(horovod_lines), key=horovod_lines.count) if horovod_lines else start.line
            pending.append((step.end_us, line, start))
    nodes = {line: [e for e in events if e.node_id is not None] for line, events in lines.items()}
    free_at: dict[int, float] = {}
    completed: dict[int, float] = {}
    for done_at, line, start in sorted(pending, key=lambda p: p[0]):
        begin = max(start.start, free_at.get(line, -math.inf))
        free_at[line] = done_at
        name, op_type = _identity(start)
        op = add(start, name, op_type, f"comm:{line}", begin, done_at)
        if op is None:
            continue
        kind = _COLLECTIVE_TYPE.match(op_type).group(2)
        op.kind, op.collective = "comm", {"op": _COLLECTIVE_OP[kind]}
        tensors = collective_tensors.get(tensor_key(name))
        if tensors:
            op.collective.update(collective_sizes(tensors))
        completed[op.id] = done_at
        before = [e for e in nodes.get(start.line, []) if e.end <= start.start]
        if before and ops[before[-1].node_id].step == op.step:
            op.deps.append(before[-1].node_id)
    return completed


def collective_sizes(tensors: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A collective's ``tensors`` (copies) with their total ``bytes`` and ``numel`` and the
    ``dtype`` (the first tensor's)."""
    copies = [dict(t) for t in tensors]
    return {
        "tensors": copies,
        "bytes": sum(int(t.get("bytes") or 0) for t in copies),
        "numel": sum(math.prod(t["shape"]) for t in copies if t.get("shape") is not None),
        "dtype": copies[0].get("dtype"),
    }


def _link_consumers(ops: list[Op], done_at: Mapping[int, float]) -> None:
    """The first op of the same step that starts on a non-communication thread at or after a
    collective's completion waits for it."""
    compute = sorted((op for op in ops if not op.thread.startswith("comm:")), key=lambda o: o.start_us)
    starts = [op.start_us for op in compute]
    for op_id, done in done_at.items():
        i = bisect.bisect_left(starts, done)
        if i < len(compute) and compute[i].step == ops[op_id].step:
            compute[i].deps.append(op_id)


def _classify(ops: list[Op], op_types: list[str], optimizer_scopes: Iterable[str]) -> None:
    """Backward by gradient scope, update by optimizer scope or ``Apply*`` type, the rest forward."""
    names = "|".join(re.escape(s) for s in optimizer_scopes)
    optimizer = re.compile(rf"^({names})(_\d+)?/")
    for op, op_type in zip(ops, op_types, strict=True):
        if op.kind == "comm":
            continue
        if _GRADIENT_SCOPE.search(op.name):
            op.kind = "backward"
        elif optimizer.match(op.name) or _APPLY_TYPE.match(op_type):
            op.kind = "update"
        else:
            op.kind = "forward"


def _attribute_layers(ops: list[Op], layers: Sequence[Mapping[str, Any]]) -> None:
    """The longest layer scope in the op's name, at scope boundaries; for a collective, in the
    tensor name Horovod builds from the gradient's name (scopes joined by ``_``)."""
    scopes = sorted(((str(t["scope"]), str(t["name"])) for t in layers), key=lambda s: -len(s[0]))
    found: dict[tuple[str, bool], str | None] = {}
    for op in ops:
        key = (op.name, op.kind == "comm")
        if key not in found:
            padded, flat = f"/{op.name}/", f"_{op.name.rsplit('/', 1)[-1]}_"
            found[key] = next(
                (
                    name
                    for scope, name in scopes
                    if f"/{scope}/" in padded or (key[1] and f"_{scope.replace('/', '_')}_" in flat)
                ),
                None,
            )
        op.layer = found[key]
