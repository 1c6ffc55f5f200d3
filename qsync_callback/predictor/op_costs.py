"""Durations for a symbolic trace's ops: from the learned per-op model of this device where it has
one (`op_cost_model.py`, trained on the ops this device has recorded), else from this machine's
roofline (`recorder/roofline.py`).

On the roofline, an op costs the dispatcher's per-op time plus the larger of its FLOPs at the
matmul rate of its first floating-point input's dtype and its bytes (its tensor inputs read, what it allocates
written) at the measured bandwidth. The learned model prices each op by its features and adds
the host's time for the step's ops and the bytes they allocate (its `HostTime`) at the step's end. The
ops run one after another from the step's start, and the trace's memory events move with the op
they fell in. An op type the learned model never saw measured is timed alone where it could be
(`recorder/op_probes.py`), its time taken as measured; an op of a type it knows that was timed
alone too is priced at the geometric mean of the two: the model's price and the time alone are
two estimates of its time in the step with errors of their own (the model's from other ops and
families, the probe's from made-up values outside a step: each was 3x off on some op here), so
neither is taken over the other. Where the model has no data of the trace's setting, the ops
timed alone also carry its prices across (CDMPP's cross-device transfer, calibrated on the
estimate's own measurements): at a thread count it never ran, every price is scaled by what the ops
of types it knows took alone over its prices of them (`thread_shift`); at a floating-point dtype it
never measured (a bf16-mixed step priced from fp32 runs), each such op's price by the same ratio
over the ops of its type and dtype, or of its dtype (`precision_shifts`). The trace's
``symbolic.durations`` says where the durations came from, which op types were timed alone or
priced from features only, and each shift.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from qsync_callback.predictor.compiled_regions import input_bytes
from qsync_callback.predictor.op_cost_model import MIN_US, OpCostModel
from qsync_callback.recorder.data_loading import DataLoading
from qsync_callback.recorder.kineto import float_dtype
from qsync_callback.recorder.op_samples import OpSample, op_key
from qsync_callback.recorder.trace import Op, Trace


def op_us(op: Op, roofline: Mapping[str, Any]) -> float:
    """``op``'s predicted duration (see the module docstring)."""
    moved = sum(input_bytes(op.input_shapes, op.input_dtypes)) + op.bytes
    compute = 0.0
    if op.flops:
        dtype = float_dtype(op.input_dtypes) or "float"
        rates = roofline["flops_per_us"]
        compute = op.flops / rates.get(dtype, rates["float"])
    return roofline["op_us"] + max(compute, moved / roofline["bytes_per_us"])


def thread_shift(
    ops: Sequence[Op], prices: Sequence[float], measured: Mapping[tuple, float], model: OpCostModel
) -> float | None:
    """How much slower than ``model`` prices them ``ops`` ran timed alone (``measured``, by
    `op_key`): the time alone of the ops of types it knows over its ``prices`` of them, each op as
    often as it runs; None with none timed alone. A model with no recorded step at a trace's thread
    count prices it as the thread counts it has data at run: this is the shift to the thread count
    at hand (CDMPP's cross-device transfer, calibrated by the estimate's own measurements)."""
    return _time_alone_over_price(
        [
            (measured[key], price)
            for op, price in zip(ops, prices, strict=True)
            if op.name in model.known_types
            and (key := op_key(op.name, op.input_shapes, op.input_dtypes)) in measured
        ]
    )


def precision_shifts(
    ops: Sequence[Op], prices: Sequence[float], measured: Mapping[tuple, float], model: OpCostModel
) -> tuple[list[float], dict[str, float]]:
    """The factor each of ``ops``' ``prices`` is scaled by where ``model`` never measured an op of its
    floating-point dtype (a model trained on fp32 runs pricing a bf16-mixed step: the trees treat
    the dtype as a category they never saw), as `thread_shift` does across thread counts: what the
    ops of its type and dtype took timed alone (``measured``) over its prices of them, or, where
    none of its type was, those of every type of its dtype; 1 for the others and where no op of
    the dtype was timed alone. Also each such dtype's own factor."""
    timed: dict[str, dict[str, list[tuple[float, float]]]] = {}  # dtype -> type -> (alone, price)
    for op, price in zip(ops, prices, strict=True):
        dtype = float_dtype(op.input_dtypes)
        key = op_key(op.name, op.input_shapes, op.input_dtypes)
        if dtype and dtype not in model.float_dtypes and op.name in model.known_types and key in measured:
            timed.setdefault(dtype, {}).setdefault(op.name, []).append((measured[key], price))
    by_dtype = {
        dtype: _time_alone_over_price([pair for pairs in types.values() for pair in pairs])
        for dtype, types in timed.items()
    }
    factors = []
    for op in ops:
        dtype = float_dtype(op.input_dtypes)
        if dtype in timed:
            factors.append(_time_alone_over_price(timed[dtype].get(op.name, [])) or by_dtype[dtype])
        else:
            factors.append(1.0)
    return factors, by_dtype


