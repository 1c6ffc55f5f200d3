"""Horovod's tensor fusion in the TF integration: what the recorder reads about it, and how a
fusion plan is applied.

Recording:
- `graph_collectives`: the gradients Horovod all-reduces, read from the step's concrete function
  graph (``HorovodAllreduce`` and ``HorovodGroupedAllreduce`` op inputs, inside the ``cond``
  branches ``DistributedGradientTape`` builds): per collective op, its tensors' shapes, dtypes and
  bytes, and the variable each gradient belongs to (Horovod builds the ops for the ``groups`` in
  order, then one per remaining variable in ``sources`` order; gradients are matched to variables
  in that order by shape);
- `horovod_settings`: the fusion threshold and cycle time in effect (Horovod's environment
  variables, which ``horovodrun --fusion-threshold-mb/--cycle-time-ms`` set, or its defaults);
- `Timeline`: Horovod's timeline for each recorded step (``hvd.start_timeline``), when the user
  opted in with `record_horovod_timeline` (``HOROVOD_TIMELINE=DYNAMIC``) before ``hvd.init()``. It
  is opt-in because it is not free: from ``hvd.init()`` to shutdown, Horovod 0.28's timeline writer
  thread on the coordinator (rank 0) polls its queue without sleeping (``TimelineWriter::WriterLoop``
  yields and loops), so it keeps one core busy for the whole run, recorded or not. Measured on the
  project's 2-core VM (`benchmarks/horovod_timeline_cost.py`): the example's CNN step took 1.42
  times as long with it on one process and 1.53 times on two (medians of 3 pairs of runs). Without
  it the trace says so and the tensor-fusion plans are not priced (they need the timeline's fused
  responses). A timeline that cannot be started or read warns once; recording goes on without
  Horovod's phases.

Applying (mode "apply"): fusion threshold and cycle time are read by ``hvd.init()`` and cannot
change in a running job: the chosen values go into ``plan.json`` with the ``horovodrun`` flags and
environment that apply them at the next launch (`next_launch`). Gradient groups can change live:
the user passes ``groups=recorder.groups`` to ``hvd.DistributedGradientTape``; `groups_trial`
sets the planned groups and re-traces the step's Python function, which is then measured like the
other candidates (see `apply`). At a later launch with the kept plan (``Recorder(plan=...)``) its
groups are set the same way (`groups_by_variable`), and its fusion threshold and cycle time are
only checked against the environment in effect (`launch_note`).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf

from qsync_callback.errors import QSyncInputError
from qsync_callback.integrations.horovod_tf.apply import GROUPS, Trial, python_function
from qsync_callback.plan import Plan
from qsync_callback.recorder.horovod_timeline import TensorRecord, part_keys, read_timeline, tensor_key

TIMELINE_ENV = "HOROVOD_TIMELINE"
DYNAMIC = "DYNAMIC"
THRESHOLD_ENV = "HOROVOD_FUSION_THRESHOLD"
CYCLE_ENV = "HOROVOD_CYCLE_TIME"
DEFAULT_THRESHOLD_BYTES = 128 * 2**20  # Horovod 0.28's defaults (horovodrun --help)
DEFAULT_CYCLE_MS = 1.0
TIMELINE_DIR = "horovod_timeline"
_COLLECTIVE_OPS = ("HorovodAllreduce", "HorovodGroupedAllreduce")


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


def graph_collectives(
    fn: Callable, args: Sequence, kwargs: Mapping, variables: Sequence[Any], groups: Any
) -> dict[str, list[dict[str, Any]]]:
    """Per Horovod collective op of the step's graph (by `tensor_key` of its name): its tensors,
    ``{"name", "shape", "dtype", "bytes", "variable"}``. ``fn`` must be a ``tf.function``;
    ``variables`` the ``sources`` of the tape's gradient (usually ``model.trainable_variables``);
    ``groups`` what the step passed to ``DistributedGradientTape`` (a list of lists of variables
    maps gradients to variables; otherwise they map in ``variables`` order)."""
    concrete = fn.get_concrete_function(*args, **kwargs)
    graphs = _graphs(concrete.graph)
    ops = [op for graph in graphs for op in graph.get_operations() if op.type in _COLLECTIVE_OPS]
    order = list(variables)
    if isinstance(groups, list):
        named = [v for group in groups for v in group]
        order = named + [v for v in variables if all(v is not n for n in named)]
    out: dict[str, list[dict[str, Any]]] = {}
    for op in ops:
        key = tensor_key(op.name)
        tensors = []
        for name, tensor in zip(part_keys(key, len(op.inputs)), op.inputs, strict=True):
            shape = [int(d) if d is not None else -1 for d in tensor.shape]
            variable = _take_variable(order, shape)
            numel = math.prod(shape) if all(d >= 0 for d in shape) else None
            tensors.append(
                {
                    "name": name,
                    "variable": variable,
                    "shape": shape,
                    "dtype": tensor.dtype.name,
                    "bytes": numel * tensor.dtype.size if numel is not None else None,
                }
            )
        out[key] = tensors
    return out


def _graphs(graph: Any) -> list[Any]:
    """A function graph and the graphs of the functions it calls (cond branches...), breadth first
    in the order they were created."""
    out, queue, seen = [], [graph], set()
    while queue:
        g = queue.pop(0)
        if id(g) in seen:
            continue
        seen.add(id(g))
        out.append(g)
        for f in getattr(g, "_functions", {}).values():
            if getattr(f, "graph", None) is not None:
                queue.append(f.graph)
    return out


def _take_variable(order: list[Any], shape: list[int]) -> str | None:
    """The name of the first variable left in ``order`` with this shape (removed from it)."""
    for i, v in enumerate(order):
        if [int(d) for d in v.shape] == shape:
            return order.pop(i).name
    return None


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


def attach_timeline(ops: Sequence[Any], records: Sequence[TensorRecord]) -> int:
    """Put each collective op's tensors' timeline records into ``op.collective["tensors"]``: per
    tensor, the record with its key that ended closest to the op's completion (with the tensor's
    dtype, shape and bytes from the record where the graph did not give them). Returns how many
    tensors got a record."""
    by_key: dict[str, list[TensorRecord]] = {}
    for r in records:
        by_key.setdefault(r.key, []).append(r)
    found = 0
    for op in ops:
        if op.kind != "comm" or op.collective is None:
            continue
        key = tensor_key(op.name)
        tensors = op.collective.get("tensors")
        if tensors is None:
            names = [k for k in by_key if k == key or k.startswith(f"{key}_")]
            tensors = [{"name": k, "variable": None} for k in sorted(names)]
        for tensor in tensors:
            candidates = by_key.get(tensor["name"], [])
            if not candidates:
                continue
            record = min(candidates, key=lambda r: abs(r.end_us - op.end_us))
            tensor["timeline"] = record.to_dict()
            tensor.setdefault("shape", record.shape)
            tensor.setdefault("dtype", record.dtype)
            if tensor.get("bytes") is None:
                tensor["bytes"] = record.bytes
            found += 1
        if tensors:
            op.collective["tensors"] = tensors
            op.collective["bytes"] = sum(int(t.get("bytes") or 0) for t in tensors)
    return found


def groups_by_variable(buckets: Sequence[Sequence[str]], variables: Sequence[Any]) -> list[list[Any]]:
    """A plan's buckets (variable names) as ``DistributedGradientTape``'s ``groups`` (lists of the
    variables); ValueError naming a bucket entry that is no variable of ``variables``."""
    by_name = {v.name: v for v in variables}
    missing = [n for bucket in buckets for n in bucket if n not in by_name]
    if missing:
        raise ValueError(f"the plan's gradient groups name unknown variables: {', '.join(missing[:5])}")
    return [[by_name[n] for n in bucket] for bucket in buckets]


def next_launch(settings: Mapping[str, Any]) -> str:
    """How to launch with ``settings`` (a plan's ``communication``): horovodrun's flags (only where
    they can say it: the threshold in whole MiB) and the environment variables."""
    flags, env = [], []
    threshold = settings.get("fusion_threshold_bytes")
    cycle = settings.get("cycle_time_ms")
    if threshold is not None:
        if threshold % 2**20 == 0:
            flags.append(f"--fusion-threshold-mb {threshold // 2**20}")
        env.append(f"{THRESHOLD_ENV}={threshold}")
    if cycle is not None:
        flags.append(f"--cycle-time-ms {cycle:g}")
        env.append(f"{CYCLE_ENV}={cycle:g}")
    return f"horovodrun {' '.join(flags)} ...   (or {' '.join(env)})"


def settings_in_effect(plan: Plan | None, env: Mapping[str, str] = os.environ) -> bool:
    """True if ``plan`` (a plan.json of an earlier run) has communication settings and the
    environment applies every one of them."""
    if plan is None or not plan.communication:
        return False
    current = horovod_settings(env)
    return all(
        name in current["from_env"] and math.isclose(float(current[key]), float(plan.communication[key]))
        for key, name in (("fusion_threshold_bytes", THRESHOLD_ENV), ("cycle_time_ms", CYCLE_ENV))
        if key in plan.communication
    )


def launch_note(plan: Plan) -> str:
    """What to tell the user about ``plan``'s fusion threshold and cycle time at launch: in effect,
    or how to launch with them."""
    if settings_in_effect(plan):
        return "qsync: the plan's fusion threshold and cycle time are in effect"
    return (
        "qsync: the plan's fusion threshold and cycle time are not in effect (Horovod reads them at"
        f" hvd.init()); launch with {next_launch(plan.communication)}"
    )


class FusionPlanning:
    """Rank 0 prices gradient groups and fusion settings on every rank's recorded ``traces``
    (`planner/tensor_fusion.py`) when the groups candidate is built; every rank receives the
    groups through ``share`` (rank 0's text on every rank)."""

    def __init__(self, traces: Sequence[Any] | None, rank: int, share: Callable[[str], str]):
        self.traces = list(traces) if traces else None
        self.rank = rank
        self.share = share
        self.settings: Any = None  # rank 0: the chosen fusion threshold and cycle time (FusionChoice)
        self.baseline_ms: float | None = None

    def groups(self, trial: Trial) -> list[list[str]]:
        """The chosen groups (every rank); on rank 0 the trial's prediction is set on the way."""
        text = ""
        if self.rank == 0:
            try:
                text = json.dumps({"buckets": self._choose(trial)})
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then leave it out
                text = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        data = json.loads(self.share(text))
        if "error" in data:
            raise RuntimeError(data["error"])
        return data["buckets"]

    def _choose(self, trial: Trial) -> list[list[str]]:
        from qsync_callback.planner.tensor_fusion import choose_groups, choose_settings
        from qsync_callback.predictor.predict import Predictor

        if self.traces is None:
            raise RuntimeError("rank 0 has no recorded traces to price plans on")
        predictor = Predictor(self.traces)
        self.settings = choose_settings(predictor)
        choice = choose_groups(predictor)
        if choice is None:
            raise RuntimeError("a single all-reduced gradient: no grouping to try")
        self.baseline_ms = choice.baseline.step_ms
        trial.prediction = {
            "step_ms": choice.prediction.step_ms,
            "source": "predicted",
            "baseline_step_ms": choice.baseline.step_ms,
            "candidates": choice.candidates,
        }
        return choice.plan.buckets

    def write_next_launch(self, plan_path: Path) -> str | None:
        """Rank 0, after the decision: put the chosen fusion threshold and cycle time into the plan
        file (they apply at the next launch) if they are predicted faster than the recorded ones;
        returns what to tell the user."""
        choice = self.settings
        if choice is None:
            return None
        recorded = choice.baseline.step_ms
        if choice.prediction.step_ms >= recorded:
            return (
                f"qsync fusion: the recorded fusion threshold and cycle time are the best predicted"
                f" ({recorded:.2f} ms/step)"
            )
        plan = Plan.load(plan_path)
        plan.communication = dict(choice.plan.communication)
        prediction = dict(plan.prediction or {})
        prediction["communication"] = {
            "step_ms": choice.prediction.step_ms,
            "recorded_step_ms": recorded,
            "source": "predicted",
            "applies": "at the next launch",
            "candidates": choice.candidates,
        }
        plan.prediction = prediction
        plan.save(plan_path)
        return (
            f"qsync fusion: fusion threshold {plan.communication['fusion_threshold_bytes']} bytes, cycle time"
            f" {plan.communication['cycle_time_ms']:g} ms predicted {choice.prediction.step_ms:.2f} ms/step"
            f" (recorded settings: {recorded:.2f}); written to {plan_path}; applies at the next launch:"
            f" {next_launch(plan.communication)}"
        )


def groups_trial(
    fn: Callable,
    variables: Sequence[Any],
    fingerprint: Mapping[str, Any],
    planning: FusionPlanning,
    recorder: Any,
) -> Trial:
    """The gradient-groups candidate: the planned groups set on ``recorder.groups`` and the step's
    Python function re-traced. After its first call (traced) the recorder's groups go back to
    what they were until the candidate is kept (``enable``); the evidence is the grouped
    all-reduce ops of its graph."""
    original = recorder.groups
    chosen: list[list[Any]] = []
    trial = Trial(GROUPS, Plan(fingerprint=dict(fingerprint)), lambda: None)

    def build() -> Callable:
        trial.plan.buckets = planning.groups(trial)
        chosen[:] = groups_by_variable(trial.plan.buckets, variables)
        recorder.groups = chosen
        return tf.function(python_function(fn))

    def inspect(step: Callable, args: Sequence, kwargs: Mapping) -> dict[str, Any]:
        recorder.groups = original
        collectives = graph_collectives(step, args, kwargs, variables, chosen)
        grouped = sorted(len(ts) for ts in collectives.values() if len(ts) > 1)
        return {"collective_ops": len(collectives), "grouped_tensors": grouped} if grouped else {}

    def enable() -> None:
        recorder.groups = chosen

    trial.build, trial.inspect, trial.enable = build, inspect, enable
    return trial
