"""glibc malloc's two thresholds, which decide how many fresh pages a CPU training step faults in.

The CPU tensors of torch (and TF) come from the C library's malloc. glibc's malloc serves a block
of at least ``M_MMAP_THRESHOLD`` bytes with a fresh ``mmap`` and unmaps it when it is freed, and it
returns the free top of its heap to the system once that exceeds ``M_TRIM_THRESHOLD``; either way
the next step touches fresh, zeroed pages, one minor page fault each (`page_faults.py`). By default
both thresholds move: they start at 128 KiB, and each freed mapped block of up to 32 MiB raises the
mmap threshold to its size and the trim threshold to twice that. A step whose largest blocks are
freed and asked for again keeps trimming and re-growing its heap: thousands of faults a step at
a few microseconds each on a CPU, which no op's own time explains.

Fixing both thresholds above what a step asks for (``mallopt``) stops it: the freed blocks stay in
the heap and the next step reuses them. This module holds what that lever needs about this
process, for the recorder, the planner and the applier:

- `glibc_malloc`: whether the process's ``malloc`` is glibc's (it is not when tcmalloc or jemalloc
  is preloaded), with ``mallopt`` to set the thresholds;
- `fresh_page_us`: a fresh page's cost on this machine, timed;
- `thresholds_in_force`: the thresholds a step ran under, from its allocations and frees (glibc
  gives no way to read them) or from the environment that fixed them;
- `step_allocations`: the largest block a recorded step asked for and the most it held;
- `recorded_thresholds`: `thresholds_in_force` for a recorded trace;
- `malloc_facts`: what the recorder keeps in a trace (``measured["malloc"]``);
- `set_thresholds` and `hand_back_free_heap`: what the applier and its undo do.

glibc has no way back to its moving thresholds once ``mallopt`` set one: an undo sets the values
the moving ones had reached (`thresholds_in_force`) and hands back the free heap the fixed ones kept
(`hand_back_free_heap`), so that the next step faults its pages in again. It is the closest glibc
allows, not the same: a block by which the heap grew while the thresholds were fixed stays free in
it (its pages handed back), and glibc serves a block that fits from there before it maps one; the
run after an undo can take fewer faults than it did before the plan (the verify's turns say how
many each configuration took).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch

from qsync_callback.plan import MALLOC_LIMIT, MALLOC_SETTINGS
from qsync_callback.recorder.trace import Trace

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
START_THRESHOLD = 128 * 2**10  # both thresholds' starting value in glibc
MOVING_MMAP_MAX = 32 * 2**20  # a freed mapped block raises the mmap threshold only up to this size (64-bit)
MMAP_THRESHOLD, TRIM_THRESHOLD = MALLOC_SETTINGS  # their names in a plan and in a trace
_ENVIRONMENT = {MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_", TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_"}
_TUNABLES = {MMAP_THRESHOLD: "glibc.malloc.mmap_threshold", TRIM_THRESHOLD: "glibc.malloc.trim_threshold"}
FAULT_PROBE_BYTES = 16 * 2**20
FAULT_PROBE_REPEATS = 5


@lru_cache(maxsize=1)
def glibc_malloc() -> tuple[Any | None, str | None]:
    """glibc's ``mallopt`` when this process's ``malloc`` is glibc's, else None and the reason."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        process = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None, "the C library is not glibc (no libc.so.6 with mallopt)"
    ours = ctypes.cast(process.malloc, ctypes.c_void_p).value
    if ours != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return None, "malloc is not glibc's here (another allocator, tcmalloc or jemalloc, is preloaded)"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt, None


def set_thresholds(settings: Mapping[str, int]) -> None:
    """Fix glibc's thresholds at ``settings`` (`MALLOC_SETTINGS` names, bytes); raises RuntimeError when
    malloc is not glibc's or glibc refuses a value. The trim threshold is set first: a refused mmap
    threshold then leaves only the trim threshold changed, which the caller's undo sets back."""
    mallopt, reason = glibc_malloc()
    if mallopt is None:
        raise RuntimeError(reason)
    for name, parameter in ((TRIM_THRESHOLD, M_TRIM_THRESHOLD), (MMAP_THRESHOLD, M_MMAP_THRESHOLD)):
        if name in settings:
            value = int(settings[name])
            if not 0 <= value < MALLOC_LIMIT or mallopt(parameter, value) != 1:
                raise RuntimeError(f"glibc's mallopt refused {name} = {value}")