def _time_alone_over_price(pairs: Sequence[tuple[float, float]]) -> float | None:
    """The (time alone, price) pairs' summed times alone over their summed prices; None with none."""
    if not pairs:
        return None
    return sum(max(m, MIN_US) for m, _ in pairs) / sum(price for _, price in pairs)


def priced(
    trace: Trace,
    roofline: Mapping[str, Any],
    model: OpCostModel | None = None,
    probed: Sequence[OpSample] = (),
    calls: Mapping[tuple, Mapping[str, Any]] | None = None,
    data: DataLoading | None = None,
) -> Trace:
    """A copy of symbolic ``trace`` whose ops last `op_us` (or ``model``'s prediction, with its host
    time; or, for an op ``probed`` at its shapes, the time measured), one after another from the
    step's start, its memory events and step end moved with them, and the step ending after what
    ``data``, its loader's fetch of the next batch, adds to it. ``calls``: each distinct op's call
    by `op_key` (the symbolic trace's ``distinct_ops``), for a model with TVM's features."""
    out = copy.copy(trace)
    out.ops = [copy.copy(op) for op in trace.ops]
    if model is None:
        durations, host_us = [op_us(op, roofline) for op in out.ops], 0.0
        source = f"predicted by this machine's roofline (recorder/roofline.py; {roofline.get('source', '')})"
    else:
        threads = trace.symbolic.get("threads") or torch.get_num_threads()  # what it was traced at
        durations = model.predict_us(
            [
                {
                    "name": op.name,
                    "shapes": op.input_shapes,
                    "dtypes": op.input_dtypes,
                    "flops": op.flops,
                    "out_bytes": op.bytes,
                    "call": (calls or {}).get(op_key(op.name, op.input_shapes, op.input_dtypes)),
                    "threads": threads,
                }
                for op in out.ops
            ]
        )
        host_us = model.host.at(len(out.ops), sum(op.bytes for op in out.ops))
        measured = {op_key(s.name, s.shapes, s.dtypes): s.us for s in probed}
        unseen_threads = bool(model.threads) and threads not in model.threads
        shift = thread_shift(out.ops, durations, measured, model) if unseen_threads else None
        if shift is not None:
            durations = [d * shift for d in durations]
        factors, dtype_shifts = precision_shifts(out.ops, durations, measured, model)
        durations = [d * f for d, f in zip(durations, factors, strict=True)]
        blended = set()
        for k, op in enumerate(out.ops):
            key = op_key(op.name, op.input_shapes, op.input_dtypes)
            if key not in measured:
                continue
            if op.name in model.known_types:
                durations[k] = math.sqrt(max(measured[key], MIN_US) * durations[k])
                blended.add(key)
            else:
                durations[k] = measured[key]
        unseen = {op.name for op in out.ops} - model.known_types
        probed_types = unseen & {s.name for s in probed}
        source = f"predicted by the {model.describe()}"
        if shift is not None:
            source += (
                f"; none at {threads} thread(s): its prices times {shift:.2f}, what the ops of types it "
                "knows took timed alone over its prices of them"
            )
        if dtype_shifts:
            shifted = ", ".join(
                f"{dtype} times {factor:.2f}" for dtype, factor in sorted(dtype_shifts.items())
            )
            source += (
                f"; none of their dtype measured: the prices of its ops, by type, times what those timed "
                f"alone took over its prices of them (of all their types: {shifted})"
            )
        if probed_types:
            timed = ", ".join(sorted(probed_types))
            source += f"; op types never measured here, timed alone on made-up tensors: {timed}"
        if blended:
            source += (
                f"; {len(blended)} distinct ops of types it knows also timed alone, each at the geometric "
                "mean of its price and its time alone"
            )
        if unseen - probed_types:
            source += f"; priced from their features alone: {', '.join(sorted(unseen - probed_types))}"
    starts: list[float] = []
    clock = trace.steps[0].start_us
    for op, duration in zip(out.ops, durations, strict=False):
        starts.append(clock)
        op.start_us, op.dur_us = clock, duration
        clock += op.dur_us

    def moved(ts: float) -> float:
        k = min(int(math.floor(ts)), len(out.ops) - 1)
        return starts[k] + (ts - k) * out.ops[k].dur_us if k >= 0 else ts

    out.memory_events = [[moved(ts), addr, nbytes, op_id] for ts, addr, nbytes, op_id in trace.memory_events]
    step = copy.copy(trace.steps[0])
    step.end_us = clock + host_us
    if data is None:
        loading = "not timed (no data loader): the step's time leaves out loading its batch"
    else:
        step.end_us += data.wait_us(step.end_us - step.start_us)
        loading = f"timed from the module's train_dataloader(): {data.describe()}"
    step.end_us = max(step.end_us, step.start_us + 1.0)
    out.steps = [step]
    out.symbolic = {**trace.symbolic, "durations": source, "data_loading": loading}
    return out
