"""Read Horovod's timeline: per-tensor communication records and the responses that fused them.

Horovod's coordinator (rank 0; the other ranks write nothing) writes a Chrome-trace JSON array while
its timeline is on (``hvd.start_timeline(path)`` with ``HOROVOD_TIMELINE=DYNAMIC`` set before
``hvd.init()``, or ``HOROVOD_TIMELINE=<path>`` for the whole run). What Horovod 0.28.1 writes:

- a first ``process_name`` metadata record (pid 0) whose ``start_time_since_epoch_in_micros`` is the
  wall-clock time of the timeline's zero: ``ts`` values count microseconds from it, so
  ``start + ts`` is on the host's wall clock (the clock the TF recorder puts its ops on);
- one "process" per tensor (``process_name`` metadata: Horovod's tensor name, the collective op's
  name with the function-instantiation path TF puts in front, and ``_<i>of<n>`` after a grouped
  op's i-th tensor);
- per tensor and step, begin/end (``B``/``E``) pairs: ``NEGOTIATE_ALLREDUCE`` (from the moment rank 0
  queued the tensor to the coordinator's decision that every rank has it), then ``ALLREDUCE`` (the
  execution) with nested activities: ``MEMCPY_IN_FUSION_BUFFER``, ``GLOO_ALLREDUCE`` (or
  ``MPI_ALLREDUCE``, ``NCCL_ALLREDUCE``...), ``MEMCPY_OUT_FUSION_BUFFER`` for a fused response, just
  the collective for a single tensor; the op's ``E`` carries the tensor's ``dtype`` and ``shape``;
- ``CYCLE_START`` instants (with ``mark_cycles``).

Horovod writes the ``B`` of every tensor of one response in a loop before any of its nested
activities start, so the tensors whose op began before the first nested activity of the response
were fused together (that holds on CPU, where responses run one after the other, and on GPU, where
they may overlap). A run that is still going leaves the array unterminated (no ``]``, maybe a
trailing comma): that is read as is; a file cut inside a record, or anything else that is not such
an array, raises one `QSyncInputError` naming the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qsync_callback.errors import QSyncInputError

NEGOTIATE_PREFIX = "NEGOTIATE_"
START_KEY = "start_time_since_epoch_in_micros"
DTYPE_BYTES = {
    "uint8": 1,
    "int8": 1,
    "bool": 1,
    "uint16": 2,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "float32": 4,
    "int64": 8,
    "float64": 8,
}


@dataclass
class Activity:
    """One begin/end pair of a tensor: its name, times (wall-clock microseconds) and nesting depth."""

    name: str
    start_us: float
    end_us: float
    depth: int
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class TensorRecord:
    """One tensor's collective in one step, as the coordinator saw it.

    ``op`` is the executed activity (``"ALLREDUCE"``...); ``start_us``/``end_us`` its span;
    ``negotiate_us`` the negotiation before it (None if the timeline started after it began);
    ``phases`` the nested activities; ``response`` the index (in time order, within the file) of
    the response that carried it: tensors with the same index were fused into one buffer."""

    name: str
    op: str
    start_us: float
    end_us: float
    negotiate_us: tuple[float, float] | None
    phases: list[Activity]
    dtype: str | None
    shape: list[int] | None
    response: int = -1

    @property
    def key(self) -> str:
        """The collective op's own name (the last path component), with a group part's suffix."""
        return tensor_key(self.name)

    @property
    def bytes(self) -> int | None:
        """Size of the tensor from the dtype and shape Horovod reported; None if unknown."""
        if self.shape is None or self.dtype not in DTYPE_BYTES:
            return None
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form that the normalized trace keeps per tensor (times as given)."""
        return {
            "response": self.response,
            "op_us": [self.start_us, self.end_us],
            "negotiate_us": list(self.negotiate_us) if self.negotiate_us else None,
            "phases_us": {p.name: [p.start_us, p.end_us] for p in self.phases},
        }


def tensor_key(name: str) -> str:
    """The last path component of a Horovod tensor or op name (the same on every rank and in the
    XSpace, whatever function-instantiation path TF puts in front)."""
    return name.rsplit("/", 1)[-1]


def part_keys(op_key: str, count: int) -> list[str]:
    """Horovod's tensor names for the ``count`` tensors of one (grouped) collective op."""
    if count == 1:
        return [op_key]
    return [f"{op_key}_{i + 1}of{count}" for i in range(count)]


