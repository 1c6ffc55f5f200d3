"""Swap a model's Linear/Conv1d/Conv2d layers for their LP versions in place, set their precisions,
and put the stock modules back. Parameters are shared throughout: nothing is copied.

``nn.MultiheadAttention`` does not call its ``out_proj`` child: it passes ``out_proj.weight`` and
``out_proj.bias`` to ``F.multi_head_attention_forward``, so an LP ``out_proj`` would never run its
LP forward and its precision would be a lie. Such children are left out of the default swap and
refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from qsync_callback.lp.modules import CAST_DTYPES, LP_CLASSES, LPModule, lp_class_for
from qsync_callback.model_layers import layer_table, layers_of, registrations
from qsync_callback.precision_links import Link, precision_links


def _under_mha(model: nn.Module, module: nn.Module) -> bool:
    return any(isinstance(parent, nn.MultiheadAttention) for parent, _ in registrations(model, module))


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent, name in registrations(model, old):
        setattr(parent, name, new)


def swappable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers a precision plan can address: every Linear/Conv1d/Conv2d among ``layers_of(model)``
    (already-swapped LP modules included) except the children of ``nn.MultiheadAttention``."""
    return {
        name: module
        for name, module in layers_of(model).items()
        if isinstance(module, (LPModule, *LP_CLASSES)) and not _under_mha(model, module)
    }


def runnable_precisions(module: nn.Module, device: torch.device | str) -> tuple[str, ...]:
    """The precisions ``module`` (a stock swappable layer or an LP module) can run on ``device``."""
    lp_class = type(module) if isinstance(module, LPModule) else lp_class_for(module)
    if lp_class is None:
        raise ValueError(f"a {type(module).__name__} has no LP version")
    return lp_class.allowed_precisions(device)


def swap_to_lp(model: nn.Module, layer_names: Iterable[str] | None = None) -> dict[str, LPModule]:
    """Replace layers of ``model`` in place by LP modules at fp32 (sharing their Parameters).

    By default every Linear/Conv1d/Conv2d among ``layers_of(model)`` except the children of
    ``nn.MultiheadAttention``; named layers must be such modules (ValueError otherwise). Every
    layer is checked and built before any is installed. Returns the LP modules by layer name.
    """
    layers = layers_of(model)
    if layer_names is None:
        names = [n for n, m in swappable_layers(model).items() if lp_class_for(m) is not None]
    else:
        names = list(dict.fromkeys(layer_names))
        for name in names:
            module = layers.get(name)
            if module is None:
                raise ValueError(f"{name!r} is not a layer of the model (see layers_of)")
            if lp_class_for(module) is None:
                kind = type(module).__name__
                raise ValueError(f"layer {name!r} is a {kind}, not a Linear, Conv1d or Conv2d")
            if _under_mha(model, module):
                raise ValueError(
                    f"layer {name!r} belongs to an nn.MultiheadAttention, which reads its weight directly "
                    "instead of calling it: an LP version would never run"
                )
    swapped = {name: lp_class_for(layers[name]).from_module(layers[name]) for name in names}
    for name, lp in swapped.items():
        _replace(model, layers[name], lp)
    return swapped


def set_precision(lp_modules: Mapping[str, LPModule], precisions: Mapping[str, str]) -> None:
    """Set ``precisions`` (layer name -> precision) on the LP modules, all or nothing: every name and
    precision is checked first, and a bad one raises ValueError with nothing changed."""
    unknown = [name for name in precisions if name not in lp_modules]
    if unknown:
        raise ValueError(f"no LP module named {', '.join(map(repr, unknown))}")
    for name, precision in precisions.items():
        try:
            lp_modules[name].check_precision(precision)
        except ValueError as error:
            raise ValueError(f"layer {name!r}: {error}") from None
    for name, precision in precisions.items():
        lp_modules[name].precision = precision


def restore(model: nn.Module, lp_modules: Mapping[str, LPModule]) -> None:
    """Put the stock modules back in place of the LP ones (same Parameters); all or nothing."""
    missing = [name for name, lp in lp_modules.items() if not registrations(model, lp)]
    if missing:
        raise ValueError(f"LP module(s) {', '.join(map(repr, missing))} are not in the model")
    for lp in lp_modules.values():
        _replace(model, lp, lp.to_stock())


def link_neighbours(model: nn.Module, lp_modules: Mapping[str, LPModule]) -> list[Link]:
    """Let the LP modules at the same bf16/fp16 precision that follow each other in an
    ``nn.Sequential`` pass their low-precision tensor on (`precision_links`); every other LP module
    casts its output back to its input's dtype. Returns the links."""
    links = precision_links(layer_table(model), {name: lp.precision for name, lp in lp_modules.items()})
    for lp in lp_modules.values():
        lp.output_dtype = None
    for link in links:
        source, target = lp_modules[link.source], lp_modules[link.target]
        source.output_dtype = CAST_DTYPES[link.precision]
        if target.output_dtype is None:
            target.output_dtype = target.weight.dtype
    return links


def apply_precision_plan(model: nn.Module, precision: Mapping[str, str]) -> dict[str, LPModule]:
    """Swap the layers ``precision`` names for LP modules at those precisions, neighbours at the same
    bf16/fp16 precision linked (`link_neighbours`); all or nothing: on any problem (a layer that is
    not swappable, a precision it cannot run here) the model is left as it was and ValueError says
    why. Returns the LP modules (give them to ``restore`` to undo)."""
    lp_modules = swap_to_lp(model, precision)
    try:
        set_precision(lp_modules, precision)
    except ValueError:
        restore(model, lp_modules)
        raise
    link_neighbours(model, lp_modules)
    return lp_modules
