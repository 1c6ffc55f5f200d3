"""Choose the modules to compile as regions (``plan.fused_regions``) by the fusion cost model.

Each candidate is a module that ran recorded forward ops, or a block holding one whose forward ran
(`compiled_regions.region_candidates`),
priced alone on the recorded step closest to the median (`compiled_regions.price_region`): its
saving per step and its compile time. A region set is a set of candidates none of which holds
another; its value is what it saves over the steps left in the run less what it costs to compile,
in seconds (`RegionSearch.value`). A module with the same recorded ops and shapes as another in the
set (the second of two identical blocks) reuses its compiled code and costs `REUSE_COMPILE_S` to
compile, so the value is not a sum over regions: the search is over sets.

- **exhaustive** (`RegionSearch.exhaustive`): every set of nested-free regions among the candidates
  that save anything, up to `EXHAUSTIVE_MAX` of them;
- **MCMC** (`RegionSearch.mcmc`, dPRO's search with heat-weighted proposals): a walk over region
  sets by five moves (compile a module, compile it and every module with the same ops and shapes
  (its twins: they share one compile), fuse regions into the block holding them, partition a region
  into its children, drop a region), accepting a worse set with the Metropolis probability. Each
  module keeps a heat: the mean of ``(exp(d) - 1) / (k * d_max)`` over the value changes ``d`` its
  moves brought, signed by direction (a fusion's change, a partition's negated); a fusion move on
  it is proposed with weight ``1 + H``, a partition with ``1 / (1 + H)``.

A module that broke its graph when compiled during the warm-up is left out, with the modules of
the same ops and shapes and every block holding one (compiled whole, they would break too); one
that breaks only once applied is rolled back alone by the applier (`appliers/torch_regions.py`).
Where an epoch ends with a smaller batch (``partial_last_batch``: a new shape), each region compiles
once more, then with dynamic shapes for every later size (the applier's docstring says what was
measured): its compile time counts twice.

**A saving the model cannot stand behind is not counted.** The warm-up's probes measure how far the
model's compiled time is from a compiled module's (`probe_errors`); its worst under-pricing among
them is its optimism (`model_optimism`: 0.45 where it priced a probe at 0.69 of its measured time).
A region's part priced by the model (not at a probe's measured ratio) is counted that much slower
(`RegionCost.saving_beyond_us`): a region that then saves nothing is left out of the search and
named in the plan table, since a saving within the model's error could as well be a slowdown.
Without a probe that measured both times the model is taken at its price.

The exhaustive search runs where it can; the MCMC where it cannot (the benchmark runs both on small
models and reports the gap). With the steps left unknown (an iterable data set without a length), a
region's compile is counted against `UNKNOWN_STEPS_LEFT` steps. The chosen set is priced by
the predictor (a replay of the graphs with the regions compiled, `compiled_regions.apply_regions`),
with the buckets of the plan it goes on merged where one would end inside a region (a compiled
region's gradients become ready together: `plan.buckets_around_regions`);
if it is not predicted more than `NO_DECISION_GAIN` faster than the plan it goes on top of, or its
compile does not pay back in the steps left, no region is chosen.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

import networkx as nx

from qsync_callback.plan import Plan, buckets_around_regions, holds
from qsync_callback.planner import NO_DECISION_GAIN
from qsync_callback.predictor.compiled_regions import (
    REUSE_COMPILE_S,
    FusionCosts,
    RegionCost,
    forward_owners,
    measured_ratios,
    price_region,
    region_candidates,
    region_signature,
)
from qsync_callback.predictor.predict import Prediction, Predictor

EXHAUSTIVE_MAX = 14
MCMC_STEPS = 2000
UNKNOWN_STEPS_LEFT = 1000
_HEAT_K = 2.0


@dataclass
class RegionChoice:
    """The chosen regions (empty: none), their prediction against the plan's, and how they were found."""

    plan: Plan | None
    base: Prediction
    chosen: list[RegionCost]
    prediction: Prediction | None
    costs: FusionCosts
    steps_left: int | None
    compile_s: float
    search: dict[str, float | int | str] = field(default_factory=dict)
    probe_errors: dict[str, float] = field(default_factory=dict)  # per probe: predicted vs measured, %
    doubtful: list[RegionCost] = field(default_factory=list)  # saving within the model's optimism

    @property
    def optimism(self) -> float:
        """The cost model's optimism on the warm-up's probes (`model_optimism`)."""
        return model_optimism(self.probe_errors)


