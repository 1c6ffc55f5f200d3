"""Mode "apply": try TF plan kinds on the live run, measure them, keep the best or roll back.

After the recorded window and the report, the next calls of the user's train step run, in turn:

- the original step (the baseline), ``verify_steps`` timed calls;
- operator fusion through XLA: the step's Python function under ``tf.function(jit_compile=True)``;
- mixed precision on CPU, uniform: the same function re-traced with TF's oneDNN bfloat16
  auto-mixed-precision graph rewrite (``auto_mixed_precision_onednn_bfloat16``) switched on, with
  TF's default op lists. On rank 0 its first `PROBE_CALLS` calls also measure it per op type
  (`mixed_precision.Bf16Probe`: the graph TF runs, then a profiled window);
- mixed precision per op type: rank 0 writes those costs into the traces
  (``precision_costs["op_types"]``, saved again), prices plans with the predictor
  (`predictor/op_precision.py`) and chooses the op types to run at bf16
  (`planner/op_precision.py`, TF's deny list excluded); every rank receives the plan, sets TF's env
  lists for it (`mixed_precision.env_lists`, PRIORLIST file and variable too) and re-traces the
  function with the rewrite on;

each candidate ``CANDIDATE_WARMUP`` untimed calls (tracing, compiling; the uniform one
`PROBE_CALLS`) then ``verify_steps`` timed. Each call returns the result of the function that ran,
unchanged. Each candidate is measured ("measured candidate"); the baseline and both mixed-precision
candidates also carry the predictor's figure ("predicted": the recorded trace with the op types'
measured bf16 times and cast nodes, replayed; the uniform candidate as every op type TF ran at bf16).
XLA is not priced. A candidate that raises warns once, and that call and the rest of its turn run
the original step; one whose result stops being finite is out. After its first call, a bf16
candidate's graph is run through TF's graph optimizer to count the ops the rewrite turned to
bfloat16 (``evidence`` in verification.json); if there are none (a CPU without bfloat16 support, or
a plan that keeps every type at fp32), it is out. Horovod's collectives have no XLA kernels on CPU:
on a step that all-reduces through Horovod the XLA candidate fails to compile, and is out. Each
candidate's TF settings (the rewrite option, the env lists) are set for its turn and put back after
it, and set again only for the kept candidate.

Then rank 0 decides on the slowest rank's medians (one all-reduce) and broadcasts its choice, so that
every rank switches at the same call: the fastest candidate is kept only if it is more than
`SLOWER_TOLERANCE` faster than the baseline (`qsync_callback.verify`), otherwise the run rolls back
to the original step, with TF's options and env as they were. Rank 0 writes ``plan.json`` (the plan in
effect) and ``verification.json`` (every figure and the decision) and prints a summary.

At a later launch the Recorder applies a kept plan (``Recorder(plan=...)``) at the first call with
`enact`: the step's Python function re-traced with what the plan decides (XLA for a fused region
over every layer, TF's bf16 rewrite for bf16 on every layer, or with the env lists of its
``op_precision``); gradient groups and communication settings are the recorder's (`fusion`).
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from qsync_callback.integrations.horovod_tf.mixed_precision import (
    LOW,
    PRIORLIST_FILE,
    PROBE_CALLS,
    UNSAFE_OP_TYPES,
    Bf16Probe,
    EnvSetting,
    env_lists,
    op_type_table,
)
from qsync_callback.jsonio import write_text_atomic
from qsync_callback.plan import Plan
from qsync_callback.planner.op_precision import choose_op_precision, measured_op_types
from qsync_callback.predictor.op_precision import OP_TYPES
from qsync_callback.predictor.predict import Prediction, Predictor
from qsync_callback.recorder.trace import Trace, rank_trace_path
from qsync_callback.verify import SLOWER_TOLERANCE

CANDIDATE_WARMUP = 2
XLA = "xla"
AMP = "amp_bf16"
AMP_OPS = "amp_op_types"
GROUPS = "groups"  # the gradient-groups candidate (`fusion.groups_trial`)
CANDIDATES = (XLA, AMP, AMP_OPS)
WARMUP = {AMP: PROBE_CALLS}  # untimed calls of a candidate, where not CANDIDATE_WARMUP
AMP_OPTION = "auto_mixed_precision_onednn_bfloat16"
BASELINE = "baseline"
PLAN_FILE = "plan.json"
VERIFICATION_FILE = "verification.json"
MEASURED = "measured candidate"
PREDICTED = "predicted"
NO_REWRITE = "the rewrite changed no op of the step on this machine"
ERROR_CHARS = 300  # of a failed candidate's error message, in the warning and verification.json


@dataclass
class Trial:
    """One configuration tried on the live run: how to build its step function, and what it measured."""

    name: str
    plan: Plan
    build: Callable[[], Callable]
    warmup: int = CANDIDATE_WARMUP
    fn: Callable | None = None
    calls: int = 0
    samples: list[float] = field(default_factory=list)
    finite: bool = True
    error: str | None = None
    inspect: Callable[[Callable, Sequence, Mapping], dict[str, Any]] | None = None  # after its 1st call
    evidence: dict[str, Any] | None = None
    probe: Bf16Probe | None = None  # runs its first calls (rank 0's uniform bf16 candidate)
    enable: Callable[[], None] | None = None  # sets its TF settings again when it is kept
    prediction: dict[str, Any] | None = None  # the predictor's figure, where it prices the trial

    @property
    def median_ms(self) -> float | None:
        """Median of the timed calls; None if it failed or has none."""
        return statistics.median(self.samples) if self.samples and self.error is None else None

    def summary(self) -> dict[str, Any]:
        """The figures for verification.json."""
        return {
            "name": self.name,
            "step_ms": self.median_ms,
            "samples_ms": list(self.samples),
            "source": "measured baseline" if self.name == BASELINE else MEASURED,
            "finite": self.finite,
            "error": self.error,
            "evidence": self.evidence,
            "prediction": self.prediction,
            "plan": self.plan.to_dict(),
        }


def python_function(fn: Callable) -> Callable:
    """The Python function behind a ``tf.function`` (or ``fn`` itself)."""
    return getattr(fn, "python_function", fn)


def all_finite(result: Any) -> bool:
    """True unless a floating-point tensor in ``result`` (a nested structure) holds inf or NaN."""
    for value in tf.nest.flatten(result, expand_composites=True):
        if isinstance(value, tf.Tensor) and value.dtype.is_floating:
            if not bool(tf.reduce_all(tf.math.is_finite(value))):
                return False
    return True


class AmpOption:
    """Switches TF's oneDNN bfloat16 auto-mixed-precision rewrite on, with TF's op lists changed by
    env variables (`mixed_precision.env_lists`) or not, and both back to what they were."""

    def __init__(self) -> None:
        self._before: bool | None = None
        self._env = EnvSetting()

    def enable(self, env: Mapping[str, str] | None = None) -> None:
        """Rewrite on; ``env`` set (None: TF's default lists, as before the first change)."""
        if self._before is None:
            self._before = bool(tf.config.optimizer.get_experimental_options().get(AMP_OPTION, False))
        self._env.restore()
        self._env.set(env or {})
        tf.config.optimizer.set_experimental_options({AMP_OPTION: True})

    def restore(self) -> None:
        """The option and the env variables as they were before `enable`."""
        self._env.restore()
        if self._before is not None:
            tf.config.optimizer.set_experimental_options({AMP_OPTION: self._before})
            self._before = None


def trial_calls(verify_steps: int) -> int:
    """Calls the trials take: the baseline's and every candidate's warm-up and timed calls."""
    return verify_steps + sum(WARMUP.get(name, CANDIDATE_WARMUP) + verify_steps for name in CANDIDATES)


def _prediction(prediction: Prediction, **extra: Any) -> dict[str, Any]:
    return {"step_ms": prediction.step_ms, "source": PREDICTED, **extra}


class OpTypePlanning:
    """The per-op-type mixed-precision plan: rank 0 measures the uniform bf16 candidate (``probe``),
    then prices and chooses (`plan`); every rank receives the chosen op types through ``share``
    (rank 0's text on every rank). ``traces`` are every rank's recorded traces (rank 0)."""

    def __init__(
        self,
        traces: Sequence[Trace] | None,
        rank: int,
        logdir: Path,
        output_dir: Path,
        share: Callable[[str], str],
    ):
        self.traces = list(traces) if traces else None
        self.rank = rank
        self.output_dir = output_dir
        self.share = share
        self.probe = Bf16Probe(logdir) if rank == 0 else None

    def plan(self, trials: Sequence[Trial]) -> dict[str, str]:
        """The chosen op types (every rank); on rank 0 the trials' predictions are set on the way."""
        text = ""
        if self.rank == 0:
            try:
                text = json.dumps({"op_precision": self._choose(trials)})
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then step aside
                text = json.dumps({"error": _error(exc)})
        data = json.loads(self.share(text))
        if "error" in data:
            raise RuntimeError(data["error"])
        return data["op_precision"]

    def _choose(self, trials: Sequence[Trial]) -> dict[str, str]:
        by_name = {t.name: t for t in trials}
        if by_name[AMP].error is not None:
            raise RuntimeError(f"the uniform bf16 candidate did not run ({by_name[AMP].error})")
        if self.probe.error is not None:
            raise RuntimeError(f"measuring the uniform bf16 candidate failed ({self.probe.error})")
        if self.traces is None:
            raise RuntimeError("rank 0 has no recorded traces to price plans on")
        table = op_type_table(self.traces[0], self.probe)
        for trace in self.traces:
            trace.precision_costs[OP_TYPES] = table
            trace.save(rank_trace_path(self.output_dir / "trace", trace.rank))
        predictor = Predictor(self.traces)
        fingerprint = self.traces[0].fingerprint
        by_name[BASELINE].prediction = _prediction(predictor.predict())
        uniform = dict.fromkeys(measured_op_types(predictor), LOW)
        by_name[AMP].prediction = _prediction(
            predictor.predict(Plan(fingerprint=fingerprint, op_precision=uniform)), op_precision=uniform
        )
        choice = choose_op_precision(predictor, Plan(fingerprint=fingerprint), UNSAFE_OP_TYPES)
        by_name[AMP_OPS].prediction = _prediction(
            choice.prediction,
            candidates=choice.candidates,
            search=choice.search,
            plans_priced=choice.plans_priced,
        )
        return choice.plan.op_precision


def make_trials(
    fn: Callable,
    layers: Sequence[str],
    fingerprint: Mapping[str, Any],
    amp: AmpOption,
    planning: OpTypePlanning,
) -> list[Trial]:
    """The baseline (the original step) and the candidates built from its Python function."""
    py = python_function(fn)
    names = list(layers)

    def amp_step() -> Callable:
        amp.enable()  # read when the new function is traced and optimized: its first call
        return tf.function(py)

    env: dict[str, str] = {}

    def op_types_step() -> Callable:
        op_types.plan.op_precision = planning.plan(trials)  # rank 0 chooses, every rank receives
        if LOW not in op_types.plan.op_precision.values():
            raise RuntimeError("the predictor found no op type that makes the step faster at bf16")
        env.update(env_lists(op_types.plan.op_precision, planning.output_dir / PRIORLIST_FILE))
        amp.enable(env)  # read when the new function is traced and optimized: its first call
        return tf.function(py)

    op_types = Trial(
        AMP_OPS,
        Plan(fingerprint=dict(fingerprint)),
        op_types_step,
        inspect=bf16_op_counts,
        enable=lambda: amp.enable(env),
    )
    trials = [
        Trial(BASELINE, Plan.empty(fingerprint), lambda: fn, warmup=0),
        Trial(
            XLA,
            Plan(fingerprint=dict(fingerprint), fused_regions=[names] if names else []),
            lambda: tf.function(py, jit_compile=True),
        ),
        Trial(
            AMP,
            Plan(fingerprint=dict(fingerprint), precision=dict.fromkeys(names, LOW)),
            amp_step,
            warmup=WARMUP[AMP],
            inspect=bf16_op_counts,
            probe=planning.probe,
            enable=amp.enable,
        ),
        op_types,
    ]
    return trials


def enact(plan: Plan, fn: Callable, layers: Sequence[str], amp: AmpOption, priorlist_file: Path) -> Callable:
    """The step function that runs ``plan``'s live decisions (a plan kept by an earlier run): the
    Python function of ``fn`` re-traced, under XLA for a fused region over every layer, with TF's
    bf16 rewrite on (``amp``) for bf16 on every layer or for ``op_precision`` (its env lists,
    `mixed_precision.env_lists`); ``fn`` itself for a plan with no live decision. Gradient groups
    need the re-trace too (the caller sets them). A decision TF cannot enact raises ValueError
    before anything is set."""
    names = set(layers)
    if plan.activation:
        raise ValueError("activation policies (offload, recompute) are not enacted on TensorFlow")
    if plan.precision and (set(plan.precision) != names or set(plan.precision.values()) != {LOW}):
        raise ValueError(
            "TF's bf16 rewrite covers the whole step: a plan's precision must be bf16 everywhere"
        )
    if plan.precision and plan.op_precision:
        raise ValueError("a plan sets either bf16 on every layer or a precision per op type, not both")
    if plan.fused_regions and [sorted(r) for r in plan.fused_regions] != [sorted(names)]:
        raise ValueError("XLA compiles the whole step: a plan's fused region must hold every layer")
    env = env_lists(plan.op_precision, priorlist_file) if plan.op_precision else {}
    if not (plan.precision or plan.op_precision or plan.fused_regions or plan.buckets):
        return fn
    if plan.precision or plan.op_precision:
        amp.enable(env)  # read when the new function is traced and optimized: its first call
    return tf.function(python_function(fn), jit_compile=bool(plan.fused_regions))


def live_kinds(plan: Plan) -> list[str]:
    """The candidates whose decisions ``plan`` holds (what `enact` changes in the running step)."""
    decisions = (plan.fused_regions, plan.precision, plan.op_precision, plan.buckets)
    return [name for name, decided in zip((XLA, AMP, AMP_OPS, GROUPS), decisions, strict=True) if decided]


class Trials:
    """Runs the trials call by call (see the module docstring), then decides and switches."""

    def __init__(
        self,
        trials: list[Trial],
        verify_steps: int,
        rank: int,
        world_size: int,
        output_dir: Path,
        amp: AmpOption,
    ):
        self.trials = trials
        self.verify_steps = verify_steps
        self.rank = rank
        self.world_size = world_size
        self.output_dir = output_dir
        self.amp = amp
        self._index = 0
        self.calls = 0
        self.chosen: Trial | None = None  # set once decided
        self.verification: dict[str, Any] | None = None

    @property
    def done(self) -> bool:
        """True once every trial has had its turn."""
        return self._index >= len(self.trials)

    def step(self, original: Callable, args: Sequence, kwargs: Mapping) -> Any:
        """One call: the current trial's function (or the original where it failed); returns its result."""
        trial = self.trials[self._index]
        self.calls += 1
        trial.calls += 1
        if trial.fn is None and trial.error is None:
            try:
                trial.fn = trial.build()
            except Exception as exc:  # noqa: BLE001 - a candidate must never break training
                self._failed(trial, _error(exc))
        if trial.error is not None:
            result = original(*args, **kwargs)
        else:
            start = time.perf_counter()
            try:
                if trial.probe is not None and trial.calls <= trial.warmup:
                    result = trial.probe.call(trial.calls, trial.fn, args, kwargs)
                else:
                    result = trial.fn(*args, **kwargs)
            except Exception as exc:
                if trial.name == BASELINE:
                    raise
                self._failed(trial, _error(exc))
                result = original(*args, **kwargs)
            else:
                if trial.calls > trial.warmup:
                    trial.samples.append((time.perf_counter() - start) * 1e3)
                trial.finite = trial.finite and all_finite(result)
                if trial.calls == 1 and trial.inspect is not None:
                    self._inspect(trial, args, kwargs)
        if trial.calls == trial.warmup + self.verify_steps:
            self._index += 1
            self.amp.restore()  # a candidate's TF settings hold for its turn only
        return result

    def _inspect(self, trial: Trial, args: Sequence, kwargs: Mapping) -> None:
        """Check that the candidate changed the step; one that changed nothing is out."""
        try:
            trial.evidence = trial.inspect(trial.fn, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the check is TF-internal; without it, measure anyway
            trial.evidence = {"unavailable": _error(exc)}
            return
        if not trial.evidence:
            self._failed(trial, NO_REWRITE)

    def _failed(self, trial: Trial, error: str) -> None:
        trial.error = error
        self.amp.restore()
        warnings.warn(
            f"qsync Recorder: candidate {trial.name} failed ({trial.error}); this run goes on with the"
            " original train step",
            RuntimeWarning,
            stacklevel=6,
        )

    def decide(self) -> Trial:
        """Agree on the figures (slowest rank), rank 0 chooses and broadcasts; switch; write the files."""
        n = len(self.trials)
        figures = np.array(
            [t.median_ms if t.median_ms is not None else np.inf for t in self.trials]
            + [0.0 if t.finite and t.error is None else 1.0 for t in self.trials],
            np.float64,
        )
        if self.world_size > 1:
            figures = hvd.allreduce(tf.constant(figures), op=hvd.Max, name="qsync.trials").numpy()
        medians, out = figures[:n], figures[n:] > 0
        choice, reason = choose([t.name for t in self.trials], medians, out) if self.rank == 0 else (0, "")
        if self.world_size > 1:
            choice = int(
                hvd.broadcast(tf.constant(choice, tf.int32), root_rank=0, name="qsync.choice").numpy()
            )
        self.chosen = self.trials[choice]
        if self.chosen.enable is not None:
            self.chosen.enable()
        if self.rank == 0:
            self._write(medians, out, reason)
        return self.chosen

    def _write(self, medians: np.ndarray, out: np.ndarray, reason: str) -> None:
        chosen = self.chosen
        base_ms = float(medians[0])
        candidates = []
        for trial, ms, excluded in zip(self.trials[1:], medians[1:], out[1:], strict=True):
            entry = trial.summary()
            entry["all_ranks_step_ms"] = None if np.isinf(ms) else float(ms)
            entry["excluded"] = bool(excluded)
            entry["speedup_pct"] = None if np.isinf(ms) else 100 * (base_ms / float(ms) - 1)
            candidates.append(entry)
        self.verification = {
            "baseline": {**self.trials[0].summary(), "all_ranks_step_ms": base_ms},
            "candidates": candidates,
            "tolerance": SLOWER_TOLERANCE,
            "decision": "roll back" if chosen.name == BASELINE else "keep",
            "chosen": chosen.name,
            "reason": reason,
            "switch_call": self.calls,
            "world_size": self.world_size,
        }
        plan = chosen.plan
        if chosen.name != BASELINE:
            plan.prediction = {
                **(chosen.prediction or {"step_ms": None, "source": "not priced"}),
                "measured_step_ms": float(medians[self.trials.index(chosen)]),
                "measured_source": MEASURED,
            }
        plan.save(self.output_dir / PLAN_FILE)
        text = json.dumps(self.verification, indent=2, allow_nan=False)
        write_text_atomic(self.output_dir / VERIFICATION_FILE, text + "\n", what="verification")
        print(format_verification(self.verification), flush=True)


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:ERROR_CHARS]}"


