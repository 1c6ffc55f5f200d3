"""Predicted against measured step time of the recorded configuration, Horovod + TensorFlow.

For each Keras model of ``examples/train_horovod_tf.py`` and each process count, runs the example
(``python`` for one process, ``horovodrun --gloo`` for more) ``--repeats`` times, each in a fresh
process with the Recorder in mode "report", and reads each run's report.json. Writes a markdown
table (``<out>/horovod_tf_accuracy.md``) and the raw rows (``<out>/horovod_tf_accuracy.json``).
Exits non-zero if any run produced no report.

    python benchmarks/horovod_tf_accuracy.py [--models mlp,cnn] [--procs 1,2] [--repeats 3]
        [--batch-size 64] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from runs import environment, installed_version, launch_command, stderr_tail, write_results

from qsync_callback.jsonio import read_json

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_horovod_tf.py"
TIMEOUT_S = 300.0


def run(
    model: str, procs: int, batch_size: int, run_dir: Path, extra: Sequence[str] = ()
) -> tuple[int, float]:
    """One run of the example (with the ``extra`` arguments); returns (exit code, wall seconds).
    Logs go into ``run_dir``."""
    example = [sys.executable, str(EXAMPLE), "--model", model, "--batch-size", str(batch_size), *extra]
    threads = max(1, (os.cpu_count() or 1) // procs)  # one process per core share: no oversubscription
    example += ["--threads", str(threads), "--output-dir", str(run_dir / "qsync")]
    cmd = example
    if procs > 1:
        horovodrun = str(Path(sys.executable).with_name("horovodrun"))
        cmd = [horovodrun, "-np", str(procs), "-H", f"localhost:{procs}", "--gloo", *example]
    return launch_command(cmd, run_dir, TIMEOUT_S)


def read_row(model: str, procs: int, repeat: int, run_dir: Path) -> dict[str, Any]:
    report = read_json(run_dir / "qsync" / "report.json", what="report")
    return {
        "model": model,
        "procs": procs,
        "repeat": repeat,
        "measured_ms": report["measured"]["step_ms"],
        "spread_pct": report["measured"]["step_ms_spread_pct"],
        "predicted_ms": report["predicted"]["step_ms"],
        "signed_error_pct": 100.0 * (report["predicted"]["step_ms"] / report["measured"]["step_ms"] - 1),
    }


def markdown(rows: list[dict[str, Any]], failures: list[str], batch_size: int) -> str:
    lines = [
        "| model | procs | run | measured ms | spread % | predicted ms | error % |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['procs']} | {r['repeat']} | {r['measured_ms']:.2f} | {r['spread_pct']:.1f} "
            f"| {r['predicted_ms']:.2f} | {r['signed_error_pct']:+.1f} |"
        )
    lines += ["", "| model | procs | median abs error % | signed errors % |", "|---|---:|---:|---|"]
    pairs = sorted({(r["model"], r["procs"]) for r in rows}, key=lambda p: (p[0], p[1]))
    for model, procs in pairs:
        errors = [r["signed_error_pct"] for r in rows if r["model"] == model and r["procs"] == procs]
        signed = ", ".join(f"{e:+.1f}" for e in errors)
        lines.append(f"| {model} | {procs} | {statistics.median(abs(e) for e in errors):.1f} | {signed} |")
    lines += ["", f"batch size {batch_size} per process; error = predicted / measured - 1"]
    lines += [f"FAILED: {f}" for f in failures]
    return "\n".join(lines)


def horovod_arguments(description: str) -> argparse.ArgumentParser:
    """The options every Horovod + TF benchmark takes (models, process counts, repeats, batch, out)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--procs", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return parser


def each_run(args: argparse.Namespace, folder: str) -> Iterator[tuple[str, int, int, Path]]:
    """(model, processes, repeat, run folder under ``<out>/<folder>``) for every run to make."""
    for model in args.models.split(","):
        for procs in (int(p) for p in args.procs.split(",")):
            for repeat in range(1, args.repeats + 1):
                yield model, procs, repeat, args.out / folder / f"{model}-p{procs}-r{repeat}"


def horovod_environment(args: argparse.Namespace, load_at_start: tuple[float, ...]) -> dict:
    """The machine and versions a Horovod + TF benchmark ran on, for its JSON."""
    return environment(
        tensorflow=installed_version("tensorflow-cpu", "tensorflow"),
        horovod=installed_version("horovod"),
        load_avg_at_start=load_at_start,
        batch_size=args.batch_size,
        repeats=args.repeats,
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
    args = horovod_arguments(__doc__).parse_args(argv)
    rows, failures = [], []
    load_at_start = os.getloadavg()
    for model, procs, repeat, run_dir in each_run(args, "horovod_tf_runs"):
        rc, wall_s = run(model, procs, args.batch_size, run_dir)
        try:
            rows.append(read_row(model, procs, repeat, run_dir))
        except Exception as exc:  # noqa: BLE001 - report every failed run, then exit non-zero
            failures.append(f"{run_dir.name}: exit {rc}, {exc}\n{stderr_tail(run_dir)}")
        print(f"{run_dir.name}: exit {rc} in {wall_s:.1f} s", file=sys.stderr, flush=True)
    return finish(
        args, "horovod_tf_accuracy", markdown(rows, failures, args.batch_size), rows, failures, load_at_start
    )


if __name__ == "__main__":
    sys.exit(main())
