"""Record a window of a live TensorFlow train step (Horovod's or not) into a normalized trace.

The caller calls `TFRecorder.step_boundary()` right before each call of the train step and
`step_end()` right after it returns. A call is timed on the wall clock from its boundary (or from
the ranks' meeting after it, `restart_step_clock`) to its return. Calls are counted from 0 in the
window:

- calls before ``warmup_steps`` run untouched and are timed (the first `COLD_STEPS` are not: they
  trace the function), except the last, which runs under a profiler session that is thrown away (a
  session's first profiled call is slow); right before it, at its boundary, the profiler's cost per
  recorded event is calibrated (`ProfilerCalibration`: three small loops timed inside that session
  and outside it, before it starts and after it stops), and when it stops the events it recorded in
  the loops' ranges are counted;
- call ``warmup_steps`` settles after that session and is not timed;
- then ``profile_steps`` calls are recorded, every other call, each in a ``tf.profiler`` session of
  its own with a ``qsync::step`` mark around it; the unprofiled calls between them are timed, so
  that measured and recorded calls see the same conditions of the machine (see
  `qsync_callback.recorder.torch_recorder`);
- at the boundary after the last recorded call each session's XSpace is converted
  (`recorder/xspace.py`) into the trace; the raw profiles stay beside it in ``profile/`` (a
  TensorBoard log directory, one run per recorded call);
- ``measure_steps`` more calls are timed (the measured step time is their median, with the others
  timed before);
- for planning, the op-type probe (`recorder/tf_op_types.py`) then runs its calls of TF's uniform
  bf16 rewrite (the last of them in turns with the recorded step, the rewrite's reading the
  allocator's peak), and its table goes into the trace (``precision_costs["op_types"]``).

Profiler overhead: the calibrated cost per event of each kind (``trace.profiler_overhead_us``,
`xspace.EVENT_KINDS`) is charged to the recorded ops' ``overhead_us`` and ``gap_overhead_us``
(`xspace.convert_xspace`), which the predictor subtracts: a prediction is for the run without the
profiler. What the loops do not see (a session's start, the caches it leaves cold, a slow stretch
of the machine under the recorded calls: recorded calls of the GRU took 16 to 22 ms in two runs
whose timed calls took 14.5 ms) is taken from the run's own timed calls, as on the torch side
(`event_costs.calibrate_on_steps`, ``measured["profiler_share"]``): so for the configuration
recorded the prediction is calibrated on the run (the report says so) and its error checks the
replay; a plan's prediction re-costs the ops it changes and is judged by verify.

Sessions and ranks: the recorder makes no collective call of its own; the caller's ranks meet
right after each boundary that opens a session (`meet_after`), and `restart_step_clock` then puts a
``qsync::clock_sync`` mark into the profile. A profile's times count from its session's start: the
mark's wall-clock time puts every session of every rank on this host's clock, and the first kept
session's mark (all ranks had just left the meeting) is the common zero across hosts. The ranks
meet again right before each boundary that closes a session (`meet_before`): the meeting queues
behind the step's last collective in Horovod's thread, so the session holds it; and once more right
after a recorded call's session closed, so that the timed call after it starts together on all
ranks (stopping a session takes each rank its own time).

With more than one process: Horovod's timeline (when the caller gives one) runs during each
recorded call, and its records go into the collective ops of rank 0's trace; the collectives'
tensors, sizes, dtypes and variables are read from the step's concrete function graph at the first
recorded call (`recorder/tf_collectives.py`; a step that is no ``tf.function`` leaves them to the
timeline). Resident bytes: the model's weights and the optimizer's variables, counted when the
window opens, and the allocator's bytes in use then.

Memory: each timed call's peak is TF's allocator's own (`recorder/tf_memory.py`: reset at the
call's boundary, read after it), and the measured peak is the largest; the recorded calls' profiles
give the allocator's every allocation and free (`xspace.py`), the trace's memory events, from which
the predictor simulates the allocator (`predictor/bfc_allocator.py`).
"""

