"""Predicted against measured step time of the recorded configuration, Horovod + TensorFlow.

For each Keras model of ``examples/train_horovod_tf.py``, each process count and each thread
setting (``--settings``, `SETTINGS`; default: the example's own defaults), runs the example
(``python`` for one process, ``horovodrun --gloo`` for more) ``--repeats`` times, each in a fresh
process with the Recorder in mode "report", and reads each run's report.json and traces. The runs of
one repeat go one after the other in every (model, processes, setting), in an order that is reversed
from one repeat to the next, so that a drift of the machine spreads over all of them.

Per run: the measured step time (median of the slowest rank's unprofiled calls) and its spread
within the run ((p90 - p10) / median), the recorded (profiled) steps' median wall time, the
predicted step time (the replay with the calibrated profiler overhead subtracted,
`recorder/tf_recorder.ProfilerCalibration`, and what recording added beyond it taken from the run's
own timed calls, `event_costs.calibrate_on_steps`: calibrated on the run, so close to the measured
step by construction), recomputed here from the same traces, the prediction with the per-event
costs alone (out of sample: "loops' costs only") and with nothing subtracted; the profiler's cost
per event and per step.
Writes a markdown table (``<out>/horovod_tf_accuracy.md``) and the raw rows
(``<out>/horovod_tf_accuracy.json``). Exits non-zero if any run produced no report.

    python benchmarks/horovod_tf_accuracy.py [--models mlp,cnn,gru,resnet] [--procs 1,2] [--repeats 3]
        [--settings example] [--measure-steps N] [--batch-size 64] [--out benchmarks/results]
    python benchmarks/horovod_tf_accuracy.py --quick     # smoke run: mlp, 1 and 2 processes, once
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from runs import (
    bench_environment,
    installed_version,
    launch_command,
    na,
    profiler_share,
    range_noise_pct,
    say_allocator,
    stderr_tail,
    tf_environment,
    write_results,
)

from qsync_callback.jsonio import read_json
from qsync_callback.mean_band import change_pct
from qsync_callback.predictor.predict import predict
from qsync_callback.recorder.trace import load_trace_dir

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_horovod_tf.py"
TIMEOUT_S = 300.0
EXAMPLE_DEFAULTS = "example"
# thread settings a run can be made under: (the example's arguments, environment variables); the
# example's own defaults are the first (see its --help)
_T1 = ["--threads", "1"]
SETTINGS: dict[str, tuple[list[str], dict[str, str]]] = {
    EXAMPLE_DEFAULTS: ([], {}),
    "tf-pools": (["--threads", "0", "--pin", "none"], {}),  # TF's own pools: as many threads as cores, each
    "threads-1": ([*_T1, "--pin", "none"], {}),
    "intra-1-inter-2": ([*_T1, "--inter-threads", "2", "--pin", "none"], {}),
    "intra-2-inter-1": (["--threads", "2", "--inter-threads", "1", "--pin", "none"], {}),
    "cycle-0.2ms": ([*_T1, "--pin", "none", "--cycle-time-ms", "0.2"], {}),
    "cycle-5ms": ([*_T1, "--pin", "none", "--cycle-time-ms", "5"], {}),
    "omp-1": ([*_T1, "--pin", "none"], {"OMP_NUM_THREADS": "1"}),
    "pin-all": ([*_T1, "--pin", "all"], {}),
    "pin-compute": ([*_T1, "--pin", "compute"], {}),
    "pin-all-cycle-0.2ms": ([*_T1, "--pin", "all", "--cycle-time-ms", "0.2"], {}),
    "pin-all-cycle-5ms": ([*_T1, "--pin", "all", "--cycle-time-ms", "5"], {}),
}


def example_command(
    model: str,
    procs: int,
    batch_size: int,
    run_dir: Path,
    extra: Sequence[str] = (),
    setting: str = EXAMPLE_DEFAULTS,
) -> list[str]:
    """The command line of one run of the example (``horovodrun --gloo`` for more than one process),
    under ``setting``; its output goes under ``run_dir``."""
    args, env = SETTINGS[setting]
    example = [sys.executable, str(EXAMPLE), "--model", model, "--batch-size", str(batch_size), *args, *extra]
    example += ["--output-dir", str(run_dir / "qsync")]
    cmd = example
    if procs > 1:
        horovodrun = str(Path(sys.executable).with_name("horovodrun"))
        cmd = [horovodrun, "-np", str(procs), "-H", f"localhost:{procs}", "--gloo", *example]
    if env:
        cmd = ["env", *(f"{k}={v}" for k, v in env.items()), *cmd]
    return cmd


def read_row(
    model: str, procs: int, repeat: int, run_dir: Path, setting: str = EXAMPLE_DEFAULTS
) -> dict[str, Any]:
    """A run's figures, from its report.json and traces."""
    qsync = run_dir / "qsync"
    report = read_json(qsync / "report.json", what="report")
    traces = load_trace_dir(qsync / "trace")
    measured, predicted = report["measured"]["step_ms"], report["predicted"]["step_ms"]
    steps = len(traces[0].steps)
    charged = [sum(op.overhead_us + op.gap_overhead_us for op in t.ops) / steps / 1e3 for t in traces]
    share = profiler_share(traces, measured)  # takes the run's calibration out of the traces
    for trace in traces:  # the same traces with no profiler overhead subtracted either
        for op in trace.ops:
            op.overhead_us = op.gap_overhead_us = 0.0
    uncorrected = predict(traces).step_ms
    recorded = statistics.median(s.dur_us / 1e3 for s in traces[0].steps)
    return {
        "model": model,
        "procs": procs,
        "setting": setting,
        "repeat": repeat,
        "measured_ms": measured,
        "spread_pct": report["measured"]["step_ms_spread_pct"],
        "samples": report["measured"]["step_ms_samples"],
        "recorded_ms": recorded,
        "predicted_ms": predicted,
        "uncorrected_ms": uncorrected,
        "signed_error_pct": change_pct(predicted, measured),
        "uncorrected_error_pct": change_pct(uncorrected, measured),
        **share,
        "profiler_us_per_event": report["profiler_overhead_us"],
        "profiler_ms_per_step": max(charged),
    }


