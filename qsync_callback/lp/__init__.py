"""Low-precision (LP) layers: Linear/Conv1d/Conv2d whose compute precision is an attribute.

What runs for real, per precision (``supported_precisions(device)`` measures it per device):

- fp32: the stock op, bit-identical to the stock module, on any device.
- tf32: CUDA devices of compute capability 8.0+ only (TF32 math flags around the op and its
  backward); refused on CPU and older GPUs.
- bf16, fp16: explicit casts and the stock op in that dtype, on CPU and CUDA (where a tiny probe
  op runs); the Parameters stay fp32 and get fp32 gradients.
- int8: Linear only, real int8 x int8 -> int32 matmuls with ``torch._int_mm`` on CPU and CUDA;
  shapes it cannot take (on CUDA: rows <= 16, features not multiples of 8) run in fp32 and are
  counted in ``int8_fallbacks``. Convolutions refuse int8: stock PyTorch has no trainable int8
  convolution kernel.

Swapping shares Parameter objects, so DDP, the optimizer and checkpoints are untouched.
``apply_precision_plan`` also links neighbours at the same bf16/fp16 precision in an
``nn.Sequential`` (``link_neighbours``, `qsync_callback.precision_links`): the low-precision tensor
passes between them without the casts back and forth.
"""

from qsync_callback.lp.costs import (
    cast_costs,
    fit_cast_costs,
    fit_linear_cost,
    probe_layer_costs,
    probe_pass_through_costs,
)
from qsync_callback.lp.modules import LPConv1d, LPConv2d, LPLinear, LPModule, supported_precisions
from qsync_callback.lp.swap import (
    apply_precision_plan,
    link_neighbours,
    restore,
    runnable_precisions,
    set_precision,
    swap_to_lp,
    swappable_layers,
)

__all__ = [
    "apply_precision_plan",
    "link_neighbours",
    "runnable_precisions",
    "LPConv1d",
    "LPConv2d",
    "LPLinear",
    "LPModule",
    "restore",
    "set_precision",
    "supported_precisions",
    "swap_to_lp",
    "swappable_layers",
    "cast_costs",
    "fit_cast_costs",
    "fit_linear_cost",
    "probe_layer_costs",
    "probe_pass_through_costs",
]
