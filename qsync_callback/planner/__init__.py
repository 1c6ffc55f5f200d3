"""Planners: search over Plans with the predictor as the judge; `choose.choose_plan` runs those
whose levers are allowed and whose inputs the traces carry."""

from __future__ import annotations

from dataclasses import dataclass

from qsync_callback.plan import Plan

# a planner proposes a plan only where it is predicted faster by more than this share: what verify
# lets a plan lose before it rolls it back (`verify.SLOWER_TOLERANCE`), so that a plan priced within
# it is not decided by its pricing's noise
NO_DECISION_GAIN = 0.02


@dataclass
class PlanChoice:
    """A planner's result: the chosen plan (with its prediction and constraints), whether it meets
    the constraints, and the table printed for the user."""

    plan: Plan
    feasible: bool
    table: str
