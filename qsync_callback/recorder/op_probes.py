"""Single ops of a symbolic trace timed on real tensors: what an estimate measures of an op type the
learned model never saw measured on this device (a max pool, dropout's random numbers), before any
step of the model runs.

An op is given as the symbolic trace saw it dispatched: its sample's ``call``, the aten overload's
name and its arguments as JSON, each tensor kept as its shape, strides and dtype only
(`op_samples.call_json`). `probe` times calls in
a child Python process (made-up values can crash a native kernel: an RNN's backward reads its
forward's workspace, which a made-up tensor is not), which makes real tensors of those (random
floats; zeros for integers and booleans, valid indices and masks), runs each op once to warm it
and then `REPEATS` times, and keeps the least time. A crash loses only the op that crashed, and
so does a hang (`ITEM_SECONDS` without a word from the child): the child is started again after it
(`child_runner.py`). Each result is an `OpSample` of the same
schema as a recorded op's, so probes join the device's data set (`op_dataset.py`). Ops whose
inputs exceed `MAX_PROBE_BYTES`, whose arguments JSON cannot hold, that fail on made-up values, or
beyond the time allowed are left to the model.

    python -m qsync_callback.recorder.op_probes   # the child: calls as JSON on stdin
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from qsync_callback.child_runner import run_in_children, serve
from qsync_callback.recorder.op_samples import TORCH_DTYPES, OpSample, call_overload, call_values

REPEATS = 3
ITEM_SECONDS = 20.0  # an op whose child writes nothing for this long is taken as hung (`child_runner`)
MAX_PROBE_BYTES = 256 << 20  # a probe's tensor inputs together at most


def _spec_bytes(spec: Sequence) -> int:
    shape, stride, dtype = spec
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n > 0) if shape else 1
    return span * TORCH_DTYPES[dtype].itemsize


def _made_up(spec: Sequence, device: str) -> torch.Tensor:
    """A tensor of ``spec`` (shape, stride, dtype) on ``device``: random floats, zeros otherwise."""
    shape, stride, dtype = spec
    torch_dtype = TORCH_DTYPES[dtype]
    span = max(_spec_bytes(spec) // torch_dtype.itemsize, 1)
    if torch_dtype.is_floating_point:
        base = torch.randn(span, dtype=torch_dtype, device=device)
    else:
        base = torch.zeros(span, dtype=torch_dtype, device=device)
    return base.as_strided(shape, stride)


def _tensors(value: Any) -> list[list]:
    if isinstance(value, list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict) and "tensor" in value:
        return [value["tensor"]]
    return []


def call_input_bytes(call: Mapping[str, Any]) -> int:
    """The bytes of a call's tensor inputs (`op_samples.call_json`'s form), strides counted."""
    return sum(_spec_bytes(t) for t in _tensors([call["args"], list(call["kwargs"].values())]))


def _run_call(call: dict, device: str) -> float:
    """The least time (us) of ``REPEATS`` runs of a call, after a first that warms it."""
    func = call_overload(call)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def made(spec: Sequence) -> torch.Tensor:
        return _made_up(spec, device)

    best = math.inf
    for k in range(REPEATS + 1):
        args = call_values(call["args"], made, torch.device(device))
        kwargs = {key: call_values(v, made, torch.device(device)) for key, v in call["kwargs"].items()}
        sync()
        start = time.perf_counter()
        func(*args, **kwargs)
        sync()
        if k:
            best = min(best, (time.perf_counter() - start) * 1e6)
    return best


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
    serve(lambda call, request: _run_call(call, request["device"]))
