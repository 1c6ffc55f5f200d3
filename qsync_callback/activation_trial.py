"""What an activation policy costs inside this run's steps, measured once the recorded window has
closed: the offload trial, then the recompute trial.

The copy-cost fit (`copy_costs.py`) times the store's copies alone: a tensor put in the store and
got back in a loop of nothing else. Inside a training step the same copies cost more on the CPU's
disk tier (the trials' factors per recording: the memory plans table of `benchmarks/README.md`).

A recompute is priced as its module's recorded forward run again (`predictor.activation`). A step
pays more or less than that, and not the same share for every module or every process (the
recompute's allocations change how many page faults glibc's allocator takes): the trials' factors
per recording are in the same table.

Each trial (`OffloadTrial`, `RecomputeTrial`) applies its policy to `trial_modules` (every module a
policy can reach, the outermost ones: the most bytes and the longest forward, so the change stands
well above the step's noise; for the recompute, the blocks among them, `recompute_trial_modules`)
and runs it in turns with the recorded configuration for `TRIAL_ROUNDS` rounds, each block
`alternation.SETTLE_STEPS` untimed steps after the switch and `alternation.BLOCK_STEPS` timed ones
(the schedule and the change of `alternation.py`, so that a drift of the machine's speed cancels in
each round). While the change's noise is over `PRECISE_ENOUGH` of it, a trial goes on by as many
rounds again, up to `TRIAL_LOOKS` times as many (fewer looks than the loop's turns: a trial only
calibrates a price, and the planning waits for it). The change is the rounds' mean, or their
median where its noise is the smaller (`alternation.less_noisy_change`): an offload trial of the
benchmarks' ResNet to disk (45 MiB a step) measured +59 ms +-83 in its rounds' mean in one process
(session 20) and +21.9 +-2.2 in another (session 21), as the disk stalls a few rounds' blocks and
not the rest.
`TrialSequence` runs them one after the other.
Where the change is within its noise of nothing, a trial calibrates nothing and says so; the
recompute's also where it is within its noise of its price (`predictor.activation.price_stands`),
the offload's not: its price is the copy-cost fit, copies timed alone, which moves between
measurements by more than a trial's noise. On this project's 2-core VM (session 45, three runs of
`benchmarks/activation_costs.py`) the benchmarks' decoder's offload of its outermost modules was
priced at 14.6, 22.9 and 28.6 ms by three fits, while its cost measured in turns was 22.3, 27.0 and
26.0 ms; in two of the fits reading back 16 MiB took 10.7 ms and 32 MiB 5.3-5.5. So a trial's
change, measured inside the run's own steps, is the offload's price wherever it measured one.
A trial that fails (a module refused, a store that cannot write) is undone at once and says why.

- **Offload**: the factor is the step-time change over what the fit prices for the copies the store
  made in the trial's timed steps (``copies * alpha + bytes * beta`` each way, by the store's own
  counts); the pricing multiplies each copy by it. Its result is
  ``Trace.activation_costs["copy"]["in_step"]``::

    {"modules": ["net"], "rounds": 6, "baseline_ms": 70.1, "change_ms": 24.9, "noise_ms": 2.3,
     "estimate": "mean", "round_changes_ms": [...],
     "copies_per_step": {"to_store": 20, "from_store": 20}, "bytes_per_step": {...},
     "priced_ms": 15.9, "factor": 1.57}

  or ``{"modules": [...], "factor": null, "note": "why not"}``. Only the CPU's disk tier is tried:
  on CUDA the copies run on a side stream beside the step and the replay's copy lane prices them.
- **Recompute**: the trial measures the change alone, ``Trace.activation_costs["recompute"]
  ["in_step"]`` = ``{"modules": ["net"], "rounds": 6, "baseline_ms": 70.1, "change_ms": 27.0,
  "noise_ms": 1.9}`` (or with a ``"note"`` and no change where it cannot tell); the predictor takes
  its factor against its own price of the same recompute (`predictor.activation.recompute_trials`),
  as that price is made of the recorded op durations the recorder does not have at hand. It runs on
  every device.
"""

