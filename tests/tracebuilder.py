"""Hand-written normalized traces for unit tests: ops given as (name, kind, thread, start, dur)."""

from __future__ import annotations

from qsync_callback.recorder.trace import Op, Step, Trace


def op(op_id: int, name: str, kind: str, thread: str, start: float, dur: float, step: int = 0, **extra) -> Op:
    return Op(id=op_id, name=name, kind=kind, thread=thread, start_us=start, dur_us=dur, step=step, **extra)


def trace(ops: list[Op], step_end: float, rank: int = 0, world_size: int = 1, **extra) -> Trace:
    return Trace(
        rank=rank, world_size=world_size, device="cpu", steps=[Step(0, 0.0, step_end)], ops=ops, **extra
    )
