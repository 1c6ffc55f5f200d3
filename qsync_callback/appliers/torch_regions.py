"""Carry out a plan's compiled regions on a live torch model: each named module compiled in place.

For torch, a region (`Plan.fused_regions`) is a list holding exactly one module name, as
``named_modules()`` names it: a layer (``blocks.0.fc1``) or a block holding layers (``blocks.0``),
never the whole model (``""``: compile the model itself with ``torch.compile`` for that). The
applier compiles each module in place, the way ``nn.Module.compile()`` does: it sets the module's
``_compiled_call_impl``, which ``nn.Module.__call__`` runs instead of ``_call_impl``. The parameters,
the state-dict keys, the optimizer and DDP are untouched; the undo puts back what was there (no
instance attribute), so the module runs eagerly again, exactly as before.

What is compiled, and why not ``Module.compile()`` itself (torch 2.13, measured here):

- ``Module.compile()`` compiles ``self._call_impl``; dynamo skips that frame (torch.nn is in its
  skip files) and starts at the first frame it may trace: the module's ``forward`` if its class is
  the user's, nothing at all for torch's own modules (``nn.Linear``, ``nn.Sequential``,
  ``nn.LayerNorm``: no graph, the calls stay eager, silently). So each region's call goes through a
  function of this file (`_region_call`: the module's whole ``_call_impl``, its hooks and forward),
  which dynamo traces, inlining torch's modules as it does inside a user's forward.
- ``torch.compile`` keeps its compiled code per code object, and at most
  ``torch._dynamo.config.recompile_limit`` (8; ``cache_size_limit`` is the same setting) entries per
  code object. One entry function for every region would put every module class on one code
  object: a ninth class would find the limit reached. So each module class gets its own copy of the
  entry function (a code object of its own, named ``qsync_region_<class>``), kept for the applier's
  life, and one backend object serves every region: structurally identical modules (one class, the
  same parameter shapes; dynamo guards on the class, the parameters are graph inputs) run one
  compiled graph, which is compiled once, as in PyTorch's regional compilation recipe; re-applying
  the plan (the loop's turns undo and apply it again) compiles nothing again. A region's stats say
  ``graphs`` 0 when it runs a graph compiled for an identical module before it.
- ``fullgraph=True``: a region is priced as one fused unit, and is one graph or nothing. A graph
  break (``torch._dynamo.graph_break()``, a ``print``, data-dependent control flow on ``.item()``)
  raises ``Unsupported`` when dynamo traces the call, before any of it ran; without it dynamo would
  split the region into graphs run in turn with eager code between them. So a region's call either
  runs exactly one graph, or raises.
- the backward: inductor lowers a backward graph lazily, at the first backward, unless the graph
  has dynamic shapes; a failure there would raise in the user's ``loss.backward()``, where nothing
  can catch it. The backend here has AOTAutograd lower it with the forward
  (``torch._functorch.config.force_non_lazy_backward_lowering``, set only around this applier's
  compiles), so every compile happens inside the guarded call below, and the first call's time is
  the whole compile.

The guard: a region's compiled call that raises (dynamo's ``Unsupported`` for a graph break,
``BackendCompilerFailed``, ``FailOnRecompileLimitHit``, anything else) is run again eagerly on the
same arguments. If the eager call runs, the compiler was at fault: that module alone goes back to
eager for the rest of the plan (its ``_compiled_call_impl`` as before), a message naming it and the
cause is recorded (`RegionApplier.notes`) and warned once, and the step goes on. If the eager call
raises too, the error is the user's own and is raised as it would be without the plan. Dynamo
defers the side effects of the code it traces until the graph runs, so a compile that raised left
nothing done twice; only an error inside a compiled graph that was running can have done part of
its work (in-place updates of buffers are written at the graph's end). One exception is no
failure and passes through: checkpoint's early stop (``_StopRecomputationError``), which a
recompute around the region raises inside it once it has what backward needs.

Calls without grad (validation, inference; Lightning validates under ``inference_mode``) run
eagerly, as the activation applier's do: a plan is chosen and verified on training steps, and an
eval graph would be a compile of its own (seconds with inductor) and an entry toward the limit.

Recompiles (measured): a call whose arguments fail the guards of every compiled entry (a new batch
size, the last partial batch of an epoch) compiles again, inside the same guarded call. With
``dynamic=None`` (the default, used here) the first compile assumes static shapes
(``assume_static_by_default``); the first recompile for a changed size marks that dimension dynamic
(``automatic_dynamic_shapes``) and compiles a graph for any size, so a later batch size compiles
nothing (batch 2 compiled, 3 recompiled dynamic, 5, 7 and 9 reused it). Dynamo remembers the
dimensions it made dynamic for the rest of the process, per code (file, first line, name: here per
module class), so a later applier's first compile of the same class is dynamic at once (a
cross-process memory needs ``torch.compiler.config.job_id``, unset here). Each recompile is counted
and timed in the region's stats, and is no failure. Past the recompile limit, dynamo on its own
would run the frame eagerly and only log a warning; under ``fullgraph=True`` it raises
``FailOnRecompileLimitHit`` instead, so the region goes back to eager alone, with a message, like
any other failed compile.

Module hooks: dynamo does not guard on them (``torch._dynamo.config.skip_nnmodule_hook_guards``,
True). Hooks added to a region's modules after its first compile do not run inside the region: the
recorder's layer ranges are not seen there (the region's ops are its graph's). Hooks present when
it compiles are traced into it, and the recorder's ranges cannot be (``RecordFunctionFast``: a
graph break), so a compile while they are installed fails and sends the region back to eager. The
loop applies a plan at a step boundary and its verify window installs its ranges from its fourth
step, after the regions' first calls; a recompile inside a recorded window (an epoch's last batch
there) still meets them.

What else a region cannot hold (measured; the guard sends it back to eager at its first call): an
LP module at a low precision (``lp.modules._label`` asks ``torch._C._autograd._profiler_enabled()``,
which dynamo does not trace). Compile times on this 2-core CPU: "aot_eager" 0.2 to 0.5 s a region
class (2 s for a process's first); inductor, a small block's forward and backward, 8 to 20 s with
a cold cache, 2 s from inductor's on-disk cache.

Refused before anything changes (QSyncInputError naming each region and why): a region that is
not exactly one name; the whole model; a name that is not a module of the model; a module named
twice (under one name or two: a module registered twice is one module); a region inside another;
a module compiled already, or inside or around one (``module.compile()``); a region holding a
module with an activation policy of this project's activation applier (it runs first in a plan):
torch.compile cannot trace a recompute (its checkpoint's ``context_fn`` restores buffers; dynamo
takes only a pair of ``TorchDispatchMode``) nor an offload (its saved-tensor hooks read
``grad_fn``). A region may sit inside a module with a policy: that module's forward runs eagerly
and calls the compiled region (twice under recompute).
"""

