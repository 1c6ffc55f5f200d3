"""FLOP formulas for ops torch's own counter (`torch.utils.flop_counter`) has none for, added to its
registry on import, so that every FLOP count of this package (a symbolic trace's ops, a recorded
op's, `op_samples.recorded_flops`) prices them alike.

- ``aten::mkldnn_rnn_layer``: one layer of an RNN run by oneDNN (what ``nn.LSTM`` runs on a CPU).
  Each of its ``T * N`` time steps and batch rows multiplies its input and its hidden state by
  the gates' weights: ``2 * T * N * G * (I + H)`` FLOPs, ``G`` the gates' rows (``weight0``'s
  first dimension: 4 hidden sizes for an LSTM), ``I`` the input size and ``H`` the hidden size.
  Its cells' pointwise work (a few FLOPs per gate) is left out, as torch's formulas leave out a
  matmul's bias.
- ``aten::mkldnn_rnn_layer_backward``: twice the forward's: the gradients of the input and hidden
  state, and those of the weights.
- ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward: what
  ``scaled_dot_product_attention`` runs on a CPU (``nn.MultiheadAttention`` too), by torch's own
  formulas for its other attention kernels (`sdpa_flop_count`: the two batched matmuls, ``Q K^T``
  and the scores times ``V``; the backward's five), which torch does not register for this one.
  Without them the CPU's attention counted no FLOPs: the learned model priced a ViT's attention
  from its bytes, at a fifth to a seventh of its time in the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.flop_counter import (
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

aten = torch.ops.aten


def rnn_layer_flops(input_shape: Sequence[int], weight_ih_shape: Sequence[int], hidden_size: int) -> int:
    """The matmul FLOPs of one RNN layer's forward over a whole sequence: ``input_shape`` (time,
    batch and features, in either order), the input-to-hidden weights ``[G, I]`` and ``hidden_size``."""
    gates, features = weight_ih_shape
    rows = math.prod(input_shape) // features  # time steps times batch rows
    return 2 * rows * gates * (features + hidden_size)


def _forward(input_shape: Sequence[int], weight0_shape: Sequence[int], *args: Any, **kwargs: Any) -> int:
    hidden_size = args[8]  # after weight1..3, hx_, cx_, reverse, batch_sizes, mode
    return rnn_layer_flops(input_shape, weight0_shape, hidden_size)


def _backward(input_shape: Sequence[int], weight1_shape: Sequence[int], *args: Any, **kwargs: Any) -> int:
    hidden_size = args[13]  # after weight2..4, hx_, cx_tmp, output, hy_, cy_, the 3 grads, reverse, mode
    return 2 * rnn_layer_flops(input_shape, weight1_shape, hidden_size)


def _attention(
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    value_shape: Sequence[int],
    *args: Any,
    **kwargs: Any,
) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _attention_backward(
    grad_out_shape: Sequence[int],
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    value_shape: Sequence[int],
    *args: Any,
    **kwargs: Any,
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


for _packet, _formula in (
    (aten.mkldnn_rnn_layer, _forward),
    (aten.mkldnn_rnn_layer_backward, _backward),
    (aten._scaled_dot_product_flash_attention_for_cpu, _attention),
    (aten._scaled_dot_product_flash_attention_for_cpu_backward, _attention_backward),
):
    if _packet not in flop_registry:  # torch may gain its own: keep torch's
        register_flop_formula(_packet)(_formula)