def _prefixes(module: str) -> list[str]:
    """The blocks holding ``module``: each proper dotted prefix of its name."""
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


class RegionSearch:
    """The value of region sets over the candidates that save anything, and the two searches."""

    def __init__(
        self,
        graph: nx.DiGraph,
        costs: FusionCosts,
        steps_left: int,
        broken: Iterable[str] = (),
        called_blocks: Iterable[str] | None = None,
        compiles: int = 1,
        optimism: float = 0.0,
    ):
        self.steps_left = steps_left
        self.compiles = compiles  # per region: 2 where an epoch's last batch is smaller
        candidates = region_candidates(forward_owners(graph), called_blocks)
        # a module that broke its graph when compiled during the warm-up, its twins, and every
        # block holding one of them would break too: they are left out
        broken_signatures = {region_signature(graph, m) for m in broken}
        broken_names = {m for m in candidates if region_signature(graph, m) in broken_signatures}
        left_out = {a for m in broken_names for a in [m, *_prefixes(m)]}
        measured = measured_ratios(graph, costs)
        priced = [price_region(graph, m, costs, measured) for m in candidates if m not in left_out]
        saving = [c for c in priced if c is not None and c.saving_us > 0]
        # what each saves beyond the model's optimism; those that then save nothing are left out
        self.saving = {c.module: c.saving_beyond_us(optimism) for c in saving}
        self.regions = {c.module: c for c in saving if self.saving[c.module] > 0}
        self.doubtful = sorted((c for c in saving if self.saving[c.module] <= 0), key=lambda c: c.module)
        self.names = sorted(self.regions)
        self.signature = {m: region_signature(graph, m) for m in self.names}
        names = set(self.names)
        self.ancestors = {m: {a for a in _prefixes(m) if a in names} for m in self.names}
        self.descendants: dict[str, set[str]] = {m: set() for m in self.names}
        for m in self.names:
            for a in self.ancestors[m]:
                self.descendants[a].add(m)
        self.twins = {
            m: {t for t in self.names if self.signature[t] == self.signature[m]} for m in self.names
        }
        self.children = {
            m: [c for c in self.descendants[m] if "." not in c[len(m) + 1 :]] for m in self.names
        }

    def compile_s(self, chosen: Iterable[str]) -> float:
        """The set's compile time: each distinct signature once, the repeats `REUSE_COMPILE_S`; all
        of it ``compiles`` times (a second shape compiles each region again, dynamic)."""
        seen: set[tuple] = set()
        total = 0.0
        for m in sorted(chosen):
            first = self.signature[m] not in seen
            seen.add(self.signature[m])
            total += self.regions[m].compile_s if first else REUSE_COMPILE_S
        return total * self.compiles

    def value(self, chosen: Iterable[str]) -> float:
        """Seconds the set saves over the steps left (beyond the model's optimism), less its compile time."""
        chosen = list(chosen)
        saving_us = sum(self.saving[m] for m in chosen)
        return saving_us * self.steps_left / 1e6 - self.compile_s(chosen)

    def nested_free(self, chosen: Sequence[str]) -> bool:
        return not any(holds(a, b) or holds(b, a) for a, b in combinations(chosen, 2))

    def exhaustive(self) -> tuple[list[str], float, int]:
        """The best set, its value and the sets tried (every nested-free set)."""
        best: tuple[list[str], float] = ([], 0.0)
        tried = 0

        def extend(start: int, chosen: list[str]) -> None:
            nonlocal best, tried
            tried += 1
            value = self.value(chosen)
            if value > best[1]:
                best = (list(chosen), value)
            for i in range(start, len(self.names)):
                name = self.names[i]
                if all(not holds(c, name) and not holds(name, c) for c in chosen):
                    chosen.append(name)
                    extend(i + 1, chosen)
                    chosen.pop()

        extend(0, [])
        return best[0], best[1], tried

    def mcmc(self, steps: int = MCMC_STEPS, seed: int = 0) -> tuple[list[str], float, int]:
        """dPRO's heat-weighted MCMC (see the module docstring): the best set seen, its value and the
        steps walked."""
        rng = random.Random(seed)
        heat: dict[str, list[float]] = {}
        current: set[str] = set()
        value = 0.0
        best = (set(), 0.0)
        scale = max((abs(self.value([m])) for m in self.names), default=1.0) or 1.0
        walked = 0
        for step in range(steps):
            temperature = scale * 0.1 * (1 - step / steps) + 1e-9
            moves = self._moves(current, heat)
            if not moves:
                break
            walked += 1
            weights = [w for _, _, _, w in moves]
            kind, module, proposed, _ = rng.choices(moves, weights)[0]
            new_value = self.value(proposed)
            delta = new_value - value
            if kind in ("fuse", "partition"):
                signed = delta if kind == "fuse" else -delta
                heat.setdefault(module, []).append(signed / scale)
            if delta >= 0 or rng.random() < math.exp(delta / temperature):
                current, value = proposed, new_value
                if value > best[1]:
                    best = (set(current), value)
        return sorted(best[0]), best[1], walked

    def _moves(
        self, current: set[str], heat: dict[str, list[float]]
    ) -> list[tuple[str, str, set[str], float]]:
        """Every move from ``current``: (kind, module, the set it leads to, its proposal weight)."""
        moves = []
        for m in self.names:
            if m in current:
                moves.append(("drop", m, current - {m}, 1.0))
                if self.children[m]:
                    weight = 1.0 / (1.0 + _heat(heat.get(m, [])))
                    moves.append(("partition", m, (current - {m}) | set(self.children[m]), weight))
            elif not self.ancestors[m] & current:
                inner = self.descendants[m] & current
                if inner:
                    weight = 1.0 + _heat(heat.get(m, []))
                    moves.append(("fuse", m, (current - inner) | {m}, weight))
                else:
                    moves.append(("compile", m, current | {m}, 1.0))
                    twins = {
                        t
                        for t in self.twins[m]
                        if t not in current and not (self.ancestors[t] | self.descendants[t]) & current
                    }
                    if len(twins) > 1:
                        moves.append(("compile", m, current | twins, 1.0))
        return moves


