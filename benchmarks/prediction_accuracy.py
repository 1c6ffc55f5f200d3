"""Predictor accuracy and recorder overhead of QSyncCallback on real Lightning runs.

For each model and process count, runs ``Trainer.fit`` in a fresh subprocess with
``QSyncCallback(mode="report")``, repeated ``--repeats`` times, then reads each run's report.json
and rank traces and writes a markdown table (``<out>/prediction_accuracy.md``) and the raw rows
(``<out>/prediction_accuracy.json``). Exits non-zero if any run produced no report.

    python benchmarks/prediction_accuracy.py [--models mlp,cnn,transformer] [--procs 1,2]
        [--repeats 3] [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from models import MODELS, get_model, timed_fit
from runs import (
    bench_environment,
    launch,
    max_present,
    na,
    profiler_share,
    range_noise_pct,
    say_allocator,
    stderr_tail,
    write_results,
)

from qsync_callback.recorder.torch_recorder import window_close_step
from qsync_callback.recorder.trace import load_trace_dir

WARMUP_STEPS = 10
PROFILE_STEPS = 5
MEASURE_STEPS = 10  # the callback's defaults: warm-up 10, profile 5, measure 10
# The callback closes the window at the boundary after the last recorded step and reports
# MEASURE_STEPS later, so the run needs one step more than that.
CLOSE_STEP = window_close_step(WARMUP_STEPS, PROFILE_STEPS)
MAX_STEPS = CLOSE_STEP + MEASURE_STEPS + 1 + 2
TARGET_PCT = 5.0
STEP_TIMES_DIR = "step_times"  # per-rank wall time of every step, from the worker's own timer
# 0-based steps whose time holds the recording's work. The benchmark's timer runs after the callback
# at each on_train_batch_start, so work done at boundary b is timed in step b - 1: calibration
# (boundary WARMUP - 2), the profiled warm-up step, the recorded steps, the session ends and the
# window's closing (boundary CLOSE_STEP)...
COST_STEPS = list(range(WARMUP_STEPS - 3, CLOSE_STEP))
# ... and rank 0's prediction and report (boundary CLOSE_STEP + MEASURE_STEPS).
REPORT_STEP = CLOSE_STEP + MEASURE_STEPS - 1
# Unprofiled steps before the window that carry no recorder work (not step 0: cold), from the step
# timer: if the measured median is well above their median, the recording left the run slower
# than it was when profiled.
PRE_WINDOW_STEPS = list(range(1, WARMUP_STEPS - 3))


# ----------------------------------------------------------------------------- the worker


def run_worker(model: str, procs: int, run_dir: Path) -> None:
    """One training run with the callback (executed in a subprocess; Lightning's DDP launcher
    re-executes this same command line for rank 1)."""
    from qsync_callback.integrations.lightning import QSyncCallback

    callback = QSyncCallback(
        mode="report",
        warmup_steps=WARMUP_STEPS,
        profile_steps=PROFILE_STEPS,
        measure_steps=MEASURE_STEPS,
        output_dir=run_dir,
    )
    trainer, timer, _, _ = timed_fit(get_model(model), MAX_STEPS, [callback], procs)
    path = run_dir / STEP_TIMES_DIR / f"rank{trainer.global_rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(timer.step_ms))


# ----------------------------------------------------------------------------- the driver


def launch_run(model: str, procs: int, run_dir: Path, timeout_s: float) -> tuple[int, float]:
    """One training run of ``model`` on ``procs`` processes in a fresh subprocess."""
    args = ["--worker", model, "--worker-procs", str(procs), "--worker-dir", str(run_dir.resolve())]
    return launch(Path(__file__).resolve(), args, run_dir, timeout_s)


def rank_costs(trace: dict[str, Any], step_ms: list[float] | None) -> dict[str, float | None]:
    """One rank's costs in seconds: the recorder's own overhead (outside the profiled steps); the
    extra time of the profiled steps over the unprofiled median; that of the profiled, unrecorded
    warm-up step (from the clock-sync mark to the first recorded step); and, from the worker's step
    timer, the total extra time of every step that carried the callback's work (``COST_STEPS`` and
    ``REPORT_STEP``); plus the median time (ms) of the clean steps before the window."""
    measured = trace.get("measured", {})
    samples = measured.get("step_ms") or []
    steps = trace.get("steps") or []
    costs: dict[str, float | None] = {
        "recorder_overhead_s": measured.get("recorder_overhead_s"),
        "profiled_extra_s": None,
        "warmup_extra_s": None,
        "total_cost_s": None,
        "pre_window_step_ms": None,
    }
    if not samples:
        return costs
    median_ms = statistics.median(samples)
    if steps:
        costs["profiled_extra_s"] = sum((s["end_us"] - s["start_us"]) / 1e3 - median_ms for s in steps) / 1e3
        sync_us = -float(trace.get("clock_offset_us") or 0.0)  # the recorder stores -(clock-sync mark)
        if sync_us:
            first = min(s["start_us"] for s in steps)
            costs["warmup_extra_s"] = ((first - sync_us) / 1e3 - median_ms) / 1e3
    if step_ms and len(step_ms) > max(*COST_STEPS, REPORT_STEP):
        costs["total_cost_s"] = sum(step_ms[i] - median_ms for i in [*COST_STEPS, REPORT_STEP]) / 1e3
    if step_ms and len(step_ms) > PRE_WINDOW_STEPS[-1]:
        costs["pre_window_step_ms"] = statistics.median(step_ms[i] for i in PRE_WINDOW_STEPS)
    return costs


def read_row(model: str, procs: int, repeat: int, run_dir: Path, wall_s: float) -> dict[str, Any]:
    """One table row from a finished run's report.json and rank traces (slowest rank for costs)."""
    report = json.loads((run_dir / "report.json").read_text())
    measured, predicted, error = report["measured"], report["predicted"], report["error_pct"]
    per_rank, other = [], []
    for path in sorted((run_dir / "trace").glob("rank*/trace.json")):
        timer_path = run_dir / STEP_TIMES_DIR / f"{path.parent.name}.json"
        step_ms = json.loads(timer_path.read_text()) if timer_path.exists() else None
        trace = json.loads(path.read_text())
        per_rank.append(rank_costs(trace, step_ms))
        other.append(trace.get("resident_bytes", {}).get("other"))
    keys = ("recorder_overhead_s", "profiled_extra_s", "warmup_extra_s", "total_cost_s", "pre_window_step_ms")
    costs = {key: max_present([c[key] for c in per_rank]) for key in keys}
    return {
        **profiler_share(load_trace_dir(run_dir / "trace"), measured.get("step_ms")),
        "model": model,
        "procs": procs,
        "repeat": repeat,
        "measured_step_ms": measured.get("step_ms"),
        "step_ms_spread_pct": measured.get("step_ms_spread_pct"),
        "step_ms_samples": measured.get("step_ms_samples"),
        "predicted_step_ms": predicted.get("step_ms"),
        "step_error_pct": error.get("step_ms"),
        "measured_peak_bytes": measured.get("peak_bytes"),
        "predicted_peak_bytes": predicted.get("peak_bytes"),
        "peak_error_pct": error.get("peak_bytes"),
        "peak_source": measured.get("peak_source"),
        "other_resident_bytes": max_present(other),
        **costs,
        "ranks_traced": len(per_rank),
        "wall_s": wall_s,
        "run_dir": str(run_dir),
    }


