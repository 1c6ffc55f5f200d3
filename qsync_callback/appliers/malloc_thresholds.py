"""Fix glibc malloc's thresholds at a plan's ``malloc_thresholds`` (`qsync_callback.malloc_thresholds`).

The thresholds are the process's: the applier needs no model, and the same one serves every
framework whose tensors come from malloc. Its undo sets the thresholds the steps ran under before
(``in_force``: from the run's recorded trace, else the environment's or glibc's starting values),
since glibc has no way back to its moving ones, and hands back the free heap the plan kept.
What it cannot hand back is a block the plan kept free below a live one (the heap shrinks only
from its top): the next request of that size is served there, mapped already, so the run after an
undo can take fewer faults than before the plan; the verify's turns measure it as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qsync_callback.errors import QSyncInputError
from qsync_callback.malloc_thresholds import (
    fixed_in_environment,
    glibc_malloc,
    hand_back_free_heap,
    set_thresholds,
    thresholds_in_force,
)
from qsync_callback.plan import Plan


class MallocThresholdApplier:
    """Carries out a plan's ``malloc_thresholds``; ``in_force`` gives the thresholds to go back to
    (None: no recorded steps to tell, then those the environment fixed, else glibc's start)."""

    def __init__(self, in_force: Callable[[], Mapping[str, int] | None]):
        self._in_force = in_force
        self._known: dict[str, int] | None = None  # the last thresholds ``in_force`` gave

    def __call__(self, plan: Plan) -> Callable[[], None]:
        mallopt, reason = glibc_malloc()
        if mallopt is None:
            raise QSyncInputError(f"malloc's thresholds cannot be fixed: {reason}; nothing was applied")
        recorded = self._in_force()
        self._known = dict(recorded) if recorded is not None else self._known
        before = self._known or thresholds_in_force([], fixed_in_environment())
        try:
            set_thresholds(plan.malloc_thresholds)
        except RuntimeError as error:
            set_thresholds(before)
            said = f"malloc's thresholds were not fixed: {error}; nothing was applied"
            raise QSyncInputError(said) from None

        def undo() -> None:
            set_thresholds(before)
            hand_back_free_heap()

        return undo
