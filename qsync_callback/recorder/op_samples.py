"""Measured op samples from a recorded Kineto trace: what the learned per-op cost model trains on.

A symbolic trace (`symbolic_trace.py`) sees a step's ops at the dispatch level: ``nn.Linear`` as
``aten::t`` and ``aten::addmm``, not as ``aten::linear``. In a Kineto trace the same ops are the
``aten::`` events on the training thread whose enclosing ``aten::`` events all decompose
(``CompositeImplicitAutograd`` ops such as ``aten::linear``, ``aten::conv2d``,
``aten::cross_entropy_loss``); autograd's nodes, the optimizer's and Lightning's ranges enclose
them without counting. Each such event is one sample:

- ``name``, the tensor inputs' ``shapes`` and ``dtypes`` (Kineto's names), as the symbolic trace
  writes them (non-tensor arguments left out);
- ``flops``: torch's own formula (`torch.utils.flop_counter`), run on meta tensors of the recorded
  shapes with the recorded scalar arguments (0 for ops torch has no formula for, and where the
  arguments cannot be rebuilt);
- ``out_bytes``: what the op allocated and still held when it returned (the profiler's memory
  events inside it): its outputs, as the symbolic trace counts them;
- ``us``: its duration less the profiler's calibrated cost of the events recorded inside it
  (`overhead.py`'s figures, as the converted trace uses them);
- ``call``: the overload and arguments it was called with (`call_json`'s form, tensors as shape,
  stride and dtype), rebuilt from Kineto's arguments where they can be: what the compiler-level
  features (`predictor/tvm_features.py`) lower and what `op_probes.py` times.

Each recorded step also gives the host's time: the step's length, less the profiler's cost of all
its events, less its data loader's fetch of the next batch (``data_us``: what a symbolic trace does
not see and an estimate times apart, `data_loading.py`), less its samples' time, beside their
count and the bytes they allocated and kept (`StepSample`).
Samples of one trace with the same name, shapes and dtypes are merged (the median of their times,
and a count).
"""

from __future__ import annotations

import ast
import bisect
import functools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from qsync_callback.recorder.flop_formulas import flop_registry
from qsync_callback.recorder.kineto import (
    DATA_LOADER_PREFIX,
    DTYPE_BYTES,
    MEMORY_EVENT,
    OPTIMIZER_STEP_PREFIX,
    RANGE_PREFIXES,
    STEP_PREFIX,
    event_kind,
)

ATEN = "aten::"
TORCH_DTYPES = {  # Kineto's names of torch's dtypes
    "float": torch.float32,
    "double": torch.float64,
    "c10::Half": torch.float16,
    "c10::BFloat16": torch.bfloat16,
    "long int": torch.int64,
    "int": torch.int32,
    "short int": torch.int16,
    "signed char": torch.int8,
    "unsigned char": torch.uint8,
    "bool": torch.bool,
}
KINETO_DTYPES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


@dataclass
class OpSample:
    """One op at the dispatch level, measured (see the module docstring)."""

    name: str
    shapes: list[list[int]]
    dtypes: list[str]
    flops: float
    out_bytes: int
    us: float
    count: int = 1
    call: dict[str, Any] | None = None


@dataclass
class StepSample:
    """One recorded step: its length with the profiler's cost taken off, the time of its
    dispatch-level ops, how many there were, the bytes they allocated and kept (their
    ``out_bytes``), and its data loader's fetch (the same cost off)."""

    step_us: float
    ops_us: float
    ops: int
    data_us: float = 0.0
    out_bytes: int = 0


def op_key(name: str, shapes: Any, dtypes: Any) -> tuple[str, str, str]:
    """What makes two ops the same op here: the name and the tensor inputs' shapes and dtypes."""
    return name, repr(shapes), repr(dtypes)


def aten_packet(name: str) -> Any:
    """The ``torch.ops.aten`` overload packet of ``aten::<name>``, or None."""
    return getattr(torch.ops.aten, name[len(ATEN) :], None) if name.startswith(ATEN) else None