def load_timeline(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a timeline file; an empty file (no collective ran) is no records.

    Reads an unterminated array (the run still writing); raises QSyncInputError naming the file if
    it cannot be read, is cut inside a record, or is not an array of objects."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise QSyncInputError(f"{path}: cannot read the Horovod timeline ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise QSyncInputError(f"{path}: the Horovod timeline is not UTF-8 text") from None
    body = text.strip()
    if not body:
        return []
    if not body.startswith("["):
        raise QSyncInputError(f"{path}: not a Horovod timeline (expected a JSON array of trace events)")
    if not body.endswith("]"):
        body = body.rstrip(",").rstrip() + "]"
    try:
        records = json.loads(body)
    except json.JSONDecodeError as exc:
        raise QSyncInputError(
            f"{path}: the Horovod timeline is truncated or corrupt (line {exc.lineno}, column {exc.colno}:"
            f" {exc.msg})"
        ) from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise QSyncInputError(f"{path}: not a Horovod timeline (expected a JSON array of trace events)")
    return records


def convert_timeline(records: list[dict[str, Any]], source: str = "<timeline>") -> list[TensorRecord]:
    """Per-tensor records of a loaded timeline, in order of their op's start, with responses.

    Times are wall-clock microseconds (the file's start time plus ``ts``). An activity still open
    at the end of the file (the timeline stopped during it) is dropped; QSyncInputError if a
    record lacks what Horovod always writes."""
    names: dict[int, str] = {}
    start: float | None = None
    open_stacks: dict[int, list[tuple[str, float]]] = {}
    finished: dict[int, list[Activity]] = {}
    try:
        for r in records:
            ph = r.get("ph")
            if ph == "M" and r.get("name") == "process_name":
                args = r.get("args", {})
                if START_KEY in args:
                    start = float(args[START_KEY])
                elif "name" in args:
                    names[int(r["pid"])] = str(args["name"])
            elif ph == "B":
                open_stacks.setdefault(int(r["pid"]), []).append((str(r["name"]), float(r["ts"])))
            elif ph == "E":
                stack = open_stacks.get(int(r["pid"]))
                if stack:
                    name, begin = stack.pop()
                    finished.setdefault(int(r["pid"]), []).append(
                        Activity(name, begin, float(r["ts"]), len(stack), dict(r.get("args") or {}))
                    )
    except (KeyError, TypeError, ValueError) as exc:
        what = f"{type(exc).__name__}: {exc}"
        raise QSyncInputError(f"{source}: malformed Horovod timeline record ({what})") from None
    if start is None and finished:
        raise QSyncInputError(f"{source}: the Horovod timeline has no {START_KEY} record")
    tensors: list[TensorRecord] = []
    for pid, activities in finished.items():
        if pid not in names:
            raise QSyncInputError(f"{source}: Horovod timeline events for unnamed process {pid}")
        tensors.extend(_tensor_records(names[pid], activities, start or 0.0))
    tensors.sort(key=lambda t: (t.start_us, t.name))
    _assign_responses(tensors)
    return tensors


def read_timeline(path: str | os.PathLike) -> list[TensorRecord]:
    """`convert_timeline` of `load_timeline`: the per-tensor records of a timeline file."""
    return convert_timeline(load_timeline(path), source=str(path))


def _tensor_records(name: str, activities: list[Activity], start: float) -> list[TensorRecord]:
    """One record per top-level op activity of a tensor, with the negotiation just before it and
    the activities nested in it."""
    activities.sort(key=lambda a: (a.start_us, a.depth))
    out: list[TensorRecord] = []
    negotiate: tuple[float, float] | None = None
    for i, top in enumerate(activities):
        if top.depth != 0:
            continue
        if top.name.startswith(NEGOTIATE_PREFIX):
            negotiate = (start + top.start_us, start + top.end_us)
            continue
        nested = [
            Activity(a.name, start + a.start_us, start + a.end_us, a.depth)
            for a in activities[i + 1 :]
            if a.depth > 0 and top.start_us <= a.start_us and a.end_us <= top.end_us
        ]
        shape = top.args.get("shape")
        out.append(
            TensorRecord(
                name=name,
                op=top.name,
                start_us=start + top.start_us,
                end_us=start + top.end_us,
                negotiate_us=negotiate,
                phases=nested,
                dtype=top.args.get("dtype"),
                shape=json.loads(shape) if isinstance(shape, str) else None,
            )
        )
        negotiate = None
    return out


def _assign_responses(tensors: list[TensorRecord]) -> None:
    """Number the responses: a tensor joins the current response if its op began before the
    response's first nested activity (or its end, if it has none)."""
    response, cutoff = -1, -float("inf")
    for t in tensors:
        if t.start_us > cutoff:
            response += 1
            cutoff = min((p.start_us for p in t.phases), default=t.end_us)
        t.response = response