def _heat(history: list[float]) -> float:
    """dPRO's heat of a module: the mean of ``(exp(d) - 1) / k`` over its moves' value changes
    (normalized), above -1."""
    if not history:
        return 0.0
    return sum((math.exp(min(d, 20.0)) - 1) / _HEAT_K for d in history) / len(history)


def choose_regions(predictor: Predictor, base: Plan) -> RegionChoice:
    """The regions to compile on top of ``base`` (see the module docstring)."""
    recorded = predictor.traces[0].compiled_regions
    steps_left = recorded.get("steps_left")
    costs = predictor.fusion_costs
    graph = predictor.graphs[predictor.typical_step]
    broken = [m for m, probe in recorded.get("probes", {}).items() if probe.get("graphs", 1) > 1]
    steps = steps_left if steps_left is not None else UNKNOWN_STEPS_LEFT
    compiles = 2 if recorded.get("partial_last_batch") else 1
    errors = probe_errors(predictor, costs)
    search = RegionSearch(
        graph, costs, steps, broken, recorded.get("called_blocks"), compiles, model_optimism(errors)
    )
    base_prediction = predictor.predict(base)
    if len(search.names) <= EXHAUSTIVE_MAX:
        chosen, value, tried = search.exhaustive()
        mcmc_chosen, mcmc_value, _ = search.mcmc()
        stats = {"method": "exhaustive", "sets": tried, "mcmc_value_s": mcmc_value, "value_s": value}
    else:
        chosen, value, tried = search.mcmc()
        stats = {"method": "mcmc", "steps": tried, "value_s": value}
    stats["candidates"] = len(search.names)
    choice = RegionChoice(
        None, base_prediction, [], None, costs, steps_left, 0.0, stats, errors, search.doubtful
    )
    if not chosen:
        return choice
    regions = [[m] for m in chosen]
    buckets = buckets_around_regions(base.buckets, regions)
    plan = Plan.from_dict({**base.to_dict(), "fused_regions": regions, "buckets": buckets})
    prediction = predictor.predict(plan)
    choice.chosen = [search.regions[m] for m in chosen]
    choice.prediction = prediction
    choice.compile_s = search.compile_s(chosen)
    if prediction.step_ms < base_prediction.step_ms * (1 - NO_DECISION_GAIN):
        plan.prediction = prediction.figures()
        choice.plan = plan
    return choice


