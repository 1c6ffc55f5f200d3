"""The module hooks that open a ``qsync::layer::<name>`` profiler range around each layer's forward
(the layers are `model_layers.layers_of`'s).

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

import torch

from qsync_callback.recorder.kineto import LAYER_PREFIX


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
