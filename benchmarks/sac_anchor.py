"""PyTorch's own selective-activation-checkpointing solver, the anchor of the memory-plan benchmark
(issue 13, part 5): ``torch.distributed._tools.sac_estimator`` and ``sac_ilp`` over one training step
of a model on CPU, their answer in our plan's vocabulary, and an applier for their own op-level policy.

**How it runs** (the pipeline of torch's own tests of ``sac_ilp``). A copy of the model whose
parameters and buffers are fake tensors (``FakeTensorMode``, which ``SACEstimator`` and
``RuntimeEstimator`` require: they refuse to enter without it) runs the step (``loss_fn``, backward,
the optimizer's step) under ``MemTracker`` twice, the first to create the optimizer state; then once
under ``RuntimeEstimator``; then its forward under ``SACEstimator``. ``ilp_utils.aggregate_stats`` and
``parse_module_info`` build the module graph, and ``sac_milp`` solves it for the budget.

**What CPU lacks, and what stands in** (both named in each result's ``measurement``):

- torch's two runtime-estimate modes need CUDA. ``operator-level-cost-model`` (the roofline) asserts
  ``torch.cuda.is_available()``; ``operator-level-benchmark`` times each op with ``torch.cuda.Event``,
  which a CPU build cannot make ("Tried to instantiate dummy base class Event").
  `torch_estimator_errors` probes both on one fake matmul. Inside the estimators, the exception is
  raised for the first op, ``prim.device``, from C++, and the process aborts ("terminate called after
  throwing an instance of 'python_error'"). Standing in: `CpuOpTimer`, torch's benchmark mode with
  ``time.perf_counter`` in place of the CUDA events.
- ``SACEstimator`` fits its trade-off curves with the ``pwlf`` package. That package is not
  installed here, and the project's extras do not include it. Where it is missing, a least-squares
  stand-in (`PiecewiseLinFit`) is registered under that name while the graph is built, so torch's
  code runs unchanged.

**The budget.** ``sac_milp`` takes its budget in GiB (it divides every byte count by 2**30). The
budget covers what its model counts: the root's parameters, the gradients so far, and, at each
module's backward, the activations alive and the activation gradients. It leaves out optimizer
state, buffers, the batch, and the optimizer step. ``memory_budget_bytes`` is a peak of the whole
step, and it is converted in three parts:

1. Into ``MemTracker``'s accounting (bytes of tensor storages by kind, the accounting sac_ilp's
   stats come from). Where the caller gives its own measured peak of the unchanged step
   (``measured_peak_bytes``), the budget is shifted by ``tracked - measured``.
2. From the whole step to sac_milp's model: minus the offset ``fwd_bwd_peak - model_baseline_peak``.
   ``fwd_bwd_peak`` is MemTracker's peak over the second step's forward and backward.
   ``model_baseline_peak`` is sac_milp's own model of it with no recomputation
   (``get_peak_memory_runtime_baseline``). The offset is what the model leaves out, less what it
   over-counts; it is taken as constant.
3. A budget below the optimizer step's peak is refused before sac_milp is asked, because
   recomputation cannot lower that peak.

A plan's predicted peak of the step is ``max(model peak + offset, optimizer peak)``, back in the
caller's accounting. The model peak comes from evaluating sac_milp's own constraints at the plan
(`modelled_peak_bytes`). The peak sac_milp returns is only an upper bound: its ``max_m`` is not
minimised, so it can land anywhere up to the budget. That bound is kept as ``milp_peak_bound_bytes``.

**Whole modules.** ``sac_milp`` picks AC units (modules; never leaves, never nested). For each unit
it picks ``r``, the share of the unit's activation memory to discard op by op. Our recompute applier
checkpoints whole modules, so the projection (``SacResult.recompute``) recomputes every AC unit
whole. That discards everything the module saved (``r = 1`` in sac_milp's model), at least what
sac_milp asked for, so the budget it met still holds in its model. In exchange, the module's whole
forward runs again, not sac_milp's predicted share of it. Both plans are priced in sac_milp's model:
``predicted_*`` for its own plan, ``whole_module_*`` for the projection. The model's root is not a
candidate (``ac_units`` leaves it out): a plan names modules below the model.

**Op level.** For each AC unit, ``get_optimal_checkpointing_policy_per_module(stats, 1 - r)`` picks
which of its ops to save (its budget is the share kept), giving ``SacResult.op_policies``.
`apply_sac_op_policy` carries this out with non-reentrant ``checkpoint`` and
``create_selective_checkpoint_contexts``. It matches the module's ops in forward order, by name,
against the list SACEstimator recorded. An op out of step with that list is saved and counted.
Where the per-module solver finds no policy, every op is recomputed. This happens at ``r = 1`` when
an op it must save leaves no room. SAC caches an in-place op's output before the op bumps the
tensor's version. torch's check ("Tensor cached during selective activation checkpoint has been
mutated") therefore fires at every in-place op the policy saves, and sac_ilp must save the in-place
ops that are their own parents (batch norm's ``num_batches_tracked += 1``). So the contexts allow
cache-entry mutation; tests/test_sac_anchor.py checks that gradients stay bit-identical. As in any
checkpoint, a recomputed batch-norm op updates its running statistics a second time.

Op times are measured on a shared CPU, so a plan can differ from run to run where two choices
cost nearly the same.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import io
import logging
import logging.handlers
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools import sac_ilp
from torch.distributed._tools.ilp_utils import (
    Graph,
    aggregate_stats,
    get_peak_memory_runtime_baseline,
    parse_module_info,
)
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.runtime_estimator import RuntimeEstimator
from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP, SACEstimator, SACStats
from torch.utils._mode_utils import no_dispatch
from torch.utils._runtime_estimation import _IGNORE_OPS
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from qsync_callback.units import format_bytes

TORCH_ESTIMATOR_MODES = ("operator-level-cost-model", "operator-level-benchmark")
CPU_ESTIMATOR = "cpu-benchmark: torch's operator-level-benchmark timed with time.perf_counter"
GIB = 2**30  # sac_milp's unit for budgets (its MEM_MULTIPLIER)
RECOMPUTE = "recompute"  # the activation policy our plans name


def torch_estimator_errors() -> dict[str, str]:
    """For each of torch's runtime-estimate modes, what its estimate raises on one fake matmul on this
    machine ("ExceptionType: message"); "" where it runs."""
    fake_mode = FakeTensorMode()
    with fake_mode:
        a, b = torch.ones(4, 8), torch.ones(8, 4)
    RuntimeEstimator.fake_mode = fake_mode  # read by the estimates; their estimator's __enter__ sets it
    errors = {}
    for mode in TORCH_ESTIMATOR_MODES:
        try:
            with fake_mode:
                RuntimeEstimator()(mode)._estimate(torch.ops.aten.mm.default, (a, b), {})
            errors[mode] = ""
        except Exception as exc:
            errors[mode] = f"{type(exc).__name__}: {exc}"
    return errors


class CpuOpTimer:
    """Runtime estimates for torch's estimators on CPU: torch's ``operator-level-benchmark`` mode
    with ``time.perf_counter`` for its CUDA events. Each op is run on real CPU tensors shaped like
    its fake inputs (random floats, ones for other dtypes), 2 warm-up and 3 timed runs (torch's
    counts), and its estimate is the mean in ms. View and tensor-creation ops count 0, as in torch.
    An op that fails on such inputs counts 0 and is listed in ``untimed``."""

    WARMUP_RUNS, TIMED_RUNS = 2, 3

    def __init__(self) -> None:
        self.untimed: set[str] = set()

    def estimate(self, func: Any, args: Any, kwargs: Any) -> tuple[Any, float]:
        """(``func``'s fake result, its measured time in ms), the contract of torch's estimates."""
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket in _IGNORE_OPS or torch.Tag.inplace_view in func.tags:
            return out, 0.0
        flat, spec = pytree.tree_flatten((args, kwargs))
        with no_dispatch():
            try:
                real_args, real_kwargs = pytree.tree_unflatten([_real_like(a) for a in flat], spec)
                for _ in range(self.WARMUP_RUNS):
                    func(*real_args, **real_kwargs)
                start = time.perf_counter()
                for _ in range(self.TIMED_RUNS):
                    func(*real_args, **real_kwargs)
                return out, (time.perf_counter() - start) / self.TIMED_RUNS * 1e3
            except Exception:
                self.untimed.add(str(func))
                return out, 0.0


def _real_like(value: Any) -> Any:
    if not isinstance(value, FakeTensor):
        return value
    if value.dtype.is_floating_point:
        return torch.rand_like(value, device=value.fake_device)
    return torch.ones_like(value, device=value.fake_device)


class PiecewiseLinFit:
    """The part of ``pwlf.PiecewiseLinFit`` that ``SACEstimator`` uses: a continuous piecewise-linear
    least-squares fit of y on x with 1 or 2 segments (torch asks for at most 2). The breakpoint of 2
    segments is the best of 400 evenly spaced between the ends (pwlf optimises it by differential
    evolution). After `fit`: ``fit_breaks`` (the ends and the breakpoint), `calc_slopes`, and
    ``intercepts`` (each segment's line at x = 0)."""

    BREAKPOINT_CANDIDATES = 400

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
        self.fit_breaks = self.slopes = self.intercepts = np.empty(0)

    def fit(self, n_segments: int) -> np.ndarray:
        if n_segments not in (1, 2):
            raise ValueError(f"this stand-in for pwlf fits 1 or 2 segments, not {n_segments}")
        low, high = self.x.min(), self.x.max()
        inner = np.linspace(low, high, self.BREAKPOINT_CANDIDATES + 2)[1:-1]
        candidates = [inner[:0]] if n_segments == 1 else [inner[i : i + 1] for i in range(len(inner))]
        _, breaks, coef = min((self._lstsq(c) for c in candidates), key=lambda fit: fit[0])
        self.fit_breaks = np.concatenate([[low], breaks, [high]])
        self.slopes = np.cumsum(coef[1:])
        at_breaks = self._basis(self.fit_breaks, breaks) @ coef
        self.intercepts = at_breaks[:-1] - self.slopes * self.fit_breaks[:-1]
        return self.fit_breaks

    def calc_slopes(self) -> np.ndarray:
        return self.slopes

    def _lstsq(self, breaks: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        basis = self._basis(self.x, breaks)
        coef = np.linalg.lstsq(basis, self.y, rcond=None)[0]
        return float(((basis @ coef - self.y) ** 2).sum()), breaks, coef

    @staticmethod
    def _basis(x: np.ndarray, breaks: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones_like(x), x, *(np.maximum(0.0, x - b) for b in breaks)])


@contextlib.contextmanager
def _pwlf_importable() -> Iterator[str]:
    """``pwlf`` importable for the duration: the installed package, else `PiecewiseLinFit` under its
    name; yields which."""
    if importlib.util.find_spec("pwlf") is not None:
        yield "pwlf"
        return
    stand_in = types.ModuleType("pwlf")
    stand_in.PiecewiseLinFit = PiecewiseLinFit  # type: ignore[attr-defined]
    sys.modules["pwlf"] = stand_in
    try:
        yield "least-squares stand-in for pwlf (not installed)"
    finally:
        del sys.modules["pwlf"]


class SacAnchorError(RuntimeError):
    """torch's tools could not measure the step or build its graph; the message says at which stage."""


@contextlib.contextmanager
def _stage(name: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        raise SacAnchorError(f"{name} failed: {type(exc).__name__}: {exc}") from exc


@dataclass
class SacStats:
    """What torch's tools measured of one training step. The byte counts are in MemTracker's
    accounting of the second step: the peak over its forward and backward, the peak over its
    optimizer step, and sac_milp's model of the first with no recomputation."""

    graph: Graph
    sac_stats: dict[str, SACStats]  # per module that has children (graph names), for op policies
    fwd_bwd_peak_bytes: int
    optimizer_peak_bytes: int
    model_baseline_peak_bytes: int
    baseline_compute_ms: float  # the step's forward and backward, as the estimator timed them
    estimator: str
    torch_estimator_errors: dict[str, str]
    tradeoff_fit: str
    untimed_ops: list[str]
    collect_s: float

    @property
    def tracked_peak_bytes(self) -> int:
        return max(self.fwd_bwd_peak_bytes, self.optimizer_peak_bytes)

    @property
    def root(self) -> str:
        """The model's name in the graph (its class name); modules are ``root.<named_modules name>``."""
        return self.graph.nodes[0]["fqn"]

    def summary(self) -> dict[str, Any]:
        """The measurement as plain JSON-ready values (the graph left out)."""
        return {
            "tracked_peak_bytes": self.tracked_peak_bytes,
            "fwd_bwd_peak_bytes": self.fwd_bwd_peak_bytes,
            "optimizer_peak_bytes": self.optimizer_peak_bytes,
            "model_baseline_peak_bytes": self.model_baseline_peak_bytes,
            "baseline_compute_ms": self.baseline_compute_ms,
            "estimator": self.estimator,
            "torch_estimator_errors": self.torch_estimator_errors,
            "tradeoff_fit": self.tradeoff_fit,
            "untimed_ops": self.untimed_ops,
            "collect_s": self.collect_s,
        }


def lightning_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A LightningModule's training loss on ``batch``: ``training_step(batch, 0)``."""
    return model.training_step(batch, 0)


def lightning_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """A LightningModule's optimizer (``configure_optimizers`` returning one optimizer)."""
    return model.configure_optimizers()


def collect_sac_stats(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
) -> SacStats:
    """Run torch's MemTracker, RuntimeEstimator and SACEstimator over training steps of a fake copy
    of ``model`` on ``batch``, the step being ``loss_fn(model, batch).backward()``, then the step of
    ``make_optimizer(model)``'s optimizer (without one, the gradients are dropped). ``model`` is
    not changed. Raises `SacAnchorError` naming the stage that failed."""
    start = time.perf_counter()
    timer = CpuOpTimer()
    with _stage("copying the model to fake tensors"):
        fake_mode = FakeTensorMode()
        fakes = {id(t): fake_mode.from_tensor(t) for t in (*model.parameters(), *model.buffers())}
        fake_model = copy.deepcopy(model, fakes)
        fake_batch = pytree.tree_map_only(torch.Tensor, fake_mode.from_tensor, batch)
    # RuntimeEstimator prints its total on exit.
    with fake_mode, contextlib.redirect_stdout(io.StringIO()):
        optimizer = make_optimizer(fake_model) if make_optimizer else None

        def forward_backward() -> None:
            loss_fn(fake_model, fake_batch).backward()

        def optimizer_step() -> None:
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()
            else:
                fake_model.zero_grad()

        # Each entry into MemTracker starts its peak afresh from what is alive.
        mem_tracker = MemTracker()
        with _stage("the step under MemTracker"):
            mem_tracker.track_external(fake_model, optimizer, fake_batch)
            with mem_tracker:
                forward_backward()
                optimizer_step()
            mem_tracker.reset_mod_stats()
            with mem_tracker:
                forward_backward()
                fwd_bwd_peak = _total_bytes(mem_tracker.get_tracker_snapshot("peak"))
            with mem_tracker:
                optimizer_step()
                optimizer_peak = _total_bytes(mem_tracker.get_tracker_snapshot("peak"))
        with _stage("the step under RuntimeEstimator"):
            runtime_estimator = RuntimeEstimator()(TORCH_ESTIMATOR_MODES[1])
            runtime_estimator._estimate = timer.estimate
            with runtime_estimator:
                forward_backward()
                optimizer_step()
        with _stage("the forward under SACEstimator"):
            sac_estimator = SACEstimator()(TORCH_ESTIMATOR_MODES[1])
            sac_estimator._estimate_runtime = timer.estimate
            with sac_estimator:
                loss = loss_fn(fake_model, fake_batch)
            loss.backward()
        with _stage("building the module graph"), _pwlf_importable() as tradeoff_fit:
            root = runtime_estimator.mod_fw_pre_order[0]
            calls = Counter(runtime_estimator.mod_fw_pre_order)
            repeated = sorted(fqn.removeprefix(root + ".") for fqn, count in calls.items() if count > 1)
            if repeated:
                raise ValueError(
                    f"module(s) {', '.join(repeated)} ran more than once in the step's forward; sac_ilp's "
                    "graph has each module once"
                )
            info = aggregate_stats(
                fake_model, mem_tracker, runtime_estimator, sac_estimator, torch.device("cpu")
            )
            graph = parse_module_info(info)
    model_peak, compute_ms = get_peak_memory_runtime_baseline(graph)
    return SacStats(
        graph=graph,
        sac_stats=dict(sac_estimator.sac_mod_stats),
        fwd_bwd_peak_bytes=fwd_bwd_peak,
        optimizer_peak_bytes=optimizer_peak,
        model_baseline_peak_bytes=model_peak,
        baseline_compute_ms=compute_ms,
        estimator=CPU_ESTIMATOR,
        torch_estimator_errors=torch_estimator_errors(),
        tradeoff_fit=tradeoff_fit,
        untimed_ops=sorted(timer.untimed),
        collect_s=time.perf_counter() - start,
    )


def _total_bytes(snapshot: Mapping[torch.device, Mapping[str, int]]) -> int:
    return sum(per_device["Total"] for per_device in snapshot.values())


@dataclass(frozen=True)
class OpPolicy:
    """sac_ilp's op-level policy for one module: its ops in forward order, as SACEstimator lists
    them (ops it skips left out), and whether each is saved (else recomputed)."""

    ops: list[str]
    save: list[bool]


@dataclass
class SacResult:
    """sac_milp's answer for one budget, in our plan's vocabulary, with what it predicted. Bytes are
    in the caller's accounting (that of ``measured_peak_bytes`` where given, else MemTracker's).

    ``recompute`` is the whole-module projection ({named_modules name: "recompute"}); ``discard`` is
    sac_milp's own answer (share of each AC unit's activation memory discarded) and ``op_policies``
    its op-level policy. Where it does not fit, ``reason`` says why, ``lowest_peak_bytes`` is the
    lowest peak of the step sac_milp's model reaches and ``closest_discard`` the plan reaching it.
    sac_milp rounds each share to 4 decimals, so a plan's predicted peak can exceed the budget by a
    few hundred bytes.
    """

    budget_bytes: int
    fits: bool
    reason: str = ""
    recompute: dict[str, str] = field(default_factory=dict)
    discard: dict[str, float] = field(default_factory=dict)
    op_policies: dict[str, OpPolicy] = field(default_factory=dict)
    predicted_peak_bytes: int | None = None
    predicted_recompute_ms: float | None = None
    whole_module_peak_bytes: int | None = None
    whole_module_recompute_ms: float | None = None
    milp_budget_bytes: int | None = None
    milp_peak_bound_bytes: int | None = None
    offset_bytes: int | None = None  # fwd_bwd_peak - model_baseline_peak (module docstring, step 2)
    to_tracker_bytes: int = 0  # tracked - measured peak: added to the budget for MemTracker's accounting
    lowest_peak_bytes: int | None = None
    closest_discard: dict[str, float] = field(default_factory=dict)
    solve_s: float = 0.0
    solver_log: list[str] = field(default_factory=list)
    measurement: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The result as plain JSON-ready values."""
        return asdict(self)


def sac_recompute_plan(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    memory_budget_bytes: int,
    *,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    measured_peak_bytes: int | None = None,
) -> SacResult:
    """torch's sac_ilp plan for ``model``'s training step under a budget for the step's peak
    (`collect_sac_stats`, then `solve_sac_plan`). Where torch's tools cannot measure the step, the
    result does not fit and its reason names the stage and the exception."""
    try:
        stats = collect_sac_stats(model, batch, loss_fn, make_optimizer)
    except SacAnchorError as exc:
        return SacResult(budget_bytes=memory_budget_bytes, fits=False, reason=str(exc))
    return solve_sac_plan(stats, memory_budget_bytes, measured_peak_bytes)


def solve_sac_plan(
    stats: SacStats, memory_budget_bytes: int, measured_peak_bytes: int | None = None
) -> SacResult:
    """Solve ``sac_milp`` on ``stats`` for a budget of the step's peak, converted as the module
    docstring says. ``measured_peak_bytes``: the caller's own measured peak of the unchanged step,
    in whose accounting the budget and the returned peaks are."""
    graph = stats.graph
    to_tracker = stats.tracked_peak_bytes - measured_peak_bytes if measured_peak_bytes is not None else 0
    offset = stats.fwd_bwd_peak_bytes - stats.model_baseline_peak_bytes
    milp_budget = memory_budget_bytes + to_tracker - offset
    candidates = [node["fqn"] for node in graph.nodes[1:]]  # below the root

    def step_peak(discard: Mapping[str, float]) -> int:
        return max(modelled_peak_bytes(graph, discard) + offset, stats.optimizer_peak_bytes) - to_tracker

    result = SacResult(
        budget_bytes=memory_budget_bytes,
        fits=False,
        milp_budget_bytes=milp_budget,
        offset_bytes=offset,
        to_tracker_bytes=to_tracker,
        measurement=stats.summary(),
    )
    start = time.perf_counter()
    with _captured_log(result.solver_log):
        if memory_budget_bytes + to_tracker < stats.optimizer_peak_bytes:
            result.reason = (
                f"the optimizer step's peak ({format_bytes(stats.optimizer_peak_bytes - to_tracker)}) is "
                f"above the budget ({format_bytes(memory_budget_bytes)}); recomputation cannot lower it, "
                "so sac_milp was not asked"
            )
        else:
            discard, recompute_ms, bound = sac_ilp.sac_milp(graph, milp_budget / GIB, ac_units=candidates)
            result.milp_peak_bound_bytes = bound
            if bound >= 0:
                result.fits = True
                result.discard = {_module_name(stats, fqn): share for fqn, share in discard.items()}
                result.recompute = dict.fromkeys(result.discard, RECOMPUTE)
                result.predicted_peak_bytes = step_peak(discard)
                result.predicted_recompute_ms = recompute_ms
                result.whole_module_peak_bytes = step_peak(dict.fromkeys(discard, 1.0))
                result.whole_module_recompute_ms = sum(graph.name2node[f]["sac_runtime"] for f in discard)
                result.op_policies = _op_policies(stats, discard, result.solver_log)
            else:
                result.reason = (
                    f"sac_milp found no plan for {format_bytes(milp_budget)} of its model "
                    f"({format_bytes(memory_budget_bytes)} for the step)"
                )
        if not result.fits:
            closest = _closest_plan(graph, candidates, stats.model_baseline_peak_bytes)
            result.closest_discard = {_module_name(stats, fqn): share for fqn, share in closest.items()}
            result.lowest_peak_bytes = step_peak(closest)
            result.reason += (
                f"; the lowest peak of the step sac_milp reaches is {format_bytes(result.lowest_peak_bytes)}"
            )
    result.solve_s = time.perf_counter() - start
    return result


def modelled_peak_bytes(graph: Graph, discard: Mapping[str, float]) -> int:
    """The peak of sac_milp's memory model (world size 1) with AC units ``discard`` (graph name ->
    share r of its activation memory discarded): the largest m_i over modules, where
    m_i = act_total_i + act_grad_i - (discards of the modules whose forward ended before i's)
    + root parameters + gradients so far, and a unit discards sac_memory * r - (sac_memory - act_fw)."""
    discarded = [
        node["sac_memory"] * discard[node["fqn"]] - (node["sac_memory"] - node["act_fw_per_module"])
        if node["fqn"] in discard
        else 0.0
        for node in graph.nodes
    ]
    params = graph.nodes[0]["param_per_module"]
    peak = 0.0
    for node in graph.nodes:
        ended_before = graph.fw_post_order[: node["pos_fw_post_order"]]
        activations = node["act_total"] + node["act_grad_per_module"]
        activations -= sum(discarded[graph.name2node[fqn]["index"]] for fqn in ended_before)
        peak = max(peak, activations + params + node["grad_total"])
    return round(peak)


def _closest_plan(graph: Graph, candidates: list[str], model_baseline_peak: int) -> dict[str, float]:
    """sac_milp's plan at the lowest budget it solves, to 1% of the baseline (bisection: a budget
    it solves stays solvable when raised). The baseline itself is solved with no recomputation."""
    low, high = 0, model_baseline_peak + 1
    plan: dict[str, float] = {}
    while high - low > model_baseline_peak / 100:
        middle = (low + high) // 2
        discard, _, bound = sac_ilp.sac_milp(graph, middle / GIB, ac_units=candidates)
        if bound >= 0:
            high, plan = middle, discard
        else:
            low = middle
    return plan


def _op_policies(stats: SacStats, discard: Mapping[str, float], log: list[str]) -> dict[str, OpPolicy]:
    """get_optimal_checkpointing_policy_per_module for each AC unit, keeping 1 - r of its memory.
    Where it finds none (at r = 1 an op it must save, such as batch norm's in-place counter, leaves
    no room), every op is recomputed: plain checkpointing, what r = 1 asks for."""
    policies = {}
    for fqn, share in discard.items():
        module_stats = stats.sac_stats[fqn]
        keep = max(0.0, 1.0 - share)
        save = sac_ilp.get_optimal_checkpointing_policy_per_module(module_stats, keep)
        if not save:
            log.append(
                f"get_optimal_checkpointing_policy_per_module found no op policy for {fqn} keeping "
                f"{keep:.0%} of its memory; every op of it is recomputed (plain checkpointing)"
            )
            save = [0] * len(module_stats.func_names)
        policies[_module_name(stats, fqn)] = OpPolicy(list(module_stats.func_names), [bool(s) for s in save])
    return policies


def _module_name(stats: SacStats, fqn: str) -> str:
    """A graph name ("ResNet.net.3") as ``named_modules`` names it ("net.3")."""
    return fqn.removeprefix(stats.root + ".")


@contextlib.contextmanager
def _captured_log(lines: list[str]) -> Iterator[None]:
    """sac_ilp's log records (infeasible solves, its corrections of the stats) into ``lines``
    instead of the console."""
    logger = logging.getLogger(sac_ilp.__name__)
    handler = logging.handlers.BufferingHandler(capacity=10**6)
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        lines.extend(record.getMessage() for record in handler.buffer)


@dataclass
class AppliedSacPolicy:
    """Op-level SAC policies in place. `undo` puts the modules' own forwards back.
    ``mismatched_ops`` counts, per module, the ops its forwards ran out of step with the recorded
    list; those ops were saved."""

    undo: Callable[[], None]
    mismatched_ops: Counter[str]


def apply_sac_op_policy(model: nn.Module, op_policies: Mapping[str, OpPolicy]) -> AppliedSacPolicy:
    """Run each named module's forward under non-reentrant ``checkpoint`` with its op policy
    (``create_selective_checkpoint_contexts``): the n-th op of the forward, not counting ops
    SACEstimator skips (left to recompute), is saved or recomputed as the policy's n-th, when the
    names match. Refuses, changing nothing, a name that is not a module of ``model``."""
    modules = dict(model.named_modules())
    missing = sorted(set(op_policies) - set(modules))
    if missing:
        raise ValueError(f"no module named {', '.join(missing)} in the model")
    mismatched: Counter[str] = Counter()
    own_forwards = {name: modules[name].__dict__.get("forward") for name in op_policies}
    for name, policy in op_policies.items():
        modules[name].forward = _selectively_checkpointed(modules[name].forward, policy, name, mismatched)

    def undo() -> None:
        for name, forward in own_forwards.items():
            if forward is None:
                del modules[name].forward
            else:
                modules[name].forward = forward

    return AppliedSacPolicy(undo, mismatched)


def _selectively_checkpointed(
    forward: Callable[..., Any], policy: OpPolicy, name: str, mismatched: Counter[str]
) -> Callable[..., Any]:
    def context_fn() -> tuple[Any, Any]:
        position = 0

        def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            nonlocal position
            if op in OPS_TO_ALWAYS_SKIP:
                return CheckpointPolicy.PREFER_RECOMPUTE
            index, position = position, position + 1
            if index < len(policy.ops) and op._overloadpacket.__name__ == policy.ops[index]:
                return CheckpointPolicy.MUST_SAVE if policy.save[index] else CheckpointPolicy.PREFER_RECOMPUTE
            mismatched[name] += 1
            return CheckpointPolicy.MUST_SAVE

        return create_selective_checkpoint_contexts(policy_fn, allow_cache_entry_mutation=True)

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return checkpointed
