"""Recorder and ``@profile``: a thin adapter from a Horovod + TensorFlow train step to the record ->
report loop.

``@profile(recorder)`` wraps the user's train step (usually a ``tf.function``); the wrapper counts
the calls, times each one (wall clock, from the call to its return) and returns the step's result
unchanged. Call by call, counted from 0:

- calls before ``warmup_steps`` run untouched and are timed (the first ``COLD_STEPS`` are not:
  they trace the function), except the last, which runs under a profiler session that is thrown
  away (a session's first profiled step is slow);
- call ``warmup_steps`` settles after that session and is not timed;
- then ``profile_steps`` calls are recorded, every other call, each in a ``tf.profiler`` session
  of its own with a ``qsync::step`` mark around it; the unprofiled calls between them are timed,
  so that measured and recorded steps see the same conditions of the machine (see
  `qsync_callback.recorder.torch_recorder`);
- after the last recorded call, each session's XSpace is converted (`recorder/xspace.py`) and
  the normalized trace written to ``<output_dir>/trace/rank<k>/trace.json``; the raw profiles stay
  beside it in ``profile/`` (a TensorBoard log directory, one run per recorded step);
- ``measure_steps`` more calls are timed, then every rank saves its trace with the measured step
  times, and in mode "report" rank 0 gathers all ranks' traces, prints the summary and writes
  ``<output_dir>/report.json``, as the Lightning callback does;
- in mode "apply", after the report, the next calls try XLA and bfloat16 mixed precision on the live
  run, measure them against the original step and keep the best or roll back (see `apply`); with
  more than one process also the best predicted gradient groups (``recorder.groups``), and the
  best predicted fusion threshold and cycle time go into ``plan.json`` for the next launch (see
  `fusion`).

The next launch with the kept plan: ``plan="path/plan.json"``, or in mode "apply" by default the
``plan.json`` an earlier run kept in ``output_dir`` (``plan=False``: plan afresh). At call 0 rank 0
reads it and checks that it was made for this run (`Plan.check_for`); every rank enacts it
(`apply.enact`: XLA, the bf16 rewrite with its env lists, or TF's default lists, re-traced; its
gradient groups into ``recorder.groups``), all or none, and rank 0 says whether its fusion threshold
and cycle time are the ones in effect (they cannot change after ``hvd.init()``). In mode "apply"
the recorder is then done; in modes "record" and "report" it records and reports the run under the
plan. A given plan that cannot be read, was made for another run or holds a decision TF cannot enact
warns once and the recorder steps aside with nothing applied; a kept one made for another run is
not used (one warning), and mode "apply" plans afresh.

Communication (more than one process): Horovod's timeline is on during each recorded step
(`fusion.Timeline`; rank 0 writes it under ``trace/rank0/horovod_timeline/``), and the
collectives' tensors, sizes and dtypes are read from the step's concrete function graph (when the
decorated step is a ``tf.function``); the trace's collective ops carry both, and its
``communication`` entry the fusion threshold, cycle time and groups in effect.

Ranks meet (one Horovod all-reduce of a flag) when a profiler session opens and when it closes,
and before the report. Each opening meeting is followed by a ``qsync::clock_sync`` mark (see
`Recorder._open_session`); the closing one also lets Horovod's thread finish the step's last
collective before the profiler stops; and a failure on any rank makes every rank step aside at the
same meeting, so that none waits alone. A run shorter than the window (``warmup_steps + 2 *
profile_steps + measure_steps`` calls) records nothing.

The recorder never breaks training: a failure of its own (Horovod not initialized, a profiler that
does not start, a trace that cannot be written) warns once with the cause, stops its profiler
session and steps aside; the train step goes on running and returning its result.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import horovod
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from qsync_callback.errors import QSyncInputError
from qsync_callback.fail_safe import FailSafe
from qsync_callback.integrations.horovod_tf import fusion
from qsync_callback.integrations.horovod_tf.apply import (
    AMP,
    BASELINE,
    CANDIDATE_WARMUP,
    PLAN_FILE,
    AmpOption,
    OpTypePlanning,
    Trials,
    enact,
    live_kinds,
    make_trials,
    trial_calls,
)
from qsync_callback.integrations.horovod_tf.mixed_precision import PRIORLIST_FILE
from qsync_callback.plan import Plan
from qsync_callback.recorder.kineto import CLOCK_SYNC
from qsync_callback.recorder.trace import Op, Step, Trace, rank_trace_path
from qsync_callback.recorder.xspace import (
    OPTIMIZER_SCOPES,
    STEP_NAME,
    convert_xspace,
    find_xspace,
    keras_layers,
    load_xspace,
)
from qsync_callback.report import REPORT_FILE, build_report, format_summary, write_report

MODES = ("record", "report", "apply")
COLD_STEPS = 2
PROFILE_DIR = "profile"
WARMUP_RUN = "warmup"
PEAK_SOURCE = "not measured: TensorFlow reports allocator peaks for GPUs only"

F = TypeVar("F", bound=Callable[..., Any])


class Recorder:
    """Record a window of a Horovod + TensorFlow training run and report on it (see the module
    docstring for the schedule).

    Args:
        model: the Keras model trained by the step (for layers, weight bytes and the fingerprint).
        batch_size: the per-rank batch size (goes into the fingerprint).
        output_dir: where each rank writes its trace, and rank 0 the report (and the other ranks'
            traces, which it gathers through Horovod, if they are not there yet).
        warmup_steps: calls before the recorded window (at least 2).
        profile_steps: calls recorded under the profiler (at least 1).
        measure_steps: unprofiled calls timed after the window.
        mode: "record" (write traces only), "report" (also predict, print and write report.json) or
            "apply" (also try plans on the live run, keep the best or roll back; see `apply`).
        optimizer: the optimizer the step applies (default: ``model.optimizer`` if compiled); its
            variables count as resident memory and its name scope marks update ops.
        verify_steps: in mode "apply", timed calls of the baseline and of each candidate (at least 1).
        plan: the plan to apply at the first call (see the module docstring): a plan file; None (the
            default): in mode "apply" the ``plan.json`` kept in ``output_dir``, if there is one;
            False: none.

    Attribute ``groups`` (default None: Horovod's default) is what the step should pass to
    ``hvd.DistributedGradientTape(tape, groups=recorder.groups)``; in mode "apply" a candidate sets
    the planned gradient groups there and re-traces the step.
    """

    def __init__(
        self,
        model: Any = None,
        batch_size: int | None = None,
        output_dir: str | Path = "qsync",
        warmup_steps: int = 10,
        profile_steps: int = 5,
        measure_steps: int = 10,
        mode: str = "report",
        *,
        optimizer: Any = None,
        verify_steps: int = 10,
        plan: str | Path | Literal[False] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if warmup_steps < 2 or profile_steps < 1 or measure_steps < 0:
            raise ValueError("need warmup_steps >= 2, profile_steps >= 1 and measure_steps >= 0")
        if verify_steps < 1:
            raise ValueError("need verify_steps >= 1")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}")
        if model is not None and not hasattr(model, "layers"):
            raise TypeError(f"model must be a Keras model, not {type(model).__name__}")
        if not (plan is None or plan is False or isinstance(plan, (str, Path))):
            raise TypeError(f"plan must be a plan file's path, None or False, not {plan!r}")
        self.model = model
        self.batch_size = batch_size
        self.output_dir = Path(output_dir)
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.measure_steps = measure_steps
        self.mode = mode
        self.verify_steps = verify_steps
        self.plan_path = Path(plan) if isinstance(plan, (str, Path)) else None
        self.use_kept_plan = plan is None and mode == "apply"
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.trace: Trace | None = None
        self.report: dict[str, Any] | None = None
        self.step_ms: list[float] = []  # the timed (unprofiled) calls
        self.rank = 0
        self.world_size = hvd.size() if hvd.is_initialized() else 1
        self.groups: Any = None
        self._step_fn: Callable | None = None
        self._calls = 0
        self._safe = FailSafe("qsync Recorder", self.close)
        self._finished = False
        self._session: Path | None = None
        self._session_mark_us = 0.0
        self._sessions: list[tuple[Path, float]] = []  # kept sessions and their clock marks
        self._fingerprint: dict[str, Any] = {}
        self._resident: dict[str, int] = {}
        self._layers: list[dict[str, Any]] = []
        self._amp = AmpOption()
        self._trials: Trials | None = None  # mode "apply": running, then decided
        self._traces: list[Trace] | None = None  # rank 0, after the report: every rank's trace
        self._applied: Callable | None = None  # the kept candidate's step function
        self._timeline: fusion.Timeline | None = None  # more than one process: Horovod's timeline
        self._collectives: dict[str, list[dict[str, Any]]] = {}  # from the step's graph
        self._fusion: fusion.FusionPlanning | None = None  # mode "apply", more than one process
        self._groups_before: Any = None
        self._start_plan: Plan | None = None  # the plan enacted at call 0, on every rank

    # ----------------------------------------------------------------- schedule

    @property
    def recorded_steps(self) -> list[int]:
        """The calls recorded under the profiler: every other call from ``warmup_steps + 1``."""
        return [self.warmup_steps + 1 + 2 * j for j in range(self.profile_steps)]

    @property
    def finished(self) -> bool:
        """True once the recorder is done (reported, or stepped aside)."""
        return self._finished

    @property
    def failure(self) -> str | None:
        """Why the recorder stepped aside, or None."""
        return self._safe.cause

    @property
    def total_calls(self) -> int:
        """Calls until the recorder is done: the window, and in mode "apply" the trials too."""
        calls = self.recorded_steps[-1] + self.measure_steps + 1
        if self.mode == "apply":
            calls += trial_calls(self.verify_steps)
            if self.world_size > 1:
                calls += CANDIDATE_WARMUP + self.verify_steps  # the gradient-groups candidate
        return calls

    @property
    def active(self) -> str:
        """Which step function runs now: "baseline" (the original), the kept candidate's name, or
        the kinds of the plan applied at the first call (joined by "+")."""
        if self._start_plan is not None:
            return "+".join(live_kinds(self._start_plan)) or BASELINE
        if self._trials is None or self._trials.chosen is None:
            return BASELINE
        return self._trials.chosen.name

    @property
    def verification(self) -> dict[str, Any] | None:
        """Mode "apply", rank 0, once decided: the figures and the decision (as in verification.json)."""
        return self._trials.verification if self._trials is not None else None

    def _timed(self, step: int) -> bool:
        last = self.recorded_steps[-1]
        if step < self.warmup_steps - 1:
            return step >= COLD_STEPS
        return self.warmup_steps < step <= last + self.measure_steps and step not in self.recorded_steps

    def _attach(self, fn: Callable) -> None:
        if self._step_fn is not None and self._step_fn is not fn:
            raise ValueError("this Recorder already profiles another train step; make one Recorder per step")
        self._step_fn = fn

    def run_step(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run one call of the decorated train step (see `profile`); returns its result unchanged."""
        if self._trials is not None and not self._trials.done and self._safe.ok:
            return self._trial_step(fn, args, kwargs)
        if self._finished:
            return (self._applied or fn)(*args, **kwargs)
        step = self._calls
        self._calls += 1
        self._before(step, args, kwargs)
        fn = self._applied or fn
        recorded = self._session is not None and step in self.recorded_steps
        start = time.perf_counter()
        try:
            if recorded:
                with tf.profiler.experimental.Trace(STEP_NAME, step_num=step, _r=1):
                    result = fn(*args, **kwargs)
            else:
                result = fn(*args, **kwargs)
        except Exception as exc:
            self._safe.fail(f"the train step raised {type(exc).__name__}: {exc}")
            self._after(step, None)  # keeps this rank at the same meeting points as the others
            raise
        except BaseException:
            self._safe.fail("the train step was interrupted; recording stopped")
            self._finished = True
            raise
        elapsed_ms = (time.perf_counter() - start) * 1e3
        self._after(step, elapsed_ms)
        return result

    def _before(self, step: int, args: Sequence, kwargs: Mapping) -> None:
        if step == 0:
            if not hvd.is_initialized():
                self._safe.fail("Horovod is not initialized; call hvd.init() before the first train step")
                self._finished = True
                return
            self._safe.run(self._start, args, kwargs)
            if self.plan_path is not None or self.use_kept_plan:
                self._use_start_plan()
                if self._finished:
                    return
        if step == self.warmup_steps - 1:
            self._safe.run(self._prepare_window)
            self._open_session(self._profile_dir() / WARMUP_RUN)
        elif step in self.recorded_steps:
            if step == self.recorded_steps[0] and self.world_size > 1:
                self._read_collectives(args, kwargs)
            self._open_session(self._profile_dir() / f"step{step}")
            if self._timeline is not None and self._session is not None:
                self._timeline.start(step, write=self.rank == 0)

    def _after(self, step: int, elapsed_ms: float | None) -> None:
        if self._finished:
            return
        if elapsed_ms is not None and self._timed(step):
            self.step_ms.append(elapsed_ms)
        if step == self.warmup_steps - 1 or step in self.recorded_steps:
            self._close_session(keep=step != self.warmup_steps - 1)
            if step == self.recorded_steps[-1] and self._safe.ok:
                self.trace = self._safe.run(self._convert)
        if step == self.recorded_steps[-1] + self.measure_steps and not self._finished:
            self._window_done()

    # ----------------------------------------------------------------- the recorded window

    def _start(self, args: Sequence, kwargs: Mapping) -> None:
        self.rank, self.world_size = hvd.rank(), hvd.size()
        self._layers = keras_layers(self.model) if self.model is not None else []
        self._fingerprint = tf_fingerprint(
            self._layers, batch_shapes_of((args, kwargs)), self.batch_size, self.world_size, _device()
        )

    def _use_start_plan(self) -> None:
        """Call 0: rank 0 finds the plan to start with (`_find_start_plan`); every rank enacts it, all
        or none (a failure on any rank makes every rank step aside, TF's options and env put back).
        In mode "apply" the recorder is then done."""
        text = (self._safe.run(self._find_start_plan) or "") if self.rank == 0 else ""
        shared = self._exchange(text)
        if not self._agree() or not shared or not shared[0]:
            return
        enacted = self._safe.run(self._enact, shared[0])
        if not self._agree():
            return  # close() has put TF's option and env back; groups were not set
        self._start_plan, self._applied, self.groups = enacted
        if self.rank == 0:
            kinds = ", ".join(live_kinds(self._start_plan)) or "no change to the step"
            print(f"qsync: applied the plan at the first call ({kinds})", flush=True)
            if self._start_plan.communication:
                print(fusion.launch_note(self._start_plan), flush=True)
        if self.mode == "apply":
            self._finished = True

    def _find_start_plan(self) -> str:
        """Rank 0: the JSON of the plan to start with, or "" for none. A given plan that cannot be
        read or was made for another run raises QSyncInputError; the kept one is then only not used,
        with a warning."""
        if self.plan_path is not None:
            path, source = self.plan_path, str(self.plan_path)
        else:
            path, source = self.output_dir / PLAN_FILE, f"the kept plan {self.output_dir / PLAN_FILE}"
            if not path.exists():
                return ""
        try:
            plan = Plan.load(path)
            plan.check_for(self._fingerprint, source=source)
        except QSyncInputError as exc:
            if self.plan_path is not None:
                raise
            warnings.warn(
                f"qsync Recorder: not applying {exc}; planning afresh", RuntimeWarning, stacklevel=3
            )
            return ""
        print(f"qsync: applying the plan from {path}", flush=True)
        return plan.to_json()

    def _enact(self, text: str) -> tuple[Plan, Callable | None, Any]:
        """Rank 0's plan on this rank: the plan, its step function (None: the original) and its
        gradient groups, which the caller sets once every rank has them; TF's bf16 option and env
        lists are set here (`apply.enact`; `close` puts them back)."""
        plan = Plan.from_json(text, source="rank 0's plan")
        variables = self.model.trainable_variables if self.model is not None else []
        groups = fusion.groups_by_variable(plan.buckets, variables) if plan.buckets else self.groups
        layers = [layer["name"] for layer in self._layers]
        fn = enact(plan, self._step_fn, layers, self._amp, self.output_dir / PRIORLIST_FILE)
        return plan, (fn if fn is not self._step_fn else None), groups

    def _trace_dir(self) -> Path:
        return self.output_dir / "trace"

    def _profile_dir(self) -> Path:
        return rank_trace_path(self._trace_dir(), self.rank).parent / PROFILE_DIR

    def _prepare_window(self) -> None:
        """Clear this rank's old profiles and count the bytes held across steps."""
        shutil.rmtree(self._profile_dir(), ignore_errors=True)
        self._profile_dir().mkdir(parents=True, exist_ok=True)
        self._resident = resident_bytes(self.model, self.optimizer)
        if self.world_size > 1:
            timeline_dir = self._profile_dir().parent / fusion.TIMELINE_DIR
            shutil.rmtree(timeline_dir, ignore_errors=True)
            self._timeline = fusion.Timeline(timeline_dir)

    def _read_collectives(self, args: Sequence, kwargs: Mapping) -> None:
        """The step's all-reduced tensors from its graph; a step that is no ``tf.function`` (or a
        graph that cannot be read) leaves them to Horovod's timeline, on rank 0."""
        variables = self.model.trainable_variables if self.model is not None else []
        step_fn = self._applied or self._step_fn
        try:
            self._collectives = fusion.graph_collectives(step_fn, args, kwargs, variables, self.groups)
        except Exception:  # noqa: BLE001 - optional structure: the timeline still gives rank 0's sizes
            self._collectives = {}

    def _open_session(self, logdir: Path) -> None:
        """Start a profiler session into ``logdir``, meet the other ranks, then put a clock mark into
        the profile. A profile's times count from its session's start: the mark's wall-clock time
        puts every session of every rank on this host's clock, and the first one (all ranks just
        left the meeting) is the common zero across hosts."""
        self._safe.run(self._start_profiler, logdir)
        if self._agree():
            before = time.time_ns()
            with tf.profiler.experimental.Trace(CLOCK_SYNC):
                pass
            self._session_mark_us = (before + time.time_ns()) / 2e3

    def _start_profiler(self, logdir: Path) -> None:
        tf.profiler.experimental.start(str(logdir))
        self._session = logdir

    def _close_session(self, keep: bool) -> None:
        """Meet the other ranks (Horovod's thread finishes the step's collectives first: the meeting
        queues behind them), then stop the profiler; keep the session's profile or remove it."""
        session = self._session
        ok = self._agree()
        if self._timeline is not None:
            self._timeline.stop()
        stopped = self._safe.run(self._stop_profiler) is not None
        if session is None:
            return
        if ok and stopped and keep:
            self._sessions.append((session, self._session_mark_us))
        else:
            shutil.rmtree(session, ignore_errors=True)

    def _stop_profiler(self) -> None:
        if self._session is not None:
            self._session = None
            tf.profiler.experimental.stop()

    def _convert(self) -> Trace:
        """One normalized trace of the recorded sessions (one step each, op ids made unique)."""
        scopes = list(OPTIMIZER_SCOPES)
        if getattr(self.optimizer, "name", None):
            scopes.append(self.optimizer.name)
        steps, ops = [], []
        for session, mark_us in self._sessions:
            space = load_xspace(find_xspace(session))
            converted = convert_xspace(space, self._layers, scopes, collective_tensors=self._collectives)
            if converted["clock_sync_us"] is None:
                raise ValueError(f"{session}: the profile lost its clock mark")
            shift = mark_us - converted["clock_sync_us"]
            steps.extend(Step(s.index, s.start_us + shift, s.end_us + shift) for s in converted["steps"])
            ops.extend(_shifted(converted["ops"], len(ops), shift))
        return Trace(
            rank=self.rank,
            world_size=self.world_size,
            device=_device(),
            steps=steps,
            ops=ops,
            framework="tensorflow",
            framework_version=tf.__version__,
            host=socket.gethostname(),
            clock_offset_us=-self._sessions[0][1],
            resident_bytes=self._resident,
            layers=self._layers,
            measured={"peak_bytes": None, "peak_source": PEAK_SOURCE},
            fingerprint=self._fingerprint,
            raw_trace=PROFILE_DIR,
            communication=self._communication(ops),
        )

    def _communication(self, ops: list[Op]) -> dict[str, Any]:
        """Horovod's settings in effect and the timeline (its records go into ``ops``, on rank 0)."""
        settings = fusion.horovod_settings()
        groups = self.groups
        if isinstance(groups, list):
            groups = [[v.name for v in group] for group in groups]
        out = {"library": "horovod", **settings, "groups": groups, "plan_in_effect": self._plan_in_effect()}
        if self._timeline is not None:
            if self.rank == 0:
                fusion.attach_timeline(ops, self._timeline.records())
            out.update(self._timeline.describe(self._profile_dir().parent))
        return out

    def _plan_in_effect(self) -> bool:
        """Whether the plan applied at the first call (said then), or else a plan.json of an earlier
        run, set the fusion threshold and cycle time in effect (said once, on rank 0)."""
        if self._start_plan is not None:
            return fusion.settings_in_effect(self._start_plan)
        path = self.output_dir / PLAN_FILE
        try:
            plan = Plan.load(path) if path.exists() else None
        except QSyncInputError:
            return False
        in_effect = fusion.settings_in_effect(plan)
        if in_effect and self.rank == 0:
            print(f"qsync: {path}'s fusion threshold and cycle time are in effect", flush=True)
        return in_effect

    def _save(self) -> None:
        self.trace.measured["step_ms"] = list(self.step_ms)
        self.trace.save(rank_trace_path(self._trace_dir(), self.rank))

    def _window_done(self) -> None:
        """Every rank saves its trace with the measured steps; rank 0 reports (mode "report")."""
        ok = self._safe.ok and self.trace is not None and self._safe.run(self._save) is not None
        if not self._agree(ok) or self.mode == "record":
            self._finished = True
            return
        texts = self._exchange(json.dumps(self.trace.to_dict(), separators=(",", ":")))
        if self.rank == 0 and texts is not None:
            self._safe.run(self._report, texts)
        self._finished = True
        if self.mode == "apply" and self._agree():
            self._trials = self._safe.run(self._make_trials)

    # ----------------------------------------------------------------- mode "apply"

    def _make_trials(self) -> Trials:
        layers = [layer["name"] for layer in self._layers]
        planning = OpTypePlanning(
            self._traces,
            self.rank,
            self._profile_dir() / AMP,
            self.output_dir,
            lambda text: _gather_strings(text, self.world_size)[0],
        )
        trials = make_trials(self._step_fn, layers, self._fingerprint, self._amp, planning)
        if self.world_size > 1:
            self._fusion = fusion.FusionPlanning(self._traces, self.rank, planning.share)
            self._groups_before = self.groups
            variables = self.model.trainable_variables if self.model is not None else []
            trials.append(
                fusion.groups_trial(self._step_fn, variables, self._fingerprint, self._fusion, self)
            )
        return Trials(trials, self.verify_steps, self.rank, self.world_size, self.output_dir, self._amp)

    def _trial_step(self, fn: Callable, args: Sequence, kwargs: Mapping) -> Any:
        """One call during the trials; after the last one, decide and switch (every rank at once)."""
        try:
            result = self._trials.step(fn, args, kwargs)
        except Exception as exc:
            self._safe.fail(f"the train step raised {type(exc).__name__}: {exc}")
            raise
        if self._trials.done:
            chosen = self._safe.run(self._trials.decide)
            if chosen is None:
                self._trials.chosen = None  # back to the original step and TF's options (see close)
            self._applied = chosen.fn if chosen and chosen.name != BASELINE else None
            if self._fusion is not None:
                self._safe.run(self._settle_fusion, chosen)
        return result

    def _settle_fusion(self, chosen: Any) -> None:
        """The user's groups again unless the groups candidate was kept; rank 0 writes the fusion
        threshold and cycle time for the next launch into plan.json and says so."""
        if chosen is None or chosen.name != fusion.GROUPS:
            self.groups = self._groups_before
        if self.rank == 0 and chosen is not None:
            message = self._fusion.write_next_launch(self.output_dir / PLAN_FILE)
            if message:
                print(message, flush=True)

    def _report(self, texts: list[str]) -> None:
        traces = [Trace.from_dict(json.loads(t), source=f"rank {i} trace") for i, t in enumerate(texts)]
        for trace in traces:
            path = rank_trace_path(self._trace_dir(), trace.rank)
            if not path.exists():
                trace.save(path)
        self._traces = traces
        self.report = build_report(traces)
        write_report(self.report, self.output_dir / REPORT_FILE)
        print(format_summary(self.report) + f"\n  written to {self.output_dir}", flush=True)

    # ----------------------------------------------------------------- failure handling

    def _agree(self, ok: bool | None = None) -> bool:
        """All ranks go on only if every rank is still healthy (one all-reduce of a flag)."""
        ok = self._safe.ok if ok is None else bool(ok)
        if self.world_size > 1:
            try:
                ok = bool(hvd.allreduce(tf.constant(int(ok)), op=hvd.Min, name="qsync.agree").numpy())
            except Exception as exc:  # noqa: BLE001
                self._safe.fail(f"meeting the other ranks failed: {type(exc).__name__}: {exc}")
                ok = False
        if not ok:
            self._safe.fail("another rank failed; this rank steps aside too")
            self._finished = True
        return ok

    def _exchange(self, text: str) -> list[str] | None:
        """Every rank's ``text``, in rank order; None if the collective failed."""
        try:
            return _gather_strings(text, self.world_size)
        except Exception as exc:  # noqa: BLE001
            self._safe.fail(f"exchanging with the other ranks failed: {type(exc).__name__}: {exc}")
            return None

    def close(self) -> None:
        """Stop this recorder's profiler session if one is running, and put back the original step
        and TF's options if trials were under way; safe to call at any time."""
        if self._applied is None:
            self._amp.restore()
        if self._session is not None:
            self._session = None
            try:
                tf.profiler.experimental.stop(save=False)
            except Exception as exc:  # noqa: BLE001
                warnings.warn(
                    f"qsync Recorder could not stop the profiler: {exc}", RuntimeWarning, stacklevel=2
                )


def profile(recorder: Recorder) -> Callable[[F], F]:
    """Decorator: record the train step with ``recorder``; the step's result is returned unchanged.

    Use as ``@profile(recorder)`` above ``@tf.function``."""
    if not isinstance(recorder, Recorder):
        raise TypeError(f"profile() takes a Recorder (use @profile(recorder)), not {type(recorder).__name__}")

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"@profile(recorder) decorates the train step function, not {type(fn).__name__}")
        recorder._attach(fn)

        @functools.wraps(fn, updated=())
        def step(*args: Any, **kwargs: Any) -> Any:
            return recorder.run_step(fn, *args, **kwargs)

        return step

    return decorate


