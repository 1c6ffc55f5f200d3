"""Carry out a Plan's decisions on a live Horovod + TF train step, one applier per plan field
(`qsync_callback.tuning_loop.Applier`). Each refuses, before changing anything, what it cannot
carry out (QSyncInputError naming it), and returns an undo that puts back the step function and
the TF options, env lists and groups it changed. Each change re-traces the step
(`TrainStep.retrace`), so that the next call runs it.

- ``precision``: bf16 on every layer, through TF's oneDNN bf16 rewrite with its default lists (the
  rewrite covers the whole step: bf16 on some layers only, or another precision, is refused);
- ``op_precision``: the rewrite steered by the plan's env lists (`mixed_precision.env_lists`; an
  op type TF does not know is refused);
- ``fused_regions``: one region holding every layer, the step compiled by XLA (``jit_compile``);
  the step must lower to XLA with the arguments of the call in progress (on CPU Horovod's
  all-reduce has no XLA kernel), which is checked before anything changes;
- ``buckets``: gradient groups (variable names) into ``recorder.groups``, which the step passes to
  ``hvd.DistributedGradientTape``;
- ``communication``: Horovod's fusion threshold and cycle time, which ``hvd.init()`` reads: accepted
  only where they are already in effect, else refused with how to launch with them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tensorflow as tf

from qsync_callback.errors import QSyncInputError
from qsync_callback.integrations.horovod_tf.fusion import groups_by_variable, settings_not_in_effect
from qsync_callback.integrations.horovod_tf.mixed_precision import LOW, env_lists, rewrite_on
from qsync_callback.integrations.horovod_tf.train_step import TrainStep
from qsync_callback.plan import Plan
from qsync_callback.planner.tensor_fusion import next_launch
from qsync_callback.tuning_loop import Applier, Undo

ERROR_CHARS = 300  # of TF's own error message, in a refusal


def rewrite_step(step: TrainStep, env: Mapping[str, str]) -> Undo:
    """The step re-traced with TF's bf16 rewrite on and ``env`` set (empty: TF's default lists)."""
    option_undo = rewrite_on(env)
    step_undo = step.retrace()

    def undo() -> None:
        step_undo()
        option_undo()

    return undo


def tf_appliers(
    step: TrainStep, layers: Sequence[str], variables: Sequence[Any], priorlist_file: Path
) -> dict[str, Applier]:
    """Plan field -> its applier, for ``step`` training the model of ``layers`` and ``variables``
    (its trainable variables); ``priorlist_file`` is where `env_lists` writes its priorlist."""

    def precision(plan: Plan) -> Undo:
        if set(plan.precision) != set(layers) or set(plan.precision.values()) != {LOW}:
            raise QSyncInputError(
                "precision: TF's bf16 rewrite covers the whole step: a plan's precision must be bf16 on"
                " every layer"
            )
        if plan.op_precision:
            raise QSyncInputError("precision: a plan sets bf16 on every layer or per op type, not both")
        return rewrite_step(step, {})

    def op_precision(plan: Plan) -> Undo:
        try:
            env = env_lists(plan.op_precision, priorlist_file)
        except ValueError as error:
            raise QSyncInputError(f"op_precision: {error}") from None
        return rewrite_step(step, env)

    def fused_regions(plan: Plan) -> Undo:
        if [sorted(region) for region in plan.fused_regions] != [sorted(layers)]:
            raise QSyncInputError("fused_regions: XLA compiles the whole step: one region holds every layer")
        compiled = tf.function(step.python_function, jit_compile=True)
        try:
            compiled.experimental_get_compiler_ir(*step.args, **step.kwargs)(stage="hlo")
        except Exception as exc:  # noqa: BLE001 - TF raises several kinds; each means "cannot compile"
            message = str(exc).splitlines()[0][:ERROR_CHARS] if str(exc) else type(exc).__name__
            raise QSyncInputError(f"fused_regions: XLA cannot compile the step ({message})") from None
        step.jit_compile = True
        return _undo_also(step.retrace(), lambda: setattr(step, "jit_compile", False))

    def buckets(plan: Plan) -> Undo:
        try:
            groups = groups_by_variable(plan.buckets, variables)
        except ValueError as error:
            raise QSyncInputError(f"buckets: {error}") from None
        before, step.groups = step.groups, groups
        return _undo_also(step.retrace(), lambda: setattr(step, "groups", before))

    def communication(plan: Plan) -> Undo:
        off = settings_not_in_effect(plan.communication)
        if off:
            raise QSyncInputError(
                f"communication: Horovod reads {' and '.join(off)} at hvd.init(), and this run has other"
                f" values; launch with {next_launch(plan.communication)}"
            )
        return lambda: None

    return {
        "precision": precision,
        "op_precision": op_precision,
        "fused_regions": fused_regions,
        "buckets": buckets,
        "communication": communication,
    }


def _undo_also(undo: Undo, also: Callable[[], None]) -> Undo:
    def both() -> None:
        undo()
        also()

    return both
