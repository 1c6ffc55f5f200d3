"""Record a window of a live torch training loop into a normalized trace.

The training loop calls `TorchRecorder.step_boundary()` at the start of every step:

- steps before ``warmup_steps`` run untouched and are timed, except the last, which runs under
  the profiler unrecorded (a profiler's first step is slower than the rest: torch.profiler's
  schedule has a warm-up phase for the same reason) and counts the bytes autograd saves per layer;
- the next step settles (the step right after the first profiler session ends runs slow) and is
  neither recorded nor timed;
- then ``profile_steps`` steps are recorded, every other step, each in a profiler session of its
  own (shapes and memory on, layer ranges installed; Python's young generations collected at the
  boundary before, so that no collection pause lands in a recorded step); the unprofiled steps
  between them are timed, so that measured and recorded steps see the same conditions of the
  machine (on a shared host the speed of a step drifts by tens of percent over a few seconds);
- at the boundary after the last recorded step the sessions' Kineto traces are merged into
  ``<trace_dir>/rank<k>/kineto.json`` and converted to the normalized ``trace.json``;
- steps after the window are timed again: the median of the unprofiled steps is the measured
  step time;
- where asked for (``trial``: given the closed window's trace, the trials to run, from
  `activation_trial.activation_trials_for`), the steps after those run an offload of the model's
  outermost modules, then a recompute of the blocks among them, each in turns with the recorded
  configuration: what each policy costs this run's steps; they are not timed as steps.

On request the recorder also gathers the precision indicator's layer statistics over the first
``COLD_STEPS`` steps (not timed; `layer_statistics.py`) and, once the window has closed, probes
every swappable layer at each precision asked for (`precision_probes.py`), and compiles a few of
the model's modules to calibrate the fusion cost model where a region could pay for its compile in
the steps left (`region_probes.py`); all go into the trace.

Before the window opens the recorder counts the bytes resident in parameters, buffers, gradients,
optimizer state, DDP's buckets and any other live tensor on the device (`resident_bytes`); the
first session opens with a ``qsync::clock_sync`` mark and the overhead calibration loops
(`overhead.py`), and the last recorded step's session with a second round of them, whose events the
merged trace counts when the window closes (for the costs per event).

With several ranks the caller synchronizes them (the recorder makes no collective call of its
own while a rank may have failed, so a failure on one rank can never leave another waiting in one;
its one collective work, the all-reduce calibration under DDP, waits for the meeting after the
window closes, `restart_step_clock`, and so do the timings of the modules compiled as it closes,
which one rank's compile would otherwise slow on another): right before the boundary
at ``warmup_steps - 1``, which opens the first session (so that the clock-sync marks of all ranks
fall at one moment), and right after each of ``session_end_steps`` (so that the unprofiled step
that follows starts together on all ranks, then `restart_step_clock`).

The measured peak (``trace.measured["peak_bytes"]``, its source in ``peak_source``) owes nothing to
the predictor: on CUDA, the caching allocator's peak (``torch.cuda.max_memory_allocated``, reset at
the boundary before each recorded step and read at the one after); elsewhere, the bytes of the live
tensors at each recorded step's start plus the largest rise of the allocator's "Total Allocated"
counter within the step, less the frees that counter misses (`live_memory.py`; counted at the
boundaries, outside the steps, in ``overhead_s``). The largest over the recorded steps.
"""

from __future__ import annotations

import gc
import hashlib
import json
import mmap
import socket
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson
import torch

