"""What offloading or recomputing one module costs a step, predicted against measured in turns.

A memory plan's price is the time its activation policies add. Between fresh processes that cost
cannot be measured to better than what separates two processes (a drift of the machine's speed,
glibc's allocator regime), so here it is measured the way the loop measures a plan: in turns with
the recorded configuration in one process (`plan_turns.py`), over more rounds than the loop's
(24 rounds in each of 2 processes by default; the noise this leaves on each cost: `benchmarks/README.md`).

For each model: one recording, the one `memory_plans.py` makes (``QSyncCallback(mode="apply")``
under a 100% budget: the offload store's copy-cost fit and the offload and recompute trials of
`activation_trial.py`, planning nothing). From it, `planner.activation.activation_options` lists
every module that can be offloaded or recomputed alone; the ``--options`` that free the most of
each policy, other than the modules its trial ran (priced by that trial's own measurement), are
priced (the plan's predicted step less the recorded configuration's, both predicted) and run in
turns; so is each policy's trial's set of modules together (`trial_options`), whose cost, several
times one module's, the noise resolves to a few percent, and whose independent price is the one
without the trial (the copy-cost fit, the recorded forward). All run in turns, ``--rounds`` rounds
in each of ``--repeats`` fresh processes, each of which first records and reports a window as a
user's run does (`plan_turns.turns_worker`'s ``after_recording``: the loop applies a plan in the
process that recorded, whose allocator regime a fresh process does not share; in session 45's run
without it the ResNet's recording took 2 page faults a step and the turns processes 4,200-5,700, and
their offload and recompute cost 1.3-1.8 times what the recording's trials measured). The measured
cost is the change in turns
(`alternation.paired_change`) times the baseline step of the same turns, mean over the processes,
noise combined (`turns_cost_ms`); its error is the predicted cost against it.

    python benchmarks/activation_costs.py [--models resnet,attention,mlp] [--options 3]
        [--rounds 24] [--repeats 2] [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

from memory_plans import recording_trials
from models import get_model
from plan_turns import in_turns_change, measure_in_turns
from runs import bench_environment, na, run_report, say_allocator, write_results

from qsync_callback.mean_band import change_pct, combined_noise_pct
from qsync_callback.plan import OFFLOAD, RECOMPUTE, Plan
from qsync_callback.planner.activation import activation_options
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.trace import Trace, load_trace_dir
from qsync_callback.report import format_activation_trial
from qsync_callback.units import format_bytes

MEMORY_PLANS = Path(__file__).resolve().with_name("memory_plans.py")  # its recording and turns workers
COST_TOLERANCE = 10.0  # % of the measured cost: the target for offload's time cost


def without_trials(traces: list[Trace]) -> list[Trace]:
    """Copies of ``traces`` without the activation trials' results: what the predictor prices
    without them (the copy-cost fit's price of the copies, the recorded forward of a recompute)."""
    out = []
    for trace in traces:
        costs = {policy: dict(entry) for policy, entry in trace.activation_costs.items()}
        for entry in costs.values():
            entry.pop("in_step", None)
        out.append(dataclasses.replace(trace, activation_costs=costs))
    return out


def priced_rows(predictor: Predictor, plans: list[tuple[str, Plan, int]]) -> list[dict[str, Any]]:
    """Each ``(label, plan, freed bytes)`` as a row: its policy, its predicted cost (ms) and change
    (%) against the recorded configuration, and its cost priced without the trials
    (``untried_cost_ms``)."""
    recorded = predictor.predict()
    untried = Predictor(without_trials(predictor.traces))
    untried_recorded_ms = untried.predict().step_ms
    rows = []
    for label, plan, freed_bytes in plans:
        predicted = predictor.predict(plan)
        rows.append(
            {
                "module": label,
                "policy": next(iter(plan.activation.values())),
                "plan": plan,
                "freed_bytes": freed_bytes,
                "predicted_cost_ms": predicted.step_ms - recorded.step_ms,
                "untried_cost_ms": untried.predict(plan).step_ms - untried_recorded_ms,
                "predicted_change_pct": change_pct(predicted.step_ms, recorded.step_ms),
            }
        )
    return rows


def chosen_options(predictor: Predictor, per_policy: int) -> list[dict[str, Any]]:
    """The ``per_policy`` single-module options of each policy that free the most, each with its
    plan, its predicted cost (ms) and change (%) against the recorded configuration, and its cost
    priced without the trials (``untried_cost_ms``). The modules a policy's trial ran
    (`memory_plans.recording_trials`) are left out: their price is that trial's measurement."""
    trials = recording_trials(predictor)
    options, _ = activation_options(predictor, {})
    fingerprint = predictor.traces[0].fingerprint
    plans = []
    for policy in (OFFLOAD, RECOMPUTE):
        tried = set((trials.get(policy) or {}).get("modules", []))
        mine = sorted(
            (o for o in options if o.policy == policy and o.module not in tried), key=lambda o: -o.freed_bytes
        )
        for option in mine[:per_policy]:
            plan = Plan(fingerprint=dict(fingerprint), activation={option.module: policy})
            plans.append((option.module, plan, option.freed_bytes))
    return priced_rows(predictor, plans)


def trial_options(predictor: Predictor) -> list[dict[str, Any]]:
    """Each policy's trial's modules together as one plan (`memory_plans.recording_trials`), with
    the keys of `chosen_options`' rows and ``together``: its price with the trial is calibrated on
    that trial's own few rounds; its price without the trial is an independent prediction."""
    options, _ = activation_options(predictor, {})
    freed = {(o.module, o.policy): o.freed_bytes for o in options}
    plans = []
    for policy, trial in recording_trials(predictor).items():
        if not trial or not trial.get("modules"):
            continue
        modules = trial["modules"]
        activation = dict.fromkeys(modules, policy)
        plan = Plan(fingerprint=dict(predictor.traces[0].fingerprint), activation=activation)
        label = ", ".join(modules[:3]) + ", ..." * (len(modules) > 3)
        plans.append((label, plan, sum(freed.get((module, policy), 0) for module in modules)))
    return [{**row, "together": True} for row in priced_rows(predictor, plans)]


def turns_cost_ms(in_turns: list[dict[str, Any]]) -> tuple[float, float]:
    """A plan's cost in turns in ms, and its noise: in each process its change in turns times that
    process's own baseline (the median of its rounds' baseline blocks), the mean over the processes,
    their noises combined over their number (as `plan_turns.in_turns_change` combines the changes).
    The recording's step is no measure of the turns' processes: it is predicted, and a process
    minutes apart runs the same step 20% faster or slower on this VM."""
    timed = [t for t in in_turns if t["change_pct"] is not None]
    costs = [t["change_pct"] / 100 * statistics.median(t["baseline_ms"]) for t in timed]
    noises = [t["noise_pct"] / 100 * statistics.median(t["baseline_ms"]) for t in timed]
    return statistics.fmean(costs), combined_noise_pct(*noises) / len(timed)


def measure_model(model: str, out: Path, per_policy: int, rounds: int, repeats: int, timeout: float) -> dict:
    """Record ``model``, price its chosen options and run them in turns; the rows."""
    runs_dir = out / "activation_cost_runs"
    record_dir = runs_dir / f"{model}-record"
    args = ["--worker", model, "--worker-mode", "apply"]
    if run_report(MEMORY_PLANS, args, record_dir, timeout) is None:
        raise RuntimeError(f"recording {model} failed")
    predictor = Predictor(load_trace_dir(record_dir / "trace"))
    recorded_ms = predictor.predict().step_ms
    rows = chosen_options(predictor, per_policy) + trial_options(predictor)
    files = {}
    for i, row in enumerate(rows):
        files[str(i)] = runs_dir / f"{model}-option{i}.json"
        row.pop("plan").save(files[str(i)])
    turns = []
    for k in range(repeats):
        print(f"[benchmark] {model}: {len(rows)} options in turns, process {k + 1} ...", file=sys.stderr)
        run_dir = runs_dir / f"{model}-turns-r{k}"
        turns.append(
            measure_in_turns(MEMORY_PLANS, model, files, run_dir, timeout, rounds, after_recording=True)
        )
    for i, row in enumerate(rows):
        row["in_turns"] = [each[str(i)] for each in turns if str(i) in each]
        measured = in_turns_change(row)
        row["measured_change_pct"], row["noise_pct"] = measured if measured else (None, None)
        if measured is not None:
            row["measured_cost_ms"], row["noise_ms"] = turns_cost_ms(row["in_turns"])
            row["cost_error_pct"] = change_pct(row["predicted_cost_ms"], row["measured_cost_ms"])
    return {
        "model": model,
        "recorded_step_ms": recorded_ms,
        "rows": rows,
        "trials": recording_trials(predictor),
    }


def markdown(results: list[dict[str, Any]], rounds: int, repeats: int) -> str:
    lines = [
        "| model | module | policy | frees | predicted cost ms | measured cost ms in turns (+- noise) | "
        "error | within noise | priced without the trial ms | measured over it |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    errors: dict[str, list[float]] = {OFFLOAD: [], RECOMPUTE: []}
    within: dict[str, int] = {OFFLOAD: 0, RECOMPUTE: 0}
    together_lines = []
    for result in results:
        for row in result["rows"]:
            measured = row.get("measured_cost_ms")
            error = row.get("cost_error_pct")
            told = measured is not None and abs(row["predicted_cost_ms"] - measured) <= row["noise_ms"]
            untried = row["untried_cost_ms"]
            if row.get("together"):
                if measured is not None and measured > 0:
                    together_lines.append(_together_line(result["model"], row, measured, untried))
            elif error is not None:
                errors[row["policy"]].append(error)
                within[row["policy"]] += told
            cell = "-" if measured is None else f"{measured:+.2f} (+-{row['noise_ms']:.2f})"
            frees = format_bytes(row["freed_bytes"])
            ratio = measured / untried if measured is not None and untried > 0 else None
            verdict = "-" if measured is None else "yes" if told else "no"
            label = f"together: {row['module']}" if row.get("together") else row["module"]
            lines.append(
                f"| {result['model']} | {label} | {row['policy']} | {frees} | "
                f"{row['predicted_cost_ms']:+.2f} | {cell} | {na(error, '+.0f')}% | {verdict} | "
                f"{untried:+.2f} | {na(ratio, '.2f')} |"
            )
    lines.append("")
    lines.append(
        f"In turns: {rounds} rounds in each of {repeats} processes; the measured cost is the change in turns "
        "times the same turns' baseline step (each process's median), mean over the processes."
    )
    for policy, policy_errors in errors.items():
        if not policy_errors:
            continue
        close = sum(abs(e) <= COST_TOLERANCE for e in policy_errors)
        lines.append(
            f"{policy}: median |cost error| {statistics.median(abs(e) for e in policy_errors):.0f}% over "
            f"{len(policy_errors)} modules (mean signed {statistics.fmean(policy_errors):+.0f}%); within "
            f"{COST_TOLERANCE:.0f}%: {close} of {len(policy_errors)}; predicted within the measured noise: "
            f"{within[policy]} of {len(policy_errors)}."
        )
    if together_lines:
        lines.append(
            "Each trial's modules together (priced with the trial: calibrated on that trial's own rounds; "
            "without it: an independent price), the error of the price without the trial:"
        )
        lines += together_lines
    lines.append("The recordings' trials (`activation_trial.py`), as the plan's table gives them:")
    lines += [
        f"- {r['model']}: {format_activation_trial(policy, trial).strip()}"
        for r in results
        for policy, trial in r["trials"].items()
        if trial is not None
    ]
    return "\n".join(lines)


def _together_line(model: str, row: dict[str, Any], measured_ms: float, untried_ms: float) -> str:
    """One summary line for a trial's modules together: the price without the trial against the
    cost measured in turns, and the measured noise as a share of that cost (what the figure resolves)."""
    error = change_pct(untried_ms, measured_ms)
    resolves = 100 * row["noise_ms"] / measured_ms
    verdict = "within" if abs(error) <= COST_TOLERANCE else "outside"
    return (
        f"- {model} {row['policy']} of {row['module']}: {untried_ms:+.2f} ms priced without the trial "
        f"against {measured_ms:+.2f} ms (+-{row['noise_ms']:.2f}, +-{resolves:.0f}% of it): {error:+.1f}%, "
        f"{verdict} {COST_TOLERANCE:.0f}%."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet,attention,mlp")
    parser.add_argument("--options", type=int, default=3, help="modules of each policy, those freeing most")
    parser.add_argument("--rounds", type=int, default=24, help="rounds in turns per process")
    parser.add_argument("--repeats", type=int, default=2, help="processes in turns per model")
    parser.add_argument("--quick", action="store_true", help="smoke run: resnet, 1 option each, 6 rounds")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if args.quick:
        models, args.options, args.rounds, args.repeats = ["resnet"], 1, 6, 1
    for name in models:
        get_model(name)  # fail fast on a bad name
    say_allocator()
    env = bench_environment(rounds=args.rounds, repeats=args.repeats)
    results = [
        measure_model(name, args.out, args.options, args.rounds, args.repeats, args.timeout)
        for name in models
    ]
    table = markdown(results, args.rounds, args.repeats)
    write_results(args.out, "activation_costs", table, {"environment": env, "results": results})
    measured = [row for r in results for row in r["rows"] if row.get("measured_cost_ms") is not None]
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
