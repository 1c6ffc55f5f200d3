"""Applied TF plans, predicted against measured step time, Horovod + TensorFlow: one row per (model,
processes, plan kind).

For each Keras model of ``examples/train_horovod_tf.py`` and each process count, runs the example in
mode "apply" ``--repeats`` times, each in fresh processes (the launcher of `runs.py`) and with no
kept plan (``--plan none``). Each run records a window, the planner prices the TF candidates (bf16
uniform and per op type, with 2+ processes gradient groups; `planner/tf_plans.py`) and the best
predicted plan is applied and verified. From each run: the chosen plan's kind, its predicted step
time (plan.json / verification.json) and the step time measured under it (verification.json: the
median of the slowest rank's unprofiled calls), the baseline measured in the same run (report.json),
and whether the plan was kept or rolled back; a run whose planner kept the recorded configuration
says so.

With 2+ processes the apply runs record Horovod's timeline (``--horovod-timeline``), from which the
fusion and gradient-groups plans are priced; it keeps a core busy on rank 0 for the whole run
(`integrations/horovod_tf/fusion.py`), so those runs' figures, baseline included, are slower than a
run without it. Fusion threshold and cycle time apply at the next launch only: the fastest predicted
settings are priced here on the apply run's traces (`planner/tensor_fusion.choose_settings`, as the
planner's table shows them); where they are predicted faster than the recorded ones, the same job is
launched twice more in mode "report", once with their ``HOROVOD_FUSION_THRESHOLD`` /
``HOROVOD_CYCLE_TIME`` and once without them (which goes first alternates between repeats), and each
launch's report.json gives the measured step time. A launch whose trace does not show the settings
in effect counts as failed.

Each table cell is the median over the repeats (error: the median of each run's own predicted /
measured - 1). Writes ``<out>/horovod_tf_plans.md`` and ``.json`` (the table's rows and every run's
figures); the runs go under ``<out>/horovod_tf_plan_runs/``. Exits non-zero if any launch wrote no
report.json or plan.json.

    python benchmarks/horovod_tf_plans.py [--models mlp,cnn] [--procs 1,2] [--repeats 3]
        [--batch-size 64] [--verify-steps 3] [--out benchmarks/results]
    python benchmarks/horovod_tf_plans.py --quick     # smoke run: mlp, 1 and 2 processes, once

A plan whose bf16 op types are exactly those TF's uniform rewrite ran is the configuration the bf16
probe profiled and timed: its predicted figure is the change those calls measured in turns with
the recorded step, where told apart from its replay (in-sample), and its row says so ("bf16
uniform, a reconstruction"); the other plans' figures are predictions of configurations no call ran
before they were applied.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from horovod_tf_accuracy import TIMEOUT_S, each_run, example_command, finish, horovod_arguments, quick
from runs import launch_command, priced_without, say_allocator, stderr_tail

from qsync_callback.jsonio import read_json
from qsync_callback.mean_band import change_pct
from qsync_callback.plan import Plan
from qsync_callback.planner.tensor_fusion import choose_settings
from qsync_callback.planner.tf_plans import reconstructs_probe
from qsync_callback.predictor.op_precision import rewrite_change
from qsync_callback.predictor.predict import Predictor
from qsync_callback.predictor.tensor_fusion import can_price_fusion
from qsync_callback.recorder.tf_recorder import PROBE_RUN
from qsync_callback.recorder.trace import load_trace_dir
from qsync_callback.recorder.xspace import convert_xspace, find_xspace, load_xspace

FUSION = "fusion threshold + cycle time"
FUSION_ENV = ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME")  # Horovod's names
NONE = "none (recorded configuration kept)"
RECONSTRUCTION = "a reconstruction"
NOTE_CHARS = 160  # of a failure's reason, in the table (the JSON has it whole)
NAME_CHARS = 24  # longer words of a reason (generated graph and node names) are left out of the table


def run(
    model: str,
    procs: int,
    batch_size: int,
    verify_steps: int,
    run_dir: Path,
    mode: str = "apply",
    env: dict[str, str | None] | None = None,
) -> tuple[int, float]:
    """One run of the example in ``mode`` (its default threads), with ``env`` set (a None value:
    unset); returns (exit code, wall seconds)."""
    extra = ["--mode", mode, "--verify-steps", str(verify_steps)]
    if mode == "apply":
        extra += ["--plan", "none"]  # plan afresh: no kept plan read or written
    if mode == "apply" and procs > 1:  # the fusion and groups plans are priced from Horovod's timeline
        extra += ["--horovod-timeline"]
    cmd = example_command(model, procs, batch_size, run_dir, extra)
    if env:
        unset = [arg for key, value in env.items() if value is None for arg in ("-u", key)]
        cmd = ["env", *unset, *(f"{k}={v}" for k, v in env.items() if v is not None), *cmd]
    return launch_command(cmd, run_dir, TIMEOUT_S)


def plan_kind(plan: Plan, reconstruction: bool = False) -> str:
    """What a plan changes, as the table names it; ``reconstruction``: its bf16 op types are those
    TF's uniform rewrite ran, which the bf16 probe profiled (`tf_plans.reconstructs_probe`)."""
    low = sorted(t for t, p in plan.op_precision.items() if p == "bf16")
    bf16 = f"bf16 op types ({', '.join(low)})" if low else ""
    if bf16 and reconstruction:
        bf16 = f"bf16 uniform, {RECONSTRUCTION} ({', '.join(low)})"
    parts = [bf16, "gradient groups" if plan.buckets else ""]
    return " + ".join(p for p in parts if p) or NONE