from qsync_callback.errors import QSyncInputError
from qsync_callback.lp.costs import device_name
from qsync_callback.lp.modules import LPModule
from qsync_callback.malloc_thresholds import malloc_facts
from qsync_callback.model_layers import blocks_of, layer_table, layers_of
from qsync_callback.page_faults import minor_page_faults
from qsync_callback.plan import fingerprint_key, module_layers
from qsync_callback.recorder.copy_costs import copy_costs
from qsync_callback.recorder.ddp_buckets import (
    attach_bucket_tensors,
    ddp_communication,
    is_ddp,
    time_allreduces,
)
from qsync_callback.recorder.event_costs import calibrate_on_steps
from qsync_callback.recorder.kineto import (
    CALIBRATION_RANGE,
    CLOCK_SYNC,
    STEP_PREFIX,
    calibration_event_counts,
    convert_kineto,
)
from qsync_callback.recorder.layer_ranges import LayerRanges
from qsync_callback.recorder.layer_statistics import LayerStatistics
from qsync_callback.recorder.live_memory import StorageWatch, live_storages, step_peak
from qsync_callback.recorder.module_calls import CallProbe, activation_refusals
from qsync_callback.recorder.op_dataset import add_to_dataset
from qsync_callback.recorder.op_samples import op_samples, samples_document
from qsync_callback.recorder.overhead import (
    calibration_extra_times,
    overhead_per_event,
    profiler_kwargs,
)
from qsync_callback.recorder.precision_probes import probe_precision_costs
from qsync_callback.recorder.region_probes import (
    CompiledProbe,
    RegionGate,
    RegionInputs,
    compiled_region_costs,
    probe_modules,
    time_probes,
)
from qsync_callback.recorder.saved_tensors import SavedActivations
from qsync_callback.recorder.trace import Trace, rank_trace_path

RAW_TRACE_FILE = "kineto.json"
COLD_STEPS = 2


def ddp_bucket_bytes(module: torch.nn.Module | None) -> int:
    """Bytes of DDP's gradient buckets (separate from the gradients unless they are bucket views)."""
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return 0
    data = module._get_ddp_logging_data()
    if data.get("gradient_as_bucket_view"):
        return 0
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return sum(int(s) for s in str(sizes).replace(",", " ").split())


def tensor_roots(
    model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]
) -> list[torch.Tensor | None]:
    """The tensors a step starts from that may have no Python object until read: parameters (the
    model's and the optimizers'), their gradients, buffers."""
    params = [*model.parameters(), *(p for opt in optimizers for g in opt.param_groups for p in g["params"])]
    return [*params, *(p.grad for p in params), *model.buffers()]


def resident_bytes(
    model: torch.nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    ddp_module: torch.nn.Module | None = None,
    device_type: str = "cpu",
    exclude: Collection[int] = (),
) -> dict[str, int]:
    """Bytes held across steps, by category, each storage counted once: parameters, buffers,
    gradients, optimizer state, DDP's gradient buckets, and ``other``: the storages on
    ``device_type`` of every other live tensor (`live_memory.live_storages`: a tensor kept as a plain
    attribute, the batch, the data set), which the step starts from as well, but those whose data
    pointer is in ``exclude`` (the recorder's own)."""
    optimizers = list(optimizers)
    live = live_storages(device_type, tensor_roots(model, optimizers), exclude)
    seen: set[int] = set()

    def total(tensors: Iterable[torch.Tensor]) -> int:
        nbytes = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            nbytes += storage.nbytes()
        return nbytes

    params = list(model.parameters())
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values()]
    counted = {
        "parameters": total(params),
        "buffers": total(model.buffers()),
        "gradients": total(p.grad for p in params if p.grad is not None),
        "optimizer_state": total(state),
        "gradient_buckets": ddp_bucket_bytes(ddp_module),
    }
    return counted | {"other": sum(nbytes for ptr, nbytes in live.items() if ptr not in seen)}


def torch_fingerprint(
    model: torch.nn.Module, batch_shapes: Sequence, world_size: int, device: str
) -> dict[str, Any]:
    """What a plan for this run depends on: structure, batch shapes, device (`lp.costs.device_name`:
    a CPU of another kind runs other precisions fast), world size, versions."""
    structure = [
        (n, type(m).__name__, [list(p.shape) for p in m.parameters(recurse=False)])
        for n, m in model.named_modules()
    ]
    digest = hashlib.sha256(json.dumps(structure).encode()).hexdigest()[:16]
    from qsync_callback import __version__

    return {
        "model": digest,
        "layers": list(layers_of(model)),
        "batch_shapes": [list(s) for s in batch_shapes],
        "device": device_name(device),
        "world_size": world_size,
        "versions": {"torch": torch.__version__.split("+")[0], "qsync_callback": __version__},
    }


