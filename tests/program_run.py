"""Start one of the tests' own programs: a script beside the tests that trains under the callback in
a process of its own (what a plan applies, a malloc setting or a process group, stays in the process
that applied it), run in its output directory with its output captured."""

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def run_program(script: str, arguments: Sequence[str], out: Path) -> subprocess.CompletedProcess:
    """``script`` run with ``arguments`` in ``out``, unbuffered, within 400 s."""
    return subprocess.run(
        [sys.executable, str(Path(script).resolve()), *arguments],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=out,
    )
