"""Running benchmark workers: each training run in a fresh subprocess, its output in its folder."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
STDERR_TAIL_LINES = 40


TCMALLOC_OPT_IN = "QSYNC_BENCH_TCMALLOC"


def tcmalloc_requested() -> bool:
    """Whether runs preload tcmalloc: only when ``QSYNC_BENCH_TCMALLOC=1`` is set and it is
    installed. Users do not preload it, so the figures are measured without it by default."""
    return os.environ.get(TCMALLOC_OPT_IN) == "1" and TCMALLOC.exists()


def subprocess_env() -> dict[str, str]:
    """The environment of a run: tcmalloc preloaded only when requested (`tcmalloc_requested`)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if tcmalloc_requested():
        preload = env.get("LD_PRELOAD", "")
        if str(TCMALLOC) not in preload.split(":"):
            env["LD_PRELOAD"] = f"{TCMALLOC}:{preload}" if preload else str(TCMALLOC)
    return env


def say_allocator() -> None:
    """Print which allocator the runs use (glibc malloc unless tcmalloc is requested)."""
    if tcmalloc_requested():
        print(f"[benchmark] runs preload {TCMALLOC} ({TCMALLOC_OPT_IN}=1)", file=sys.stderr)
    else:
        print(
            f"[benchmark] runs use glibc malloc, as users do ({TCMALLOC_OPT_IN}=1 preloads tcmalloc)",
            file=sys.stderr,
        )


def launch(script: Path, args: list[str], run_dir: Path, timeout_s: float) -> tuple[int, float]:
    """Run ``python script args`` in a fresh subprocess (see `launch_command`)."""
    return launch_command([sys.executable, str(script), *args], run_dir, timeout_s)


def launch_command(cmd: list[str], run_dir: Path, timeout_s: float) -> tuple[int, float]:
    """Run ``cmd`` in a fresh subprocess, in an emptied ``run_dir``; returns (exit code, wall
    seconds). Output goes to ``run_dir/stdout.log`` and ``run_dir/stderr.log``."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    start = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as out, open(run_dir / "stderr.log", "w") as err:
        # its own session, so that a timeout also ends the other ranks it started
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=subprocess_env(), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            err.write(f"\n[benchmark] timed out after {timeout_s:.0f} s\n")
            rc = 124
    return rc, time.perf_counter() - start


def stderr_tail(run_dir: Path, lines: int = STDERR_TAIL_LINES) -> str:
    """The last ``lines`` lines of a run's stderr."""
    path = run_dir / "stderr.log"
    text = path.read_text(errors="replace") if path.exists() else "(no stderr.log)"
    return "\n".join(text.splitlines()[-lines:])


def installed_version(*distributions: str) -> str | None:
    """The installed version of the first of ``distributions`` that is installed."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def write_results(out: Path, name: str, table: str, raw: dict[str, Any]) -> None:
    """Print a benchmark's markdown ``table`` and write it to ``<out>/<name>.md``, its ``raw`` rows
    and environment to ``<out>/<name>.json``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(table.rstrip("\n") + "\n")
    (out / f"{name}.json").write_text(json.dumps(raw, indent=2) + "\n")
    print(table)
    print(f"written to {out / name}.md and .json")


def environment(**extra: Any) -> dict[str, Any]:
    """What the numbers depend on, saved with the raw rows."""
    import pytorch_lightning as pl
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pytorch_lightning": pl.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "tcmalloc": str(TCMALLOC) if tcmalloc_requested() else None,
        "load_avg_at_start": os.getloadavg(),
        **extra,
    }
