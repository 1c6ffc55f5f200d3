"""The ``qsync`` command: work on saved traces.

    qsync report  TRACE_DIR [--json] [--top N]     measured vs predicted, per-op statistics
    qsync predict TRACE_DIR [--plan PLAN] [--json]  the prediction for a plan (default: as recorded)

Bad input (a missing, truncated or foreign trace; a bad plan) prints one line,
``qsync: error: <file>: <what is wrong>``, and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.predictor.predict import predict
from qsync_callback.recorder.trace import load_trace_dir
from qsync_callback.report import build_report, format_summary


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        traces = load_trace_dir(args.trace_dir)
        if args.command == "report":
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
                    f"peak memory {prediction.peak_bytes / 2**20:.1f} MiB"
                )
    except QSyncInputError as exc:
        print(f"qsync: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
