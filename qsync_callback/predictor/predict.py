"""Predict step time and peak memory of a plan from recorded traces: the predictor's entry point.

Step time: each recorded step position is built into a global graph (all ranks joined through
their collectives) and replayed; the recorded configuration's prediction is the median of the
replayed steps, a plan's that median plus the median over the steps of the plan's change on each
(`_paired`). Peak memory: the liveness model of each rank (`memory.py`); the prediction is the
largest rank's peak.

A plan is priced as changes to the recorded graph and liveness: per-layer precision
(`precision.py`: changed op durations and extra tensors on the graphs compiled once, with no copy)
per-op-type precision (`op_precision.py`: transformed copies of the graphs, their step calibrated on
the bf16 probe's timed calls of TF's uniform rewrite, `_on_rewrite_calls`, and their peak on its
allocator readings), and
per-module activation policies (`activation.py`: recompute and offload, as added op time on the same
compiled graphs and synthetic tensors), and compiled regions (`compiled_regions.py`: the fusion
cost model's durations on copies of the graphs; time only, on torch traces). A plan with decisions
this version cannot price (regions on a TF trace, activation policies beside fusion or regions) is
refused with a message naming them, never silently priced as if empty. Tensor fusion
(Horovod's ``communication``: fusion threshold and cycle time, and ``buckets``: gradient groups;
DDP's ``buckets``) is priced by regrouping the recorded all-reduces (`tensor_fusion.py`, time only)
on traces with Horovod's timeline records or DDP's buckets; on others it is refused, saying what
is missing. On such Horovod traces every plan but the recorded configuration is priced through the
model of Horovod's loop, at the recorded settings where the plan sets none, so that a plan with
gradient groups and one without differ by the groups alone; the loop is priced at each phase of its
first cycle (`tensor_fusion.CYCLE_PHASES`) and a step is their mean. glibc malloc's thresholds
fixed (`malloc_thresholds.py`, time only, on CPU torch traces that say which malloc ran) take the
page faults they save off every step, on top of whatever else the plan decides.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import networkx as nx
import numpy as np

from qsync_callback.errors import QSyncInputError
from qsync_callback.mean_band import median_band
from qsync_callback.plan import KEEP, Plan, holds
from qsync_callback.predictor.activation import ActivationPricing, check_activation_plan
from qsync_callback.predictor.compiled_regions import (
    FusionCosts,
    apply_regions,
    check_region_plan,
    fit_fusion_costs,
)
from qsync_callback.predictor.graph import build_global_graph
from qsync_callback.predictor.malloc_thresholds import fault_saving_us, malloc_problem
from qsync_callback.predictor.memory import MemoryCurve, TensorLife, lifetime_events, tensor_lifetimes
from qsync_callback.predictor.op_precision import (
    apply_op_precision,
    changed_op_types,
    changed_share,
    check_op_precision_plan,
    op_type_lives,
    op_type_table,
    rewrite_change,
    rewrite_reading,
    uniform_op_types,
)
from qsync_callback.predictor.precision import (
    PrecisionDurations,
    PrecisionLives,
    apply_precision,
    check_precision_plan,
)
from qsync_callback.predictor.replay import CompiledGraph
from qsync_callback.predictor.tensor_fusion import (
    DDP,
    HOROVOD,
    MIDDLE_PHASE,
    AllreduceCost,
    can_price_fusion,
    check_buckets,
    fit_allreduce_cost,
    fusion_correction_us,
    loop_phases,
    regroup,
    shared_core_us,
)
from qsync_callback.recorder.trace import Trace


@dataclass
class Prediction:
    """What a plan is predicted to do, per step (milliseconds) and at peak (bytes)."""

    step_ms: float
    peak_bytes: int
    replayed_step_ms: list[float]
    per_rank_peak_bytes: list[int]
    critical_path_share: dict[str, float] = field(default_factory=dict)
    memory_breakdown: dict[str, int] = field(default_factory=dict)
    layer_ms: dict[str, float] = field(default_factory=dict)
    exposed_comm_ms: float = 0.0  # the median step's collectives past its last backward op
    peak_bytes_simulated: int | None = None  # TF's allocator simulated, uncalibrated (largest rank's)

    def to_dict(self) -> dict:
        return asdict(self)

    def figures(self) -> dict[str, float | int]:
        """What a plan carries as its ``prediction`` (the one schema, see `qsync_callback.plan`)."""
        return {"step_ms": self.step_ms, "peak_bytes": self.peak_bytes}


def check_plan(traces: Sequence[Trace], plan: Plan, source: str = "<plan>") -> None:
    """Refuse a plan made for another run, or with decisions this version cannot price."""
    plan.check_for(traces[0].fingerprint, [layer["name"] for layer in traces[0].layers], source=source)
    check_region_plan(traces, plan.fused_regions, source)
    if _acting(plan.activation) and (
        plan.op_precision or plan.buckets or plan.communication or plan.fused_regions
    ):
        raise QSyncInputError(
            f"{source}: activation policies cannot be priced together with per-op-type precision, "
            "fusion decisions or compiled regions yet"
        )
    if plan.malloc_thresholds and (problem := malloc_problem(traces)) is not None:
        raise QSyncInputError(f"{source}: the plan's malloc_thresholds cannot be priced: {problem}")
    if plan.buckets or plan.communication:
        reason = can_price_fusion(traces)
        if reason is not None:
            names = ", ".join(
                n for n, d in (("buckets", plan.buckets), ("communication", plan.communication)) if d
            )
            raise QSyncInputError(f"{source}: the plan's {names} decisions cannot be priced: {reason}")
    check_precision_plan(traces, plan.precision, source)
    check_op_precision_plan(traces, plan.op_precision, source)
    check_activation_plan(traces, plan.activation, source)


def _acting(activation: Mapping[str, str]) -> dict[str, str]:
    """The policies of ``activation`` that change something (all but keep)."""
    return {name: policy for name, policy in activation.items() if policy != KEEP}


class Predictor:
    """Prices plans on one set of recorded traces (one per rank).

    The recorded steps' graphs (compiled for replay, `replay.CompiledGraph`) and memory curves are
    built once. A precision plan is priced on them as changed op durations (`PrecisionDurations`)
    and extra tensors (`PrecisionLives`), and so is an activation plan on top of it
    (`ActivationPricing`), with no copy: a planner prices many plans quickly. A plan
    with per-op-type precision or fusion decisions transforms copies of the graphs, compiled anew.
    """

    def __init__(self, traces: Sequence[Trace]):
        if not traces:
            raise QSyncInputError("no traces to predict from")
        self.traces = list(traces)
        positions = min(len(t.steps) for t in self.traces)
        self._graphs = [build_global_graph(self.traces, pos) for pos in range(positions)]
        self._compiled = [CompiledGraph(g) for g in self._graphs]
        self._durations = PrecisionDurations(self._graphs, self._compiled, self.traces)
        lives = [tensor_lifetimes(t) for t in self.traces]
        self._curves = [MemoryCurve(t, rank_lives) for t, rank_lives in zip(self.traces, lives, strict=True)]
        self._precision_lives = [
            PrecisionLives(t, rank_lives) for t, rank_lives in zip(self.traces, lives, strict=True)
        ]
        self._lives = lives
        self._activation_pricing: ActivationPricing | None = None  # built when first needed
        self._fusion: AllreduceCost | None = None  # fitted when first needed
        self._corrections: dict[tuple[int, float], float] = {}  # per recorded step and loop phase
        self._horovod_loop: bool | None = None  # `_prices_horovod_loop`, when first needed
        self._typical: int | None = None  # the recorded step the estimates replay, when first needed
        self._fusion_costs: FusionCosts | None = None  # fitted when first needed
        self._estimates: dict[tuple[frozenset, frozenset], Prediction] = {}  # `estimate`'s, by plan
        self._rewrite_residual_ms: dict[str, float] = {}  # `_on_rewrite_calls`', by precision
        self._recorded_at: dict[tuple[int, ...], Prediction] = {}  # `_paired`'s, by step positions

    def predict(
        self, plan: Plan | None = None, plan_source: str = "<plan>", steps: Sequence[int] | None = None
    ) -> Prediction:
        """Price ``plan`` (default: the recorded configuration) on every recorded step, or on the
        recorded steps at positions ``steps`` (a quick figure for ranking plans: `typical_step`)."""
        if plan is None:
            plan = Plan()
        else:
            check_plan(self.traces, plan, plan_source)
        prediction = self._replayed(plan, steps, plan_source)
        if plan.op_precision:
            prediction = self._on_rewrite_calls(plan, prediction)
        return prediction

    def _on_rewrite_calls(self, plan: Plan, prediction: Prediction) -> Prediction:
        """An op-type plan's step calibrated on the uniform rewrite's timed calls: the change they
        measured in turns on the recorded configuration's predicted step, over the rewrite's
        replayed step, times the plan's `changed_share` of the rewrite (module docstring of
        `op_precision.py`); unchanged where the probe timed no round, where the two are within
        their combined band of each other, or where the turns cannot tell the rewrite from the
        recorded configuration."""
        precisions = set(changed_op_types(plan.op_precision).values())
        if len(precisions) != 1:
            return prediction
        low = precisions.pop()
        if low not in self._rewrite_residual_ms:
            measured = rewrite_change(self.traces)
            uniform = uniform_op_types(op_type_table(self.traces[0]), low)
            self._rewrite_residual_ms[low] = 0.0
            if measured is not None and uniform:
                recorded_ms = self._replayed(Plan(), None, "<the recorded configuration>").step_ms
                rewrite = Plan(op_precision=dict.fromkeys(uniform, low))
                replayed = self._replayed(rewrite, None, "<the uniform rewrite>")
                residual = recorded_ms * (1 + measured["change_pct"] / 100) - replayed.step_ms
                band = recorded_ms * measured["noise_pct"] / 100
                noise = math.hypot(band, median_band(replayed.replayed_step_ms) or 0.0)
                told = abs(residual) > noise and abs(measured["change_pct"]) > measured["noise_pct"]
                self._rewrite_residual_ms[low] = residual if told else 0.0
        share = statistics.fmean(
            changed_share(op_type_table(trace), plan.op_precision) for trace in self.traces
        )
        added_ms = share * self._rewrite_residual_ms[low]
        if not added_ms:
            return prediction
        return replace(
            prediction,
            step_ms=prediction.step_ms + added_ms,
            replayed_step_ms=[ms + added_ms for ms in prediction.replayed_step_ms],
        )

    def _replayed(self, plan: Plan, at: Sequence[int] | None, plan_source: str) -> Prediction:
        """``plan`` priced on the recorded steps at positions ``at`` (None: all of them), its step
        paired with the recorded configuration's (`_paired`)."""
        at = tuple(range(len(self._graphs))) if at is None else tuple(at)
        if at not in self._recorded_at:
            self._recorded_at[at] = self._replayed_alone(Plan(), at, "<the recorded configuration>")
        if plan.is_empty:
            return self._recorded_at[at]
        return _paired(self._replayed_alone(plan, at, plan_source), self._recorded_at[at])

    def _replayed_alone(self, plan: Plan, at: Sequence[int], plan_source: str) -> Prediction:
        """``plan`` priced on the recorded steps at positions ``at``, its step the median of its
        replayed steps."""
        if not (plan.op_precision or plan.buckets or plan.communication or plan.fused_regions):
            return self._with_malloc(plan, self._price_recorded(plan.precision, _acting(plan.activation), at))
        graphs = [self._graphs[i] for i in at]
        if plan.precision:
            graphs = [apply_precision(g, self.traces, plan.precision) for g in graphs]
        if plan.op_precision:
            graphs = [apply_op_precision(g, self.traces, plan.op_precision) for g in graphs]
        if plan.fused_regions:
            modules = [region[0] for region in plan.fused_regions]
            graphs = [apply_regions(g, modules, self.fusion_costs) for g in graphs]
        fused = bool(plan.buckets or plan.communication) or self._prices_horovod_loop
        corrections = [0.0] * len(graphs)
        if fused:
            graphs, compiled, corrections = self._apply_fusion(graphs, at, plan, plan_source)
        else:
            compiled = [CompiledGraph(g) for g in graphs]
        if fused and self._shared_cores:
            corrections = [
                c + shared_core_us(g, cg) for c, g, cg in zip(corrections, graphs, compiled, strict=True)
            ]
        curves = None
        if plan.op_precision:
            curves = [
                curve.with_lives(
                    op_type_lives(trace, curve.lives, plan.op_precision),
                    rewrite_reading(op_type_table(trace), plan.op_precision),
                )
                for trace, curve in zip(self.traces, self._curves, strict=True)
            ]
        runs = [(c.dur, frozenset()) for c in compiled]
        prediction = self._price(plan.precision, compiled, runs, corrections, curves=curves)
        return self._with_malloc(plan, prediction)

    def _with_malloc(self, plan: Plan, prediction: Prediction) -> Prediction:
        """``prediction`` less the page faults ``plan``'s malloc thresholds save on every step
        (`malloc_thresholds.fault_saving_us`)."""
        if not plan.malloc_thresholds:
            return prediction
        saved_ms = fault_saving_us(self.traces, plan.malloc_thresholds) / 1e3
        return replace(
            prediction,
            step_ms=prediction.step_ms - saved_ms,
            replayed_step_ms=[ms - saved_ms for ms in prediction.replayed_step_ms],
        )

    def estimate(
        self, precision: Mapping[str, str], activation: Mapping[str, str] | None = None
    ) -> Prediction:
        """A quick estimate of a precision (and activation) plan for ranking moves, not for choosing a
        plan: step time from one recorded step (the one the recorded configuration's median comes
        from), peak memory as `predict` prices it. Kept by plan: the planners ask for the same
        estimates again (each layer's moves alone, for every budget tried)."""
        check_precision_plan(self.traces, precision, "<estimate>")
        activation = _acting(activation or {})
        key = (frozenset(precision.items()), frozenset(activation.items()))
        if key not in self._estimates:
            self._estimates[key] = self._price_recorded(precision, activation, [self.typical_step])
        return self._estimates[key]

    @property
    def typical_step(self) -> int:
        """The recorded step whose replay is closest to the median of the recorded steps' replays
        (the one quick estimates and the region planner price on)."""
        if self._typical is None:
            replayed = [c.run().step_us for c in self._compiled]
            self._typical = _closest(replayed, statistics.median(replayed))
        return self._typical

    @property
    def fusion_costs(self) -> FusionCosts:
        """The fusion cost model's constants (`compiled_regions.fit_fusion_costs`) on the recorded
        graphs, calibrated on the modules compiled during the warm-up; fitted when first needed."""
        if self._fusion_costs is None:
            probes = self.traces[0].compiled_regions.get("probes", {})
            self._fusion_costs = fit_fusion_costs(self._graphs, probes)
        return self._fusion_costs

    def _price_recorded(
        self, precision: Mapping[str, str], activation: Mapping[str, str], steps: Sequence[int]
    ) -> Prediction:
        """A precision and activation plan priced on the recorded steps at ``steps``, as changed op
        durations on their compiled graphs (no copy)."""
        runs = self._durations(precision, steps)
        if activation:
            runs = self.activation.durations(activation, runs, steps)
        compiled = [self._compiled[i] for i in steps]
        return self._price(precision, compiled, runs, [0.0] * len(runs), activation)

    @property
    def activation(self) -> ActivationPricing:
        """The activation policies' pricing on the recorded steps (module spans, saved tensors),
        built the first time a plan with activation policies is priced."""
        if self._activation_pricing is None:
            recorded = [dur for dur, _ in self._durations({})]
            self._activation_pricing = ActivationPricing(
                self._graphs, self._compiled, self.traces, self._lives, recorded
            )
        return self._activation_pricing

    @property
    def curves(self) -> list[MemoryCurve]:
        """Each rank's recorded memory curve (do not change them)."""
        return self._curves

    def extra_lives(self, precision: Mapping[str, str], activation: Mapping[str, str]) -> list[list[dict]]:
        """Per rank: the synthetic tensors of a precision and activation plan (`MemoryCurve.predict`'s
        ``extra``)."""
        extras = self.activation_lives(precision, activation)
        return [
            [*lives(precision), *extra] for lives, extra in zip(self._precision_lives, extras, strict=True)
        ]

    def activation_lives(
        self, precision: Mapping[str, str], activation: Mapping[str, str], neighbours_offloaded: bool = False
    ) -> list[list[dict]]:
        """Per rank: the synthetic tensors ``activation`` adds on top of ``precision``
        (`ActivationPricing.lives`, ``neighbours_offloaded`` as there). A layer ``precision``
        changes inside a module with a policy saves the precision's bytes, not the recorded ones
        (`PrecisionLives.saved`); while the module's tensors are away (`ActivationPricing.away`) it
        saves nothing, so that change is taken away then too."""
        acting = _acting(activation)
        if not acting:
            return [[] for _ in self._precision_lives]
        out = []
        for k, rank_events in enumerate(self.activation.lives(acting, neighbours_offloaded)):
            saved = [
                life
                for life in self._precision_lives[k].saved(precision)
                if any(holds(m, life.layer) for m in acting)
            ]
            away = self.activation.away(acting, k, neighbours_offloaded) if saved else {}
            taken = []
            for life in saved:
                for (step, module), (gone, back) in away.items():
                    start, end = max(life.birth_us, gone), min(life.death_us, back)
                    if step == life.step and holds(module, life.layer) and start < end:
                        taken.append(
                            TensorLife(
                                -1, -life.bytes, step, start, end, None, None, life.category, life.layer
                            )
                        )
            out.append([*rank_events, lifetime_events(taken)] if taken else rank_events)
        return out

    def _price(
        self,
        precision: Mapping[str, str],
        compiled: Sequence[CompiledGraph],
        runs: Sequence[tuple[np.ndarray, frozenset[int]]],
        corrections: Sequence[float],
        activation: Mapping[str, str] | None = None,
        curves: Sequence[MemoryCurve] | None = None,
    ) -> Prediction:
        """Replay each step graph with its op durations, price the memory (each rank's ``curves``,
        default the recorded ones) with ``precision``'s and ``activation``'s extra tensors, and
        gather the prediction (step time: the median step; shares and layer times: the step closest
        to it)."""
        timings = [c.run(dur, moved) for c, (dur, moved) in zip(compiled, runs, strict=True)]
        step_us = [t.step_us + c for t, c in zip(timings, corrections, strict=True)]
        median_us = statistics.median(step_us)
        typical = _closest([t.step_us for t in timings], median_us)
        graph, dur = compiled[typical], runs[typical][0]
        memory = [
            curve.predict(extra)
            for curve, extra in zip(
                curves or self._curves, self.extra_lives(precision, activation or {}), strict=True
            )
        ]
        largest = max(memory, key=lambda m: m.peak_bytes)
        return Prediction(
            step_ms=median_us / 1e3,
            peak_bytes=largest.peak_bytes,
            replayed_step_ms=[us / 1e3 for us in step_us],
            per_rank_peak_bytes=[m.peak_bytes for m in memory],
            critical_path_share=graph.critical_share(graph.critical_path(timings[typical]), dur),
            memory_breakdown=largest.breakdown,
            layer_ms=graph.layer_totals(dur / 1e3, ("forward", "backward", "cast")),
            exposed_comm_ms=graph.exposed_comm_us(timings[typical]) / 1e3,
            peak_bytes_simulated=max(
                (m.peak_bytes_simulated for m in memory if m.peak_bytes_simulated is not None), default=None
            ),
        )

    @property
    def graphs(self) -> list[nx.DiGraph]:
        """The recorded steps' global graphs (do not change them: the predictor compiled them once)."""
        return self._graphs

    def fusion_cost(self) -> AllreduceCost:
        """The all-reduce cost fitted on the recorded responses (once per predictor)."""
        if self._fusion is None:
            settings = self.traces[0].communication
            library = settings.get("library", HOROVOD)
            alone = [
                t.communication["allreduce_us"] for t in self.traces if "allreduce_us" in t.communication
            ]
            self._fusion = fit_allreduce_cost(self._graphs, self.traces[0].world_size, library, alone)
        return self._fusion

    def _fusion_correction(self, step: int, phase: float = MIDDLE_PHASE) -> float:
        """`tensor_fusion.fusion_correction_us` of the recorded step at position ``step``, the
        loop at ``phase``."""
        if (step, phase) not in self._corrections:
            settings = self.traces[0].communication
            self._corrections[step, phase] = fusion_correction_us(
                self._graphs[step],
                self.fusion_cost(),
                settings,
                self._shared_cores,
                self._compiled[step],
                phase,
            )
        return self._corrections[step, phase]

    @property
    def _shared_cores(self) -> bool:
        """Whether the all-reduces take the cores backward runs on (DDP on a CPU: `shared_core_us`)."""
        return self.traces[0].communication.get("library") == DDP and self.traces[0].device == "cpu"

    @property
    def _prices_horovod_loop(self) -> bool:
        """Whether every plan other than the recorded configuration is priced through the model of
        Horovod's loop (`tensor_fusion.regroup`) at the recorded settings where it sets none: on
        traces of more than one Horovod process with its timeline. A plan with gradient groups is
        priced so; one without them must be too, or the groups' price would hold the difference
        between the loop's model and the recorded responses' fixed spans as well as their own."""
        if self._horovod_loop is None:
            library = self.traces[0].communication.get("library")
            self._horovod_loop = library == HOROVOD and can_price_fusion(self.traces) is None
        return self._horovod_loop

    def recorded_ends(self, step: int) -> dict[str, float]:
        """Each op's end in the replay of the recorded step at position ``step``, by node."""
        compiled = self._compiled[step]
        return compiled.end_times(compiled.run())

    def _apply_fusion(
        self, graphs: Sequence[nx.DiGraph], steps: Sequence[int], plan: Plan, source: str
    ) -> tuple[list[nx.DiGraph], list[CompiledGraph], list[float]]:
        """The graphs of the recorded steps at ``steps`` regrouped by the plan's fusion settings
        (the recorded ones where it sets none) and buckets, Horovod's loop at the middle phase,
        compiled, and each one's correction: `tensor_fusion.fusion_correction_us`, and where the loop
        is priced at several phases (`tensor_fusion.loop_phases`), what takes the middle phase's
        step to the phases' mean step (each with its own correction)."""
        settings = {**self.traces[0].communication, **plan.communication}
        check_buckets(self._graphs[0], plan.buckets, source, complete=settings.get("library") == DDP)
        cost = self.fusion_cost()
        phases = loop_phases(settings)
        regrouped, compiled, corrections = [], [], []
        for g, i in zip(graphs, steps, strict=True):
            ends = self.recorded_ends(i) if g is self._graphs[i] else None
            by_phase = {phase: regroup(g, cost, settings, plan.buckets, ends, phase) for phase in phases}
            middle = CompiledGraph(by_phase[MIDDLE_PHASE])
            correction = self._fusion_correction(i)
            if len(phases) > 1:
                step_us = {MIDDLE_PHASE: middle.run().step_us + correction}
                for phase, graph in by_phase.items():
                    if phase != MIDDLE_PHASE:
                        step_us[phase] = CompiledGraph(graph).run().step_us + self._fusion_correction(
                            i, phase
                        )
                correction += statistics.fmean(step_us.values()) - step_us[MIDDLE_PHASE]
            regrouped.append(by_phase[MIDDLE_PHASE])
            compiled.append(middle)
            corrections.append(correction)
        return regrouped, compiled, corrections


def _closest(step_us: Sequence[float], median_us: float) -> int:
    """The position of the replayed step closest to the median (the first such)."""
    return min(range(len(step_us)), key=lambda i: abs(step_us[i] - median_us))


def _paired(plan: Prediction, recorded: Prediction) -> Prediction:
    """``plan``'s step as the recorded configuration's median step (``recorded``, priced on the same
    steps) plus the median over the steps of the plan's change on each. The median of the plan's own
    steps would take its change from another step than the recorded median's: the decoder's three
    blocks recomputed added 14.6-23.3 ms to its five recorded steps (16.5 ms the median, as the
    recompute trial measured for them), and the median of its steps came out 21.8 ms over the
    recorded one, where a long host gap in one block's forward made its slowest step the median."""
    changes = [
        mine - theirs for mine, theirs in zip(plan.replayed_step_ms, recorded.replayed_step_ms, strict=True)
    ]
    return replace(plan, step_ms=recorded.step_ms + statistics.median(changes))


def predict(traces: Sequence[Trace], plan: Plan | None = None, plan_source: str = "<plan>") -> Prediction:
    """Price ``plan`` (default: the recorded configuration) on the recorded ``traces`` (one per rank)."""
    return Predictor(traces).predict(plan, plan_source)
