"""A small Keras MLP and its traced train step, shared by the TensorFlow tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf

from qsync_callback.host_cpu import precision_flags


def mlp_and_step(
    width: int,
    features: int,
    *,
    distributed: bool = False,
    momentum: float = 0.9,
    finish: Callable[[tf.Tensor], tf.Tensor] | None = None,
) -> tuple[Any, Any, Any]:
    """A Dense(``width``, relu) "hidden" -> Dense(4) "head" model on ``features`` inputs, its SGD
    optimizer and its ``tf.function`` train step ``(x, y) -> loss``; ``distributed`` all-reduces the
    gradients through Horovod's tape, ``finish`` maps the loss before it is returned."""
    hidden = tf.keras.layers.Dense(width, activation="relu", name="hidden")
    model = tf.keras.Sequential([hidden, tf.keras.layers.Dense(4, name="head")], name="net")
    model.build((None, features))
    optimizer = tf.keras.optimizers.SGD(0.01, momentum=momentum)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return finish(loss) if finish is not None else loss

    return model, optimizer, train_step


def cpu_runs_bf16() -> bool:
    """Whether this CPU runs TF's oneDNN bfloat16 rewrite natively, from the CPU's own flags
    (AVX512F or AVX-NE-CONVERT, what TF checks), not from anything the project measures. Without
    them TF, at its own oneDNN default there, rewrites nothing; with oneDNN turned on (as
    `tests/conftest.py` does) it may still rewrite ops to bf16, without the CPU's native support."""
    return bool({"avx512f", "avx_ne_convert"} & set(precision_flags()))


NO_BF16_CPU = "this CPU has neither avx512f nor avx_ne_convert: no native bfloat16 for TF's oneDNN rewrite"
