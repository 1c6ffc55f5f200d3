"""Choose which op types run at low precision (a per-op-type plan, TF's auto-mixed-precision unit),
by predicted step time.

The plan decides the op types whose every recorded op was measured at the low precision (under
the framework's own rewrite, so the framework judged each of them safe where it stands) and that
the caller does not exclude (the framework's deny list: losses, softmax, reductions, unless the
user asks for them); other op types are left to the framework. An op type slower at the low
precision is not ruled out by its own time: between two low-precision neighbours it can still save
more in casts than it costs (the CNN's ReluGrad on this project's CPU), so the predictor decides.
Every subset of up to `EXHAUSTIVE_MAX` decided types is priced by the predictor (scaled ops, cast
nodes, replay); above that, a greedy search from all-fp32 adds one op type at a time, the one that
lowers the predicted step the most, while any does. The search ranks subsets on one recorded step
(`Predictor.typical_step`, the quick figure for ranking plans); the chosen one is priced on every
recorded step. Types left out stay at fp32, and the plan says so (``candidates`` lists the types
measured faster at the low precision, for the record).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from qsync_callback.plan import FULL_PRECISION, Plan
from qsync_callback.predictor.op_precision import op_type_table, uniform_op_types
from qsync_callback.predictor.predict import Prediction, Predictor

EXHAUSTIVE_MAX = 6
LOW_PRECISION = "bf16"
# TF 2.15's oneDNN bfloat16 deny list of numerically dangerous ops (AutoMixedPrecisionListsMkl)
TF_BF16_DENYLIST = frozenset(
    {
        "Exp",
        "Expm1",
        "L2Loss",
        "Mean",
        "Pow",
        "SaveV2",
        "SoftmaxCrossEntropyWithLogits",
        "SparseSoftmaxCrossEntropyWithLogits",
    }
)
# never planned into bf16 unless asked: the deny list, softmax and the reductions TF leaves unlisted
UNSAFE_OP_TYPES = TF_BF16_DENYLIST | {"Softmax", "LogSoftmax", "Sum", "Prod"}


@dataclass
class OpTypeChoice:
    """The chosen op-type plan, its prediction, and the search behind it."""

    plan: Plan
    prediction: Prediction
    candidates: list[str]
    plans_priced: int
    search: str


def candidate_op_types(predictor: Predictor, decided: Iterable[str], low: str = LOW_PRECISION) -> list[str]:
    """The ``decided`` op types measured faster at ``low`` than at fp32."""
    costs = op_type_table(predictor.traces[0]).get("costs", {})
    return sorted(t for t in decided if costs[t][f"{low}_us"] < costs[t][f"{FULL_PRECISION}_us"])


def measured_op_types(predictor: Predictor, low: str = LOW_PRECISION) -> list[str]:
    """Op types measured at ``low`` on every one of their ops (what the framework's own rewrite ran
    there): the per-op-type picture of its uniform rewrite."""
    return uniform_op_types(op_type_table(predictor.traces[0]), low)


def choose_op_precision(
    predictor: Predictor, plan: Plan, exclude: Iterable[str] = (), low: str = LOW_PRECISION
) -> OpTypeChoice:
    """The fastest predicted op-type plan over the candidates (see the module docstring); ``plan``
    gives the fingerprint. An empty choice (nothing predicted faster) keeps every type at fp32."""
    decided = sorted(set(measured_op_types(predictor, low)) - set(exclude))

    def make(chosen: Iterable[str]) -> Plan:
        chosen = set(chosen)
        decisions = {t: low if t in chosen else FULL_PRECISION for t in decided}
        return Plan(fingerprint=dict(plan.fingerprint), op_precision=decisions)

    def price(trial: Plan) -> Prediction:
        return predictor.predict(trial, steps=[predictor.typical_step])

    best_plan = make(())
    best = price(best_plan)
    priced = 1
    if len(decided) <= EXHAUSTIVE_MAX:
        search = "exhaustive"
        for size in range(1, len(decided) + 1):
            for subset in itertools.combinations(decided, size):
                trial = make(subset)
                prediction = price(trial)
                priced += 1
                if prediction.step_ms < best.step_ms:
                    best_plan, best = trial, prediction
    else:
        search = "greedy"
        chosen: list[str] = []
        while True:
            moves = []
            for t in decided:
                if t not in chosen:
                    trial = make([*chosen, t])
                    moves.append((price(trial), t, trial))
                    priced += 1
            if not moves:
                break
            prediction, t, trial = min(moves, key=lambda m: m[0].step_ms)
            if prediction.step_ms >= best.step_ms:
                break
            chosen.append(t)
            best_plan, best = trial, prediction
    return OpTypeChoice(
        best_plan, predictor.predict(best_plan), candidate_op_types(predictor, decided, low), priced, search
    )
