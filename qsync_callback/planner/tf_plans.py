"""Choose the plan for a TensorFlow run: mixed precision by op type and Horovod's gradient groups,
by predicted step time.

The candidates are Plans, each priced by the predictor (`Predictor.predict`) on the recorded traces:

- bf16, uniform: every op type TF's uniform bf16 rewrite ran at bf16 (the recorder's op-type
  probe, ``precision_costs["op_types"]``), at bf16: TF's own choice, said per op type;
- bf16 by op type: the op types whose bf16 time pays for its casts (`op_precision.py`; TF's deny
  list, softmax and reductions stay fp32);
- gradient groups (more than one process, traces with Horovod's timeline): the fastest predicted
  grouping (`tensor_fusion.choose_groups`);
- each bf16 plan and the groups together.

The lever "precision" (with "bf16" among the precisions) allows the bf16 plans, "buckets" the
groups. Of the plans that meet the constraints (``max_step_ms``; ``memory_budget`` on the predicted
peak: TF's allocator simulated on the recorded allocations, an op-type plan's made smaller where
its ops run at bf16 and its casts added, `op_precision.py`), the fastest of those with the fewest
decisions no recorded step ran (`unseen`: an op-type set other than the one TF's uniform rewrite
ran, which the bf16 probe profiled; gradient groups) is chosen, unless one with more is predicted
faster than it by `UNSEEN_MARGIN` for each decision it adds, beyond the noise of that difference
over the recorded steps (`preferred`, `beats`): a prediction of a configuration nothing ran carries
an error that a smaller difference does not beat, and a difference the recorded steps disagree on
is no difference. On two Horovod processes sharing two cores, three identical launches picking the
fastest predicted plan chose three plans; the one whose op types left the convolutions' input
gradients, `MaxPoolGrad` and `ReluGrad` in fp32 was predicted 20% faster than the recorded
configuration and measured 29% slower in turns (casts and layout conversions around the fp32 ops,
which the probe never ran). With one margin for any number of unseen decisions and no noise, three
identical two-process MLP launches still chose three plans (uniform bf16, with gradient groups, and
bf16 `MatMul` alone with groups): re-priced, one launch's groups moved from a saving to a cost
over its five recorded steps. The chosen plan must be predicted more than `NO_DECISION_GAIN` faster than
the recorded configuration; otherwise the recorded configuration (an empty plan) is chosen: a
smaller predicted difference is no decision, unless the bf16 probe's turns cannot tell TF's
uniform rewrite from a gain over `NO_DECISION_GAIN` (their change's band reaching past it, on
whichever side of 0 the change is: `untold_gain`, `rewrite_to_try`): then the rewrite is chosen still, to be
tried, and verify's turns decide on it (they keep a gain told apart from the noise and otherwise
the cheaper configuration; the cost is their rounds on a plan that may change nothing). On two
Horovod processes sharing two cores, a launch whose replay priced the rewrite under that gain, its
probe's band reaching past it, planned nothing while identical launches kept the rewrite; and
with a gain required of the probe's change itself, one whose probe measured +9.3% +- 19.8 did. None
meeting the constraints: the closest, which the loop applies only under ``best_effort``. A memory
budget on traces that predict no peak (TF recorded no allocations) is refused, with the reason.

In-sample, said so: the bf16 probe profiled TF's uniform rewrite (its own calls, after the
baseline's timed ones; `recorder/tf_op_types.py`), so a candidate whose bf16 op types are exactly
those the rewrite ran at bf16 is a configuration the probe already ran: its figure is the change
the probe's timed calls of it measured in turns with the recorded step, on the recorded
configuration's predicted step (`op_precision.rewrite_change`; where it timed none, or that figure
is within the two figures' combined band of it or its own of none, the probe's profiled op times
rebuilt on the recorded step), and its peak is its tensors' simulation calibrated on what TF's
allocator read in the probe's profiled and reading calls (`op_precision.rewrite_reading`), rather
than predicting an unseen configuration. Other op-type plans take the share of what those timed
calls measured over the rewrite's replay that their op types make of it
(`op_precision.changed_share`).
The table marks such a candidate (`reconstructs_probe`). Its verification (`verify.py`) still
measures it on calls of its own that feed no prediction.

Not proposed: Horovod's fusion threshold and cycle time, which Horovod reads at ``hvd.init()``
(the fastest predicted ones are shown with how to launch with them, `tensor_fusion.next_launch`);
and XLA (a fused region over the whole step), which the predictor cannot price yet (a cost model
for fused regions is issue 14); a given plan with one is still applied.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from qsync_callback.errors import QSyncInputError
from qsync_callback.mean_band import mean_band
from qsync_callback.plan import Constraints, Plan
from qsync_callback.planner import NO_DECISION_GAIN, PlanChoice
from qsync_callback.planner.op_precision import (
    LOW_PRECISION,
    UNSAFE_OP_TYPES,
    choose_op_precision,
    measured_op_types,
)
from qsync_callback.planner.tensor_fusion import choose_groups, choose_settings, next_launch
from qsync_callback.predictor.memory import unpredictable_peak
from qsync_callback.predictor.op_precision import rewrite_change
from qsync_callback.predictor.predict import Prediction, Predictor
from qsync_callback.predictor.tensor_fusion import can_price_fusion
from qsync_callback.recorder.trace import OP_TYPE_COSTS, Trace
from qsync_callback.units import format_bytes

RECORDED = "recorded configuration"
# a plan must be predicted this much faster for each decision no recorded step ran that it adds to
# be chosen over one without it (`preferred`)
UNSEEN_MARGIN = 0.05


RECONSTRUCTION = "reconstruction"


def reconstructs_probe(traces: Sequence[Trace], plan: Plan) -> bool:
    """Whether ``plan``'s bf16 op types are exactly the types TF's uniform rewrite ran at bf16 on
    every op (`op_precision.measured_op_types`), which the bf16 probe profiled and timed: its bf16
    figure is then the probe's calls' own (module docstring)."""
    return _reconstructs(plan, measured_op_types(Predictor(traces)))


def _reconstructs(plan: Plan, uniform: list[str]) -> bool:
    low = sorted(t for t, p in plan.op_precision.items() if p == LOW_PRECISION)
    return bool(low) and low == uniform


def has_tf_candidates(traces: Sequence[Trace]) -> bool:
    """Whether the traces carry what these candidates are priced on (op-type costs, or Horovod's
    settings)."""
    if not traces:
        return False
    return OP_TYPE_COSTS in traces[0].precision_costs or traces[0].communication.get("library") == "horovod"


def choose_tf_plan(traces: Sequence[Trace], constraints: Constraints) -> PlanChoice:
    """The best plan for ``traces`` under ``constraints`` (a memory budget in bytes by now), see
    the module docstring. Raises QSyncInputError when no candidate can be proposed, saying why."""
    budgeted = constraints.budgeted
    why_not = next((why for why in map(unpredictable_peak, traces) if why), None)
    if budgeted and why_not:
        raise QSyncInputError(f"a memory budget cannot be honoured: {why_not}")
    predictor = Predictor(traces)
    fingerprint = traces[0].fingerprint
    notes: list[str] = []
    candidates = [(RECORDED, Plan.empty(fingerprint))]
    op_types = _op_type_plans(predictor, constraints, notes)
    groups = _groups_plan(predictor, constraints, notes)
    candidates += op_types + ([groups] if groups else [])
    if groups:
        for name, bf16 in op_types:
            both = Plan(
                fingerprint=dict(fingerprint), op_precision=bf16.op_precision, buckets=groups[1].buckets
            )
            candidates.append((f"{name} + {groups[0]}", both))
    if len(candidates) == 1:
        raise QSyncInputError("no TF plan to propose: " + "; ".join(notes))
    priced = _unique([(name, plan, predictor.predict(plan)) for name, plan in candidates])
    recorded, feasible = priced[0], [c for c in priced if _meets(c[2], constraints)]
    eligible = feasible or priced  # none meets the constraints: the closest, for best_effort
    uniform = measured_op_types(predictor)
    plans = [c for c in eligible if c is not recorded]
    best = preferred(plans, uniform) if plans else recorded
    if recorded in eligible and best[2].step_ms >= recorded[2].step_ms * (1 - NO_DECISION_GAIN):
        measured = rewrite_change(traces)
        tried = rewrite_to_try(feasible, uniform, measured)
        if tried is not None:
            notes.append(to_try_note(tried, recorded[2], measured))
        best = tried or recorded
    plan = Plan.from_dict(best[1].to_dict())
    plan.prediction = best[2].figures()
    plan.constraints = constraints.to_dict()
    rebuilt = {name for name, candidate, _ in priced if _reconstructs(candidate, uniform)}
    if rebuilt:
        notes.append(
            f"{RECONSTRUCTION}: TF's uniform bf16 rewrite, which the bf16 probe profiled and timed; the "
            "figure is the change the probe's timed calls measured in turns with the recorded step (its "
            "profiled op times rebuilt on the recorded step where it timed none, where that change is "
            "within its noise of them or of none), and "
            "its peak is calibrated on what the allocator read in the probe's calls (in-sample figures, "
            "not a prediction of an unseen configuration)"
        )
    return PlanChoice(plan, best in feasible, _table(priced, best[0], notes, rebuilt))


def untold_gain(measured: Mapping[str, Any] | None) -> bool:
    """Whether ``measured``, the bf16 probe's change of TF's uniform rewrite in turns
    (`op_precision.rewrite_change`: ``change_pct`` and ``noise_pct``), cannot be told from a gain
    larger than `NO_DECISION_GAIN`: the change less its noise below -`NO_DECISION_GAIN`, whichever
    side of 0 the change itself is (a band that wide says nothing of its sign: two-process MLP
    launches measured -10.6% +- 19.4 and +9.3% +- 19.8 on one rewrite)."""
    if measured is None:
        return False
    return measured["change_pct"] - measured["noise_pct"] < -100 * NO_DECISION_GAIN


def rewrite_to_try(
    feasible: Sequence[tuple[str, Plan, Prediction]], uniform: list[str], measured: Mapping[str, Any] | None
) -> tuple[str, Plan, Prediction] | None:
    """Where no plan is predicted `NO_DECISION_GAIN` faster: of the candidates meeting the
    constraints, TF's uniform rewrite alone (``uniform``'s op types at bf16, no groups) where the
    probe ``measured`` it as an `untold_gain`; else None."""
    if not untold_gain(measured):
        return None
    return next((c for c in feasible if _reconstructs(c[1], uniform) and not c[1].buckets), None)


def to_try_note(
    rewrite: tuple[str, Plan, Prediction], recorded: Prediction, measured: Mapping[str, Any]
) -> str:
    """What the table says of a `rewrite_to_try` chosen."""
    return (
        f"to try: {rewrite[0]} is predicted {100 * (rewrite[2].step_ms / recorded.step_ms - 1):+.1f}%, "
        f"under the {100 * NO_DECISION_GAIN:g}% that decides, but the bf16 probe measured it "
        f"{measured['change_pct']:+.1f}% +- {measured['noise_pct']:.1f} in turns with the recorded step: "
        "a gain not told from a larger one; verify's turns decide on it"
    )


def unseen(plan: Plan, uniform: list[str]) -> int:
    """How many of ``plan``'s decisions no recorded step ran: an op-type set other than ``uniform``
    (the types TF's uniform rewrite ran at bf16, which the bf16 probe profiled), and gradient
    groups."""
    return int(bool(plan.op_precision) and not _reconstructs(plan, uniform)) + int(bool(plan.buckets))


def preferred(
    priced: Sequence[tuple[str, Plan, Prediction]], uniform: list[str]
) -> tuple[str, Plan, Prediction]:
    """Of ``priced``, the fastest predicted of those with the fewest `unseen` decisions; then, level
    by level of more unseen decisions, the fastest of a level's plans that each `beats` the one
    chosen so far by `UNSEEN_MARGIN` for every unseen decision it adds, if any does."""
    levels = sorted({unseen(c[1], uniform) for c in priced})
    best = min((c for c in priced if unseen(c[1], uniform) == levels[0]), key=lambda c: c[2].step_ms)
    for level in levels[1:]:
        margin = 100 * UNSEEN_MARGIN * (level - unseen(best[1], uniform))
        beating = [c for c in priced if unseen(c[1], uniform) == level and beats(c[2], best[2], margin)]
        if beating:
            best = min(beating, key=lambda c: c[2].step_ms)
    return best


def beats(plan: Prediction, other: Prediction, margin_pct: float) -> bool:
    """Whether ``plan`` is predicted faster than ``other`` by more than ``margin_pct`` beyond the
    noise of that difference: their change recorded step by recorded step (both are priced on the
    same steps), its mean's 95% band (`mean_band.mean_band`) over the steps."""
    changes = [
        100 * (mine / theirs - 1)
        for mine, theirs in zip(plan.replayed_step_ms, other.replayed_step_ms, strict=True)
    ]
    return statistics.fmean(changes) + mean_band(changes) < -margin_pct


def uniform_plan(predictor: Predictor) -> Plan:
    """TF's uniform bf16 rewrite as an op-type plan: every op type it ran at bf16 on all its ops
    (`op_precision.measured_op_types`), at bf16."""
    uniform = dict.fromkeys(measured_op_types(predictor), LOW_PRECISION)
    return Plan(fingerprint=dict(predictor.traces[0].fingerprint), op_precision=uniform)


def _op_type_plans(
    predictor: Predictor, constraints: Constraints, notes: list[str]
) -> list[tuple[str, Plan]]:
    """The uniform and the op-type bf16 plans, where the lever and the traces allow them."""
    if "precision" not in constraints.levers or LOW_PRECISION not in constraints.precisions:
        notes.append("bf16 plans: not allowed (levers/precisions)")
        return []
    table = predictor.traces[0].precision_costs.get(OP_TYPE_COSTS, {})
    if not table.get("costs"):
        why = table.get("note") or "TF's bf16 rewrite changed no op of the step on this machine"
        notes.append(f"bf16 plans: {why}")
        return []
    fingerprint = dict(predictor.traces[0].fingerprint)
    uniform = uniform_plan(predictor)
    plans = [(f"bf16 uniform ({len(uniform.op_precision)} op types)", uniform)]
    choice = choose_op_precision(predictor, Plan(fingerprint=fingerprint), UNSAFE_OP_TYPES)
    low = sorted(t for t, p in choice.plan.op_precision.items() if p == LOW_PRECISION)
    if low:
        plans.append((f"bf16 op types ({', '.join(low)})", choice.plan))
    return plans


def _groups_plan(predictor: Predictor, constraints: Constraints, notes: list[str]) -> tuple[str, Plan] | None:
    """The fastest predicted gradient grouping, where the lever and the traces allow it; the
    fusion settings for the next launch go into ``notes``."""
    if "buckets" not in constraints.levers:
        notes.append("gradient groups: not allowed (levers)")
        return None
    why = can_price_fusion(predictor.traces)
    if why is not None:
        notes.append(f"gradient groups: {why}")
        return None
    settings = choose_settings(predictor)
    if settings.prediction.step_ms < settings.baseline.step_ms:
        best = settings.plan.communication
        notes.append(
            f"fusion threshold {best['fusion_threshold_bytes'] / 2**20:g} MiB and cycle time "
            f"{best['cycle_time_ms']:g} ms predicted {settings.prediction.step_ms:.2f} ms (recorded "
            f"settings {settings.baseline.step_ms:.2f}); Horovod reads them at hvd.init(): launch with "
            f"{next_launch(best)}"
        )
    choice = choose_groups(predictor)
    if choice is None:
        notes.append("gradient groups: a single all-reduced gradient")
        return None
    return f"gradient groups ({len(choice.plan.buckets)})", choice.plan


def _meets(prediction: Prediction, constraints: Constraints) -> bool:
    fast = constraints.max_step_ms is None or prediction.step_ms <= constraints.max_step_ms
    fits = constraints.memory_budget is None or prediction.peak_bytes <= constraints.memory_budget
    return fast and fits


def _unique(priced: list[tuple[str, Plan, Prediction]]) -> list[tuple[str, Plan, Prediction]]:
    """The candidates without repeats of the same decisions (the first name kept)."""
    out, seen = [], []
    for name, plan, prediction in priced:
        decisions = (plan.op_precision, plan.buckets)
        if decisions not in seen:
            seen.append(decisions)
            out.append((name, plan, prediction))
    return out


def _table(
    priced: list[tuple[str, Plan, Prediction]], chosen: str, notes: list[str], rebuilt: set[str] = frozenset()
) -> str:
    recorded = priced[0][2].step_ms
    lines = [
        f"qsync TF plans ({len(priced)} priced by the predictor; XLA is not proposed: fused regions "
        "cannot be priced yet)"
    ]
    for name, _, prediction in priced:
        change = 100 * (prediction.step_ms / recorded - 1)
        mark = f"   ({RECONSTRUCTION})" if name in rebuilt else ""
        mark += "   <- chosen" if name == chosen else ""
        lines.append(
            f"  {name[:60]:<60} {prediction.step_ms:8.2f} ms predicted {change:+6.1f}%, "
            f"peak {format_bytes(prediction.peak_bytes)}{mark}"
        )
    lines += [f"  note: {note}" for note in notes]
    return "\n".join(lines)
