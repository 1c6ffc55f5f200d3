"""What the allocator holds while a short piece of code runs, from the profiler's memory events: the
op probes' kernel scratch (`recorder/op_probes.py`) and a low-precision layer's transient bytes
(`lp/costs.py`) are both read this way.

`profiled_events` runs a callable under ``torch.profiler`` with ``profile_memory`` (its console
lines kept quiet, `quiet_profiler.py`) and returns the Chrome trace's events; `allocator_totals`
reads the allocator's "Total Allocated" after each allocation and free among them, in time order
(the CPU allocator's and, on CUDA, the caching allocator's: the one allocator view on both).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from qsync_callback.quiet_profiler import quiet_kineto
from qsync_callback.recorder.kineto import MEMORY_EVENT


def profiled_events(run: Callable[[], None], device: str | torch.device) -> list[dict[str, Any]]:
    """The Chrome-trace events of one call of ``run`` under the profiler with its memory events
    (CUDA's activity too where ``device`` is a CUDA device)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    quiet_kineto()
    with tempfile.TemporaryDirectory() as folder:
        with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
            run()
        path = os.path.join(folder, "profile.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            return json.load(file)["traceEvents"]


def allocator_totals(
    events: Sequence[Mapping[str, Any]], start: float = -float("inf"), end: float = float("inf")
) -> list[int]:
    """The allocator's "Total Allocated" after each memory event of ``events`` between ``start``
    and ``end`` (the events' microseconds), in time order."""
    memory = sorted(
        (e["ts"], int(e["args"].get("Total Allocated", 0))) for e in events if e.get("name") == MEMORY_EVENT
    )
    return [total for ts, total in memory if start <= ts <= end]
