"""The module hooks that open a ``qsync::layer::<name>`` profiler range around each layer's forward
(the layers are `model_layers.layers_of`'s), and a ``qsync::module::<name>`` range around every
other submodule's (a block holding layers: what a compiled region may be).

The hooks are installed only while recording, so a run that is not being recorded pays nothing.
Inside a compiled region (`appliers/torch_regions.py`) a module's hooks are traced when the region
compiles: there they open nothing (the region's ops are the compiled graph's, attributed to the
range around the region), so a recompile inside a recorded window does not break the region.
The ranges let the trace conversion attribute every forward op to the innermost layer that ran it,
and to the innermost module of either kind (a block's own ops: its residual adds, its attention's
reshapes), and through autograd sequence numbers every backward op too.

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

from qsync_callback.recorder.kineto import LAYER_PREFIX, MODULE_PREFIX


class LayerRanges:
    """Forward pre/post hooks on the given layers and other ``modules``; ``install()`` and
    ``remove()`` them."""

    def __init__(
        self, layers: Mapping[str, torch.nn.Module], modules: Mapping[str, torch.nn.Module] | None = None
    ):
        self._layers = dict(layers)
        self._modules = {name: m for name, m in (modules or {}).items() if name not in self._layers}
        self._handles: list = []
        self._open: list = []  # (name, range, is a layer), innermost last
        self.called_blocks: set[str] = set()  # the other modules whose forward ran

    def install(self) -> None:
        for prefix, found in ((LAYER_PREFIX, self._layers), (MODULE_PREFIX, self._modules)):
            for name, module in found.items():
                self._handles.append(module.register_forward_pre_hook(self._enter_hook(prefix, name)))
                self._handles.append(module.register_forward_hook(self._exit_hook, always_call=True))

    @property
    def current_layer(self) -> str | None:
        """The innermost layer whose forward is running, if any."""
        return next((name for name, _, is_layer in reversed(self._open) if is_layer), None)

    def _enter_hook(self, prefix: str, name: str):
        label = prefix + name
        is_layer = prefix == LAYER_PREFIX

        def enter(module: torch.nn.Module, args: Iterable) -> None:
            if torch.compiler.is_compiling():  # traced into a compiled region: no range there
                return
            record = torch._C._profiler._RecordFunctionFast(label)
            record.__enter__()
            self._open.append((name, record, is_layer))
            if not is_layer:
                self.called_blocks.add(name)

        return enter

    def _exit_hook(self, module: torch.nn.Module, args: Iterable, output: object) -> None:
        if self._open and not torch.compiler.is_compiling():
            self._open.pop()[1].__exit__(None, None, None)

    def remove(self) -> None:
        """Remove the hooks and close any range a failed forward left open."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        while self._open:
            self._open.pop()[1].__exit__(None, None, None)
