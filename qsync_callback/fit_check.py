"""Will the run fit? Checked before its first step, on a symbolic trace of it (`estimate.py`).

The peak of one training step traced on fake tensors at the Trainer's precision (no real
compute, no memory; its ops priced as `estimate` prices them, but none timed alone and no kernel's
scratch measured: the run is live, and those run in a child process) is compared with the memory
budget given in bytes (a budget given as a share of the recorded peak cannot be
resolved before anything is recorded, and is said to be skipped) and with the device's memory:
a CUDA device's total memory, or the machine's physical memory for the CPU. Where the step does
not fit, the activation planner (`planner/memory_plan.py`, recompute only: offload's copy costs
are measured in a real run) is run on the same symbolic trace for a plan that would fit, or the
least peak it reaches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qsync_callback.errors import QSyncInputError
from qsync_callback.estimate import estimate_trace
from qsync_callback.plan import Constraints
from qsync_callback.planner.memory_plan import describe_plan, plan_memory
from qsync_callback.predictor.predict import Predictor
from qsync_callback.units import format_bytes


class DoesNotFit(QSyncInputError):
    """The run's symbolic peak is over its memory budget or its device's memory (``strict=True``)."""


@dataclass
class FitCheck:
    """The symbolic peak against the limits it was checked against, and a plan that fits."""

    peak_bytes: int
    limits: dict[str, int]  # what the peak was checked against, by name
    skipped: list[str]  # limits that could not be checked, and why
    fits: bool
    plan_text: str | None = None  # a plan that would fit, or the closest one, in words

    def message(self) -> str:
        checked = ", ".join(f"{name} {format_bytes(limit)}" for name, limit in self.limits.items())
        head = f"predicted peak {format_bytes(self.peak_bytes)} (symbolic, before step 1)"
        lines = [f"{head} {'fits' if self.fits else 'is over'} {checked}"]
        lines += self.skipped
        if self.plan_text:
            lines.append(self.plan_text)
        return "; ".join(lines)


def device_memory_bytes(device: str) -> int:
    """The memory of ``device``: a CUDA device's total, or the machine's physical memory."""
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fit(
    module: nn.Module,
    batch: Any,
    constraints: Constraints,
    device: str = "cpu",
    processes: int = 1,
    precision: str | int = "32-true",
) -> FitCheck:
    """``module``'s step on ``batch`` traced symbolically at the Trainer's ``precision``, its peak
    checked against ``constraints.memory_budget`` and ``device``'s memory, shared by ``processes``
    on the CPU (see the module docstring)."""
    # no child process in a live run: no op timed alone, no kernel's scratch measured
    trace = estimate_trace(module, batch, device, probe_seconds=0.0, scratch_seconds=0.0, precision=precision)
    peak = Predictor([trace]).predict().peak_bytes
    if device.startswith("cuda") or processes <= 1:
        limits = {f"the device's memory ({device})": device_memory_bytes(device)}
    else:
        shared = f"the machine's memory shared by {processes} processes"
        limits = {shared: device_memory_bytes(device) // processes}
    skipped = []
    if constraints.memory_budget is not None:
        limits = {"the memory budget": constraints.memory_budget, **limits}
    elif constraints.memory_budget_share is not None:
        skipped.append(
            f"the budget of {100 * constraints.memory_budget_share:g}% is a share of the recorded peak, "
            "not checked before one is recorded"
        )
    limit = min(limits.values())
    check = FitCheck(peak, limits, skipped, peak <= limit)
    if not check.fits:
        check.plan_text = _fitting_plan(trace, constraints, limit)
    return check


def _fitting_plan(trace: Any, constraints: Constraints, limit: int) -> str:
    if "activation" not in constraints.levers:
        return "no plan was looked for: the activation lever is not allowed (levers=...)"
    wanted = Constraints(memory_budget=limit, levers=("activation",), best_effort=True)
    choice = plan_memory([trace], wanted)
    chosen = choice.chosen
    if not chosen.plan.activation:
        return "no activation plan lowers the peak"
    policies = describe_plan(chosen.plan)
    prediction = chosen.prediction
    figures = f"predicted peak {format_bytes(prediction.peak_bytes)}, step {prediction.step_ms:.1f} ms"
    if choice.feasible:
        return f"a plan that fits: {policies} ({figures})"
    return f"no activation plan fits; the closest: {policies} ({figures})"