from __future__ import annotations

import re
import time
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch._dynamo
import torch._functorch.config
from torch import nn
from torch.utils.checkpoint import _StopRecomputationError

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan

_ABSENT = object()  # a module with no ``_compiled_call_impl`` of its own (the class's None)
_ACTIVATION_APPLIER = "qsync_callback.appliers.torch_activation"
_POLICIES = {  # the activation applier's wrappers, by name: the policy, and why dynamo refuses it
    "recomputed": (
        "recompute",
        "its checkpoint's context_fn is not the pair of TorchDispatchModes dynamo takes",
    ),
    "offloaded": ("offload", "its saved-tensor hooks read grad_fn, which dynamo does not trace"),
}
_CAUSE_CHARS = 300


def _region_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The frame dynamo compiles for a region: the module's whole call (its hooks and forward)."""
    return module._call_impl(*args, **kwargs)


def _entry_for(cls: type) -> Callable[..., Any]:
    """`_region_call` with a code object of its own, named after ``cls`` (see the module docstring:
    dynamo's compiled code and its recompile limit are per code object)."""
    name = "qsync_region_" + re.sub(r"\W", "_", cls.__qualname__)
    code = _region_call.__code__.replace(co_name=name)
    return types.FunctionType(code, _region_call.__globals__, name)


class _CountingBackend:
    """The backend every region of one applier compiles with: counts each graph for the region
    being called (``active``), then hands it to the named backend, its backward lowered at once."""

    def __init__(self, backend: str):
        self.__name__ = backend  # how dynamo names it in its errors
        self.compile = torch._dynamo.lookup_backend(backend)
        self.active: _Region | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self.active.graphs += 1  # a compile happens only inside a region's call
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            return self.compile(gm, example_inputs)


