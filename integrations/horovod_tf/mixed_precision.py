"""TF's oneDNN bfloat16 auto-mixed-precision rewrite: switched on, and steered per op type through
its env lists.

What TF 2.15.1 does (found by experiment on this project's AVX512-BF16 CPU, with the optimized
graph's bfloat16 op counts and a MatMul whose fp32 and bf16 results differ visibly):

- The rewrite (``auto_mixed_precision_onednn_bfloat16``) builds its four lists (allow, infer,
  deny, clear) each time Grappler optimizes a function, and reads
  ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_<LIST>_ADD`` and ``..._<LIST>_REMOVE`` (comma-separated op
  types) then. Set in this process before a new ``tf.function`` is first called, they take effect
  on it (a MatMul denied so computes exactly as in fp32; the same function with the default lists
  differs by bf16 rounding); functions optimized before keep what they got. So a plan is carried
  out by setting the env and re-tracing the step.
- An op type on two lists (e.g. ``ALLOWLIST_ADD=AddV2``, AddV2 being on the default infer list)
  makes the whole rewrite fail ("Op lists have conflicting entries", logged by Grappler, nothing
  raised): the step silently stays fp32. So an op type moved to one list is removed from the three
  others (``_REMOVE``; removing a type a list does not hold does nothing). An op type TF does not
  know is refused (`env_lists`), never passed on.
- ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL`` is read by the CUDA fp16 lists only: on the bf16
  rewrite it changes nothing (same op counts). It is left alone.
- ``..._PRIORLIST_FILE`` and ``..._PRIORLIST_ADD`` (op types to force to low precision, dPRO's fork
  of TF) are not read by TF: no effect here. They are written anyway, for forks that read them.
- On the bf16 lists of 2.15, ``Sum`` and ``Tanh`` are on none (a missing comma in TF's source joins
  them into one name); ``_REMOVE`` makes this harmless.
- ``FusedBatchNormV3`` and its gradient (a Keras ``BatchNormalization`` in training) are on TF's
  infer list: painted after a bf16 op, they run at bf16 with their scale and statistics at fp32.
  Added to the allow list instead, their scale type ``U`` becomes bfloat16 too, which the oneDNN op
  they become (``_MklNativeFusedBatchNormV3``) does not allow: ``mkl_layout_pass.cc`` aborts the
  process (SIGABRT, nothing to catch; seen on a residual CNN with batch norm). So a plan's bf16
  `INFER_ONLY_OP_TYPES` stay on the infer list, where the uniform rewrite had them.
- Denying an op type keeps it fp32. Its infer-list neighbours can follow it: TF paints an infer or
  clear op bf16 only after or between bf16 ops (see `predictor/op_precision.py`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from qsync_callback.jsonio import write_text_atomic
from qsync_callback.plan import FULL_PRECISION

AMP_OPTION = "auto_mixed_precision_onednn_bfloat16"
ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"
PRIORLIST_FILE_VAR = ENV_PREFIX + "PRIORLIST_FILE"
PRIORLIST_FILE = "amp_priorlist.txt"
LOW = "bf16"
# TF 2.15's oneDNN bfloat16 allow list (tensorflow/core/grappler/optimizers/auto_mixed_precision_lists.h,
# AutoMixedPrecisionListsMkl)
TF_BF16_ALLOWLIST = frozenset(
    {
        "Conv2D",
        "Conv2DBackpropFilter",
        "Conv2DBackpropInput",
        "Conv3D",
        "Conv3DBackpropFilterV2",
        "Conv3DBackpropInputV2",
        "DepthwiseConv2dNative",
        "DepthwiseConv2dNativeBackpropFilter",
        "DepthwiseConv2dNativeBackpropInput",
        "MatMul",
        "BatchMatMul",
        "BatchMatMulV2",
        "Einsum",
    }
)


# op types TF 2.15's oneDNN rewrite aborts the process on when they are on its allow list (module
# docstring): at bf16 they stay on its infer list
INFER_ONLY_OP_TYPES = frozenset({"FusedBatchNormV3", "FusedBatchNormGradV3"})


def unknown_op_types(names: Iterable[str]) -> list[str]:
    """The names of ``names`` that are no op type registered in this TF."""
    return sorted(n for n in names if op_def_registry.get(n) is None)


def env_lists(op_precision: Mapping[str, str], priorlist_file: Path | None = None) -> dict[str, str]:
    """The env that carries out ``op_precision`` (op type -> "bf16" or "fp32") on TF's bf16
    rewrite: low-precision types not on TF's allow list go to ``ALLOWLIST_ADD`` (but
    `INFER_ONLY_OP_TYPES` stay on its infer list), fp32 types to ``DENYLIST_ADD``, each removed from
    the other lists (see the module docstring); the
    low-precision types also go to ``PRIORLIST_ADD`` and, one per line, to ``priorlist_file``
    (written here) for forks that read them. Only non-empty variables are returned. An op type TF
    does not know, or another precision, raises ValueError before anything is written."""
    low = sorted(t for t, p in op_precision.items() if p == LOW)
    full = sorted(t for t, p in op_precision.items() if p == FULL_PRECISION)
    other = sorted(set(op_precision) - set(low) - set(full))
    if other:
        raise ValueError(
            f"TF's bf16 rewrite runs op types at bf16 or fp32 only, not {op_precision[other[0]]}"
        )
    unknown = unknown_op_types(op_precision)
    if unknown:
        raise ValueError(f"no op type of this TensorFlow is named {', '.join(map(repr, unknown))}")
    names = {
        "ALLOWLIST_ADD": [t for t in low if t not in TF_BF16_ALLOWLIST | INFER_ONLY_OP_TYPES],
        "ALLOWLIST_REMOVE": full,
        "INFERLIST_REMOVE": [t for t in low if t not in INFER_ONLY_OP_TYPES] + full,
        "CLEARLIST_REMOVE": low + full,
        "DENYLIST_REMOVE": low,
        "DENYLIST_ADD": full,
        "PRIORLIST_ADD": low,
    }
    env = {ENV_PREFIX + key: ",".join(types) for key, types in names.items() if types}
    if priorlist_file is not None and low:
        priorlist_file.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(priorlist_file, "".join(f"{t}\n" for t in low), what="AMP priorlist")
        env[PRIORLIST_FILE_VAR] = str(priorlist_file)
    return env


def rewrite_on(env: Mapping[str, str]) -> Callable[[], None]:
    """Switch TF's bf16 rewrite on with ``env`` set (empty: TF's lists as they are); returns the
    undo: the option and those variables as they were."""
    option_before = bool(tf.config.optimizer.get_experimental_options().get(AMP_OPTION, False))
    env_before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    tf.config.optimizer.set_experimental_options({AMP_OPTION: True})

    def undo() -> None:
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        tf.config.optimizer.set_experimental_options({AMP_OPTION: option_before})

    return undo
