"""Running benchmark workers: each training run in a fresh subprocess, its output in its folder."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from qsync_callback.host_cpu import cpu_description
from qsync_callback.plan import Plan
from qsync_callback.predictor.op_precision import op_type_table
from qsync_callback.predictor.predict import Prediction, Predictor, predict
from qsync_callback.recorder.trace import OP_TYPE_COSTS, Trace

REPO = Path(__file__).resolve().parent.parent
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


def _bursts(share: float, seed: int) -> None:
    """Take ``share`` of one core in bursts: busy 0.05-0.6 s at a time (pure Python), then idle as
    long as keeps the share, each length drawn at random."""
    draw = random.Random(seed)
    while True:
        busy = draw.uniform(0.05, 0.6)
        end = time.perf_counter() + busy
        while time.perf_counter() < end:
            pass
        time.sleep(busy * (1 - share) / share * draw.uniform(0.5, 1.5))


@contextlib.contextmanager
def busy_machine(share: float, seed: int = 0) -> Iterator[multiprocessing.Process | None]:
    """Another job on the machine while the block runs: a process (given to the block) taking
    ``share`` (0-1) of one core in bursts of a fraction of a second (`_bursts`), as a user's machine
    shared with another job is; none where ``share`` is 0."""
    if share <= 0:
        yield None
        return
    if share > 1:
        raise ValueError(f"busy share {share} is over one core (1)")
    job = multiprocessing.get_context("fork").Process(target=_bursts, args=(share, seed), daemon=True)
    job.start()
    try:
        yield job
    finally:
        job.terminate()
        job.join()


def stderr_tail(run_dir: Path, lines: int = STDERR_TAIL_LINES) -> str:
    """The last ``lines`` lines of a run's stderr."""
    path = run_dir / "stderr.log"
    text = path.read_text(errors="replace") if path.exists() else "(no stderr.log)"
    return "\n".join(text.splitlines()[-lines:])


def run_report(script: Path, args: list[str], run_dir: Path, timeout: float) -> dict[str, Any] | None:
    """One worker run of ``script`` in ``run_dir``; its report's measured figures, or None (said on
    stderr, with the run's stderr tail) if it failed or wrote no report."""
    rc, _ = launch(script, [*args, "--worker-dir", str(run_dir)], run_dir, timeout)
    report_path = run_dir / "report.json"
    if rc != 0 or not report_path.exists():
        print(f"[benchmark] {run_dir.name} FAILED (exit {rc}):\n{stderr_tail(run_dir)}", file=sys.stderr)
        return None
    return json.loads(report_path.read_text())["measured"]


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
        "cpu": cpu_description(),
        "platform": platform.platform(),
        "tcmalloc": str(TCMALLOC) if tcmalloc_requested() else None,
        "load_avg_at_start": os.getloadavg(),
        **extra,
    }


