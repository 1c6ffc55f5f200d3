"""Choose a precision for every layer: QSync's allocator over the predictor.

The problem: minimise the summed indicator (the damage to training, `predictor/indicator.py`) of
the chosen per-layer precisions, subject to predicted step time <= ``max_step_ms`` and predicted
peak memory <= ``memory_budget``. Every plan is priced by the predictor (op durations and tensors
changed on the recorded steps, then a replay and the memory curve: `predictor/precision.py`),
never by a formula of its own.

Each (layer, precision) move is first priced by the predictor's estimate (`Predictor.estimate`:
the replay of one recorded step, the median one, and the full memory curve), with the layer's link
partners at their current precisions and every other layer as recorded (neighbours at the same
bf16/fp16 precision pass tensors without casts, `precision_links`, so a move is worth more next to
an equal neighbour), and those estimates rank the moves; every plan that a search below keeps or
returns is priced by the full predictor (every recorded step replayed).

- ``fastest_plan``: each layer at the precision that alone makes the step fastest, or a uniform
  plan if one is faster, checked by the predictor (the default time target is this plan's
  predicted time + 5%); ``least_memory_plan`` the same for the peak.
- ``allocate_precision`` (greedy, as in QSync): start from the recorded precision (fp32, no
  damage). While a constraint is violated, lower the layer whose move buys the most violation per
  unit of indicator (its single-move estimate's change applied to the current plan), and price the
  new plan by the predictor; a move whose priced plan does not reduce the violation is dropped.
  If that ends short of a memory budget that the least-memory plan meets (moves that pay only
  together, as linked neighbours do), start from the least-memory plan instead. Then recover:
  raise layers back, most sensitive first, wherever the plan stays feasible.
- ``exact_precision``: every combination priced by the predictor; for small instances, so that
  the greedy's gap is measured rather than assumed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import FULL_PRECISION, PRECISIONS, Plan
from qsync_callback.precision_links import link_partners
from qsync_callback.predictor.indicator import sensitivity
from qsync_callback.predictor.predict import Prediction, Predictor
from qsync_callback.recorder.trace import Trace
from qsync_callback.units import format_bytes

DEFAULT_SLACK = 0.05


@dataclass
class PrecisionChoice:
    """The chosen plan, what it is predicted to do, its summed indicator, and how it was found."""

    plan: Plan
    prediction: Prediction
    indicator: float
    target_step_ms: float | None
    memory_budget: int | None
    feasible: bool
    plans_priced: int  # by the predictor, or by its estimate (`Predictor.estimate`) for single moves


def candidate_precisions(predictor: Predictor, precisions: Iterable[str]) -> dict[str, list[str]]:
    """Per probed layer, the wanted precisions probed on every rank (the recorded one first)."""
    wanted = [p for p in PRECISIONS if p in set(precisions) and p != FULL_PRECISION]
    per_rank = [t.precision_costs.get("layers", {}) for t in predictor.traces]
    names = set.intersection(*(set(layers) for layers in per_rank)) if per_rank else set()
    return {
        name: [FULL_PRECISION, *(p for p in wanted if all(p in layers[name]["costs"] for layers in per_rank))]
        for name in sorted(names)
    }


class _Pricer:
    """Prices plans given as layer -> precision (or estimates them, `Predictor.estimate`), counting
    how many."""

    def __init__(self, predictor: Predictor):
        self.predictor = predictor
        self.fingerprint = predictor.traces[0].fingerprint
        self.priced = 0

    def __call__(self, choice: Mapping[str, str]) -> Prediction:
        self.priced += 1
        return self.predictor.predict(self.plan(choice))

    def estimate(self, choice: Mapping[str, str]) -> Prediction:
        self.priced += 1
        return self.predictor.estimate(choice)

    def plan(self, choice: Mapping[str, str]) -> Plan:
        return Plan(
            fingerprint=dict(self.fingerprint),
            precision={k: v for k, v in choice.items() if v != FULL_PRECISION},
        )

    def choice(
        self,
        choice: Mapping[str, str],
        prediction: Prediction,
        indicator: Mapping[str, Mapping[str, float]],
        target_step_ms: float | None,
        memory_budget: int | None,
        feasible: bool,
    ) -> PrecisionChoice:
        """The result of a search: ``choice`` as a plan carrying ``prediction``, and its figures."""
        plan = self.plan(choice)
        plan.prediction = prediction.figures()
        return PrecisionChoice(
            plan,
            prediction,
            _indicator_sum(choice, indicator),
            target_step_ms,
            memory_budget,
            feasible,
            self.priced,
        )


def _violation(prediction: Prediction, target_ms: float | None, budget: int | None) -> float:
    """How far a prediction is outside the constraints, as relative excess (0: feasible)."""
    excess = 0.0
    if target_ms is not None:
        excess += max(0.0, prediction.step_ms - target_ms) / target_ms
    if budget is not None:
        excess += max(0.0, prediction.peak_bytes - budget) / budget
    return excess


def _damage(indicator: Mapping[str, Mapping[str, float]], name: str, precision: str) -> float:
    """The indicator of one layer at one precision (0 at full precision)."""
    return 0.0 if precision == FULL_PRECISION else indicator.get(name, {}).get(precision, 0.0)


def _indicator_sum(choice: Mapping[str, str], indicator: Mapping[str, Mapping[str, float]]) -> float:
    return sum(_damage(indicator, name, p) for name, p in choice.items())


class _Moves:
    """Estimates (`Predictor.estimate`) of (layer, precision) moves, each with the layer's link
    partners (`precision_links.link_partners`) at their precisions in the plan it is made from and
    every other layer as recorded: a bf16 layer next to a bf16 one saves the casts between them,
    which the move alone would not show. Estimates are cached by plan."""

    def __init__(self, pricer: _Pricer, candidates: Mapping[str, list[str]]):
        self._pricer = pricer
        self._partners = link_partners(pricer.predictor.traces[0].layers, list(candidates))
        self._estimates: dict[frozenset, Prediction] = {}
        self._estimate({})  # the recording's estimate, which every single move is compared with
        self.alone = {
            (name, p): self.held(name, p) for name, options in candidates.items() for p in options[1:]
        }

    def _estimate(self, choice: Mapping[str, str]) -> Prediction:
        key = frozenset(choice.items())
        if key not in self._estimates:
            self._estimates[key] = self._pricer.estimate(choice)
        return self._estimates[key]

    def held(self, name: str, precision: str, choice: Mapping[str, str] | None = None) -> Prediction:
        """The estimate of ``name`` at ``precision``, its link partners as in ``choice`` (default:
        as recorded) and the other layers as recorded."""
        plan = {
            n: choice[n]
            for n in self._partners.get(name, ())
            if choice is not None and choice.get(n, FULL_PRECISION) != FULL_PRECISION
        }
        if precision != FULL_PRECISION:
            plan[name] = precision
        return self._estimate(plan)


def _best_simple_plan(
    pricer: _Pricer, moves: _Moves, base: Prediction, figure: Callable[[Prediction], float]
) -> tuple[dict[str, str], Prediction]:
    """The plan with the lowest ``figure`` (step time, peak), each priced by the predictor, among:
    each layer at the precision whose move alone gives the lowest figure; each uniform plan (every
    layer at one precision, as far as it runs it: linked neighbours save what no single move
    shows); and the recorded configuration (``base``)."""
    per_layer: dict[str, str] = {}
    for (name, p), single in moves.alone.items():
        if figure(single) < figure(moves.held(name, per_layer.get(name, FULL_PRECISION))):
            per_layer[name] = p
    uniform: dict[str, dict[str, str]] = {}
    for name, p in moves.alone:
        uniform.setdefault(p, {})[name] = p
    best: tuple[dict[str, str], Prediction] = ({}, base)
    for choice in [per_layer, *uniform.values()]:
        priced = pricer(choice)
        if figure(priced) < figure(best[1]) or (figure(priced) == figure(best[1]) and not best[0]):
            best = (choice, priced)
    return best


def _step_ms(prediction: Prediction) -> float:
    return prediction.step_ms


def _peak_bytes(prediction: Prediction) -> float:
    return prediction.peak_bytes


def fastest_plan(predictor: Predictor, precisions: Iterable[str]) -> tuple[dict[str, str], Prediction]:
    """The fastest plan of `_best_simple_plan` (per-layer fastest, uniform plans, the recording);
    returns the choice and its prediction."""
    pricer = _Pricer(predictor)
    moves = _Moves(pricer, candidate_precisions(predictor, precisions))
    return _best_simple_plan(pricer, moves, predictor.predict(), _step_ms)


def _fastest_fit(
    pricer: _Pricer, moves: _Moves, choice: dict[str, str], current: Prediction, budget: int
) -> Prediction:
    """From the fastest plan, the moves that buy the most memory per time lost (by their
    estimates) until the plan fits ``budget`` (as far as they can); the prediction of where that
    ends."""
    left = dict(moves.alone)
    while current.peak_bytes > budget and left:
        best, best_score = None, 0.0
        for name, p in left:
            held = moves.held(name, choice.get(name, FULL_PRECISION), choice)
            single = moves.held(name, p, choice)
            gain = held.peak_bytes - single.peak_bytes
            if p == choice.get(name, FULL_PRECISION) or gain <= 0:
                continue
            score = gain / max(single.step_ms - held.step_ms, 1e-3)
            if score > best_score:
                best, best_score = (name, p), score
        if best is None:
            break
        left.pop(best)
        trial = {**choice, best[0]: best[1]}
        priced = pricer(trial)
        if priced.peak_bytes < current.peak_bytes:
            choice, current = trial, priced
    return current


def least_memory_plan(predictor: Predictor, precisions: Iterable[str]) -> tuple[dict[str, str], Prediction]:
    """The plan with the lowest predicted peak the precisions allow (the smallest budget a plan can
    meet), and its prediction."""
    pricer = _Pricer(predictor)
    moves = _Moves(pricer, candidate_precisions(predictor, precisions))
    return _best_simple_plan(pricer, moves, predictor.predict(), _peak_bytes)


def _least_memory(
    pricer: _Pricer, moves: _Moves, base: Prediction, budget: int | None
) -> tuple[dict[str, str], Prediction] | None:
    """With a memory ``budget``, the least-memory plan (`_best_simple_plan`) and its prediction; None
    without one."""
    if budget is None:
        return None
    if budget <= 0:
        raise QSyncInputError(f"memory budget must be positive, not {budget} bytes")
    return _best_simple_plan(pricer, moves, base, _peak_bytes)


def budget_refusal(memory_budget: int, closest: Prediction, described: str) -> str:
    """The one message that refuses a memory budget no plan meets: the closest plan and its peak."""
    return (
        f"memory budget {format_bytes(memory_budget)} is below the smallest predicted peak "
        f"{format_bytes(closest.peak_bytes)}, reached by the closest plan: {described} "
        f"({closest.step_ms:.1f} ms/step predicted); best effort (best_effort=True, qsync plan "
        "--best-effort) takes it anyway"
    )


def describe_choice(choice: Mapping[str, str]) -> str:
    """``fc1 bf16, fc2 int8`` (layers away from full precision), or "the recorded configuration"."""
    moved = [f"{name} {p}" for name, p in sorted(choice.items()) if p != FULL_PRECISION]
    return ", ".join(moved) if moved else "the recorded configuration"


def allocate_precision(
    predictor: Predictor,
    indicator: Mapping[str, Mapping[str, float]],
    precisions: Iterable[str] = PRECISIONS,
    *,
    max_step_ms: float | None = None,
    memory_budget: int | None = None,
    best_effort: bool = False,
) -> PrecisionChoice:
    """QSync's greedy allocation (see the module docstring). With no ``max_step_ms`` the target is
    the fastest plan's predicted step time + 5%; with a ``memory_budget`` the fastest plan is the
    fastest found that fits it (moves chosen by memory saved per time lost). A memory budget no
    plan can meet raises QSyncInputError naming the closest plan (the least-memory one), or with
    ``best_effort`` returns that plan with ``feasible=False``; a time target no plan meets gives
    the least-violating plan with ``feasible=False``."""
    precisions = list(precisions)
    pricer = _Pricer(predictor)
    candidates = candidate_precisions(predictor, precisions)
    base = pricer({})
    moves = _Moves(pricer, candidates)
    least = _least_memory(pricer, moves, base, memory_budget)
    if least is not None and least[1].peak_bytes > memory_budget:
        closest, prediction = least
        if not best_effort:
            raise QSyncInputError(budget_refusal(memory_budget, prediction, describe_choice(closest)))
        return pricer.choice(closest, prediction, indicator, max_step_ms, memory_budget, feasible=False)
    if max_step_ms is None:
        fastest_choice, fastest = _best_simple_plan(pricer, moves, base, _step_ms)
        if memory_budget is not None and fastest.peak_bytes > memory_budget:
            fastest = _fastest_fit(pricer, moves, fastest_choice, fastest, memory_budget)
        max_step_ms = fastest.step_ms * (1 + DEFAULT_SLACK)
    choice = {name: FULL_PRECISION for name in candidates}
    current = base
    alone = dict(moves.alone)
    while (violation := _violation(current, max_step_ms, memory_budget)) > 0:
        best, best_score = None, 0.0
        for name, p in alone:
            if choice[name] == p:
                continue
            was, single = moves.held(name, choice[name], choice), moves.held(name, p, choice)
            gain_t = was.step_ms - single.step_ms
            gain_m = was.peak_bytes - single.peak_bytes
            estimate = Prediction(
                step_ms=current.step_ms - gain_t,
                peak_bytes=current.peak_bytes - gain_m,
                replayed_step_ms=[],
                per_rank_peak_bytes=[],
            )
            gained = violation - _violation(estimate, max_step_ms, memory_budget)
            if gained <= 0:
                continue
            cost = _damage(indicator, name, p) - _damage(indicator, name, choice[name])
            score = gained / max(cost, 1e-12)
            if score > best_score:
                best, best_score = (name, p), score
        if best is None:
            break
        trial = {**choice, best[0]: best[1]}
        priced = pricer(trial)
        if _violation(priced, max_step_ms, memory_budget) >= violation:
            alone.pop(best)  # the estimate did not hold together with the other moves: drop this move
            continue
        choice, current = trial, priced
    feasible = _violation(current, max_step_ms, memory_budget) == 0
    if not feasible and least is not None and _violation(least[1], max_step_ms, memory_budget) == 0:
        # moves that pay only together (linked neighbours) can leave the greedy short of a budget
        # the least-memory plan meets: start from that plan and recover from there
        choice = {name: least[0].get(name, FULL_PRECISION) for name in candidates}
        current, feasible = least[1], True
    if feasible:
        choice, current = _recover(pricer, choice, current, candidates, indicator, max_step_ms, memory_budget)
    return pricer.choice(choice, current, indicator, max_step_ms, memory_budget, feasible)


def _recover(
    pricer: _Pricer,
    choice: dict[str, str],
    current: Prediction,
    candidates: Mapping[str, list[str]],
    indicator: Mapping[str, Mapping[str, float]],
    max_step_ms: float | None,
    memory_budget: int | None,
) -> tuple[dict[str, str], Prediction]:
    """Raise lowered layers to less damaging precisions, most damaging first, while feasible."""
    lowered = sorted(
        (name for name, p in choice.items() if p != FULL_PRECISION),
        key=lambda n: -_damage(indicator, n, choice[n]),
    )
    for name in lowered:
        now = _damage(indicator, name, choice[name])
        better = sorted(
            (p for p in candidates[name] if _damage(indicator, name, p) < now),
            key=lambda p: _damage(indicator, name, p),
        )
        for p in better:
            trial = {**choice, name: p}
            priced = pricer(trial)
            if _violation(priced, max_step_ms, memory_budget) == 0:
                choice, current = trial, priced
                break
    return choice, current


def exact_precision(
    predictor: Predictor,
    indicator: Mapping[str, Mapping[str, float]],
    precisions: Iterable[str] = PRECISIONS,
    *,
    max_step_ms: float,
    memory_budget: int | None = None,
    max_plans: int = 4096,
) -> PrecisionChoice:
    """The least-indicator feasible plan over every combination, each priced by the predictor
    (where none is feasible, the least damaging of the least violating ones). Refuses instances
    with more than ``max_plans`` combinations (ValueError)."""
    pricer = _Pricer(predictor)
    candidates = candidate_precisions(predictor, precisions)
    names = list(candidates)
    count = math.prod(len(candidates[n]) for n in names)
    if count > max_plans:
        raise ValueError(f"{count} combinations is more than max_plans={max_plans}")
    best: tuple[float, dict[str, str], Prediction] | None = None
    least_violating: tuple[tuple[float, float], dict[str, str], Prediction] | None = None
    for combo in itertools.product(*(candidates[n] for n in names)):
        choice = dict(zip(names, combo, strict=True))
        priced = pricer(choice)
        violation = _violation(priced, max_step_ms, memory_budget)
        damage = _indicator_sum(choice, indicator)
        if violation == 0 and (best is None or damage < best[0]):
            best = (damage, choice, priced)
        if least_violating is None or (violation, damage) < least_violating[0]:
            least_violating = ((violation, damage), choice, priced)  # the least damaging of them
    feasible = best is not None
    _, choice, prediction = best if feasible else least_violating
    return pricer.choice(choice, prediction, indicator, max_step_ms, memory_budget, feasible)


def plan_precision(
    traces: Sequence[Trace],
    precisions: Iterable[str] = PRECISIONS,
    *,
    max_step_ms: float | None = None,
    memory_budget: int | None = None,
    best_effort: bool = False,
    predictor: Predictor | None = None,
) -> tuple[PrecisionChoice, dict[str, dict[str, float]]]:
    """Plan a recorded run: its indicator (from rank 0's layer statistics), then the greedy
    allocation over its predictor (``predictor``, if one is built for these traces already;
    ``best_effort``: see `allocate_precision`). Returns the choice and the indicator it minimised."""
    if not traces or not traces[0].layer_statistics:
        raise QSyncInputError(
            "the trace has no layer statistics for the precision indicator; record it with "
            "QSyncCallback(mode='apply')"
        )
    precisions = list(precisions)
    indicator = sensitivity(traces[0].layer_statistics, precisions)
    choice = allocate_precision(
        predictor or Predictor(traces),
        indicator,
        precisions,
        max_step_ms=max_step_ms,
        memory_budget=memory_budget,
        best_effort=best_effort,
    )
    return choice, indicator
