"""Carry out a plan's per-layer precision on a live torch model.

The named layers are swapped in place for LP modules at their precisions (`lp.swap`), sharing the
same Parameter objects, so DDP and the optimizer are untouched; neighbours at the same bf16/fp16
precision are linked. A layer may be named by any name it is registered under (a module registered
twice has two). All or nothing: a layer that is not in the model or not swappable, or a precision
it cannot run on this device, raises QSyncInputError with the model unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from qsync_callback.errors import QSyncInputError
from qsync_callback.lp.swap import apply_precision_plan, restore
from qsync_callback.model_layers import layers_of
from qsync_callback.plan import Plan


def canonical_names(model: torch.nn.Module, names: Mapping[str, str]) -> dict[str, str]:
    """``names`` (layer -> value) with each layer named as `layers_of` names it: an alias of a module
    registered twice becomes its first name. Names of no module are left as they are."""
    first = {id(module): name for name, module in layers_of(model).items()}
    modules = dict(model.named_modules(remove_duplicate=False))
    out: dict[str, str] = {}
    for name, value in names.items():
        module = modules.get(name)
        out[first.get(id(module), name) if module is not None else name] = value
    return out


def precision_applier(model: torch.nn.Module) -> Callable[[Plan], Callable[[], None]]:
    """The applier of ``plan.precision`` on ``model``."""

    def apply(plan: Plan) -> Callable[[], None]:
        try:
            lp_modules = apply_precision_plan(model, canonical_names(model, plan.precision))
        except ValueError as error:
            raise QSyncInputError(f"precision: {error}") from None
        return lambda: restore(model, lp_modules)

    return apply