def batch_shapes_of(batch: Any) -> list[list[int]]:
    """Shapes of the tensors in a (nested) batch, in order."""
    if isinstance(batch, torch.Tensor):
        return [list(batch.shape)]
    if isinstance(batch, Mapping):
        return [s for v in batch.values() for s in batch_shapes_of(v)]
    if isinstance(batch, (list, tuple)):
        return [s for v in batch for s in batch_shapes_of(v)]
    return []


def recorded_steps(warmup_steps: int, profile_steps: int) -> list[int]:
    """The steps a recorder profiles: every other step from ``warmup_steps + 1``, so that the
    unprofiled steps between them, timed as measured steps, run in the same conditions of the
    machine. Step ``warmup_steps`` settles after the warm-up session (the step right after the
    first profiler session ends runs slow) and is neither recorded nor timed. The window closes at
    the boundary after the last of them."""
    return [warmup_steps + 1 + 2 * j for j in range(profile_steps)]


def window_close_step(warmup_steps: int, profile_steps: int) -> int:
    """The step boundary at which the recorder closes its window and writes the trace."""
    return recorded_steps(warmup_steps, profile_steps)[-1] + 1


class WindowTrial(Protocol):
    """Trials the recorder runs in the steps after its measured ones
    (`activation_trial.TrialSequence`): their boundaries counted from 0, until they have finished;
    each result goes in the trace's activation costs, under its key."""

    finished: bool

    @property
    def steps(self) -> int: ...

    def boundary(self, step: int) -> None: ...

    def close(self) -> None: ...

    def stop(self, why: str) -> None: ...

    def results(self) -> dict[str, dict[str, Any]]: ...