from __future__ import annotations

import math
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import tensorflow as tf

from qsync_callback.recorder.event_costs import calibrate_on_steps, event_costs
from qsync_callback.recorder.horovod_timeline import TensorRecord
from qsync_callback.recorder.kineto import CALIBRATION_LOOP_PREFIX, CLOCK_SYNC
from qsync_callback.recorder.tf_collectives import attach_timeline, graph_collectives
from qsync_callback.recorder.tf_memory import StepPeaks
from qsync_callback.recorder.tf_op_types import LiveStep, OpTypeProbe
from qsync_callback.recorder.trace import OP_TYPE_COSTS, Op, Step, Trace, rank_trace_path
from qsync_callback.recorder.xspace import (
    EVENT_KINDS,
    OPTIMIZER_SCOPES,
    STEP_NAME,
    calibration_event_counts,
    convert_xspace,
    find_xspace,
    load_xspace,
)

COLD_STEPS = 2
PROFILE_DIR = "profile"
WARMUP_RUN = "warmup"
PROBE_RUN = "bf16_probe"


class Timeline(Protocol):
    """Horovod's timeline for the recorded calls (`integrations/horovod_tf/fusion.py`)."""

    def start(self, step: int, write: bool) -> None: ...

    def stop(self) -> None: ...

    def records(self) -> list[TensorRecord]: ...

    def describe(self, rank_dir: Path) -> dict[str, Any]: ...