from __future__ import annotations

import abc
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

from qsync_callback.alternation import (
    BASELINE,
    PLAN,
    Alternation,
    BlockTimes,
    less_noisy_change,
    paired_change,
)
from qsync_callback.plan import OFFLOAD, RECOMPUTE, Plan, module_layers
from qsync_callback.recorder.copy_costs import DIRECTIONS, copies_us
from qsync_callback.recorder.trace import Trace

TRIAL_ROUNDS = 6
TRIAL_LOOKS = 3
# the change's noise, as a share of it, under which a trial stops: a price is no closer than its
# trial's noise, and an offload's time cost is to be priced within 10% (issue 13)
PRECISE_ENOUGH = 0.1

Undo = Callable[[], None]


class TrialApplier(Protocol):
    """What a trial needs of the activation applier (`appliers.torch_activation.ActivationApplier`)."""

    def __call__(self, plan: Plan) -> Undo: ...

    def step_stats(self) -> Mapping[str, Mapping[str, Any]]: ...

    def failure(self) -> str | None: ...


def trial_modules(layers: Iterable[str], refused: Mapping[str, str]) -> list[str]:
    """The modules a trial acts on: of the modules holding ``layers`` that may take a policy (not in
    ``refused``), the outermost ones (none of their enclosing modules may take one)."""
    candidates = {name for name in module_layers(layers) if name not in refused}

    def enclosed(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:k]) in candidates for k in range(1, len(parts)))

    return sorted(name for name in candidates if not enclosed(name))


def recompute_trial_modules(modules: Sequence[str], layers: Iterable[str]) -> list[str]:
    """The blocks among ``modules`` (those holding more than themselves as a layer); all of them if
    none is. A recompute trial's modules: a plan recomputes blocks (checkpointing a single layer
    frees little: it keeps its input), and a layer's recompute (an embedding, a head, the loss) may
    cost the step another share of its forward than a block's does. One factor does not fit every
    block either (the module docstring); a trial of the blocks inside a model's one container was
    tried in session 19 and priced a single block no better than the whole container's trial."""
    members = module_layers(layers)
    return [name for name in modules if members.get(name, frozenset({name})) != {name}] or list(modules)


def activation_trials_for(
    applier: TrialApplier, rounds: int = TRIAL_ROUNDS, looks: bool = True
) -> Callable[[Trace], TrialSequence]:
    """What a recorder asks for the trials of its window once it has closed (``TorchRecorder``'s
    ``trial``): of ``trace``'s outermost modules that may take a policy, through ``applier``, the
    offload trial (on the CPU's disk tier only, against the trace's copy-cost fit), then the
    recompute trial (of the blocks among them)."""

    def trials_of(trace: Trace) -> TrialSequence:
        refused = trace.activation_costs["refused"]  # recorded with the copy costs
        layers = [layer["name"] for layer in trace.layers]
        modules = trial_modules(layers, refused)
        trials: list[PolicyTrial] = []
        copy = trace.activation_costs.get("copy") or {}
        if copy.get("tier") == "disk":
            trials.append(OffloadTrial(applier, modules, copy, rounds, looks))
        trials.append(RecomputeTrial(applier, recompute_trial_modules(modules, layers), rounds, looks))
        return TrialSequence(trials)

    return trials_of