def bf16_op_counts(fn: Callable, args: Sequence, kwargs: Mapping) -> dict[str, int]:
    """Ops of the step's graph, after TF's graph optimizations with the oneDNN bfloat16 rewrite on,
    that compute in bfloat16, by op type; empty where the rewrite does nothing (a CPU without
    bfloat16 support). Runs TF's graph optimizer (Grappler) on the traced graph: internal API."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.grappler import tf_optimizer
    from tensorflow.python.training import saver

    concrete = fn.get_concrete_function(*args, **kwargs)
    graph = concrete.graph
    meta = saver.export_meta_graph(graph_def=graph.as_graph_def(), graph=graph)
    meta.collection_def["train_op"].node_list.value.extend(t.name for t in concrete.outputs)
    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.auto_mixed_precision_onednn_bfloat16 = (
        rewriter_config_pb2.RewriterConfig.ON
    )
    optimized = tf_optimizer.OptimizeGraph(config, meta)
    nodes = [*optimized.node, *(n for f in optimized.library.function for n in f.node_def)]
    counts: dict[str, int] = {}
    for node in nodes:
        if any(node.attr[k].type == tf.bfloat16.as_datatype_enum for k in ("T", "DstT") if k in node.attr):
            counts[node.op] = counts.get(node.op, 0) + 1
    return counts


def choose(names: Sequence[str], medians: np.ndarray, out: np.ndarray) -> tuple[int, str]:
    """Index of the trial to keep (0: the baseline) and why: the fastest candidate still in, if it is
    more than `SLOWER_TOLERANCE` faster than the baseline."""
    base = float(medians[0])
    inside = [i for i in range(1, len(medians)) if not out[i] and np.isfinite(medians[i])]
    if not np.isfinite(base) or not inside:
        return 0, "no candidate ran to the end with finite results"
    best = min(inside, key=lambda i: medians[i])
    gain = 1 - float(medians[best]) / base
    if gain > SLOWER_TOLERANCE:
        return best, f"{100 * gain:.1f}% faster than the baseline"
    figure = f"{100 * gain:.1f}% faster" if gain >= 0 else f"{-100 * gain:.1f}% slower"
    return (
        0,
        f"the best candidate, {names[best]}, is {figure}; keeping needs > {100 * SLOWER_TOLERANCE:g}%",
    )


def format_verification(verification: Mapping[str, Any]) -> str:
    """A few lines: the baseline, each candidate, the decision."""
    base = verification["baseline"]
    lines = [f"qsync apply: baseline {base['all_ranks_step_ms']:.2f} ms/step (measured){_predicted(base)}"]
    for c in verification["candidates"]:
        ms = c["all_ranks_step_ms"]
        figure = f"{ms:.2f} ms/step (measured)" if ms is not None else "no figure"
        note = f", failed: {c['error']}" if c["error"] else ("" if c["finite"] else ", not finite")
        lines.append(f"  {c['name']:<12} {figure}{_predicted(c)}{note}")
    decision = verification["decision"]
    what = "to the original step" if decision == "roll back" else verification["chosen"]
    lines.append(f"  decision: {decision} {what} ({verification['reason']})")
    return "\n".join(lines)


def _predicted(entry: Mapping[str, Any]) -> str:
    prediction = entry.get("prediction")
    return f", {prediction['step_ms']:.2f} predicted" if prediction else ""
