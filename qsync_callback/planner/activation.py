"""Choose an activation policy for each module (keep, recompute or offload) under a memory budget,
for the least predicted step time: G10's "offload what has time to move, recompute what is cheap".

Every module that holds recorded layers is a candidate (`predictor.activation.module_layers`),
except those the recorder refused (with the reason: `Trace.activation_costs["refused"]`), those
that saved nothing either policy frees, and one that holds another with a policy (a policy covers
what is inside it). Offload is a candidate only where the trace carries the store's fitted copy cost.
A module with a layer the precision plan lowers takes a policy too: its memory is priced at the
plan's precision (`Predictor.activation_lives`), its recompute at the plan's op times; its copies
are priced at the recorded bytes, which a lowered layer changes (the ResNet's `net.3` with four
layers at bf16 moved 20 MiB a step against 16 at fp32: the LP layers save their own casts).

- **Costs**, per (module, policy), from one replay of the plan they are added to: a recompute costs
  its forward's time again (`ActivationPricing.recompute_us`); an offload costs the wait of its
  first backward op for its tensors when they are asked back as the backward reaches the next
  module (the copy lane laid out on the replayed times). Memory: the module's synthetic tensors
  (`ActivationPricing.lives`) as a change of the bytes alive at every moment of every recorded step.
- **Exact** (`exact_activation`): a MILP through scipy's HiGHS (the way torch's `sac_ilp` chooses
  selective checkpointing): binary x[module, policy], at most one policy along each chain of nested
  modules, minimise the summed cost, subject to: at every moment that could break the budget, the
  recorded bytes alive then plus the chosen changes then stay within it. The moments are the
  curve's own events and the changes' (a recompute makes its tensors again at the backward), so the
  linear model is the memory model itself, with every policy priced alone; the full predictor then
  prices the plan together (copies share one lane, so offloads can wait on each other), and if it
  misses the budget the MILP is solved again with the budget cut by the miss (up to 4 times).
- **Greedy** (`greedy_activation`): take the policies in order of bytes freed at the peak per
  microsecond of cost, each priced by the predictor's estimate with those already taken, until the
  budget is met; for instances the MILP is too slow for, and so that its gap is measured.
  `choose_activation` runs it where the MILP found nothing that meets the budget.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from qsync_callback.plan import OFFLOAD, RECOMPUTE, Plan, holds
from qsync_callback.predictor.activation import nested_pairs
from qsync_callback.predictor.memory import merged_events
from qsync_callback.predictor.predict import Prediction, Predictor

NOTHING_TO_FREE = "saves nothing either policy could free"
_RETRIES = 4
_MILP_SECONDS = 10.0


@dataclass
class Option:
    """One (module, policy) a plan may take: its predicted cost and the change it makes to the bytes
    alive, per rank position and step (times, change right after each)."""

    module: str
    policy: str
    cost_us: float
    changes: list[dict[int, tuple[np.ndarray, np.ndarray]]]  # taken alone
    joined: list[dict[int, tuple[np.ndarray, np.ndarray]]]  # in any plan it joins (`_changes`)
    freed_bytes: int  # the most bytes it frees at once, alone (for the greedy's order)


@dataclass
class ActivationChoice:
    """The chosen policies (module -> recompute/offload), their full prediction, whether they meet
    the budget, why the modules left out were left out, and how the choice was made."""

    activation: dict[str, str]
    prediction: Prediction
    feasible: bool
    refused: dict[str, str] = field(default_factory=dict)
    options: list[Option] = field(default_factory=list)
    method: str = ""
    solve_s: float = 0.0


def _changes(
    predictor: Predictor, precision: Mapping[str, str], activation: Mapping[str, str], joined: bool = False
) -> list[dict[int, tuple[np.ndarray, np.ndarray]]]:
    """Per rank position and step: the times of ``activation``'s synthetic tensors' events on top of
    ``precision`` and the change of the bytes alive right after each; ``joined``: an offload as if
    the module after it were offloaded too (what it frees in any plan it joins,
    `ActivationPricing.lives`)."""
    out = []
    for rank_events in predictor.activation_lives(precision, activation, neighbours_offloaded=joined):
        steps: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for step in sorted(set().union(*rank_events)):
            times, deltas, _ = merged_events(None, [events[step] for events in rank_events if step in events])
            steps[step] = (times, np.add.accumulate(deltas))
        out.append(steps)
    return out


def _at(change: tuple[np.ndarray, np.ndarray] | None, times: np.ndarray) -> np.ndarray:
    """The change of bytes alive at each of ``times`` (after every event at or before it)."""
    if change is None or not len(change[0]):
        return np.zeros(len(times))
    k = np.searchsorted(change[0], times, side="right") - 1
    return np.where(k >= 0, change[1][np.maximum(k, 0)], 0.0)


def activation_options(
    predictor: Predictor, precision: Mapping[str, str]
) -> tuple[list[Option], dict[str, str]]:
    """Every (module, policy) a plan on top of ``precision`` may take, priced alone, and the modules
    left out with the reason."""
    trace = predictor.traces[0]
    refused = dict(trace.activation_costs.get("refused", {}))
    policies = [RECOMPUTE] + (
        [OFFLOAD] if all("copy" in t.activation_costs for t in predictor.traces) else []
    )
    base = predictor.estimate(precision)
    options = []
    for name in predictor.activation.modules:
        if name in refused:
            continue
        saved = [
            span
            for k in range(len(predictor.traces))
            for (_, module), span in predictor.activation.spans(k).items()
            if module == name
        ]
        if not any(span.inside or span.held for span in saved):
            refused[name] = NOTHING_TO_FREE
            continue
        for policy in policies:
            if policy == RECOMPUTE and not any(span.inside for span in saved):
                continue
            changes = _changes(predictor, precision, {name: policy})
            freed = -min((float(c[1].min()) for steps in changes for c in steps.values()), default=0.0)
            if freed <= 0:
                continue
            cost = predictor.estimate(precision, {name: policy}).step_ms - base.step_ms
            joined = (
                _changes(predictor, precision, {name: policy}, joined=True) if policy == OFFLOAD else changes
            )
            options.append(Option(name, policy, max(0.0, cost * 1e3), changes, joined, int(freed)))
    return options, refused


def _moments(
    predictor: Predictor,
    precision: Mapping[str, str],
    options: Sequence[Option],
    budget: int,
    joined: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The MILP's memory rows: each option's change (``joined``: as in any plan it joins) at every
    moment that could break ``budget``, and the room left there (budget less the bytes alive with no
    option)."""
    rows, room = [], []
    extra = predictor.extra_lives(precision, {})
    for k, curve in enumerate(predictor.curves):
        for step, (times, level) in curve.levels(extra[k]).items():
            moments = [times] + [
                (o.joined if joined else o.changes)[k][step][0]
                for o in options
                if step in (o.joined if joined else o.changes)[k]
            ]
            at = np.unique(np.concatenate(moments))
            base = _at((times, level), at)
            change = np.array(
                [_at((o.joined if joined else o.changes)[k].get(step), at) for o in options]
            ).reshape(len(options), len(at))
            reachable = base + np.clip(change, 0, None).sum(axis=0)
            keep = reachable > budget
            rows.append(change[:, keep].T)
            room.append(budget - base[keep])
    if not rows:
        return np.zeros((0, len(options))), np.zeros(0)
    return np.vstack(rows), np.concatenate(room)


