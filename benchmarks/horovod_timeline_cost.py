"""What recording Horovod's timeline costs a Horovod + TensorFlow run: step time with and without it.

Horovod reads ``HOROVOD_TIMELINE`` in ``hvd.init()``; with it set (``DYNAMIC`` or a path), Horovod
0.28 starts a timeline writer thread on the coordinator (rank 0) that polls its queue without
sleeping until shutdown, recorded or not. That is why the recorder's timeline is opt-in
(`integrations/horovod_tf/fusion.py` ``record_horovod_timeline``). This script measures the cost:
for each Keras model of ``examples/train_horovod_tf.py`` and each process count, ``--repeats``
pairs of runs in mode "report", one with ``--horovod-timeline`` and one without (which goes first
alternates), and compares the measured step time (median of the slowest rank's unprofiled steps)
of each pair. Writes ``<out>/horovod_timeline_cost.md`` and ``.json``; runs go under
``<out>/horovod_timeline_runs/``.

    python benchmarks/horovod_timeline_cost.py [--models mlp,cnn] [--procs 1,2] [--repeats 3]
        [--batch-size 64] [--out benchmarks/results]
    python benchmarks/horovod_timeline_cost.py --quick     # smoke run: mlp, 1 and 2 processes, once
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

from horovod_tf_accuracy import (
    TIMEOUT_S,
    each_run,
    example_command,
    finish,
    horovod_arguments,
    quick,
    read_row,
)
from runs import launch_command, say_allocator, stderr_tail

TIMELINE_FLAG = "--horovod-timeline"


def _runs(values: list[float]) -> str:
    """The median of ``values`` and, in brackets, each of them."""
    return f"{statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})"


def markdown(rows: list[dict[str, Any]], failures: list[str], batch_size: int) -> str:
    """Per (model, processes): each pair's step times and the median ratio with / without."""
    lines = [
        "| model | procs | without timeline ms (runs) | with timeline ms (runs) | median ratio |",
        "|---|---:|---|---|---:|",
    ]
    for model, procs in sorted({(r["model"], r["procs"]) for r in rows}):
        pairs = [r for r in rows if r["model"] == model and r["procs"] == procs]
        ratio = statistics.median(r["with_ms"] / r["without_ms"] for r in pairs)
        without, with_ = (_runs([r[key] for r in pairs]) for key in ("without_ms", "with_ms"))
        lines.append(f"| {model} | {procs} | {without} | {with_} | {ratio:.2f} |")
    lines += ["", f"batch size {batch_size} per process; ratio = with / without, per pair"]
    lines += [f"FAILED: {f}" for f in failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = quick(horovod_arguments(__doc__).parse_args(argv))
    say_allocator()
    rows, failures = [], []
    load_at_start = os.getloadavg()
    for model, procs, repeat, run_dir in each_run(args, "horovod_timeline_runs"):
        measured: dict[bool, float] = {}
        order = (False, True) if repeat % 2 else (True, False)
        for timeline in order:
            folder = run_dir / ("with" if timeline else "without")
            command = example_command(
                model, procs, args.batch_size, folder, [TIMELINE_FLAG] if timeline else []
            )
            rc, _ = launch_command(command, folder, TIMEOUT_S)
            try:
                measured[timeline] = read_row(model, procs, repeat, folder)["measured_ms"]
            except Exception as exc:  # noqa: BLE001 - report every failed run, then exit non-zero
                failures.append(f"{folder}: exit {rc}, {exc}\n{stderr_tail(folder)}")
        if len(measured) == 2:
            rows.append(
                {
                    "model": model,
                    "procs": procs,
                    "repeat": repeat,
                    "without_ms": measured[False],
                    "with_ms": measured[True],
                }
            )
        print(f"{run_dir.name}: {measured}", file=sys.stderr, flush=True)
    table = markdown(rows, failures, args.batch_size)
    return finish(args, "horovod_timeline_cost", table, rows, failures, load_at_start)


if __name__ == "__main__":
    sys.exit(main())
