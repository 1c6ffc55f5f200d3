"""A model's layers (`layers_of`, `layer_table`: what a plan can address, and which layer's output
feeds which, `sequential_next`), and the module hooks that open a ``qsync::layer::<name>`` profiler
range around each layer's forward.

The hooks are installed only while recording, so a run that is not being recorded pays nothing.
The ranges let the trace conversion attribute every forward op to the innermost layer that ran it
(and, through autograd sequence numbers, every backward op too).

A range is a ``torch._C._profiler._RecordFunctionFast`` (what torch.compile's own profiler marks
use; Kineto writes it as a ``cpu_op`` event, which the conversion tells from ops by its name): about
0.6 us to open and close under the profiler in a loop here, where ``torch.profiler.record_function``'s
dispatcher ops take about 20 us with the profiler on or off, and 60 to 100 us per layer inside a real
step. A hooked layer still costs a real forward about 20 us (some 12 us of it the Python hooks
themselves); `overhead.py` calibrates it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from qsync_callback.recorder.kineto import LAYER_PREFIX


def layers_of(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules a plan can address: leaves, and any module holding parameters of its own
    (``nn.MultiheadAttention`` keeps ``in_proj_weight`` itself besides its ``out_proj`` child)."""
    found = {}
    for name, module in model.named_modules():
        if not name:
            continue
        has_children = next(module.children(), None) is not None
        owns_params = next(module.parameters(recurse=False), None) is not None
        if not has_children or owns_params:
            found[name] = module
    return found


def registrations(model: nn.Module, target: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every (parent, child name) under which ``target`` is registered in ``model``."""
    return [
        (parent, name)
        for parent in model.modules()
        for name, child in parent._modules.items()
        if child is target
    ]


def sequential_next(model: nn.Module) -> dict[str, str | None]:
    """For each layer of ``model`` (`layers_of`): the name of the next child of the ``nn.Sequential``
    it is a child of, or None: not a Sequential's child, its last, a child of a Sequential subclass
    with a forward of its own (which may not feed each child to the next), or a module registered
    in more than one place (its output may go elsewhere too)."""
    following: dict[str, str | None] = {}
    for prefix, parent in model.named_modules():
        if isinstance(parent, nn.Sequential) and type(parent).forward is nn.Sequential.forward:
            names = [f"{prefix}.{name}" if prefix else name for name in parent._modules]
            following.update(zip(names, [*names[1:], None], strict=True))
    layers = layers_of(model)
    return {
        name: following.get(name) if len(registrations(model, module)) == 1 else None
        for name, module in layers.items()
    }


def layer_table(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Name, type, own parameter bytes and the next child of its ``nn.Sequential`` (`precision_links`)
    of each layer a plan can address."""
    following = sequential_next(model)
    return [
        {
            "name": name,
            "type": type(module).__name__,
            "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters(recurse=False)),
            "next": following[name],
        }
        for name, module in layers_of(model).items()
    ]


class LayerRanges:
    """Forward pre/post hooks on the given layers; ``install()`` and ``remove()`` them."""

    def __init__(self, layers: Mapping[str, torch.nn.Module]):
        self._layers = dict(layers)
        self._handles: list = []
        self._open: list = []

    def install(self) -> None:
        for name, module in self._layers.items():
            self._handles.append(module.register_forward_pre_hook(self._enter_hook(name)))
            self._handles.append(module.register_forward_hook(self._exit_hook, always_call=True))

    @property
    def current_layer(self) -> str | None:
        """The innermost layer whose forward is running, if any."""
        return self._open[-1][0] if self._open else None

    def _enter_hook(self, name: str):
        label = LAYER_PREFIX + name

        def enter(module: torch.nn.Module, args: Iterable) -> None:
            record = torch._C._profiler._RecordFunctionFast(label)
            record.__enter__()
            self._open.append((name, record))

        return enter

    def _exit_hook(self, module: torch.nn.Module, args: Iterable, output: object) -> None:
        if self._open:
            self._open.pop()[1].__exit__(None, None, None)

    def remove(self) -> None:
        """Remove the hooks and close any range a failed forward left open."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        while self._open:
            self._open.pop()[1].__exit__(None, None, None)
