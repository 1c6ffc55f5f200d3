"""What a module's calls do in one step, and which modules can therefore take an activation policy
(recompute or offload): the recorder observes a real step (`CallProbe`) and gives the planner the
refusals (`activation_refusals`, into `Trace.activation_costs["refused"]`); the applier
(`qsync_callback.appliers.torch_activation`) refuses the same modules with the same reasons.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from qsync_callback.lp.swap import _under_mha  # one test of "MultiheadAttention reads it directly"

# --- what a module's calls do ----------------------------------------------------------------------


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value`` and in the tuples, lists and dicts inside it."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def output_problem(value: Any) -> str | None:
    """Why a forward's output ``value`` rules out a policy, or None: anything but a tensor, None, or a
    tuple, list or dict of them (nested too). Other objects may carry state the forward changes,
    which a recompute would change again, and the pricing only knows tensors."""
    if value is None or isinstance(value, torch.Tensor):
        return None
    if isinstance(value, (tuple, list, dict)):
        items = value.values() if isinstance(value, dict) else value
        for item in items:
            problem = output_problem(item)
            if problem is not None:
                return problem
        return None
    return f"its forward returns a {type(value).__name__}, not tensors"


class CallProbe:
    """Count each module's calls, and note what rules a module out, over the forward passes run
    inside ``with CallProbe(model) as probe:`` (one training step: ``probe.calls`` is then the
    ``calls_per_step`` of `activation_refusals`, ``probe.problems`` its ``call_problems``).

    Forward pre- and post-hooks on every module but the root, named by their first name: the
    output is checked by `output_problem`, and a tensor argument whose version counter moved
    during the call was changed in place (a recompute would run on the changed input)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.calls: dict[str, int] = {}
        self.problems: dict[str, str] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._versions: dict[str, list[list[tuple[torch.Tensor, int]]]] = {}

    def __enter__(self) -> CallProbe:
        for name, module in self.model.named_modules():
            if name:
                self.calls.setdefault(name, 0)
                self._handles.append(module.register_forward_pre_hook(self._before(name), with_kwargs=True))
                self._handles.append(
                    module.register_forward_hook(self._after(name), with_kwargs=True, always_call=True)
                )
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.calls[name] = self.calls.get(name, 0) + 1
            versions = [(t, t._version) for t in _tensors((args, kwargs))]
            self._versions.setdefault(name, []).append(versions)

        return hook

    def _after(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            versions = self._versions[name].pop()
            if any(t._version != version for t, version in versions):
                self.problems.setdefault(name, "its forward changes an input in place")
            problem = output_problem(output)
            if problem is not None:
                self.problems.setdefault(name, problem)

        return hook


# --- which modules can take a policy ---------------------------------------------------------------


def _first_names(model: nn.Module) -> dict[int, str]:
    """Each module's first name (as `layers_of` and the recorder name it), by id."""
    return {id(module): name for name, module in model.named_modules()}


def activation_refusals(
    model: nn.Module,
    names: Iterable[str],
    calls_per_step: Mapping[str, int] | None = None,
    call_problems: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Why each of ``names`` cannot take a recompute or offload policy; a name absent can.

    Seen on the module: not a module of ``model``; the model itself (its forward is the whole
    step's); a forward already replaced on the instance (by another wrapper: it could not be
    restored exactly); ``inplace=True`` (ReLU, Dropout, ...: it changes its input, which a recompute
    reads again: backward fails); a child of ``nn.MultiheadAttention``, which reads its weights
    instead of calling it (a policy would never run). Seen on a step, where the caller gives it
    (keyed by first names, as `layers_of` names layers): ``calls_per_step`` of 0 (a policy changes
    nothing) or more than one (the pricing and the prefetch order assume one call); a
    ``call_problems`` entry (`CallProbe`: an output that is not tensors, an input changed in
    place). Aliases of a module are looked up under its first name."""
    modules = dict(model.named_modules(remove_duplicate=False))
    first = _first_names(model)
    calls = calls_per_step or {}
    problems = call_problems or {}
    refusals: dict[str, str] = {}
    for name in names:
        module = modules.get(name)
        if module is None:
            refusals[name] = "not a module of the model"
            continue
        canonical = first[id(module)]
        count = calls.get(canonical)
        if module is model:
            refusals[name] = "the model itself: a policy applies to a module inside it"
        elif "forward" in module.__dict__:
            refusals[name] = "its forward is already replaced on the instance (another wrapper)"
        elif getattr(module, "inplace", False) is True:
            refusals[name] = (
                "it changes its input in place (inplace=True), which a recompute would read again"
            )
        elif _under_mha(model, module):
            refusals[name] = (
                "nn.MultiheadAttention reads its weights instead of calling it: a policy never runs"
            )
        elif count == 0:
            refusals[name] = "it is not called in a step: a policy changes nothing"
        elif count is not None and count > 1:
            refusals[name] = f"it is called {count} times per step"
        elif canonical in problems:
            refusals[name] = problems[canonical]
    return refusals
