"""The normalized trace: one rank's recorded steps, framework-neutral, as JSON.

Every recorder (torch.profiler here, the TF profiler plus Horovod's timeline later) writes this
schema, and everything downstream (graph, replay, memory, report) reads only this schema.

One file per rank, ``<trace_dir>/rank<k>/trace.json``::

    {
      "format": "qsync-trace", "version": 1,
      "framework": "torch", "framework_version": "2.13.0",
      "rank": 0, "world_size": 2, "device": "cpu", "host": "node-3",
      "clock_offset_us": 12.5,          # add to this rank's timestamps to get the common clock
                                        # (ranks on one host share its clock and need none)
      "steps": [{"index": 7, "start_us": ..., "end_us": ...}, ...],
      "ops": [Op, ...],                 # see `Op`
      "memory_events": [[ts_us, addr, bytes, op_id], ...],   # bytes < 0 is a free; op_id -1: none
      "resident_bytes": {"parameters": ..., "gradients": ..., "optimizer_state": ..., "buffers": ...},
      "saved_activation_bytes": {"net.0": ..., ...},   # saved for backward in one step, by layer
      "precision": {"net.0": "bf16", ...},   # the precision each layer ran at (absent: fp32)
      "precision_costs": {...},         # per-layer probes at each precision and the fitted casts
                                        # (`recorder/precision_probes.py`); absent if not probed;
                                        # for a graph rewrite chosen by op type (TF), under
                                        # "op_types" (below)
      "layer_statistics": {...},        # per-layer value statistics for the precision indicator
      "layers": [{"name": "net.0", "type": "Linear", "param_bytes": 33024, "next": "net.1"}, ...],
                                        # "next": the next child of its nn.Sequential, or null
      "measured": {"step_ms": [...], "peak_bytes": ..., "peak_source": "..."},
      "profiler_overhead_us": {"op": ..., "range": ..., "memory": ...},
      "communication": {...},           # the collective library's settings in effect, and where its
                                        # own record is (Horovod: fusion threshold, cycle time,
                                        # groups, timeline; see `recorder/horovod_timeline.py`)
      "fingerprint": {...},
      "raw_trace": "kineto.json"        # the profiler's own trace, beside this file
    }

Times are microseconds on this rank's clock. An op's ``dur_us`` and ``gap_us`` are as recorded;
``overhead_us`` is the part of ``dur_us`` and ``gap_overhead_us`` the part of the idle time before
the op that the profiler itself added (events recorded inside or before it, times the calibrated
per-event cost); the graph subtracts them so that predictions are for runs without the profiler.

Per-op-type precision costs (``precision_costs["op_types"]``, written by
`integrations/horovod_tf/mixed_precision.py`, read by `predictor/op_precision.py`)::

    {"ops": {"mlp/fc1/Relu": "MatMul", ...},   # op type of recorded ops, by op name (a fused op:
                                               # its root type, as the rewrite's lists name it)
     "low_ops": ["mlp/fc1/Relu", ...],         # the ops the uniform bf16 rewrite ran at bf16
                                               # (recorded or not: fused, renamed)
     "edges": [["x", "mlp/fc1/Relu", 65536], ...],   # float tensors between ops: producer,
                                               # consumer, bytes at fp32 (one entry per use; an
                                               # end recorded or in low_ops)
     "costs": {"MatMul": {"ops": 5, "measured_ops": 5, "fp32_us": 8012.4, "bf16_us": 1950.2}, ...},
                                               # per step: the type's ops (measured_ops of them
                                               # ran at bf16 under the rewrite) summed, at fp32
                                               # (the recorded steps) and at bf16 (profiled steps)
     "casts": {"fp32->bf16": {"us_per_byte": .., "bytes": .., "casts": 9}, "bf16->fp32": {...}},
                                               # the rewrite's own Cast ops, per step, per fp32 byte
     "source": "..."}                          # what was measured where (rank, steps)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from qsync_callback.errors import QSyncInputError
from qsync_callback.jsonio import read_json, write_text_atomic

TRACE_FORMAT = "qsync-trace"
TRACE_VERSION = 1
TRACE_FILE = "trace.json"
OP_KINDS = ("forward", "backward", "update", "comm", "cast", "copy", "other")


@dataclass
class Op:
    """One node-to-be of the data-flow graph: an outermost op on one thread, or a collective.

    ``thread`` names the queue it ran on: "main" (the training loop's thread, which also runs
    backward on CPU), "comm:<n>" (a communication thread or stream), "cuda:<stream>", or
    "tid:<n>" for any other thread. ``deps`` are ids of ops on other threads it waited for
    (same-thread order is implied by start time). ``collective`` is set on communication ops:
    {"op": "all_reduce", "numel": ..., "bytes": ..., "dtype": ...}. A Horovod collective op (one per
    ``HorovodAllreduce``, or per ``HorovodGroupedAllreduce`` of several tensors) also lists its
    ``"tensors"``: [{"name": <Horovod's tensor name, last path component>, "variable": <the variable
    whose gradient it is, or null>, "shape": [...], "dtype": ..., "bytes": ...,
    "timeline": <rank 0 only: `TensorRecord.to_dict()`, the coordinator's phases and response>}].
    """

    id: int
    name: str
    kind: str
    thread: str
    start_us: float
    dur_us: float
    step: int
    layer: str | None = None
    seq: int | None = None
    input_shapes: list = field(default_factory=list)
    input_dtypes: list = field(default_factory=list)
    bytes: int = 0
    overhead_us: float = 0.0
    gap_overhead_us: float = 0.0
    deps: list[int] = field(default_factory=list)
    collective: dict | None = None

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass
class Step:
    """One training step's window on this rank's clock."""

    index: int
    start_us: float
    end_us: float

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class Trace:
    """One rank's normalized trace (see the module docstring for the JSON layout)."""

    rank: int
    world_size: int
    device: str
    steps: list[Step]
    ops: list[Op]
    framework: str = "torch"
    framework_version: str = ""
    host: str = ""
    clock_offset_us: float = 0.0
    memory_events: list[list] = field(default_factory=list)
    resident_bytes: dict[str, int] = field(default_factory=dict)
    saved_activation_bytes: dict[str, int] = field(default_factory=dict)
    precision: dict[str, str] = field(default_factory=dict)
    precision_costs: dict[str, Any] = field(default_factory=dict)
    layer_statistics: dict[str, Any] = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)
    profiler_overhead_us: dict[str, float] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    raw_trace: str | None = None
    communication: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the ops and steps are shallow copies (their fields are plain JSON values)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["ops"] = [dict(vars(op)) for op in self.ops]
        data["steps"] = [dict(vars(step)) for step in self.steps]
        return {"format": TRACE_FORMAT, "version": TRACE_VERSION, **data}

    def save(self, path: str | os.PathLike) -> None:
        """Write as JSON, atomically (a reader never sees half a file)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(self.to_dict(), separators=(",", ":")), what="trace")

    @classmethod
    def from_dict(cls, data: Any, source: str = "<trace>") -> Trace:
        """Validate and build; any problem raises QSyncInputError naming ``source``."""
        if not isinstance(data, Mapping):
            raise QSyncInputError(f"{source}: not a qsync trace (expected a JSON object)")
        if data.get("format") != TRACE_FORMAT:
            raise QSyncInputError(f"{source}: not a qsync trace (format is {data.get('format')!r})")
        if data.get("version") != TRACE_VERSION:
            raise QSyncInputError(
                f"{source}: trace version {data.get('version')!r}; this tool reads version {TRACE_VERSION}"
            )
        try:
            steps = [Step(int(s["index"]), float(s["start_us"]), float(s["end_us"])) for s in data["steps"]]
            ops = [_op_from_dict(o) for o in data["ops"]]
            trace = cls(
                rank=int(data["rank"]),
                world_size=int(data["world_size"]),
                device=str(data["device"]),
                steps=steps,
                ops=ops,
                framework=str(data.get("framework", "")),
                framework_version=str(data.get("framework_version", "")),
                host=str(data.get("host", "")),
                clock_offset_us=float(data.get("clock_offset_us", 0.0)),
                memory_events=[list(e) for e in data.get("memory_events", [])],
                resident_bytes={str(k): int(v) for k, v in data.get("resident_bytes", {}).items()},
                saved_activation_bytes={
                    str(k): int(v) for k, v in data.get("saved_activation_bytes", {}).items()
                },
                precision={str(k): str(v) for k, v in data.get("precision", {}).items()},
                precision_costs=dict(data.get("precision_costs", {})),
                layer_statistics=dict(data.get("layer_statistics", {})),
                layers=list(data.get("layers", [])),
                measured=dict(data.get("measured", {})),
                profiler_overhead_us={k: float(v) for k, v in data.get("profiler_overhead_us", {}).items()},
                fingerprint=dict(data.get("fingerprint", {})),
                raw_trace=data.get("raw_trace"),
                communication=dict(data.get("communication", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise QSyncInputError(f"{source}: malformed trace ({type(exc).__name__}: {exc})") from None
        _check_consistency(trace, source)
        return trace

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        return cls.from_dict(read_json(path, what="trace file"), source=str(path))


def _op_from_dict(o: Mapping) -> Op:
    return Op(
        id=int(o["id"]),
        name=str(o["name"]),
        kind=str(o["kind"]),
        thread=str(o["thread"]),
        start_us=float(o["start_us"]),
        dur_us=float(o["dur_us"]),
        step=int(o["step"]),
        layer=o.get("layer"),
        seq=o.get("seq"),
        input_shapes=list(o.get("input_shapes", [])),
        input_dtypes=list(o.get("input_dtypes", [])),
        bytes=int(o.get("bytes", 0)),
        overhead_us=float(o.get("overhead_us", 0.0)),
        gap_overhead_us=float(o.get("gap_overhead_us", 0.0)),
        deps=[int(d) for d in o.get("deps", [])],
        collective=o.get("collective"),
    )


def _check_consistency(trace: Trace, source: str) -> None:
    if not trace.steps:
        raise QSyncInputError(f"{source}: the trace has no recorded steps")
    ids = set()
    step_indices = {s.index for s in trace.steps}
    for op in trace.ops:
        if op.kind not in OP_KINDS:
            raise QSyncInputError(f"{source}: op {op.id} has unknown kind {op.kind!r}")
        if not (math.isfinite(op.start_us) and math.isfinite(op.dur_us)) or op.dur_us < 0:
            raise QSyncInputError(f"{source}: op {op.id} ({op.name}) has an invalid time")
        if op.step not in step_indices:
            raise QSyncInputError(f"{source}: op {op.id} ({op.name}) belongs to unrecorded step {op.step}")
        ids.add(op.id)
    if len(ids) != len(trace.ops):
        raise QSyncInputError(f"{source}: op ids are not unique")
    for op in trace.ops:
        missing = [d for d in op.deps if d not in ids]
        if missing:
            raise QSyncInputError(f"{source}: op {op.id} depends on unknown op {missing[0]}")


def clock_offsets_us(traces: Sequence[Trace]) -> list[float]:
    """What to add to each rank's timestamps to put all ranks on one clock.

    Ranks on one host read the same clock: no offset (the barrier-based offset would only add the
    barrier's release skew). Across hosts: each rank's ``clock_offset_us``, which puts the moment
    every rank left the clock-sync barrier at zero.
    """
    if all(t.host and t.host == traces[0].host for t in traces):
        return [0.0] * len(traces)
    return [t.clock_offset_us for t in traces]


def rank_trace_path(trace_dir: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` writes its normalized trace under ``trace_dir``."""
    return Path(trace_dir) / f"rank{rank}" / TRACE_FILE


def load_trace_dir(trace_dir: str | os.PathLike) -> list[Trace]:
    """Load every rank's trace under ``trace_dir`` (a directory of ``rank<k>/trace.json``).

    Checks that the set of ranks is complete and that all ranks agree on the world size.
    """
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        raise QSyncInputError(f"{trace_dir}: no such trace directory")
    files = sorted(trace_dir.glob(f"rank*/{TRACE_FILE}"))
    if not files and (trace_dir / TRACE_FILE).is_file():
        files = [trace_dir / TRACE_FILE]
    if not files:
        raise QSyncInputError(f"{trace_dir}: no rank*/{TRACE_FILE} inside; is this a qsync trace directory?")
    traces = sorted((Trace.load(f) for f in files), key=lambda t: t.rank)
    world = traces[0].world_size
    ranks = [t.rank for t in traces]
    if any(t.world_size != world for t in traces):
        raise QSyncInputError(f"{trace_dir}: ranks disagree on the world size")
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        raise QSyncInputError(f"{trace_dir}: world size is {world} but traces of ranks {missing} are missing")
    return traces
