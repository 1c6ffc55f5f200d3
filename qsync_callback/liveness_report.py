"""``qsync liveness``: the tensor-liveness report of a trace directory, as files.

What is in it is `qsync_callback.predictor.liveness`'s (saved tensors and their inactive periods,
each op's kernels, the memory curve by kind); this module reads the profiler's own traces beside
the normalized ones and writes, under the output directory:

- ``liveness.json``, everything (the layout below);
- ``saved_tensors.csv``: one row per saved tensor (rank, step, layer, bytes, the ops that made,
  saved and freed it, its last use in forward and first use in backward with their replayed times
  in microseconds from the step's start, and its inactive period);
- ``memory_curve.csv``: one row per point of each step's curve (rank, step, time on the trace's
  clock and from the step's start, bytes of each kind, total);
- ``memory_counters.json``: a Chrome trace of counter events (``"ph": "C"``), one counter per kind
  (``qsync memory: <kind>``, ``args.bytes``) and their total, at the times of the Kineto trace (the
  trace's own clock, and the Kineto trace's process id): open it in Perfetto beside the Kineto
  trace, or add its ``traceEvents`` to the Kineto trace's to see both in one view;
- with matplotlib (``pip install 'qsync-callback[plots]'``), ``memory_curve.png`` (the curve of the
  step with the largest peak, stacked by kind, with the memory budget's line where one was given)
  and ``saved_tensors.png`` (each saved tensor's bytes against its inactive period, log axes);
  without it the rest is written and the command says once how to install it.

``liveness.json``::

    {"format": "qsync-liveness", "version": 1, "device": "cpu", "world_size": 1,
     "kinds": ["parameters", "gradients", "optimizer_state", "activations", "temporaries", "other"],
     "memory_budget_bytes": null,                 # the budget drawn on the plot, or null
     "peak": {"bytes": .., "rank": 0, "step": 4, "t_us": ..,       # the largest step peak, when
              "by_kind": {"parameters": .., ...}},                  # (trace clock), what is alive
     "notes": ["..."],                            # what could not be read, and so is missing
     "ranks": [{"rank": 0,
                "steps": [{"step": 4, "start_us": .., "end_us": ..,     # trace clock
                           "replayed_step_us": ..,                      # null: not replayed
                           "peak_bytes": .., "peak_t_us": ..,
                           "memory_curve": {"t_us": [..], "by_kind": {"parameters": [..], ...}},
                           "saved_tensors": [{"bytes": .., "layer": "net.1",
                                              "made_by": {"op": 3, "name": "aten::relu"},
                                              "saved_by": {...}, "freed_by": {...},
                                              "last_forward_use": {...}, "first_backward_use": {...},
                                              "last_forward_use_end_us": ..,     # replayed, from
                                              "first_backward_use_start_us": .., # the step's start
                                              "inactive_us": ..}, ...]}, ...],
                "ops": [{"id": 3, "name": "aten::relu", "kind": "forward", "thread": "main",
                         "layer": "net.1", "step": 4, "start_us": .., "dur_us": ..,   # recorded
                         "replayed_start_us": .., "replayed_end_us": ..,   # null: not replayed
                         "kernels": [{"name": .., "start_us": .., "dur_us": .., "self_us": ..,
                                      "depth": 1}, ...]}, ...]}]}      # null: no profiler trace
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from qsync_callback.errors import QSyncInputError
from qsync_callback.jsonio import ANY, Fields, ListOf, check_shape, read_json, write_text_atomic
from qsync_callback.predictor.liveness import (
    KINDS,
    Liveness,
    RankLiveness,
    SavedTensor,
    StepCurve,
    analyse_liveness,
)
from qsync_callback.recorder.trace import Op, Trace, rank_trace_path
from qsync_callback.units import format_bytes

LIVENESS_FORMAT = "qsync-liveness"
LIVENESS_VERSION = 1
LIVENESS_FILE = "liveness.json"
SAVED_TENSORS_CSV = "saved_tensors.csv"
MEMORY_CURVE_CSV = "memory_curve.csv"
MEMORY_COUNTERS_FILE = "memory_counters.json"
MEMORY_CURVE_PNG = "memory_curve.png"
SAVED_TENSORS_PNG = "saved_tensors.png"
PLOTS_MISSING = (
    "qsync: the PNG plots need matplotlib, which is not installed: pip install 'qsync-callback[plots]'"
)
_KINETO = Fields(required={"traceEvents": ListOf(ANY)})


def _raw_trace_path(trace: Trace, trace_dir: Path) -> Path | None:
    """Where ``trace``'s profiler trace is: beside its ``trace.json`` (``rank<k>/``, or the
    directory itself for a lone trace, as `load_trace_dir` reads them)."""
    if not trace.raw_trace:
        return None
    beside = rank_trace_path(trace_dir, trace.rank).parent
    return (beside if beside.is_dir() else trace_dir) / trace.raw_trace


def read_raw_traces(traces: Sequence[Trace], trace_dir: str | os.PathLike | None) -> tuple[list, list[str]]:
    """Each rank's Kineto trace (None where there is none to read) and notes saying why one is
    missing. A Kineto trace that cannot be read raises QSyncInputError naming it."""
    raws: list[Mapping[str, Any] | None] = []
    notes = []
    for trace in traces:
        path = _raw_trace_path(trace, Path(trace_dir)) if trace_dir is not None else None
        if path is None or not path.is_file() or path.suffix != ".json":
            if trace_dir is None:
                why = "no trace directory given"
            elif path is None:
                why = "the trace names no profiler trace"
            elif not path.exists():
                why = f"{path} not found"
            else:
                why = f"{path} is not a Kineto JSON trace"
            notes.append(f"rank {trace.rank}: no kernel lists ({why})")
            raws.append(None)
            continue
        raw = read_json(path, what="Kineto trace")
        check_shape(raw, _KINETO, str(path))
        raws.append(raw)
    return raws, notes


def liveness_of(traces: Sequence[Trace], trace_dir: str | os.PathLike | None = None) -> Liveness:
    """`analyse_liveness` of ``traces`` with the Kineto traces beside them in ``trace_dir``."""
    raws, notes = read_raw_traces(traces, trace_dir)
    sources = [
        str(_raw_trace_path(t, Path(trace_dir))) if trace_dir is not None else f"rank {t.rank}"
        for t in traces
    ]
    liveness = analyse_liveness(traces, raws, sources)
    liveness.notes.extend(notes)
    return liveness


# --- liveness.json ------------------------------------------------------------------------------


def _op_ref(op: Op) -> dict[str, Any]:
    return {"op": op.id, "name": op.name}


def _saved_dict(saved: SavedTensor) -> dict[str, Any]:
    return {
        "bytes": saved.bytes,
        "layer": saved.layer,
        "made_by": _op_ref(saved.made_by),
        "saved_by": _op_ref(saved.saved_by),
        "freed_by": _op_ref(saved.freed_by),
        "last_forward_use": _op_ref(saved.last_forward_use),
        "first_backward_use": _op_ref(saved.first_backward_use),
        "last_forward_use_end_us": saved.last_forward_use_end_us,
        "first_backward_use_start_us": saved.first_backward_use_start_us,
        "inactive_us": saved.inactive_us,
    }


def _step_dict(rank: RankLiveness, curve: StepCurve) -> dict[str, Any]:
    return {
        "step": curve.step,
        "start_us": curve.start_us,
        "end_us": curve.end_us,
        "replayed_step_us": rank.replayed_step_us.get(curve.step),
        "peak_bytes": curve.peak_bytes,
        "peak_t_us": float(curve.times_us[curve.peak_index]),
        "memory_curve": {
            "t_us": curve.times_us.tolist(),
            "by_kind": {kind: curve.by_kind[kind].tolist() for kind in KINDS},
        },
        "saved_tensors": [_saved_dict(s) for s in rank.saved if s.step == curve.step],
    }


def _op_dict(rank: RankLiveness, op: Op) -> dict[str, Any]:
    start, end = rank.replayed.get(op.id, (None, None))
    kernels = None if rank.kernels is None else [vars(k) for k in rank.kernels.get(op.id, [])]
    return {
        "id": op.id,
        "name": op.name,
        "kind": op.kind,
        "thread": op.thread,
        "layer": op.layer,
        "step": op.step,
        "start_us": op.start_us,
        "dur_us": op.dur_us,
        "replayed_start_us": start,
        "replayed_end_us": end,
        "kernels": kernels,
    }


def liveness_document(liveness: Liveness, memory_budget_bytes: int | None = None) -> dict[str, Any]:
    """``liveness.json``'s content (the layout in the module docstring)."""
    peak = liveness.peak_curve
    first = liveness.ranks[0].trace
    return {
        "format": LIVENESS_FORMAT,
        "version": LIVENESS_VERSION,
        "device": first.device,
        "world_size": first.world_size,
        "kinds": list(KINDS),
        "memory_budget_bytes": memory_budget_bytes,
        "peak": {
            "bytes": peak.peak_bytes,
            "rank": peak.rank,
            "step": peak.step,
            "t_us": float(peak.times_us[peak.peak_index]),
            "by_kind": peak.at(peak.peak_index),
        },
        "notes": list(liveness.notes),
        "ranks": [
            {
                "rank": rank.trace.rank,
                "steps": [_step_dict(rank, curve) for curve in rank.curves],
                "ops": [_op_dict(rank, op) for op in rank.trace.ops],
            }
            for rank in liveness.ranks
        ],
    }