class PolicyTrial(abc.ABC):
    """One rank's trial (see the module docstring) of ``policy`` on ``modules`` through ``applier``.
    ``looks``: the trial may go on while its change is too noisy; never under several ranks, whose
    windows must end at one step (each would look at its own)."""

    policy: ClassVar[str]
    cost_key: ClassVar[str]  # where its result goes: Trace.activation_costs[cost_key]["in_step"]

    def __init__(
        self, applier: TrialApplier, modules: list[str], rounds: int = TRIAL_ROUNDS, looks: bool = True
    ):
        self.modules = modules
        self._looks = looks
        self._note: str | None = None if modules else "no module can take a policy"
        self.finished = not modules  # nothing to try: over before it starts, in no step
        self._applier = applier
        # run so far, or to be run (one look's worth more while too noisy); none without a module
        self._rounds = rounds if modules else 0
        self._times = BlockTimes(Alternation(rounds, looks=TRIAL_LOOKS))
        self._undo: Undo | None = None

    @property
    def steps(self) -> int:
        """The boundaries the trial takes so far: its rounds' blocks, then the one that ends the last
        (more at a look that finds the change too noisy)."""
        return 2 * self._rounds * self._times.alternation.block_length

    def boundary(self, step: int) -> None:
        """Boundary ``step`` of the trial (0 starts it, `steps` ends it): time the step that ended
        and switch where a block starts. A trial stopped short (its policy refused or failed) is
        undone at once and idles to its planned end."""
        if self.finished:
            return
        if self._note is None:
            self._times.boundary(step)
            block = self._times.alternation.timed_block(step)
            self._step_ended(block is not None and block[1] == PLAN)
        if step == self.steps:
            self._look()
        switch = self._times.alternation.switch_at(step)
        if self.finished or self._note is not None or switch == BASELINE:
            self.close()
        elif switch == PLAN:
            try:
                self._undo = self._applier(Plan(activation=dict.fromkeys(self.modules, self.policy)))
            except Exception as error:  # noqa: BLE001 - refused or failed: the trial calibrates nothing
                self._note = f"the trial's {self.policy} could not be applied: {error}"
        self._times.restart()

    def _step_ended(self, timed_plan_step: bool) -> None:
        """What the trial notes of the step that ended (``timed_plan_step``: one of the plan's timed
        steps): a fault of the policy in force."""
        if timed_plan_step:
            fault = self._applier.failure()
            if fault is not None:
                self._note = f"the trial's {self.policy} failed: {fault}"

    def _look(self) -> None:
        """At the end of the rounds planned: finished; or, where looks are allowed, as many rounds
        again while the change's noise is over `PRECISE_ENOUGH` of it and the schedule has rounds
        left."""
        first = self._times.alternation.rounds
        if self._looks and self._note is None and self._rounds + first <= self._times.alternation.most_rounds:
            change = less_noisy_change(paired_change([self._times.times]))
            if change is not None and change["noise_pct"] > PRECISE_ENOUGH * abs(change["change_pct"]):
                self._rounds += first
                return
        self.finished = True

    def stop(self, why: str) -> None:
        """End the trial short (training ended before its last round): undone, ``why`` its note."""
        if not self.finished:
            self._note = self._note or why
            self.finished = True
        self.close()

    def close(self) -> None:
        """Undo the trial's policy, if it is in force (the trial is over, or the window ends early)."""
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def _measured(self) -> dict[str, Any]:
        """The modules and rounds, and the change's figures (``baseline_ms``, ``change_ms``,
        ``noise_ms``) or a ``note`` saying why there are none."""
        out: dict[str, Any] = {"modules": list(self.modules), "rounds": self._rounds}
        if self._note is not None:
            return {**out, "note": self._note}
        rounds = paired_change([self._times.times])
        change = less_noisy_change(rounds)
        if change is None:
            return {**out, "note": "no round of the trial was timed"}
        baseline_ms = statistics.median(rounds["baseline_ms"])
        return {
            **out,
            "baseline_ms": baseline_ms,
            "change_ms": change["change_pct"] / 100 * baseline_ms,
            "noise_ms": change["noise_pct"] / 100 * baseline_ms,
            "estimate": change["estimate"],
            "round_changes_ms": [pct / 100 * baseline_ms for pct in rounds["round_changes_pct"]],
        }

    @abc.abstractmethod
    def result(self) -> dict[str, Any]:
        """The trial's figures (see the module docstring)."""


def within_noise(change_ms: float, noise_ms: float) -> str | None:
    """The note of a change that cannot calibrate anything: one within its noise (or not above 0)."""
    if change_ms <= noise_ms:
        return f"the step's change ({change_ms:+.2f} ms) is within its noise (+-{noise_ms:.2f} ms)"
    return None


