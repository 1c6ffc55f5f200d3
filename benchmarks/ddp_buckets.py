"""DDP's gradient buckets on 2 processes: the planner's candidates predicted against measured, and
the chosen buckets against DDP's default.

For each model: one recording under DDP (2 CPU processes, gloo) with ``QSyncCallback(mode="report",
levers=("buckets",))`` and DDP's default buckets. From its traces, `planner.ddp_buckets.choose_buckets`
prices its candidates (DDP's own assignment at several caps, one bucket, the partition that ends the
last all-reduce soonest). Then the recorded buckets and every candidate run ``--repeats`` times each,
interleaved, in fresh processes with ``QSyncCallback(mode="report", plan=...)``: the plan applied at
step 0 by re-wrapping DDP (`appliers/torch_ddp_buckets.py`), recorded, and its measured step time
(the median of the unprofiled steps after the window, on the slowest rank) set against the
prediction made from the recording. The recorded buckets' spread over their runs is the noise each
error and each difference is judged against.

    python benchmarks/ddp_buckets.py [--models mlp,attention,resnet] [--repeats 2] [--quick]
        [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from models import get_model, timed_fit
from runs import bench_environment, na, range_noise_pct, run_report, say_allocator, write_results

from qsync_callback.mean_band import change_pct
from qsync_callback.plan import Plan
from qsync_callback.planner.ddp_buckets import RECORDED, choose_buckets
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.torch_recorder import window_close_step
from qsync_callback.recorder.trace import load_trace_dir

WARMUP_STEPS, PROFILE_STEPS, MEASURE_STEPS = 10, 5, 10
MAX_STEPS = window_close_step(WARMUP_STEPS, PROFILE_STEPS) + MEASURE_STEPS + 3
PROCS = 2


def run_worker(model: str, run_dir: Path, plan: Path | None) -> None:
    """One training run on 2 processes (in a subprocess): the recording, or one plan."""
    from qsync_callback.integrations.lightning import QSyncCallback

    callback = QSyncCallback(
        mode="report",
        warmup_steps=WARMUP_STEPS,
        profile_steps=PROFILE_STEPS,
        measure_steps=MEASURE_STEPS,
        output_dir=run_dir,
        levers=("buckets",),
        plan=plan,
        plan_cache=False,
    )
    timed_fit(get_model(model), MAX_STEPS, [callback], PROCS)


def bench_model(model: str, repeats: int, out: Path, timeout: float) -> list[dict[str, Any]]:
    script = Path(__file__).resolve()
    record_dir = out / "runs" / f"{model}-record"
    if run_report(script, ["--worker", model], record_dir, timeout) is None:
        return [{"model": model, "failed": "the recording"}]
    traces = load_trace_dir(record_dir / "trace")
    predictor = Predictor(traces)
    choice = choose_buckets(predictor)
    chosen = choice.chosen.name if choice.chosen is not None else RECORDED
    files: dict[str, Path | None] = {RECORDED: None}
    for candidate in choice.candidates:
        path = out / "runs" / f"{model}-plans" / f"{len(files)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        plan = Plan(fingerprint=traces[0].fingerprint, buckets=candidate.buckets)
        path.write_text(json.dumps(plan.to_dict()))
        files[candidate.name] = path
    measured: dict[str, list[float]] = {name: [] for name in files}
    for r in range(repeats):
        for k, (name, path) in enumerate(files.items()):
            args = ["--worker", model] + (["--worker-plan", str(path)] if path else [])
            result = run_report(script, args, out / "runs" / f"{model}-{k}-{r}", timeout)
            if result is not None:
                measured[name].append(result["step_ms"])
    rows = []
    for candidate in [choice.recorded, *choice.candidates]:
        steps = measured[candidate.name]
        median = statistics.median(steps) if steps else None
        # priced on every recorded step (the planner ranks on the typical one)
        plan = Plan(fingerprint=traces[0].fingerprint, buckets=candidate.buckets)
        predicted = predictor.predict(plan).step_ms
        rows.append(
            {
                "model": model,
                "candidate": candidate.name,
                "chosen": candidate.name == chosen,
                "bucket_mib": [round(b / 2**20, 2) for b in candidate.bucket_bytes],
                "predicted_ms": predicted,
                "exposed_ms": candidate.prediction.exposed_comm_ms,
                "measured_ms": steps,
                "median_ms": median,
                "error_pct": change_pct(predicted, median),
                "noise_pct": range_noise_pct(steps),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """One row per candidate: its prediction and measurement, the error (signed: predicted less
    measured), the spread of its runs, and its change against the recorded buckets, predicted and
    measured."""
    lines = [
        "| model | candidate | buckets (MiB) | predicted ms | measured ms (runs) | error | noise | "
        "vs recorded: predicted | measured | chosen |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    base: dict[str, float | None] = {}
    predicted_base: dict[str, float] = {}
    for row in rows:
        if "failed" in row:
            lines.append(f"| {row['model']} | failed: {row['failed']} | | | | | | | | |")
            continue
        if row["candidate"] == RECORDED:
            base[row["model"]] = row["median_ms"]
            predicted_base[row["model"]] = row["predicted_ms"]
        sizes = ", ".join(f"{s:g}" for s in row["bucket_mib"][:5]) + (
            ", ..." if len(row["bucket_mib"]) > 5 else ""
        )
        runs = ", ".join(f"{m:.1f}" for m in row["measured_ms"])
        against = base.get(row["model"])
        versus = change_pct(row["median_ms"], against) if against and row["median_ms"] else None
        predicted_change = change_pct(row["predicted_ms"], predicted_base[row["model"]])
        lines.append(
            f"| {row['model']} | {row['candidate']} | {len(row['bucket_mib'])}: {sizes} | "
            f"{row['predicted_ms']:.1f} | "
            f"{na(row['median_ms'], '.1f')} ({runs}) | {na(row['error_pct'], '+.1f')}% | "
            f"{na(row['noise_pct'], '.1f')}% | {na(predicted_change, '+.1f')}% | {na(versus, '+.1f')}% | "
            f"{'yes' if row['chosen'] else ''} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,attention,resnet")
    parser.add_argument("--repeats", type=int, default=2, help="runs per candidate")
    parser.add_argument("--quick", action="store_true", help="smoke run: mlp, 1 run per candidate")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-plan", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker, args.worker_dir, args.worker_plan)
        return 0
    say_allocator()
    models, repeats = (["mlp"], 1) if args.quick else (args.models.split(","), args.repeats)
    environment = bench_environment(procs=PROCS, repeats=repeats)
    rows = [row for model in models for row in bench_model(model, repeats, args.out, args.timeout)]
    write_results(args.out, "ddp_buckets", table(rows), {"environment": environment, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
