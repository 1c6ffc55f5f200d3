"""Hand-written normalized traces for unit tests: ops given as (name, kind, thread, start, dur)."""

from __future__ import annotations

import torch

from qsync_callback.recorder.trace import Op, Step, Trace


def op(op_id: int, name: str, kind: str, thread: str, start: float, dur: float, step: int = 0, **extra) -> Op:
    return Op(id=op_id, name=name, kind=kind, thread=thread, start_us=start, dur_us=dur, step=step, **extra)


def trace(ops: list[Op], step_end: float, rank: int = 0, world_size: int = 1, **extra) -> Trace:
    return Trace(
        rank=rank, world_size=world_size, device="cpu", steps=[Step(0, 0.0, step_end)], ops=ops, **extra
    )


def op_samples(n: int, seed: int = 0) -> list[dict]:
    """Matmuls whose time is 2 us plus their FLOPs at 10 GFLOP/s, and adds at 5 GB/s."""
    g = torch.Generator().manual_seed(seed)
    ops = []
    for _ in range(n):
        m, k, p = (int(v) for v in torch.randint(8, 512, (3,), generator=g))
        ops.append(
            {
                "name": "aten::mm",
                "shapes": [[m, k], [k, p]],
                "dtypes": ["float", "float"],
                "flops": 2.0 * m * k * p,
                "out_bytes": 4 * m * p,
                "us": 2 + 2 * m * k * p / 1e4,
                "count": 1,
            }
        )
        ops.append(
            {
                "name": "aten::add",
                "shapes": [[m, k], [m, k]],
                "dtypes": ["float", "float"],
                "flops": 0.0,
                "out_bytes": 4 * m * k,
                "us": 1 + 12 * m * k / 5e3,
                "count": 1,
            }
        )
    return ops