class OffloadTrial(PolicyTrial):
    """The offload trial: its stores' counts (`OffloadStore.step_stats`) give what moved; ``fit`` is
    the copy-cost fit the factor is taken against."""

    policy = OFFLOAD
    cost_key = "copy"

    def __init__(
        self,
        applier: TrialApplier,
        modules: list[str],
        fit: Mapping[str, Any],
        rounds: int = TRIAL_ROUNDS,
        looks: bool = True,
    ):
        super().__init__(applier, modules, rounds, looks)
        self._fit = fit
        self._moved = {"copies": dict.fromkeys(DIRECTIONS, 0.0), "bytes": dict.fromkeys(DIRECTIONS, 0.0)}
        self._timed_plan_steps = 0

    def _step_ended(self, timed_plan_step: bool) -> None:
        """Count what the step's copies moved, where it was one of the plan's timed steps (the
        store's counts are read at every boundary: each step's own)."""
        moved = self._applier.step_stats()
        if timed_plan_step:
            self._timed_plan_steps += 1
            for stats in moved.values():
                for direction in DIRECTIONS:
                    self._moved["copies"][direction] += stats[direction]["copies"]
                    self._moved["bytes"][direction] += stats[direction]["bytes"]
        super()._step_ended(timed_plan_step)

    def result(self) -> dict[str, Any]:
        """The change, the copies per step, their price by the fit and the factor (see the module
        docstring)."""
        out = {**self._measured(), "factor": None}
        if self._note is not None:  # refused, failed or cut short: no counts to give
            return out
        steps = max(self._timed_plan_steps, 1)
        copies = {d: n / steps for d, n in self._moved["copies"].items()}
        nbytes = {d: n / steps for d, n in self._moved["bytes"].items()}
        out.update(copies_per_step=copies, bytes_per_step=nbytes)
        if "note" in out:  # no round was timed
            return out
        priced_ms = sum(copies_us(self._fit, d, nbytes[d], copies[d]) for d in DIRECTIONS) / 1e3
        out["priced_ms"] = priced_ms
        if priced_ms <= 0:
            return {**out, "note": "the trial's offload moved nothing"}
        note = within_noise(out["change_ms"], out["noise_ms"])
        if note is not None:
            return {**out, "note": note}
        return {**out, "factor": out["change_ms"] / priced_ms}


class RecomputeTrial(PolicyTrial):
    """The recompute trial: the change alone; the predictor prices the same recompute and takes the
    factor (`predictor.activation`)."""

    policy = RECOMPUTE
    cost_key = "recompute"

    def result(self) -> dict[str, Any]:
        """The change and its noise, or a note (see the module docstring)."""
        out = self._measured()
        if "note" in out:
            return out
        note = within_noise(out["change_ms"], out["noise_ms"])
        return out if note is None else {**out, "note": note}


class TrialSequence:
    """``trials`` one after the other in the steps after the window (what a recorder runs: its
    ``WindowTrial``): boundary 0 of each is the boundary that ends the one before."""

    def __init__(self, trials: Sequence[PolicyTrial]):
        self.trials = list(trials)

    @property
    def finished(self) -> bool:
        return all(trial.finished for trial in self.trials)

    @property
    def steps(self) -> int:
        """The boundaries the trials take so far (each trial's own, which may grow at a look)."""
        return sum(trial.steps for trial in self.trials)

    def boundary(self, step: int) -> None:
        """Boundary ``step`` of the sequence, handed to the trial it falls in; where it ends one
        trial, it starts the next."""
        start = 0
        for trial in self.trials:
            if step - start < 0:
                return
            if not trial.finished:
                trial.boundary(step - start)
                if not trial.finished:
                    return
            start += trial.steps

    def stop(self, why: str) -> None:
        """End every trial not finished (training ended before its last round)."""
        for trial in self.trials:
            trial.stop(why)

    def close(self) -> None:
        """Undo whichever trial's policy is in force."""
        for trial in self.trials:
            trial.close()

    def results(self) -> dict[str, dict[str, Any]]:
        """Each trial's result, by where it goes (``Trace.activation_costs[key]["in_step"]``)."""
        return {trial.cost_key: trial.result() for trial in self.trials}