def noise_floor(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, procs): run-to-run noise of the measured median, (max - min) / mean over repeats in
    % (with two repeats: |median 1 - median 2| / mean), and the signed step-time errors of the
    repeats with their median |error| (a predictor without bias has signed errors on both sides)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        if row["measured_step_ms"] is not None and row["predicted_step_ms"] is not None:
            groups.setdefault((row["model"], row["procs"]), []).append(row)
    out = []
    for (model, procs), group in groups.items():
        medians = [r["measured_step_ms"] for r in group]
        signed = [
            100.0 * (r["predicted_step_ms"] - r["measured_step_ms"]) / r["measured_step_ms"] for r in group
        ]
        loops_only = [r["loops_only_error_pct"] for r in group if r.get("loops_only_error_pct") is not None]
        noise = range_noise_pct(medians)
        out.append(
            {
                "model": model,
                "procs": procs,
                "medians_ms": medians,
                "noise_pct": noise,
                "signed_errors_pct": signed,
                "median_abs_error_pct": statistics.median(map(abs, signed)),
                "loops_only_errors_pct": loops_only,
                "loops_only_mean_error_pct": statistics.fmean(loops_only) if loops_only else None,
            }
        )
    return out


def _mib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _meets(value: float | None) -> bool:
    return value is not None and value <= TARGET_PCT


