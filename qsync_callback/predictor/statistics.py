"""Per-op and per-layer statistics of recorded steps (dPRO's ``statistic``).

Times are the profiler-corrected op durations, averaged per recorded step and over ranks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from qsync_callback.recorder.trace import Trace


def _per_step(traces: Sequence[Trace]) -> float:
    return float(sum(len(t.steps) for t in traces)) or 1.0


def op_statistics(traces: Sequence[Trace]) -> list[dict]:
    """One row per (op name, kind): calls and milliseconds per step, mean microseconds per call,
    share of the ops' summed time; sorted by time, largest first."""
    total_us: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    for trace in traces:
        for op in trace.ops:
            key = (op.name, op.kind)
            total_us[key] += trace.own_us(op)
            calls[key] += 1
    per_step = _per_step(traces)
    whole = sum(total_us.values()) or 1.0
    rows = [
        {
            "name": name,
            "kind": kind,
            "calls_per_step": calls[(name, kind)] / per_step,
            "ms_per_step": total_us[(name, kind)] / per_step / 1e3,
            "mean_us": total_us[(name, kind)] / calls[(name, kind)],
            "share": total_us[(name, kind)] / whole,
        }
        for name, kind in total_us
    ]
    return sorted(rows, key=lambda r: r["ms_per_step"], reverse=True)


def layer_statistics(traces: Sequence[Trace]) -> list[dict]:
    """One row per layer, in model order: forward and backward milliseconds per step, and the bytes
    autograd saved for its backward in one step (largest rank)."""
    forward: dict[str, float] = defaultdict(float)
    backward: dict[str, float] = defaultdict(float)
    for trace in traces:
        for op in trace.ops:
            if op.layer is None:
                continue
            target = forward if op.kind == "forward" else backward if op.kind == "backward" else None
            if target is not None:
                target[op.layer] += trace.own_us(op)
    per_step = _per_step(traces)
    order = [layer["name"] for layer in traces[0].layers] if traces else []
    names = [n for n in order if n in forward or n in backward]
    names += sorted((set(forward) | set(backward)) - set(names))
    saved = {n: max(t.saved_activation_bytes.get(n, 0) for t in traces) for n in names} if traces else {}
    return [
        {
            "layer": n,
            "forward_ms": forward[n] / per_step / 1e3,
            "backward_ms": backward[n] / per_step / 1e3,
            "saved_bytes": saved[n],
        }
        for n in names
    ]
