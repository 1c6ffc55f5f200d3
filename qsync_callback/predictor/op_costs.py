"""Durations for a symbolic trace's ops, from this machine's roofline (`recorder/roofline.py`).

An op costs the dispatcher's per-op time plus the larger of its FLOPs at the matmul rate of its
first floating-point input's dtype and its bytes (its tensor inputs read, what it allocates
written) at the measured bandwidth. The ops run one after another from the step's start, and the
trace's memory events move with the op they fell in. The trace's ``symbolic.durations`` says the
durations came from here.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from qsync_callback.predictor.compiled_regions import input_bytes
from qsync_callback.recorder.trace import Op, Trace

FLOAT_DTYPES = ("float", "double", "c10::BFloat16", "c10::Half")


def op_us(op: Op, roofline: Mapping[str, Any]) -> float:
    """``op``'s predicted duration (see the module docstring)."""
    moved = sum(input_bytes(op.input_shapes, op.input_dtypes)) + op.bytes
    compute = 0.0
    if op.flops:
        dtype = next((d for d in op.input_dtypes if d in FLOAT_DTYPES), "float")
        rates = roofline["flops_per_us"]
        compute = op.flops / rates.get(dtype, rates["float"])
    return roofline["op_us"] + max(compute, moved / roofline["bytes_per_us"])


def priced(trace: Trace, roofline: Mapping[str, Any]) -> Trace:
    """A copy of symbolic ``trace`` whose ops last `op_us`, one after another from the step's
    start, its memory events and step end moved with them."""
    out = copy.copy(trace)
    out.ops = [copy.copy(op) for op in trace.ops]
    starts: list[float] = []
    clock = trace.steps[0].start_us
    for op in out.ops:
        starts.append(clock)
        op.start_us, op.dur_us = clock, op_us(op, roofline)
        clock += op.dur_us

    def moved(ts: float) -> float:
        k = min(int(math.floor(ts)), len(out.ops) - 1)
        return starts[k] + (ts - k) * out.ops[k].dur_us if k >= 0 else ts

    out.memory_events = [[moved(ts), addr, nbytes, op_id] for ts, addr, nbytes, op_id in trace.memory_events]
    step = copy.copy(trace.steps[0])
    step.end_us = max(clock, step.start_us + 1.0)
    out.steps = [step]
    out.symbolic = {
        **trace.symbolic,
        "durations": "predicted by this machine's roofline (recorder/roofline.py; "
        f"{roofline.get('source', '')})",
    }
    return out