def git_commit(root: Path = REPO) -> str | None:
    """The commit checked out in ``root`` (its HEAD), read from ``.git`` without running git (no
    lock taken, no git needed); None outside a checkout or if HEAD cannot be resolved. Uncommitted
    changes are not seen: numbers to publish come from a clean tree."""
    git = root / ".git"
    try:
        if git.is_file():  # a worktree or submodule: "gitdir: <path>"
            line = git.read_text().strip()
            if not line.startswith("gitdir:"):
                return None
            git = (root / line.split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head or None
        ref = head.split(":", 1)[1].strip()
        common = git
        if (git / "commondir").is_file():
            common = (git / (git / "commondir").read_text().strip()).resolve()
        for base in dict.fromkeys([git, common]):
            if (base / ref).is_file():
                return (base / ref).read_text().strip() or None
        packed = common / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                sha, _, name = line.partition(" ")
                if name.strip() == ref and not line.startswith(("#", "^")):
                    return sha
    except OSError:
        return None
    return None


def command_line(argv: list[str] | None = None) -> str:
    """How this benchmark was started, as one shell line: ``python`` and ``argv`` (default
    ``sys.argv``), the script's path relative to the repository when it lies inside it."""
    args = list(sys.argv if argv is None else argv)
    if args:
        script = Path(args[0]).resolve()
        if script.is_relative_to(REPO):
            args[0] = str(script.relative_to(REPO))
    return shlex.join(["python", *args])


def provenance() -> dict[str, Any]:
    """When, at which commit and by which command the numbers were made: the date (UTC), the
    checked-out commit (`git_commit`) and the command (`command_line`)."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": command_line(),
    }


def tf_environment() -> dict[str, Any]:
    """What a TensorFlow benchmark's figures also depend on: ``TF_ENABLE_ONEDNN_OPTS`` as the runs
    inherit it (None: unset, TF decides by the CPU). Without oneDNN TF's CPU allocator keeps no
    statistics and the runs measure no peak (`recorder/tf_memory.py`)."""
    return {"tf_enable_onednn_opts": os.environ.get("TF_ENABLE_ONEDNN_OPTS")}


def bench_environment(**extra: Any) -> dict[str, Any]:
    """`environment` and `provenance` together: what a benchmark saves beside its table, and what
    ``benchmarks/readme_tables.py`` names under it in the README. Call it when the runs start (its
    load average is taken then)."""
    return {**environment(**extra), **provenance()}


def na(value: float | None, fmt: str) -> str:
    """``value`` formatted with ``fmt`` for a table cell, "n/a" when there is none."""
    return "n/a" if value is None else format(value, fmt)


def range_noise_pct(values: list[float]) -> float | None:
    """Run-to-run noise of repeated measurements: (max - min) / mean in % (with two: their difference
    over their mean); None with fewer than two."""
    if len(values) < 2:
        return None
    return 100.0 * (max(values) - min(values)) / statistics.fmean(values)


def precision_counts(precision: dict[str, str]) -> str:
    """A plan's layers by precision, as "5 bf16, 2 int8" ("recorded" for no layer moved)."""
    counts: dict[str, int] = {}
    for p in precision.values():
        counts[p] = counts.get(p, 0) + 1
    return ", ".join(f"{n} {p}" for p, n in sorted(counts.items())) or "recorded"


def max_present(values: list[float | None]) -> float | None:
    """The largest of ``values`` that are not None; None if none is."""
    present = [v for v in values if v is not None]
    return max(present) if present else None


def profiler_share(traces: list[Trace], measured_ms: float | None) -> dict[str, float | None]:
    """What recording added to a recorded step (slowest rank's figures,
    `event_costs.calibrate_on_steps`) and the prediction with the calibration loops' per-event costs
    alone (the share measured on the run's steps left out, and taken out of ``traces``): its signed
    error shows the lean that the run's own steps remove, and it is the recorded configuration's
    prediction out of sample."""
    shares = [t.measured.get("profiler_share") or {} for t in traces]
    for trace in traces:
        trace.measured.pop("profiler_share", None)
    loops_only = predict(traces).step_ms
    return {
        "recording_added_ms": max_present([share.get("in_step_ms") for share in shares]),
        "loops_share_ms": max_present([share.get("loops_share_ms") for share in shares]),
        "loops_only_step_ms": loops_only,
        "loops_only_error_pct": 100.0 * (loops_only - measured_ms) / measured_ms if measured_ms else None,
    }


def priced_without(traces: list[Trace], plan: Plan, keys: set[str]) -> Prediction:
    """``plan`` priced on copies of ``traces`` whose probe tables lack ``keys`` (the figures the
    product calibrates on, to show what they change)."""
    copies = [Trace.from_dict(trace.to_dict(), source="copy") for trace in traces]
    for trace in copies:  # a copy shares its dicts with the trace: the table is replaced, not edited
        table = {k: v for k, v in op_type_table(trace).items() if k not in keys}
        trace.precision_costs = {**trace.precision_costs, OP_TYPE_COSTS: table}
    return Predictor(copies).predict(plan)