def hand_back_free_heap() -> None:
    """Give the free memory of every arena back to the system (``malloc_trim(0)``: the heap's free
    top, and the free pages inside it): what the thresholds an undo sets would have handed back by
    now. Without it the blocks a fixed threshold kept stay free in the heap, and the steps reuse them
    with no fault whatever the thresholds say. Nothing where malloc is not glibc's."""
    if glibc_malloc()[0] is not None:
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def fresh_page_us(nbytes: int = FAULT_PROBE_BYTES, repeats: int = FAULT_PROBE_REPEATS) -> float:
    """A fresh page's cost in a step on this machine, in microseconds: an anonymous mapping of
    ``nbytes`` filled by torch (with the threads it has now, as a step's ops fill their outputs)
    twice, the first fill's extra time over the second per page; the median of ``repeats``
    mappings (about 0.1 s for the defaults)."""
    pages = nbytes // mmap.PAGESIZE
    costs = []
    for _ in range(repeats):
        with mmap.mmap(-1, nbytes) as mapping:
            tensor = torch.frombuffer(mapping, dtype=torch.uint8)
            start = time.perf_counter()
            tensor.fill_(1)
            first = time.perf_counter() - start
            start = time.perf_counter()
            tensor.fill_(2)
            second = time.perf_counter() - start
            del tensor
        costs.append(max(first - second, 0.0) / pages * 1e6)
    return statistics.median(costs)


def fixed_in_environment(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """The thresholds the environment fixed at the process's start (``MALLOC_*_THRESHOLD_`` or
    ``GLIBC_TUNABLES``, the latter winning as in glibc), by `MALLOC_SETTINGS` name."""
    fixed: dict[str, int] = {}
    for name, variable in _ENVIRONMENT.items():
        if environ.get(variable, "").strip().isdigit():
            fixed[name] = int(environ[variable])
    for item in environ.get("GLIBC_TUNABLES", "").split(":"):
        key, _, value = item.partition("=")
        for name, tunable in _TUNABLES.items():
            if key.strip() == tunable and value.strip().isdigit():
                fixed[name] = int(value)
    return fixed


def _chunk_bytes(nbytes: int) -> int:
    """The size glibc gives a mapped block asked for with ``nbytes`` (a header, rounded up to pages)."""
    page = mmap.PAGESIZE
    return -(-(nbytes + 8) // page) * page


def thresholds_in_force(freed_bytes: Iterable[int], fixed: Mapping[str, int]) -> dict[str, int]:
    """The thresholds a step ran under: those the environment ``fixed``, and for the others the
    values glibc's moving thresholds reach on blocks of ``freed_bytes`` freed: the mmap threshold
    at the largest freed block of up to `MOVING_MMAP_MAX` (from `START_THRESHOLD`), the trim
    threshold at twice that. Fixing one fixes both in glibc; so it is here."""
    if fixed:
        return {
            MMAP_THRESHOLD: fixed.get(MMAP_THRESHOLD, START_THRESHOLD),
            TRIM_THRESHOLD: fixed.get(TRIM_THRESHOLD, START_THRESHOLD),
        }
    moved = [_chunk_bytes(n) for n in freed_bytes if _chunk_bytes(n) <= MOVING_MMAP_MAX]
    mmap_threshold = max([START_THRESHOLD, *moved])
    return {MMAP_THRESHOLD: mmap_threshold, TRIM_THRESHOLD: 2 * mmap_threshold if moved else START_THRESHOLD}


def step_allocations(memory_events: Sequence[Sequence[float]]) -> dict[str, int]:
    """From the profiler's memory events (``[time_us, address, bytes, op id]``, frees negative):
    the largest block asked for (``largest_bytes``), the largest freed (``largest_freed_bytes``)
    and the most the bytes held rose above their level at the first event (``rise_bytes``)."""
    largest = freed = held = most = 0
    for event in sorted(memory_events, key=lambda e: e[0]):
        nbytes = int(event[2])
        largest = max(largest, nbytes)
        freed = max(freed, -nbytes)
        held += nbytes
        most = max(most, held)
    return {"largest_bytes": largest, "largest_freed_bytes": freed, "rise_bytes": most}


def malloc_facts() -> dict[str, Any]:
    """What a trace keeps about this process's malloc (``measured["malloc"]``): whether it is
    glibc's (``glibc``, else ``reason``), a fresh page's cost (``fresh_page_us``, `fresh_page_us`)
    and the thresholds the environment fixed (``fixed``, `fixed_in_environment`)."""
    mallopt, reason = glibc_malloc()
    facts: dict[str, Any] = {
        "glibc": mallopt is not None,
        "fresh_page_us": fresh_page_us(),
        "fixed": fixed_in_environment(),
    }
    if reason is not None:
        facts["reason"] = reason
    return facts


def recorded_thresholds(trace: Trace) -> dict[str, int]:
    """The thresholds ``trace``'s steps ran under (`thresholds_in_force` on its memory events'
    frees and the environment it recorded)."""
    freed = [-int(event[2]) for event in trace.memory_events if event[2] < 0]
    return thresholds_in_force(freed, trace.measured.get("malloc", {}).get("fixed", {}))
