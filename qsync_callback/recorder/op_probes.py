"""Single ops of a symbolic trace timed on real tensors: what an estimate measures of an op type the
learned model never saw measured on this device (a max pool, dropout's random numbers), before any
step of the model runs.

`OpRecipe` is one op as the symbolic trace saw it dispatched: the aten overload and its arguments,
each tensor kept as its shape, dtype and strides only. `probe` makes real tensors of those
(random floats; zeros for integers and booleans, which are valid indices and masks), runs the op
once to warm it and then `REPEATS` times, and keeps the least time: an `OpSample` of the same
schema as a recorded op's, so the probe joins the device's data set (`op_dataset.py`). Ops whose
inputs exceed `MAX_PROBE_BYTES`, that fail on made-up values, or beyond the time allowed are left
to the model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from qsync_callback.recorder.op_samples import OpSample

REPEATS = 3
MAX_PROBE_BYTES = 256 << 20  # a probe's inputs together at most


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument, without its values."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        if not self.shape:
            return self.dtype.itemsize
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True) if n > 0)
        return span * self.dtype.itemsize

    def make(self, device: str) -> torch.Tensor:
        span = max(self.nbytes // self.dtype.itemsize, 1)
        if self.dtype.is_floating_point or self.dtype.is_complex:
            base = torch.randn(span, dtype=self.dtype, device=device)
        else:
            base = torch.zeros(span, dtype=self.dtype, device=device)
        return base.as_strided(self.shape, self.stride)


@dataclass
class OpRecipe:
    """One op as dispatched: its overload and arguments (tensors as `TensorSpec`), and the sample
    fields the trace gave it."""

    func: Any
    args: tuple
    kwargs: dict
    sample: OpSample

    @classmethod
    def of(cls, func: Any, args: tuple, kwargs: dict, sample: OpSample) -> OpRecipe:
        def spec(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype)
            return value

        return cls(func, tree_map(spec, args), tree_map(spec, kwargs), sample)

    @property
    def input_bytes(self) -> int:
        leaves = [*self.args, *self.kwargs.values()]
        return sum(v.nbytes for v in leaves if isinstance(v, TensorSpec))


def _timed_us(recipe: OpRecipe, device: str) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    best = float("inf")
    for k in range(REPEATS + 1):
        args = tree_map(lambda v: v.make(device) if isinstance(v, TensorSpec) else v, recipe.args)
        kwargs = tree_map(lambda v: v.make(device) if isinstance(v, TensorSpec) else v, recipe.kwargs)
        sync()
        start = time.perf_counter()
        recipe.func(*args, **kwargs)
        sync()
        if k:  # the first call warms the kernel up
            best = min(best, (time.perf_counter() - start) * 1e6)
    return best


def probe(recipes: Iterable[OpRecipe], device: str = "cpu", seconds: float = 5.0) -> list[OpSample]:
    """The recipes timed on ``device`` (see the module docstring), within about ``seconds``."""
    deadline = time.perf_counter() + seconds
    samples = []
    for recipe in recipes:
        if time.perf_counter() > deadline:
            break
        if recipe.input_bytes > MAX_PROBE_BYTES:
            continue
        try:
            us = _timed_us(recipe, device)
        except Exception:  # noqa: BLE001 - an op made-up values cannot run is left to the model
            continue
        sample = recipe.sample
        samples.append(
            OpSample(sample.name, sample.shapes, sample.dtypes, sample.flops, sample.out_bytes, us)
        )
    return samples
