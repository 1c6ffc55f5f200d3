"""Single ops of a symbolic trace timed on real tensors: what an estimate measures of its ops before
any step of the model runs (`estimate.probe_order`: first the op types the learned model never
saw measured on this device, a max pool or dropout's random numbers, then the rest).

An op is given as the symbolic trace saw it dispatched: its sample's ``call``, the aten overload's
name and its arguments as JSON, each tensor kept as its shape, strides and dtype only
(`op_samples.call_json`). `probe` times calls in a child Python process (made-up values can crash
a native kernel: an RNN's backward given an empty workspace did, before the symbolic trace gave
workspaces their real size), which makes real tensors of those (`made_up`: random floats, positive
and away from 0 (`MADE_UP_FLOATS`); zeros for integers and booleans, valid indices and masks),
runs each op once to warm it and then `REPEATS` times, and keeps the least time, less what timing
a call costs beyond its op (`call_floor_us`). A crash loses only the op that crashed, and so does a
hang (`ITEM_SECONDS` without a word from the child): the child is started again after it
(`child_runner.py`). Each result is an `OpSample` of the same
schema as a recorded op's, so probes join the device's data set (`op_dataset.py`). Ops whose
inputs exceed `MAX_PROBE_BYTES`, whose arguments JSON cannot hold, that fail on made-up values, or
beyond the time allowed are left to the model. The same child measures a call's kernel scratch
instead (`scratch_bytes`: what the allocator held at its peak during the call beyond what the
call returned), for the symbolic trace's memory.

    python -m qsync_callback.recorder.op_probes   # the child: calls as JSON on stdin
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from qsync_callback.allocator_profile import allocator_totals, profiled_events
from qsync_callback.child_runner import run_in_children, serve
from qsync_callback.recorder.op_samples import TORCH_DTYPES, OpSample, call_overload, call_values

REPEATS = 3
FLOOR_CALLS = 200
ITEM_SECONDS = 20.0  # an op whose child writes nothing for this long is taken as hung (`child_runner`)
MAX_PROBE_BYTES = 256 << 20  # a probe's tensor inputs together at most
# made-up floats: positive and away from 0, as the values an optimizer takes a square root of or
# divides by are; a negative one sends sqrt down its NaN path (19x slower on 4M floats here) and
# a 0 a division to inf, paths a real step does not take
MADE_UP_FLOATS = (0.5, 1.5)
SCRATCH_SECONDS = 10.0  # the most a symbolic trace spends measuring its ops' scratch


def _span(shape: Sequence[int], stride: Sequence[int]) -> int:
    """The elements a tensor of that shape and stride reaches in its storage."""
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n > 0) if shape else 1


def _spec_bytes(spec: Sequence) -> int:
    shape, stride, dtype = spec
    return _span(shape, stride) * TORCH_DTYPES[dtype].itemsize


def made_up(
    shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: str | torch.device
) -> torch.Tensor:
    """A tensor of that shape, stride and dtype on ``device``: floats uniform in `MADE_UP_FLOATS`,
    zeros otherwise (valid indices and masks)."""
    span = _span(shape, stride)
    if dtype.is_floating_point:
        base = torch.empty(span, dtype=dtype, device=device).uniform_(*MADE_UP_FLOATS)
    else:
        base = torch.zeros(span, dtype=dtype, device=device)
    return base.as_strided(shape, stride)


def _call_values(call: Mapping[str, Any], device: str) -> tuple[list, dict]:
    """A call's arguments and keywords (`op_samples.call_json`'s form) with made-up tensors."""

    def tensor(spec: Sequence) -> torch.Tensor:
        shape, stride, dtype = spec
        return made_up(shape, stride, TORCH_DTYPES[dtype], device)

    args = call_values(call["args"], tensor, torch.device(device))
    return args, {key: call_values(v, tensor, torch.device(device)) for key, v in call["kwargs"].items()}


def _sync(device: str) -> Callable[[], None]:
    """What waits for ``device``'s queued work: CUDA's synchronize, or nothing."""
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def _tensors(value: Any) -> list[list]:
    if isinstance(value, list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict) and "tensor" in value:
        return [value["tensor"]]
    return []


def call_input_bytes(call: Mapping[str, Any]) -> int:
    """The bytes of a call's tensor inputs (`op_samples.call_json`'s form), strides counted."""
    return sum(_spec_bytes(t) for t in _tensors([call["args"], list(call["kwargs"].values())]))


@functools.cache
def call_floor_us(device: str) -> float:
    """What timing a call here costs beyond its op: the least time of `FLOOR_CALLS` calls of
    ``aten::alias`` (a view: no kernel work), timed as `_run_call` times a call (Python's binding
    of ``torch.ops``, argument parsing, the dispatcher), which a Kineto op's duration does not
    hold."""
    x = torch.zeros(1, device=device)
    alias = torch.ops.aten.alias.default
    sync = _sync(device)
    best = math.inf
    for _ in range(FLOOR_CALLS):
        sync()
        start = time.perf_counter()
        alias(x)
        sync()
        best = min(best, (time.perf_counter() - start) * 1e6)
    return best


def _run_call(call: dict, device: str) -> float:
    """The least time (us) of ``REPEATS`` runs of a call, after a first that warms it, less
    `call_floor_us` (at least 0)."""
    func = call_overload(call)
    sync = _sync(device)
    best = math.inf
    for k in range(REPEATS + 1):
        args, kwargs = _call_values(call, device)
        sync()
        start = time.perf_counter()
        func(*args, **kwargs)
        sync()
        if k:
            best = min(best, (time.perf_counter() - start) * 1e6)
    return max(best - call_floor_us(device), 0.0)


def _scratch_bytes(call: dict, device: str) -> int:
    """The bytes a call's kernel holds at its peak beyond what it returns: the allocator's largest
    total during the call less its total when the call returns (`allocator_profile.py`), after a
    first run that warms it (a kernel's one-time caches)."""
    func = call_overload(call)
    args, kwargs = _call_values(call, device)
    func(*args, **kwargs)
    outputs = []  # held past the profile: what the call returns is not its scratch
    totals = allocator_totals(profiled_events(lambda: outputs.append(func(*args, **kwargs)), device))
    return max(max(totals) - totals[-1], 0) if totals else 0


def scratch_bytes(
    calls: Sequence[dict], device: str = "cpu", seconds: float = SCRATCH_SECONDS
) -> list[int | None]:
    """`_scratch_bytes` of each call, run in a child process as `probe` times them (a native kernel's
    scratch, which no tensor a dispatch-level trace sees holds: oneDNN's convolutions and RNN
    layers). None for a call whose inputs exceed `MAX_PROBE_BYTES`, that failed, crashed its child
    or was not reached in ``seconds``."""
    sized: list[int | None] = [None] * len(calls)
    todo = [i for i, call in enumerate(calls) if call_input_bytes(call) <= MAX_PROBE_BYTES]

    def report(k: int, nbytes: int | None) -> None:
        sized[todo[k]] = nbytes

    deadline = time.monotonic() + seconds
    extra = {"device": device, "measure": "scratch"}
    run_in_children(__name__, [calls[i] for i in todo], deadline, report, extra, ITEM_SECONDS)
    return sized


def probe(samples: Iterable[OpSample], device: str = "cpu", seconds: float = 5.0) -> list[OpSample]:
    """The calls of ``samples`` (those with one) timed on ``device`` in a child process (see the
    module docstring), within about ``seconds`` in all: each a copy of its sample with the time."""
    todo = [s for s in samples if s.call is not None and call_input_bytes(s.call) <= MAX_PROBE_BYTES]
    timed: dict[int, float] = {}

    def report(i: int, us: float | None) -> None:
        if us is not None:
            timed[i] = us

    calls = [s.call for s in todo]
    deadline = time.monotonic() + seconds
    run_in_children(__name__, calls, deadline, report, {"device": device}, ITEM_SECONDS)
    return [dataclasses.replace(s, us=timed[i]) for i, s in enumerate(todo) if i in timed]


if __name__ == "__main__":
    serve(
        lambda call, request: (_scratch_bytes if request.get("measure") == "scratch" else _run_call)(
            call, request["device"]
        )
    )
