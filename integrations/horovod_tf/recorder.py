"""Recorder and ``@profile``: a Horovod + TensorFlow train step, forwarded to the tuning loop
(`qsync_callback.tuning_loop`).

Each call of the decorated step runs the step function in force (the user's, or the one a plan
re-traced) between the loop's `TuningLoop.step_boundary` and `TuningLoop.step_end`, and returns its
result unchanged. The loop records a window on every rank (the schedule: `recorder/tf_recorder.py`)
and rank 0 reports measured against predicted step time (summary, ``report.json``); in mode "apply"
it then plans (`planner/tf_plans.py`), applies the plan on every rank at one call, records again and
keeps the plan or rolls back (`verify.py`), and keeps it in ``plan.json`` and the plan cache. What
the loop needs from Horovod and TF (ranks, fingerprint, recorder, appliers) is `HorovodRun`.

A train step that raises makes the loop step aside with one warning (a plan under verification is
undone on every rank); the error reaches the caller, and later calls run the step function in force.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar

import horovod.tensorflow as hvd

from qsync_callback.alternation import LOOKS, ROUNDS
from qsync_callback.integrations.horovod_tf.horovod_run import HorovodRun
from qsync_callback.integrations.horovod_tf.train_step import TrainStep, all_finite
from qsync_callback.plan import DEFAULT_PRECISIONS, LEVERS, Constraints, Plan
from qsync_callback.tuning_loop import LoopSettings, TuningLoop
from qsync_callback.units import check_count

F = TypeVar("F", bound=Callable[..., Any])


class Recorder:
    """Record a window of a Horovod + TensorFlow training run, report on it, and (mode "apply")
    switch the run to the best plan.

    Args:
        model: the Keras model trained by the step (for layers, weight bytes and the fingerprint).
        batch_size: the per-rank batch size (goes into the fingerprint).
        output_dir: where each rank writes its trace, and rank 0 the report, plan and verification.
        warmup_steps: calls before the recorded window (at least 2).
        profile_steps: calls recorded under the profiler (at least 1).
        measure_steps: unprofiled calls timed after the window (planning precision, as many calls
            of the bf16 probe read the allocator's peak under TF's uniform rewrite).
        mode: "record" (write traces only), "report" (also predict, print and write report.json) or
            "apply" (also plan, apply, verify and keep).
        optimizer: the optimizer the step applies (default: ``model.optimizer`` if compiled); its
            variables count as resident memory and its name scope marks update ops.
        verify_steps: calls recorded after applying a plan.
        alternate_rounds: after those, rounds of the recorded configuration and the plan in turns,
            as for ``QSyncCallback`` (each switch re-traces the step).
        alternate_looks: while the turns cannot tell the plan from the baseline, as many more rounds,
            up to this many times as many, as for ``QSyncCallback``.
        plan: a plan file to apply at the first call; None: in mode "apply" the plan kept in the
            plan cache for this job under these constraints, if any; False: none.
        memory_budget, max_step_time, precisions, levers, best_effort: what a plan is chosen
            under, as for ``QSyncCallback``.
        plan_cache: where kept plans live between launches: True for the user's cache directory,
            a directory, or False for none.

    ``groups`` (default None: Horovod's default) is what the step should pass to
    ``hvd.DistributedGradientTape(tape, groups=recorder.groups)``; a plan's gradient groups go there.
    """

    def __init__(
        self,
        model: Any = None,
        batch_size: int | None = None,
        output_dir: str | Path = "qsync",
        warmup_steps: int = 10,
        profile_steps: int = 5,
        measure_steps: int = 10,
        mode: str = "report",
        *,
        optimizer: Any = None,
        verify_steps: int = 3,
        alternate_rounds: int = ROUNDS,
        alternate_looks: int = LOOKS,
        plan: str | Path | Literal[False] | None = None,
        memory_budget: str | int | float | None = None,
        max_step_time: float | None = None,
        precisions: Iterable[str] = DEFAULT_PRECISIONS,
        levers: Iterable[str] = LEVERS,
        best_effort: bool = False,
        plan_cache: bool | str | Path = True,
    ):
        if batch_size is not None:
            check_count(batch_size, "batch_size", 1)
        if model is not None and not hasattr(model, "layers"):
            raise TypeError(f"model: must be a Keras model, not {type(model).__name__}")
        if not (plan is None or plan is False or isinstance(plan, (str, Path))):
            raise TypeError(f"plan: must be a plan file's path, None or False, not {plan!r}")
        settings = LoopSettings.from_arguments(
            mode,
            warmup_steps,
            profile_steps,
            measure_steps,
            verify_steps,
            output_dir,
            constraints=Constraints.from_arguments(
                memory_budget, max_step_time, precisions, levers, best_effort
            ),
            plan=plan if plan is not False else None,
            plan_cache=plan_cache if plan is not False else False,
            alternate_rounds=alternate_rounds,
            alternate_looks=alternate_looks,
        )
        self._loop = TuningLoop(settings, who="qsync Recorder")
        self.model = model
        self.batch_size = batch_size
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        constraints = settings.constraints
        self._probe_bf16 = "precision" in constraints.levers and "bf16" in constraints.precisions
        self._step = TrainStep()
        self._run: HorovodRun | None = None

    @property
    def output_dir(self) -> Path:
        return self._loop.output_dir

    @property
    def report(self) -> dict[str, Any] | None:
        """Rank 0, once reported: the report (as in report.json)."""
        return self._loop.report

    @property
    def verification(self) -> dict[str, Any] | None:
        """Rank 0, once a plan was verified: the figures and the decision (as in verification.json)."""
        return self._loop.verification

    @property
    def plan(self) -> Plan | None:
        """The kept plan in force (None: the user's step as it is)."""
        return self._loop.plan

    @property
    def finished(self) -> bool:
        """True once the recorder is done (reported, applied, verified, or stepped aside), on every
        rank at the same call; a rank that fails steps aside at once and finishes with the others."""
        return self._loop.finished

    @property
    def failure(self) -> str | None:
        """Why the recorder stepped aside, or None."""
        return self._loop.failure

    @property
    def groups(self) -> Any:
        return self._step.groups

    @groups.setter
    def groups(self, groups: Any) -> None:
        self._step.groups = groups

    def run_step(self, *args: Any, **kwargs: Any) -> Any:
        """One call of the decorated train step (see `profile`); returns its result unchanged."""
        step, loop = self._step, self._loop
        if loop.finished:
            return step.fn(*args, **kwargs)
        step.args, step.kwargs = args, kwargs
        if self._run is None:
            self._run = HorovodRun(
                step, self.model, self.optimizer, self.batch_size, loop.output_dir, self._probe_bf16
            )
        loop.step_boundary(self._run)
        try:
            result = step.fn(*args, **kwargs)
        except Exception as exc:
            loop.exception(f"the train step raised {type(exc).__name__}: {exc}")
            raise
        except BaseException:
            loop.exception()
            raise
        loop.step_end(all_finite(result) if loop.verifying else True)
        step.args, step.kwargs = (), {}
        return result

    def close(self) -> None:
        """Stop recording; a plan still under verification is undone. Safe to call at any time."""
        self._loop.close()


def profile(recorder: Recorder) -> Callable[[F], F]:
    """Decorator: record the train step with ``recorder``; the step's result is returned unchanged.

    Use as ``@profile(recorder)`` above ``@tf.function``."""
    if not isinstance(recorder, Recorder):
        raise TypeError(f"profile() takes a Recorder (use @profile(recorder)), not {type(recorder).__name__}")

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"@profile(recorder) decorates the train step function, not {type(fn).__name__}")
        recorder._step.attach(fn)

        @functools.wraps(fn, updated=())
        def step(*args: Any, **kwargs: Any) -> Any:
            return recorder.run_step(*args, **kwargs)

        return step

    return decorate


def patch_horovod() -> None:
    """Make dPRO-style scripts run unchanged: ``hvd.Recorder(...)`` and ``@hvd.profile(recorder)``."""
    hvd.Recorder = Recorder
    hvd.profile = profile