class TFRecorder:
    """One recorded window of ``step`` (see the module docstring). ``communication`` is the
    collective library's settings in effect (the trace adds the step's groups and the timeline);
    ``switch_to_bf16``, when given, makes this a planning window: it switches the step to TF's
    uniform bf16 rewrite and returns the undo, for the op-type probe."""

    def __init__(
        self,
        step: LiveStep,
        trace_dir: Path,
        *,
        warmup_steps: int,
        profile_steps: int,
        measure_steps: int,
        model: Any,
        optimizer: Any,
        layers: Sequence[Mapping[str, Any]],
        fingerprint: Mapping[str, Any],
        rank: int = 0,
        world_size: int = 1,
        communication: Mapping[str, Any] | None = None,
        timeline: Timeline | None = None,
        switch_to_bf16: Callable[[], Callable[[], None]] | None = None,
    ):
        self.step = step
        self.trace_dir = Path(trace_dir)
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.measure_steps = measure_steps
        self.model = model
        self.optimizer = optimizer
        self.layers = [dict(layer) for layer in layers]
        self.fingerprint = dict(fingerprint)
        self.rank = rank
        self.world_size = world_size
        self.communication = dict(communication or {})
        self.timeline = timeline
        self.trace: Trace | None = None
        self.step_ms: list[float] = []  # the timed (unprofiled) calls
        self.step_peaks: list[int] = []  # their allocator peaks (bytes), where TF keeps them
        self._peaks = StepPeaks()
        self._in_use_at_start: int | None = None
        self._probe = None
        if switch_to_bf16 is not None:
            self._probe = OpTypeProbe(step, self._profile_dir() / PROBE_RUN, switch_to_bf16, self._peaks)
        self._calls = 0  # boundaries so far
        self._clock = 0.0
        self._session: Path | None = None
        self._opened = False  # a session opened at this boundary: its clock mark is due
        self._mark: Any = None  # the recorded call's step mark, while it runs
        self._failure: Exception | None = None  # of `restart_step_clock`, raised by `step_end`
        self._sessions: list[tuple[Path, float]] = []  # kept sessions and their clock marks (us)
        self._mark_us = 0.0
        self._resident: dict[str, int] = {}
        self._collectives: dict[str, list[dict[str, Any]]] = {}
        self._calibration: ProfilerCalibration | None = None
        self._overhead: dict[str, float] = {}  # us per recorded event, by kind

    # ----------------------------------------------------------------- schedule

    @property
    def recorded_steps(self) -> list[int]:
        """The calls recorded under the profiler: every other call from ``warmup_steps + 1``."""
        return [self.warmup_steps + 1 + 2 * j for j in range(self.profile_steps)]

    @property
    def meet_after(self) -> set[int]:
        """Boundaries that open a session (the warm-up one, each recorded call's), and those that
        close a recorded call's (so that the timed call after it starts together on all ranks)."""
        return {self.warmup_steps - 1, *self.recorded_steps, *(k + 1 for k in self.recorded_steps)}

    @property
    def meet_before(self) -> set[int]:
        """Boundaries that close a session."""
        return {self.warmup_steps, *(k + 1 for k in self.recorded_steps)}

    @property
    def _probe_start(self) -> int:
        return self.recorded_steps[-1] + self.measure_steps + 1

    @property
    def done_step(self) -> int:
        """The boundary at which the window is complete: its measured calls (and probe) have run."""
        return self._probe_start + (self._probe.calls if self._probe is not None else 0)

    def _timed(self, call: int) -> bool:
        if call < self.warmup_steps - 1:
            return call >= COLD_STEPS
        last = self.recorded_steps[-1]
        return self.warmup_steps < call <= last + self.measure_steps and call not in self.recorded_steps

    # ----------------------------------------------------------------- hooks

    def step_boundary(self) -> None:
        call = self._calls
        self._calls += 1
        if call == self.warmup_steps - 1:
            self._prepare_window()
            self._calibration = ProfilerCalibration()
            self._calibration.time_plain()
            self._start_session(self._profile_dir() / WARMUP_RUN)
            self._calibration.time_profiled()
        elif call == self.warmup_steps:
            self._stop_session(keep=False, calibrated=True)
        elif call - 1 in self.recorded_steps:
            self._stop_session(keep=True)
            if call - 1 == self.recorded_steps[-1]:
                self.trace = self._convert()
        if call in self.recorded_steps:
            if call == self.recorded_steps[0] and self.world_size > 1:
                self._read_collectives()
            self._start_session(self._profile_dir() / f"step{call}")
        if self._probe is not None and call >= self._probe_start:
            if call == self.done_step:
                self.trace.precision_costs[OP_TYPE_COSTS] = self._probe.table(self.trace)
            else:
                self._probe.step_boundary(call - self._probe_start)
        if self._timed(call):
            self._peaks.start()
        self._clock = time.perf_counter()

    def restart_step_clock(self) -> None:
        """The ranks have just met: a session opened at this boundary gets its clock mark now (and a
        recorded call its timeline and step mark), and the call's clock starts now. A failure here
        is raised by `step_end`, where the caller's fail-safe sees it."""
        try:
            self._mark_session()
        except Exception as exc:  # noqa: BLE001 - raised again in step_end
            self._failure = exc
        self._clock = time.perf_counter()

    def _mark_session(self) -> None:
        if self._opened:
            self._opened = False
            before = time.time_ns()
            with tf.profiler.experimental.Trace(CLOCK_SYNC):
                pass
            self._mark_us = (before + time.time_ns()) / 2e3
            call = self._calls - 1
            if call in self.recorded_steps:
                if self.timeline is not None:
                    self.timeline.start(call, write=self.rank == 0)
                self._mark = tf.profiler.experimental.Trace(STEP_NAME, step_num=call, _r=1)
                self._mark.__enter__()

    def step_end(self) -> None:
        elapsed_ms = (time.perf_counter() - self._clock) * 1e3
        call = self._calls - 1
        self._end_mark()
        if self._failure is not None:
            raise self._failure
        if self._timed(call):
            self.step_ms.append(elapsed_ms)
            peak = self._peaks.end()
            if peak is not None:
                self.step_peaks.append(peak)
        if self._probe is not None and self._probe_start <= call < self.done_step:
            self._probe.step_end(call - self._probe_start, elapsed_ms)

    def save(self) -> None:
        """Write the trace with the timed calls (``measured.step_ms``), their allocator peaks
        (``measured.step_peak_bytes``; the measured peak is the largest) and the profiler's share
        of the recorded calls beyond the calibrated per-event costs, from the timed ones (once:
        `event_costs.calibrate_on_steps`, as the torch recorder does)."""
        if "profiler_share" not in self.trace.measured and self.step_ms:
            self.trace.measured["profiler_share"] = calibrate_on_steps(self.trace, self.step_ms)
        self.trace.measured["step_ms"] = list(self.step_ms)
        self.trace.measured["step_peak_bytes"] = list(self.step_peaks)
        self.trace.measured["peak_bytes"] = max(self.step_peaks) if self.step_peaks else None
        self.trace.measured["peak_source"] = self._peaks.source
        self.trace.save(rank_trace_path(self.trace_dir, self.rank))

    def close(self) -> None:
        """Stop profiling (a session's profile is dropped) and switch a probed step back; safe at
        any time, more than once."""
        self._end_mark()
        if self.timeline is not None:
            self.timeline.stop()
        if self._probe is not None:
            self._probe.close()
        if self._session is not None:
            self._session = None
            tf.profiler.experimental.stop(save=False)

    # ----------------------------------------------------------------- the window

    def _profile_dir(self) -> Path:
        return rank_trace_path(self.trace_dir, self.rank).parent / PROFILE_DIR

    def _prepare_window(self) -> None:
        """Clear this rank's old profiles and count the bytes held across steps."""
        shutil.rmtree(self._profile_dir(), ignore_errors=True)
        self._profile_dir().mkdir(parents=True, exist_ok=True)
        self._resident = resident_bytes(self.model, self.optimizer)
        self._in_use_at_start = self._peaks.in_use()

    def _read_collectives(self) -> None:
        """The step's all-reduced tensors from its graph; a step that is no ``tf.function`` (or a
        graph that cannot be read) leaves them to Horovod's timeline, on rank 0."""
        variables = self.model.trainable_variables if self.model is not None else []
        try:
            self._collectives = graph_collectives(
                self.step.fn, self.step.args, self.step.kwargs, variables, self.step.groups
            )
        except Exception:  # noqa: BLE001 - optional structure: the timeline still gives rank 0's sizes
            self._collectives = {}

    def _start_session(self, logdir: Path) -> None:
        tf.profiler.experimental.start(str(logdir))
        self._session = logdir
        self._opened = True

    def _stop_session(self, keep: bool, calibrated: bool = False) -> None:
        """Stop the profiler (Horovod's timeline first); keep the session's profile or remove it
        (``calibrated``: after counting the calibration loops' events in it)."""
        if self.timeline is not None:
            self.timeline.stop()
        session, self._session = self._session, None
        tf.profiler.experimental.stop()
        if keep:
            self._sessions.append((session, self._mark_us))
            return
        if calibrated and self._calibration is not None:
            self._calibration.time_plain()
            self._overhead = self._calibration.costs(session)
        shutil.rmtree(session, ignore_errors=True)

    def _end_mark(self) -> None:
        mark, self._mark = self._mark, None
        if mark is not None:
            mark.__exit__(None, None, None)

    def _convert(self) -> Trace:
        """One normalized trace of the recorded sessions (one step each, op ids made unique)."""
        scopes = list(OPTIMIZER_SCOPES)
        if getattr(self.optimizer, "name", None):
            scopes.append(self.optimizer.name)
        steps, ops, memory_events, allocator, readings = [], [], [], None, []
        for session, mark_us in self._sessions:
            space = load_xspace(find_xspace(session))
            converted = convert_xspace(
                space, self.layers, scopes, collective_tensors=self._collectives, overhead_us=self._overhead
            )
            if converted["clock_sync_us"] is None:
                raise ValueError(f"{session}: the profile lost its clock mark")
            shift = mark_us - converted["clock_sync_us"]
            steps.extend(Step(s.index, s.start_us + shift, s.end_us + shift) for s in converted["steps"])
            memory_events.extend(
                [ts + shift, addr, nbytes, op_id + len(ops) if op_id >= 0 else -1]
                for ts, addr, nbytes, op_id in converted["memory_events"]
            )
            allocator = allocator or converted["allocator"]
            if converted["recorded_peak_bytes"] is not None:
                readings.append(converted["recorded_peak_bytes"])
            ops.extend(_shifted(converted["ops"], len(ops), shift))
        allocator = allocator or self._peaks.allocator  # none of the step's requests was counted
        return Trace(
            rank=self.rank,
            world_size=self.world_size,
            device="gpu" if tf.config.list_physical_devices("GPU") else "cpu",
            steps=steps,
            ops=ops,
            framework="tensorflow",
            framework_version=tf.__version__,
            host=socket.gethostname(),
            clock_offset_us=-self._sessions[0][1],
            resident_bytes=self._resident,
            layers=self.layers,
            memory_events=memory_events,
            allocator=self._allocator(allocator, readings),
            measured={"peak_bytes": None, "peak_source": self._peaks.source},
            profiler_overhead_us=dict(self._overhead),
            fingerprint=self.fingerprint,
            raw_trace=PROFILE_DIR,
            communication=self._communication(ops),
        )

    def _allocator(self, name: str | None, readings: list[int]) -> dict[str, Any]:
        """The trace's ``allocator``: its name, the bytes in use when the window opened, and the
        most it read in use in the recorded steps (where its profile gave its readings)."""
        if not name:
            return {}
        out = {"name": name, "in_use_bytes": self._in_use_at_start}
        if readings and self._in_use_at_start is not None:
            out["recorded_peak_bytes"] = max(readings)
        return out

    def _communication(self, ops: list[Op]) -> dict[str, Any]:
        """The settings in effect, the step's groups, and the timeline (its records go into
        ``ops``, on rank 0)."""
        groups = self.step.groups
        if isinstance(groups, list):
            groups = [[v.name for v in group] for group in groups]
        out = {**self.communication, "groups": groups}
        if self.timeline is not None:
            if self.rank == 0:
                attach_timeline(ops, self.timeline.records())
            out.update(self.timeline.describe(self._profile_dir().parent))
        return out