def _chains(options: Sequence[Option]) -> np.ndarray:
    """One row per module with options: 1 for its options and those of the modules holding it (at
    most one of them may be taken)."""
    names = sorted({o.module for o in options})
    rows = np.zeros((len(names), len(options)))
    for r, name in enumerate(names):
        for i, option in enumerate(options):
            if holds(option.module, name):
                rows[r, i] = 1
    return rows


def _solve(options: Sequence[Option], rows: np.ndarray, room: np.ndarray) -> list[int] | None:
    """The options of least summed cost whose changes keep every row within its room, at most one
    along each chain of nested modules (HiGHS MILP); None if there are none."""
    n = len(options)
    if n == 0:
        return [] if (room >= 0).all() else None
    constraints = []
    if len(room):
        constraints.append(LinearConstraint(rows, -np.inf, room))
    constraints.append(LinearConstraint(_chains(options), 0, 1))
    cost = np.array([o.cost_us for o in options]) + 1e-3  # a tie goes to fewer changes
    result = milp(
        cost,
        constraints=constraints,
        integrality=np.ones(n),
        bounds=Bounds(0, 1),
        options={"time_limit": _MILP_SECONDS},
    )
    if result.x is None:
        return None
    return [i for i in range(n) if result.x[i] > 0.5]