def patch_horovod() -> None:
    """Make dPRO-style scripts run unchanged: ``hvd.Recorder(...)`` and ``@hvd.profile(recorder)``."""
    hvd.Recorder = Recorder
    hvd.profile = profile


def _gather_strings(text: str, world_size: int) -> list[str]:
    """Every rank's ``text`` in rank order (Horovod all-gathers of the UTF-8 bytes)."""
    if world_size == 1:
        return [text]
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    sizes = hvd.allgather(tf.constant([data.size], tf.int64), name="qsync.sizes").numpy()
    gathered = hvd.allgather(tf.constant(data), name="qsync.texts").numpy().tobytes()
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [gathered[a:b].decode() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _shifted(ops: Iterable[Op], first_id: int, shift_us: float) -> list[Op]:
    """``ops`` with ids (and their deps) counted from ``first_id`` and times moved by ``shift_us``."""
    out = []
    for op in ops:
        op.id += first_id
        op.deps = [d + first_id for d in op.deps]
        op.start_us += shift_us
        out.append(op)
    return out


def _device() -> str:
    return "gpu" if tf.config.list_physical_devices("GPU") else "cpu"


def _variable_bytes(variables: Iterable[Any]) -> int:
    seen, total = set(), 0
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            total += math.prod(v.shape) * v.dtype.size
    return int(total)


def resident_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """Bytes held across steps: trainable weights, other weights, optimizer variables (when known)."""
    resident: dict[str, int] = {}
    if model is not None:
        resident["parameters"] = _variable_bytes(model.trainable_weights)
        resident["buffers"] = _variable_bytes(model.non_trainable_weights)
    variables = getattr(optimizer, "variables", None)
    if variables is not None:
        resident["optimizer_state"] = _variable_bytes(variables() if callable(variables) else variables)
    return resident


def batch_shapes_of(value: Any) -> list[list[int]]:
    """Shapes of the tensors and arrays in a (nested) argument structure, in order."""
    if isinstance(value, (tf.Tensor, np.ndarray)):
        return [[int(d) if d is not None else -1 for d in value.shape]]
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in batch_shapes_of(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in batch_shapes_of(v)]
    return []


def tf_fingerprint(
    layers: Sequence[Mapping[str, Any]],
    batch_shapes: Sequence,
    batch_size: int | None,
    world_size: int,
    device: str,
) -> dict[str, Any]:
    """What a plan for this run depends on: structure, batch, device, world size, versions."""
    from qsync_callback import __version__

    structure = [(t["name"], t["type"], t["param_bytes"]) for t in layers]
    return {
        "model": hashlib.sha256(json.dumps(structure).encode()).hexdigest()[:16],
        "layers": [t["name"] for t in layers],
        "batch_shapes": [list(s) for s in batch_shapes],
        "batch_size": batch_size,
        "device": device,
        "world_size": world_size,
        "versions": {
            "tensorflow": tf.__version__,
            "horovod": horovod.__version__,
            "qsync_callback": __version__,
        },
    }
