"""Horovod's tensor fusion in the TF integration: the settings in effect, its timeline, and
gradient groups.

- `horovod_settings`: the fusion threshold and cycle time in effect (Horovod's environment
  variables, which ``horovodrun --fusion-threshold-mb/--cycle-time-ms`` set, or its defaults).
  They are read by ``hvd.init()`` and cannot change in a running job (`settings_in_effect`).
- `Timeline`: Horovod's timeline for each recorded call (``hvd.start_timeline``), when the user
  opted in with `record_horovod_timeline` (``HOROVOD_TIMELINE=DYNAMIC``) before ``hvd.init()``. It
  is opt-in because it is not free: from ``hvd.init()`` to shutdown, Horovod 0.28's timeline writer
  thread on the coordinator (rank 0) polls its queue without sleeping (``TimelineWriter::WriterLoop``
  yields and loops), so it keeps one core busy for the whole run, recorded or not. Measured on the
  project's 2-core VM (`benchmarks/horovod_timeline_cost.py`): the example's CNN step took 1.42
  times as long with it on one process and 1.53 times on two (medians of 3 pairs of runs). Without
  it the trace says so and the tensor-fusion plans are not priced (they need the timeline's fused
  responses). A timeline that cannot be started or read warns once; recording goes on without
  Horovod's phases.
- `groups_by_variable`: a plan's buckets (variable names) as ``DistributedGradientTape``'s
  ``groups``, which the user's step reads from ``recorder.groups``.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import horovod.tensorflow as hvd

from qsync_callback.errors import QSyncInputError
from qsync_callback.planner.tensor_fusion import CYCLE_ENV, THRESHOLD_ENV
from qsync_callback.recorder.horovod_timeline import TensorRecord, read_timeline

TIMELINE_ENV = "HOROVOD_TIMELINE"
DYNAMIC = "DYNAMIC"
DEFAULT_THRESHOLD_BYTES = 128 * 2**20  # Horovod 0.28's defaults (horovodrun --help)
DEFAULT_CYCLE_MS = 1.0
TIMELINE_DIR = "horovod_timeline"


def record_horovod_timeline() -> None:
    """Opt in to recording Horovod's timeline in the recorded steps (communication phases, fused
    responses; needed to price tensor-fusion plans): sets ``HOROVOD_TIMELINE=DYNAMIC`` unless the
    variable is set (a path there is the user's own timeline, read as it is). Call it before
    ``hvd.init()``, which reads it. Costs a core on rank 0 for the whole run (module docstring)."""
    os.environ.setdefault(TIMELINE_ENV, DYNAMIC)


def horovod_settings(env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The fusion threshold (bytes) and cycle time (ms) Horovod runs with, from its environment
    variables or its defaults, and which of them the environment set."""
    settings: dict[str, Any] = {
        "fusion_threshold_bytes": DEFAULT_THRESHOLD_BYTES,
        "cycle_time_ms": DEFAULT_CYCLE_MS,
        "from_env": [],
    }
    for key, name, kind in (
        ("fusion_threshold_bytes", THRESHOLD_ENV, int),
        ("cycle_time_ms", CYCLE_ENV, float),
    ):
        if env.get(name):
            try:
                settings[key] = kind(float(env[name])) if kind is int else kind(env[name])
                settings["from_env"].append(name)
            except ValueError:
                pass  # Horovod ignores what it cannot parse too
    return settings


class Timeline:
    """Horovod's timeline for the recorded steps, one file per step under ``directory`` (rank 0
    writes them; on the other ranks Horovod writes nothing). The first failure warns once and
    switches it off; ``note`` then says why."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.note: str | None = None
        self.files: list[Path] = []
        self._running = False
        user = os.environ.get(TIMELINE_ENV)
        self._user = bool(user) and user != DYNAMIC
        if self._user:
            self.files = [Path(user)]  # the user's own timeline, for the whole run: read, not started
        elif not user:  # not asked for: said in the trace, no warning
            self.note = (
                f"not recorded: {TIMELINE_ENV} was unset at hvd.init() (record_horovod_timeline() "
                "before hvd.init() records it, at the cost of a core on rank 0)"
            )

    def _off(self, cause: str) -> None:
        if self.note is None:
            self.note = cause
            warnings.warn(
                f"qsync Recorder: Horovod's timeline is not recorded ({cause}); the trace has no"
                " communication phases",
                RuntimeWarning,
                stacklevel=4,
            )

    def start(self, step: int, write: bool) -> None:
        """Start the timeline into ``step<k>.json`` (``write``: this rank is Horovod's coordinator)."""
        if self.note is not None or self._user:
            return
        path = self.directory / f"step{step}.json"
        try:
            if write:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.unlink(missing_ok=True)
            hvd.start_timeline(str(path))
        except (OSError, ValueError) as exc:
            self._off(f"{type(exc).__name__}: {exc}")
            return
        self._running = True
        if write:
            self.files.append(path)

    def stop(self) -> None:
        """Stop it (Horovod closes the file); safe to call when it is not running."""
        if not self._running:
            return
        self._running = False
        try:
            hvd.stop_timeline()
        except ValueError as exc:
            self._off(f"{type(exc).__name__}: {exc}")

    def records(self) -> list[TensorRecord]:
        """Every tensor record of the files, responses numbered across files; [] (with a note) if a
        file cannot be read. A missing file is one Horovod did not write (no collective ran)."""
        out: list[TensorRecord] = []
        for path in self.files:
            if not path.exists():
                continue
            try:
                records = read_timeline(path)
            except QSyncInputError as exc:
                self._off(str(exc))
                return []
            base = 1 + max((r.response for r in out), default=-1)
            for r in records:
                r.response += base
            out.extend(records)
        return out

    def describe(self, rank_dir: Path) -> dict[str, Any]:
        """What the trace says about the timeline: where it is (relative to the rank's directory)."""
        if self.note is not None:
            return {"timeline": None, "timeline_note": self.note}
        if self._user:
            return {"timeline": str(self.files[0]), "timeline_note": f"the user's {TIMELINE_ENV}"}
        return {"timeline": os.path.relpath(self.directory, rank_dir) if self.files else None}


def groups_by_variable(buckets: Sequence[Sequence[str]], variables: Sequence[Any]) -> list[list[Any]]:
    """A plan's buckets (variable names) as ``DistributedGradientTape``'s ``groups`` (lists of the
    variables); ValueError naming a bucket entry that is no variable of ``variables``."""
    by_name = {v.name: v for v in variables}
    missing = [n for bucket in buckets for n in bucket if n not in by_name]
    if missing:
        raise ValueError(f"the plan's gradient groups name unknown variables: {', '.join(missing[:5])}")
    return [[by_name[n] for n in bucket] for bucket in buckets]


def settings_not_in_effect(settings: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> list[str]:
    """The names of ``settings`` (a plan's ``communication``) whose value is not the one Horovod
    runs with (`horovod_settings`)."""
    current = horovod_settings(env)
    return [key for key, value in settings.items() if not math.isclose(float(current[key]), float(value))]
