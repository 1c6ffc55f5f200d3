"""The allocator lever: launches of ``QSyncCallback(mode="apply", levers=("allocator",))``, the page
faults each recorded, what fixing glibc malloc's thresholds was predicted to save, and what the
turns measured.

Each launch is a fresh process running `decision_repeatability.py`'s worker: a real
``Trainer.fit`` of a model from ``models.py`` (one process, or ``--procs 2``: Lightning DDP over
gloo) with the callback, which records, prices the thresholds (`planner/malloc_thresholds.py`),
applies them on every rank, verifies them with the baseline and the plan run in turns and keeps
them or rolls them back. From the launch's recorded traces the script takes each rank's page faults
a step (the mean the pricing uses: over the steps timed after the window,
`predictor.malloc_thresholds.steady_faults`) and a fresh page's measured cost; from its ``verification.json``
the predicted change, the change measured in turns with its noise, the page faults a step in each
configuration's blocks, and the decision. A launch the planner fixed nothing in says so (with the
faults it priced). Without tcmalloc (its malloc is not glibc's: the lever is not priced there).

    python benchmarks/malloc_thresholds.py [--models resnet,attention,mlp,transformer] [--launches 2]
        [--procs 1] [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from decision_repeatability import outcome
from models import get_model
from runs import bench_environment, launch, na, say_allocator, stderr_tail, write_results

from qsync_callback.errors import QSyncInputError
from qsync_callback.malloc_thresholds import MMAP_THRESHOLD, TRIM_THRESHOLD
from qsync_callback.predictor.malloc_thresholds import faults_per_step
from qsync_callback.recorder.trace import load_trace_dir
from qsync_callback.units import format_bytes

WORKER = Path(__file__).resolve().parent / "decision_repeatability.py"


def read_launch(model: str, launch_no: int, run_dir: Path) -> dict[str, Any]:
    """One row from a finished launch: its recorded faults, and its verification where it had one."""
    row: dict[str, Any] = {"model": model, "launch": launch_no}
    try:
        traces = load_trace_dir(run_dir / "trace")
    except QSyncInputError as error:  # a failed launch is a row saying why
        return {**row, "failed": f"{error}; {stderr_tail(run_dir, 5)}"}
    row["faults_per_step"] = [faults_per_step(t) for t in traces]
    row["fresh_page_us"] = [t.measured["malloc"]["fresh_page_us"] for t in traces]
    path = run_dir / "verification.json"
    if not path.exists():
        return {**row, "verified": False, "outcome": "nothing fixed"}
    v = json.loads(path.read_text())
    alternation = v.get("alternation") or {}
    return {
        **row,
        "verified": True,
        "thresholds": v["plan"].get("malloc_thresholds") or {},
        "predicted_change_pct": v["predicted_change_pct"],
        "change_pct": v["step_ms_change_pct"],
        "noise_pct": v["noise_pct"],
        "rounds": alternation.get("rounds", 0),
        "turn_faults": alternation.get("page_faults_per_step"),
        "decision": v["decision"],
        "outcome": outcome(v["reason"]),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | launch | faults/step priced (mean after the window, per rank) | fresh page us | "
        "thresholds fixed | predicted change | change in turns (noise; rounds) | "
        "faults/step in turns: baseline, plan | decision |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['model']} | {r['launch']} | FAILED: {r['failed'][:80]} | | | | | | |")
            continue
        faults = ", ".join(f"{f:,.0f}" for f in r["faults_per_step"])
        page_us = ", ".join(f"{u:.2f}" for u in r["fresh_page_us"])
        if not r["verified"]:
            head = f"| {r['model']} | {r['launch']} | {faults} | {page_us} |"
            lines.append(f"{head} none | | | | {r['outcome']} |")
            continue
        fixed = (
            f"mmap {format_bytes(r['thresholds'].get(MMAP_THRESHOLD))}, "
            f"trim {format_bytes(r['thresholds'].get(TRIM_THRESHOLD))}"
        )
        turn_faults = r["turn_faults"] or {}
        lines.append(
            f"| {r['model']} | {r['launch']} | {faults} | {page_us} | {fixed} | "
            f"{na(r['predicted_change_pct'], '+.1f')}% | {na(r['change_pct'], '+.1f')}% "
            f"(+-{na(r['noise_pct'], '.1f')}%; {r['rounds']}) | "
            f"{na(turn_faults.get('baseline'), ',.0f')}, {na(turn_faults.get('plan'), ',.0f')} | "
            f"{r['decision']}: {r['outcome']} |"
        )
    verified = [r for r in rows if r.get("verified") and r["change_pct"] is not None]
    lines.append("")
    if verified:
        gaps = [r["predicted_change_pct"] - r["change_pct"] for r in verified]
        lines.append(
            f"Predicted change against the change measured in turns (points): median |difference| "
            f"{statistics.median(map(abs, gaps)):.1f} over {len(gaps)} launches, range "
            f"{min(gaps):+.1f} to {max(gaps):+.1f}; kept {sum(r['decision'] == 'keep' for r in verified)} "
            f"of {len(verified)}."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet,attention,mlp,transformer")
    parser.add_argument("--launches", type=int, default=2)
    parser.add_argument("--procs", type=int, default=1, help="processes per launch (DDP over gloo)")
    parser.add_argument("--quick", action="store_true", help="smoke run: resnet, 1 launch")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    launches = args.launches
    if args.quick:
        models, launches = ["resnet"], 1
    for name in models:
        get_model(name)  # fail fast on a bad name
    say_allocator()
    env = bench_environment(launches=launches, procs=args.procs)
    rows = []
    for launch_no in range(1, launches + 1):  # interleaved: launch 1 of every model, then launch 2...
        for model in models:
            run_dir = args.out / "malloc_runs" / f"{model}-p{args.procs}-l{launch_no}"
            print(f"[benchmark] {model} launch {launch_no} ...", file=sys.stderr, flush=True)
            worker = ["--worker", model, "--worker-dir", str(run_dir.resolve())]
            launch(WORKER, [*worker, "--levers=allocator", f"--procs={args.procs}"], run_dir, args.timeout)
            rows.append(read_launch(model, launch_no, run_dir))
    rows.sort(key=lambda r: (models.index(r["model"]), r["launch"]))
    name = "malloc_thresholds" if args.procs == 1 else f"malloc_thresholds_p{args.procs}"
    write_results(args.out, name, markdown(rows), {"environment": env, "rows": rows})
    return 0 if all("failed" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