# --- CSV and the counter track ------------------------------------------------------------------

_SAVED_COLUMNS = (
    "rank",
    "step",
    "layer",
    "bytes",
    "made_by_op",
    "made_by",
    "saved_by_op",
    "saved_by",
    "freed_by_op",
    "freed_by",
    "last_forward_use_op",
    "last_forward_use",
    "last_forward_use_end_us",
    "first_backward_use_op",
    "first_backward_use",
    "first_backward_use_start_us",
    "inactive_us",
)


def _csv(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows(rows)
    return out.getvalue()


def saved_tensors_csv(liveness: Liveness) -> str:
    rows = []
    for rank in liveness.ranks:
        for s in rank.saved:
            rows.append(
                [
                    s.rank,
                    s.step,
                    s.layer if s.layer is not None else "",
                    s.bytes,
                    *(part for op in (s.made_by, s.saved_by, s.freed_by) for part in (op.id, op.name)),
                    s.last_forward_use.id,
                    s.last_forward_use.name,
                    s.last_forward_use_end_us,
                    s.first_backward_use.id,
                    s.first_backward_use.name,
                    s.first_backward_use_start_us,
                    s.inactive_us,
                ]
            )
    return _csv(_SAVED_COLUMNS, rows)


def memory_curve_csv(liveness: Liveness) -> str:
    rows = []
    for rank in liveness.ranks:
        for curve in rank.curves:
            total = curve.total
            for i, t in enumerate(curve.times_us.tolist()):
                kinds = [int(curve.by_kind[kind][i]) for kind in KINDS]
                rows.append([curve.rank, curve.step, t, t - curve.start_us, *kinds, int(total[i])])
    return _csv(("rank", "step", "t_us", "since_step_start_us", *KINDS, "total"), rows)


def memory_counters(liveness: Liveness) -> dict[str, Any]:
    """A Chrome trace of the curves as counter events on each rank's own clock: one counter per kind
    and the total, under the Kineto trace's process id (the rank where there is none)."""
    events = []
    for rank in liveness.ranks:
        pid = rank.kineto_pid if rank.kineto_pid is not None else rank.trace.rank
        for curve in rank.curves:
            times = curve.times_us.tolist()
            series = {f"qsync memory: {kind}": curve.by_kind[kind].tolist() for kind in KINDS}
            series["qsync memory: total"] = curve.total.tolist()
            for name, values in series.items():
                for i, (t, value) in enumerate(zip(times, values, strict=True)):
                    if i in (0, len(times) - 1) or value != values[i - 1]:  # a counter holds till changed
                        events.append(_counter(name, pid, t, int(value)))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _counter(name: str, pid: Any, ts: float, value: int) -> dict[str, Any]:
    return {"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": ts, "args": {"bytes": value}}


# --- plots ---------------------------------------------------------------------------------------


def _unit(nbytes: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB")):
        if nbytes >= scale:
            return scale, name
    return 2**10, "KiB"


def _plot_curve(
    new_figure: Callable[..., Any], liveness: Liveness, path: Path, memory_budget_bytes: int | None
) -> None:
    """The step with the largest peak, stacked by kind, with the budget's line."""
    curve = liveness.peak_curve
    top = max(curve.peak_bytes, memory_budget_bytes or 0)
    scale, unit = _unit(top)
    figure = new_figure(figsize=(9, 5))
    ax = figure.add_subplot()
    since_ms = (curve.times_us - curve.start_us) / 1e3
    ax.stackplot(
        since_ms,
        *(curve.by_kind[kind] / scale for kind in KINDS),
        labels=[kind.replace("_", " ") for kind in KINDS],
        step="post",
    )
    if memory_budget_bytes is not None:
        ax.axhline(
            memory_budget_bytes / scale,
            color="red",
            linestyle="--",
            label=f"budget {format_bytes(memory_budget_bytes)}",
        )
    ax.set_xlabel("time from the step's start (ms, recorded)")
    ax.set_ylabel(f"bytes alive ({unit})")
    ax.set_title(
        f"Predicted memory, rank {curve.rank}, step {curve.step}: peak {format_bytes(curve.peak_bytes)}"
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    figure.savefig(path, dpi=100, bbox_inches="tight")


def _plot_saved(new_figure: Callable[..., Any], liveness: Liveness, path: Path) -> None:
    """Each saved tensor's bytes against its inactive period, coloured by its layer's position."""
    saved = [s for rank in liveness.ranks for s in rank.saved]
    order = {layer["name"]: k for k, layer in enumerate(liveness.ranks[0].trace.layers)}
    shown = [s for s in saved if s.inactive_us > 0]
    figure = new_figure(figsize=(8, 5))
    ax = figure.add_subplot()
    in_layer = [s for s in shown if s.layer in order]
    if in_layer:
        points = ax.scatter(
            [s.inactive_us / 1e3 for s in in_layer],
            [s.bytes for s in in_layer],
            c=[order[s.layer] for s in in_layer],
            cmap="viridis",
            vmin=0,
            vmax=max(len(order) - 1, 1),
            alpha=0.7,
        )
        bar = figure.colorbar(points, ax=ax, label="layer (position in the model)")
        named = sorted({order[s.layer] for s in in_layer})
        if len(named) <= 20:
            bar.set_ticks(named, labels=[list(order)[k] for k in named])
    no_layer = [s for s in shown if s.layer not in order]
    if no_layer:
        ax.scatter(
            [s.inactive_us / 1e3 for s in no_layer],
            [s.bytes for s in no_layer],
            color="grey",
            marker="x",
            label="saved outside any layer",
        )
        ax.legend(loc="lower right", fontsize="small")
    if shown:
        ax.set_xscale("log")
        ax.set_yscale("log")
    hidden = len(saved) - len(shown)
    ax.set_xlabel("inactive period (ms, replayed)")
    ax.set_ylabel("bytes")
    ax.set_title(
        f"Tensors saved for backward: {len(saved)}"
        + (f" ({hidden} with no inactive period not shown)" if hidden else "")
    )
    figure.savefig(path, dpi=100)


def _write_plots(liveness: Liveness, out: Path, memory_budget_bytes: int | None) -> list[Path]:
    """The two PNGs (Agg, no window); none, and the note on stderr, without matplotlib."""
    try:  # ``import a.b as x`` looks ``a`` up too (``from a.b import x`` would not, once a.b is loaded)
        import matplotlib.backends.backend_agg as agg
        import matplotlib.figure as mpl_figure
    except ImportError:
        print(PLOTS_MISSING, file=sys.stderr)
        return []

    def new_figure(**kwargs: Any) -> Any:
        figure = mpl_figure.Figure(**kwargs)
        agg.FigureCanvasAgg(figure)
        return figure

    curve_png, saved_png = out / MEMORY_CURVE_PNG, out / SAVED_TENSORS_PNG
    _plot_curve(new_figure, liveness, curve_png, memory_budget_bytes)
    _plot_saved(new_figure, liveness, saved_png)
    return [curve_png, saved_png]


# --- writing ------------------------------------------------------------------------------------


def write_liveness_files(
    liveness: Liveness, out_dir: str | os.PathLike, memory_budget_bytes: int | None = None
) -> list[Path]:
    """Write the report's files (see the module docstring) under ``out_dir``; return their paths.
    A directory that cannot be written raises QSyncInputError naming it."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QSyncInputError(f"{out}: cannot create the output directory: {exc.strerror or exc}") from None
    texts = {
        LIVENESS_FILE: json.dumps(liveness_document(liveness, memory_budget_bytes), separators=(",", ":")),
        SAVED_TENSORS_CSV: saved_tensors_csv(liveness),
        MEMORY_CURVE_CSV: memory_curve_csv(liveness),
        MEMORY_COUNTERS_FILE: json.dumps(memory_counters(liveness), separators=(",", ":")),
    }
    paths = []
    for name, text in texts.items():
        write_text_atomic(out / name, text, what=name)
        paths.append(out / name)
    try:
        paths.extend(_write_plots(liveness, out, memory_budget_bytes))
    except OSError as exc:
        raise QSyncInputError(f"{out}: cannot write the plots: {exc.strerror or exc}") from None
    return paths


def write_liveness(
    traces: Sequence[Trace],
    out_dir: str | os.PathLike,
    memory_budget_bytes: int | None = None,
    *,
    trace_dir: str | os.PathLike | None = None,
) -> list[Path]:
    """The liveness report of ``traces`` (one per rank; their Kineto traces read from ``trace_dir``
    for the kernel lists) written under ``out_dir``, with the budget's line where one is given."""
    return write_liveness_files(liveness_of(traces, trace_dir), out_dir, memory_budget_bytes)


def format_liveness(
    liveness: Liveness, memory_budget_bytes: int | None, paths: Sequence[Path], top: int = 5
) -> str:
    """A short summary: the peak by kind, the budget, the largest saved tensors of the peak's step
    with their inactive periods, and the files written."""
    curve = liveness.peak_curve
    at = curve.at(curve.peak_index)
    since_ms = (curve.times_us[curve.peak_index] - curve.start_us) / 1e3
    lines = [
        f"predicted peak {format_bytes(curve.peak_bytes)} (rank {curve.rank}, step {curve.step}, "
        f"{since_ms:.2f} ms into the step)",
        "  " + ", ".join(f"{kind.replace('_', ' ')} {format_bytes(at[kind])}" for kind in KINDS),
    ]
    if memory_budget_bytes is not None:
        over = curve.peak_bytes - memory_budget_bytes
        verdict = f"over it by {format_bytes(over)}" if over > 0 else "within it"
        lines.append(f"  budget {format_bytes(memory_budget_bytes)}: the recorded configuration is {verdict}")
    rank = next(r for r in liveness.ranks if r.trace.rank == curve.rank)
    saved = sorted((s for s in rank.saved if s.step == curve.step), key=lambda s: -s.bytes)
    lines.append(
        f"saved for backward in that step: {len(saved)} tensors, {format_bytes(sum(s.bytes for s in saved))}"
    )
    if saved:
        lines.append(f"  {'layer':<24} {'bytes':>10} {'inactive':>11}  made by -> first used in backward")
        for s in saved[:top]:
            layer, inactive_ms = s.layer or "(no layer)", s.inactive_us / 1e3
            lines.append(
                f"  {layer:<24} {format_bytes(s.bytes):>10} {inactive_ms:>8.3f} ms  "
                f"{s.made_by.name} -> {s.first_backward_use.name}"
            )
    lines.extend(f"note: {note}" for note in liveness.notes)
    lines.append("written: " + ", ".join(str(p) for p in paths))
    return "\n".join(lines)
