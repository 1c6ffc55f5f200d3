"""Per-layer tensor statistics for QSync's precision-sensitivity indicator.

While started, hooks on the swappable layers (``swappable_layers``: Linear, Conv1d, Conv2d and
their LP versions) reduce, for every training forward and its backward, five tensors of each layer:

- ``input`` and ``weight`` (the operands a low-precision forward rounds),
- ``output`` (the signal the forward's rounding noise is compared with),
- ``grad_output`` (the gradient a low-precision backward rounds),
- ``grad_weight`` (the signal the weight gradient's rounding noise is compared with).

Per tensor and call they add up its element count, sum of squares, ``amax**2 * numel`` (the int8
quantization step of a per-tensor symmetric quantizer is ``amax / 127``), and the count and sum of
squares of its elements below fp16's smallest normal number (where fp16 loses relative precision);
they also keep the largest ``amax`` seen (fp16 overflows above 65504). A layer's depth is the order
of its first training forward among the layers (1 = first). ``predictor/indicator.py`` turns the
data of ``to_dict()`` into per-layer, per-precision indicators.

Cost and safety: a handful of reductions per tensor, accumulated on the tensor's device (no host
synchronization until ``to_dict``). The hooks read detached tensors and return nothing, so the
forward outputs and gradients are untouched. The gradient is read by a tensor hook on the layer's
output (registered in the forward hook), not by a full module backward hook: the tensor hook adds no
node to the autograd graph and works when the next op modifies the output in place. The weight
gradient is read from ``weight.grad`` at the layer's next training forward, before the training
loop zeroes it (so after DDP's all-reduce: the averaged one; the last step's is not counted). A
hook on the Parameter would see it earlier, but a hook on a leaf changes how autograd accumulates
its gradient, and the run's memory with it (seen here: 25 MB more at the peak of a 42 MB MLP).
Forwards in eval mode or without grad (validation) are not counted.

Hooks on a stock layer make ``swap_to_lp`` refuse it: ``stop()`` before swapping, or start after.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from qsync_callback.lp.swap import swappable_layers
from qsync_callback.recorder.statistics_schema import (
    FP16_NORMAL_MIN,
    STATISTICS_FORMAT,
    STATISTICS_VERSION,
    TENSOR_ROLES,
    check_statistics,
)

_SUMMED = ("sumsq", "amax_sq_numel", "under_count", "under_sumsq")  # added up over calls; plus amax


def _kind(module: nn.Module) -> str:
    for stock, kind in ((nn.Linear, "linear"), (nn.Conv1d, "conv1d"), (nn.Conv2d, "conv2d")):
        if isinstance(module, stock):
            return kind
    raise TypeError(f"a {type(module).__name__} is not a Linear, Conv1d or Conv2d")


def _reductions(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed fields of ``t`` (one call) and its amax, as 0-d/1-d fp32 tensors on its device."""
    a = t.detach().abs().float()
    amax = a.amax()
    small = a < FP16_NORMAL_MIN
    sumsq = torch.linalg.vector_norm(a).square()
    under_sumsq = torch.linalg.vector_norm(torch.where(small, a, 0.0)).square()
    return torch.stack((sumsq, amax.square() * a.numel(), small.sum().float(), under_sumsq)), amax


