"""The ``qsync`` command: work on saved traces.

    qsync report  TRACE_DIR [--json] [--top N]     measured vs predicted, per-op statistics
    qsync predict TRACE_DIR [--plan PLAN] [--json]  the prediction for a plan (default: as recorded)
    qsync plan    TRACE_DIR [--memory-budget 6GB] [--max-step-ms MS] [--precisions fp32,bf16,...]
                  [--best-effort] [--out PLAN]      choose a per-layer precision plan

``qsync plan`` needs a trace recorded with ``QSyncCallback(mode="apply")`` (it carries the
per-precision probes and the indicator's statistics).

Bad input (a missing, truncated or foreign trace; a bad plan) prints one line,
``qsync: error: <file>: <what is wrong>``, and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import PRECISIONS, Plan
from qsync_callback.planner.precision import plan_precision
from qsync_callback.predictor.predict import predict
from qsync_callback.recorder.trace import load_trace_dir
from qsync_callback.report import build_report, format_precision_plan, format_summary
from qsync_callback.units import format_bytes, parse_bytes, parse_share


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qsync", description="Predict and plan from recorded training traces."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="measured vs predicted step time and peak memory, top ops")
    report.add_argument("trace_dir", help="a trace directory (rank<k>/trace.json inside)")
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    report.add_argument("--top", type=int, default=10, help="how many ops to list (default 10)")
    pred = sub.add_parser("predict", help="predicted step time and peak memory of a plan")
    pred.add_argument("trace_dir", help="a trace directory (rank<k>/trace.json inside)")
    pred.add_argument("--plan", help="a plan JSON file (default: the recorded configuration)")
    pred.add_argument("--json", action="store_true", help="print the prediction as JSON")
    plan = sub.add_parser("plan", help="choose a per-layer precision plan for a recorded run")
    plan.add_argument("trace_dir", help="a trace directory recorded in mode 'apply'")
    plan.add_argument("--memory-budget", help="largest predicted peak: 6GB, 512MiB, 90%% (of the recorded)")
    plan.add_argument(
        "--max-step-ms", type=float, help="longest predicted step (default: fastest plan + 5%%)"
    )
    plan.add_argument(
        "--precisions", default=",".join(PRECISIONS), help="allowed precisions, comma-separated"
    )
    plan.add_argument(
        "--best-effort",
        action="store_true",
        help="when no plan meets the constraints, take the closest one (default: write none)",
    )
    plan.add_argument("--out", help="write the plan here (JSON)")
    return parser


def _plan(args: argparse.Namespace, traces: list) -> None:
    """``qsync plan``: print the chosen plan's table; write it with --out."""
    budget = None
    if args.memory_budget is not None:
        try:
            share = parse_share(args.memory_budget)
            budget = parse_bytes(args.memory_budget) if share is None else None
        except ValueError as exc:
            raise QSyncInputError(f"--memory-budget: {exc}") from None
        if share is not None:
            budget = int(share * predict(traces).peak_bytes)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise QSyncInputError(
            f"--precisions: unknown {', '.join(unknown)}; choose from {', '.join(PRECISIONS)}"
        )
    choice, indicator = plan_precision(
        traces, precisions, max_step_ms=args.max_step_ms, memory_budget=budget, best_effort=args.best_effort
    )
    print(format_precision_plan(choice, indicator, predict(traces).to_dict(), traces[0].layers))
    if not (choice.feasible or args.best_effort):
        raise QSyncInputError("no plan meets the constraints; --best-effort writes the closest one")
    if args.out:
        choice.plan.save(args.out)
        print(f"written to {args.out}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        traces = load_trace_dir(args.trace_dir)
        if args.command == "plan":
            _plan(args, traces)
        elif args.command == "report":
            report = build_report(traces, top=max(args.top, 1))
            print(json.dumps(report, indent=2) if args.json else format_summary(report, top=args.top))
        else:
            plan = Plan.load(args.plan) if args.plan else None
            prediction = predict(traces, plan, plan_source=args.plan or "<plan>")
            if args.json:
                print(json.dumps(prediction.to_dict(), indent=2))
            else:
                print(
                    f"predicted step time {prediction.step_ms:.2f} ms, "
                    f"peak memory {format_bytes(prediction.peak_bytes)}"
                )
    except QSyncInputError as exc:
        print(f"qsync: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
