"""The tuning loop, for every framework: record -> report -> plan -> apply -> verify -> keep or roll back.

`TuningLoop` owns the phases of one training run and everything about them that does not depend
on the framework. An integration (Lightning's `QSyncCallback`, Horovod's `Recorder`) forwards its
hooks to it and supplies, through `Integration`, only what is framework-specific:

- a `Collective`: agree on a flag and gather a string from every rank;
- a `WindowRecorder` per recorded window, which says at which of its step boundaries every rank
  must meet (``meet_before`` / ``meet_after``) and when its window is done (``done_step``);
- appliers, one per plan field it can carry out (`Applier`): each takes a Plan, refuses before
  changing anything what it cannot carry out (`QSyncInputError`), and returns an undo. An applier
  whose decisions can fail after they were applied (an offload store whose disk filled up) also has
  ``failure() -> str | None``: while a plan with offload decisions is in force, every rank polls it
  at each step boundary, and a failure on any rank rolls the plan back everywhere (`_plan_failed`).
  An applier that takes one decision back alone and keeps the rest in force (a region that failed
  to compile goes back to eager) has ``went_back() -> {plan field: [entries]}``: the plan kept
  leaves out what went back on any rank (`_as_ran`), so the next launch does not try it again.

Step by step, counted at `TuningLoop.step_boundary` (one per optimizer step):

- step 0: the run's fingerprint; a start plan, if there is one (the checkpoint's kept plan, then a
  given ``plan=`` file, then in mode "apply" the plan cache), is applied on every rank; in mode
  "apply" the loop is then done, in the other modes the run under it is recorded;
- the baseline window (``warmup_steps``, ``profile_steps`` recorded, ``measure_steps`` timed);
  rank 0 gathers every rank's trace, reports (``report.json``); in mode "apply", a recording too
  noisy to plan on (`report.too_noisy_to_plan`: the machine was busy) is recorded again, once, its
  report kept as ``report-too-noisy.json``, and the loop goes on with the second whatever its noise;
  then rank 0 plans
  (`planner.choose.choose_plan`, under the run's `Constraints`, a budget share turned into bytes
  here, once) and sends the plan to every rank; all ranks apply it at the same boundary;
- the verify window; then, unless the loss stopped being finite, the candidate is undone and
  re-applied in turns for ``alternate_rounds`` rounds, looking again after as many more while they
  cannot tell, up to ``alternate_looks`` looks (`alternation.py`: a drift of the machine's
  speed cancels in each round, and a plan kept for memory has its cost measured); rank 0 decides by the
  one rule in `verify.py`, every rank follows: keep, or undo the candidate. What is kept is
  written once, to ``plan.json`` and the plan cache, and is the loop's only state (`state_dict`):
  a candidate under verification never is.

The fail-safe: every piece of the loop's own work runs through a `FailSafe`. The first failure
warns once with its cause; the recorder is stopped, a candidate plan in force is undone, and the
loop steps aside while training goes on. Ranks meet (`Collective.all_true`) at each point where
they must act together, whatever their own state, so a failure on one rank never leaves another
waiting.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from qsync_callback.alternation import (
    BASELINE,
    LOOKS,
    PLAN,
    ROUNDS,
    Alternation,
    BlockTimes,
    block_steps_for,
    less_noisy_change,
    paired_change,
)
from qsync_callback.cache import cached_plan, drop_cached_plan, store_plan
from qsync_callback.errors import QSyncInputError
from qsync_callback.fail_safe import FailSafe
from qsync_callback.mean_band import band_factor
from qsync_callback.plan import LEVER_FIELDS, LEVERS, OFFLOAD, Constraints, Plan
from qsync_callback.planner.choose import choose_plan
from qsync_callback.recorder.trace import Trace, check_rank_traces, rank_trace_path
from qsync_callback.report import (
    NOISY_REPORT_FILE,
    REPORT_FILE,
    build_report,
    format_summary,
    format_verification,
    too_noisy_to_plan,
    write_report,
)
from qsync_callback.units import check_count
from qsync_callback.verify import KEEP, ROLL_BACK, can_tell, decided_on_memory, verify_plan

MODES = ("record", "report", "apply")
PLAN_FILE = "plan.json"
VERIFICATION_FILE = "verification.json"
ALTERNATE = "alternate"  # rank 0's word to every rank, and each block's timed steps: run in turns first
GO_ON = "go on"  # ... and at a look: the turns cannot tell yet, run more rounds
RECORD_AGAIN = "record again"  # rank 0's word after the baseline window: too noisy to plan on
VERIFY_WARMUP_STEPS = 4  # after switching: two cold steps, one timed, one under the profiler unrecorded

Undo = Callable[[], None]
Applier = Callable[[Plan], Undo]


@dataclass(frozen=True)
class LoopSettings:
    """A user's arguments for the loop, checked at construction (ValueError naming the bad one)."""

    mode: str = "report"
    warmup_steps: int = 10
    profile_steps: int = 5
    measure_steps: int = 10
    verify_steps: int = 3
    alternate_rounds: int = ROUNDS
    alternate_looks: int = LOOKS
    output_dir: Path | None = None
    constraints: Constraints = field(default_factory=Constraints)
    plan_path: Path | None = None
    plan_cache: bool | Path = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {', '.join(MODES)}, not {self.mode!r}")
        check_count(self.warmup_steps, "warmup_steps", 2)
        check_count(self.profile_steps, "profile_steps", 1)
        check_count(self.measure_steps, "measure_steps", 0)
        check_count(self.verify_steps, "verify_steps", 1)
        check_count(self.alternate_rounds, "alternate_rounds", 0)
        check_count(self.alternate_looks, "alternate_looks", 1)
        if not isinstance(self.plan_cache, (bool, Path)):
            raise ValueError(f"plan_cache: must be True, False or a directory, not {self.plan_cache!r}")

    @classmethod
    def from_arguments(
        cls,
        mode: str,
        warmup_steps: int,
        profile_steps: int,
        measure_steps: int,
        verify_steps: int,
        output_dir: str | Path | None,
        *,
        constraints: Constraints | None = None,
        plan: str | Path | None = None,
        plan_cache: bool | str | Path = True,
        alternate_rounds: int = ROUNDS,
        alternate_looks: int = LOOKS,
    ) -> LoopSettings:
        """The settings from a user's arguments as an integration takes them (paths as strings too)."""
        return cls(
            mode=mode,
            warmup_steps=warmup_steps,
            profile_steps=profile_steps,
            measure_steps=measure_steps,
            verify_steps=verify_steps,
            alternate_rounds=alternate_rounds,
            alternate_looks=alternate_looks,
            output_dir=Path(output_dir) if output_dir is not None else None,
            constraints=constraints or Constraints(),
            plan_path=Path(plan) if plan is not None else None,
            plan_cache=plan_cache if isinstance(plan_cache, bool) else Path(plan_cache),
        )

    @property
    def cache_dir(self) -> Path | None:
        """The plan cache's directory (None: the user's default), when there is a cache."""
        return self.plan_cache if isinstance(self.plan_cache, Path) else None


