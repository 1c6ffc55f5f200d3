"""Predicted against measured peak memory of Horovod + TensorFlow runs: the recorded configuration and
the bf16 plans, measured by TF's own allocator.

For each Keras model of ``examples/train_horovod_tf.py`` (an MLP, a CNN, an embedding +
bidirectional GRU, a residual CNN with batch norm) and each process count, runs the example
``--repeats`` times, each in fresh processes, in mode "apply" (which records, reports, plans by op
type, applies the plan on every rank, verifies it and keeps it or rolls it back):

- **recorded configuration** (report.json): the measured peak, TF's allocator's own
  (``tf.config.experimental.get_memory_info``, reset at each timed step's start: the largest of the
  timed steps, with their median and smallest), against the predicted one (TF's BFC allocator
  simulated on the recorded steps' allocations, `predictor/bfc_allocator.py`, and calibrated on the
  allocator's own readings in the recorded steps, `memory.allocator_offset`: for this configuration
  that is a measurement of other steps than the timed ones) and against the simulation alone; the
  step time too;
- **the plan** (verification.json, when one was applied): its measured peak (the verify window's
  timed steps) against its predicted one (its bf16 ops' allocations halved and its casts added,
  `predictor/op_precision.op_type_lives`);
- **TF's uniform bf16 rewrite** (``--uniform``, on by default), whichever plan the run chose: the
  uniform plan (`tf_plans.uniform_plan`) priced on the apply run's traces, then applied from the
  first call of a run of its own in mode "report" (``--plan``), whose timed steps measure its peak.
  Its predicted peak is calibrated on what TF's allocator read in the bf16 probe's profiled steps,
  which ran that rewrite (`op_precision.rewrite_reading`: a reconstruction, in-sample); beside it
  the same tensors calibrated on the recorded configuration's reading instead, and the simulation
  alone.

The runs of one repeat go one after the other in every (model, processes), in an order reversed
from one repeat to the next. Writes ``<out>/tf_memory.md`` and ``<out>/tf_memory.json``; exits
non-zero if any run produced no report. The runs have TF's oneDNN on (``TF_ENABLE_ONEDNN_OPTS=1``
unless the environment sets it): without it TF's CPU allocator keeps no statistics, and TF leaves it
off by itself on some CPUs (this project's VMs without AVX-512); the table's line says which.

    python benchmarks/tf_memory.py [--models mlp,cnn,gru,resnet] [--procs 1,2] [--repeats 2]
        [--batch-size 32] [--no-uniform] [--out benchmarks/results]
    python benchmarks/tf_memory.py --quick     # smoke run: mlp and gru, 1 process, once
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from horovod_tf_accuracy import TIMEOUT_S, example_command
from runs import (
    bench_environment,
    priced_without,
    profiler_share,
    range_noise_pct,
    stderr_tail,
    tf_environment,
    write_results,
)

from qsync_callback.jsonio import read_json
from qsync_callback.mean_band import change_pct
from qsync_callback.planner.tf_plans import uniform_plan
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.trace import load_trace_dir
from qsync_callback.units import format_bytes

MODELS = ("mlp", "cnn", "gru", "resnet")
TARGET_PCT = 5.0
WINDOW = ["--warmup-steps", "10", "--profile-steps", "5", "--measure-steps", "20", "--verify-steps", "3"]


def run_once(model: str, procs: int, batch_size: int, run_dir: Path) -> dict[str, Any] | str:
    """One run in mode apply (a plan planned afresh); its row, or why there is none."""
    extra = [*WINDOW, "--mode", "apply", "--plan", "none"]
    cmd = example_command(model, procs, batch_size, run_dir, extra)
    run_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S * 2)
    (run_dir / "stdout.log").write_text(done.stdout)
    (run_dir / "stderr.log").write_text(done.stderr)
    qsync = run_dir / "qsync"
    if done.returncode != 0 or not (qsync / "report.json").exists():
        return f"{model} {procs}p: rc={done.returncode}: {stderr_tail(run_dir)}"
    report = read_json(qsync / "report.json", what="report")
    measured, predicted = report["measured"], report["predicted"]
    row = {
        "model": model,
        "procs": procs,
        "peak_bytes": measured["peak_bytes"],
        "peak_median_bytes": measured["peak_bytes_median"],
        "peak_min_bytes": measured["peak_bytes_min"],
        "peak_steps": measured["peak_steps"],
        "predicted_peak_bytes": predicted["peak_bytes"],
        "peak_error_pct": change_pct(predicted["peak_bytes"], measured["peak_bytes"]),
        "simulated_peak_bytes": predicted.get("peak_bytes_simulated"),
        "simulated_error_pct": change_pct(predicted.get("peak_bytes_simulated"), measured["peak_bytes"]),
        "peak_median_error_pct": change_pct(predicted["peak_bytes"], measured["peak_bytes_median"]),
        "step_ms": measured["step_ms"],
        "step_error_pct": change_pct(predicted["step_ms"], measured["step_ms"]),
        **profiler_share(load_trace_dir(qsync / "trace"), measured["step_ms"]),
        "plan": None,
    }
    if (qsync / "verification.json").exists():
        verification = read_json(qsync / "verification.json", what="verification")
        plan = verification.get("plan") or {}  # the plan verified (plan.json: the one kept)
        low = sorted(t for t, p in (plan.get("op_precision") or {}).items() if p != "fp32")
        row["plan"] = {
            "op_types": low,
            "decision": verification.get("decision"),
            "peak_bytes": verification["measured"]["peak_bytes"],
            "predicted_peak_bytes": verification["predicted"]["peak_bytes"],
            "peak_error_pct": change_pct(
                verification["predicted"]["peak_bytes"], verification["measured"]["peak_bytes"]
            ),
        }
    return row


def run_uniform(
    model: str, procs: int, batch_size: int, run_dir: Path, apply_dir: Path
) -> dict[str, Any] | str:
    """TF's uniform bf16 rewrite, priced on the apply run's traces (``apply_dir``) and run in mode
    report from the first call; its figures, or why there are none."""
    traces = load_trace_dir(apply_dir / "qsync" / "trace")
    predictor = Predictor(traces)
    plan = uniform_plan(predictor)
    if not plan.op_precision:
        return f"{model} {procs}p: the bf16 probe measured no op type at bf16"
    predicted = predictor.predict(plan)
    plan.prediction = predicted.figures()
    profiled_only = priced_without(traces, plan, {"step_peak_bytes", "turns"})
    on_recorded = priced_without(traces, plan, {"recorded_peak_bytes", "step_peak_bytes"}).peak_bytes
    run_dir.mkdir(parents=True, exist_ok=True)
    plan.save(run_dir / "uniform_plan.json")
    extra = [*WINDOW[:6], "--mode", "report", "--plan", str(run_dir / "uniform_plan.json")]
    done = subprocess.run(
        example_command(model, procs, batch_size, run_dir, extra),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S * 2,
    )
    (run_dir / "stdout.log").write_text(done.stdout)
    (run_dir / "stderr.log").write_text(done.stderr)
    report_path = run_dir / "qsync" / "report.json"
    if done.returncode != 0 or not report_path.exists():
        return f"{model} {procs}p uniform bf16: rc={done.returncode}: {stderr_tail(run_dir)}"
    measured = read_json(report_path, what="report")["measured"]
    return {
        "op_types": sorted(plan.op_precision),
        "peak_bytes": measured["peak_bytes"],
        "peak_median_bytes": measured["peak_bytes_median"],
        "peak_min_bytes": measured["peak_bytes_min"],
        "predicted_peak_bytes": predicted.peak_bytes,
        "peak_error_pct": change_pct(predicted.peak_bytes, measured["peak_bytes"]),
        "peak_median_error_pct": change_pct(predicted.peak_bytes, measured["peak_bytes_median"]),
        "profiled_only_peak_bytes": profiled_only.peak_bytes,
        "profiled_only_error_pct": change_pct(profiled_only.peak_bytes, measured["peak_bytes"]),
        "replayed_step_ms": profiled_only.step_ms,
        "replayed_step_error_pct": change_pct(profiled_only.step_ms, measured["step_ms"]),
        "on_recorded_peak_bytes": on_recorded,
        "on_recorded_error_pct": change_pct(on_recorded, measured["peak_bytes"]),
        "simulated_peak_bytes": predicted.peak_bytes_simulated,
        "simulated_error_pct": change_pct(predicted.peak_bytes_simulated, measured["peak_bytes"]),
        "step_ms": measured["step_ms"],
        "predicted_step_ms": predicted.step_ms,
        "step_error_pct": change_pct(predicted.step_ms, measured["step_ms"]),
    }


def _bytes(value: int | None) -> str:
    return "n/a" if value is None else format_bytes(value)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}%"


def _step_sentence(group: list[dict[str, Any]]) -> str:
    """The step-time figures of a group of rows: calibrated on each run, and with the loops' costs alone."""
    steps = [abs(r["step_error_pct"]) for r in group if r["step_error_pct"] is not None]
    loops = [r["loops_only_error_pct"] for r in group if r.get("loops_only_error_pct") is not None]
    if not steps:
        return ""
    sentence = (
        f" Step time: |error| median {statistics.median(steps):.1f}% (calibrated on the run's own "
        "timed calls: what recording added to the recorded ones is taken off, what it took off is added)"
    )
    if loops:
        sentence += (
            f"; with the calibration loops' per-event costs alone |error| median "
            f"{statistics.median(abs(e) for e in loops):.1f}%, signed mean {statistics.fmean(loops):+.1f}%"
        )
    return sentence + "."


