"""Tensor liveness and the memory curve of recorded steps (G10's birth, death and inactive period).

Every allocation in the profiled window is paired with its free by address, giving a tensor with
a birth (the op that allocated it) and a death (the op that freed it, or none: still alive when
the window closed). The phases of those two ops say what the tensor was:

- born in forward, freed in backward: an **activation** saved for backward; the time between its
  last forward use and its backward use is its inactive period, what offload can exploit;
- born and freed within one phase of one step: a **temporary**;
- born in backward and kept past the step's backward: a **gradient**;
- born in the optimizer update and kept: **optimizer state**;
- freed in the window but born before it: part of what was **resident** at the window's start.

The bytes resident at the window's start (parameters, buffers, gradients, optimizer state) come
from the recorder, which counts the model's and optimizers' tensors. The curve is that baseline
plus the bytes of every tensor alive at each moment; its maximum inside a step is the predicted
peak, with the bytes of each category alive at that moment.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from qsync_callback.recorder.trace import Op, Trace

CATEGORIES = ("activations", "temporaries", "gradients", "optimizer_state", "other")


@dataclass
class TensorLife:
    """One tensor's lifetime in the window; ``birth_us`` None: allocated before the window,
    ``death_us`` None: still alive when it closed."""

    addr: int
    bytes: int
    birth_us: float | None
    death_us: float | None
    birth_op: Op | None
    death_op: Op | None
    category: str
    layer: str | None = None

    @property
    def inactive_us(self) -> float | None:
        """Time from the end of the op that made it to the start of the op that freed it."""
        if self.birth_op is None or self.death_op is None:
            return None
        return max(0.0, self.death_op.start_us - self.birth_op.end_us)


@dataclass
class MemoryPrediction:
    """Predicted peak bytes of one rank, when it happens, and what is alive then."""

    peak_bytes: int
    peak_step: int | None
    breakdown: dict[str, int] = field(default_factory=dict)
    step_peaks: dict[int, int] = field(default_factory=dict)


def _category(birth: Op | None, death: Op | None) -> str:
    if birth is None:
        return "resident"
    same_step = death is not None and death.step == birth.step
    if birth.kind == "forward":
        if death is not None and death.kind == "backward" and same_step:
            return "activations"
        return "temporaries" if same_step and death.kind == "forward" else "other"
    if birth.kind == "backward":
        return "temporaries" if same_step and death.kind == "backward" else "gradients"
    if birth.kind == "update":
        return "temporaries" if same_step and death.kind == "update" else "optimizer_state"
    return "temporaries" if same_step and death.kind == birth.kind else "other"


def tensor_lifetimes(trace: Trace) -> list[TensorLife]:
    """Pair the window's allocations and frees by address (see the module docstring)."""
    ops = {op.id: op for op in trace.ops}
    open_allocs: dict[int, tuple[float, int, Op | None]] = {}
    lives: list[TensorLife] = []

    def close(addr: int, ts: float, death: Op | None) -> None:
        born_ts, nbytes, birth = open_allocs.pop(addr)
        lives.append(
            TensorLife(
                addr,
                nbytes,
                born_ts,
                ts,
                birth,
                death,
                _category(birth, death),
                birth.layer if birth else None,
            )
        )

    for ts, addr, nbytes, op_id in sorted(trace.memory_events, key=lambda e: e[0]):
        op = ops.get(op_id)
        if nbytes > 0:
            if addr in open_allocs:
                close(addr, ts, op)
            open_allocs[addr] = (ts, nbytes, op)
        elif addr in open_allocs:
            close(addr, ts, op)
        else:
            lives.append(TensorLife(addr, -nbytes, None, ts, None, op, "resident"))
    for addr in list(open_allocs):
        born_ts, nbytes, birth = open_allocs.pop(addr)
        lives.append(
            TensorLife(
                addr,
                nbytes,
                born_ts,
                None,
                birth,
                None,
                _category(birth, None),
                birth.layer if birth else None,
            )
        )
    return lives


def predict_memory(trace: Trace, lives: list[TensorLife] | None = None) -> MemoryPrediction:
    """The memory curve's maximum inside a recorded step, and the bytes by category then."""
    lives = tensor_lifetimes(trace) if lives is None else lives
    deltas: list[tuple[float, int, TensorLife]] = []
    for life in lives:
        if life.birth_us is not None:
            deltas.append((life.birth_us, life.bytes, life))
        if life.death_us is not None:
            deltas.append((life.death_us, -life.bytes, life))
    deltas.sort(key=lambda d: (d[0], d[1]))
    resident = sum(trace.resident_bytes.values())
    live_by_category: dict[str, int] = defaultdict(int)
    level = resident
    steps = sorted(trace.steps, key=lambda s: s.start_us)
    step_peaks: dict[int, int] = {}
    peak, peak_step, peak_breakdown = resident, None, {}
    i = 0
    for ts, delta, life in deltas:
        level += delta
        live_by_category[life.category] += delta
        while i < len(steps) and ts >= steps[i].end_us:
            i += 1
        if i < len(steps) and ts >= steps[i].start_us and delta > 0:
            index = steps[i].index
            step_peaks[index] = max(step_peaks.get(index, 0), level)
            if level > peak or peak_step is None:
                peak, peak_step = level, index
                peak_breakdown = dict(live_by_category)
    breakdown = {
        c: trace.resident_bytes.get(c, 0) + peak_breakdown.get(c, 0)
        for c in ("parameters", "buffers", "gradient_buckets", *CATEGORIES)
    }
    breakdown["freed_resident"] = peak_breakdown.get("resident", 0)
    return MemoryPrediction(int(peak), peak_step, breakdown, step_peaks)