def applied_run(model: str, procs: int, repeat: int, run_dir: Path) -> dict[str, Any]:
    """The run's record: the chosen plan's kind, predicted and measured step time, the baseline, and
    whether it was kept."""
    qsync = run_dir / "qsync"
    report = read_json(qsync / "report.json", what="report")
    baseline_ms = report["measured"]["step_ms"]
    kept = Plan.load(qsync / "plan.json")
    record = {
        "model": model,
        "procs": procs,
        "repeat": repeat,
        "plan": NONE,
        "predicted_ms": (kept.prediction or {}).get("step_ms"),
        "measured_ms": None,
        "error_pct": None,
        "baseline_ms": baseline_ms,
        "outcome": "not planned",
        "error": None,
        "detail": None,
        "probe_ms": None,
        "change_gap_pts": None,
        "replayed_change_gap_pts": None,
        "probe_change_pct": None,
        "probe_noise_pct": None,
        "probe_change_gap_pts": None,
        "noise_pct": report["measured"]["step_ms_noise_pct"],
        "recorded_again": report.get("recorded_again"),
    }
    if (qsync / "verification.json").exists():
        verification = read_json(qsync / "verification.json", what="verification")
        applied = Plan.from_dict(verification["plan"])
        traces = load_trace_dir(qsync / "trace")
        rebuilt = reconstructs_probe(traces, applied)
        record["plan"] = plan_kind(applied, rebuilt)
        if rebuilt:  # what it reconstructs: the probe's profiled calls of that configuration
            record["probe_ms"] = probe_step_ms(qsync)
        record["predicted_ms"] = verification["predicted"]["step_ms"]
        record["measured_ms"] = verification["measured"]["step_ms"]
        record["outcome"] = "kept" if verification["decision"] == "keep" else "rolled back"
        record["detail"] = verification["reason"]
        turns = verification.get("alternation") or {}
        recorded_ms = report["predicted"]["step_ms"]
        if turns.get("change_pct") is not None and recorded_ms:
            predicted_change = change_pct(record["predicted_ms"], recorded_ms)
            record["change_gap_pts"] = abs(predicted_change - turns["change_pct"])
            replayed = priced_without(traces, applied, {"turns"}).step_ms  # the probe's timed calls unused
            record["replayed_change_gap_pts"] = abs(change_pct(replayed, recorded_ms) - turns["change_pct"])
            in_probe = rewrite_change(traces)
            if rebuilt and in_probe is not None:  # the probe's change in turns, whatever its noise
                record["probe_change_pct"] = in_probe["change_pct"]
                record["probe_noise_pct"] = in_probe["noise_pct"]
                record["probe_change_gap_pts"] = abs(in_probe["change_pct"] - turns["change_pct"])
    record["error_pct"] = change_pct(record["predicted_ms"], record["measured_ms"])
    return record


def probe_step_ms(qsync: Path) -> float | None:
    """The median wall time of the bf16 probe's profiled calls (rank 0's TF uniform rewrite; None
    when its profile is missing)."""
    try:
        converted = convert_xspace(
            load_xspace(find_xspace(qsync / "trace" / "rank0" / "profile" / PROBE_RUN))
        )
    except Exception:  # noqa: BLE001 - an optional figure
        return None
    return statistics.median(s.dur_us / 1e3 for s in converted["steps"])


def _settings_in_effect(run_dir: Path, settings: dict[str, Any]) -> bool:
    """Whether rank 0's trace of a launch shows ``settings`` (a plan's communication) set by env."""
    trace = read_json(run_dir / "qsync" / "trace" / "rank0" / "trace.json", what="trace")
    communication = trace["communication"]
    return set(FUSION_ENV) <= set(communication["from_env"]) and all(
        math.isclose(float(communication[key]), float(value)) for key, value in settings.items()
    )


