"""The ``qsync`` command: work on saved traces.

    qsync report  TRACE_DIR [--json] [--top N]     measured vs predicted, per-op statistics
    qsync predict TRACE_DIR [--plan PLAN] [--json]  the prediction for a plan (default: as recorded)
    qsync plan    TRACE_DIR [--memory-budget 6GB] [--max-step-ms MS] [--precisions fp32,bf16,...]
                  [--levers precision,...] [--best-effort] [--out PLAN]
                                                    choose a plan (`planner/choose.py`), under the
                                                    same constraints the callback takes
    qsync liveness TRACE_DIR --out DIR [--memory-budget 6GB|60%]
                                                    saved tensors and their inactive periods, each
                                                    op's kernels, the memory curve by kind: JSON,
                                                    CSV, a Perfetto counter track and PNG plots
                                                    (`liveness_report.py`)
    qsync estimate FILE:CLASS [--batch-shape 64,784 64:int64] [--device cpu] [--json] [--top N]
                   [--precision bf16-mixed] [--roofline | --tvm]
                                                    one training step predicted before any runs:
                                                    peak memory by kind, step time, FLOPs, top ops
                                                    (`estimate.py`: a symbolic trace, priced)

``qsync plan`` needs a trace recorded with ``QSyncCallback(mode="apply")`` (it carries the
per-precision probes and the indicator's statistics).

Bad input (a missing, truncated or foreign trace, a field of the wrong type or shape, rank traces
of different runs; a bad plan) prints one line, ``qsync: error: <file>: <what is wrong>``, and exits
with code 2; so does a bad argument (``qsync: error: --max-step-ms: ...``), before any trace is read.
Output piped into a reader that stops early (``qsync report DIR | head``) ends quietly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from qsync_callback.errors import QSyncInputError
from qsync_callback.estimate import (
    batch_from_shapes,
    estimate,
    format_estimate,
    load_module,
    train_dataloader,
)
from qsync_callback.liveness_report import format_liveness, liveness_of, write_liveness_files
from qsync_callback.plan import LEVERS, PRECISIONS, Constraints, Plan
from qsync_callback.planner.choose import choose_plan
from qsync_callback.predictor.predict import predict
from qsync_callback.recorder.data_loading import first_batch_and_fetch
from qsync_callback.recorder.symbolic_trace import lightning_precision
from qsync_callback.recorder.trace import load_trace_dir
from qsync_callback.report import build_report, format_summary
from qsync_callback.units import format_bytes


class _Parser(argparse.ArgumentParser):
    """argparse with the tool's one-line errors (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"qsync: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qsync", description="Predict and plan from recorded training traces.")
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
    plan.add_argument(
        "--levers", default=",".join(LEVERS), help="what a plan may change, comma-separated (default: all)"
    )
    plan.add_argument("--out", help="write the plan here (JSON)")
    liveness = sub.add_parser(
        "liveness", help="tensor liveness: saved tensors, kernels, memory curve by kind"
    )
    liveness.add_argument("trace_dir", help="a trace directory (rank<k>/trace.json inside)")
    liveness.add_argument("--out", required=True, help="write the files into this directory")
    liveness.add_argument(
        "--memory-budget", help="draw this budget: 6GB, 512MiB, 60%% (of the recorded peak)"
    )
    estimate = sub.add_parser("estimate", help="predict a LightningModule's training step before running one")
    estimate.add_argument("target", help="FILE:CLASS, a LightningModule built with no arguments")
    estimate.add_argument(
        "--batch-shape",
        nargs="+",
        help="the batch's tensors as SHAPE[:DTYPE] (64,784 64:int64); default: the first batch of the "
        "module's train_dataloader()",
    )
    estimate.add_argument("--device", default="cpu", help="the device to price for (default: cpu)")
    estimate.add_argument(
        "--precision",
        default="32-true",
        help="the Trainer's precision= (Lightning's: 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, "
        "64-true; default 32-true)",
    )
    estimate.add_argument("--json", action="store_true", help="the report.json schema, predicted only")
    estimate.add_argument("--top", type=int, default=10, help="ops to list (default 10)")
    pricing = estimate.add_mutually_exclusive_group()
    pricing.add_argument(
        "--roofline",
        action="store_true",
        help="price the ops on this machine's roofline, not the learned model of the ops recorded here",
    )
    pricing.add_argument(
        "--tvm",
        action="store_true",
        help="the learned model reads TVM's features of each op too (the 'tvm' extra; the first "
        "time, lowering each distinct op takes about 0.3 s)",
    )
    return parser