def summary_line(rows: list[dict[str, Any]]) -> str:
    """How many rows meet the step-time and memory targets."""
    n = len(rows)
    step_ok = sum(_meets(r["step_error_pct"]) for r in rows)
    peak_ok = sum(_meets(r["peak_error_pct"]) for r in rows)
    return (
        f"step time within {TARGET_PCT:g}%: {step_ok}/{n} rows; "
        f"peak memory within {TARGET_PCT:g}%: {peak_ok}/{n} rows"
    )


def markdown(rows: list[dict[str, Any]], noise: list[dict[str, Any]], failures: list[str]) -> str:
    """The results as markdown: the accuracy table, the noise floor and the summary line."""
    lines = [
        "| model | procs | repeat | measured ms | spread % | predicted ms | step err % | "
        "measured MiB | predicted MiB | mem err % | other MiB | recording added ms | loops' share ms | "
        "recorder overhead s | profiled extra s | total cost s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['procs']} | {r['repeat']} | {na(r['measured_step_ms'], '.2f')} | "
            f"{na(r['step_ms_spread_pct'], '.1f')} | {na(r['predicted_step_ms'], '.2f')} | "
            f"{na(r['step_error_pct'], '.1f')} | {_mib(r['measured_peak_bytes'])} | "
            f"{_mib(r['predicted_peak_bytes'])} | {na(r['peak_error_pct'], '.1f')} | "
            f"{_mib(r['other_resident_bytes'])} | {na(r.get('recording_added_ms'), '.2f')} | "
            f"{na(r.get('loops_share_ms'), '.2f')} | {na(r['recorder_overhead_s'], '.2f')} | "
            f"{na(r['profiled_extra_s'], '.3f')} | {na(r['total_cost_s'], '.2f')} |"
        )
    lines += ["", "Per model and process count, over the repeats:", ""]
    lines += [
        "| model | procs | measured medians ms | run-to-run noise % | signed step errors % "
        "| median abs error % | signed errors, loops' costs only % | their mean % |",
        "|---|---:|---|---:|---|---:|---|---:|",
    ]
    for g in noise:
        medians = ", ".join(f"{m:.2f}" for m in g["medians_ms"])
        signed = ", ".join(f"{e:+.1f}" for e in g["signed_errors_pct"])
        loops_only = ", ".join(f"{e:+.1f}" for e in g["loops_only_errors_pct"])
        lines.append(
            f"| {g['model']} | {g['procs']} | {medians} | {na(g['noise_pct'], '.1f')} | {signed} | "
            f"{g['median_abs_error_pct']:.1f} | {loops_only} | {na(g['loops_only_mean_error_pct'], '+.1f')} |"
        )
    within = sum(_meets(g["median_abs_error_pct"]) for g in noise)
    lines += ["", summary_line(rows) + f"; median over repeats within {TARGET_PCT:g}%: {within}/{len(noise)}"]
    for procs in sorted({g["procs"] for g in noise}):
        judged = [g for g in noise if g["procs"] == procs and g["noise_pct"] is not None]
        in_noise = sum(g["median_abs_error_pct"] <= g["noise_pct"] for g in judged)
        lines.append(
            f"{procs} process{'es' if procs > 1 else ''}: median |error| within the run-to-run noise for "
            f"{in_noise} of {len(judged)} models."
        )
    if failures:
        lines += ["", f"FAILED runs (no report): {', '.join(failures)}"]
    lines += [
        "",
        "Columns: measured = median of the run's unprofiled steps (before the window, between the "
        f"recorded steps and {MEASURE_STEPS} after; slowest rank); spread = "
        "(p90 - p10) / median within the run; err = |predicted - measured| / measured; measured MiB = "
        "the trace's measured peak (largest rank; on CPU the live tensors at each recorded step's start "
        "plus the rise of the allocator's 'Total Allocated' counter within it, see the report's "
        "peak_source); other = resident tensors that are neither parameters, buffers, gradients, "
        "optimizer state nor DDP buckets (the data set, the batches; largest rank); recorder overhead = "
        "time the recorder spent outside the profiled steps (slowest rank); profiled extra = sum over the "
        f"{PROFILE_STEPS} profiled steps of (step - unprofiled median) (slowest rank); total cost = "
        "sum of (step - unprofiled median) over every step that carried the callback's work (calibration, "
        "the profiled warm-up step, the profiled steps, closing the window, the report), from the "
        "benchmark's own step timer (slowest rank). Negative extras mean noise larger than the cost. "
        "recording added = the recorded steps' median less the unprofiled steps' median; loops' share = "
        "what the calibration loops' per-event costs account for (slowest rank). The prediction removes "
        "what recording added as measured on the run's own steps (`event_costs.calibrate_on_steps`), so for "
        "the configuration recorded its error checks the replay, not the profiler's cost: it is close to "
        "0 by construction. 'loops' costs only' is the prediction without that calibration: its signed "
        "errors show the lean the run's own steps remove. Accuracy proper is judged on plans "
        "(precision_plans.py).",
    ]
    return "\n".join(lines) + "\n"


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with --worker, one training run); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    parser.add_argument("--procs", default="1,2", help="comma-separated process counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: mlp, 1 process, 1 repeat")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-procs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        run_worker(args.worker, args.worker_procs, args.worker_dir)
        return 0

    models, procs_list, repeats = _csv(args.models), [int(p) for p in _csv(args.procs)], args.repeats
    if args.quick:
        models, procs_list, repeats = ["mlp"], [1], 1
    for name in models:
        get_model(name)  # fail fast on a bad name
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = bench_environment(
        steps={"warmup": WARMUP_STEPS, "profile": PROFILE_STEPS, "measure": MEASURE_STEPS, "max": MAX_STEPS}
    )
    say_allocator()

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    # repeats outermost: a model's launches are minutes apart, so their spread is the run-to-run noise
    # a user's next launch would see, not a few seconds' drift
    for repeat in range(1, repeats + 1):
        for model in models:
            for procs in procs_list:
                label = f"{model}-p{procs}-r{repeat}"
                run_dir = out / "runs" / label
                print(f"[benchmark] {label} ...", file=sys.stderr, flush=True)
                rc, wall_s = launch_run(model, procs, run_dir, args.timeout)
                if (run_dir / "report.json").exists():
                    rows.append(read_row(model, procs, repeat, run_dir, wall_s))
                    if rc != 0:
                        print(
                            f"[benchmark] {label}: exit code {rc} after writing its report", file=sys.stderr
                        )
                    print(f"[benchmark] {label} done in {wall_s:.0f} s", file=sys.stderr, flush=True)
                else:
                    failures.append(label)
                    print(
                        f"[benchmark] {label} FAILED (exit code {rc}, no report.json); stderr tail:\n"
                        f"{stderr_tail(run_dir)}",
                        file=sys.stderr,
                        flush=True,
                    )

    noise = noise_floor(rows)
    raw = {
        "environment": env,
        "rows": rows,
        "noise": noise,
        "failures": failures,
        "summary": summary_line(rows),
    }
    write_results(out, "prediction_accuracy", markdown(rows, noise, failures), raw)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
