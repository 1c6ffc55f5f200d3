"""Precision plans, predicted against measured, on real Lightning runs; and the greedy allocator's
gap to the exact search.

For each model: ``--recordings`` recording runs with ``QSyncCallback(mode="apply")`` (each probes
every layer at every precision and gathers the indicator's statistics; planning with no constraint
keeps fp32, so nothing is applied). From the first one's traces the planner picks a set of plans:
every layer at fp32 (through the LP modules), each uniform low precision (where a layer runs it),
the allocator's choice for speed (its default target) and for a memory budget halfway between the
recorded peak and the least any plan reaches, and two random mixed plans. Each plan then runs in a
fresh process with ``QSyncCallback(mode="report", plan=...)``: applied at step 0 and recorded, so
its measured step time (median of the unprofiled steps; with ``--repeats N``, the median over N
runs of that) and peak memory can be set against the prediction made from the fp32 recordings (the
median over them: one recording carries the machine's speed at the time it ran, as one measured
run does). Recordings and plan runs go in rounds (recording k, then every plan's run k), and each
step error stands beside the run-to-run noise of the recordings and of the plan's runs ((max -
min) / mean of their medians, combined): one process runs steadily faster or slower than the
next on a shared VM, and an error within that noise says nothing more precise. Finally the exact
search prices every combination (when there are at most ``--exact-limit``) and the greedy's summed
indicator is compared with the optimum under the same constraints.

On one process, each round also runs every plan in turns with the recorded configuration in one
more fresh process (`plan_turns.py`): the plan's change against the recorded configuration,
measured with no drift between processes in it, against the change predicted (the plan's predicted
step over the recorded configuration's, the median over the recordings).

    python benchmarks/precision_plans.py [--models mlp,cnn,...] [--procs 1,2] [--precisions fp32,bf16,int8]
        [--plans uniform,speed] [--repeats 2] [--recordings 2] [--quick]
        [--out benchmarks/results]

``--procs 2`` records and runs every plan under Lightning DDP with 2 CPU processes (gloo).

fp16 is left out by default: this project's CPU has no fast fp16 matmul, and an fp16 plan's runs
would take most of the benchmark's time; pass it in ``--precisions`` to include it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from models import MODELS, get_model, timed_fit
from plan_turns import TURN_ROUNDS, measure_in_turns, turns_cell, turns_worker
from runs import (
    bench_environment,
    launch,
    na,
    precision_counts,
    range_noise_pct,
    run_report,
    say_allocator,
    stderr_tail,
    write_results,
)

from qsync_callback.mean_band import change_pct, combined_noise_pct
from qsync_callback.plan import FULL_PRECISION, Plan
from qsync_callback.planner.precision import (
    allocate_precision,
    candidate_precisions,
    exact_precision,
    least_memory_plan,
)
from qsync_callback.predictor.indicator import sensitivity
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.torch_recorder import window_close_step
from qsync_callback.recorder.trace import load_trace_dir

WARMUP_STEPS, PROFILE_STEPS, MEASURE_STEPS = 10, 5, 10
MAX_STEPS = window_close_step(WARMUP_STEPS, PROFILE_STEPS) + MEASURE_STEPS + 3
TARGET_PCT = 5.0
RANDOM_PLANS = 2
PLAN_KINDS = ("fp32", "uniform", "speed", "memory", "random")


def run_worker(
    model: str, procs: int, run_dir: Path, mode: str, plan: Path | None, precisions: list[str]
) -> None:
    """One training run (in a subprocess): the recording (mode "apply") or one plan (mode "report")."""
    from qsync_callback.integrations.lightning import QSyncCallback

    callback = QSyncCallback(
        mode=mode,
        warmup_steps=WARMUP_STEPS,
        profile_steps=PROFILE_STEPS,
        measure_steps=MEASURE_STEPS,
        output_dir=run_dir,
        precisions=precisions,
        max_step_time=1e6 if mode == "apply" else None,  # plan nothing: this run only records
        plan=plan,
        plan_cache=False,
    )
    timed_fit(get_model(model), MAX_STEPS, [callback], procs)


def _random_plan(candidates: dict[str, list[str]], seed: int) -> dict[str, str]:
    rng = random.Random(seed)
    return {name: rng.choice(options) for name, options in candidates.items()}


def candidate_plans(
    predictor: Predictor, precisions: list[str], kinds: tuple[str, ...] = PLAN_KINDS
) -> list[tuple[str, dict[str, str]]]:
    """The plans to measure, by name (layer -> precision), of the ``kinds`` asked (`PLAN_KINDS`)."""
    candidates = candidate_precisions(predictor, precisions)
    indicator = sensitivity(predictor.traces[0].layer_statistics, precisions)
    plans = []
    if "fp32" in kinds:
        plans.append(("fp32 (LP modules)", {name: FULL_PRECISION for name in candidates}))
    for p in precisions:
        if p != FULL_PRECISION and "uniform" in kinds:
            uniform = {name: p for name, options in candidates.items() if p in options}
            if uniform:
                plans.append((f"{p} where it runs", uniform))
    if "speed" in kinds:
        speed = allocate_precision(predictor, indicator, precisions)
        plans.append(("allocator: speed (fastest + 5%)", speed.plan.precision))
    if "memory" in kinds:
        plans += _memory_plan(predictor, indicator, precisions)
    if "random" in kinds:
        plans += [(f"random mixed {i + 1}", _random_plan(candidates, seed=i)) for i in range(RANDOM_PLANS)]
    return plans


def _memory_plan(
    predictor: Predictor, indicator: dict, precisions: list[str]
) -> list[tuple[str, dict[str, str]]]:
    """The allocator's plan for a budget halfway between the recorded peak and the least any plan
    reaches (none if no plan lowers the peak)."""
    recorded = predictor.predict().peak_bytes
    least = least_memory_plan(predictor, precisions)[1].peak_bytes
    if least >= recorded:
        print("[benchmark] no plan lowers the predicted peak: no memory plan", file=sys.stderr)
        return []
    budget = (least + recorded) // 2
    memory = allocate_precision(predictor, indicator, precisions, memory_budget=budget)
    return [(f"allocator: memory <= {budget / recorded:.1%} of recorded", memory.plan.precision)]


def greedy_gap(predictor: Predictor, precisions: list[str], limit: int) -> dict[str, Any]:
    """The greedy's summed indicator against the exact search's, for the speed target."""
    indicator = sensitivity(predictor.traces[0].layer_statistics, precisions)
    candidates = candidate_precisions(predictor, precisions)
    combos = math.prod(len(options) for options in candidates.values())
    greedy = allocate_precision(predictor, indicator, precisions)
    row: dict[str, Any] = {
        "combinations": combos,
        "greedy_indicator": greedy.indicator,
        "greedy_plans_priced": greedy.plans_priced,
        "target_step_ms": greedy.target_step_ms,
    }
    if combos > limit:
        row["exact_indicator"] = None
        return row
    exact = exact_precision(
        predictor, indicator, precisions, max_step_ms=greedy.target_step_ms, max_plans=limit
    )
    row.update(
        exact_indicator=exact.indicator, exact_plans_priced=exact.plans_priced, exact_feasible=exact.feasible
    )
    return row


def _record(script: Path, common: list[str], run_dir: Path, timeout: float) -> None:
    """One recording run (mode "apply", nothing planned); raises if it wrote no report."""
    rc, _ = launch(
        script, [*common, "--worker-dir", str(run_dir), "--worker-mode", "apply"], run_dir, timeout
    )
    if rc != 0 or not (run_dir / "report.json").exists():
        raise RuntimeError(f"recording {run_dir.name} failed (exit {rc}):\n{stderr_tail(run_dir)}")


def measure_plans(
    model: str,
    procs: int,
    out: Path,
    precisions: list[str],
    kinds: tuple[str, ...],
    timeout: float,
    limit: int,
    repeats: int,
    recordings: int,
) -> dict[str, Any]:
    """Record ``model`` on ``procs`` processes ``recordings`` times and run every candidate plan of
    ``kinds`` (chosen on the first recording) ``repeats`` times, in rounds (round k: recording k,
    then every plan's run k), so that a slow stretch of the machine falls on recordings and plan
    runs alike; compare the median of the runs' measured step times (and their largest peak) with
    the median of the predictions made from each recording, beside the run-to-run noise of both
    (`runs.range_noise_pct`, combined as verify combines two medians' noise); returns the rows."""
    script = Path(__file__).resolve()
    common = ["--worker", model, "--worker-procs", str(procs), "--precisions", ",".join(precisions)]
    label = f"{model}-p{procs}"
    runs_dir = out / "precision_runs"
    record_dirs = [runs_dir / f"{label}-record-r{k}" for k in range(recordings)]
    _record(script, common, record_dirs[0], timeout)
    first = Predictor(load_trace_dir(record_dirs[0] / "trace"))
    fingerprint = first.traces[0].fingerprint
    plans = candidate_plans(first, precisions, kinds)
    plan_files = [runs_dir / f"{label}-plan{i}.json" for i in range(len(plans))]
    for (_, precision), plan_file in zip(plans, plan_files, strict=True):
        Plan(fingerprint=fingerprint, precision=precision).save(plan_file)
    plan_runs: list[list[dict[str, Any]]] = [[] for _ in plans]
    turns: list[dict[str, Any]] = []
    for k in range(max(recordings, repeats)):
        if 0 < k < recordings:
            _record(script, common, record_dirs[k], timeout)
        if k >= repeats:
            continue
        for i, (name, _) in enumerate(plans):
            print(f"[benchmark] {label}: {name}, run {k + 1} of {repeats} ...", file=sys.stderr, flush=True)
            args = [*common, "--worker-mode", "report", "--worker-plan", str(plan_files[i])]
            run = run_report(script, args, runs_dir / f"{label}-plan{i}-r{k}", timeout)
            if run is not None:
                plan_runs[i].append(run)
        if procs == 1:  # in turns: one process, the loop's own comparison (plan_turns.py)
            files = {str(i): plan_file for i, plan_file in enumerate(plan_files)}
            turns.append(measure_in_turns(script, model, files, runs_dir / f"{label}-turns-r{k}", timeout))
    predictors = [first] + [Predictor(load_trace_dir(d / "trace")) for d in record_dirs[1:]]
    recorded_ms = [json.loads((d / "report.json").read_text())["measured"]["step_ms"] for d in record_dirs]
    recording_noise = range_noise_pct(recorded_ms)
    recorded_predicted = [p.predict().step_ms for p in predictors]
    rows = []
    for i, ((name, precision), runs) in enumerate(zip(plans, plan_runs, strict=True)):
        if not runs:
            rows.append({"plan": name, "precision": precision, "failed": True})
            continue
        predictions = [
            p.predict(Plan(fingerprint=p.traces[0].fingerprint, precision=precision)) for p in predictors
        ]
        changes = [
            change_pct(plan.step_ms, ms) for plan, ms in zip(predictions, recorded_predicted, strict=True)
        ]
        predicted_ms = statistics.median(p.step_ms for p in predictions)
        predicted_peak = statistics.median(p.peak_bytes for p in predictions)
        run_ms = [run["step_ms"] for run in runs]
        measured_ms = statistics.median(run_ms)
        measured_peak = max(run["peak_bytes"] for run in runs)
        run_noise = range_noise_pct(run_ms)
        rows.append(
            {
                "plan": name,
                "precision": precision,
                "predicted_step_ms": predicted_ms,
                "predicted_runs_ms": [p.step_ms for p in predictions],
                "measured_step_ms": measured_ms,
                "measured_runs_ms": run_ms,
                "measured_spread_pct": statistics.median(run["step_ms_spread_pct"] or 0.0 for run in runs),
                "noise_pct": None
                if recording_noise is None and run_noise is None
                else combined_noise_pct(recording_noise, run_noise),
                "step_error_pct": change_pct(predicted_ms, measured_ms),
                "predicted_peak_bytes": predicted_peak,
                "measured_peak_bytes": measured_peak,
                "peak_error_pct": change_pct(predicted_peak, measured_peak),
                "predicted_change_pct": statistics.median(changes),
                "in_turns": [each[str(i)] for each in turns if str(i) in each],
            }
        )
    return {
        "model": model,
        "procs": procs,
        "recorded_runs_ms": recorded_ms,
        "probe_s": first.traces[0].precision_costs.get("probe_s"),
        "rows": rows,
        "greedy_gap": greedy_gap(first, precisions, limit),
    }


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | procs | plan | layers | predicted ms (recordings) | measured ms (runs; spread in a run) | "
        "step error | run-to-run noise % | change in turns (predicted / measured +- noise) | "
        "predicted peak MiB | measured peak MiB | peak error |",
        "|---|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    step_errors, peak_errors, signed_errors, within_noise, with_noise = [], [], [], 0, 0
    turn_errors: dict[str, list[float]] = {}  # by model
    for result in results:
        for row in result["rows"]:
            layers = precision_counts(row["precision"])
            if row.get("failed"):
                cells = f"| {result['model']} | {result['procs']} | {row['plan']} | {layers} | FAILED "
                lines.append(cells + "| " * 7 + "|")
                continue
            step_errors.append(abs(row["step_error_pct"]))
            signed_errors.append(row["step_error_pct"])
            peak_errors.append(abs(row["peak_error_pct"]))
            noise = row.get("noise_pct")
            if noise is not None:
                with_noise += 1
                within_noise += abs(row["step_error_pct"]) <= noise
            in_turns, turn_error = turns_cell(row)
            if turn_error is not None:
                turn_errors.setdefault(result["model"], []).append(turn_error)
            lines.append(
                f"| {result['model']} | {result['procs']} | {row['plan']} | {layers} | "
                f"{row['predicted_step_ms']:.1f} "
                f"({', '.join(f'{ms:.0f}' for ms in row['predicted_runs_ms'])}) | "
                f"{row['measured_step_ms']:.1f} "
                f"({', '.join(f'{ms:.0f}' for ms in row['measured_runs_ms'])}; "
                f"{na(row['measured_spread_pct'], '.0f')}%) | {row['step_error_pct']:+.1f}% | "
                f"{na(noise, '.1f')} | {in_turns} | "
                f"{row['predicted_peak_bytes'] / 2**20:.1f} | {row['measured_peak_bytes'] / 2**20:.1f} | "
                f"{row['peak_error_pct']:+.1f}% |"
            )
    if step_errors:
        within_t = sum(e <= TARGET_PCT for e in step_errors)
        within_m = sum(e <= TARGET_PCT for e in peak_errors)
        lines += [
            "",
            f"Step time within {TARGET_PCT:.0f}%: {within_t} of {len(step_errors)} plans "
            f"(median |error| {statistics.median(step_errors):.1f}%); peak memory within {TARGET_PCT:.0f}%: "
            f"{within_m} of {len(peak_errors)} (median |error| {statistics.median(peak_errors):.1f}%).",
            f"Mean signed step error {statistics.fmean(signed_errors):+.1f}% "
            f"({sum(e < 0 for e in signed_errors)} under, {sum(e > 0 for e in signed_errors)} over); "
            "within the run-to-run noise (recordings' and plan runs' (max - min) / mean, combined): "
            f"{within_noise} of {with_noise} plans with two runs or more.",
        ]
    if turn_errors:
        every = [e for errors in turn_errors.values() for e in errors]
        per_model = ", ".join(
            f"{model} {statistics.median(abs(e) for e in errors):.1f}%"
            for model, errors in turn_errors.items()
        )
        lines.append(
            f"In turns (one process, each plan against the recorded configuration, {TURN_ROUNDS} rounds per "
            "process, `plan_turns.py`): the plan's step predicted against measured, both referred to the "
            f"recorded configuration's: median |error| {statistics.median(abs(e) for e in every):.1f}% over "
            f"{len(every)} plans (mean signed {statistics.fmean(every):+.1f}%); per model: {per_model}."
        )
    lines += [
        "",
        "| model | procs | combinations | greedy indicator | exact indicator | plans priced (greedy / exact) "
        "|",
    ]
    lines.append("|---|---:|---:|---:|---:|---|")
    for result in results:
        gap = result["greedy_gap"]
        lines.append(
            f"| {result['model']} | {result['procs']} | {gap['combinations']} | "
            f"{gap['greedy_indicator']:.3g} | "
            f"{na(gap['exact_indicator'], '.3g')} | "
            f"{gap['greedy_plans_priced']} / {gap.get('exact_plans_priced', 'n/a')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--procs", default="1,2", help="comma-separated process counts")
    parser.add_argument("--precisions", default="fp32,bf16,int8")
    parser.add_argument(
        "--plans", default="uniform,speed", help=f"comma-separated plan kinds, of {', '.join(PLAN_KINDS)}"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: mlp, 1 process, fp32 and bf16, uniform and speed plans",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per plan (median of their medians)")
    parser.add_argument(
        "--recordings", type=int, default=2, help="recording runs (prediction: median over them)"
    )
    parser.add_argument(
        "--exact-limit", type=int, default=4096, help="most combinations the exact search prices"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-procs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker-mode", default="report", help=argparse.SUPPRESS)
    parser.add_argument("--worker-plan", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if args.worker and args.worker_mode == "turns":
        turns_worker(args.worker, args.worker_dir, args.worker_plan)
        return 0
    if args.worker:
        run_worker(
            args.worker, args.worker_procs, args.worker_dir, args.worker_mode, args.worker_plan, precisions
        )
        return 0
    models, procs_list = args.models.split(","), [int(p) for p in args.procs.split(",")]
    kinds = tuple(k.strip() for k in args.plans.split(",") if k.strip())
    if args.quick:
        models, procs_list, precisions, kinds = ["mlp"], [1], ["fp32", "bf16"], ("uniform", "speed")
        args.repeats = args.recordings = 1
    unknown = set(kinds) - set(PLAN_KINDS)
    if unknown:
        parser.error(f"unknown plan kinds {sorted(unknown)}; choose from {', '.join(PLAN_KINDS)}")
    for name in models:
        get_model(name)  # fail fast on a bad name
    say_allocator()
    args.out.mkdir(parents=True, exist_ok=True)
    env = bench_environment(precisions=precisions, plans=list(kinds))
    results = [
        measure_plans(
            name,
            procs,
            args.out,
            precisions,
            kinds,
            args.timeout,
            args.exact_limit,
            args.repeats,
            args.recordings,
        )
        for name in models
        for procs in procs_list
    ]
    raw = {"environment": env, "results": results}
    write_results(args.out, "precision_plans", markdown(results), raw)
    failed = any(row.get("failed") for result in results for row in result["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