class TorchRecorder:
    """Profile ``profile_steps`` steps of a live training loop, every other step from ``warmup_steps``.

    ``model`` is the module whose layers are recorded; ``ddp_module``, if the model runs wrapped in
    DistributedDataParallel, the wrapper (its gradient buckets count as resident memory).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        trace_dir: str | Path,
        *,
        warmup_steps: int,
        profile_steps: int,
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
        fingerprint: Mapping[str, Any] | None = None,
        ddp_module: torch.nn.Module | None = None,
        probe_precisions: Sequence[str] = (),
        layer_statistics: bool = False,
        measure_steps: int = 0,
        activation_costs: bool = False,
        offload_stats: Callable[[], Mapping[str, Any]] | None = None,
        trial: Callable[[Trace], WindowTrial | None] | None = None,
        compiled_regions: RegionGate | None = None,
        steps_left: int | None = None,
        partial_last_batch: bool | None = None,
    ):
        if warmup_steps < 2 or profile_steps < 1:
            raise ValueError("warmup_steps must be at least 2 and profile_steps at least 1")
        self.model = model
        self.ddp_module = ddp_module
        self._time_allreduces = False  # the all-reduce calibration is due at the next meeting
        self.optimizers = list(optimizers)
        self.trace_dir = Path(trace_dir)
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.measure_steps = measure_steps
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.fingerprint = dict(fingerprint or {})
        self.probe_precisions = list(probe_precisions)
        self._activation_costs = activation_costs
        self._calls: CallProbe | None = None
        self.module_calls: dict[str, int] | None = None  # per module, in the warm-up step
        self.call_problems: dict[str, str] = {}
        self._offload_stats = offload_stats
        self._trial_of = trial  # what activation policies cost the steps after the window, where asked
        self._trial: WindowTrial | None = None
        self._region_gate = compiled_regions  # compile modules to calibrate on, where it says so
        self._steps_left = steps_left  # from this recorder's first step to the end of the run
        self._partial_last_batch = partial_last_batch
        self._region_inputs: RegionInputs | None = None
        # compiled as the window closes, timed once the ranks have met after it
        self._compiled_probes: dict[str, CompiledProbe] = {}
        self._called_blocks: set[str] = set()  # the blocks whose forward ran in a recorded session
        self._offload_steps = 0  # the steps ended since the offload counts started
        self._statistics = LayerStatistics(model) if layer_statistics else None
        self._statistics_data: dict[str, Any] = {}
        self.unprofiled_ms: list[float] = []
        self.unprofiled_page_faults: list[int] = []
        self.unprofiled_after_window = 0  # how many of the unprofiled steps came after the window
        self.overhead_s = 0.0
        self.trace: Trace | None = None
        self._steps_started = 0
        self._last_boundary: float | None = None
        self._last_faults = 0
        self._profiler: torch.profiler.profile | None = None
        self._parts: list[Path] = []
        self._ranges: LayerRanges | None = None
        self._step_range = None
        self._resident: dict[str, int] = {}
        self._watch: StorageWatch | None = None
        self._step_start: dict[int, tuple[dict[int, int], int]] = {}
        self._cuda_peaks: dict[int, int] = {}
        self._saved: SavedActivations | None = None
        self._saved_bytes: dict[str, int] = {}
        self._calibration_rounds: list[dict[str, float]] = []
        self._overhead: dict[str, float] = {}

    @property
    def profiled_steps(self) -> list[int]:
        return recorded_steps(self.warmup_steps, self.profile_steps)

    @property
    def session_end_steps(self) -> list[int]:
        """The boundaries at which a profiler session ends: the warm-up session's, then each
        recorded step's (the last one closes the window)."""
        return [self.warmup_steps] + [step + 1 for step in self.profiled_steps]

    @property
    def close_step(self) -> int:
        """The boundary at which the window closes and the trace is written."""
        return window_close_step(self.warmup_steps, self.profile_steps)

    @property
    def meet_before(self) -> set[int]:
        """Boundaries where every rank meets before `step_boundary`: the one that opens the first
        session, so that the clock-sync marks of all ranks fall at one moment."""
        return {self.warmup_steps - 1}

    @property
    def meet_after(self) -> set[int]:
        """Boundaries where every rank meets after `step_boundary`, then restarts its step clock:
        after the calibration (``warmup_steps - 2``: a failure there is agreed on before the ranks
        meet at the clock-sync barrier) and after each session ends (so that the unprofiled step
        that follows starts together on all ranks)."""
        return {self.warmup_steps - 2, *self.session_end_steps}

    @property
    def trial_start(self) -> int:
        """The boundary at which the activation trials start: after the measured steps."""
        return self.close_step + self.measure_steps

    @property
    def done_step(self) -> int:
        """The boundary at which the window is complete: ``measure_steps`` after it closes, and the
        activation trials' steps after them where they run."""
        return self.trial_start + (self._trial.steps if self._trial is not None else 0)

    def step_end(self) -> None:
        """The step returned (steps are timed boundary to boundary): one more step in the offload
        store's counts, once the window has closed."""
        if self.trace is not None:
            self._offload_steps += 1

    @property
    def recording(self) -> bool:
        return self._profiler is not None

    def step_boundary(self) -> Trace | None:
        """Mark the start of the next step. Returns the trace on the boundary that closes the window."""
        now = time.perf_counter()
        faults = minor_page_faults()
        step = self._steps_started
        settling = step - 1 == self.warmup_steps
        trial = self._trial is not None and step > self.trial_start  # the step that ended was the trial's
        if (
            self._last_boundary is not None
            and not (self.recording or settling or trial)
            and step > COLD_STEPS
        ):
            self.unprofiled_ms.append((now - self._last_boundary) * 1e3)
            self.unprofiled_page_faults.append(faults - self._last_faults)
            self.unprofiled_after_window += step - 1 >= self.close_step
        if self._statistics is not None and step in (0, COLD_STEPS):
            self._gather_statistics(step)
        if self._region_gate is not None and step in (0, 1):
            self._keep_region_inputs(step)
        if step in (self.warmup_steps - 2, self.warmup_steps - 1):
            self.prepare_window()  # once; counts its own time
        work = time.perf_counter()
        finished = None
        if self.recording and step in self.session_end_steps:
            if step - 1 in self.profiled_steps:
                self._end_step_memory(step - 1)
            self._end_session()
            if step == self.close_step:
                finished = self._close_window()
        if step == self.warmup_steps - 1:
            self._open_window()
        elif step in self.profiled_steps:
            # a young-generation collection now, outside the step, rather than inside it: one would
            # otherwise fall in a recorded step about every other window (27 ms in a 60 ms step here)
            gc.collect(1)
            if not self.recording:
                self._start_session()
                if step == self.profiled_steps[-1]:
                    self._calibrate()
            self._stop_saved_activations()
            self._start_step_memory(step)
            self._step_range = torch.ops.profiler._record_function_enter_new(f"{STEP_PREFIX}{step}", None)
        if self.warmup_steps - 1 <= step <= self.close_step:
            self.overhead_s += time.perf_counter() - work
        if self._trial is not None and self.trial_start <= step <= self.done_step:
            self._trial.boundary(step - self.trial_start)  # its result: at `save`
        self._steps_started += 1
        self._last_boundary = time.perf_counter()
        self._last_faults = minor_page_faults()
        return finished

    def restart_step_clock(self) -> None:
        """Called right after the ranks met: first what needs every rank together (under DDP, once
        the window has closed, the all-reduce calibration, `ddp_buckets.time_allreduces`, and the
        compiled probes' timings, `region_probes.time_probes`, which no rank's compile disturbs
        there), then leave the time since the last boundary out of the measured steps (the caller
        did work of its own there, such as waiting for other ranks)."""
        if self._time_allreduces and self.trace is not None:
            self._time_allreduces = False
            self.trace.communication["allreduce_us"] = time_allreduces(self.ddp_module)
        if self._compiled_probes and self.trace is not None:
            start = time.perf_counter()
            compiled, self._compiled_probes = self._compiled_probes, {}
            time_probes(self.trace.compiled_regions["probes"], compiled)
            self.overhead_s += time.perf_counter() - start
        self._last_boundary = time.perf_counter()
        self._last_faults = minor_page_faults()

    def _keep_region_inputs(self, step: int) -> None:
        """The arguments of the modules to compile during the warm-up, from their first call in the
        first step (`region_probes.RegionInputs`)."""
        if step == 0:
            self._region_inputs = RegionInputs(self.model, probe_modules(self.model))
        elif self._region_inputs is not None:
            self._region_inputs.remove()

    def _gather_statistics(self, step: int) -> None:
        """The indicator's layer statistics, over the cold steps (which are not timed)."""
        if step == 0:
            self._statistics.start()
        else:
            self._statistics.stop()
            self._statistics_data = self._statistics.to_dict()

    def prepare_window(self) -> None:
        """Count the bytes resident when the window opens, once (done at the window's opening if not
        called before; a distributed caller has it done a step earlier, so that a failure here can be
        agreed on before the ranks meet at the clock-sync barrier)."""
        if not self._resident:
            start = time.perf_counter()
            # a full collection: tensors in unreachable cycles (an earlier run's model in the same
            # process, say) await the next one and would count as resident for the whole window
            gc.collect()
            device_type = torch.device(self.device).type
            self._resident = resident_bytes(
                self.model, self.optimizers, self.ddp_module, device_type, self._held_bytes(device_type)
            )
            self.overhead_s += time.perf_counter() - start

    def _open_window(self) -> None:
        """The first session: clock sync, the calibration loops (recorded and unrecorded, in turns),
        and the warm-up step."""
        self._start_session()
        with torch.profiler.record_function(CLOCK_SYNC):
            pass
        self._calibrate()
        self._saved = SavedActivations(self._ranges, self.model.parameters())
        self._saved.start()
        if self._activation_costs:
            self._calls = CallProbe(self.model).__enter__()

    def _calibrate(self) -> None:
        """One round of the overhead calibration loops, outside any step (`overhead.py`): in the first
        session and in the last."""
        with torch.profiler.record_function(CALIBRATION_RANGE):
            self._calibration_rounds.append(calibration_extra_times())

    def _start_session(self) -> None:
        self._profiler = torch.profiler.profile(**profiler_kwargs(self.device))
        self._profiler.__enter__()
        self._ranges = LayerRanges(layers_of(self.model), blocks_of(self.model))
        self._ranges.install()

    def _start_step_memory(self, step: int) -> None:
        """Where a recorded step's measured peak starts from: on CUDA, the caching allocator's peak
        is reset; elsewhere the live storages are counted and watched (`live_memory.StorageWatch`),
        and DDP's gradient buckets, which only its C++ side holds, taken from DDP's own logging
        data (`ddp_bucket_bytes`)."""
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            roots = tensor_roots(self.model, self.optimizers)
            device_type = torch.device(self.device).type
            self._watch = StorageWatch(device_type, roots, self._held_bytes(device_type))
            self._step_start[step] = (self._watch.bytes, ddp_bucket_bytes(self.ddp_module))

    def _end_step_memory(self, step: int) -> None:
        """At the boundary after recorded step ``step``: on CUDA, its allocator peak is read, less
        what the recorder itself holds there."""
        if self.device.startswith("cuda"):
            held = sum(self._held_bytes("cuda").values())
            self._cuda_peaks[step] = torch.cuda.max_memory_allocated(self.device) - held
        self._stop_watch()

    def _held_bytes(self, device_type: str) -> dict[int, int]:
        """The storages the recorder itself holds through the window, by data pointer: the module
        arguments kept for the compiled-region probes (`region_probes.RegionInputs`), which the
        run's memory figures leave out, as the run will not hold them."""
        return self._region_inputs.held_bytes(device_type) if self._region_inputs is not None else {}

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def _end_session(self) -> None:
        """Stop the profiler after a recorded step and write its trace now (a profiler holding its
        results would stay in memory through the unprofiled steps that follow)."""
        profiler = self._profiler
        self._stop()
        part = self._raw_path().with_suffix(f".part{len(self._parts)}.json")
        part.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(part))
        self._parts.append(part)

    def _raw_path(self) -> Path:
        return rank_trace_path(self.trace_dir, self.rank).parent / RAW_TRACE_FILE

    def _close_window(self) -> Trace:
        # parsing and converting make many objects at once: with the collector paused they are made
        # in a fraction of the time, and one young-generation collection at the end frees the rest
        gc.disable()
        try:
            raw = _merge_parts(self._parts, self._raw_path())
            self._parts.clear()
            counts = calibration_event_counts(raw)
            self._overhead = overhead_per_event(self._calibration_rounds, counts)
            self.trace = self._convert(raw)
            if self.rank == 0:
                self._add_op_samples(raw)
            del raw
        finally:
            gc.enable()
        if self.device == "cpu":
            self.trace.measured["malloc"] = malloc_facts()
        if self.probe_precisions:
            self.trace.precision_costs = probe_precision_costs(self.model, self.trace, self.probe_precisions)
        if self._activation_costs:
            self.trace.activation_costs = self._activation_costs_of(self.trace)
            self._trial = self._trial_of(self.trace) if self._trial_of is not None else None
        if self._region_gate is not None:
            steps_left = None if self._steps_left is None else max(self._steps_left - self.close_step, 0)
            inputs = self._region_inputs.inputs if self._region_inputs is not None else {}
            self.trace.compiled_regions, self._compiled_probes = compiled_region_costs(
                self.model, self.trace, inputs, steps_left, sorted(self._called_blocks), self._region_gate
            )
            self._region_inputs = None  # the probes hold the arguments they need until timed
            self.trace.compiled_regions["partial_last_batch"] = self._partial_last_batch
        if self._offload_stats is not None:
            self._offload_stats()  # the measured steps' moves start from here
            self._offload_steps = 0
        self._write()
        gc.collect(1)
        return self.trace

    def _add_op_samples(self, raw: dict) -> None:
        """Add the window's measured ops to this device's data set (`op_dataset.py`), under the
        model's fingerprint and precision; a failure warns and leaves the data set as it was."""
        precision = hashlib.sha256(json.dumps(self.trace.precision, sort_keys=True).encode()).hexdigest()[:8]
        source = f"{fingerprint_key(self.fingerprint)}:{precision}"
        try:
            add_to_dataset(samples_document(*op_samples(raw, self._overhead), source), self.device)
        except (OSError, QSyncInputError, ValueError, RuntimeError) as error:
            warnings.warn(f"the op data set of {self.device} was not updated: {error}", stacklevel=2)

    def _convert(self, raw: dict) -> Trace:
        """The normalized trace of the raw Kineto trace ``raw`` and what the recorder counted."""
        converted = convert_kineto(raw, device=self.device, overhead_us=self._overhead)
        sync = converted["clock_sync_us"]
        trace = Trace(
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            steps=converted["steps"],
            ops=converted["ops"],
            framework="torch",
            framework_version=torch.__version__.split("+")[0],
            host=socket.gethostname(),
            clock_offset_us=-sync if sync is not None else 0.0,
            memory_events=converted["memory_events"],
            resident_bytes=self._resident,
            saved_activation_bytes=self._saved_bytes,
            layer_statistics=self._statistics_data,
            precision={
                name: module.precision
                for name, module in layers_of(self.model).items()
                if isinstance(module, LPModule) and module.precision != "fp32"
            },
            layers=layer_table(self.model),
            profiler_overhead_us=self._overhead,
            fingerprint=self.fingerprint,
            raw_trace=RAW_TRACE_FILE,
        )
        if is_ddp(self.ddp_module):
            layers = [layer["name"] for layer in trace.layers]
            trace.communication = ddp_communication(self.ddp_module, self.model, layers)
            attach_bucket_tensors(trace.ops, trace.communication["buckets"])
            self._time_allreduces = self.world_size > 1  # when the ranks meet next
        if self.device.startswith("cuda"):
            trace.measured["peak_bytes"] = max(self._cuda_peaks.values())
            trace.measured["peak_source"] = (
                "the CUDA caching allocator's peak (torch.cuda.max_memory_allocated, reset before each "
                "recorded step), the largest over the recorded steps"
            )
        else:
            counter, freed = converted["allocator_counter"], converted["freed_marks"]
            trace.measured["peak_bytes"] = max(
                step_peak(start, counter.get(step, []), freed.get(step, [])) + buckets
                for step, (start, buckets) in self._step_start.items()
            )
            trace.measured["peak_source"] = (
                "live tensors at each recorded step's start (every tensor storage on the CPU, each "
                "counted once; DDP's gradient buckets from DDP's logging data) + the largest rise "
                "within the step of the CPU allocator's 'Total Allocated' in the profiler's memory "
                "events, less the frees of older blocks that counter misses (marked by weak "
                "references on the storages counted at the start); the largest over the recorded steps"
            )
        return trace

    def save(self) -> None:
        """Write the normalized trace with the unprofiled step times measured so far, its profiler
        shares calibrated on them (once: at the first save after the window closed, when the loop
        has measured the steps after it; `event_costs.calibrate_on_steps`)."""
        if self.trace is not None and "profiler_share" not in self.trace.measured and self.unprofiled_ms:
            self.trace.measured["profiler_share"] = calibrate_on_steps(self.trace, self.unprofiled_ms)
        if (
            self.trace is not None
            and self._offload_stats is not None
            and self._trial is None  # a trial's moves are its own (`_end_trial`)
            and "offload" not in self.trace.measured
        ):
            moved = {device: stats for device, stats in self._offload_stats().items() if stats}
            steps = self._offload_steps
            if moved and steps:  # what the offload store moved over the steps since the window closed
                self.trace.measured["offload"] = {"steps": steps, "stores": moved}
        self._end_trial()
        self._write()

    def _activation_costs_of(self, trace: Trace) -> dict[str, Any]:
        """What the activation planner needs from this run: the offload store's copy cost on this
        device (`copy_costs`, cached) and the modules that cannot take a policy, with the reason
        (`activation_refusals`, on the calls counted in the warm-up step)."""
        modules = module_layers([layer["name"] for layer in trace.layers])
        refused = activation_refusals(self.model, modules, self.module_calls, self.call_problems)
        device = "cuda" if self.device.startswith("cuda") else self.device
        return {"copy": copy_costs(device), "refused": refused}

    def _end_trial(self) -> None:
        """Undo a trial in force; one that training ended before its last round says so."""
        if self._trial is not None:
            self._trial.stop("training ended before the trial's last round")
            for key, result in self._trial.results().items():
                self.trace.activation_costs.setdefault(key, {})["in_step"] = result

    def _write(self) -> None:
        if self.trace is not None:
            self.trace.measured["step_ms"] = list(self.unprofiled_ms)
            self.trace.measured["page_faults"] = list(self.unprofiled_page_faults)
            self.trace.measured["steps_after_window"] = self.unprofiled_after_window
            self.trace.measured["page_size"] = mmap.PAGESIZE
            self.trace.measured["recorder_overhead_s"] = self.overhead_s
            self.trace.save(rank_trace_path(self.trace_dir, self.rank))

    def _stop_saved_activations(self) -> None:
        if self._saved is not None:
            self._saved_bytes = self._saved.stop()
            self._saved = None
        if self._calls is not None:
            calls, self._calls = self._calls, None
            calls.__exit__(None, None, None)
            self.module_calls, self.call_problems = dict(calls.calls), dict(calls.problems)

    def close(self) -> None:
        """Stop profiling, remove the hooks and the Kineto parts of a window that did not close;
        safe to call at any time, more than once."""
        self._stop()
        for part in self._parts:
            part.unlink(missing_ok=True)
        self._parts.clear()

    def _stop(self) -> None:
        """Stop profiling and watching storages, remove the hooks, and undo a trial in force."""
        if self._trial is not None:
            self._trial.close()
        self._stop_watch()
        self._stop_saved_activations()
        if self._statistics is not None:
            self._statistics.stop()
        if self._region_inputs is not None:
            self._region_inputs.remove()
        if self._step_range is not None:
            torch.ops.profiler._record_function_exit(self._step_range)
            self._step_range = None
        if self._ranges is not None:
            self._called_blocks |= self._ranges.called_blocks
            self._ranges.remove()
            self._ranges = None
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.__exit__(None, None, None)


def _merge_parts(parts: Sequence[Path], path: Path) -> dict:
    """Merge the sessions' Kineto traces ``parts`` into one Chrome trace at ``path``, remove the
    parts, and return the merged trace parsed.

    Every session of a process stamps events on the same clock, so their events merge into one
    timeline; the metadata comes from the first session.
    """
    merged: dict | None = None
    for part in parts:
        data = orjson.loads(part.read_bytes())
        if merged is None:
            merged = data
        else:
            merged["traceEvents"].extend(e for e in data["traceEvents"] if e.get("ph") != "M")
    path.write_bytes(orjson.dumps(merged))
    for part in parts:
        part.unlink(missing_ok=True)
    return merged
