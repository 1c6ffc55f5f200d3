"""Single ops of a symbolic trace timed on real tensors: what an estimate measures of an op type the
learned model never saw measured on this device (a max pool, dropout's random numbers), before any
step of the model runs.

`OpRecipe` is one op as the symbolic trace saw it dispatched: the aten overload's name and its
arguments as JSON, each tensor kept as its shape, strides and dtype only. `probe` times recipes in
a child Python process (made-up values can crash a native kernel: an RNN's backward reads its
forward's workspace, which a made-up tensor is not), which makes real tensors of those (random
floats; zeros for integers and booleans, valid indices and masks), runs each op once to warm it
and then `REPEATS` times, and keeps the least time. A crash loses only the op that crashed: the
child is started again after it. Each result is an `OpSample` of the same schema as a recorded op's,
so probes join the device's data set (`op_dataset.py`). Ops whose inputs exceed `MAX_PROBE_BYTES`,
whose arguments JSON cannot hold, that fail on made-up values, or beyond the time allowed are left
to the model.

    python -m qsync_callback.recorder.op_probes   # the child: recipes as JSON on stdin
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qsync_callback.recorder.op_samples import KINETO_DTYPES, TORCH_DTYPES, OpSample

REPEATS = 3
MAX_PROBE_BYTES = 256 << 20  # a probe's tensor inputs together at most


def _spec_bytes(spec: Sequence) -> int:
    shape, stride, dtype = spec
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n > 0) if shape else 1
    return span * TORCH_DTYPES[dtype].itemsize


def _to_json(value: Any) -> Any:
    """``value`` as JSON, a tensor as ``{"tensor": [shape, stride, dtype]}`` (Kineto's dtype names);
    ValueError for what JSON cannot hold."""
    if isinstance(value, (torch.Tensor, torch.dtype)):
        dtype = value.dtype if isinstance(value, torch.Tensor) else value
        if dtype not in KINETO_DTYPES:
            raise ValueError(f"dtype {dtype}")
        if isinstance(value, torch.dtype):
            return {"dtype": KINETO_DTYPES[dtype]}
        return {"tensor": [list(value.shape), list(value.stride()), KINETO_DTYPES[dtype]]}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    raise ValueError(f"argument of type {type(value).__name__}")


def _from_json(value: Any, device: str) -> Any:
    if isinstance(value, list):
        return [_from_json(v, device) for v in value]
    if isinstance(value, dict):
        if "tensor" in value:
            shape, stride, dtype = value["tensor"]
            torch_dtype = TORCH_DTYPES[dtype]
            span = max(_spec_bytes(value["tensor"]) // torch_dtype.itemsize, 1)
            if torch_dtype.is_floating_point:
                base = torch.randn(span, dtype=torch_dtype, device=device)
            else:
                base = torch.zeros(span, dtype=torch_dtype, device=device)
            return base.as_strided(shape, stride)
        if "dtype" in value:
            return TORCH_DTYPES[value["dtype"]]
        if "device" in value:
            return torch.device(device)
        return float(value["float"])
    return value


def _tensors(value: Any) -> list[list]:
    if isinstance(value, list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict) and "tensor" in value:
        return [value["tensor"]]
    return []


@dataclass
class OpRecipe:
    """One op as dispatched: its overload (``aten::add.Tensor``), arguments as JSON (see the module
    docstring), and the sample fields the trace gave it."""

    op: str
    args: list
    kwargs: dict
    sample: OpSample

    @classmethod
    def of(cls, func: Any, args: tuple, kwargs: dict, sample: OpSample) -> OpRecipe | None:
        """The recipe of a dispatched call, or None where its arguments cannot be written down."""
        try:
            keywords = {key: _to_json(v) for key, v in kwargs.items()}
            return cls(f"{func._schema.name}.{func._overloadname}", _to_json(args), keywords, sample)
        except ValueError:
            return None

    @property
    def input_bytes(self) -> int:
        return sum(_spec_bytes(t) for t in _tensors([self.args, list(self.kwargs.values())]))


def _run_recipe(recipe: dict, device: str) -> float:
    """The least time (us) of ``REPEATS`` calls of a recipe, after a first that warms it."""
    name, _, overload = recipe["op"].removeprefix("aten::").partition(".")
    func = getattr(getattr(torch.ops.aten, name), overload or "default")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    best = math.inf
    for k in range(REPEATS + 1):
        args = _from_json(recipe["args"], device)
        kwargs = {key: _from_json(v, device) for key, v in recipe["kwargs"].items()}
        sync()
        start = time.perf_counter()
        func(*args, **kwargs)
        sync()
        if k:
            best = min(best, (time.perf_counter() - start) * 1e6)
    return best


def _child() -> None:
    """Time the recipes given as JSON on stdin, one ``start i`` and one ``done i us`` (or ``failed
    i``) line each on stdout."""
    request = json.load(sys.stdin)
    for i, recipe in enumerate(request["recipes"]):
        print(f"start {i}", flush=True)
        try:
            us = _run_recipe(recipe, request["device"])
        except Exception:  # noqa: BLE001 - an op made-up values cannot run is left to the model
            print(f"failed {i}", flush=True)
            continue
        print(f"done {i} {us}", flush=True)


def probe(recipes: Iterable[OpRecipe], device: str = "cpu", seconds: float = 5.0) -> list[OpSample]:
    """The recipes timed on ``device`` in a child process (see the module docstring), within about
    ``seconds`` in all."""
    todo = [r for r in recipes if r.input_bytes <= MAX_PROBE_BYTES]
    deadline = time.monotonic() + seconds
    timed: dict[int, float] = {}
    first = 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    while first < len(todo) and time.monotonic() < deadline:
        request = {
            "device": device,
            "recipes": [{"op": r.op, "args": r.args, "kwargs": r.kwargs} for r in todo[first:]],
        }
        child = subprocess.Popen(
            [sys.executable, "-m", "qsync_callback.recorder.op_probes"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )  # fmt: skip
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(json.dumps(request))
        child.stdin.close()
        last = None
        for line in child.stdout:
            word, index, *rest = line.split()
            last = first + int(index)
            if word == "done":
                timed[last] = float(rest[0])
            if time.monotonic() > deadline:
                child.kill()
                break
        child.wait()
        if last is None:  # the child did not start: nothing more to try
            break
        first = last + 1  # after a crash, from the op after the one that crashed
    return [dataclasses.replace(r.sample, us=timed[i]) for i, r in enumerate(todo) if i in timed]


if __name__ == "__main__":
    _child()
