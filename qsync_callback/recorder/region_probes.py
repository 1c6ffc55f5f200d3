"""Compile a few of the model's own modules during the warm-up, to calibrate the fusion cost model
(`predictor/compiled_regions.py`) on this machine.

`probe_modules` picks at most `MAX_PROBES` modules: the first instance of the model's most repeated
block (a transformer block, a residual block: what a region plan compiles most), and inside it a
layer that runs a library kernel alone (a Linear or a convolution: what compiling a region costs
beyond its kernels) and a normalization layer (one or two fused kernels), each the first of its
kind called in a step. Where no block repeats alike (a CNN whose stages widen), the largest block
(the most layers; of several alike, the first called) stands in for the repeated one: the region a
plan for such a model most likely compiles, measured itself. A smaller block's ratio does not carry
into a larger region: on a CPU inductor runs a region's convolutions channels-last (its layout
optimization), which pays across a stack of convolutions and not across one block, whose input and
output stay in the eager layout. Measured on the ResNet of `benchmarks/models.py` (2026-11-30, two
threads and one): its stack of blocks (``net``) probed at 0.61 and 0.70 times eager, its first
residual block alone at 1.03 and 0.96; in a training loop, eager with the model channels-last
ran its step 32% and 29% faster, as fast as with its stack compiled.

`RegionInputs` keeps a copy of each one's arguments from its first call in a cold step (forward
pre-hooks, removed after that step). Each module runs on its arguments, forward and backward (with
fixed random output gradients), on a deep copy (the live module, its parameters and their gradients
are left alone): as the window closes `compile_probes` compiles each (``torch.compile``, inductor);
once the ranks have met after it, `time_probes` runs each eager and compiled in turns,
`PROBE_PAIRS` pairs: ``eager_us`` is the median eager run and ``compiled_us`` that times the median
of the pairs' ratios (compiled over eager), so the ratio the predictor takes is the pairs' median.
The least of five of each, as timed before, moves far more from draw to draw: 80 pairs in a
process (session 30, a 2-core AMD EPYC without AVX-512), cut into draws, gave the benchmarks'
decoder block 0.93-1.09 over 48 draws of five pairs in three processes and the ResNet's conv stack
0.53-0.83 over 32 in two; the median of ten pairs ranged 0.97-1.02 and 0.70-0.77. A region's
compile time is its first compiled forward and backward less an eager one.

The result is plain JSON (``Trace.compiled_regions["probes"]``)::

    {"blocks.0": {"eager_us": 812.0, "compiled_us": 655.1, "compile_s": 21.4, "graphs": 1},
     "blocks.0.ln1": {"error": "..."}}

A probe that fails (the compiler is missing, the module breaks its graph: ``graphs`` > 1) says so
and calibrates nothing; planning goes on with the model's defaults. Nothing is compiled where the
caller's gate says no region could pay for its compile in the steps left (the integration passes
`compiled_regions.payback_gate`: the recorder does not price).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from operator import truediv
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from qsync_callback.model_layers import blocks_of, layers_of
from qsync_callback.recorder.live_memory import storage_bytes
from qsync_callback.recorder.trace import Trace

MAX_PROBES = 3
PROBE_PAIRS = 11  # eager and compiled runs in turns; odd, so the median is one pair's
_LIBRARY_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._BatchNorm)


def _structure(module: nn.Module) -> tuple:
    """What makes two modules compile to the same code: their class and parameter shapes."""
    return (type(module), tuple((name, tuple(p.shape)) for name, p in module.named_parameters()))


def probe_modules(model: nn.Module) -> list[list[str]]:
    """The modules to compile during the warm-up (see the module docstring), as groups of which the
    first one called is compiled (a Linear inside ``nn.MultiheadAttention`` is never called: its
    weight is); empty if the model has no block holding two layers."""
    blocks = blocks_of(model)
    counts = Counter(_structure(module) for module in blocks.values())
    repeated = [(name, counts[_structure(m)]) for name, m in blocks.items() if counts[_structure(m)] > 1]
    if repeated:
        most = max(times for _, times in repeated)
        group = [next(name for name, times in repeated if times == most)]
    else:
        group = _largest_blocks(blocks)
    if not group:
        return []
    groups = [group]
    for kinds in (_LIBRARY_LAYERS, _NORMS):
        inner = [
            f"{block}.{n}"
            for block in group
            for n, m in blocks[block].named_modules()
            if n and isinstance(m, kinds)
        ]
        if inner:
            groups.append(inner)
    return groups[:MAX_PROBES]


def _largest_blocks(blocks: dict[str, nn.Module]) -> list[str]:
    """The called blocks (an ``nn.ModuleList`` or ``nn.ModuleDict`` never is) holding the most layers,
    two at least, in the model's order; none where no block holds two."""
    containers = (nn.ModuleList, nn.ModuleDict)
    sizes = {name: len(layers_of(m)) for name, m in blocks.items() if not isinstance(m, containers)}
    most = max(sizes.values(), default=0)
    return [name for name, size in sizes.items() if size == most] if most >= 2 else []


class RegionInputs:
    """Keeps a detached copy of the arguments of the first module of each group called, at its first
    call."""

    def __init__(self, model: nn.Module, groups: list[list[str]]):
        modules = dict(model.named_modules())
        self.inputs: dict[str, tuple[tuple, dict]] = {}
        self._taken: set[int] = set()  # the groups with a module called
        self._handles = [
            modules[name].register_forward_pre_hook(self._hook(name, g), with_kwargs=True)
            for g, group in enumerate(groups)
            for name in group
            if name in modules
        ]

    def _hook(self, name: str, group: int) -> Callable[..., None]:
        def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if group not in self._taken:
                self._taken.add(group)
                self.inputs[name] = tree_map(_copy_input, (args, kwargs))

        return keep

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def held_bytes(self, device_type: str) -> dict[int, int]:
        """Bytes of the storages the kept arguments hold on ``device_type``, by data pointer: the
        recorder's, not the run's (`live_memory.live_storages` leaves them out of the run's)."""
        return storage_bytes(tree_leaves(self.inputs), device_type)