class _Layer:
    """What is gathered for one layer: sums on the device, counts on the host."""

    def __init__(self, kind: str, fan_in: int):
        self.kind = kind
        self.fan_in = fan_in
        self.depth: int | None = None
        self.calls = 0
        self.input_grad = False
        self.numel = dict.fromkeys(TENSOR_ROLES, 0)
        self.sums: torch.Tensor | None = None  # [roles, summed fields]
        self.amax: torch.Tensor | None = None  # [roles]

    def add(self, role: str, t: torch.Tensor) -> None:
        summed, amax = _reductions(t)
        if self.sums is None or self.sums.device != summed.device:
            device = summed.device
            self.sums = (
                torch.zeros(len(TENSOR_ROLES), len(_SUMMED), device=device)
                if self.sums is None
                else self.sums.to(device)
            )
            self.amax = (
                torch.zeros(len(TENSOR_ROLES), device=device) if self.amax is None else self.amax.to(device)
            )
        i = TENSOR_ROLES.index(role)
        self.sums[i] += summed
        self.amax[i] = torch.maximum(self.amax[i], amax)
        self.numel[role] += t.numel()

    def to_dict(self) -> dict[str, Any]:
        sums = [[0.0] * len(_SUMMED)] * len(TENSOR_ROLES) if self.sums is None else self.sums.tolist()
        amax = [0.0] * len(TENSOR_ROLES) if self.amax is None else self.amax.tolist()
        tensors = {}
        for role, row, peak in zip(TENSOR_ROLES, sums, amax, strict=True):
            values = dict(zip(_SUMMED, row, strict=True), amax=peak)
            # a NaN comes from an inf or NaN in the tensor, which no precision holds either
            tensors[role] = {"numel": self.numel[role]} | {
                field: math.inf if math.isnan(v) else v for field, v in values.items()
            }
        return {
            "kind": self.kind,
            "fan_in": self.fan_in,
            "depth": self.depth,
            "calls": self.calls,
            "input_grad": self.input_grad,
            "tensors": tensors,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> _Layer:
        layer = cls(data["kind"], data["fan_in"])
        layer.depth, layer.calls, layer.input_grad = data["depth"], data["calls"], data["input_grad"]
        tensors = data["tensors"]
        layer.numel = {role: tensors[role]["numel"] for role in TENSOR_ROLES}
        layer.sums = torch.tensor([[tensors[role][f] for f in _SUMMED] for role in TENSOR_ROLES])
        layer.amax = torch.tensor([tensors[role]["amax"] for role in TENSOR_ROLES])
        return layer


class LayerStatistics:
    """Gathers the indicator's statistics on a model's swappable layers between ``start()`` and
    ``stop()``; several start/stop windows add up. ``layer_names`` picks some of the layers."""

    def __init__(self, model: nn.Module, layer_names: Iterable[str] | None = None):
        found = swappable_layers(model)
        names = list(found) if layer_names is None else list(dict.fromkeys(layer_names))
        unknown = [name for name in names if name not in found]
        if unknown:
            raise ValueError(
                f"{', '.join(map(repr, unknown))}: not a swappable layer of the model (see swappable_layers)"
            )
        self._modules = {name: found[name] for name in names}
        self._layers = {
            name: _Layer(_kind(module), module.weight[0].numel()) for name, module in self._modules.items()
        }
        self._handles: list[RemovableHandle] = []
        self._grads_read: dict[str, tuple[weakref.ref, int]] = {}  # the last tensor read, its version
        self._active = False

    @property
    def recording(self) -> bool:
        """Whether the hooks are installed."""
        return self._active

    def start(self) -> None:
        """Install the hooks (a no-op when already recording)."""
        if self._active:
            return
        for name, module in self._modules.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
        self._active = True

    def stop(self) -> None:
        """Remove every hook (a backward still to come is not counted), after reading the weight
        gradients of the last step (``weight.grad``, if the loop has not zeroed it yet)."""
        if self._active:
            for name, module in self._modules.items():
                self._read_weight_gradient(name, module)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._active = False

    def _forward_hook(self, name: str):
        layer = self._layers[name]

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if not (module.training and torch.is_grad_enabled()):
                return
            if layer.depth is None:
                layer.depth = 1 + sum(other.depth is not None for other in self._layers.values())
            x = args[0]
            layer.calls += 1
            layer.input_grad = layer.input_grad or x.requires_grad
            layer.add("input", x)
            layer.add("weight", module.weight)
            layer.add("output", output)
            self._read_weight_gradient(name, module)  # the previous step's, before it is zeroed
            if output.requires_grad:
                output.register_hook(self._grad_hook(layer, "grad_output"))

        return hook

    def _read_weight_gradient(self, name: str, module: nn.Module) -> None:
        """Count ``weight.grad`` once: the same tensor object at the same version is not read again.
        Identity, not the address: a loop that sets gradients to None makes a new tensor each step,
        which the allocator often places where the last one was."""
        grad = module.weight.grad
        if grad is None or not self._layers[name].calls:
            return
        last = self._grads_read.get(name)
        if last is None or last[0]() is not grad or last[1] != grad._version:
            self._grads_read[name] = (weakref.ref(grad), grad._version)
            self._layers[name].add("grad_weight", grad)

    def _grad_hook(self, layer: _Layer, role: str):
        def hook(grad: torch.Tensor) -> None:
            if self._active:
                layer.add(role, grad)

        return hook

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (layers in depth order, never-run layers last), read by
        ``predictor.indicator.sensitivity``; synchronizes with the device once per layer."""
        order = sorted(
            self._layers, key=lambda n: (self._layers[n].depth is None, self._layers[n].depth or 0)
        )
        return {
            "format": STATISTICS_FORMAT,
            "version": STATISTICS_VERSION,
            "layers": {name: self._layers[name].to_dict() for name in order},
        }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], model: nn.Module, source: str = "layer statistics"
    ) -> LayerStatistics:
        """Statistics saved by ``to_dict``, on ``model`` again: ``start()`` adds to them. The data is
        validated (``QSyncInputError`` naming ``source``); its layers must be swappable layers of
        ``model`` of the same kind and fan-in."""
        layers = check_statistics(data, source)
        stats = cls(model, layers)
        for name, saved in layers.items():
            layer = stats._layers[name]
            if (saved["kind"], saved["fan_in"]) != (layer.kind, layer.fan_in):
                raise ValueError(
                    f"{source}: layer {name!r} was a {saved['kind']} of fan-in {saved['fan_in']}, "
                    f"the model's is a {layer.kind} of fan-in {layer.fan_in}"
                )
            stats._layers[name] = _Layer.from_dict(saved)
        return stats
