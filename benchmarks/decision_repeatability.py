"""Identical launches of ``QSyncCallback(mode="apply")``: the plan each one verifies, its predicted
step time against the step time measured under it, and whether the launches decide alike.

Each launch is a fresh process running a real ``Trainer.fit`` of a model from ``models.py`` (one
process, or ``--procs 2``: Lightning DDP over gloo, every rank applying, verifying and deciding at
the same step) with ``QSyncCallback(mode="apply", plan_cache=False)`` (its default target: the
fastest plan within 5%; ``--memory-budget 85%`` adds a budget, with ``best_effort=True``; ``--levers
activation`` limits what it may change; ``--busy 0.5`` runs another job beside each launch, half a
core in bursts, `runs.busy_machine`), the way a user adds it: the callback records, plans,
applies the plan, records again and keeps the plan or rolls it back (`verify.py`). From each
launch's ``verification.json`` the script takes the plan (its layers' precisions and its modules'
activation policies), the predicted and the measured step time under it (the verified error: a real
prediction, made before the plan ran), the change against the baseline between the two windows and,
decided on, the change measured with the baseline and the plan run in turns (`alternation.py`: the
rounds' mean, or their median where it is the less noisy, "median" in the cell), each with its
noise, the change predicted (against the recorded configuration's prediction: the drift between the
windows does not enter it), and the decision with its reason. The decision is one of:
faster (kept), slower (rolled back), could not tell (then the cheaper configuration is kept), needed
for the memory budget, loss not finite; or nothing to apply (the planner kept the recorded
configuration). Launches of one model agree when they reach the same one. Each row also says
whether the launch recorded its baseline again before planning (its first recording too noisy to
plan on, `report.too_noisy_to_plan`) and the noise of the recording it planned on.
A plan with activation policies (recompute, offload) costs step time: its predicted change against
the change measured in turns is that cost predicted against measured, with no drift between
processes or windows in it.

    python benchmarks/decision_repeatability.py [--models resnet,gru,attention] [--launches 3]
        [--procs 1] [--memory-budget 85%] [--levers activation] [--busy 0.5] [--quick]
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
from runs import (
    bench_environment,
    busy_machine,
    launch,
    na,
    precision_counts,
    say_allocator,
    stderr_tail,
    write_results,
)

from qsync_callback.tuning_loop import NOISY_REPORT_FILE, REPORT_FILE

# the baseline window ends at 30 (150 to 390 with a memory budget and the activation lever: the
# offload and recompute trials, 60 to 180 steps each), the verify window 20 steps later, the turns
# (3 rounds of two blocks of 5 steps, up to 18 while they cannot tell) 30 to 180 after that
MAX_STEPS = 600
NOTHING_TO_APPLY = "nothing to apply"


def run_worker(model: str, run_dir: Path, memory_budget: str, levers: str, procs: int) -> None:
    """One launch (in a subprocess; DDP's other ranks are started by Lightning)."""
    from qsync_callback.integrations.lightning import QSyncCallback

    options: dict[str, Any] = {"memory_budget": memory_budget, "best_effort": True} if memory_budget else {}
    if levers:
        options["levers"] = tuple(levers.split(","))
    callback = QSyncCallback(mode="apply", plan_cache=False, output_dir=run_dir, **options)
    timed_fit(get_model(model), MAX_STEPS, [callback], procs)


def outcome(reason: str) -> str:
    """What a verification's reason states: faster, slower, could not tell, memory budget or loss
    not finite."""
    if reason.startswith("could not tell"):
        return "could not tell"
    if "slower than the baseline" in reason:
        return "slower"
    if "faster than the baseline" in reason:
        return "faster"
    if reason.startswith("needed for the memory budget"):
        return "memory budget"
    if "finite" in reason:
        return "loss not finite"
    return reason


def recordings(run_dir: Path) -> dict[str, Any]:
    """Whether a launch recorded its baseline again (``recorded_again``: why, or None), the noise of
    the recording it planned on and of the one it set aside (% of the step; None where absent)."""

    def read(name: str) -> dict[str, Any]:
        path = run_dir / name
        return json.loads(path.read_text()) if path.exists() else {}

    report, set_aside = read(REPORT_FILE), read(NOISY_REPORT_FILE)
    return {
        "recorded_again": report.get("recorded_again"),
        "planned_on_noise_pct": report.get("measured", {}).get("step_ms_noise_pct"),
        "set_aside_noise_pct": set_aside.get("measured", {}).get("step_ms_noise_pct"),
    }


def read_launch(model: str, launch_no: int, run_dir: Path) -> dict[str, Any]:
    """One row from a finished launch's verification.json (or what it logged instead)."""
    path = run_dir / "verification.json"
    row = {"model": model, "launch": launch_no, **recordings(run_dir)}
    if not path.exists():
        planned = (run_dir / "plan.json").exists()  # the recorded configuration kept as the plan
        row.update(verified=False, planned=planned)
        return {**row, "outcome": NOTHING_TO_APPLY} if planned else {**row, "why": stderr_tail(run_dir, 5)}
    v = json.loads(path.read_text())
    predicted, measured = v["predicted"]["step_ms"], v["measured"]["step_ms"]
    return {
        **row,
        "verified": True,
        "planned": True,
        "plan": describe(v["plan"]),
        "activation": v["plan"].get("activation") or {},
        "predicted_step_ms": predicted,
        "measured_step_ms": measured,
        "measured_noise_pct": v["measured"].get("step_ms_noise_pct"),
        "step_error_pct": 100 * (predicted - measured) / measured if predicted and measured else None,
        "baseline_step_ms": v["baseline_step_ms"],
        "windows_change_pct": v["windows"]["step_ms_change_pct"],
        "windows_noise_pct": v["windows"]["noise_pct"],
        "rounds": (v.get("alternation") or {}).get("rounds", 0),
        "change_pct": v["step_ms_change_pct"],
        "noise_pct": v["noise_pct"],
        "estimate": v.get("estimate"),
        "predicted_change_pct": v["predicted_change_pct"],
        "decision": v["decision"],
        "outcome": outcome(v["reason"]),
        "reason": v["reason"],
    }


def describe(plan: dict[str, Any]) -> str:
    """A plan's layers by precision and its modules' activation policies, in a few words."""
    policies = [f"{module} {policy}" for module, policy in sorted((plan.get("activation") or {}).items())]
    precision = precision_counts(plan.get("precision") or {}) if plan.get("precision") or not policies else ""
    return ", ".join(filter(None, [precision, *policies]))


def cost_error_pct(row: dict[str, Any]) -> float:
    """A plan's step-time cost predicted against measured in turns (both changes against the
    recorded configuration), in percent of the measured cost."""
    return 100.0 * (row["predicted_change_pct"] / row["change_pct"] - 1)


def turns_error_pct(row: dict[str, Any]) -> float:
    """The plan's step-time error with the drift between the windows taken out: its predicted step
    against its measured one, both as a ratio to the recorded configuration (predicted, and measured
    in the same rounds)."""
    return 100.0 * ((1 + row["predicted_change_pct"] / 100) / (1 + row["change_pct"] / 100) - 1)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | launch | plan | predicted ms | measured ms (noise) | verified error | baseline ms | "
        "change between windows (noise) | change in turns (noise; rounds) | predicted change | decision |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if not r["verified"]:
            what = "recorded configuration" if r["planned"] else "FAILED: no plan"
            lines.append(f"| {r['model']} | {r['launch']} | {what} | | | | | | | | {r.get('outcome', '')} |")
            continue
        lines.append(
            f"| {r['model']} | {r['launch']} | {r['plan']} | {na(r['predicted_step_ms'], '.1f')} | "
            f"{na(r['measured_step_ms'], '.1f')} (+-{na(r['measured_noise_pct'], '.1f')}%) | "
            f"{na(r['step_error_pct'], '+.1f')}% | {na(r['baseline_step_ms'], '.1f')} | "
            f"{na(r['windows_change_pct'], '+.1f')}% (+-{na(r['windows_noise_pct'], '.1f')}%) | "
            + (
                f"{na(r['change_pct'], '+.1f')}% (+-{na(r['noise_pct'], '.1f')}%; {r['rounds']}"
                f"{'; median' if r.get('estimate') == 'median' else ''}) | "
                if r["rounds"]
                else "none | "
            )
            + f"{na(r['predicted_change_pct'], '+.1f')}% | {r['decision']}: {r['outcome']} |"
        )
    verified = [r for r in rows if r["verified"] and r["step_error_pct"] is not None]
    models = sorted({r["model"] for r in rows})
    agree = [m for m in models if len({r.get("outcome") for r in rows if r["model"] == m}) == 1]
    lines.append("")
    if verified:
        errors = [abs(r["step_error_pct"]) for r in verified]
        signed = [r["step_error_pct"] for r in verified]
        lines.append(
            f"Verified step-time error (predicted plan against the plan measured in the same launch): median "
            f"|error| {statistics.median(errors):.1f}% over {len(errors)} launches, mean signed "
            f"{statistics.fmean(signed):+.1f}%, range {min(signed):+.1f}% to {max(signed):+.1f}%."
        )
    in_turns = [r for r in verified if r["rounds"] and r["predicted_change_pct"] is not None]
    if in_turns:
        gaps = [r["predicted_change_pct"] - r["change_pct"] for r in in_turns]
        errors = [turns_error_pct(r) for r in in_turns]
        lines.append(
            "Predicted change against the change measured in turns (points): median |difference| "
            f"{statistics.median(map(abs, gaps)):.1f} over {len(gaps)} launches, "
            f"mean {statistics.fmean(gaps):+.1f}, range {min(gaps):+.1f} to {max(gaps):+.1f}; as a step-time "
            f"error (the plan's predicted step against its measured one, both referred to the baseline of "
            f"the same round): median |error| {statistics.median(map(abs, errors)):.1f}%, mean "
            f"{statistics.fmean(errors):+.1f}%."
        )
    costs = [r for r in in_turns if r.get("activation") and r["change_pct"] > 0]
    if costs:
        errors = [cost_error_pct(r) for r in costs]
        noise = [100 * r["noise_pct"] / r["change_pct"] for r in costs]
        lines.append(
            f"Plans with activation policies: their cost (the change in turns) predicted against measured: "
            f"median |error| {statistics.median(map(abs, errors)):.0f}% over {len(errors)} launches, range "
            f"{min(errors):+.0f}% to {max(errors):+.0f}%; the measured cost's own noise: median "
            f"+-{statistics.median(noise):.0f}% of it."
        )
    again = [r for r in rows if r["recorded_again"]]
    planned_on = [r["planned_on_noise_pct"] for r in rows if r["planned_on_noise_pct"] is not None]
    if planned_on:
        set_aside = ", ".join(f"+-{r['set_aside_noise_pct']:.1f}%" for r in again)
        lines.append(
            f"Recorded again before planning (the first recording too noisy to plan on): {len(again)} of "
            f"{len(rows)} launches"
            + (f" (the recordings set aside: {set_aside})" if again else "")
            + f"; the recordings planned on: noise +-{min(planned_on):.1f}% to +-{max(planned_on):.1f}%."
        )
    lines.append(
        f"Launches of one model that reach the same outcome: {len(agree)} of {len(models)} models"
        + (f" ({', '.join(agree)})" if agree else "")
        + "."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet,gru,attention")
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--procs", type=int, default=1, help="processes per launch (DDP over gloo)")
    parser.add_argument("--memory-budget", default="", help="e.g. 85%% (with best effort); default none")
    parser.add_argument("--levers", default="", help="e.g. activation; default every lever")
    parser.add_argument(
        "--busy",
        type=float,
        default=0.0,
        help="share of one core another job takes in bursts (0-1; default 0)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: resnet, 2 launches")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker, args.worker_dir, args.memory_budget, args.levers, args.procs)
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    launches = args.launches
    if args.quick:
        models, launches = ["resnet"], 2
    for name in models:
        get_model(name)  # fail fast on a bad name
    say_allocator()
    env = bench_environment(
        memory_budget=args.memory_budget or None,
        levers=args.levers or None,
        launches=launches,
        procs=args.procs,
        busy=args.busy,
    )
    script = Path(__file__).resolve()
    rows = []
    for launch_no in range(1, launches + 1):  # interleaved: launch 1 of every model, then launch 2...
        for model in models:
            run_dir = args.out / "decision_runs" / f"{model}-l{launch_no}"
            print(f"[benchmark] {model} launch {launch_no} ...", file=sys.stderr, flush=True)
            worker_args = ["--worker", model, "--worker-dir", str(run_dir.resolve())]
            options = [
                f"--memory-budget={args.memory_budget}",
                f"--levers={args.levers}",
                f"--procs={args.procs}",
            ]
            with busy_machine(args.busy, seed=launch_no):
                launch(script, [*worker_args, *options], run_dir, args.timeout)
            rows.append(read_launch(model, launch_no, run_dir))
    rows.sort(key=lambda r: (models.index(r["model"]), r["launch"]))
    write_results(args.out, "decision_repeatability", markdown(rows), {"environment": env, "rows": rows})
    return 0 if all(r["planned"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