def exact_activation(
    predictor: Predictor, precision: Mapping[str, str], memory_budget: int
) -> ActivationChoice:
    """The least-cost policies on top of ``precision`` that the predictor says meet
    ``memory_budget``: the MILP on the options taken alone, then (where what it chose misses the
    budget together) on the options as they free in any plan they join; each answer priced by the
    full predictor, and solved again with the budget cut by its miss (see the module docstring).
    Where none meets it: the policies of least predicted peak found, ``feasible`` False."""
    began = time.perf_counter()
    options, refused = activation_options(predictor, precision)
    tried: list[tuple[dict[str, str], Prediction]] = []
    for joined in (False, True):
        target = memory_budget
        for _ in range(_RETRIES + 1):
            rows, room = _moments(predictor, precision, options, target, joined)
            chosen = _solve(options, rows, room)
            if chosen is None:
                break
            activation = {options[i].module: options[i].policy for i in chosen}
            prediction = predictor.predict(Plan(precision=dict(precision), activation=activation))
            tried.append((activation, prediction))
            if prediction.peak_bytes <= memory_budget:
                return ActivationChoice(
                    activation, prediction, True, refused, options, "milp", time.perf_counter() - began
                )
            target -= prediction.peak_bytes - memory_budget
    tried += [_least_peak(predictor, precision, options, memory_budget, joined) for joined in (False, True)]
    meeting = [t for t in tried if t[1].peak_bytes <= memory_budget]
    if meeting:
        best = min(meeting, key=lambda t: t[1].step_ms)
    else:
        best = min(tried, key=lambda t: (t[1].peak_bytes, t[1].step_ms))
    return ActivationChoice(*best, bool(meeting), refused, options, "milp", time.perf_counter() - began)


def choose_activation(
    predictor: Predictor, precision: Mapping[str, str], memory_budget: int
) -> ActivationChoice:
    """`exact_activation`, and where it finds no plan that meets the budget, `greedy_activation`
    too (it prices every step on the full predictor, so it sees what the MILP's model of options
    priced one by one misses); the fastest that meets the budget, else the least peak."""
    exact = exact_activation(predictor, precision, memory_budget)
    if exact.feasible:
        return exact
    greedy = greedy_activation(predictor, precision, memory_budget)
    if greedy.feasible:
        return greedy
    return min((exact, greedy), key=lambda c: (c.prediction.peak_bytes, c.prediction.step_ms))


def _least_peak(
    predictor: Predictor,
    precision: Mapping[str, str],
    options: Sequence[Option],
    memory_budget: int,
    joined: bool = False,
) -> tuple[dict[str, str], Prediction]:
    """The policies of least peak by the same linear model (a MILP with the peak as a variable, over
    the moments that could come above half the budget), priced by the predictor: the closest a
    budget nothing meets can come."""
    rows, room = _moments(predictor, precision, options, memory_budget // 2, joined)
    n = len(options)
    if n == 0 or not len(room):
        return {}, predictor.predict(Plan(precision=dict(precision)))
    base = memory_budget // 2 - room  # the bytes alive at each moment with no option
    # variables: the options, then the peak z; each moment: base + change . x - z <= 0
    moments = LinearConstraint(np.hstack([rows, -np.ones((len(room), 1))]), -np.inf, -base)
    chains = LinearConstraint(np.hstack([_chains(options), np.zeros((len(_chains(options)), 1))]), 0, 1)
    cost = np.append(np.array([o.cost_us for o in options]) * 1e-6, 1.0)
    result = milp(
        cost,
        constraints=[moments, chains],
        integrality=np.append(np.ones(n), 0),
        bounds=Bounds(np.zeros(n + 1), np.append(np.ones(n), np.inf)),
        options={"time_limit": _MILP_SECONDS},
    )
    chosen = [] if result.x is None else [i for i in range(n) if result.x[i] > 0.5]
    activation = {options[i].module: options[i].policy for i in chosen}
    return activation, predictor.predict(Plan(precision=dict(precision), activation=activation))


def greedy_activation(
    predictor: Predictor, precision: Mapping[str, str], memory_budget: int
) -> ActivationChoice:
    """Take options in order of bytes freed per microsecond of cost, each kept only if the
    predictor's estimate of the plan so far says the peak went down, until the budget is met."""
    began = time.perf_counter()
    options, refused = activation_options(predictor, precision)
    activation: dict[str, str] = {}
    peak = predictor.estimate(precision).peak_bytes
    for option in sorted(options, key=lambda o: -o.freed_bytes / (o.cost_us + 1.0)):
        if peak <= memory_budget:
            break
        if option.module in activation or nested_pairs([*activation, option.module]):
            continue
        trial = {**activation, option.module: option.policy}
        estimate = predictor.estimate(precision, trial)
        if estimate.peak_bytes < peak:
            activation, peak = trial, estimate.peak_bytes
    prediction = predictor.predict(Plan(precision=dict(precision), activation=activation))
    feasible = prediction.peak_bytes <= memory_budget
    return ActivationChoice(
        activation, prediction, feasible, refused, options, "greedy", time.perf_counter() - began
    )