def markdown(rows: list[dict[str, Any]], failures: list[str], batch_size: int) -> str:
    lines = [
        f"Batch {batch_size} per process. Peaks are TF's allocator's (chunks in use; on the CPU, requests "
        "of 256 KiB and more), per rank, the largest rank's.\n",
        "| model | processes | measured peak: largest (median, smallest) of the timed steps | predicted "
        "| error vs largest | error vs median | simulation alone (error vs largest) | step ms (error; "
        "loops' costs only) | plan applied: measured peak | predicted | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        plan = r["plan"]
        plan_cells = "| - | - | - |"
        if plan is not None:
            plan_cells = (
                f"| {', '.join(plan['op_types']) or 'fp32'} ({plan['decision']}): "
                f"{format_bytes(plan['peak_bytes'])} | {format_bytes(plan['predicted_peak_bytes'])} "
                f"| {_pct(plan['peak_error_pct'])} |"
            )
        lines.append(
            f"| {r['model']} | {r['procs']} | {format_bytes(r['peak_bytes'])} "
            f"({format_bytes(r['peak_median_bytes'])}, {format_bytes(r['peak_min_bytes'])}) "
            f"| {format_bytes(r['predicted_peak_bytes'])} | {_pct(r['peak_error_pct'])} "
            f"| {_pct(r['peak_median_error_pct'])} | {_bytes(r.get('simulated_peak_bytes'))} "
            f"({_pct(r.get('simulated_error_pct'))}) | {r['step_ms']:.1f} ({_pct(r['step_error_pct'])}; "
            f"{_pct(r.get('loops_only_error_pct'))}) " + plan_cells
        )
    spreads = rewrite_peak_spreads(rows)
    for procs in sorted({r["procs"] for r in rows}):
        group = [r for r in rows if r["procs"] == procs]
        largest = [abs(r["peak_error_pct"]) for r in group if r["peak_error_pct"] is not None]
        median = [abs(r["peak_median_error_pct"]) for r in group if r["peak_median_error_pct"] is not None]
        plans = [
            abs(r["plan"]["peak_error_pct"])
            for r in group
            if r["plan"] and r["plan"]["peak_error_pct"] is not None
        ]
        noise = statistics.median(
            range_noise_pct([r["step_ms"] for r in group if r["model"] == m]) or 0.0
            for m in {r["model"] for r in group}
        )
        within = sum(e <= TARGET_PCT for e in largest)
        alone = [abs(r["simulated_error_pct"]) for r in group if r.get("simulated_error_pct") is not None]
        simulated = (
            f"; the simulation alone (before its calibration on the recorded steps' readings) "
            f"{statistics.median(alone):.1f}% ({sum(e <= TARGET_PCT for e in alone)} of {len(alone)})"
            if alone
            else ""
        )
        spread = statistics.median(
            100 * (r["peak_bytes"] - r["peak_min_bytes"]) / r["peak_median_bytes"] for r in group
        )
        within_spread = sum(
            within_target_or_spread(r["plan"]["peak_error_pct"], spreads.get((r["model"], procs)))
            for r in group
            if r["plan"]
            and r["plan"]["peak_error_pct"] is not None
            and r.get("uniform")
            and r["plan"]["op_types"] == r["uniform"]["op_types"]
        )
        planned = (
            f"; plans' |peak error| median {statistics.median(plans):.1f}% over {len(plans)} "
            f"({sum(e <= TARGET_PCT for e in plans)} within {TARGET_PCT:g}%; of those that are TF's uniform "
            f"rewrite, {within_spread} within {TARGET_PCT:g}% or within its measured peak's run-to-run "
            "spread, below)"
            if plans
            else ""
        )
        lines.append(
            f"\n{procs} process(es), {len(group)} runs: recorded configuration, |peak error| against the "
            f"largest step median {statistics.median(largest):.1f}% ({within} of {len(largest)} within "
            f"{TARGET_PCT:g}%), against the median step {statistics.median(median):.1f}%"
            f"{simulated}{planned}; "
            "step-to-step spread of the measured peak (largest - smallest over median): median "
            f"{spread:.1f}%; "
            f"run-to-run noise of a model's step time (max - min over mean): median {noise:.1f}%."
            + _step_sentence(group)
        )
    lines += _uniform_lines(rows)
    lines += [f"\nFailed: {f}" for f in failures]
    return "\n".join(lines) + "\n"


def within_target_or_spread(error_pct: float, spread_pct: float | None) -> bool:
    """Whether an error is within `TARGET_PCT`, or within the measured figure's own run-to-run
    spread where that is known and wider."""
    return abs(error_pct) <= max(TARGET_PCT, spread_pct or 0.0)


def rewrite_peak_spreads(rows: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """Per (model, processes), the run-to-run spread (max - min over mean, %) of the measured peak of
    TF's uniform rewrite: the largest step of each of its own runs and of each verify window of a
    plan of the same op types (the same configuration), where there are two or more."""
    peaks: dict[tuple[str, int], list[int]] = {}
    for r in rows:
        u = r.get("uniform")
        if not u:
            continue
        key = (r["model"], r["procs"])
        peaks.setdefault(key, []).append(u["peak_bytes"])
        if r["plan"] and r["plan"]["op_types"] == u["op_types"]:
            peaks[key].append(r["plan"]["peak_bytes"])
    spreads = {key: range_noise_pct(values) for key, values in peaks.items()}
    return {key: spread for key, spread in spreads.items() if spread is not None}


def _uniform_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The uniform bf16 rewrite's table and its summary per process count (none without such rows)."""
    runs = [(r, r["uniform"]) for r in rows if r.get("uniform")]
    if not runs:
        return []
    lines = [
        "\nTF's uniform bf16 rewrite, run from the first call (its own run in mode report): measured "
        "against its peak priced on the apply run's traces, calibrated on the bf16 probe's readings "
        "(the product's figure: its five profiled steps and its reading calls), on its profiled steps "
        "alone, on the recorded configuration's reading instead, and the simulation alone; its step "
        "time predicted (the change the probe's timed calls measured in turns with the recorded step, or "
        "the replay where the two are within their combined noise) and replayed from the probe's "
        "profiled op times alone.\n",
        "| model | processes | op types | measured peak: largest (median, smallest) | predicted "
        "| error vs largest | error vs median | on the profiled steps alone (error) | on the recorded "
        "reading (error) | simulation alone (error) | step ms measured / predicted (error) | replayed "
        "alone (error) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, u in runs:
        lines.append(
            f"| {r['model']} | {r['procs']} | {', '.join(u['op_types'])} | {format_bytes(u['peak_bytes'])} "
            f"({format_bytes(u['peak_median_bytes'])}, {format_bytes(u['peak_min_bytes'])}) "
            f"| {format_bytes(u['predicted_peak_bytes'])} | {_pct(u['peak_error_pct'])} "
            f"| {_pct(u['peak_median_error_pct'])} | {_bytes(u.get('profiled_only_peak_bytes'))} "
            f"({_pct(u.get('profiled_only_error_pct'))}) | {format_bytes(u['on_recorded_peak_bytes'])} "
            f"({_pct(u['on_recorded_error_pct'])}) | {_bytes(u['simulated_peak_bytes'])} "
            f"({_pct(u['simulated_error_pct'])}) | {u['step_ms']:.1f} / {u['predicted_step_ms']:.1f} "
            f"({_pct(u['step_error_pct'])}) | {_ms(u.get('replayed_step_ms'))} "
            f"({_pct(u.get('replayed_step_error_pct'))}) |"
        )
    spreads = rewrite_peak_spreads(rows)
    for procs in sorted({r["procs"] for r, _ in runs}):
        group = [u for r, u in runs if r["procs"] == procs]
        noisy = [
            within_target_or_spread(u["peak_error_pct"], spreads.get((r["model"], procs)))
            for r, u in runs
            if r["procs"] == procs and u["peak_error_pct"] is not None
        ]
        errors = {
            name: [abs(u[key]) for u in group if u.get(key) is not None]
            for name, key in (
                ("calibrated on the probe's readings", "peak_error_pct"),
                ("on its profiled steps alone", "profiled_only_error_pct"),
                ("on the recorded reading", "on_recorded_error_pct"),
                ("the simulation alone", "simulated_error_pct"),
            )
        }
        parts = [
            f"{name} median {statistics.median(e):.1f}% ({sum(x <= TARGET_PCT for x in e)} of {len(e)} "
            f"within {TARGET_PCT:g}%)"
            for name, e in errors.items()
            if e
        ]
        steps = [abs(u["step_error_pct"]) for u in group if u["step_error_pct"] is not None]
        replayed = [
            abs(u["replayed_step_error_pct"]) for u in group if u.get("replayed_step_error_pct") is not None
        ]
        step_part = f" Step time |error|: median {statistics.median(steps):.1f}%" if steps else ""
        if steps and replayed:
            step_part += f" (replayed from the profiled op times alone {statistics.median(replayed):.1f}%)"
        spread_part = (
            " The measured peak of this configuration moves from launch to launch (its own runs and the "
            "verify windows of plans of the same op types, max - min over mean): "
            + ", ".join(f"{m} {s:.1f}%" for (m, p), s in sorted(spreads.items()) if p == procs)
            + f"; the product's figure is within {TARGET_PCT:g}% or within that spread in "
            f"{sum(noisy)} of {len(noisy)}."
        )
        lines.append(
            f"\n{procs} process(es), uniform bf16, |peak error| against the largest step: "
            + "; ".join(parts)
            + "."
            + (step_part + "." if step_part else "")
            + spread_part
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--procs", default="1,2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="smoke run: mlp and gru, 1 process, once")
    parser.add_argument(
        "--no-uniform", dest="uniform", action="store_false", help="skip the uniform bf16 rewrite's runs"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    models, procs, repeats = args.models.split(","), [int(p) for p in args.procs.split(",")], args.repeats
    if args.quick:
        models, procs, repeats = ["mlp", "gru"], [1], 1
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the runs inherit it (see the docstring)
    environment = bench_environment(**tf_environment(), repeats=repeats)
    cells = [(m, p) for m in models for p in procs]
    rows, failures = [], []
    for repeat in range(repeats):
        for model, n in cells if repeat % 2 == 0 else cells[::-1]:
            run_dir = args.out / "tf_memory_runs" / f"{model}-{n}p-{repeat}"
            result = run_once(model, n, args.batch_size, run_dir)
            if isinstance(result, str):
                failures.append(result)
                continue
            if args.uniform:
                uniform = run_uniform(
                    model, n, args.batch_size, run_dir.with_name(run_dir.name + "-uniform"), run_dir
                )
                if isinstance(uniform, str):
                    failures.append(uniform)
                else:
                    result["uniform"] = uniform
            rows.append({**result, "repeat": repeat})
    rows.sort(key=lambda r: (models.index(r["model"]), r["procs"], r["repeat"]))
    write_results(
        args.out,
        "tf_memory",
        markdown(rows, failures, args.batch_size),
        {"environment": environment, "rows": rows},
    )
    return 1 if failures or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
