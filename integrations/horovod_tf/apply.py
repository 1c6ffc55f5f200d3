"""Mode "apply": try the first TF plan kinds on the live run, measure them, keep the best or roll back.

After the recorded window and the report, the next calls of the user's train step run, in turn:

- the original step (the baseline), ``verify_steps`` timed calls;
- operator fusion through XLA: the step's Python function under ``tf.function(jit_compile=True)``;
- mixed precision on CPU: the same function re-traced with TF's oneDNN bfloat16 auto-mixed-precision
  graph rewrite (``auto_mixed_precision_onednn_bfloat16``) switched on;

each candidate ``CANDIDATE_WARMUP`` untimed calls (tracing, compiling) then ``verify_steps`` timed.
Each call returns the result of the function that ran, unchanged. A candidate is priced by these
measurements ("measured candidate", not an estimate). A candidate that raises warns once, and that
call and the rest of its turn run the original step; one whose result stops being finite is out.
After its first call, the bf16 candidate's graph is run through TF's graph optimizer to count the
ops the rewrite turned to bfloat16 (``evidence`` in verification.json); if there are none (a CPU
without bfloat16 support), it is out. Horovod's collectives have no XLA kernels on CPU: on a step
that all-reduces through Horovod the XLA candidate fails to compile, and is out.

Then rank 0 decides on the slowest rank's medians (one all-reduce) and broadcasts its choice, so that
every rank switches at the same call: the fastest candidate is kept only if it is more than
`SLOWER_TOLERANCE` faster than the baseline (`qsync_callback.verify`), otherwise the run rolls back
to the original step, with TF's options as they were. Rank 0 writes ``plan.json`` (the plan in
effect) and ``verification.json`` (every figure and the decision) and prints a summary.
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

from qsync_callback.jsonio import write_text_atomic
from qsync_callback.plan import Plan
from qsync_callback.verify import SLOWER_TOLERANCE

CANDIDATE_WARMUP = 2
XLA = "xla"
AMP = "amp_bf16"
CANDIDATES = (XLA, AMP)
AMP_OPTION = "auto_mixed_precision_onednn_bfloat16"
BASELINE = "baseline"
PLAN_FILE = "plan.json"
VERIFICATION_FILE = "verification.json"
MEASURED = "measured candidate"
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
    """Switches TF's oneDNN bfloat16 auto-mixed-precision rewrite on, and back to what it was."""

    def __init__(self) -> None:
        self._before: bool | None = None

    def enable(self) -> None:
        if self._before is None:
            self._before = bool(tf.config.optimizer.get_experimental_options().get(AMP_OPTION, False))
        tf.config.optimizer.set_experimental_options({AMP_OPTION: True})

    def restore(self) -> None:
        if self._before is not None:
            tf.config.optimizer.set_experimental_options({AMP_OPTION: self._before})
            self._before = None


def make_trials(
    fn: Callable, layers: Sequence[str], fingerprint: Mapping[str, Any], amp: AmpOption
) -> list[Trial]:
    """The baseline (the original step) and the candidates built from its Python function."""
    py = python_function(fn)
    names = list(layers)

    def amp_step() -> Callable:
        amp.enable()  # read when the new function is traced and optimized: its first call
        return tf.function(py)

    return [
        Trial(BASELINE, Plan.empty(fingerprint), lambda: fn, warmup=0),
        Trial(
            XLA,
            Plan(fingerprint=dict(fingerprint), fused_regions=[names] if names else []),
            lambda: tf.function(py, jit_compile=True),
        ),
        Trial(
            AMP,
            Plan(fingerprint=dict(fingerprint), precision=dict.fromkeys(names, "bf16")),
            amp_step,
            inspect=bf16_op_counts,
        ),
    ]


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
        if trial.name == AMP:
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
        if self.chosen.name != AMP:
            self.amp.restore()
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
            plan.prediction = {"step_ms": float(medians[self.trials.index(chosen)]), "source": MEASURED}
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
    lines = [f"qsync apply: baseline {verification['baseline']['all_ranks_step_ms']:.2f} ms/step (measured)"]
    for c in verification["candidates"]:
        ms = c["all_ranks_step_ms"]
        figure = f"{ms:.2f} ms/step (measured)" if ms is not None else "no figure"
        note = f", failed: {c['error']}" if c["error"] else ("" if c["finite"] else ", not finite")
        lines.append(f"  {c['name']:<10} {figure}{note}")
    decision = verification["decision"]
    what = "to the original step" if decision == "roll back" else verification["chosen"]
    lines.append(f"  decision: {decision} {what} ({verification['reason']})")
    return "\n".join(lines)
