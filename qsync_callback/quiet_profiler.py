"""Keep torch.profiler's own console lines off the user's console.

Every profiler session makes Kineto, torch's profiler library, print a pair of lines to stderr from
C++: ``USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start`` and ``...
profiler_stop`` (its ``USDT_EMIT_START_TRACE`` / ``USDT_EMIT_STOP_TRACE`` marks): a pair for every
step the recorder records. Kineto logs them at its highest severity (USDT, 5, above ERROR, 4) and
prints whatever is at or above its threshold; torch sets that threshold to ERROR unless the
environment variable ``KINETO_LOG_LEVEL`` says otherwise, which Kineto reads once per process, when
the first profiler session starts. No lower threshold than 6 keeps the marks out, so Kineto's own
ERROR lines go too; the failures that matter here reach Python as exceptions or an empty trace.

A user who set ``KINETO_LOG_LEVEL`` keeps it; a profiler started earlier in the process (the user's
own) has fixed the threshold already, and its lines stay.
"""

from __future__ import annotations

import os

KINETO_LOG_LEVEL = "KINETO_LOG_LEVEL"
QUIET_LEVEL = "6"  # above every severity Kineto logs (VERBOSE 0 ... ERROR 4, USDT 5)


def quiet_kineto() -> None:
    """Silence Kineto's console output for this process (and the processes it starts), unless the
    user chose a level; call before the process's first profiler session."""
    os.environ.setdefault(KINETO_LOG_LEVEL, QUIET_LEVEL)
