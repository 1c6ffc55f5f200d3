"""The symbolic estimate (`qsync_callback/estimate.py`) against real runs, before any step.

For each model family: in a fresh process, `estimate` on the model's first batch (timed: what a
user waits for ``qsync estimate``; the roofline measured first, cached for the others); then, in
another fresh process, a real ``Trainer.fit`` of the same model with ``QSyncCallback(mode="report")``
for its measured step time (median of the unprofiled steps) and measured peak (live tensors and
the allocator's counter: `torch_recorder`, nothing from the predictor), ``--repeats`` times.

The benchmark's data set is held in memory for the whole run (one batch per step, `timed_fit`):
the measured peak counts it, the estimate (one batch) does not, so the data set less one batch is
taken off the measured peak before the comparison (said in the table). The step time comes from
the roofline alone: its error is the roofline's (`op_cost_model.py` prices the same traces with the
learned per-op model, trained on the other families' recorded runs).

    python benchmarks/symbolic_estimate.py [--models mlp,cnn,...] [--repeats 2] [--quick]
        [--out benchmarks/results] [--resume] [--threads N] [--precision bf16-mixed]

``--threads``: torch's intra-op threads in every run; ``--precision``: the Trainer's in every run, and
the estimate's (`symbolic_trace` at that precision).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from models import MODELS, get_model, timed_fit
from runs import bench_environment, launch, range_noise_pct, say_allocator, stderr_tail, write_results

from qsync_callback.recorder.torch_recorder import window_close_step
from qsync_callback.units import format_bytes

WARMUP_STEPS, PROFILE_STEPS, MEASURE_STEPS = 10, 5, 10
MAX_STEPS = window_close_step(WARMUP_STEPS, PROFILE_STEPS) + MEASURE_STEPS + 3
PEAK_TARGET_PCT = 5.0
SYMBOLIC_TRACE = "symbolic_trace.json"  # the estimate's trace, unpriced
PROBES = "probes.json"  # each distinct op of it timed alone (`recorder/op_probes.py`)
CALLS = "calls.json"  # each distinct op's call (`op_samples.call_json`), keyed by `op_key`


def save_calls(distinct_ops: dict, path: Path) -> None:
    """Each distinct op's call as JSON rows ``{"key": op_key, "call": call}``."""
    path.write_text(json.dumps([{"key": list(key), "call": s.call} for key, s in distinct_ops.items()]))


def symbolic_calls(model: str, run_dir: Path) -> dict[tuple, dict]:
    """The calls of ``model``'s symbolic trace by `op_key` (`CALLS` in ``run_dir``; traced again and
    saved there where a run made before it was written has none)."""
    from qsync_callback.recorder.symbolic_trace import symbolic_trace

    if not (run_dir / CALLS).exists():
        distinct_ops: dict = {}
        symbolic_trace(
            get_model(model).build(),
            next(iter(get_model(model).dataloader(MAX_STEPS))),
            distinct_ops=distinct_ops,
        )
        save_calls(distinct_ops, run_dir / CALLS)
    return {tuple(row["key"]): row["call"] for row in json.loads((run_dir / CALLS).read_text())}


def estimate_worker(model: str, run_dir: Path, precision: str) -> None:
    """The estimate of ``model``'s step at ``precision``, timed, with the bytes of its benchmark data set."""
    from qsync_callback.estimate import estimate
    from qsync_callback.recorder.data_loading import first_batch_and_fetch
    from qsync_callback.recorder.op_probes import probe
    from qsync_callback.recorder.symbolic_trace import symbolic_trace

    spec = get_model(model)
    loader = spec.dataloader(MAX_STEPS)
    start = time.perf_counter()
    batch, data = first_batch_and_fetch(loader)
    report = estimate(spec.build(), batch, learned=False, data=data, precision=precision)
    seconds = time.perf_counter() - start
    distinct_ops: dict = {}  # for op_cost_model.py: the trace, and each distinct op timed alone
    symbolic_trace(spec.build(), batch, distinct_ops=distinct_ops, precision=precision).save(
        run_dir / SYMBOLIC_TRACE
    )
    probe_start = time.perf_counter()
    probed = probe(distinct_ops.values(), seconds=120)
    probe_s = time.perf_counter() - probe_start
    (run_dir / PROBES).write_text(json.dumps([dataclasses.asdict(s) for s in probed]))
    save_calls(distinct_ops, run_dir / CALLS)
    held = sum(t.untyped_storage().nbytes() for t in loader.dataset.tensors)
    one_batch = sum(t.untyped_storage().nbytes() for t in batch)
    result = {
        "estimate": report,
        "seconds": seconds,
        "probe_s": probe_s,
        "data_set_bytes": held - one_batch,
        "data_loading": None if data is None else dataclasses.asdict(data),
    }
    (run_dir / "estimate.json").write_text(json.dumps(result))


