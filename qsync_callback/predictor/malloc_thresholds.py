"""What fixing glibc malloc's thresholds saves a step: its page faults, at a fresh page's cost.

A step under glibc's moving thresholds faults in fresh pages where its heap was trimmed or its large
blocks unmapped since the step before (`qsync_callback.malloc_thresholds`). Thresholds fixed above
the largest block any rank's step asks for and above the most its step holds at once leave every
freed block in the heap for the next step, which then takes no fault for them. The saving priced
is, on each rank, its steps' minor page faults times a fresh page's cost timed on its machine
(`measured["malloc"]["fresh_page_us"]`). A synchronous step waits for its slowest rank, so a step
is priced at the most any rank's faults cost in it, and the saving is the mean of that over the
steps every rank timed (`waited_fault_us`): ranks fault in bursts, thousands in one step and
none in the next, at different steps on different ranks, and each burst holds up the whole step.
Thresholds that do not cover a rank's blocks are priced as saving nothing. Peak memory is priced
unchanged: the tensors the step asks for are the same, only where their blocks come from moves.
The process's resident memory is not: between steps it keeps up to the trim threshold of freed heap
mapped, and where a small block lands just after a freed aligned one (torch's blocks are
aligned), the next block of that size does not fit in the gap and the heap grows by it, a few
blocks of the largest size before the freed ones run together.

The faults a step are a mean over the steps timed after the recorded window (`steady_faults`),
not a median: they come in bursts (0 one step, 8,000 the next, as the heap's top is trimmed or
not), and what a step saves on average is their mean. How many a run takes depends on how far
earlier frees moved glibc's thresholds, the recorder's own among them (its probes, the profiler's
buffers, the trace parsed): two launches of one run can differ by thousands a step, and a recorded
run mostly stops faulting once its window has closed. Session 47's runs on a 2-core VM: the
benchmarks' ResNet took 8,160-16,320 faults in four steps before and inside its window and none in
the ten after it, in three launches of three; of twenty recordings of ten model families, twelve
took none after the window, two one burst, and six went on faulting (both of an LSTM's and of a
MobileNet-style CNN's, one of a CNN's and one of a Conv1d's). What the thresholds can save is
what the run goes on to take, so the steps before and inside the window are left out where the
trace counts the ones after it (`measured["steps_after_window"]`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from qsync_callback.malloc_thresholds import MMAP_THRESHOLD, TRIM_THRESHOLD, step_allocations
from qsync_callback.plan import MALLOC_LIMIT
from qsync_callback.recorder.trace import Trace


def malloc_problem(traces: Sequence[Trace]) -> str | None:
    """Why fixed thresholds cannot be priced on ``traces`` (None: they can)."""
    for trace in traces:
        malloc = trace.measured.get("malloc")
        if trace.device != "cpu":
            return f"rank {trace.rank} ran on {trace.device}, not on the CPU, where malloc serves the tensors"
        if not malloc or "fresh_page_us" not in malloc or "page_size" not in trace.measured:
            return f"rank {trace.rank}'s trace does not say which malloc it ran with (record it again)"
        if not malloc.get("glibc"):
            return f"rank {trace.rank}: {malloc.get('reason', 'malloc is not glibc')}"
        if not trace.measured.get("page_faults"):
            return f"rank {trace.rank} counted no page faults on the steps timed around its window"
        if not trace.memory_events:
            return f"rank {trace.rank}'s trace has no memory events to size the thresholds on"
    return None


def covering_thresholds(traces: Sequence[Trace]) -> dict[str, int]:
    """Thresholds that leave every rank's freed blocks in its heap: the mmap threshold above the
    largest block a recorded step asked for (by two pages: glibc's header and alignment), the trim
    threshold at least the most a step held at once, and at least twice the mmap threshold (glibc's
    own ratio)."""
    sizes = [step_allocations(trace.memory_events) for trace in traces]
    page = max(int(trace.measured["page_size"]) for trace in traces)
    mmap_threshold = min(max(s["largest_bytes"] for s in sizes) + 2 * page, MALLOC_LIMIT - 1)
    trim_threshold = min(max(2 * mmap_threshold, *(s["rise_bytes"] for s in sizes)), MALLOC_LIMIT - 1)
    return {MMAP_THRESHOLD: mmap_threshold, TRIM_THRESHOLD: trim_threshold}


def steady_faults(trace: Trace) -> list[int]:
    """A rank's minor page faults of each step timed after the window (the last
    ``measured["steps_after_window"]`` of ``measured["page_faults"]``); of every step timed where
    the trace counts none after it (training ended first, or an older trace)."""
    after = int(trace.measured.get("steps_after_window") or 0)
    return list(trace.measured["page_faults"])[-after:]  # from -0, or past the start: every step


def faults_per_step(trace: Trace) -> float:
    """A rank's minor page faults a step: the mean of its `steady_faults`."""
    return float(statistics.fmean(steady_faults(trace)))


def waited_faults(traces: Sequence[Trace]) -> float:
    """The page faults a synchronous step waits on: in each step every rank timed, the most any
    rank took; their mean over those steps (one rank: its `faults_per_step`)."""
    return _mean_step_maximum([steady_faults(trace) for trace in traces])


def waited_fault_us(traces: Sequence[Trace]) -> float:
    """What a synchronous step waits on its page faults (microseconds): in each step every rank
    timed, the most any rank's faults cost at its fresh page's cost; their mean over those steps."""
    return _mean_step_maximum(
        [
            [faults * float(trace.measured["malloc"]["fresh_page_us"]) for faults in steady_faults(trace)]
            for trace in traces
        ]
    )


def _mean_step_maximum(per_rank: Sequence[Sequence[float]]) -> float:
    """The mean over the steps every rank timed (the first ones, by index) of the most any rank's
    figure was in the step."""
    return float(statistics.fmean(max(step) for step in zip(*per_rank, strict=False)))


def fault_saving_us(traces: Sequence[Trace], thresholds: Mapping[str, int]) -> float:
    """The step time ``thresholds`` save (microseconds; see the module docstring); 0 where they do
    not cover the recorded blocks (`covering_thresholds`)."""
    covering = covering_thresholds(traces)
    if any(thresholds.get(name, 0) < value for name, value in covering.items()):
        return 0.0
    return waited_fault_us(traces)
