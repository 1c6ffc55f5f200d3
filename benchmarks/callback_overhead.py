"""What QSyncCallback costs per step when it is not recording (after it has finished).

Runs a short real ``Trainer.fit`` of the MLP with the callback (warmup 2, profile 1, measure 1) and a
step timer, then calls the finished callback's ``on_train_batch_start`` a few thousand times and
compares the per-call cost with the MLP's median step time (steps after the callback finished).
Writes ``<out>/callback_overhead.md`` and ``.json`` (with the environment). Runs with glibc malloc,
as users do, unless ``QSYNC_BENCH_TCMALLOC=1`` (then it restarts itself with tcmalloc preloaded).
``--quick``: a smoke pass, 5 steps after the callback and 3 blocks of 1000 calls.

    python benchmarks/callback_overhead.py [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from models import get_model, timed_fit
from runs import TCMALLOC, bench_environment, say_allocator, subprocess_env, tcmalloc_requested, write_results

from qsync_callback.integrations.lightning import QSyncCallback
from qsync_callback.recorder.torch_recorder import window_close_step

WARMUP, PROFILE, MEASURE = 2, 1, 1
STEPS_AFTER = 30  # timed steps after the callback has finished
CALLS, BLOCKS = 5000, 7
QUICK_STEPS_AFTER, QUICK_CALLS, QUICK_BLOCKS = 5, 1000, 3


def _reexec_with_tcmalloc() -> None:
    """Restart this script, once, with tcmalloc preloaded when `runs.tcmalloc_requested` (as
    ``runs.launch`` starts the other benchmarks' runs); else run on, with glibc malloc."""
    if not tcmalloc_requested() or str(TCMALLOC) in os.environ.get("LD_PRELOAD", "").split(":"):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], subprocess_env())


def allocator() -> str:
    """ "tcmalloc" if it is loaded in this process, else "glibc malloc"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return "tcmalloc" if "libtcmalloc" in maps else "glibc malloc"


def time_call(fn: Callable[[], Any], calls: int = CALLS, blocks: int = BLOCKS) -> float:
    """Per-call cost of ``fn`` in microseconds: the median over ``blocks`` blocks of ``calls`` calls."""
    per_call = []
    for _ in range(blocks):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter_ns() - start) / calls / 1e3)
    return statistics.median(per_call)


def measure(
    out: Path, steps_after: int = STEPS_AFTER, calls: int = CALLS, blocks: int = BLOCKS
) -> dict[str, Any]:
    """Fit the MLP with the callback, then time the finished callback's per-step hook (``blocks``
    blocks of ``calls`` calls) and the ``steps_after`` steps after it finished."""
    callback = QSyncCallback(
        mode="report",
        warmup_steps=WARMUP,
        profile_steps=PROFILE,
        measure_steps=MEASURE,
        output_dir=out / "callback_overhead_run",
    )
    # 0-based step at whose start the callback finishes: MEASURE steps after the window closes
    finished_at = window_close_step(WARMUP, PROFILE) + MEASURE
    trainer, timer, module, loader = timed_fit(get_model("mlp"), finished_at + 1 + steps_after, [callback])
    if callback.report is None:
        raise SystemExit("the callback produced no report; see the warnings above")

    # timer.step_ms[i] is step i's duration (the timer runs after the callback, so the report's work
    # falls in step finished_at - 1); keep the steps from finished_at on.
    after = timer.step_ms[finished_at:]
    step_ms = statistics.median(after)
    batch = next(iter(loader))
    qsync_us = time_call(lambda: callback.on_train_batch_start(trainer, module, batch, 0), calls, blocks)
    bare = pl.Callback()
    bare_us = time_call(lambda: bare.on_train_batch_start(trainer, module, batch, 0), calls, blocks)
    return {
        "calls": calls,
        "blocks": blocks,
        "step_ms": step_ms,
        "steps_timed": len(after),
        "hook_us": qsync_us,
        "bare_hook_us": bare_us,
        "hook_pct_of_step": 100.0 * qsync_us / (step_ms * 1e3),
        "extra_us": qsync_us - bare_us,
        "allocator": allocator(),
    }


def markdown(r: dict[str, Any]) -> str:
    """The result as a short markdown table."""
    return "\n".join(
        [
            "| quantity | value |",
            "|---|---:|",
            f"| MLP median step (callback finished, {r['steps_timed']} steps) | {r['step_ms']:.2f} ms |",
            f"| finished QSyncCallback.on_train_batch_start per step | {r['hook_us']:.3f} us |",
            f"| same, as % of a step | {r['hook_pct_of_step']:.5f} % |",
            f"| a bare pl.Callback.on_train_batch_start, for reference | {r['bare_hook_us']:.3f} us |",
            f"| difference to the bare hook | {r['extra_us']:.3f} us |",
            "",
            f"Hook cost: median over {r['blocks']} blocks of {r['calls']} calls on the finished "
            f"callback of a real Trainer.fit (warmup {WARMUP}, profile {PROFILE}, measure {MEASURE}); "
            f"allocator: {r['allocator']}.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Measure, print and write ``<out>/callback_overhead.md`` and ``.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke pass: 5 steps, 3 blocks of 1000 calls")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    say_allocator()
    settings = {"warmup": WARMUP, "profile": PROFILE, "measure": MEASURE, "quick": args.quick}
    env = bench_environment(**settings)
    if args.quick:
        result = measure(args.out, QUICK_STEPS_AFTER, QUICK_CALLS, QUICK_BLOCKS)
    else:
        result = measure(args.out)
    write_results(args.out, "callback_overhead", markdown(result), {"environment": env, **result})
    print(
        f"\nper-step cost when not recording: {result['hook_us']:.3f} us "
        f"= {result['hook_pct_of_step']:.5f}% of a {result['step_ms']:.1f} ms step"
    )
    return 0


if __name__ == "__main__":
    _reexec_with_tcmalloc()
    sys.exit(main())
