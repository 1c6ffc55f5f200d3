"""Planners: search over Plans with the predictor as the judge; `choose.choose_plan` runs those
whose levers are allowed and whose inputs the traces carry."""

from __future__ import annotations

from dataclasses import dataclass

from qsync_callback.plan import Plan


@dataclass
class PlanChoice:
    """A planner's result: the chosen plan (with its prediction and constraints), whether it meets
    the constraints, and the table printed for the user."""

    plan: Plan
    feasible: bool
    table: str