def fusion_run(
    model: str, procs: int, repeat: int, apply_dir: Path, launch: Callable[..., tuple[int, float]]
) -> tuple[dict[str, Any], list[str]]:
    """The fusion record of a repeat: the fastest predicted settings on the apply run's traces, and
    (where they are predicted faster than the recorded ones) the step time measured by two launches
    in mode "report", with and without the settings' env; ``launch(run_dir, env=...)`` runs one.
    Returns the record and the failed launches."""
    traces = load_trace_dir(apply_dir / "qsync" / "trace")
    why_not = can_price_fusion(traces)
    choice = choose_settings(Predictor(traces)) if why_not is None else None
    faster = choice is not None and choice.prediction.step_ms < choice.baseline.step_ms
    settings = choice.plan.communication if faster else {}
    record = {
        "model": model,
        "procs": procs,
        "repeat": repeat,
        "plan": FUSION,
        "predicted_ms": choice.prediction.step_ms if faster else None,
        "predicted_recorded_settings_ms": choice.baseline.step_ms if choice is not None else None,
        "settings": settings or None,
        "measured_ms": None,
        "error_pct": None,
        "baseline_ms": None,
        "outcome": "next launch" if settings else "not planned",
        "error": None,
        "detail": None,
    }
    if not settings:
        record["detail"] = why_not or "recorded settings predicted best"
        return record, []
    threshold, cycle = settings["fusion_threshold_bytes"], settings["cycle_time_ms"]
    record["detail"] = f"{threshold / 2**20:g} MiB, {cycle:g} ms"
    recorded_ms = record["predicted_recorded_settings_ms"]
    if recorded_ms is not None:
        record["detail"] += f"; predicted {recorded_ms:.2f} at the recorded settings"
    with_env = dict(zip(FUSION_ENV, (str(threshold), f"{cycle:g}"), strict=True))
    launches = [("baseline_ms", dict.fromkeys(FUSION_ENV)), ("measured_ms", with_env)]
    failures = []
    for key, env in launches if repeat % 2 else launches[::-1]:
        run_dir = apply_dir.with_name(f"{apply_dir.name}-{'fusion' if key == 'measured_ms' else 'default'}")
        rc, wall_s = launch(run_dir, env=env)
        print(f"{run_dir.name}: exit {rc} in {wall_s:.1f} s", file=sys.stderr, flush=True)
        try:
            report = read_json(run_dir / "qsync" / "report.json", what="report")
            if key == "measured_ms" and not _settings_in_effect(run_dir, settings):
                raise ValueError("the launch's trace does not show the plan's settings in effect")
        except Exception as exc:  # noqa: BLE001 - report every failed launch, then exit non-zero
            record["error"] = f"{run_dir.name}: {exc}"
            failures.append(f"{run_dir.name}: exit {rc}, {exc}\n{stderr_tail(run_dir)}")
            continue
        record[key] = report["measured"]["step_ms"]
    record["error_pct"] = change_pct(record["predicted_ms"], record["measured_ms"])
    return record, failures


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def table_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, processes, plan kind): medians over the repeats, every run's outcome."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["model"], r["procs"], r["plan"]), []).append(r)
    rows = []
    for (model, procs, plan), runs in groups.items():  # in the order they ran
        outcomes = Counter(r["outcome"] for r in runs)
        notes = [n for n in dict.fromkeys(r["error"] or r["detail"] for r in runs) if n]
        rows.append(
            {
                "model": model,
                "procs": procs,
                "plan": plan,
                "runs": len(runs),
                "predicted_ms": _median([r["predicted_ms"] for r in runs]),
                "measured_ms": _median([r["measured_ms"] for r in runs]),
                "error_pct": _median([r["error_pct"] for r in runs]),
                "baseline_ms": _median([r["baseline_ms"] for r in runs]),
                "probe_ms": _median([r.get("probe_ms") for r in runs]),
                "change_gaps_pts": [r["change_gap_pts"] for r in runs if r.get("change_gap_pts") is not None],
                "probe_gaps_pts": [
                    r["probe_change_gap_pts"] for r in runs if r.get("probe_change_gap_pts") is not None
                ],
                "replayed_gaps_pts": [
                    r["replayed_change_gap_pts"] for r in runs if r.get("replayed_change_gap_pts") is not None
                ],
                "failed_runs": sum(r["error"] is not None for r in runs),
                "recorded_again": [r["recorded_again"] for r in runs if r.get("recorded_again")],
                "noises_pct": [r["noise_pct"] for r in runs if r.get("noise_pct") is not None],
                "outcome": ", ".join(f"{o} x{n}" if len(runs) > 1 else o for o, n in outcomes.items()),
                "notes": notes,
            }
        )
    return rows


