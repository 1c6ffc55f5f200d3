"""TensorFlow's own allocator figures: each step's measured peak, and the bytes in use when a window
opens.

``tf.config.experimental.get_memory_info(device)`` gives the device allocator's ``current`` and
``peak`` bytes in use and ``reset_memory_stats(device)`` starts the peak again from ``current``: on
a GPU (TF's BFC allocator there) and on the CPU when TF runs with oneDNN (the ``mklcpu``
allocator, a BFC allocator for requests of 256 KiB and more; the smaller ones go to another
allocator that these figures do not count, see `predictor/bfc_allocator.py`). Unset,
``TF_ENABLE_ONEDNN_OPTS`` leaves TF to decide by the CPU (TF 2.15 left it off on an AMD EPYC
without AVX-512); ``1`` turns it on, ``0`` off.
Without oneDNN the CPU's allocator keeps no statistics, and TF says so with a ValueError: the
figures are then None, with the reason.
"""

from __future__ import annotations

import tensorflow as tf

PEAK_SOURCE = (
    "TensorFlow's allocator ({device}: tf.config.experimental.get_memory_info's peak, reset at each "
    "timed step's start): the largest over the window's timed (unprofiled) steps; chunks in use, "
    "as the allocator counts them (on the CPU, requests of 256 KiB and more)"
)
NO_STATISTICS = (
    "not measured: TensorFlow's allocator on {device} keeps no statistics here ({why}); on the CPU it "
    "keeps them when TF runs with oneDNN (TF_ENABLE_ONEDNN_OPTS=1; unset, TF decides by the CPU and "
    "may leave it off)"
)


def allocator_device() -> str:
    """The device whose allocator holds the step's tensors: the first GPU, else the CPU."""
    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


class StepPeaks:
    """Peaks of single steps on ``device``'s allocator: `start` at a step's boundary, `end` after
    it; `why_not` says why there are none (statistics not kept)."""

    def __init__(self, device: str | None = None):
        self.device = device or allocator_device()
        self.why_not: str | None = None
        try:
            tf.config.experimental.get_memory_info(self.device)
        except ValueError as exc:
            self.why_not = NO_STATISTICS.format(device=self.device, why=str(exc).strip())

    @property
    def allocator(self) -> str | None:
        """The allocator's name as TF's profiler gives it (None without statistics)."""
        if self.why_not is not None:
            return None
        return "mklcpu" if self.device.startswith("CPU") else f"GPU_{self.device.split(':')[1]}_bfc"

    @property
    def source(self) -> str:
        """What a peak from here is, for the trace's ``peak_source``."""
        return self.why_not or PEAK_SOURCE.format(device=self.device)

    def in_use(self) -> int | None:
        """The allocator's bytes in use now."""
        if self.why_not is not None:
            return None
        return int(tf.config.experimental.get_memory_info(self.device)["current"])

    def start(self) -> None:
        """A step starts: its peak counts from the bytes in use now."""
        if self.why_not is None:
            tf.config.experimental.reset_memory_stats(self.device)

    def end(self) -> int | None:
        """The step's peak (bytes), since `start`."""
        if self.why_not is not None:
            return None
        return int(tf.config.experimental.get_memory_info(self.device)["peak"])