def probe_errors(predictor: Predictor, costs: FusionCosts) -> dict[str, float]:
    """Per module compiled during the warm-up: the model's predicted compiled-to-eager ratio (the
    model's, not the measured ratio modules of its ops are priced at) against the measured one, in
    percent (the error on the regions it was calibrated on)."""
    probes = predictor.traces[0].compiled_regions.get("probes", {})
    graph = predictor.graphs[predictor.typical_step]
    out = {}
    for module, probe in probes.items():
        cost = price_region(graph, module, costs, {})  # the model's price, not the probe's own
        if cost is None or not probe.get("compiled_us") or not probe.get("eager_us"):
            continue
        predicted = cost.compiled_us / cost.eager_us
        measured = probe["compiled_us"] / probe["eager_us"]
        out[module] = 100 * (predicted / measured - 1)
    return out


def model_optimism(errors: Mapping[str, float]) -> float:
    """The most the model under-priced a probe's compiled time, as a share of its price (0 where it
    under-priced none): a probe's error of -31% (`probe_errors`) is a measured time 1/0.69 of the
    price, an optimism of 0.45."""
    return max([0.0, *(100 / (100 + e) - 1 for e in errors.values())])


def _priced_as(region: RegionCost) -> str:
    """How a region was priced: at a warm-up probe's measured ratio, by the model, or both."""
    if region.measured_us >= region.compiled_us:
        return "priced as the one compiled in the warm-up"
    kernels = f"{region.fused_kernels} fused kernels"
    if not region.measured:
        return kernels
    share = 100 * region.measured_us / region.compiled_us
    return f"{share:.0f}% of its compiled time priced as compiled in the warm-up, the rest {kernels}"


def format_region_plan(choice: RegionChoice) -> str:
    """The chosen regions as a table: each one's predicted saving and compile time, the plan's
    predicted step time against the plan without them, and where the cost model's constants came from."""
    steps = "unknown" if choice.steps_left is None else str(choice.steps_left)
    lines = [
        f"qsync compiled regions ({choice.search.get('candidates', 0)} candidates, "
        f"{choice.search.get('method')} search; {steps} steps left; costs: {choice.costs.source})"
    ]
    for module, error in choice.probe_errors.items():
        lines.append(f"  compiled during the warm-up: {module}: model {error:+.1f}% against measured")
    for region in choice.doubtful:
        lines.append(
            f"  left out: {region.module[:40]}: priced to save {region.saving_us / 1e3:.3f} ms/step, "
            f"not beyond the model's error (a probe measured {100 * choice.optimism:.0f}% over its price)"
        )
    for region in choice.chosen:
        lines.append(
            f"  {region.module[:40]:<40} saves {region.saving_us / 1e3:7.3f} ms/step  "
            f"compile ~{region.compile_s:5.1f} s  ({region.ops} ops, {_priced_as(region)})"
        )
    if choice.prediction is not None:
        change = 100 * (choice.prediction.step_ms / choice.base.step_ms - 1)
        lines.append(
            f"  predicted {choice.prediction.step_ms:.2f} ms/step against {choice.base.step_ms:.2f} "
            f"({change:+.1f}%), compile ~{choice.compile_s:.0f} s"
        )
    if choice.plan is None:
        lines.append(
            f"  no region set is predicted more than {100 * NO_DECISION_GAIN:g}% faster and to pay for its "
            "compile in the steps left: nothing is compiled"
        )
    return "\n".join(lines)