def _ms(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def _note(text: str) -> str:
    """A reason, short: generated names left out, cut to `NOTE_CHARS`, ``|`` escaped."""
    text = " ".join(w if len(w) <= NAME_CHARS else "..." for w in text.split()).replace("|", "\\|")
    return text if len(text) <= NOTE_CHARS else text[: NOTE_CHARS - 3] + "..."


def markdown(rows: list[dict[str, Any]], failures: list[str], args: argparse.Namespace) -> str:
    lines = [
        "| model | procs | plan kind | predicted ms | measured ms | error % | probe's profiled ms "
        "| baseline measured ms | kept / rolled back | notes |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        measured = "failed" if r["measured_ms"] is None and r["failed_runs"] else _ms(r["measured_ms"])
        error = f"{r['error_pct']:+.1f}" if r["error_pct"] is not None else "-"
        lines.append(
            f"| {r['model']} | {r['procs']} | {r['plan']} | {_ms(r['predicted_ms'])} | {measured} "
            f"| {error} | {_ms(r['probe_ms'])} | {_ms(r['baseline_ms'])} | {r['outcome']} "
            f"| {'; '.join(map(_note, r['notes']))} |"
        )
    lines += [
        "",
        f"batch size {args.batch_size} per process, {args.verify_steps} recorded calls under the plan;"
        f" medians over {args.repeats} run(s); error = predicted / measured - 1 (each run's own pair,"
        " median). Fusion threshold + cycle time: predicted on the apply run's traces, measured by a"
        ' launch with its env in mode "report", baseline by one without it. A reconstruction: the plan'
        " is TF's uniform bf16 rewrite, which the bf16 probe profiled and timed (its profiled calls'"
        " median: the probe column); its predicted figure is the change the probe's timed calls measured"
        " in turns with the recorded step, or its replay where the two are within their combined noise.",
    ]
    gaps = [g for r in rows for g in r.get("change_gaps_pts", [])]
    replayed = [g for r in rows for g in r.get("replayed_gaps_pts", [])]
    probed = [g for r in rows for g in r.get("probe_gaps_pts", [])]
    if gaps:
        lines.append(
            "\nThe plan's predicted change (against the recorded configuration's predicted step) against "
            "its change measured in turns in the same process: |difference| median "
            f"{statistics.median(gaps):.1f} points over {len(gaps)} launches (mean "
            f"{statistics.fmean(gaps):.1f})"
            + (
                f"; priced without the probe's timed calls, from its profiled op times alone: median "
                f"{statistics.median(replayed):.1f} (mean {statistics.fmean(replayed):.1f})"
                if replayed
                else ""
            )
            + (
                f"; the reconstructions at the probe's change in turns, whatever its noise: median "
                f"{statistics.median(probed):.1f} over {len(probed)} (mean {statistics.fmean(probed):.1f})"
                if probed
                else ""
            )
            + "; the error column compares windows minutes apart, and holds the drift between them."
        )
    again = [why for r in rows for why in r.get("recorded_again", [])]
    noises = [n for r in rows for n in r.get("noises_pct", [])]
    if noises:
        lines.append(
            f"\nThe planned-on recordings' measured noise: +-{min(noises):.1f}% to +-{max(noises):.1f}% "
            f"(median +-{statistics.median(noises):.1f}%) over {len(noises)} launches; recorded again "
            f"before planning (`report.too_noisy_to_plan`): {len(again)}"
            + "".join(f"\n- {why}" for why in again)
        )
    lines += [f"FAILED: {f}" for f in failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = horovod_arguments(__doc__)
    parser.add_argument("--verify-steps", type=int, default=3)
    args = quick(parser.parse_args(argv))
    say_allocator()
    records, failures = [], []
    load_at_start = os.getloadavg()
    for model, procs, repeat, run_dir in each_run(args, "horovod_tf_plan_runs"):
        rc, wall_s = run(model, procs, args.batch_size, args.verify_steps, run_dir)
        print(f"{run_dir.name}: exit {rc} in {wall_s:.1f} s", file=sys.stderr, flush=True)
        try:
            records.append(applied_run(model, procs, repeat, run_dir))
            if procs > 1:
                launch = functools.partial(
                    run, model, procs, args.batch_size, args.verify_steps, mode="report"
                )
                record, failed = fusion_run(model, procs, repeat, run_dir, launch)
                records.append(record)
                failures += failed
        except Exception as exc:  # noqa: BLE001 - report every failed run, then exit non-zero
            failures.append(f"{run_dir.name}: exit {rc}, {exc}\n{stderr_tail(run_dir)}")
    rows = table_rows(records)
    table = markdown(rows, failures, args)
    return finish(args, "horovod_tf_plans", table, rows, failures, load_at_start, runs=records)


if __name__ == "__main__":
    sys.exit(main())