@functools.cache
def decomposes(name: str) -> bool:
    """True where every overload of aten op ``name`` is ``CompositeImplicitAutograd``: it runs as
    the ops it is written in, which a dispatch-level trace sees instead."""
    packet = aten_packet(name)
    if packet is None:
        return False
    try:
        overloads = packet.overloads()
    except (AttributeError, RuntimeError):
        return False
    found = []
    for overload in overloads:
        if overload == "out" or overload.endswith("_out"):
            continue
        try:
            found.append(
                torch._C._dispatch_has_kernel_for_dispatch_key(
                    name if overload == "default" else f"{name}.{overload}", "CompositeImplicitAutograd"
                )
            )
        except RuntimeError:  # an overload TorchScript alone knows (``aten::to.prim_Device``)
            continue
    return bool(found) and all(found)


def _argument(dims: Any, strides: Any, kind: str, concrete: str) -> Any:
    if kind in DTYPE_BYTES:
        dtype = TORCH_DTYPES.get(kind, torch.float32)
        if isinstance(strides, list) and len(strides) == len(dims):
            return torch.empty_strided(dims, strides, dtype=dtype, device="meta")
        return torch.empty(dims, dtype=dtype, device="meta")
    if concrete == "":
        return None
    return ast.literal_eval(concrete)


@functools.lru_cache(maxsize=4096)
def _recorded_call(name: str, args_key: str) -> tuple[Any, list, dict] | None:
    """The overload of aten op ``name`` that accepts the recorded arguments (``args_key``: Kineto's
    dims, strides, types and concrete values), with them rebuilt on the meta device; None where
    no overload does, or they cannot be rebuilt."""
    dims, strides, kinds, concrete = ast.literal_eval(args_key)
    packet = aten_packet(name)
    if packet is None:
        return None
    try:
        values = [
            _argument(d, s, k, c)
            for d, s, k, c in zip(dims, strides or [None] * len(dims), kinds, concrete, strict=False)
        ]
    except (ValueError, SyntaxError, RuntimeError, TypeError):
        return None
    for overload_name in packet.overloads():  # Kineto lists keyword-only arguments in place
        overload = getattr(packet, overload_name)
        schema = overload._schema.arguments
        if len(schema) != len(values) or any(a.is_out for a in schema):
            continue
        positional = [v for a, v in zip(schema, values, strict=False) if not a.kwarg_only]
        keywords = {a.name: v for a, v in zip(schema, values, strict=False) if a.kwarg_only}
        try:
            overload(*positional, **keywords)
        except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
            continue
        return overload, positional, keywords
    return None


def _args_key(args: Mapping[str, Any]) -> str:
    """A recorded op's Kineto arguments as `_recorded_call`'s cache key."""
    dims = args.get("Input Dims") or []
    concrete = args.get("Concrete Inputs") or [""] * len(dims)
    return repr((dims, args.get("Input Strides"), args.get("Input type") or [], concrete))


@functools.lru_cache(maxsize=4096)
def _recorded_flops(name: str, args_key: str) -> float:
    matched = _recorded_call(name, args_key)
    if matched is None:
        return 0.0
    overload, positional, keywords = matched
    with FlopCounterMode(display=False) as counter:
        overload(*positional, **keywords)
    return float(counter.get_total_flops())


@functools.cache
def op_class(name: str, flops: float = 0.0) -> str:
    """The kind of op ``name`` is, by torch's own tags: ``"pointwise"``, ``"reduction"``, ``"view"``
    (returns an alias of an input), ``"compute"`` (has FLOPs: matmuls, convolutions), ``"other"``."""
    if flops > 0:
        return "compute"
    packet = aten_packet(name)
    overloads = packet.overloads() if packet is not None else []
    if not overloads:
        return "other"
    overload = getattr(packet, overloads[0])
    tags = set(overload.tags)
    if torch.Tag.pointwise in tags:
        return "pointwise"
    if torch.Tag.reduction in tags:
        return "reduction"
    if any(r.alias_info is not None for r in overload._schema.returns):
        return "view"
    return "other"


def recorded_flops(name: str, args: Mapping[str, Any]) -> float:
    """The FLOPs of a recorded op (its Kineto ``args``) by torch's formula; 0 without one."""
    packet = aten_packet(name)
    if packet is None or packet not in flop_registry:
        return 0.0
    return _recorded_flops(name, _args_key(args))


