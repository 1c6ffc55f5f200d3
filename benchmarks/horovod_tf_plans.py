"""Applied TF plans, predicted against measured step time, Horovod + TensorFlow.

For each Keras model of ``examples/train_horovod_tf.py`` and each process count, runs the example in
mode "apply" ``--repeats`` times, each in fresh processes (the launcher of `runs.py`), and reads each
run's verification.json: per plan kind tried on the live run (baseline, XLA, uniform bf16 mixed
precision, per-op-type mixed precision) the measured step time (median of its timed calls, slowest
rank) and, where the predictor prices it, the predicted one; and which was kept. Writes
``<out>/horovod_tf_plans.md`` and ``.json``; the runs go under ``<out>/horovod_tf_plan_runs/``.
Exits non-zero if any run wrote no verification.json.

    python benchmarks/horovod_tf_plans.py [--models mlp,cnn] [--procs 1,2] [--repeats 3]
        [--batch-size 64] [--verify-steps 10] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from horovod_tf_accuracy import EXAMPLE, ROOT, TIMEOUT_S, _version
from runs import launch_command, stderr_tail

from qsync_callback.jsonio import read_json


def run(model: str, procs: int, batch_size: int, verify_steps: int, run_dir: Path) -> tuple[int, float]:
    """One run of the example in mode "apply"; returns (exit code, wall seconds)."""
    example = [sys.executable, str(EXAMPLE), "--model", model, "--batch-size", str(batch_size)]
    threads = max(1, (os.cpu_count() or 1) // procs)
    example += ["--threads", str(threads), "--output-dir", str(run_dir / "qsync"), "--mode", "apply"]
    example += ["--verify-steps", str(verify_steps)]
    cmd = example
    if procs > 1:
        horovodrun = str(Path(sys.executable).with_name("horovodrun"))
        cmd = [horovodrun, "-np", str(procs), "-H", f"localhost:{procs}", "--gloo", *example]
    return launch_command(cmd, run_dir, TIMEOUT_S)


def read_rows(model: str, procs: int, repeat: int, run_dir: Path) -> list[dict[str, Any]]:
    """One row per trial of the run: measured and predicted step time, whether it was kept."""
    verification = read_json(run_dir / "qsync" / "verification.json", what="verification")
    rows = []
    for trial in [verification["baseline"], *verification["candidates"]]:
        measured = trial["all_ranks_step_ms"]
        predicted = (trial.get("prediction") or {}).get("step_ms")
        plan = trial["plan"]
        rows.append(
            {
                "model": model,
                "procs": procs,
                "repeat": repeat,
                "plan": trial["name"],
                "op_precision": plan.get("op_precision") or None,
                "measured_ms": measured,
                "predicted_ms": predicted,
                "error_pct": 100.0 * (predicted / measured - 1) if predicted and measured else None,
                "kept": trial["name"] == verification["chosen"],
                "error": trial["error"],
            }
        )
    return rows


def _ms(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def markdown(rows: list[dict[str, Any]], failures: list[str], batch_size: int) -> str:
    lines = [
        "| model | procs | run | plan | op types at bf16 | measured ms | predicted ms | error % | kept |",
        "|---|---:|---:|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        low = ", ".join(t for t, p in (r["op_precision"] or {}).items() if p == "bf16") or "-"
        error = f"{r['error_pct']:+.1f}" if r["error_pct"] is not None else "-"
        measured = _ms(r["measured_ms"]) if r["error"] is None else "failed"
        lines.append(
            f"| {r['model']} | {r['procs']} | {r['repeat']} | {r['plan']} | {low} | {measured} "
            f"| {_ms(r['predicted_ms'])} | {error} | {'yes' if r['kept'] else ''} |"
        )
    lines += ["", f"batch size {batch_size} per process; error = predicted / measured - 1"]
    lines += [f"FAILED: {f}" for f in failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--procs", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--verify-steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    rows, failures = [], []
    load_at_start = os.getloadavg()
    for model in args.models.split(","):
        for procs in (int(p) for p in args.procs.split(",")):
            for repeat in range(1, args.repeats + 1):
                run_dir = args.out / "horovod_tf_plan_runs" / f"{model}-p{procs}-r{repeat}"
                rc, wall_s = run(model, procs, args.batch_size, args.verify_steps, run_dir)
                try:
                    rows.extend(read_rows(model, procs, repeat, run_dir))
                except Exception as exc:  # noqa: BLE001 - report every failed run, then exit non-zero
                    failures.append(f"{run_dir.name}: exit {rc}, {exc}\n{stderr_tail(run_dir)}")
                print(f"{run_dir.name}: exit {rc} in {wall_s:.1f} s", file=sys.stderr, flush=True)
    text = markdown(rows, failures, args.batch_size)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "horovod_tf_plans.md").write_text(text + "\n")
    environment = {
        "cpu_count": os.cpu_count(),
        "tensorflow": _version("tensorflow-cpu", "tensorflow"),
        "horovod": _version("horovod"),
        "load_avg_at_start": load_at_start,
        "batch_size": args.batch_size,
        "verify_steps": args.verify_steps,
    }
    raw = {"environment": environment, "rows": rows, "failures": failures}
    (args.out / "horovod_tf_plans.json").write_text(json.dumps(raw, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
