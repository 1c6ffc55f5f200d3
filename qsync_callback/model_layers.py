"""A torch model's layers: what a plan can address (`layers_of`, and the blocks holding them,
`blocks_of`), under which names a module is
registered (`registrations`), which layer's output feeds which inside an ``nn.Sequential``
(`sequential_next`), and the table the trace keeps of them (`layer_table`).

The recorder, the LP modules and the appliers all read a model's layers here, so that a plan names
the same layers whoever reads it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def layers_of(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules a plan can address: leaves, and any module holding parameters of its own
    (``nn.MultiheadAttention`` keeps ``in_proj_weight`` itself besides its ``out_proj`` child)."""
    found = {}
    for name, module in model.named_modules():
        if not name:
            continue
        has_children = next(module.children(), None) is not None
        owns_params = next(module.parameters(recurse=False), None) is not None
        if not has_children or owns_params:
            found[name] = module
    return found


def blocks_of(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The submodules that are not layers (`layers_of`): the blocks that hold them, at any depth
    below the root (a transformer block, its attention, an ``nn.Sequential``)."""
    layers = layers_of(model)
    return {name: module for name, module in model.named_modules() if name and name not in layers}


def registrations(model: nn.Module, target: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every (parent, child name) under which ``target`` is registered in ``model``."""
    return [
        (parent, name)
        for parent in model.modules()
        for name, child in parent._modules.items()
        if child is target
    ]


def sequential_next(model: nn.Module) -> dict[str, str | None]:
    """For each layer of ``model`` (`layers_of`): the name of the next child of the ``nn.Sequential``
    it is a child of, or None: not a Sequential's child, its last, a child of a Sequential subclass
    with a forward of its own (which may not feed each child to the next), or a module registered
    in more than one place (its output may go elsewhere too)."""
    following: dict[str, str | None] = {}
    for prefix, parent in model.named_modules():
        if isinstance(parent, nn.Sequential) and type(parent).forward is nn.Sequential.forward:
            names = [f"{prefix}.{name}" if prefix else name for name in parent._modules]
            following.update(zip(names, [*names[1:], None], strict=True))
    layers = layers_of(model)
    return {
        name: following.get(name) if len(registrations(model, module)) == 1 else None
        for name, module in layers.items()
    }


def layer_table(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Name, type, own parameter bytes and the next child of its ``nn.Sequential`` (`precision_links`)
    of each layer a plan can address."""
    following = sequential_next(model)
    return [
        {
            "name": name,
            "type": type(module).__name__,
            "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters(recurse=False)),
            "next": following[name],
        }
        for name, module in layers_of(model).items()
    ]