def recorded_call(name: str, args: Mapping[str, Any]) -> dict[str, Any] | None:
    """A recorded op (its Kineto ``args``) as the call it was, in `call_json`'s form; None where
    its arguments cannot be rebuilt (tensor lists, values Kineto does not keep)."""
    matched = _recorded_call(name, _args_key(args))
    if matched is None:
        return None
    try:
        return call_json(*matched)
    except ValueError:
        return None


def _to_json(value: Any) -> Any:
    if isinstance(value, (torch.Tensor, torch.dtype)):
        dtype = value.dtype if isinstance(value, torch.Tensor) else value
        if dtype not in KINETO_DTYPES:
            raise ValueError(f"dtype {dtype}")
        if isinstance(value, torch.dtype):
            return {"dtype": KINETO_DTYPES[dtype]}
        return {"tensor": [list(value.shape), list(value.stride()), KINETO_DTYPES[dtype]]}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    raise ValueError(f"argument of type {type(value).__name__}")


def call_overload(call: Mapping[str, Any]) -> Any:
    """The ``torch.ops`` overload a call (`call_json`'s form) names."""
    namespace, _, rest = call["op"].partition("::")
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def call_values(value: Any, tensor: Callable[[list], Any], device: torch.device) -> Any:
    """A call's arguments (`call_json`'s form) as values: each tensor made by ``tensor`` from its
    ``[shape, stride, dtype]``, dtypes and non-finite floats rebuilt, each device as ``device``."""
    if isinstance(value, list):
        return [call_values(v, tensor, device) for v in value]
    if isinstance(value, dict):
        if "tensor" in value:
            return tensor(value["tensor"])
        if "dtype" in value:
            return TORCH_DTYPES[value["dtype"]]
        if "device" in value:
            return device
        return float(value["float"])
    return value


