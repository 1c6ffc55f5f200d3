"""Tensor liveness and the memory curve of recorded steps (G10's birth, death and inactive period).

Every allocation in a recorded step is paired with its free by address, giving a tensor with a
birth (the op that allocated it) and a death (the op that freed it, or none: still alive when the
step ended). The phases of those two ops say what the tensor was:

- born in forward, freed in backward: an **activation** saved for backward; the time between its
  last forward use and its backward use is its inactive period, what offload can exploit;
- born and freed within one phase: a **temporary**;
- born in backward and kept past the step's backward: a **gradient**;
- born in the optimizer update and kept: **optimizer state**;
- freed in the step but born before it: part of what was **resident** at the step's start
  (including the previous step's gradients, whose frees the profiler often cannot see: see
  `_unseen_gradient_frees`).

The bytes resident at a step's start (parameters, buffers, gradients, optimizer state, DDP's
gradient buckets, and ``other``: any other live tensor on the device, such as one kept as a plain
attribute, the batch or the data set) come from the recorder, which counts them once, when its
window opens; every step starts from that same state. A step's curve is that baseline (every
category summed) plus the bytes of every tensor alive at each moment; the largest over the recorded
steps is the predicted peak, with the bytes of each category alive at that moment (``other``: the
resident ones and those born outside any phase and kept). `MemoryCurve` keeps each step's births
and deaths as sorted arrays, so that a plan's extra tensors (`precision.PrecisionLives`) are merged
in rather than the curve rebuilt.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from qsync_callback.predictor.bfc_allocator import for_allocator
from qsync_callback.recorder.trace import Op, Trace

CATEGORIES = ("activations", "temporaries", "gradients", "optimizer_state", "other")
# steps run one after another through a simulated allocator (`allocator_peaks`): about as many as the
# recorder times for the measured peak's largest step
ALLOCATOR_STEPS = 40


@dataclass
class TensorLife:
    """One tensor's lifetime within a recorded step; ``birth_us`` None: allocated before the step,
    ``death_us`` None: still alive when it ended."""

    addr: int
    bytes: int
    step: int
    birth_us: float | None
    death_us: float | None
    birth_op: Op | None
    death_op: Op | None
    category: str
    layer: str | None = None

    @property
    def inactive_us(self) -> float | None:
        """Time from the end of the op that made it to the start of the op that freed it."""
        if self.birth_op is None or self.death_op is None:
            return None
        return max(0.0, self.death_op.start_us - self.birth_op.end_us)


@dataclass
class MemoryPrediction:
    """Predicted peak bytes of one rank, in which step, and what is alive then."""

    peak_bytes: int
    peak_step: int | None
    breakdown: dict[str, int] = field(default_factory=dict)
    step_peaks: dict[int, int] = field(default_factory=dict)
    peak_bytes_simulated: int | None = None  # TF's allocator simulated, before `allocator_offset`


def _category(birth: Op | None, death: Op | None) -> str:
    if birth is None:  # born in the step outside every op (a free of a block born before it is "resident")
        return "other"
    if birth.kind == "forward":
        if death is not None and death.kind == "backward":
            return "activations"
        return "temporaries" if death is not None and death.kind == "forward" else "other"
    if birth.kind == "backward":
        return "temporaries" if death is not None and death.kind == "backward" else "gradients"
    if birth.kind == "update":
        return "temporaries" if death is not None and death.kind == "update" else "optimizer_state"
    return "temporaries" if death is not None and death.kind == birth.kind else "other"


def _step_of(trace: Trace):
    steps = sorted(trace.steps, key=lambda s: s.start_us)

    def step_of(ts: float) -> int | None:
        for step in steps:
            if step.start_us <= ts < step.end_us:
                return step.index
        return None

    return step_of


def tensor_lifetimes(trace: Trace) -> list[TensorLife]:
    """Pair each step's allocations and frees by address (see the module docstring).

    Steps are paired separately: every recorded step starts from the same resident state, and
    the steps need not be consecutive (the recorder profiles every other step)."""
    ops = {op.id: op for op in trace.ops}
    step_of = _step_of(trace)
    lives: list[TensorLife] = []
    open_allocs: dict[int, tuple[float, int, Op | None]] = {}
    current: int | None = None

    def close(addr: int, ts: float | None, death: Op | None) -> None:
        born_ts, nbytes, birth = open_allocs.pop(addr)
        lives.append(
            TensorLife(
                addr,
                nbytes,
                current,
                born_ts,
                ts,
                birth,
                death,
                _category(birth, death),
                birth.layer if birth else None,
            )
        )

    for ts, addr, nbytes, op_id in sorted(trace.memory_events, key=lambda e: e[0]):
        step = step_of(ts)
        if step is None:
            continue
        if step != current:
            for left in list(open_allocs):
                close(left, None, None)
            current = step
        op = ops.get(op_id)
        if nbytes > 0:
            if addr in open_allocs:
                close(addr, ts, op)
            open_allocs[addr] = (ts, nbytes, op)
        elif addr in open_allocs:
            close(addr, ts, op)
        else:
            lives.append(TensorLife(addr, -nbytes, step, None, ts, None, op, "resident"))
    for left in list(open_allocs):
        close(left, None, None)
    return lives + _unseen_gradient_frees(trace, lives)


def _unseen_gradient_frees(trace: Trace, lives: list[TensorLife]) -> list[TensorLife]:
    """The frees of last step's gradients that the profiler did not see, one per step.

    A step that makes new gradients and keeps them (``gradients`` alive at its end) as large as the
    resident ones replaced the old ones (``zero_grad(set_to_none=True)``, Lightning's default), so
    they were freed in it. The profiler reports a free only for a block it saw allocated, and the
    old gradients were allocated in the step before, outside the session: so many of those frees are
    missing, and more or fewer of them from run to run (a freed address reused in a session becomes
    known). Each new gradient replaced an old one of its size: those with no reported free of that
    size before the backward (where the training loop zeroes the gradients at the latest; a
    resident block freed later is something else) are freed at the start of the first backward op.
    """
    resident = trace.resident_bytes.get("gradients", 0)
    if not resident:
        return []
    first_backward: dict[int, Op] = {}
    for op in trace.ops:
        if op.kind == "backward" and (
            op.step not in first_backward or op.start_us < first_backward[op.step].start_us
        ):
            first_backward[op.step] = op
    replaced: dict[int, list[int]] = defaultdict(list)
    reported: dict[int, list[int]] = defaultdict(list)
    for life in lives:
        if life.category == "gradients" and life.death_us is None:
            replaced[life.step].append(life.bytes)
        elif life.category == "resident" and life.step in first_backward:
            if life.death_us < first_backward[life.step].start_us:  # zeroed before the backward
                reported[life.step].append(life.bytes)
    unseen = []
    for step, op in first_backward.items():
        # each new gradient replaced an old one of its size: the old ones whose free was not seen
        frees = sorted(reported[step])
        missing = 0
        for nbytes in replaced[step]:
            if nbytes in frees:
                frees.remove(nbytes)
            else:
                missing += nbytes
        missing = min(missing, resident)
        if missing > 0:
            unseen.append(TensorLife(-1, missing, step, None, op.start_us, None, op, "resident"))
    return unseen


Events = tuple[np.ndarray, np.ndarray, np.ndarray]  # times, byte changes, category codes


class MemoryCurve:
    """One rank's recorded memory curve, ready to be priced again with extra tensors: each step's
    births and deaths (`lifetime_events`).

    On a trace of TF's allocator, the simulation of ``lives`` is calibrated on a reading of that
    allocator in steps that ran them (`allocator_offset`): ``lives`` are the recorded tensors
    (`tensor_lifetimes`), calibrated on the recorded steps' reading, or a plan's tensors calibrated
    on ``allocator_reading`` (the steps of the configuration they are: `with_lives`), or calibrated
    as the recorded ones were, by ``allocator_offset_bytes``."""

    def __init__(
        self,
        trace: Trace,
        lives: Sequence[TensorLife],
        allocator_offset_bytes: int | None = None,
        allocator_reading: int | None = None,
    ):
        self.resident_bytes = dict(trace.resident_bytes)
        self.lives = list(lives)
        self._trace = trace
        self._resident = sum(trace.resident_bytes.values())
        self._steps = lifetime_events(lives)
        self._allocator_offset = allocator_offset_bytes  # `allocator_offset`, when first needed
        self._reading = (
            trace.allocator.get("recorded_peak_bytes") if allocator_reading is None else allocator_reading
        )
        self._simulated: dict[int, int] | None = None  # `allocator_peaks` of ``lives``, when first needed

    def with_lives(self, lives: Sequence[TensorLife], reading: int | None = None) -> MemoryCurve:
        """The same rank's curve with other tensors (a plan's, `op_precision.op_type_lives`),
        calibrated on ``reading`` where the allocator read the configuration they are (the uniform
        rewrite's probe calls, `op_precision.rewrite_reading`), else as this one."""
        if reading is not None:
            return MemoryCurve(self._trace, lives, allocator_reading=reading)
        return MemoryCurve(self._trace, lives, self.allocator_offset)

    @property
    def allocator_offset(self) -> int:
        """What TF's allocator read in steps that ran this curve's tensors over what its simulation
        reads for them (`allocator_offset`); 0 without such a reading."""
        if self._allocator_offset is None:
            read = self._reading
            if read is None or self._trace.allocator.get("in_use_bytes") is None:
                self._allocator_offset = 0
            else:
                self._allocator_offset = read - max(
                    self._simulated_peaks().values(), default=self._trace.allocator["in_use_bytes"]
                )
        return self._allocator_offset

    def _simulated_peaks(self) -> dict[int, int]:
        """Per step: TF's allocator simulated on this curve's tensors (`allocator_peaks`), uncalibrated."""
        if self._simulated is None:
            allocator = self._trace.allocator
            self._simulated = allocator_peaks(self.lives, allocator["name"], allocator["in_use_bytes"])
        return self._simulated

    def predict(self, extra: Sequence[dict[int, Events]] = ()) -> MemoryPrediction:
        """The curve's maximum over the recorded steps with the tensors of ``extra``
        (`lifetime_events` each) alive as well, and the bytes by category then (see
        `predict_memory`). On a trace of TF's allocator (``trace.allocator``, with the bytes it held
        when the window opened) the peak is that allocator's, simulated (`allocator_peaks`) and
        calibrated on its readings in the recorded steps (`allocator_offset`: for the recorded
        tensors, the peak is then that reading; ``peak_bytes_simulated`` is the simulation's own);
        the bytes by category are still the tensors' own.
        ``extra`` comes as byte changes, not as tensors with a birth and a death, so it is not
        simulated: with it the peak is the tensors' sum (no TF plan adds any: an op-type plan's
        tensors replace the recorded ones, `with_lives`)."""
        prediction = self._predict_tensors(extra)
        allocator = self._trace.allocator
        if allocator.get("in_use_bytes") is not None and not extra:
            offset, simulated = self.allocator_offset, self._simulated_peaks()
            prediction.step_peaks = {step: peak + offset for step, peak in simulated.items()}
            prediction.peak_step = max(prediction.step_peaks, key=prediction.step_peaks.get, default=None)
            prediction.peak_bytes_simulated = simulated.get(prediction.peak_step, allocator["in_use_bytes"])
            prediction.peak_bytes = prediction.peak_bytes_simulated + offset
        return prediction

    def _predict_tensors(self, extra: Sequence[dict[int, Events]]) -> MemoryPrediction:
        resident = self._resident
        step_peaks: dict[int, int] = {}
        peak, peak_step, peak_at = resident, None, None
        for step in sorted(set(self._steps).union(*extra)):
            _, deltas, categories = merged_events(
                self._steps.get(step), [e[step] for e in extra if step in e]
            )
            level = np.add.accumulate(np.concatenate(([resident], deltas)))[1:]
            candidates = np.where(deltas > 0, level, -np.inf)
            top = int(np.argmax(candidates))
            step_peaks[step] = int(max(resident, candidates[top]))
            if candidates[top] > peak:
                peak, peak_step, peak_at = candidates[top], step, (deltas[: top + 1], categories[: top + 1])
        live_by_category: dict[str, int] = {}
        if peak_at is not None:
            sums = np.bincount(peak_at[1], weights=peak_at[0], minlength=len(CURVE_CATEGORIES))
            live_by_category = dict(zip(CURVE_CATEGORIES, (int(v) for v in sums), strict=True))
        breakdown = {
            c: self.resident_bytes.get(c, 0) + live_by_category.get(c, 0)
            for c in ("parameters", "buffers", "gradient_buckets", *CATEGORIES)
        }
        breakdown["freed_resident"] = live_by_category.get("resident", 0)
        return MemoryPrediction(int(peak), peak_step, breakdown, step_peaks)

    def levels(self, extra: Sequence[dict[int, Events]] = ()) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per step: the time of each event and the bytes alive right after it (the resident bytes
        included), with the tensors of ``extra`` merged in as `predict` merges them."""
        out = {}
        for step in sorted(set(self._steps).union(*extra)):
            times, deltas, _ = merged_events(self._steps.get(step), [e[step] for e in extra if step in e])
            out[step] = (times, self._resident + np.add.accumulate(deltas))
        return out


CURVE_CATEGORIES = (*CATEGORIES, "resident")  # the category of each code in `lifetime_events`
_CODES = {c: k for k, c in enumerate(CURVE_CATEGORIES)}


def lifetime_events(lives: Sequence[TensorLife]) -> dict[int, Events]:
    """Per step: the times, byte changes and category codes of its tensors' births and deaths,
    sorted by time, then change (frees first), stably (in the order of ``lives`` otherwise)."""
    rows: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    for life in lives:
        if life.birth_us is not None:
            rows[life.step].append((life.birth_us, life.bytes, _CODES[life.category]))
        if life.death_us is not None:
            rows[life.step].append((life.death_us, -life.bytes, _CODES[life.category]))
    events = {}
    for step, events_of in rows.items():
        times, deltas, categories = (np.array(column) for column in zip(*events_of, strict=True))
        order = np.lexsort((deltas, times))
        events[step] = (times[order].astype(float), deltas[order].astype(float), categories[order])
    return events


def merged_events(base: Events | None, extra: Sequence[Events]) -> Events:
    """The events of ``base`` and ``extra`` in one list sorted by time, then change; at equal time
    and change, ``base`` first."""
    parts = [base, *extra] if base is not None else list(extra)
    if len(parts) == 1:
        return parts[0]
    times, deltas, categories = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
    order = np.lexsort((deltas, times))
    return times[order], deltas[order], categories[order]


def allocator_peaks(lives: Sequence[TensorLife], allocator: str, in_use_bytes: int) -> dict[int, int]:
    """Per recorded step: the highest peak TF's allocator ``allocator`` reads in that step, simulated
    (`bfc_allocator.py`) from the bytes in use when the window opened (``in_use_bytes``).

    The recorded steps run `ALLOCATOR_STEPS` times in all (two rounds at least), one after another
    on one simulated allocator, in rounds of the recorded steps in an order drawn afresh each round
    from a fixed seed. Each run meets the regions and free chunks the runs before it left. TF's two
    inter-op threads order a step's allocations differently from step to step, and the chunks the
    allocator hands out (up to twice the request) depend on what the steps before left: so a real
    step's peak varies, and the recorded steps are samples of its orders.

    Tensors across a step's start: a tensor the step frees but did not make is the one of its size
    the run before made and kept; where the run before kept none of that size (the recorded steps
    cut their last frees at different places: one keeps two tensors past its end, the next one),
    it is allocated as the run starts. What the run before kept and this step does not free is
    freed as it starts. So each run starts holding what its step frees, as the real step did.

    A step's peak is ``in_use_bytes`` plus the largest rise over its start among its runs after
    the first: the largest of the steps' peaks is the largest of `ALLOCATOR_STEPS` steps, as the
    measured peak is the largest of the timed steps. The simulation starts from no region, where
    TF's allocator has the regions the allocations before the window left: `MemoryCurve` calibrates
    it on the recorded steps' own readings (`allocator_offset`)."""
    by_step: dict[int, list[TensorLife]] = defaultdict(list)
    for life in lives:
        by_step[life.step].append(life)
    events = {}
    for step, step_lives in by_step.items():
        events[step] = []
        for k, life in enumerate(step_lives):
            if life.birth_us is not None:
                events[step].append((life.birth_us, 1, k, life.bytes))
            if life.death_us is not None:
                events[step].append((life.death_us, 0, k, -life.bytes))
        events[step].sort()  # at one time, frees first
    steps, order, draw = sorted(by_step), [], random.Random(0)
    while steps and (len(order) < ALLOCATOR_STEPS or len(order) < 2 * len(steps)):  # 2 rounds at least
        order.extend(draw.sample(steps, len(steps)))
    sim = for_allocator(allocator)
    kept: dict[int, list[tuple[int, int]]] = defaultdict(list)  # the run before's, by size
    rises: dict[int, int] = {}
    for run, step in enumerate(order):
        step_lives = by_step[step]
        made_before = {}
        for k, life in enumerate(step_lives):
            if life.birth_us is None:
                made_before[k] = kept[life.bytes].pop(0) if kept[life.bytes] else None
        for leftover in (key for keys in kept.values() for key in keys):
            sim.free(leftover)  # kept by the run before, not freed by this step: gone before it
        for k, key in made_before.items():
            if key is None:  # this step frees it, the run before did not keep one of its size
                made_before[k] = (run, k)
                sim.allocate(made_before[k], step_lives[k].bytes)
        start = sim.bytes_in_use
        sim.reset_peak()
        for _, born, k, nbytes in events[step]:
            if born:
                sim.allocate((run, k), nbytes)
            else:
                sim.free(made_before.get(k, (run, k)))
        kept = defaultdict(list)
        for k, life in enumerate(step_lives):
            if life.birth_us is not None and life.death_us is None:
                kept[life.bytes].append((run, k))
        if run:
            rises[step] = max(rises.get(step, 0), sim.peak_bytes_in_use - start)
    return {step: in_use_bytes + rises[step] for step in steps}  # each ran after the first run


def allocator_offset(trace: Trace) -> int:
    """What TF's allocator read in the recorded steps of ``trace`` over what its simulation reads for
    them: ``allocator["recorded_peak_bytes"]`` less the simulated peak of the recorded tensors
    (`allocator_peaks` on `tensor_lifetimes`); 0 where the trace has no such reading.

    Where the simulation's chunks fall depends on where the allocations before the window left TF's
    regions, which the window does not record: from empty regions it can put a request in a chunk
    it cannot split where TF split one, or the other way round, a chunk apart on every step. The
    recorded steps' own readings say by how much, and a plan's tensors meet the same regions."""
    return MemoryCurve(trace, tensor_lifetimes(trace)).allocator_offset


def unpredictable_peak(trace: Trace) -> str | None:
    """Why ``trace`` cannot give a peak to stand behind, or None. A TF trace whose profile holds
    no allocations (its allocator records none: TF on the CPU without oneDNN) has only the resident
    weights to count: a figure that is not a peak."""
    if trace.framework == "tensorflow" and not trace.allocator:
        return (
            "no peak predicted: the recorded steps' profile holds no allocations of TF's allocator (on "
            "the CPU, TF records and counts them when it runs with oneDNN: TF_ENABLE_ONEDNN_OPTS=1; "
            "unset, TF decides by the CPU and may leave it off), and the resident weights alone are not "
            "a peak"
        )
    return None


def predict_memory(trace: Trace, lives: list[TensorLife] | None = None) -> MemoryPrediction:
    """The memory curve's maximum over the recorded steps, and the bytes by category then.

    Each step's curve starts from the resident bytes and follows its tensors' births and deaths:
    the recorded ones, or ``lives`` (calibrated as the recorded ones, `MemoryCurve.with_lives`)."""
    curve = MemoryCurve(trace, tensor_lifetimes(trace))
    return (curve if lives is None else curve.with_lives(lives)).predict()