def _copy_input(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


def probe_regions(model: nn.Module, inputs: dict[str, tuple[tuple, dict]]) -> dict[str, dict[str, Any]]:
    """Each module's eager and compiled forward+backward time, its compile time and graph count
    (see the module docstring); a probe that raised says why instead."""
    probes, compiled = compile_probes(model, inputs)
    time_probes(probes, compiled)
    return probes


def compile_probes(
    model: nn.Module, inputs: dict[str, tuple[tuple, dict]]
) -> tuple[dict[str, dict[str, Any]], dict[str, CompiledProbe]]:
    """Each module compiled on its arguments: its figures so far (compile time and graph count, or
    why it failed), in ``inputs``' order, and the compiled probes `time_probes` times."""
    modules = dict(model.named_modules())
    probes: dict[str, dict[str, Any]] = {}
    compiled: dict[str, CompiledProbe] = {}
    for name, (args, kwargs) in inputs.items():
        try:
            compiled[name] = CompiledProbe(modules[name], args, kwargs)
            probes[name] = {"compile_s": compiled[name].compile_s, "graphs": compiled[name].graphs}
        except Exception as exc:  # the compiler's own failure is a finding, not the run's
            probes[name] = {"error": _error_text(exc)}
    return probes, compiled


def time_probes(probes: dict[str, dict[str, Any]], compiled: dict[str, CompiledProbe]) -> None:
    """Add each compiled probe's eager and compiled times to its entry in ``probes``. Under DDP the
    recorder calls it once every rank has compiled (the ranks meet between): one rank's compile,
    which takes every core for seconds, would otherwise fall in another's timings."""
    for name, probe in compiled.items():
        try:
            probes[name].update(probe.times())
        except Exception as exc:  # as in `compile_probes`
            probes[name] = {"error": _error_text(exc)}


def _error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class CompiledProbe:
    """One module's eager copy and compiled copy (its first compiled call made, which compiles it),
    run forward and backward on the module's recorded arguments with fixed random output
    gradients."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, kwargs
        self.eager = copy.deepcopy(module)
        self._grads: list[torch.Tensor] | None = None
        graphs = [0]

        # dynamo keeps the backend as long as the module's code: a bound method would keep this
        # probe, its copies and arguments alive with it
        def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            graphs[0] += 1
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)

        self.compiled = torch.compile(copy.deepcopy(module), backend=counting_backend)
        self.step(self.eager)
        first_eager = self.step(self.eager)
        self.compile_s = max((self.step(self.compiled) - first_eager) / 1e6, 0.0)
        self.graphs = graphs[0]

    def step(self, run: nn.Module) -> float:
        """One forward and backward of ``run``, in microseconds."""
        for p in run.parameters():
            p.grad = None
        start = time.perf_counter()
        out = [
            t
            for t in tree_leaves(run(*self.args, **self.kwargs))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if self._grads is None:
            self._grads = [torch.randn_like(t) for t in out]
        if out:
            torch.autograd.backward(out, self._grads)
        return (time.perf_counter() - start) * 1e6

    def times(self) -> dict[str, float]:
        """Eager and compiled in turns, `PROBE_PAIRS` pairs: the median eager run, and that times the
        median of the pairs' ratios (a pair shares the machine's state of the moment, which a least
        or a median of each alone does not)."""
        eager_us, compiled_us = [], []
        for _ in range(PROBE_PAIRS):
            eager_us.append(self.step(self.eager))
            compiled_us.append(self.step(self.compiled))
        return paired_times(eager_us, compiled_us)


def paired_times(eager_us: Sequence[float], compiled_us: Sequence[float]) -> dict[str, float]:
    """A probe's times from runs in turns (pair ``i``: ``eager_us[i]``, then ``compiled_us[i]``): the
    median eager run, and that times the median of the pairs' ratios, compiled over eager."""
    if not eager_us or len(eager_us) != len(compiled_us):
        raise ValueError(f"pairs of runs wanted, not {len(eager_us)} eager and {len(compiled_us)} compiled")
    eager = statistics.median(eager_us)
    return {"eager_us": eager, "compiled_us": eager * statistics.median(map(truediv, compiled_us, eager_us))}


RegionGate = Callable[[Trace, int, list[str]], str | None]  # why not to compile any module, or None


def compiled_region_costs(
    model: nn.Module,
    trace: Trace,
    inputs: dict[str, tuple[tuple, dict]],
    steps_left: int | None,
    called_blocks: list[str],
    gate: RegionGate,
) -> tuple[dict[str, Any], dict[str, CompiledProbe]]:
    """``Trace.compiled_regions``: the steps left, the blocks whose forward ran in the recorded
    steps (a block never called, an ``nn.ModuleList``, is no region), and the probes compiled
    (`compile_probes`: to be timed with `time_probes`, which adds their times), unless ``gate``
    (given the trace, the steps left where known and those blocks) says why no region is worth
    compiling; then a note saying so."""
    out: dict[str, Any] = {"steps_left": steps_left, "called_blocks": called_blocks}
    if not inputs:
        out["note"] = "no block in the model holds two layers: nothing compiled to calibrate on"
        return out, {}
    reason = gate(trace, steps_left, called_blocks) if steps_left is not None else None
    if reason is not None:
        out["note"] = f"{reason}: nothing compiled to calibrate on"
        return out, {}
    out["probes"], compiled = compile_probes(model, inputs)
    return out, compiled
