"""The user's train step as the Recorder runs it: the function in force, and the call in progress.

Appliers change the step by re-tracing its Python function (``tf.function`` of it again) with
what their plan decides: TF reads its graph-rewrite options and env lists, and the step reads
``groups``, when a new function is traced and first optimized, that is at its first call. Each
change keeps the function it replaces, so that its undo puts that one back (already traced, it
keeps what it was traced with).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf


class TrainStep:
    """The decorated step ``user_fn`` (set by `attach`): ``fn`` is the function in force (the
    user's until a plan changes it), ``args``/``kwargs`` the call in progress, ``groups`` what the
    step passes to ``hvd.DistributedGradientTape(tape, groups=...)`` (None: Horovod's default),
    ``jit_compile`` whether re-traced functions are compiled by XLA."""

    def __init__(self) -> None:
        self.user_fn: Callable | None = None
        self.fn: Callable | None = None
        self.args: tuple = ()
        self.kwargs: dict = {}
        self.groups: Any = None
        self.jit_compile = False

    def attach(self, fn: Callable) -> None:
        """Make ``fn`` the user's step; ValueError if another one is attached already."""
        if self.user_fn is not None and self.user_fn is not fn:
            raise ValueError("this Recorder already profiles another train step; make one Recorder per step")
        self.user_fn = self.fn = fn

    @property
    def python_function(self) -> Callable:
        """The Python function behind the user's ``tf.function`` (or the user's function itself)."""
        return getattr(self.user_fn, "python_function", self.user_fn)

    def retrace(self) -> Callable[[], None]:
        """Put a new ``tf.function`` of the step in force; returns the undo (the function before)."""
        before = self.fn
        self.fn = tf.function(self.python_function, jit_compile=self.jit_compile)

        def undo() -> None:
            self.fn = before

        return undo


def all_finite(result: Any) -> bool:
    """True unless a floating-point tensor in ``result`` (a nested structure) holds inf or NaN."""
    for value in tf.nest.flatten(result, expand_composites=True):
        if isinstance(value, tf.Tensor) and value.dtype.is_floating:
            if not bool(tf.reduce_all(tf.math.is_finite(value))):
                return False
    return True
