"""What DDP's gradient buckets hold, and which recorded all-reduce carried which bucket.

DDP (`torch.nn.parallel.DistributedDataParallel`) groups the gradients into buckets and
all-reduces a bucket as soon as its last gradient is ready, one bucket after the other in bucket
order (its reducer launches bucket k only after bucket k-1). After the first iteration it rebuilds
the buckets in the order the gradients became ready, so from then on bucket 0 holds the gradients
ready first (the last layers') and the k-th all-reduce of a step is the k-th bucket.

`ddp_communication` reads the buckets off the live wrapper (the reducer's own bucket list, with
each bucket's parameters) and its bucket settings, for the trace's ``communication``;
`attach_bucket_tensors` names the tensors of each recorded all-reduce: each bucket's parameters go
to the step's first all-reduce (by start) of the same element count not taken by an earlier bucket
(gloo runs collectives on two threads, so a later bucket may start first; another collective of the
step, such as a metric's all-reduce, is left as it is). Each tensor carries the layer that owns
its parameter, so that pricing a new grouping (`predictor/tensor_fusion.py`) knows when each
gradient is ready. `fill_buckets` is DDP's rule for filling buckets up to their caps, which the
planner's candidates and the applier's caps (`appliers/torch_ddp_buckets.py`) both follow.

`time_allreduces` measures what one all-reduce costs on the wrapper's process group, alone, at
`CALIBRATION_BYTES` (each the least of `CALIBRATION_REPEATS`, every rank starting together after
a barrier): the recorded buckets are one or two sizes, all-reduced beside backward, which cannot tell
a per-collective cost from a per-byte one. It is the recorder's one collective call of its own: the
recorder makes it when its window closes, a step every rank reaches together.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from qsync_callback.recorder.trace import Op

DDP_LIBRARY = "ddp"
CALIBRATION_BYTES = (4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
CALIBRATION_REPEATS = 5


def is_ddp(module: torch.nn.Module | None) -> bool:
    return isinstance(module, torch.nn.parallel.DistributedDataParallel)


def owning_layer(parameter: str, layers: Iterable[str]) -> str | None:
    """The recorded layer that holds ``parameter`` (the longest layer name its name starts with)."""
    owners = [layer for layer in layers if parameter.startswith(layer + ".")]
    return max(owners, key=len) if owners else None


def ddp_communication(ddp: torch.nn.Module, model: torch.nn.Module, layers: Sequence[str]) -> dict[str, Any]:
    """DDP's buckets (in launch order, each a list of its gradients: parameter name, bytes, dtype,
    owning layer) and its bucket settings (``bucket_cap_mb`` and ``bucket_cap_mb_list``, as DDP's
    arguments of those names, null where DDP's default is in force); ``{}`` for a module that is
    not DDP. Read after DDP rebuilt its buckets (the first iteration)."""
    if not is_ddp(ddp):
        return {}
    names = {id(p): name for name, p in model.named_parameters()}
    buckets = []
    for bucket in ddp.reducer._get_zeros_like_grad_buckets():
        buckets.append(
            [
                {
                    "name": names.get(id(p), f"<parameter {i}>"),
                    "bytes": p.numel() * p.element_size(),
                    "dtype": str(p.dtype).removeprefix("torch."),
                    "layer": owning_layer(names.get(id(p), ""), layers),
                }
                for i, p in enumerate(bucket.parameters())
            ]
        )
    caps = list(ddp.bucket_bytes_cap_list)
    return {
        "library": DDP_LIBRARY,
        "buckets": buckets,
        "bucket_cap_mb": None if ddp.bucket_bytes_cap_default or caps else ddp.bucket_bytes_cap / 2**20,
        "bucket_cap_mb_list": [c / 2**20 for c in caps] or None,
    }


def attach_bucket_tensors(ops: Sequence[Op], buckets: Sequence[Sequence[dict[str, Any]]]) -> None:
    """Set ``collective["tensors"]`` of each step's all-reduce that carried a bucket (see the
    module docstring); tensors are named by parameter (``name`` and ``variable``)."""
    by_step: dict[int, list[Op]] = {}
    for op in ops:
        if op.kind == "comm" and op.collective and op.collective.get("op") == "all_reduce":
            by_step.setdefault(op.step, []).append(op)
    element_counts = [sum(t["bytes"] // _element_size(t["dtype"]) for t in bucket) for bucket in buckets]
    for comms in by_step.values():
        comms.sort(key=lambda o: o.start_us)
        for bucket, count in zip(buckets, element_counts, strict=True):
            op = next(
                (o for o in comms if o.collective.get("numel") == count and "tensors" not in o.collective),
                None,
            )
            if op is not None:
                op.collective["tensors"] = [{**t, "variable": t["name"]} for t in bucket]


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def fill_buckets(sizes: Sequence[int], caps: Sequence[int]) -> list[int]:
    """How many gradients of ``sizes`` (bytes, in filling order) each bucket gets under ``caps``
    (bytes), by DDP's rule: a bucket closes once its bytes reach its cap; the last cap repeats."""
    counts: list[int] = []
    count = size = 0
    for nbytes in sizes:
        count, size = count + 1, size + nbytes
        if size >= caps[min(len(counts), len(caps) - 1)]:
            counts.append(count)
            count = size = 0
    if count:
        counts.append(count)
    return counts


def time_allreduces(ddp: torch.nn.Module) -> dict[str, list[int | float]]:
    """One all-reduce's time alone on ``ddp``'s process group at each of `CALIBRATION_BYTES`
    (microseconds, the least of `CALIBRATION_REPEATS`: what the collective itself costs, without
    what else ran on the cores; see the module docstring). Every rank of the
    group must call it at the same point."""
    group = ddp.process_group
    device = next(ddp.module.parameters()).device
    times = []
    for nbytes in CALIBRATION_BYTES:
        tensor = torch.zeros(nbytes // 4, device=device)
        runs = []
        for _ in range(CALIBRATION_REPEATS):
            dist.barrier(group=group)
            _synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            _synchronize(device)
            runs.append((time.perf_counter() - start) * 1e6)
        times.append(min(runs))
    return {"bytes": list(CALIBRATION_BYTES), "us": times}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
