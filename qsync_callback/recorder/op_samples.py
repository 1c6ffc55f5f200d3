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
  (`overhead.py`'s figures, as the converted trace uses them).

Each recorded step also gives the host's share: the step's length, less the profiler's cost of all
its events, less its samples' time, over the number of samples (`StepSample`). Samples of one
trace with the same name, shapes and dtypes are merged (the median of their times, and a count).
"""

from __future__ import annotations

import ast
import bisect
import functools
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from qsync_callback.recorder.kineto import (
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


@dataclass
class StepSample:
    """One recorded step: its length with the profiler's cost taken off, the time of its
    dispatch-level ops, and how many there were."""

    step_us: float
    ops_us: float
    ops: int


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


def _argument(dims: Any, kind: str, concrete: str) -> Any:
    if kind in DTYPE_BYTES:
        dtype = TORCH_DTYPES.get(kind, torch.float32)
        return torch.empty(dims, dtype=dtype, device="meta")
    if concrete == "":
        return None
    return ast.literal_eval(concrete)


@functools.lru_cache(maxsize=4096)
def _recorded_flops(name: str, args_key: str) -> float:
    dims, kinds, concrete = ast.literal_eval(args_key)
    packet = aten_packet(name)
    try:
        values = [_argument(d, k, c) for d, k, c in zip(dims, kinds, concrete, strict=False)]
    except (ValueError, SyntaxError, RuntimeError, TypeError):
        return 0.0
    for overload_name in packet.overloads():  # Kineto lists keyword-only arguments in place
        overload = getattr(packet, overload_name)
        schema = overload._schema.arguments
        if len(schema) != len(values) or any(a.is_out for a in schema):
            continue
        positional = [v for a, v in zip(schema, values, strict=False) if not a.kwarg_only]
        keywords = {a.name: v for a, v in zip(schema, values, strict=False) if a.kwarg_only}
        try:
            with FlopCounterMode(display=False) as counter:
                overload(*positional, **keywords)
        except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
            continue
        return float(counter.get_total_flops())
    return 0.0


def recorded_flops(name: str, args: Mapping[str, Any]) -> float:
    """The FLOPs of a recorded op (its Kineto ``args``) by torch's formula; 0 without one."""
    packet = aten_packet(name)
    if packet is None or packet not in flop_registry:
        return 0.0
    dims = args.get("Input Dims") or []
    kinds = args.get("Input type") or []
    concrete = args.get("Concrete Inputs") or [""] * len(dims)
    return _recorded_flops(name, repr((dims, kinds, concrete)))


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
        ops_us, count = 0.0, 0
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
            stack.append((end, not is_aten or decomposes(name)))
        step_us = step_end - step_start - cost_within(step_start, step_end)
        steps.append(StepSample(step_us=step_us, ops_us=ops_us, ops=count))
    samples = [
        OpSample(
            name, shapes, dtypes, recorded_flops(name, args), allocated, statistics.median(times), len(times)
        )
        for name, shapes, dtypes, args, allocated, times in merged.values()
    ]
    return samples, steps


def samples_document(samples: list[OpSample], steps: list[StepSample], source: str) -> dict[str, Any]:
    """One trace's samples as the JSON document the per-device data set keeps (`op_dataset.py`)."""
    return {
        "source": source,
        "threads": torch.get_num_threads(),
        "ops": [asdict(s) for s in samples],
        "steps": [asdict(s) for s in steps],
    }
