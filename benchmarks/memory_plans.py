"""Memory plans (precision, recompute, offload) under budgets, predicted against measured, on real
Lightning runs; beside torch's own selective-activation-checkpointing solver and the other plans of
small instances.

For each model: one recording with ``QSyncCallback(mode="apply")`` that plans nothing to keep (it
probes every layer's precisions, counts each module's calls, fits the offload store's copy cost and,
under its 100% budget, measures offload's and recompute's costs in the steps: `activation_trial.py`). Then,
for each budget (a share of the recorded configuration's predicted peak), from its traces:

- **ours**: `planner.memory_plan.plan_memory` with the precision and activation levers, and with
  the activation lever alone;
- **sac_ilp**: torch's `sac_estimator` + `sac_ilp` (`sac_anchor.py`, with the stand-ins CPU needs),
  its modules recomputed whole by our recompute applier, as its whole-module answer;
- **others** (the small instance): every plan of one or two of the activation options that free
  the most (`planner.activation.activation_options`) that the predictor says fits the budget.

Each distinct plan then runs ``--repeats`` times in a fresh process with
``QSyncCallback(mode="report", plan=...)``: applied at step 0, recorded, and its measured step time
(median of the unprofiled steps) and measured peak (the recorder's independent measurement: live
storages and the allocator's counter, `recorder/live_memory.py`) set against the prediction made
from the recording. The run then goes on for `AFTER_SETTLE` + `AFTER_STEPS` steps after the callback
finished, and the median of the last `AFTER_STEPS` is the plan's step time after the window: what
the rest of a training run pays, without the window's own disturbance. Plans with offload also
report the bytes the store moved per step and its measured bandwidth. Each repeat also runs every
distinct plan in turns with the recorded configuration in one more fresh process (`plan_turns.py`):
the changes that rank plans to a few percent, which fresh processes cannot. The table says, per
budget, whether each plan was predicted to fit and whether it did, its change in turns against the
predicted one, and how our plan compares in turns with the fastest other plan that fit
(`_against_best`).

    python benchmarks/memory_plans.py [--models resnet,attention,mlp] [--budgets 0.5,0.7,0.85]
        [--repeats 2] [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from models import get_model, timed_fit
from plan_turns import TURN_ROUNDS, in_turns_change, measure_in_turns, turns_cell, turns_worker
from runs import (
    bench_environment,
    na,
    range_noise_pct,
    run_report,
    say_allocator,
    write_results,
)
from sac_anchor import collect_sac_stats, lightning_loss, lightning_optimizer, solve_sac_plan

from qsync_callback.activation_trial import TRIAL_LOOKS, TRIAL_ROUNDS
from qsync_callback.alternation import BLOCK_STEPS, SETTLE_STEPS
from qsync_callback.mean_band import change_pct, combined_noise_pct
from qsync_callback.plan import OFFLOAD, RECOMPUTE, Constraints, Plan
from qsync_callback.planner.activation import activation_options
from qsync_callback.planner.memory_plan import plan_memory
from qsync_callback.predictor.activation import nested_pairs
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.torch_recorder import window_close_step
from qsync_callback.recorder.trace import load_trace_dir
from qsync_callback.report import format_activation_trial
from qsync_callback.units import format_bytes

WARMUP_STEPS, PROFILE_STEPS, MEASURE_STEPS = 10, 5, 10
MAX_STEPS = window_close_step(WARMUP_STEPS, PROFILE_STEPS) + MEASURE_STEPS + 3
# the recording runs the offload trial, then the recompute trial, after its measured steps
# (`activation_trial.py`)
RECORDING_STEPS = MAX_STEPS + 2 * 2 * TRIAL_LOOKS * TRIAL_ROUNDS * (SETTLE_STEPS + BLOCK_STEPS)
# a plan's run goes on after the callback finished: the steps the rest of training runs, away from
# the window's disturbance (the offload store's writes ran at a third of their rate during and right
# after a recorded window); the first few of them settle, the rest are timed
AFTER_SETTLE, AFTER_STEPS = 5, 25
STEADY_FILE = "after_window.json"
PRECISIONS = ("fp32", "bf16", "int8")
OURS = {"ours": ("precision", "activation"), "ours: activation only": ("activation",)}  # the levers of each
OTHER_OPTIONS = 4  # the small instance: plans of one or two of this many options
BATCHES = 8  # a data set of 8 batches, gone through again each epoch: the activations dominate the
# peak, not a data set of one batch per step held in memory (as a loader reading from disk would)


def run_worker(model: str, run_dir: Path, mode: str, plan: Path | None) -> None:
    """One training run (in a subprocess): the recording (mode "apply") or one plan (mode "report")."""
    from qsync_callback.integrations.lightning import QSyncCallback

    callback = QSyncCallback(
        mode=mode,
        warmup_steps=WARMUP_STEPS,
        profile_steps=PROFILE_STEPS,
        measure_steps=MEASURE_STEPS,
        output_dir=run_dir,
        precisions=PRECISIONS,
        levers=("precision", "activation"),
        max_step_time=1e6 if mode == "apply" else None,  # plan nothing: this run only records
        # a budget, as a user's run has, so that the recording measures offload's cost in its steps
        memory_budget="100%" if mode == "apply" else None,
        best_effort=True,
        plan=plan,
        plan_cache=False,
    )
    steps = RECORDING_STEPS if mode == "apply" else MAX_STEPS + AFTER_SETTLE + AFTER_STEPS + 1
    _, timer, _, _ = timed_fit(get_model(model), steps, [callback], 1, batches=BATCHES)
    if mode == "report":  # step k of the run is timer.step_ms[k]
        after = timer.step_ms[MAX_STEPS + AFTER_SETTLE :]
        (run_dir / STEADY_FILE).write_text(json.dumps({"step_ms": after}))


def recording_trials(predictor: Predictor) -> dict[str, dict[str, Any] | None]:
    """The recording's offload and recompute trials (`activation_trial.py`), by policy, as the
    predictor prices with them (the recompute's with its factor); None where none ran."""
    return {
        OFFLOAD: predictor.traces[0].activation_costs.get("copy", {}).get("in_step"),
        RECOMPUTE: predictor.activation.recompute_trials[0],
    }


def _sac_plans(model: str, budgets: dict[float, int], measured_peak: int) -> dict[float, dict[str, Any]]:
    """torch's sac_ilp answer per budget share: its whole-module recompute plan, or why it has none."""
    spec = get_model(model)
    module = spec.build()
    batch = next(iter(spec.dataloader(1)))
    stats = collect_sac_stats(module, batch, lightning_loss, lightning_optimizer)
    out = {}
    for share, budget in budgets.items():
        result = solve_sac_plan(stats, budget, measured_peak_bytes=measured_peak)
        out[share] = {"fits": result.fits, "reason": result.reason, "activation": dict(result.recompute)}
    return out


def candidate_plans(
    predictor: Predictor, model: str, shares: list[float], measured_peak: int
) -> list[dict[str, Any]]:
    """Every plan to run, per budget share: ours (two lever sets), sac_ilp's, the small instance's."""
    traces = predictor.traces
    recorded_peak = predictor.predict().peak_bytes
    budgets = {share: int(share * recorded_peak) for share in shares}
    sac = _sac_plans(model, budgets, measured_peak)
    options, _ = activation_options(predictor, {})
    top = sorted(options, key=lambda o: -o.freed_bytes)[:OTHER_OPTIONS]
    plans = []
    for share, budget in budgets.items():
        for who, levers in OURS.items():
            # best effort: where nothing fits, the closest plan is run too (marked as not fitting)
            choice = plan_memory(traces, Constraints(memory_budget=budget, levers=levers, best_effort=True))
            plans.append({"share": share, "who": who, "plan": choice.chosen.plan, "fits": choice.feasible})
        answer = sac[share]
        if answer["activation"]:
            plans.append({"share": share, "who": "sac_ilp", "plan": Plan(activation=answer["activation"])})
        else:
            print(
                f"[benchmark] {model} at {share:.0%}: sac_ilp has no plan: {answer['reason']}",
                file=sys.stderr,
            )
        for k in (1, 2):
            for combo in itertools.combinations(top, k):
                activation = {o.module: o.policy for o in combo}
                if len(activation) < k or nested_pairs(list(activation)):
                    continue
                plan = Plan(activation=activation)
                if predictor.predict(plan).peak_bytes <= budget:
                    plans.append({"share": share, "who": "other", "plan": plan})
    for row in plans:
        row["plan"].fingerprint = dict(traces[0].fingerprint)
        prediction = predictor.predict(row["plan"])
        row.update(
            budget_bytes=budgets[row["share"]],
            predicted_step_ms=prediction.step_ms,
            predicted_peak_bytes=prediction.peak_bytes,
        )
        row.setdefault("fits", prediction.peak_bytes <= budgets[row["share"]])
    return plans


def measure_model(model: str, out: Path, shares: list[float], repeats: int, timeout: float) -> dict[str, Any]:
    """Record ``model``, choose every plan for every budget, run each distinct plan ``repeats``
    times (in rounds), and set measured against predicted."""
    script = Path(__file__).resolve()
    runs_dir = out / "memory_runs"
    record_dir = runs_dir / f"{model}-record"
    measured = run_report(script, ["--worker", model, "--worker-mode", "apply"], record_dir, timeout)
    if measured is None:
        raise RuntimeError(f"recording {model} failed")
    predictor = Predictor(load_trace_dir(record_dir / "trace"))
    recorded = predictor.predict()
    plans = candidate_plans(predictor, model, shares, measured["peak_bytes"])
    baseline = {"share": None, "who": "recorded configuration", "plan": Plan()}
    distinct: dict[str, list[dict[str, Any]]] = {}
    for row in [baseline, *plans]:
        row["key"] = json.dumps({"p": row["plan"].precision, "a": row["plan"].activation}, sort_keys=True)
        distinct.setdefault(row["key"], [])
    files = {}
    for i, key in enumerate(distinct):
        row = next(r for r in [baseline, *plans] if r["key"] == key)
        files[key] = runs_dir / f"{model}-plan{i}.json"
        row["plan"].save(files[key])
    for k in range(repeats):
        for i, key in enumerate(distinct):
            print(
                f"[benchmark] {model}: plan {i + 1} of {len(distinct)}, run {k + 1} ...",
                file=sys.stderr,
                flush=True,
            )
            args = ["--worker", model, "--worker-mode", "report", "--worker-plan", str(files[key])]
            run_dir = runs_dir / f"{model}-plan{i}-r{k}"
            run = run_report(script, args, run_dir, timeout)
            if run is not None:
                after = json.loads((run_dir / STEADY_FILE).read_text())["step_ms"]
                distinct[key].append({**run, "after_step_ms": statistics.median(after)})
    planned = {key: path for key, path in files.items() if key != baseline["key"]}
    turns = [
        measure_in_turns(Path(__file__).resolve(), model, planned, runs_dir / f"{model}-turns-r{k}", timeout)
        for k in range(repeats)
    ]
    base_runs = [run["step_ms"] for run in distinct[baseline["key"]]]
    base_ms = statistics.median(base_runs) if base_runs else None
    base_after = [run["after_step_ms"] for run in distinct[baseline["key"]]]
    rows = []
    for row in plans:
        runs = distinct[row["key"]]
        plan = row.pop("plan")
        row.update(precision=plan.precision, activation=plan.activation)
        key = row.pop("key")
        if not runs:
            rows.append({**row, "failed": True})
            continue
        in_turns = [each[key] for each in turns if key in each]
        run_ms = [run["step_ms"] for run in runs]
        after_ms = [run["after_step_ms"] for run in runs]
        peak = max(run["peak_bytes"] for run in runs)
        offload = [run.get("offload") for run in runs if run.get("offload")]
        measured_cost = cost_noise = after_cost = after_noise = None
        if base_ms is not None:
            measured_cost, cost_noise = _cost(run_ms, base_runs)
            after_cost, after_noise = _cost(after_ms, base_after)
        rows.append(
            {
                **row,
                "predicted_cost_ms": row["predicted_step_ms"] - recorded.step_ms,
                "measured_cost_ms": measured_cost,
                "measured_cost_noise_ms": cost_noise,
                "measured_step_ms": statistics.median(run_ms),
                "measured_runs_ms": run_ms,
                "noise_pct": range_noise_pct(run_ms),
                "step_error_pct": change_pct(row["predicted_step_ms"], statistics.median(run_ms)),
                "measured_peak_bytes": peak,
                "peak_error_pct": change_pct(row["predicted_peak_bytes"], peak),
                "within_budget": peak <= row["budget_bytes"],
                "offload": offload[0] if offload else None,
                "after_step_ms": statistics.median(after_ms),
                "after_runs_ms": after_ms,
                "after_noise_pct": range_noise_pct(after_ms),
                "after_error_pct": change_pct(row["predicted_step_ms"], statistics.median(after_ms)),
                "after_cost_ms": after_cost,
                "after_cost_noise_ms": after_noise,
                "predicted_change_pct": change_pct(row["predicted_step_ms"], recorded.step_ms),
                "in_turns": in_turns,
            }
        )
    return {
        "model": model,
        "recorded": {
            "predicted_step_ms": recorded.step_ms,
            "predicted_peak_bytes": recorded.peak_bytes,
            "measured_step_ms": measured["step_ms"],
            "measured_peak_bytes": measured["peak_bytes"],
            "rerun_step_ms": base_ms,
            "rerun_runs_ms": base_runs,
            "rerun_noise_pct": range_noise_pct(base_runs) if base_runs else None,
            "after_step_ms": statistics.median(base_after) if base_after else None,
            "after_noise_pct": range_noise_pct(base_after) if base_after else None,
        },
        "rows": rows,
        "trials": recording_trials(predictor),
    }


def _referred_errors(row: dict[str, Any], recorded: dict[str, Any]) -> dict[str, float | None]:
    """A plan's step error with the prediction referred to the recorded configuration's reruns, in
    the window and after it: its predicted step over the recorded configuration's predicted one,
    times the reruns' median, against the plan's runs (None without reruns). The prediction's level
    is the recording process's own steps; fresh processes of one configuration differ by more than
    a plan changes (glibc's allocator regime, `benchmarks/README.md`), so this is the error a user
    sees against the configuration they would otherwise run."""
    ratio = row["predicted_step_ms"] / recorded["predicted_step_ms"]
    base = {"measured": recorded.get("rerun_step_ms"), "after": recorded.get("after_step_ms")}
    runs = {"measured": row["measured_step_ms"], "after": row["after_step_ms"]}
    return {when: None if base[when] is None else change_pct(ratio * base[when], runs[when]) for when in base}


def _cost(plan_ms: list[float], base_ms: list[float]) -> tuple[float, float]:
    """A plan's measured cost (the median of its runs less the recorded configuration's) and its
    noise: each median of repeats may sit half its runs' range from the machine's typical step."""
    noise = 0.5 * math.hypot(max(plan_ms) - min(plan_ms), max(base_ms) - min(base_ms))
    return statistics.median(plan_ms) - statistics.median(base_ms), noise


def _against_best(rows: list[dict[str, Any]], ours: dict[str, Any]) -> str | None:
    """``ours`` against the fastest plan in turns among ``rows`` (the same model and budget) that
    measured within the budget and uses no lever ``ours`` was not allowed (`OURS`; the others are
    activation plans): how much slower its step is, in %, with the two changes' noise; None where
    either was not timed."""
    mine = in_turns_change(ours)
    allowed = [row for row in rows if "precision" in OURS[ours["who"]] or not row["precision"]]
    timed = [(change, row) for row in allowed if row["within_budget"] and (change := in_turns_change(row))]
    if mine is None or not timed:
        return None
    (best, best_noise), best_row = min(timed, key=lambda pair: pair[0][0])
    slower = change_pct(100 + mine[0], 100 + best)
    where = ", ".join(f"{m}: {p}" for m, p in sorted(best_row["activation"].items())) or "-"
    lowered = f"{len(best_row['precision'])} lowered, " if best_row["precision"] else ""
    return (
        f"{slower:+.1f}% against the fastest ({best_row['who']}: {lowered}{where}; "
        f"noise +-{combined_noise_pct(mine[1], best_noise):.1f}%)"
    )


def _mib(value: float | None) -> str:
    return na(None if value is None else value / 2**20, ".1f")


def _traffic(offload: dict[str, Any] | None) -> str:
    """A plan run's offload traffic per step (`report.offload_traffic`): bytes out and back, and the
    bandwidth each way; "-" without offload."""
    if not offload:
        return "-"
    return "; ".join(
        f"{format_bytes(m['to_store_bytes'])} out at {format_bytes(m['to_store_bytes_per_s'])}/s, "
        f"back at {format_bytes(m['from_store_bytes_per_s'])}/s"
        for m in offload.values()
    )


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | budget | plan | precision lowered | activation | fits (predicted / measured) | "
        "predicted ms | measured ms (noise) | step error | after the window ms (noise) | error after | "
        "error referred to the reruns (in the window / after) | "
        "cost ms (predicted / measured +- noise / after the window +- noise) | "
        "change in turns (predicted / measured +- noise) | "
        "predicted peak MiB | measured peak MiB | peak error | offload per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fits_kept, fits_total, step_errors, after_errors, peak_errors, turn_errors = 0, 0, [], [], [], []
    referred_errors: dict[str, list[float]] = {"measured": [], "after": []}
    costs: dict[str, dict[str, dict[str, tuple[float, bool]]]] = {
        when: {"recompute": {}, "offload": {}} for when in ("measured", "after")
    }
    for result in results:
        for row in result["rows"]:
            if row.get("failed"):
                lines.append(
                    f"| {result['model']} | {row['share']:.0%} | {row['who']} | FAILED |" + " |" * 14
                )
                continue
            referred = _referred_errors(row, result["recorded"])
            for when, error in referred.items():
                if error is not None:
                    referred_errors[when].append(error)
            activation = ", ".join(f"{m}: {p}" for m, p in sorted(row["activation"].items())) or "-"
            if row["fits"]:
                fits_total += 1
                fits_kept += row["within_budget"]
            step_errors.append(abs(row["step_error_pct"]))
            after_errors.append(abs(row["after_error_pct"]))
            peak_errors.append(abs(row["peak_error_pct"]))
            fits = f"{'yes' if row['fits'] else 'no'} / {'yes' if row['within_budget'] else 'no'}"
            noise = na(row["noise_pct"], ".1f")
            policies = set(row["activation"].values())
            if not row["precision"] and len(policies) == 1:
                policy, plan = (
                    policies.pop(),
                    f"{result['model']} {json.dumps(row['activation'], sort_keys=True)}",
                )
                for when in ("measured", "after"):
                    measured = row[f"{when}_cost_ms"]
                    if measured:
                        miss = abs(row["predicted_cost_ms"] - measured)
                        costs[when][policy][plan] = (
                            change_pct(row["predicted_cost_ms"], measured),
                            miss <= row[f"{when}_cost_noise_ms"],
                        )
            cost = (
                f"{row['predicted_cost_ms']:+.1f} / {na(row['measured_cost_ms'], '+.1f')}"
                f" (+-{na(row['measured_cost_noise_ms'], '.1f')}) / {na(row['after_cost_ms'], '+.1f')}"
                f" (+-{na(row['after_cost_noise_ms'], '.1f')})"
            )
            in_turns, turn_error = turns_cell(row)
            if turn_error is not None:
                turn_errors.append(turn_error)
            lines.append(
                f"| {result['model']} | {row['share']:.0%} | {row['who']} | {len(row['precision'])} | "
                f"{activation} | {fits} | "
                f"{row['predicted_step_ms']:.1f} | {row['measured_step_ms']:.1f} ({noise}%) | "
                f"{row['step_error_pct']:+.1f}% | {row['after_step_ms']:.1f} "
                f"({na(row['after_noise_pct'], '.1f')}%) | {row['after_error_pct']:+.1f}% | "
                f"{na(referred['measured'], '+.1f')}% / {na(referred['after'], '+.1f')}% | "
                f"{cost} | {in_turns} | {_mib(row['predicted_peak_bytes'])} | "
                f"{_mib(row['measured_peak_bytes'])} | {row['peak_error_pct']:+.1f}% | "
                f"{_traffic(row['offload'])} |"
            )
    if step_errors:
        lines += [
            "",
            f"Plans predicted to fit that measured within the budget: {fits_kept} of {fits_total}. "
            f"Median |step error| {statistics.median(step_errors):.1f}% in the window, "
            f"{statistics.median(after_errors):.1f}% after it; median |peak error| "
            f"{statistics.median(peak_errors):.1f}% over {len(step_errors)} plan rows.",
        ]
        if referred_errors["measured"]:
            window, after = referred_errors["measured"], referred_errors["after"]
            lines.append(
                "Referred to the reruns (the plan's predicted step over the recorded configuration's, "
                "times the recorded configuration's reruns, against the plan's runs): median |step error| "
                f"{statistics.median(abs(e) for e in window):.1f}% in the window (mean signed "
                f"{statistics.mean(window):+.1f}%), {statistics.median(abs(e) for e in after):.1f}% after it "
                f"(mean signed {statistics.mean(after):+.1f}%)."
            )
        if turn_errors:
            lines.append(
                "In turns (each plan against the recorded configuration in one process, "
                f"`plan_turns.py`, {TURN_ROUNDS} rounds per process): the plan's step predicted against "
                "measured, both referred to the recorded configuration's: median |error| "
                f"{statistics.median(abs(e) for e in turn_errors):.1f}% (mean signed "
                f"{statistics.mean(turn_errors):+.1f}%) over {len(turn_errors)} plan rows."
            )
        for result in results:
            rows = [row for row in result["rows"] if not row.get("failed")]
            for share in sorted({row["share"] for row in rows}):
                group = [row for row in rows if row["share"] == share]
                for ours in (row for row in group if row["who"] in OURS and row["fits"]):
                    verdict = _against_best(group, ours)
                    if verdict is not None:
                        lines.append(f"- {result['model']} {share:.0%}, {ours['who']}: {verdict}.")
        for when, where in (("measured", "in the window"), ("after", "after the window")):
            for policy, by_plan in costs[when].items():
                if by_plan:
                    errors = [error for error, _ in by_plan.values()]
                    lines.append(
                        f"{policy.capitalize()}-only plans ({len(by_plan)} distinct), {where}: the "
                        "predicted cost (the plan's step less the recorded configuration's, both "
                        "predicted) against the measured cost (the plan's runs less the recorded "
                        "configuration's runs, in fresh processes): median |error| "
                        f"{statistics.median(abs(e) for e in errors):.0f}%, from {min(errors):+.0f}% to "
                        f"{max(errors):+.0f}%; within the measured cost's noise: "
                        f"{sum(within for _, within in by_plan.values())} of {len(by_plan)}."
                    )
        reruns = [
            f"{r['model']} {rerun['rerun_step_ms']:.1f} ms ({na(rerun['rerun_noise_pct'], '.1f')}%), "
            f"after the window {na(rerun['after_step_ms'], '.1f')} ms "
            f"({na(rerun['after_noise_pct'], '.1f')}%)"
            for r in results
            if (rerun := r["recorded"]).get("rerun_step_ms") is not None
        ]
        if reruns:
            lines.append(f"The recorded configuration rerun in fresh processes: {', '.join(reruns)}.")
        lines.append("The recordings' trials (`activation_trial.py`), as the plan's table gives them:")
        lines += [
            f"- {r['model']}: {format_activation_trial(policy, trial).strip()}"
            for r in results
            for policy, trial in r.get("trials", {}).items()
            if trial is not None
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet,attention,mlp")
    parser.add_argument("--budgets", default="0.5,0.7,0.85", help="shares of the recorded predicted peak")
    parser.add_argument("--repeats", type=int, default=2, help="runs per plan")
    parser.add_argument("--quick", action="store_true", help="smoke run: resnet, 85%%, 1 run per plan")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-mode", default="report", help=argparse.SUPPRESS)
    parser.add_argument("--worker-plan", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker and args.worker_mode == "turns":
        turns_worker(args.worker, args.worker_dir, args.worker_plan, BATCHES)
        return 0
    if args.worker:
        run_worker(args.worker, args.worker_dir, args.worker_mode, args.worker_plan)
        return 0
    models = args.models.split(",")
    shares = [float(s) for s in args.budgets.split(",")]
    if args.quick:
        models, shares, args.repeats = ["resnet"], [0.85], 1
    for name in models:
        get_model(name)  # fail fast on a bad name
    say_allocator()
    args.out.mkdir(parents=True, exist_ok=True)
    env = bench_environment(budgets=shares)
    results = [measure_model(name, args.out, shares, args.repeats, args.timeout) for name in models]
    write_results(args.out, "memory_plans", markdown(results), {"environment": env, "results": results})
    failed = any(row.get("failed") for result in results for row in result["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
