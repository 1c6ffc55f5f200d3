"""Bytes autograd saves for backward, per layer: the activations a memory plan can act on.

Measured during the profiler's warm-up step (not a recorded one, so the hook's cost never shows
in a recorded op) with `torch.autograd.graph.saved_tensors_hooks`: each tensor autograd saves is
counted once per storage under the layer whose forward was running (`LayerRanges.current_layer`);
parameters, which autograd also saves, are left out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from qsync_callback.recorder.layer_ranges import LayerRanges

NO_LAYER = "(outside any layer)"


class SavedActivations:
    """Count saved-for-backward bytes by layer between `start()` and `stop()`."""

    def __init__(self, ranges: LayerRanges, parameters: Iterable[torch.Tensor]):
        self._ranges = ranges
        self._skip = {p.untyped_storage().data_ptr() for p in parameters}
        self._seen: set[int] = set()
        self._bytes: dict[str, int] = defaultdict(int)
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, FakeTensor):  # torch.compile tracing a region: it saves nothing real
            return tensor
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._skip and ptr not in self._seen:
            self._seen.add(ptr)
            self._bytes[self._ranges.current_layer or NO_LAYER] += storage.nbytes()
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def start(self) -> None:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def stop(self) -> dict[str, int]:
        """Remove the hooks (safe to call more than once) and return bytes by layer."""
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)
        return dict(self._bytes)