def call_json(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """An aten call as JSON: ``{"op": "aten::addmm.default", "args": [...], "kwargs": {...}}``, a
    tensor as ``{"tensor": [shape, stride, dtype]}`` (Kineto's dtype names), a dtype as ``{"dtype":
    name}``, a device as ``{"device": name}``, a non-finite float as ``{"float": repr}``; ValueError
    for what JSON cannot hold."""
    return {
        "op": f"{func._schema.name}.{func._overloadname}",
        "args": _to_json(list(args)),
        "kwargs": {key: _to_json(v) for key, v in kwargs.items()},
    }


def _tensor_inputs(args: Mapping[str, Any]) -> tuple[list[list[int]], list[str]]:
    """The tensor inputs' shapes and dtypes, as the symbolic trace writes them: a Python number
    autograd wrapped as a zero-dimensional double or long tensor is the number it was."""
    shapes, dtypes = [], []
    for dims, kind in zip(args.get("Input Dims") or [], args.get("Input type") or [], strict=False):
        if dims == [] and kind in ("double", "long int"):
            continue
        if kind in DTYPE_BYTES and isinstance(dims, list):
            shapes.append(list(dims))
            dtypes.append(kind)
    return shapes, dtypes


def _kept_bytes(inside: list[Mapping[str, Any]]) -> int:
    """Bytes allocated by the memory events ``inside`` an op and not freed there: its outputs, as
    a symbolic trace counts what an op allocates (scratch buffers freed inside are left out)."""
    live: dict[Any, int] = {}
    for e in inside:
        if e.get("name") != MEMORY_EVENT:
            continue
        args = e.get("args", {})
        nbytes, addr = int(args.get("Bytes", 0)), args.get("Addr")
        if nbytes > 0:
            live[addr] = nbytes
        else:
            live.pop(addr, None)
    return sum(live.values())


def _model_span(events: list[Mapping[str, Any]]) -> tuple[float, float] | None:
    """From the first layer or module range to the end of the last optimizer step of a step's
    events: the ops a symbolic trace also has (the batch's loading and Lightning's hooks outside)."""
    ranges = [e for e in events if e.get("name", "").startswith(RANGE_PREFIXES)]
    updates = [e for e in events if e.get("name", "").startswith(OPTIMIZER_STEP_PREFIX)]
    if not ranges or not updates:
        return None
    return float(ranges[0]["ts"]), max(float(e["ts"]) + float(e.get("dur", 0)) for e in updates)


def op_samples(
    raw: Mapping[str, Any], overhead_us: Mapping[str, float]
) -> tuple[list[OpSample], list[StepSample]]:
    """The dispatch-level op samples and step samples of Kineto trace ``raw`` (see the module
    docstring); ``overhead_us`` is the profiler's calibrated cost per event kind."""
    events = [e for e in raw.get("traceEvents", []) if e.get("ph") in ("X", "i") and "ts" in e]
    step_ranges = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("tid"))
        for e in events
        if e.get("ph") == "X" and e.get("name", "").startswith(STEP_PREFIX)
    )
    if not step_ranges:
        return [], []
    main = step_ranges[0][2]
    thread = sorted(
        (e for e in events if e.get("tid") == main), key=lambda e: (float(e["ts"]), -float(e.get("dur", 0)))
    )
    cost = [overhead_us.get(event_kind(e.get("cat", ""), e.get("name", "")) or "", 0.0) for e in thread]
    starts = [float(e["ts"]) for e in thread]
    cumulative = [0.0]
    for c in cost:
        cumulative.append(cumulative[-1] + c)

    def cost_within(start: float, end: float) -> float:
        lo, hi = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)
        return cumulative[hi] - cumulative[lo]

    merged: dict[tuple, list] = {}
    steps = []
    for step_start, step_end, _ in step_ranges:
        lo, hi = bisect.bisect_left(starts, step_start), bisect.bisect_left(starts, step_end)
        span = _model_span(thread[lo:hi])
        if span is None:
            continue
        stack: list[tuple[float, bool]] = []  # (end, decomposes or not an aten op)
        ops_us, count, kept = 0.0, 0, 0
        for i in range(lo, hi):
            e = thread[i]
            if e.get("ph") != "X" or e.get("cat") != "cpu_op":
                continue
            ts, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
            while stack and stack[-1][0] <= ts:
                stack.pop()
            name = e.get("name", "")
            is_aten = name.startswith(ATEN)
            if (
                is_aten
                and span[0] <= ts < span[1]
                and all(transparent for _, transparent in stack)
                and not decomposes(name)
            ):
                args = e.get("args", {})
                shapes, dtypes = _tensor_inputs(args)
                allocated = _kept_bytes(thread[i + 1 : bisect.bisect_left(starts, end, lo=i + 1)])
                us = max(end - ts - cost_within(ts + 1e-9, end), 0.0)
                key = op_key(name, shapes, dtypes)
                merged.setdefault(key, [name, shapes, dtypes, args, allocated, []])[5].append(us)
                ops_us += us
                count += 1
                kept += allocated
            stack.append((end, not is_aten or decomposes(name)))
        step_us = step_end - step_start - cost_within(step_start, step_end)
        data_us = sum(
            float(e.get("dur", 0)) - cost_within(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
            for e in thread[lo:hi]
            if e.get("ph") == "X" and e.get("name", "").startswith(DATA_LOADER_PREFIX)
        )
        steps.append(
            StepSample(step_us=step_us, ops_us=ops_us, ops=count, data_us=max(data_us, 0.0), out_bytes=kept)
        )
    samples = [
        OpSample(
            name,
            shapes,
            dtypes,
            recorded_flops(name, args),
            allocated,
            statistics.median(times),
            len(times),
            recorded_call(name, args),
        )
        for name, shapes, dtypes, args, allocated, times in merged.values()
    ]
    return samples, steps


def samples_document(
    samples: list[OpSample], steps: list[StepSample], source: str, threads: int | None = None
) -> dict[str, Any]:
    """One trace's samples as the JSON document the per-device data set keeps (`op_dataset.py`);
    ``threads``: the intra-op threads the trace ran on (None: this process's)."""
    return {
        "source": source,
        "threads": threads or torch.get_num_threads(),
        "ops": [asdict(s) for s in samples],
        "steps": [asdict(s) for s in steps],
    }