class Collective(Protocol):
    """How the ranks of one run talk: every rank calls each method at the same point."""

    rank: int
    world_size: int

    def all_true(self, flag: bool) -> bool:
        """True only if every rank passed True."""

    def gather_strings(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order (rank 0's is how it sends to all)."""


class WindowRecorder(Protocol):
    """One recorded window, driven at step boundaries counted from its first (0)."""

    trace: Trace | None  # the normalized trace, once the profiled part has closed
    meet_before: Collection[int]  # boundaries where every rank meets before `step_boundary`
    meet_after: Collection[int]  # ... after it; then the step clock restarts (`restart_step_clock`)
    done_step: int  # the boundary at which the window (its measured steps too) is complete

    def step_boundary(self) -> None: ...

    def step_end(self) -> None: ...

    def restart_step_clock(self) -> None: ...

    def save(self) -> None:
        """Write the trace with the measured steps (``trace.measured``)."""

    def close(self) -> None:
        """Stop profiling; safe at any time, more than once."""


class Integration(Protocol):
    """What a framework gives the loop."""

    collective: Collective
    job: str  # what the plan cache files this run's plans under (the model's class)

    def fingerprint(self) -> dict[str, Any]:
        """What a plan for this run depends on (called at step 0)."""

    def new_recorder(
        self, trace_dir: Path, warmup_steps: int, profile_steps: int, measure_steps: int, *, planning: bool
    ) -> WindowRecorder:
        """A recorder for one window; ``planning``: also gather what the planners need (probes)."""

    def appliers(self) -> Mapping[str, Applier]:
        """Plan field -> the applier that carries out its decisions."""

    def log(self, text: str) -> None:
        """Show ``text`` to the user (rank 0 only)."""

    def log_metrics(self, report: Mapping[str, Any]) -> None:
        """Pass the report's figures to the framework's logger, if it has one."""


def apply_plan(plan: Plan, appliers: Mapping[str, Applier], levers: Collection[str] = LEVERS) -> Undo:
    """Carry out every decision of ``plan``, all or none; returns the undo of all of them.

    A decision no applier can carry out, or one of a lever not allowed, is refused (QSyncInputError
    naming it) before anything changes; an applier that fails has what the others did undone."""
    fields = [name for names in LEVER_FIELDS.values() for name in names if getattr(plan, name)]
    allowed = {name for lever in levers for name in LEVER_FIELDS[lever]}
    refused = [name for name in fields if name not in appliers or name not in allowed]
    if refused:
        raise QSyncInputError(
            f"this run cannot carry out the plan's {', '.join(refused)} decisions "
            f"(it can: {', '.join(sorted(set(appliers) & allowed)) or 'none'}); nothing was applied"
        )
    undos: list[Undo] = []
    done: set[int] = set()
    try:
        for name in fields:
            applier = appliers[name]
            if id(applier) not in done:
                done.add(id(applier))
                undos.append(applier(plan))
    except BaseException:
        _undo_all(undos)
        raise
    return lambda: _undo_all(undos)


def _undo_all(undos: Sequence[Undo]) -> None:
    for undo in reversed(undos):
        undo()


class TuningLoop:
    """The loop of one run (see the module docstring); ``who`` names the tool in its warnings."""

    def __init__(self, settings: LoopSettings, who: str):
        self.settings = settings
        self.output_dir = settings.output_dir
        self.report: dict[str, Any] | None = None
        self.verification: dict[str, Any] | None = None
        self.plan: Plan | None = None  # the kept plan in force, on every rank
        self.candidate: Plan | None = None  # the plan under verification
        self.finished = False
        self._safe = FailSafe(who, self._step_aside)
        self._integration: Integration | None = None
        self._recorder: WindowRecorder | None = None
        self._phase = "baseline"
        self._steps = 0
        self._window_start = 0
        self._fingerprint: dict[str, Any] = {}
        self._constraints = settings.constraints
        self._undo_candidate: Undo | None = None
        self._undo_plan: Undo | None = None
        self._loss_finite = True
        self._verify_traces: list[Trace] | None = None  # rank 0, while the baseline and plan alternate
        self._turns: BlockTimes | None = None
        self._went_back: dict[str, list[Any]] = {}  # what the candidate's appliers took back alone
        self._resume_plan: Plan | None = None
        self._too_noisy: str | None = None  # why the first baseline window was recorded again

    @property
    def failure(self) -> str | None:
        """Why the loop stepped aside, or None."""
        return self._safe.cause

    @property
    def constraints(self) -> Constraints:
        """The run's constraints; after the report, a budget share is in bytes."""
        return self._constraints

    @property
    def watching(self) -> bool:
        """A plan with offload decisions is in force: every step boundary polls its appliers for a
        failure (`_plan_failed`), even once the loop is done."""
        in_force = self.candidate or self.plan
        return in_force is not None and OFFLOAD in in_force.activation.values()

    @property
    def verifying(self) -> bool:
        """A candidate is on trial (its verify window, or the turns after it)."""
        return self._phase in ("verify", "alternate") and not self.finished

    # ----------------------------------------------------------------- hooks, forwarded

    def step_boundary(self, integration: Integration) -> None:
        """Before each (optimizer) step."""
        if self._plan_failed() or self.finished:
            return
        step = self._steps
        self._steps += 1
        if step == 0:
            self._integration = integration
            self._safe.run(self._begin)
            if self._start_plan():
                return
        if self._phase == "alternate":
            self._alternate_step(step - self._window_start)
        else:
            self._window_step(step - self._window_start)

    def step_end(self, loss_finite: bool = True) -> None:
        """After each step (or micro-batch): its loss, for verify's finiteness check."""
        if self.finished:
            return
        if self._recorder is not None and self._safe.ok:
            self._safe.run(self._recorder.step_end)
        if self.verifying and not loss_finite:
            self._loss_finite = False

    def train_end(self) -> None:
        """Training ended: a window cut short records nothing; a candidate is never left unverified."""
        if self.finished:
            return
        if self._phase == "alternate":
            self._after_alternation()
            return
        if self._recorder is not None and self._recorder.trace is None and self._safe.ok:
            why = "training ended before the recorded window was complete; nothing was recorded"
            if self._too_noisy is not None:
                why = (
                    "training ended while the window was recorded again (the first recording was too "
                    f"noisy to plan on: {self._too_noisy}); no plan was made"
                )
            self._safe.fail(why)
        self._window_done()

    def exception(self, cause: str | None = None) -> None:
        """The user's training raised: stop recording, and undo a candidate under verification.
        With a ``cause``, training may go on (a train step whose error the user caught): the loop
        steps aside with that warning, and tells the other ranks at their next meeting."""
        if cause is not None:
            if not self.finished:
                self._safe.fail(cause)
            return
        self._close_recorder()
        if self.verifying:
            self._roll_back()
            self.finished = True

    def close(self) -> None:
        """Stop recording (teardown); a candidate still unverified is undone, and so is a kept plan
        with offload decisions (its stores closed, their files removed: the run is over; the plan
        cache re-applies it at the next launch)."""
        self._close_recorder()
        if self.verifying:
            self._roll_back()
        if self.watching and self._undo_plan is not None:
            undo, self._undo_plan = self._undo_plan, None
            self._safe.run(undo)

    def state_dict(self) -> dict[str, Any]:
        """Only a kept plan is state: a candidate under verification is never saved."""
        return {
            "finished": self.finished and not self.verifying,
            "output_dir": str(self.output_dir) if self.output_dir else None,
            "plan": self.plan.to_dict() if self.plan is not None and not self.plan.is_empty else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.finished = bool(state.get("finished", False))
        if state.get("output_dir") and self.output_dir is None:
            self.output_dir = Path(state["output_dir"])
        if state.get("plan") is not None:
            self._resume_plan = Plan.from_dict(state["plan"], source="the checkpoint's qsync state")
            self.finished = False  # re-apply it at the first step of the resumed run

    # ----------------------------------------------------------------- step 0

    def _begin(self) -> None:
        if self.output_dir is None:
            raise ValueError("no output directory was set")
        self._fingerprint = self._integration.fingerprint()

    def _start_plan(self) -> bool:
        """At step 0: find (rank 0) and apply (every rank) a start plan. Returns True when the loop is
        done: mode "apply" with a plan applied, or a failure."""
        collective = self._integration.collective
        sent = ""
        if collective.rank == 0:  # the plan's JSON and where it came from, for every rank to act on
            sent = json.dumps(self._safe.run(self._find_start_plan) or ("", ""))
        received = (self._exchange(sent) or [""])[0]
        if not self._agree():
            return True
        found, source = json.loads(received)
        if not found:
            return False
        plan = Plan.from_json(found, source="rank 0's plan")
        error = self._apply_everywhere(plan, to_keep=True)
        if error is not None:
            if source == "the plan cache":  # a kept plan that cannot be applied here: forget it
                self._log(f"qsync: the kept plan cannot be applied here ({error}); dropped, planning afresh")
                if collective.rank == 0:
                    self._safe.run(
                        drop_cached_plan,
                        self._integration.job,
                        plan.constraints,
                        self._fingerprint.get("device", ""),
                        self.settings.cache_dir,
                    )
                return False
            self._safe.fail(f"the plan from {source or 'rank 0'} cannot be applied: {error}")
            self.finished = True
            return True
        self._log(f"qsync: applied the plan from {source or 'rank 0'} at step 0 ({_describe(plan)})")
        if self.settings.mode == "apply":
            self.finished = True
            self._close_recorder()
        return self.finished

    def _find_start_plan(self) -> tuple[str, str]:
        """Rank 0: the JSON of the plan to apply at step 0 and where it came from, or ("", "")."""
        if self._resume_plan is not None:
            plan, source = self._resume_plan, "the checkpoint"
            plan.check_for(self._fingerprint, layers=(), source=source)  # names: the appliers
            if self.settings.mode != "apply":
                self._log(
                    f"qsync: re-applying the checkpoint's kept plan ({_describe(plan)}) in mode "
                    f"{self.settings.mode!r}; the run under it is recorded"
                )
        elif self.settings.plan_path is not None:
            source = str(self.settings.plan_path)
            plan = Plan.load(self.settings.plan_path)
            plan.check_for(self._fingerprint, layers=(), source=source)  # names: the appliers
        elif self.settings.mode == "apply" and self.settings.plan_cache is not False:
            source = "the plan cache"
            plan, why_not = cached_plan(
                self._integration.job,
                self._fingerprint,
                self.settings.constraints.to_dict(),
                self.settings.cache_dir,
            )
            if why_not:
                self._log(f"qsync: not applying the kept plan: {why_not}; planning afresh")
            if plan is None:
                if why_not is None:
                    self._log("qsync: no kept plan for this job under these constraints; planning")
                return "", ""
        else:
            return "", ""
        return plan.to_json(), source

    # ----------------------------------------------------------------- recorded windows

    def _new_window(self, where: Path, warmup: int, profile: int, measure: int) -> bool:
        planning = self.settings.mode == "apply" and self._phase == "baseline"
        self._recorder = self._safe.run(
            lambda: self._integration.new_recorder(where, warmup, profile, measure, planning=planning)
        )
        return self._agree()

    def _window_step(self, step: int) -> None:
        """At local boundary ``step`` of the window; the meetings are reached by every rank whatever
        its state, so that no rank waits alone."""
        if step == 0 and self._recorder is None:
            s = self.settings
            if not self._new_window(
                self.output_dir / "trace", s.warmup_steps, s.profile_steps, s.measure_steps
            ):
                return
        recorder = self._recorder
        if recorder is None:
            return
        if step in recorder.meet_before and not self._agree():
            return
        if self._safe.ok:
            self._safe.run(recorder.step_boundary)
        if step in recorder.meet_after:
            if not self._agree():
                return
            self._safe.run(recorder.restart_step_clock)
        if step == recorder.done_step:
            self._window_done()

    def _window_done(self) -> None:
        """Save the measured steps into the trace, then report, plan or verify."""
        recorder = self._recorder
        ok = self._safe.ok and recorder is not None and recorder.trace is not None
        if ok:
            ok = self._safe.run(recorder.save) is not None
        if not self._agree(ok) or self.settings.mode == "record":
            self.finished = True
            self._close_recorder()
            return
        self._close_recorder()
        texts = self._exchange(json.dumps(recorder.trace.to_dict(), separators=(",", ":")))
        traces = None
        if self._integration.collective.rank == 0 and texts is not None:
            traces = self._safe.run(_parse_traces, texts)
        if self._phase == "baseline":
            self._after_baseline(traces)
        else:
            self._after_verify(traces)

    # ----------------------------------------------------------------- report, plan, apply, verify

    def _after_baseline(self, traces: list[Trace] | None) -> None:
        plan_text = ""
        if traces is not None:
            self._safe.run(self._report, traces)
            if self.settings.mode == "apply" and self.report is not None:
                plan_text = self._safe.run(self._record_again_or_plan, traces) or ""
        if self.settings.mode != "apply":
            self.finished = True
            return
        plan_text = (self._exchange(plan_text) or [""])[0]
        if not plan_text or not self._agree():
            self.finished = True
            return
        if plan_text.startswith(RECORD_AGAIN):  # the baseline window again, from this boundary
            self._too_noisy = plan_text.removeprefix(RECORD_AGAIN).strip()
            self._window_start, self._recorder = self._steps - 1, None
            self._window_step(0)
            return
        plan = Plan.from_json(plan_text, source="rank 0's plan")
        error = self._apply_everywhere(plan, to_keep=False)
        if error is not None:
            self._log(f"qsync: the plan was not applied: {error}")
            self.finished = True
            return
        self._phase = "verify"
        self._loss_finite = True
        self._window_start = self._steps - 1
        if self._new_window(
            self.output_dir / "verify" / "trace",
            VERIFY_WARMUP_STEPS,
            self.settings.verify_steps,
            self.settings.measure_steps,
        ):
            self._window_step(0)

    def _report(self, traces: list[Trace]) -> None:
        """Rank 0: the baseline's report, written, printed and logged."""
        _save_rank_traces(traces, self.output_dir / "trace")
        self.report = build_report(traces)
        if self._too_noisy is not None:
            self.report["recorded_again"] = self._too_noisy
        write_report(self.report, self.output_dir / REPORT_FILE)
        self._log(format_summary(self.report) + f"\n  written to {self.output_dir}")
        self._integration.log_metrics(self.report)

    def _record_again_or_plan(self, traces: list[Trace]) -> str:
        """Rank 0: RECORD_AGAIN and why, the first time a recording is too noisy to plan on (its report
        kept aside); else `_plan`'s text."""
        why = too_noisy_to_plan(self.report) if self._too_noisy is None else None
        if why is None:
            return self._plan(traces)
        write_report(self.report, self.output_dir / NOISY_REPORT_FILE)
        self._log(f"qsync: recording the window again before planning (once): {why}")
        return f"{RECORD_AGAIN} {why}"

    def _plan(self, traces: list[Trace]) -> str:
        """Rank 0: choose the plan; its JSON if it changes anything, else "" (and keep the baseline)."""
        self._constraints = self._constraints.resolved(self.report["predicted"]["peak_bytes"])
        try:
            choice = choose_plan(traces, self._constraints, self.report["predicted"])
        except QSyncInputError as error:
            self._log(f"qsync: no plan applied: {error}")
            return ""
        self._log(choice.table)
        if not (choice.feasible or self._constraints.best_effort):
            self._log(
                "qsync: no plan meets the constraints; keeping the recorded configuration "
                "(best_effort=True applies the closest plan)"
            )
            return ""
        if choice.plan.is_empty:
            self._log("qsync: the recorded configuration is the plan; nothing to apply")
            self._keep(choice.plan)
            return ""
        return choice.plan.to_json()

    def _apply_everywhere(self, plan: Plan, *, to_keep: bool) -> str | None:
        """Every rank applies ``plan`` at this boundary, all ranks or none; None, or why it was not
        applied (rank 0's reason). ``to_keep``: it is kept at once (a start plan), else verified."""
        undo, error = None, ""
        try:
            undo = apply_plan(
                plan, self._integration.appliers(), self._constraints.levers if not to_keep else LEVERS
            )
        except Exception as exc:  # noqa: BLE001 - refused or failed: nothing is left applied
            error = str(exc) if isinstance(exc, QSyncInputError) else f"{type(exc).__name__}: {exc}"
        everywhere = self._all_true(undo is not None)
        if not everywhere:
            if undo is not None:
                undo()
            reasons = self._exchange(error) or [error]
            return next((r for r in reasons if r), "another rank could not apply it")
        if to_keep:
            self.plan, self._undo_plan = plan, undo  # kept; undone only if it fails (`_plan_failed`)
        else:
            self.candidate, self._undo_candidate = plan, undo
        return None

    def _after_verify(self, traces: list[Trace] | None) -> None:
        loss_finite = self._all_true(self._loss_finite)
        decision = ""
        if traces is not None:
            decision = self._safe.run(self._verify, traces, loss_finite) or ""
        decision = (self._exchange(decision) or [""])[0]
        if decision.startswith(ALTERNATE):
            self._phase = "alternate"
            self._window_start = self._steps - 1
            block_steps = int(decision.removeprefix(ALTERNATE))
            schedule = Alternation(
                self.settings.alternate_rounds, looks=self.settings.alternate_looks, block_steps=block_steps
            )
            self._turns = BlockTimes(schedule)
            self._alternate_step(0)
        else:
            self._decide(decision)

    def _verify(self, traces: list[Trace], loss_finite: bool) -> str:
        """Rank 0: ALTERNATE and the turns' timed steps a block (the baseline and the plan are to
        run in turns first; `alternation.block_steps_for` the recorded step time), or the decision on
        the verify window alone (no rounds asked, or the loss stopped being finite)."""
        _save_rank_traces(traces, self.output_dir / "verify" / "trace")
        if self.settings.alternate_rounds and loss_finite:
            self._verify_traces = traces
            return f"{ALTERNATE} {block_steps_for(self.report['measured']['step_ms'])}"
        return self._write_verification(traces, loss_finite, None)

    def _write_verification(
        self, traces: list[Trace], loss_finite: bool, alternation: dict[str, Any] | None
    ) -> str:
        """Rank 0: verify's decision, written and printed."""
        self.verification = verify_plan(
            self.candidate,
            self.report,
            traces,
            loss_finite=loss_finite,
            memory_budget=self._constraints.memory_budget,
            alternation=alternation,
        )
        write_report(self.verification, self.output_dir / VERIFICATION_FILE)
        self._log(format_verification(self.verification))
        return self.verification["decision"]

    def _alternate_step(self, step: int) -> None:
        """At boundary ``step`` of the turns: time the step that ended; where a block starts, every
        rank meets, then switches to the block's configuration; after the last block, decide."""
        turns = self._turns
        turns.boundary(step)
        switch = turns.alternation.switch_at(step)
        if switch is not None and not self._agree():
            return
        if turns.alternation.look_at(step) and self._after_alternation(last=False):
            return
        if switch == BASELINE:
            undo, self._undo_candidate = self._undo_candidate, None
            if undo is not None:
                self._merge_went_back(self._safe.run(self._applier_went_back))
                self._safe.run(undo)
        elif switch == PLAN:
            error = self._apply_everywhere(self.candidate, to_keep=False)
            if error is not None:
                self._log(f"qsync: the plan could not be applied again in its turn ({error}); rolled back")
                self._decide(ROLL_BACK)
                return
        if step == turns.alternation.done_step:
            self._after_alternation()
            return
        turns.restart()

    def _after_alternation(self, last: bool = True) -> bool:
        """After the last block, at a look, or at the end of training (over the rounds complete by
        then): rank 0 decides on the turns, every rank follows (a plan kept while the baseline ran is
        re-applied). At a look (not ``last``) the turns go on instead while they cannot tell the plan
        from the baseline; returns whether they ended."""
        if not self._agree():
            return True
        loss_finite = self._all_true(self._loss_finite)
        texts = self._exchange(json.dumps(self._turns.record()))
        decision = ""
        if self._integration.collective.rank == 0 and texts is not None:
            decision = self._safe.run(self._verify_in_turns, texts, loss_finite, last) or ""
        decision = (self._exchange(decision) or [""])[0]
        if decision == GO_ON:
            return False
        if decision == KEEP and self._undo_candidate is None:
            error = self._apply_everywhere(self.candidate, to_keep=False)
            if error is not None:
                self._log(f"qsync: the kept plan could not be applied again ({error}); rolled back")
                decision = ROLL_BACK
        self._decide(decision)
        return True

    def _verify_in_turns(self, texts: Sequence[str], loss_finite: bool, last: bool) -> str:
        """Rank 0: GO_ON at a look where the turns cannot tell the plan from the baseline yet (and
        the plan is decided on its step time, its loss finite); else verify's decision on the verify
        window and every rank's block times, written. The change's noise is the band its look
        decides on (`Alternation.band`, at the last look `Alternation.last_band`) where the plan is
        decided on its step time, else the rounds' 95% band (it only says what the plan costs)."""
        schedule = self._turns.alternation
        on_time = loss_finite and not decided_on_memory(self.report, self._constraints.memory_budget)
        band = (schedule.last_band if last else schedule.band) if on_time else band_factor
        turns = paired_change([json.loads(text) for text in texts], band)
        turns["block_steps"] = schedule.block_steps
        turns["most_rounds"] = schedule.most_rounds
        decided_on = less_noisy_change(turns)
        undecided = decided_on is not None and not can_tell(decided_on["change_pct"], decided_on["noise_pct"])
        if not last and undecided and on_time:
            return GO_ON
        return self._write_verification(self._verify_traces, loss_finite, turns)

    def _decide(self, decision: str) -> None:
        """Every rank: keep the candidate (``decision`` KEEP) or roll back; rank 0 writes what is kept."""
        kept = self._as_ran(self.candidate) if decision == KEEP and self.candidate is not None else None
        self._went_back = {}
        if kept is not None:
            self.plan, self._undo_plan = kept, self._undo_candidate
            self.candidate, self._undo_candidate = None, None
        else:
            self._roll_back()
        self.finished = True
        self._verify_traces, self._turns = None, None
        if self._integration.collective.rank == 0:
            self._safe.run(self._keep, kept if kept is not None else Plan.empty(self._fingerprint))

    def _plan_failed(self) -> bool:
        """Every rank, while a plan with offload decisions is in force: whether an applier reported
        a failure on any rank (`Integration` appliers' ``failure``); if so the plan is undone on every
        rank, the recorded configuration kept, and the loop is done."""
        if self._integration is None or not self.watching:
            return False
        fault = self._safe.run(self._applier_failure) or None  # (FailSafe.run: True for no failure)
        if self._all_true(fault is None and self._safe.ok):
            return False
        reasons = self._exchange(fault or "") or [fault or ""]
        reason = next((r for r in reasons if r), "another rank's plan failed")
        self._log(f"qsync: the plan in force failed ({reason}); rolled back to the recorded configuration")
        self._close_recorder()
        self._roll_back()
        undo, self._undo_plan, self.plan = self._undo_plan, None, None
        if undo is not None:
            undo()
        self.finished = True
        self._verify_traces, self._turns = None, None
        if self._integration.collective.rank == 0:
            self._safe.run(self._keep, Plan.empty(self._fingerprint))
        return True

    def _applier_failure(self) -> str | bool:
        """The first failure an applier of this run reports, or False."""
        for applier in self._integration.appliers().values():
            failure = getattr(applier, "failure", None)
            found = failure() if callable(failure) else None
            if found:
                return found
        return False

    def _merge_went_back(self, went_back: Any) -> None:
        """Add ``went_back`` (`_applier_went_back`'s, or FailSafe's True after a failure) to what the
        candidate's appliers took back alone on this rank: a plan undone for a baseline block of the
        turns and applied again starts afresh, and its parts that go back alone do so again only
        when they run."""
        _add_entries(self._went_back, went_back if isinstance(went_back, dict) else {})

    def _as_ran(self, plan: Plan) -> Plan:
        """Every rank: ``plan`` less the decisions an applier took back alone on any rank, while
        it runs or whenever it ran in the turns (`Applier` ``went_back``), said; ``plan`` itself when
        none went back."""
        self._merge_went_back(self._safe.run(self._applier_went_back))
        texts = self._exchange(json.dumps(self._went_back))
        dropped: dict[str, list[Any]] = {}
        for text in texts or []:
            _add_entries(dropped, json.loads(text))
        if not dropped:
            return plan
        said = "; ".join(f"{name} {entries}" for name, entries in dropped.items())
        self._log(f"qsync: left out of the plan kept, having gone back alone on some rank: {said}")
        return plan.without(dropped)

    def _applier_went_back(self) -> dict[str, list[Any]]:
        """What this rank's appliers took back alone, by plan field."""
        out: dict[str, list[Any]] = {}
        for applier in {id(a): a for a in self._integration.appliers().values()}.values():
            went_back = getattr(applier, "went_back", None)
            for name, entries in (went_back() if callable(went_back) else {}).items():
                out.setdefault(name, []).extend(entries)
        return out

    def _roll_back(self) -> None:
        """Back to the last kept configuration on this rank (the candidate undone)."""
        undo, self._undo_candidate, self.candidate = self._undo_candidate, None, None
        if undo is not None:
            undo()

    def _keep(self, plan: Plan) -> None:
        """Rank 0: write the plan in force, with the constraints the user gave (a budget share as a
        share), to ``plan.json`` and the cache."""
        plan.constraints = self.settings.constraints.to_dict()  # as given: the next launch's key
        if not plan.fingerprint:
            plan.fingerprint = dict(self._fingerprint)
        self.output_dir.mkdir(parents=True, exist_ok=True)  # a given plan's run records nothing there
        plan.save(self.output_dir / PLAN_FILE)
        where = str(self.output_dir / PLAN_FILE)
        if self.settings.plan_cache is not False:
            where += f" and {store_plan(plan, self._integration.job, self.settings.cache_dir)}"
        self._log(f"qsync: plan kept in {where}")

    # ----------------------------------------------------------------- ranks and failures

    def _agree(self, ok: bool | None = None) -> bool:
        """All ranks go on only if every rank is still healthy; else every rank steps aside."""
        ok = self._all_true(self._safe.ok if ok is None else bool(ok))
        if not ok:
            if self._safe.ok:
                self._safe.fail("another rank failed; this rank steps aside too")
            self.finished = True
            self._step_aside()
        return ok

    def _all_true(self, flag: bool) -> bool:
        """Whether every rank passed True; False if the collective itself failed (then stepping aside)."""
        try:
            return self._integration.collective.all_true(flag)
        except Exception as exc:  # noqa: BLE001 - the loop must never break training
            self._safe.fail(f"meeting the other ranks failed: {type(exc).__name__}: {exc}")
            return False

    def _exchange(self, text: str) -> list[str] | None:
        """Every rank's ``text``; None if the collective itself failed."""
        try:
            return self._integration.collective.gather_strings(text)
        except Exception as exc:  # noqa: BLE001
            self._safe.fail(f"exchanging with the other ranks failed: {type(exc).__name__}: {exc}")
            return None

    def _step_aside(self) -> None:
        """On any failure: stop recording; a candidate is never left in force unverified."""
        self._close_recorder()
        self._roll_back()

    def _close_recorder(self) -> None:
        if self._recorder is not None:
            try:
                self._recorder.close()
            except Exception as exc:  # noqa: BLE001 - warned, not failed: closing is the fail-safe's own step
                warnings.warn(
                    f"{self._safe.who} could not stop the profiler: {exc}", RuntimeWarning, stacklevel=2
                )

    def _log(self, text: str) -> None:
        if self._integration is not None and self._integration.collective.rank == 0:
            self._integration.log(text)


def _add_entries(into: dict[str, list[Any]], more: Mapping[str, Sequence[Any]]) -> None:
    """Add each of ``more``'s entries to ``into``'s list of the same name, once."""
    for name, entries in more.items():
        listed = into.setdefault(name, [])
        listed += [e for e in entries if e not in listed]


def _save_rank_traces(traces: Sequence[Trace], trace_dir: Path) -> None:
    """Every rank's trace beside rank 0's (ranks on other hosts wrote theirs elsewhere)."""
    for trace in traces:
        path = rank_trace_path(trace_dir, trace.rank)
        if not path.exists():
            trace.save(path)


def _parse_traces(texts: Sequence[str]) -> list[Trace]:
    """The ranks' traces, shown to be one run's (`check_rank_traces`)."""
    traces = [Trace.from_dict(json.loads(t), source=f"rank {i} trace") for i, t in enumerate(texts)]
    return check_rank_traces(traces, "the traces gathered from the ranks")


def _describe(plan: Plan) -> str:
    """What a plan decides, in a few words."""
    parts = [
        f"{len(value)} {name}"
        for names in LEVER_FIELDS.values()
        for name in names
        if (value := getattr(plan, name))
    ]
    return ", ".join(parts) or "no changes"