def _estimate(args: argparse.Namespace) -> None:
    """``qsync estimate``: the module's step predicted on fake tensors."""
    precision = lightning_precision(args.precision, args.device)  # refused before the module is built
    module = load_module(args.target)
    data = None
    if args.batch_shape:
        batch = batch_from_shapes(args.batch_shape)
    else:
        loader = train_dataloader(module)
        if loader is None:
            raise QSyncInputError(
                f"{args.target}: no train_dataloader() to take a batch from; give --batch-shape"
            )
        batch, data = first_batch_and_fetch(loader)
    report = estimate(
        module,
        batch,
        args.device,
        top=args.top,
        learned=not args.roofline,
        tvm=args.tvm,
        data=data,
        precision=precision,
    )
    _out(json.dumps(report, indent=2) if args.json else format_estimate(report, top=args.top))


def _check_arguments(args: argparse.Namespace) -> Constraints | None:
    """Refuse bad arguments before any trace is read (QSyncInputError naming the option); for
    ``qsync plan`` and ``qsync liveness``, their constraints."""
    if getattr(args, "top", 1) < 1:
        raise QSyncInputError(f"--top: expected a positive number of ops, not {args.top}")
    if args.command == "liveness":
        return _constraints(args.memory_budget)
    if args.command != "plan":
        return None
    if args.max_step_ms is not None and not (math.isfinite(args.max_step_ms) and args.max_step_ms > 0):
        raise QSyncInputError(
            f"--max-step-ms: expected a positive number of milliseconds, not {args.max_step_ms:g}"
        )
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown or not precisions:
        raise QSyncInputError(
            f"--precisions: unknown {', '.join(unknown) or 'none given'}; choose from {', '.join(PRECISIONS)}"
        )
    levers = [lever.strip() for lever in args.levers.split(",") if lever.strip()]
    max_step_s = args.max_step_ms / 1e3 if args.max_step_ms is not None else None
    return _constraints(args.memory_budget, max_step_s, precisions, levers, args.best_effort)


def _constraints(*arguments: object) -> Constraints:
    """`Constraints.from_arguments`, its ValueError said as the option (QSyncInputError)."""
    try:
        return Constraints.from_arguments(*arguments)
    except ValueError as exc:  # "<argument>: <what is wrong>", said as the option
        argument, _, what = str(exc).partition(": ")
        raise QSyncInputError(f"--{argument.replace('_', '-')}: {what}") from None


def _plan(args: argparse.Namespace, constraints: Constraints, traces: list) -> None:
    """``qsync plan``: print the chosen plan's table; write it with --out."""
    recorded = predict(traces).to_dict()
    choice = choose_plan(traces, constraints.resolved(recorded["peak_bytes"]), recorded)
    _out(choice.table)
    if not (choice.feasible or constraints.best_effort):
        raise QSyncInputError("no plan meets the constraints; --best-effort writes the closest one")
    if args.out:
        choice.plan.constraints = constraints.to_dict()
        choice.plan.save(args.out)
        _out(f"written to {args.out}")


def _liveness(args: argparse.Namespace, constraints: Constraints, traces: list) -> None:
    """``qsync liveness``: write the files (a budget share is of the predicted peak), print a summary."""
    liveness = liveness_of(traces, args.trace_dir)
    budget = constraints.resolved(liveness.peak_bytes).memory_budget
    paths = write_liveness_files(liveness, args.out, budget)
    _out(format_liveness(liveness, budget, paths))


def _out(text: str) -> None:
    """Print ``text``; once the reader has gone (``qsync report DIR | head``), drop this and all later
    output quietly, as Unix tools do (stdout onto /dev/null: no BrokenPipeError at exit either)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # a stdout with no file descriptor (captured)
            pass


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        constraints = _check_arguments(args)
        if args.command == "estimate":
            _estimate(args)
            return 0
        traces = load_trace_dir(args.trace_dir)
        if args.command == "liveness":
            _liveness(args, constraints, traces)
        elif constraints is not None:
            _plan(args, constraints, traces)
        elif args.command == "report":
            report = build_report(traces, top=args.top)
            _out(json.dumps(report, indent=2) if args.json else format_summary(report, top=args.top))
        else:
            plan = Plan.load(args.plan) if args.plan else None
            prediction = predict(traces, plan, plan_source=args.plan or "<plan>")
            if args.json:
                _out(json.dumps(prediction.to_dict(), indent=2))
            else:
                _out(
                    f"predicted step time {prediction.step_ms:.2f} ms, "
                    f"peak memory {format_bytes(prediction.peak_bytes)}"
                )
    except QSyncInputError as exc:
        print(f"qsync: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
