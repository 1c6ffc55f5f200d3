"""What an offload costs inside this run's steps, measured once the recorded window has closed.

The copy-cost fit (`copy_costs.py`) times the store's copies alone: a tensor put in the store and
got back in a loop of nothing else. Inside a training step the same copies cost more on the CPU's
disk tier. Measured on a 2-core VM (Lightning, offload in turns with the recorded configuration, 8
rounds): the step paid 1.6-2.7 times the fit's price on a residual CNN (10-43 MiB of 4 MiB tensors)
and 1.4-1.5 times on a decoder (24 MiB of 1 MiB tensors), so the fit alone priced offload at half
its cost and the planner chose it where a recompute ran faster. Part of it is glibc's: in a plain
loop of the CNN the steps with offload took 2,000-4,000 more page faults each (memory the allocator
mapped afresh), and the reads back ran at 3 GB/s against the fit's 9-12; with the allocator kept
from handing memory back (``mallopt``), no faults, the step still paid 1.5-2 times the copies' own
time, beyond the copies in both forward and backward.

`OffloadTrial` measures that factor on the run itself: for `TRIAL_ROUNDS` rounds the recorded
configuration and an offload of `trial_modules` (every module a policy can reach, the outermost
ones: the most bytes, so the change stands well above the step's noise) run in turns, each block
`alternation.SETTLE_STEPS` untimed steps after the switch and `alternation.BLOCK_STEPS` timed ones
(the schedule and the change of `alternation.py`, so that a drift of the machine's speed cancels
in each round). While the change's noise is over `PRECISE_ENOUGH` of it, the trial goes on by as
many rounds again, up to `alternation.LOOKS` times as many (a 2-core VM measured a residual CNN's
factor at 1.26, 2.27 and 2.20 in three launches of 6 rounds, the first two with noise of a third of
the change). The factor is the step-time change over what the fit prices for the copies the
store made in the trial's timed steps (``copies * alpha + bytes * beta`` each way, by the store's
own counts). The pricing multiplies each copy by it (`predictor.activation`). Where the change is
within its noise the trial calibrates nothing and says so; a trial that fails (a module refused, a
store that cannot write) is undone at once and says why.

The result is plain JSON (``Trace.activation_costs["copy"]["in_step"]``)::

    {"modules": ["net"], "rounds": 6, "baseline_ms": 70.1, "change_ms": 24.9, "noise_ms": 2.3,
     "copies_per_step": {"to_store": 20, "from_store": 20}, "bytes_per_step": {...},
     "priced_ms": 15.9, "factor": 1.57}

or ``{"modules": [...], "factor": null, "note": "why not"}``. Only the CPU's disk tier is tried:
on CUDA the copies run on a side stream beside the step and the replay's copy lane prices them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from qsync_callback.alternation import BASELINE, PLAN, Alternation, BlockTimes, paired_change
from qsync_callback.plan import OFFLOAD, Plan, module_layers
from qsync_callback.recorder.copy_costs import copies_us
from qsync_callback.recorder.trace import Trace

TRIAL_ROUNDS = 6
PRECISE_ENOUGH = 0.2  # the change's noise, as a share of it, under which the trial stops
DIRECTIONS = ("to_store", "from_store")

Undo = Callable[[], None]


class OffloadApplier(Protocol):
    """What the trial needs of the activation applier (`appliers.torch_activation.ActivationApplier`)."""

    def __call__(self, plan: Plan) -> Undo: ...

    def step_stats(self) -> Mapping[str, Mapping[str, Any]]: ...

    def failure(self) -> str | None: ...


def trial_modules(layers: Iterable[str], refused: Mapping[str, str]) -> list[str]:
    """The modules a trial offloads: of the modules holding ``layers`` that may take a policy (not in
    ``refused``), the outermost ones (none of their enclosing modules may take one)."""
    candidates = {name for name in module_layers(layers) if name not in refused}

    def enclosed(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:k]) in candidates for k in range(1, len(parts)))

    return sorted(name for name in candidates if not enclosed(name))


def offload_trial_for(
    applier: OffloadApplier, rounds: int = TRIAL_ROUNDS, looks: bool = True
) -> Callable[[Trace], OffloadTrial | None]:
    """What a recorder asks for the trial of its window once it has closed (``TorchRecorder``'s
    ``offload_trial``): of ``trace``'s outermost modules that may take a policy, through
    ``applier``, against the trace's copy-cost fit; None on a tier other than the CPU's disk."""

    def trial_of(trace: Trace) -> OffloadTrial | None:
        copy = trace.activation_costs.get("copy") or {}
        if copy.get("tier") != "disk":
            return None
        refused = trace.activation_costs["refused"]  # recorded with the copy costs
        modules = trial_modules([layer["name"] for layer in trace.layers], refused)
        return OffloadTrial(applier, modules, copy, rounds, looks)

    return trial_of


class OffloadTrial:
    """One rank's trial (see the module docstring) of offloading ``modules`` through ``applier``,
    whose stores' counts (`OffloadStore.step_stats`) give what moved; ``fit`` is the copy-cost fit
    the factor is taken against. ``looks``: the trial may go on while its change is too noisy;
    never under several ranks, whose windows must end at one step (each would look at its own)."""

    def __init__(
        self,
        applier: OffloadApplier,
        modules: list[str],
        fit: Mapping[str, Any],
        rounds: int = TRIAL_ROUNDS,
        looks: bool = True,
    ):
        self.modules = modules
        self._looks = looks  # may go on while too noisy: one process (ranks would part ways)
        self._note: str | None = None if modules else "no module can take a policy"
        self.finished = not modules  # nothing to try: over before it starts, in no step
        self._applier = applier
        self._fit = fit
        # run so far, or to be run (one look's worth more while too noisy); none without a module
        self._rounds = rounds if modules else 0
        self._times = BlockTimes(Alternation(rounds))
        self._undo: Undo | None = None
        self._moved = {"copies": dict.fromkeys(DIRECTIONS, 0.0), "bytes": dict.fromkeys(DIRECTIONS, 0.0)}
        self._timed_plan_steps = 0

    @property
    def steps(self) -> int:
        """The boundaries the trial takes so far: its rounds' blocks, then the one that ends the last
        (more at a look that finds the change too noisy)."""
        return 2 * self._rounds * self._times.alternation.block_length

    def boundary(self, step: int) -> None:
        """Boundary ``step`` of the trial (0 starts it, `steps` ends it): time the step that ended,
        count what its copies moved, and switch where a block starts. A trial stopped short (its
        offload refused or failed) is undone at once and idles to its planned end."""
        if self.finished:
            return
        if self._note is None:
            self._times.boundary(step)
            moved = self._applier.step_stats()
            block = self._times.alternation.timed_block(step)
            if block is not None and block[1] == PLAN:
                self._count(moved)
                fault = self._applier.failure()
                if fault is not None:
                    self._note = f"the trial's offload failed: {fault}"
        if step == self.steps:
            self._look()
        switch = self._times.alternation.switch_at(step)
        if self.finished or self._note is not None or switch == BASELINE:
            self.close()
        elif switch == PLAN:
            try:
                self._undo = self._applier(Plan(activation=dict.fromkeys(self.modules, OFFLOAD)))
            except Exception as error:  # noqa: BLE001 - refused or failed: the trial calibrates nothing
                self._note = f"the trial's offload could not be applied: {error}"
        self._times.restart()

    def _look(self) -> None:
        """At the end of the rounds planned: finished; or, where looks are allowed, as many rounds
        again while the change's noise is over `PRECISE_ENOUGH` of it and the schedule has rounds
        left."""
        first = self._times.alternation.rounds
        if self._looks and self._note is None and self._rounds + first <= self._times.alternation.most_rounds:
            change = paired_change([self._times.times])
            if change["change_pct"] is not None and change["noise_pct"] > PRECISE_ENOUGH * abs(
                change["change_pct"]
            ):
                self._rounds += first
                return
        self.finished = True

    def _count(self, moved: Mapping[str, Mapping[str, Any]]) -> None:
        self._timed_plan_steps += 1
        for stats in moved.values():
            for direction in DIRECTIONS:
                self._moved["copies"][direction] += stats[direction]["copies"]
                self._moved["bytes"][direction] += stats[direction]["bytes"]

    def stop(self, why: str) -> None:
        """End the trial short (training ended before its last round): undone, ``why`` its note."""
        if not self.finished:
            self._note = self._note or why
            self.finished = True
        self.close()

    def close(self) -> None:
        """Undo the trial's offload, if it is in force (the trial is over, or the window ends early)."""
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def result(self) -> dict[str, Any]:
        """The trial's figures and factor (see the module docstring)."""
        out: dict[str, Any] = {"modules": list(self.modules), "rounds": self._rounds, "factor": None}
        if self._note is not None:
            return {**out, "note": self._note}
        change = paired_change([self._times.times])
        steps = max(self._timed_plan_steps, 1)
        copies = {d: n / steps for d, n in self._moved["copies"].items()}
        nbytes = {d: n / steps for d, n in self._moved["bytes"].items()}
        out.update(copies_per_step=copies, bytes_per_step=nbytes)
        if change["change_pct"] is None:
            return {**out, "note": "no round of the trial was timed"}
        baseline_ms = statistics.median(change["baseline_ms"])
        change_ms = change["change_pct"] / 100 * baseline_ms
        noise_ms = change["noise_pct"] / 100 * baseline_ms
        priced_ms = sum(copies_us(self._fit, d, nbytes[d], copies[d]) for d in DIRECTIONS) / 1e3
        out.update(baseline_ms=baseline_ms, change_ms=change_ms, noise_ms=noise_ms, priced_ms=priced_ms)
        if priced_ms <= 0:
            return {**out, "note": "the trial's offload moved nothing"}
        if change_ms <= noise_ms:
            return {
                **out,
                "note": f"the step's change ({change_ms:+.2f} ms) is within its noise (+-{noise_ms:.2f} ms)",
            }
        return {**out, "factor": change_ms / priced_ms}