class ProfilerCalibration:
    """What the TF profiler adds per recorded event on this machine, from three small ``tf.function``
    loops, each timed as its best of `REPEATS` calls: outside a profiler session, both right before
    it starts and right after it stops (`time_plain`, the better of the two: the machine drifts), and
    inside it (`time_profiled`, each loop's calls in a ``qsync::calibration::<loop>`` range); `costs`
    then counts the events of each kind (`xspace.EVENT_KINDS`) the session recorded in each range.

    - ``ops``: a chain of `CHAIN` 64x64 MatMuls: TF's executor records each as an op event (it
      records ops it has found expensive, over a few microseconds, and not the cheap ones);
    - ``calls``: a function of a few cheap ops: mostly the events of a function call itself (the
      Python-level mark of a ``tf.function`` call, the eager runtime's and the executor's events);
    - ``executor``: a while loop of `ITERATIONS` iterations of cheap ops, lowered into the
      executor's control flow as a recurrent layer's is: mostly the executor's own
      ``ExecutorState::Process`` events (`xspace.EXECUTOR_EVENTS`), over a thousand a call.

    The loops give three equations (extra time per call = events per call @ cost per event) for the
    three costs, solved by least squares with none negative (`overhead_per_event`). Each loop is
    dominated by the events of one kind, so each cost rests mostly on one loop. The loops run on the
    process's TF thread pools, as the step does; they are traced and warmed up when the calibration
    is made. On the project's 2-core VM, over the 24 runs of session 15's
    `benchmarks/horovod_tf_accuracy.py` table: an op event 0 to 4.4 us (median 1.7), an executor
    event 0 to 0.71 us (median 0.39), a call's event 0 to 15.7 us (median 2.0); the loops tell the
    kinds apart poorly on a drifting machine. Charged at a call's event's cost, as they were before
    they had a kind of their own, a GRU's 6,300 executor events a step took 24 ms off a 16 ms step.
    """

    CHAIN = 32
    ITERATIONS = 128
    REPEATS = 50
    WARM_CALLS = 5

    def __init__(self) -> None:
        self._x = tf.ones([64, 64])
        self._w = tf.eye(64)
        self._v = tf.ones([8])
        chain = self.CHAIN

        @tf.function(autograph=False)
        def ops(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
            for _ in range(chain):
                x = tf.matmul(x, w)
            return x

        @tf.function(autograph=False)
        def calls(v: tf.Tensor) -> tf.Tensor:
            return tf.sin(tf.cos(v) + v)

        iterations = self.ITERATIONS

        @tf.function(autograph=False)
        def executor(v: tf.Tensor) -> tf.Tensor:
            def body(i: tf.Tensor, v: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
                return i + 1, tf.tanh(v * 0.5 + 0.1)

            return tf.while_loop(lambda i, _: i < iterations, body, (tf.constant(0), v))[1]

        self._loops: dict[str, Callable[[], Any]] = {
            "ops": lambda: ops(self._x, self._w),
            "calls": lambda: calls(self._v),
            "executor": lambda: executor(self._v),
        }
        self.plain: dict[str, float] = {}  # seconds per call, best of the repeats
        self.profiled: dict[str, float] = {}
        for loop in self._loops.values():
            for _ in range(self.WARM_CALLS):
                loop()

    def _best(self, loop: Callable[[], Any]) -> float:
        best = math.inf
        for _ in range(self.REPEATS):
            start = time.perf_counter()
            loop()
            best = min(best, time.perf_counter() - start)
        return best

    def time_plain(self) -> None:
        """Outside a profiler session (again: the better of both times)."""
        for name, loop in self._loops.items():
            self.plain[name] = min(self._best(loop), self.plain.get(name, math.inf))

    def time_profiled(self) -> None:
        """Inside a running profiler session: each loop's calls in its calibration range."""
        for name, loop in self._loops.items():
            with tf.profiler.experimental.Trace(CALIBRATION_LOOP_PREFIX + name):
                self.profiled[name] = self._best(loop)

    def costs(self, session: Path) -> dict[str, float]:
        """Microseconds per recorded event of each kind, from the stopped ``session``'s profile."""
        counts = calibration_event_counts(load_xspace(find_xspace(session)))
        calls = {loop: {k: n / self.REPEATS for k, n in kinds.items()} for loop, kinds in counts.items()}
        return overhead_per_event(self.plain, self.profiled, calls)


def overhead_per_event(
    plain: Mapping[str, float],
    profiled: Mapping[str, float],
    events_per_call: Mapping[str, Mapping[str, float]],
) -> dict[str, float]:
    """Microseconds the profiler adds per recorded event of each kind (`xspace.EVENT_KINDS`), from
    ``plain`` and ``profiled`` seconds per call of each loop outside and inside a session and
    ``events_per_call``, the events of each kind a call recorded (`event_costs.event_costs`)."""
    extra_us = {loop: (profiled[loop] - plain[loop]) * 1e6 for loop in plain.keys() & profiled.keys()}
    return event_costs(EVENT_KINDS, extra_us, events_per_call)


def _shifted(ops: Iterable[Op], first_id: int, shift_us: float) -> list[Op]:
    """``ops`` with ids (and their deps) counted from ``first_id`` and times moved by ``shift_us``."""
    out = []
    for op in ops:
        op.id += first_id
        op.deps = [d + first_id for d in op.deps]
        op.start_us += shift_us
        out.append(op)
    return out


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
