"""Running the tool's own work so that it never breaks the user's training.

The integrations run each piece of their own work through a `FailSafe`: the first failure warns
once, with its cause, and calls ``on_fail`` (stop the profiler, undo what was half done); from
then on the tool steps aside and its work is skipped, while the user's training goes on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any


class FailSafe:
    """Guards one integration's work; ``who`` names it in the warning (``"<who> steps aside: ..."``)."""

    def __init__(self, who: str, on_fail: Callable[[], None]):
        self.who = who
        self.on_fail = on_fail
        self.cause: str | None = None

    @property
    def ok(self) -> bool:
        """No failure so far."""
        return self.cause is None

    def run(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)``: its result (True for None), or None if it failed (a warning, once) or an
        earlier failure has already made the tool step aside."""
        if self.cause is not None:
            return None
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 - the tool must never break training
            self.fail(f"{type(exc).__name__}: {exc}")
            return None
        return True if result is None else result

    def fail(self, cause: str) -> None:
        """Step aside: warn with ``cause`` (the first time only) and call ``on_fail``."""
        if self.cause is None:
            self.cause = cause
            warnings.warn(f"{self.who} steps aside: {cause}", RuntimeWarning, stacklevel=3)
        self.on_fail()