def record_worker(model: str, run_dir: Path, precision: str) -> None:
    """A real run at the Trainer's ``precision`` with the callback reporting its measured figures."""
    from qsync_callback.integrations.lightning import QSyncCallback

    callback = QSyncCallback(
        mode="report",
        warmup_steps=WARMUP_STEPS,
        profile_steps=PROFILE_STEPS,
        measure_steps=MEASURE_STEPS,
        output_dir=run_dir,
        plan_cache=False,
    )
    timed_fit(get_model(model), MAX_STEPS, [callback], precision=precision)


RESUME = False  # `--resume`: a run whose directory holds its output already is not run again


def _run(script: Path, args: list[str], run_dir: Path, out_file: str) -> dict[str, Any] | None:
    path = run_dir / out_file
    if RESUME and path.exists():
        return json.loads(path.read_text())
    rc, _ = launch(script, [*args, "--worker-dir", str(run_dir)], run_dir, 900)
    if rc != 0 or not path.exists():
        print(f"[benchmark] {run_dir.name} FAILED (exit {rc}):\n{stderr_tail(run_dir)}", file=sys.stderr)
        return None
    return json.loads(path.read_text())


def bench_model(model: str, repeats: int, out: Path, precision: str = "32-true") -> dict[str, Any]:
    script = Path(__file__).resolve()
    runs = out / "runs"
    at = ["--precision", precision]
    estimated = _run(
        script, ["--worker", "estimate", model, *at], runs / f"{model}-estimate", "estimate.json"
    )
    if estimated is None:
        return {"model": model, "failed": "the estimate"}
    steps, peaks = [], []
    for r in range(repeats):
        report = _run(script, ["--worker", "record", model, *at], runs / f"{model}-record-{r}", "report.json")
        if report is not None:
            steps.append(report["measured"]["step_ms"])
            peaks.append(report["measured"]["peak_bytes"])
    if not peaks:
        return {"model": model, "failed": "the recorded runs"}
    predicted = estimated["estimate"]["predicted"]
    held = estimated["data_set_bytes"]
    measured_peak = statistics.median(peaks) - held
    measured_step = statistics.median(steps)
    return {
        "model": model,
        "estimate_s": estimated["seconds"],
        "flops": estimated["estimate"]["symbolic"]["flops"],
        "predicted_peak_bytes": predicted["peak_bytes"],
        "predicted_breakdown": predicted["memory_breakdown"],
        "measured_peak_bytes": peaks,
        "data_set_bytes": held,
        "peak_error_pct": 100 * (predicted["peak_bytes"] / measured_peak - 1),
        "predicted_step_ms": predicted["step_ms"],
        "measured_step_ms": steps,
        "step_error_pct": 100 * (predicted["step_ms"] / measured_step - 1),
        "step_noise_pct": range_noise_pct(steps),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | estimate s | GFLOP/step | predicted peak | measured peak (data set taken off) "
        "| peak error | predicted step ms | measured step ms (runs) | step error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    errors = []
    for row in rows:
        if "failed" in row:
            lines.append(f"| {row['model']} | failed: {row['failed']} | | | | | | | |")
            continue
        errors.append(abs(row["peak_error_pct"]))
        measured = statistics.median(row["measured_peak_bytes"]) - row["data_set_bytes"]
        runs = ", ".join(f"{s:.1f}" for s in row["measured_step_ms"])
        lines.append(
            f"| {row['model']} | {row['estimate_s']:.1f} | {row['flops'] / 1e9:.2f} | "
            f"{format_bytes(row['predicted_peak_bytes'])} | {format_bytes(measured)} "
            f"(- {format_bytes(row['data_set_bytes'])}) | {row['peak_error_pct']:+.1f}% | "
            f"{row['predicted_step_ms']:.1f} | {statistics.median(row['measured_step_ms']):.1f} ({runs}) | "
            f"{row['step_error_pct']:+.1f}% |"
        )
    if errors:
        within = sum(e <= PEAK_TARGET_PCT for e in errors)
        lines.append(
            f"\nPeak within {PEAK_TARGET_PCT:g}% of measured on {within} of {len(errors)} families "
            f"(median |error| {statistics.median(errors):.1f}%). Step times come from the roofline alone."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke run: mlp, 1 run")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--resume", action="store_true", help="reuse the runs already done in --out")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads in every run (OMP_NUM_THREADS)")
    parser.add_argument("--precision", default="32-true", help="the Trainer's precision in every run")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, model = args.worker
        (estimate_worker if kind == "estimate" else record_worker)(model, args.worker_dir, args.precision)
        return 0
    global RESUME
    RESUME = args.resume
    say_allocator()
    models, repeats = (["mlp"], 1) if args.quick else (args.models.split(","), args.repeats)
    threads_before = os.environ.get("OMP_NUM_THREADS")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the runs' torch (and their children's)
    try:
        rows = [bench_model(model, repeats, args.out, args.precision) for model in models]
    finally:  # a caller's later runs keep their own thread count
        if threads_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads_before
    environment = bench_environment(
        repeats=repeats, max_steps=MAX_STEPS, threads=args.threads, precision=args.precision
    )
    write_results(args.out, "symbolic_estimate", table(rows), {"environment": environment, "rows": rows})
    return 0 if all("failed" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