def _cause(error: BaseException) -> str:
    """An exception in a line: its type and its first two lines (dynamo's say what and why)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if isinstance(error, torch._dynamo.exc.FailOnRecompileLimitHit):  # its own text says only "fullgraph"
        limit = torch._dynamo.config.recompile_limit
        lines = [
            f"the compiled code of its class holds torch._dynamo.config.recompile_limit ({limit}) entries"
        ]
    text = f"{type(error).__name__}: {' '.join(lines[:2])}"
    return text if len(text) <= _CAUSE_CHARS else text[: _CAUSE_CHARS - 3] + "..."


class _Region:
    """One applied region: the guarded compiled call set as its module's ``_compiled_call_impl``,
    and what its calls compiled."""

    def __init__(self, name: str, module: nn.Module, compiled: Callable[..., Any], backend: _CountingBackend):
        self.name = name
        self.module = module
        self.previous = module.__dict__.get("_compiled_call_impl", _ABSENT)
        self.compiled = compiled
        self.backend = backend
        self.graphs = 0  # graphs compiled for it (0 after its first call: it runs an identical one's)
        self.first_call_s: float | None = None
        self.recompile_s: list[float] = []
        self.fallback: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # validation, inference: eager (see the module docstring)
            return self.module._call_impl(*args, **kwargs)
        before, active = self.graphs, self.backend.active
        self.backend.active = self
        start = time.perf_counter()
        cause = None
        try:
            out = self.compiled(self.module, *args, **kwargs)
        except _StopRecomputationError:  # a recompute around the region stops early: its own way
            raise
        except Exception as error:  # noqa: BLE001 - judged by the eager call below
            cause = _cause(error)  # the text only: the traceback holds this call's tensors
        finally:
            self.backend.active = active
        seconds = time.perf_counter() - start
        if cause is not None:
            out = self.module._call_impl(*args, **kwargs)  # raises what the user's code raises
            self._fall_back(cause)
            return out
        if self.first_call_s is None:
            self.first_call_s = seconds
        elif self.graphs > before:
            self.recompile_s.append(seconds)
        return out

    @property
    def in_force(self) -> bool:
        return self.module.__dict__.get("_compiled_call_impl") is self

    def _fall_back(self, cause: str) -> None:
        """Back to eager, this module alone, saying why."""
        self.restore()
        when = "its first call" if self.first_call_s is None else "a later call"
        self.fallback = f"region {self.name!r} rolled back alone to eager: {when} failed to compile ({cause})"
        warnings.warn(f"qsync: {self.fallback}", RuntimeWarning, stacklevel=4)  # the module's caller

    def restore(self) -> None:
        """The module's ``_compiled_call_impl`` as it was before (if it is still this region's)."""
        if self.in_force:
            if self.previous is _ABSENT:
                del self.module._compiled_call_impl
            else:
                self.module._compiled_call_impl = self.previous

    def stats(self) -> dict[str, Any]:
        return {
            "compiled": self.in_force,
            "graphs": self.graphs,
            "first_call_s": self.first_call_s,
            "recompiles": len(self.recompile_s),
            "recompile_s": list(self.recompile_s),
            "eager_fallback": self.fallback,
        }


class RegionApplier:
    """The applier of ``plan.fused_regions`` on ``model`` (`qsync_callback.tuning_loop.Applier`):
    each region's module compiled in place with torch.compile's ``backend`` (see the module
    docstring). `region_stats` and `notes` say what the plan in force compiled and what went back
    to eager."""

    def __init__(self, model: nn.Module, backend: str = "inductor"):
        self.model = model
        try:
            self._backend = _CountingBackend(backend)
        except Exception as error:  # dynamo's InvalidBackend, or a name that is not a string
            known = ", ".join(torch._dynamo.list_backends(exclude_tags=()))
            raise ValueError(
                f"backend: torch.compile has no backend {backend!r} (it has: {known})"
            ) from error
        self._entries: dict[type, Callable[..., Any]] = {}  # per module class, for the applier's life
        self._regions: dict[str, _Region] = {}  # the plan in force's

    def __call__(self, plan: Plan) -> Callable[[], None]:
        chosen = self._check(plan.fused_regions)
        regions = {
            name: _Region(name, module, self._entry(type(module)), self._backend) for name, module in chosen
        }
        for region in regions.values():
            region.module._compiled_call_impl = region
        self._regions.update(regions)

        def undo() -> None:
            for name, region in regions.items():
                region.restore()
                if self._regions.get(name) is region:
                    del self._regions[name]

        return undo

    def _entry(self, cls: type) -> Callable[..., Any]:
        if cls not in self._entries:
            self._entries[cls] = torch.compile(_entry_for(cls), backend=self._backend, fullgraph=True)
        return self._entries[cls]

    def _check(self, regions: Sequence[Sequence[str]]) -> list[tuple[str, nn.Module]]:
        """The modules to compile, by region name; QSyncInputError naming each refused region."""
        modules = dict(self.model.named_modules(remove_duplicate=False))
        reasons: dict[str, str] = {}
        chosen: dict[int, tuple[str, nn.Module]] = {}
        for region in regions:
            label = repr(list(region))
            if len(region) != 1:
                reasons[label] = f"a torch region is exactly one module name, not {len(region)}"
                continue
            name = region[0]
            module = modules.get(name)
            if name == "":
                reasons[label] = "the whole model is no region (compile the model itself for that)"
            elif module is None:
                reasons[label] = "not a module of the model"
            elif id(module) in chosen:
                reasons[label] = f"the same module as the region [{chosen[id(module)][0]!r}]"
            else:
                chosen[id(module)] = (name, module)
        for name, module in chosen.values():
            why = self._refusal(name, module, chosen)
            if why is not None:
                reasons[repr([name])] = why
        if reasons:
            listed = "; ".join(f"{label}: {why}" for label, why in reasons.items())
            raise QSyncInputError(f"fused_regions: cannot compile {listed}; nothing was changed")
        return list(chosen.values())

    def _refusal(
        self, name: str, module: nn.Module, chosen: Mapping[int, tuple[str, nn.Module]]
    ) -> str | None:
        """Why ``module`` (region ``name``) cannot be compiled in place, or None."""
        for _, outer in _ancestors(self.model, name):
            if id(outer) in chosen:
                return f"it is inside the region [{chosen[id(outer)][0]!r}] (regions do not nest)"
        for inner_name, inner in module.named_modules(remove_duplicate=False):
            if inner_name and id(inner) in chosen:
                return f"it holds the region [{chosen[id(inner)][0]!r}] (regions do not nest)"
        compiled = [
            label
            for label, m in (*_ancestors(self.model, name), *_named(name, module))
            if m.__dict__.get("_compiled_call_impl") is not None
        ]
        if compiled:
            return f"{repr(compiled[0]) if compiled[0] else 'the model'} is compiled already (its compile())"
        for inner_name, inner in _named(name, module):
            policy = _activation_policy(inner)
            if policy is not None:
                return (
                    f"{inner_name!r} has the activation policy {policy[0]}, which torch.compile "
                    f"cannot trace ({policy[1]})"
                )
        return None

    def region_stats(self) -> dict[str, dict[str, Any]]:
        """Per region of the plan in force (JSON-ready): ``compiled`` (still compiled), ``graphs``
        (compiled for it; 0 while it runs a graph compiled for an identical module), ``first_call_s``
        (the wall time of its first call, the compile included; None before it), ``recompiles`` and
        ``recompile_s`` (each later call that compiled again, and its wall time), ``eager_fallback``
        (why it went back to eager, or None)."""
        return {name: region.stats() for name, region in self._regions.items()}

    def notes(self) -> list[str]:
        """One line per region of the plan in force that went back to eager alone, saying why."""
        return [region.fallback for region in self._regions.values() if region.fallback is not None]

    def went_back(self) -> dict[str, list[list[str]]]:
        """The regions of the plan in force that went back to eager alone on this rank, under
        their plan field (the loop leaves them out of the plan it keeps; `notes` says why)."""
        regions = [[name] for name, region in self._regions.items() if region.fallback is not None]
        return {"fused_regions": regions} if regions else {}

    def failure(self) -> str | None:
        """None: a region that fails to compile goes back to eager alone and the rest of the plan
        stays in force (`notes` says so); the run never breaks over it, and verify judges the plan
        as it runs, so there is nothing to roll back on every rank."""
        return None


def _named(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module`` and everything inside it, named from the model's root."""
    return [
        (f"{name}.{inner}" if inner else name, m) for inner, m in module.named_modules(remove_duplicate=False)
    ]


def _ancestors(model: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    """The modules around ``name`` on its path from the root (the root first, named ``""``)."""
    parts = name.split(".")
    return [
        (prefix, model.get_submodule(prefix)) for prefix in (".".join(parts[:k]) for k in range(len(parts)))
    ]


def _activation_policy(module: nn.Module) -> tuple[str, str] | None:
    """The activation applier's policy in force on ``module`` (its own ``forward``) and why dynamo
    cannot trace it, or None (another wrapper is compiled, and judged by its first call)."""
    forward = module.__dict__.get("forward")
    if getattr(forward, "__module__", None) != _ACTIVATION_APPLIER:
        return None
    return _POLICIES.get(forward.__name__)
