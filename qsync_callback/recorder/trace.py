"""The normalized trace: one rank's recorded steps, framework-neutral, as JSON.

Every recorder (torch.profiler here, the TF profiler plus Horovod's timeline later) writes this
schema, and everything downstream (graph, replay, memory, report) reads only this schema. Reading
one checks every field's type and shape against this layout, said in code as `_TRACE` and `_OP`
(unknown keys are ignored), and rank traces read or gathered together are checked to be one
run's (`check_rank_traces`).

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
      "allocator": {"name": "mklcpu", "in_use_bytes": ...},   # whose allocations memory_events
                                        # are, where its figures are not the bytes asked for: TF's
                                        # BFC allocators ("mklcpu", "GPU_0_bfc"), simulated by
                                        # `predictor/bfc_allocator.py`, and its bytes in use when
                                        # the window opened; absent: the bytes are the figure (torch)
                                        # "recorded_peak_bytes": the most it read in use in the
                                        # recorded steps (its profile's own readings), where given
      "resident_bytes": {"parameters": ..., "gradients": ..., "optimizer_state": ..., "buffers": ...,
                         "gradient_buckets": ..., "other": ...},   # "other": every other live tensor
                                                                  # at the window's start
      "saved_activation_bytes": {"net.0": ..., ...},   # saved for backward in one step, by layer
      "precision": {"net.0": "bf16", ...},   # the precision each layer ran at (absent: fp32)
      "precision_costs": {...},         # per-layer probes at each precision and the fitted casts
                                        # (`recorder/precision_probes.py`); absent if not probed;
                                        # for a graph rewrite chosen by op type (TF), under
                                        # "op_types" (below)
      "layer_statistics": {...},        # per-layer value statistics for the precision indicator
      "activation_costs": {"copy": {"tier": "disk", "to_store": {"alpha_us": .., "us_per_byte": ..},
                                    "from_store": {...},   # the offload store's fitted copies
                                    "in_step": {"modules": ["net"], "factor": 1.6, ...}, ...},
                                        # what the steps paid over the fit's price, measured in an
                                        # offload trial (`activation_trial.py`)
                           "recompute": {"in_step": {"modules": ["net"], "change_ms": 27.0, ...}},
                                        # what recomputing them cost the steps (a recompute trial)
                           "refused": {"net.2": "called twice per step", ...}},
                                        # modules that cannot take an activation policy, and why
      "compiled_regions": {"steps_left": 980,   # training steps after the window (null: unknown)
                           "called_blocks": ["blocks.0", ...],   # blocks whose forward ran
                           "partial_last_batch": true,   # an epoch ends with a smaller batch
                                                         # (null: the data loader does not say)
                           "probes": {"blocks.0": {"eager_us": .., "compiled_us": .., "compile_s": ..,
                                                   "graphs": 1}, ...},
                           "note": "..."},      # modules compiled during the warm-up
                                        # (`recorder/region_probes.py`), or why none were
      "layers": [{"name": "net.0", "type": "Linear", "param_bytes": 33024, "next": "net.1"}, ...],
                                        # "next": the next child of its nn.Sequential, or null
      "measured": {"step_ms": [...], "peak_bytes": ..., "peak_source": "...",
                   "step_peak_bytes": [...],   # per measured step, where the allocator gives one
                   "profiler_share": {"in_step_ms": ..., "loops_share_ms": ..., "scale": ...,
                                      "slowdown": ...}},
                                        # what recording added to a step beyond the loops' costs,
                                        # from the recorded against the unprofiled steps
                                        # (`event_costs.calibrate_on_steps`, `Trace.own_us`)
      "profiler_overhead_us": {"op": ..., "range": ..., "memory": ...},
      "communication": {...},           # the collective library's settings in effect, and where its
                                        # own record is (Horovod: fusion threshold, cycle time,
                                        # groups, timeline; see `recorder/horovod_timeline.py`;
                                        # DDP: its buckets and bucket caps, see
                                        # `recorder/ddp_buckets.py`)
      "fingerprint": {...},
      "raw_trace": "kineto.json",       # the profiler's own trace, beside this file
      "symbolic": {"durations": "...", "batch": "...", "tensors": "fake"}   # a step traced on fake
                                        # tensors (or, for a model that needs values, "real ...")
                                        # (`recorder/symbolic_trace.py`): no real compute ran; its
                                        # ops carry "flops" and their durations are predicted (how:
                                        # "durations"); absent on a recorded trace
    }

Times are microseconds on this rank's clock. An op's ``dur_us`` and ``gap_us`` are as recorded;
``overhead_us`` is the part of ``dur_us`` and ``gap_overhead_us`` the part of the idle time before
the op that the profiler itself added (events recorded inside or before it, times the calibrated
per-event cost); the graph subtracts them so that predictions are for runs without the profiler.

Per-op-type precision costs (``precision_costs["op_types"]``, written by
`recorder/tf_op_types.py`, read by `predictor/op_precision.py`)::

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
     "allocated": {"mlp/fc1/Relu": [1048576, 524288], ...},   # bytes the allocator gave an op per
                                               # step that outlived it: recorded (fp32), and under
                                               # the rewrite
     "scratch": {"g/conv/Conv2DBackpropFilter": [0, 27721728], ...},   # the most bytes an op was
                                               # given and freed before it ended alive at once:
                                               # recorded, and under the rewrite (ops with some)
     "cast_allocated": {"mlp/fc1/Relu->bf16": 524288, ...},   # the same of the rewrite's casts of a
                                               # producer's output, by producer and direction
     "recorded_peak_bytes": 34603008,          # the most TF's allocator read in use in the profiled
                                               # steps of the rewrite (where it reads)
     "step_peak_bytes": [30408704, ...],        # each of the rewrite's reading calls' allocator peak
     "turns": {"baseline": [[5.3, ...], ...],   # the reading calls' times (ms), the recorded step's
               "plan": [[5.1, ...], ...]},      # and the rewrite's, by round (`alternation.py`)
     "source": "..."}                          # what was measured where (rank, steps)
    {"note": "..."}                            # instead, where the probe measured nothing: why
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from qsync_callback.errors import QSyncInputError
from qsync_callback.jsonio import (
    AMOUNT,
    ANY,
    BOOLEAN,
    COUNT,
    FINITE,
    INTEGER,
    NUMBER,
    STRING,
    Fields,
    ListOf,
    MapOf,
    Nullable,
    Row,
    Scalar,
    check_shape,
    collector_paused,
    read_json,
    write_text_atomic,
)
from qsync_callback.plan import PRECISIONS
from qsync_callback.recorder.statistics_schema import check_statistics

TRACE_FORMAT = "qsync-trace"
TRACE_VERSION = 1
TRACE_FILE = "trace.json"
OP_KINDS = ("forward", "backward", "update", "comm", "cast", "copy", "other")
OP_TYPE_COSTS = "op_types"  # the key of the per-op-type precision costs under Trace.precision_costs


@dataclass
class Op:
    """One node-to-be of the data-flow graph: an outermost op on one thread, or a collective.

    ``layer`` is the innermost layer that ran it (`model_layers.layers_of`), ``module`` the innermost
    module of any kind (a layer, or a block's own op: ``blocks.0`` for its residual add); both None
    outside the model's forward and backward.
    ``thread`` names the queue it ran on: "main" (the training loop's thread, which also runs
    backward on CPU), "comm:<n>" (a communication thread or stream), "cuda:<stream>", or
    "tid:<n>" for any other thread. ``deps`` are ids of ops on other threads it waited for
    (same-thread order is implied by start time). ``collective`` is set on communication ops:
    {"op": "all_reduce", "numel": ..., "bytes": ..., "dtype": ...}. A Horovod collective op (one per
    ``HorovodAllreduce``, or per ``HorovodGroupedAllreduce`` of several tensors) also lists its
    ``"tensors"``: [{"name": <Horovod's tensor name, last path component>, "variable": <the variable
    whose gradient it is, or null>, "shape": [...], "dtype": ..., "bytes": ...,
    "timeline": <rank 0 only: `TensorRecord.to_dict()`, the coordinator's phases and response>}].
    A DDP bucket's all-reduce lists its gradients the same way, named by parameter, each with the
    ``"layer"`` that owns it (`recorder/ddp_buckets.py`)."""

    id: int
    name: str
    kind: str
    thread: str
    start_us: float
    dur_us: float
    step: int
    layer: str | None = None
    module: str | None = None
    seq: int | None = None
    input_shapes: list = field(default_factory=list)
    input_dtypes: list = field(default_factory=list)
    bytes: int = 0
    overhead_us: float = 0.0
    gap_overhead_us: float = 0.0
    deps: list[int] = field(default_factory=list)
    collective: dict | None = None
    flops: float = 0.0  # a symbolic trace's (`symbolic_trace.py`): the op's floating-point operations

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
    allocator: dict[str, Any] = field(default_factory=dict)
    resident_bytes: dict[str, int] = field(default_factory=dict)
    saved_activation_bytes: dict[str, int] = field(default_factory=dict)
    precision: dict[str, str] = field(default_factory=dict)
    precision_costs: dict[str, Any] = field(default_factory=dict)
    layer_statistics: dict[str, Any] = field(default_factory=dict)
    activation_costs: dict[str, Any] = field(default_factory=dict)
    compiled_regions: dict[str, Any] = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)
    profiler_overhead_us: dict[str, float] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    raw_trace: str | None = None
    communication: dict[str, Any] = field(default_factory=dict)
    symbolic: dict[str, Any] = field(default_factory=dict)  # set on a trace traced symbolically

    def own_us(self, op: Op) -> float:
        """``op``'s duration without the profiler: less its events' cost at the loops' per-event
        costs (``op.overhead_us``), scaled and less the steps' slowdown as the recorded steps against
        the unprofiled ones say (``measured["profiler_share"]``, `event_costs.calibrate_on_steps`; a
        negative slowdown, recorded steps that ran faster, lengthens it)."""
        share = self.measured.get("profiler_share") or {}
        own = max(0.0, op.dur_us - share.get("scale", 1.0) * op.overhead_us)
        return own if op.collective is not None else own * (1.0 - share.get("slowdown", 0.0))

    def gap_overhead_us(self, op: Op) -> float:
        """The part of the idle time before ``op`` that recording added per event
        (``op.gap_overhead_us``, scaled as `own_us` says)."""
        share = self.measured.get("profiler_share") or {}
        return share.get("scale", 1.0) * op.gap_overhead_us

    def gap_kept(self, op: Op) -> float:
        """The share of the idle time before ``op`` (less `gap_overhead_us`) that the run keeps
        without the profiler: 1 less the steps' slowdown (1 before a collective)."""
        share = self.measured.get("profiler_share") or {}
        return 1.0 if op.collective is not None else 1.0 - share.get("slowdown", 0.0)

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
        """Validate and build; any problem raises QSyncInputError naming ``source`` and the field.

        Every field's type and shape is checked (`_TRACE`, `_OP`), and the ops against the steps
        and each other. The trace takes ``data``'s lists and objects over, uncopied."""
        if not isinstance(data, Mapping):
            raise QSyncInputError(f"{source}: not a qsync trace (expected a JSON object)")
        if data.get("format") != TRACE_FORMAT:
            raise QSyncInputError(f"{source}: not a qsync trace (format is {data.get('format')!r})")
        if data.get("version") != TRACE_VERSION:
            raise QSyncInputError(
                f"{source}: trace version {data.get('version')!r}; this tool reads version {TRACE_VERSION}"
            )
        check_shape(data, _TRACE, source)
        if data["rank"] >= data["world_size"]:
            raise QSyncInputError(f"{source}: rank is {data['rank']} but world_size is {data['world_size']}")
        steps = [Step(s["index"], s["start_us"], s["end_us"]) for s in data["steps"]]
        if not steps:
            raise QSyncInputError(f"{source}: the trace has no recorded steps")
        for i, step in enumerate(steps):
            if step.end_us <= step.start_us:
                raise QSyncInputError(f"{source}: steps[{i}] does not end after it starts")
        with collector_paused():
            ops = _ops_from_json(data["ops"], {s.index for s in steps}, source)
        _check_memory_events(data.get("memory_events", []), source)
        if data.get("layer_statistics"):
            check_statistics(data["layer_statistics"], f"{source}: layer_statistics")
        return cls(
            rank=data["rank"],
            world_size=data["world_size"],
            device=data["device"],
            steps=steps,
            ops=ops,
            **{name: data[name] for name in _OPTIONAL_FIELDS if name in data},
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        return cls.from_dict(read_json(path, what="trace file"), source=str(path))


# --- the JSON layout, checked on load ---------------------------------------------------------

_SPAN = Row((FINITE, FINITE), "[start_us, end_us]")
_COLLECTIVE = Fields(
    required={"op": STRING},
    optional={
        "numel": COUNT,
        "bytes": COUNT,
        "dtype": Nullable(STRING),
        "tensors": ListOf(
            Fields(
                required={"name": STRING},
                optional={
                    "variable": Nullable(STRING),
                    "shape": Nullable(ListOf(Nullable(INTEGER))),
                    "dtype": Nullable(STRING),
                    "bytes": Nullable(COUNT),
                    "layer": Nullable(STRING),
                    "timeline": Nullable(
                        Fields(
                            required={"op_us": _SPAN},
                            optional={
                                "response": INTEGER,
                                "negotiate_us": Nullable(_SPAN),
                                "phases_us": MapOf(_SPAN),
                            },
                        )
                    ),
                },
            )
        ),
    },
)
_OP = Fields(
    required={
        "id": INTEGER,
        "name": STRING,
        "kind": Scalar(lambda v: v in OP_KINDS, f"one of {', '.join(OP_KINDS)}"),
        "thread": STRING,
        "start_us": FINITE,
        "dur_us": AMOUNT,
        "step": INTEGER,
    },
    optional={
        "layer": Nullable(STRING),
        "module": Nullable(STRING),
        "seq": Nullable(INTEGER),
        "input_shapes": ListOf(ANY),
        "input_dtypes": ListOf(ANY),
        "bytes": INTEGER,
        "overhead_us": FINITE,
        "gap_overhead_us": FINITE,
        "deps": ListOf(INTEGER),
        "collective": Nullable(_COLLECTIVE),
        "flops": AMOUNT,
    },
)
_MEMORY_EVENT = Row((FINITE, INTEGER, INTEGER, INTEGER), "a list of 4: [time_us, address, bytes, op id]")
_PROBE_COSTS = MapOf(  # by precision: probe_layer_costs / probe_pass_through_costs
    Fields(required={"forward_us": NUMBER, "backward_us": NUMBER, "saved_bytes": NUMBER}, rest=NUMBER)
)
_SHAPE = ListOf(COUNT, expected="a shape (a list of integers >= 0)")
_PRECISION_COSTS = Fields(
    optional={
        "precisions": ListOf(STRING),
        "device": STRING,
        "probe_s": NUMBER,
        "casts": MapOf(
            Fields(
                required={"alpha_us_per_element": NUMBER, "beta_us": NUMBER},
                optional={"r2": Nullable(NUMBER)},
            )
        ),
        "layers": MapOf(
            Fields(
                required={
                    "input_numel": COUNT,
                    "output_numel": COUNT,
                    "weight_numel": COUNT,
                    "costs": _PROBE_COSTS,
                },
                optional={"input_shape": _SHAPE},
            )
        ),
        "pass_through": MapOf(
            Fields(required={"costs": _PROBE_COSTS}, optional={"input_shape": _SHAPE, "input_numel": COUNT})
        ),
        "op_types": Fields(
            optional={
                "ops": MapOf(STRING),
                "low_ops": ListOf(STRING),
                "edges": ListOf(Row((STRING, STRING, NUMBER), "[producer, consumer, bytes]")),
                "costs": MapOf(Fields(optional={"ops": COUNT, "measured_ops": COUNT}, rest=Nullable(NUMBER))),
                "casts": MapOf(Fields(required={"us_per_byte": NUMBER})),
                "allocated": MapOf(Row((AMOUNT, AMOUNT), "[fp32 bytes, bf16 bytes]")),
                "scratch": MapOf(Row((AMOUNT, AMOUNT), "[fp32 bytes, bf16 bytes]")),
                "cast_allocated": MapOf(AMOUNT),
                "recorded_peak_bytes": AMOUNT,
                "step_peak_bytes": ListOf(AMOUNT),
                "turns": Fields(required=dict.fromkeys(("baseline", "plan"), ListOf(ListOf(FINITE)))),
                "source": STRING,
            }
        ),
    }
)
_COPY_FIT = Fields(required={"alpha_us": FINITE, "us_per_byte": FINITE}, rest=ANY)
_ACTIVATION_COSTS = Fields(
    optional={
        "copy": Fields(
            required={"to_store": _COPY_FIT, "from_store": _COPY_FIT},
            optional={
                "in_step": Fields(required={"modules": ListOf(STRING), "factor": Nullable(AMOUNT)}, rest=ANY)
            },
            rest=ANY,
        ),
        "recompute": Fields(
            optional={
                "in_step": Fields(
                    required={"modules": ListOf(STRING)},
                    optional={"change_ms": FINITE, "noise_ms": FINITE},
                    rest=ANY,
                )
            },
            rest=ANY,
        ),
        "refused": MapOf(STRING),
    }
)
_COMPILED_REGIONS = Fields(
    optional={
        "steps_left": Nullable(COUNT),
        "called_blocks": ListOf(STRING),
        "partial_last_batch": Nullable(BOOLEAN),
        "probes": MapOf(
            Fields(
                optional={
                    "eager_us": AMOUNT,
                    "compiled_us": AMOUNT,
                    "compile_s": AMOUNT,
                    "graphs": COUNT,
                    "error": STRING,
                }
            )
        ),
        "note": STRING,
    }
)
_TRACE = Fields(
    required={
        "rank": COUNT,
        "world_size": Scalar(lambda v: INTEGER.test(v) and v > 0, "an integer > 0"),
        "device": STRING,
        "steps": ListOf(Fields(required={"index": INTEGER, "start_us": FINITE, "end_us": FINITE})),
        "ops": ListOf(ANY),  # each op: `_OP`, in `_ops_from_json`
    },
    optional={
        "framework": STRING,
        "framework_version": STRING,
        "host": STRING,
        "clock_offset_us": FINITE,
        "memory_events": ListOf(ANY),  # each: `_MEMORY_EVENT`, in `_check_memory_events`
        "allocator": Fields(
            optional={"name": STRING, "in_use_bytes": Nullable(AMOUNT), "recorded_peak_bytes": AMOUNT}
        ),
        "resident_bytes": MapOf(AMOUNT),
        "saved_activation_bytes": MapOf(AMOUNT),
        "precision": MapOf(Scalar(lambda v: v in PRECISIONS, f"one of {', '.join(PRECISIONS)}")),
        "precision_costs": _PRECISION_COSTS,
        "layer_statistics": Fields(),  # `statistics_schema.check_statistics` where not empty
        "activation_costs": _ACTIVATION_COSTS,
        "compiled_regions": _COMPILED_REGIONS,
        "layers": ListOf(
            Fields(
                required={"name": STRING, "type": STRING},
                optional={"param_bytes": COUNT, "next": Nullable(STRING)},
            )
        ),
        "measured": Fields(
            optional={
                "step_ms": ListOf(FINITE),
                "peak_bytes": Nullable(AMOUNT),
                "peak_source": Nullable(STRING),
                "step_peak_bytes": ListOf(AMOUNT),
                "page_faults": ListOf(COUNT),
                "steps_after_window": COUNT,  # the last ones of step_ms and page_faults
                "page_size": COUNT,
                "malloc": Fields(
                    optional={
                        "glibc": BOOLEAN,
                        "reason": STRING,
                        "fresh_page_us": AMOUNT,
                        "fixed": MapOf(COUNT),
                    }
                ),
                "recorder_overhead_s": NUMBER,
                "profiler_share": Fields(
                    optional={
                        "in_step_ms": Nullable(FINITE),
                        "loops_share_ms": Nullable(FINITE),
                        "scale": FINITE,
                    }
                ),
            }
        ),
        "profiler_overhead_us": MapOf(FINITE),
        "symbolic": Fields(optional={"durations": STRING, "batch": STRING, "tensors": STRING}),
        "fingerprint": Fields(),
        "raw_trace": Nullable(STRING),
        "communication": Fields(
            optional={
                "library": STRING,
                "fusion_threshold_bytes": COUNT,
                "cycle_time_ms": FINITE,
                "from_env": ListOf(STRING),
                "plan_in_effect": BOOLEAN,
                "timeline": Nullable(STRING),
                "timeline_note": STRING,
                "buckets": ListOf(ListOf(Fields(required={"name": STRING, "bytes": COUNT}))),
                "bucket_cap_mb": Nullable(AMOUNT),
                "bucket_cap_mb_list": Nullable(ListOf(AMOUNT)),
                "allreduce_us": Fields(required={"bytes": ListOf(COUNT), "us": ListOf(AMOUNT)}),
            }
        ),
    },
)
_REQUIRED_FIELDS = ("rank", "world_size", "device", "steps", "ops")
_OPTIONAL_FIELDS = [f.name for f in fields(Trace) if f.name not in _REQUIRED_FIELDS]  # taken as they are
_OP_KIND_SET = frozenset(OP_KINDS)
_OP_KEYS = frozenset(f.name for f in fields(Op))


def _ops_from_json(items: list, steps: set[int], source: str) -> list[Op]:
    """The ops of a trace's ``ops`` list, each checked against `_OP` and its step against ``steps``;
    then ids unique and every dependency a known op.

    A fast test of exact JSON types passes the usual op; only one that fails it (a field missing or
    of another type, a non-finite time, a collective) goes through the precise check, which names
    the first bad field."""
    ops = []
    kinds = _OP_KIND_SET
    for i, o in enumerate(items):
        try:
            start, dur, layer, seq = o["start_us"], o["dur_us"], o["layer"], o["seq"]
            deps, gap, overhead = o["deps"], o["gap_overhead_us"], o["overhead_us"]
            usual = (
                type(o["id"]) is int
                and type(o["name"]) is str
                and type(o["kind"]) is str
                and o["kind"] in kinds
                and type(o["thread"]) is str
                and type(o["step"]) is int
                and (type(start) is float and start - start == 0.0 or type(start) is int)
                and (type(dur) is float and dur - dur == 0.0 or type(dur) is int)
                and dur >= 0
                and (layer is None or type(layer) is str)
                and (seq is None or type(seq) is int)
                and type(o["input_shapes"]) is list
                and type(o["input_dtypes"]) is list
                and type(o["bytes"]) is int
                and (type(overhead) is float and overhead - overhead == 0.0 or type(overhead) is int)
                and (type(gap) is float and gap - gap == 0.0 or type(gap) is int)
                and type(deps) is list
                and (not deps or all(type(d) is int for d in deps))
                and o["collective"] is None
                and type(o.get("flops", 0.0)) in (int, float)
            )
        except (KeyError, TypeError):  # a field missing, or ``o`` not an object
            usual = False
        if not usual:
            check_shape(o, _OP, source, ("ops", i))
        try:
            op = Op(**o)
        except TypeError:  # keys this version does not know: left out
            op = Op(**{key: value for key, value in o.items() if key in _OP_KEYS})
        if op.step not in steps:
            raise QSyncInputError(f"{source}: ops[{i}] ({op.name}) belongs to unrecorded step {op.step}")
        ops.append(op)
    ids = {op.id for op in ops}
    if len(ids) != len(ops):
        raise QSyncInputError(f"{source}: op ids are not unique")
    for i, op in enumerate(ops):
        for dep in op.deps:
            if dep not in ids:
                raise QSyncInputError(f"{source}: ops[{i}] (id {op.id}) depends on unknown op {dep}")
    return ops


def _check_memory_events(events: list, source: str) -> None:
    """Each of ``events`` as `_MEMORY_EVENT` says (the usual event by a fast test of JSON types)."""
    for i, e in enumerate(events):
        if not (
            type(e) is list
            and len(e) == 4
            and type(e[1]) is int
            and type(e[2]) is int
            and type(e[3]) is int
            and (type(e[0]) is float and e[0] - e[0] == 0.0 or type(e[0]) is int)
        ):
            check_shape(e, _MEMORY_EVENT, source, ("memory_events", i))


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
    """Load every rank's trace under ``trace_dir`` (a directory of ``rank<k>/trace.json``), checked
    with `check_rank_traces`: one run's complete set of ranks."""
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        raise QSyncInputError(f"{trace_dir}: no such trace directory")
    files = sorted(
        (path for path in trace_dir.glob(f"rank*/{TRACE_FILE}") if _RANK_DIR.fullmatch(path.parent.name)),
        key=lambda path: int(path.parent.name[4:]),
    )
    if not files and (trace_dir / TRACE_FILE).is_file():
        return check_rank_traces([Trace.load(trace_dir / TRACE_FILE)], str(trace_dir))
    if not files:
        raise QSyncInputError(f"{trace_dir}: no rank*/{TRACE_FILE} inside; is this a qsync trace directory?")
    traces = []
    for path in files:
        trace = Trace.load(path)
        if trace.rank != int(path.parent.name[4:]):
            raise QSyncInputError(f"{path}: holds the trace of rank {trace.rank}")
        traces.append(trace)
    return check_rank_traces(traces, str(trace_dir))


_RANK_DIR = re.compile(r"rank[0-9]+")


def check_rank_traces(traces: Sequence[Trace], source: str) -> list[Trace]:
    """``traces`` by rank, once they are shown to be one run's, every rank once: the same world size,
    ranks 0 to world size - 1, the same fingerprint. Raises QSyncInputError naming ``source``."""
    traces = sorted(traces, key=lambda t: t.rank)
    world = traces[0].world_size
    sizes = sorted({t.world_size for t in traces})
    if len(sizes) > 1:
        raise QSyncInputError(
            f"{source}: ranks disagree on the world size ({', '.join(map(str, sizes))}): "
            "traces of different runs?"
        )
    ranks = [t.rank for t in traces]
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise QSyncInputError(f"{source}: more than one trace of rank {twice[0]}: traces of different runs?")
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        raise QSyncInputError(f"{source}: world size is {world} but traces of ranks {missing} are missing")
    for trace in traces[1:]:
        differ = sorted(
            key
            for key in traces[0].fingerprint.keys() | trace.fingerprint.keys()
            if traces[0].fingerprint.get(key) != trace.fingerprint.get(key)
        )
        if differ:
            raise QSyncInputError(
                f"{source}: the traces of ranks 0 and {trace.rank} are of different runs "
                f"(their fingerprints differ in {', '.join(differ)})"
            )
    return traces