def _summary(values: list[float]) -> str:
    """Median and range: ``m [lo, hi]``."""
    return f"{statistics.median(values):+.1f} [{min(values):+.1f}, {max(values):+.1f}]"


def markdown(rows: list[dict[str, Any]], failures: list[str], batch_size: int) -> str:
    lines = [
        "| model | procs | setting | run | measured ms | spread % | recorded ms | predicted ms | error % "
        "| loops' costs only: error % | uncorrected error % | profiler us/event (op, executor, other) "
        "| profiler ms/step |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        costs = r["profiler_us_per_event"] or {}
        lines.append(
            f"| {r['model']} | {r['procs']} | {r['setting']} | {r['repeat']} | {r['measured_ms']:.2f} "
            f"| {r['spread_pct']:.1f} | {r['recorded_ms']:.2f} | {r['predicted_ms']:.2f} "
            f"| {r['signed_error_pct']:+.1f} | {na(r.get('loops_only_error_pct'), '+.1f')} "
            f"| {r['uncorrected_error_pct']:+.1f} "
            f"| {', '.join(f'{costs.get(k, 0):.2f}' for k in ('op', 'executor', 'other'))} "
            f"| {r['profiler_ms_per_step']:.3f} |"
        )
    lines += [
        "",
        "| model | procs | setting | runs | measured ms median [min, max] | run-to-run noise % "
        "| spread % median [min, max] | signed error % median [min, max] | median abs error within the noise "
        "| mean signed error % | loops' costs only: median abs, mean signed error % "
        "| uncorrected: mean signed error % |",
        "|---|---:|---|---:|---|---:|---|---|---|---:|---|---:|",
    ]
    keys = list(dict.fromkeys((r["model"], r["procs"], r["setting"]) for r in rows))
    for model, procs, setting in keys:
        group = [r for r in rows if (r["model"], r["procs"], r["setting"]) == (model, procs, setting)]
        measured = [r["measured_ms"] for r in group]
        spreads = [r["spread_pct"] for r in group]
        errors = [r["signed_error_pct"] for r in group]
        before = [r["uncorrected_error_pct"] for r in group]
        loops = [r["loops_only_error_pct"] for r in group if r.get("loops_only_error_pct") is not None]
        loops_cell = (
            f"{statistics.median(map(abs, loops)):.1f}, {statistics.mean(loops):+.1f}" if loops else "n/a"
        )
        noise = range_noise_pct(measured)
        within = "n/a" if noise is None else ("yes" if statistics.median(map(abs, errors)) <= noise else "no")
        lines.append(
            f"| {model} | {procs} | {setting} | {len(group)} | {statistics.median(measured):.2f} "
            f"[{min(measured):.2f}, {max(measured):.2f}] | {na(noise, '.1f')} "
            f"| {statistics.median(spreads):.1f} [{min(spreads):.1f}, {max(spreads):.1f}] "
            f"| {_summary(errors)} | {within} "
            f"| {statistics.mean(errors):+.1f} | {loops_cell} | {statistics.mean(before):+.1f} |"
        )
    lines += [
        "",
        f"batch size {batch_size} per process; error = predicted / measured - 1 (the prediction removes "
        "what recording added to the recorded steps, or adds what it took off, as the run's own "
        "timed calls show, so for the "
        "configuration recorded it is calibrated on the run); loops' costs only: without that, the "
        "calibration loops' per-event costs alone (out of sample); uncorrected: the same "
        "traces replayed with no profiler overhead subtracted; recorded: median wall time of the "
        "profiled steps (rank 0); spread: (p90 - p10) / median of the slowest rank's unprofiled calls; "
        "run-to-run noise: (max - min) / mean of the runs' measured medians",
    ]
    lines += [f"FAILED: {f}" for f in failures]
    return "\n".join(lines)


def horovod_arguments(description: str, models: str = "mlp,cnn") -> argparse.ArgumentParser:
    """The options every Horovod + TF benchmark takes (models, by default ``models``; process
    counts, repeats, batch, out, quick)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default=models)
    parser.add_argument("--procs", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true", help="smoke run: mlp, 1 and 2 processes, 1 repeat")
    return parser


def quick(args: argparse.Namespace) -> argparse.Namespace:
    """``--quick``: the MLP, 1 and 2 processes, one repeat (into ``--out``, as every benchmark's)."""
    if args.quick:
        args.models, args.procs, args.repeats = "mlp", "1,2", 1
    return args


def setting_runs(
    args: argparse.Namespace, folder: str, settings: Sequence[str] = (EXAMPLE_DEFAULTS,)
) -> Iterator[tuple[str, int, str, int, Path]]:
    """(model, processes, setting, repeat, run folder under ``<out>/<folder>``) for every run to
    make: one repeat of every (model, processes, setting) after another, every other repeat in the
    reverse order (a drift of the machine spreads over all of them)."""
    combos = [
        (model, int(procs), setting)
        for model in args.models.split(",")
        for procs in args.procs.split(",")
        for setting in settings
    ]
    for repeat in range(1, args.repeats + 1):
        for model, procs, setting in combos if repeat % 2 else combos[::-1]:
            name = f"{model}-p{procs}-r{repeat}" + (f"-{setting}" if setting != EXAMPLE_DEFAULTS else "")
            yield model, procs, setting, repeat, args.out / folder / name


def each_run(args: argparse.Namespace, folder: str) -> Iterator[tuple[str, int, int, Path]]:
    """(model, processes, repeat, run folder under ``<out>/<folder>``) for every run to make, under
    the example's defaults (`setting_runs`)."""
    for model, procs, _, repeat, run_dir in setting_runs(args, folder):
        yield model, procs, repeat, run_dir


def horovod_environment(args: argparse.Namespace, load_at_start: tuple[float, ...]) -> dict:
    """The machine and versions a Horovod + TF benchmark ran on, for its JSON."""
    return bench_environment(
        **tf_environment(),
        tensorflow=installed_version("tensorflow-cpu", "tensorflow"),
        horovod=installed_version("horovod"),
        load_avg_at_start=load_at_start,
        load_avg_at_end=os.getloadavg(),
        batch_size=args.batch_size,
        repeats=args.repeats,
        quick=args.quick,
        **({"verify_steps": args.verify_steps} if hasattr(args, "verify_steps") else {}),
    )


def finish(
    args: argparse.Namespace,
    name: str,
    table: str,
    rows: list[dict[str, Any]],
    failures: list[str],
    load_at_start: tuple[float, ...],
    **extra: Any,
) -> int:
    """Write a Horovod + TF benchmark's ``table`` and JSON (rows, failures, environment and
    ``extra``); the exit code: 1 if any run failed."""
    raw = {
        "environment": horovod_environment(args, load_at_start),
        "rows": rows,
        "failures": failures,
        **extra,
    }
    write_results(args.out, name, table, raw)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = horovod_arguments(__doc__, models="mlp,cnn,gru,resnet")
    parser.add_argument(
        "--settings",
        default=EXAMPLE_DEFAULTS,
        help=f"comma-separated thread settings to compare, of: {', '.join(SETTINGS)}",
    )
    parser.add_argument("--measure-steps", type=int, help="the example's --measure-steps (default: its own)")
    args = quick(parser.parse_args(argv))
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    extra = ["--measure-steps", str(args.measure_steps)] if args.measure_steps is not None else []
    say_allocator()
    rows, failures = [], []
    load_at_start = os.getloadavg()
    for model, procs, setting, repeat, run_dir in setting_runs(args, "horovod_tf_runs", settings):
        command = example_command(model, procs, args.batch_size, run_dir, extra, setting)
        rc, wall_s = launch_command(command, run_dir, TIMEOUT_S)
        try:
            rows.append(read_row(model, procs, repeat, run_dir, setting))
        except Exception as exc:  # noqa: BLE001 - report every failed run, then exit non-zero
            failures.append(f"{run_dir.name}: exit {rc}, {exc}\n{stderr_tail(run_dir)}")
        print(f"{run_dir.name}: exit {rc} in {wall_s:.1f} s", file=sys.stderr, flush=True)
    table = markdown(rows, failures, args.batch_size)
    return finish(args, "horovod_tf_accuracy", table, rows, failures, load_at_start, settings=settings)


if __name__ == "__main__":
    sys.exit(main())
