"""Measure a TF train step per op type under TF's uniform bfloat16 rewrite: the costs that op-type
precision plans (``Plan.op_precision``, TF's auto-mixed-precision unit) are priced on.

`OpTypeProbe` runs `OpTypeProbe.calls` calls of the live step switched to TF's oneDNN bfloat16
auto-mixed-precision rewrite with its default lists (the caller's ``switch`` re-traces the step and
returns the undo), after the recorded window: the first call with TF's graph collection on, which
yields the graph TF really runs (names, fused types, dtypes, data inputs, the rewrite's Cast ops);
`SETTLE_CALLS` unprofiled (the first calls of a rewritten step are slower: TF and oneDNN build and
cache its kernels, which would make bf16 look slow against the recorded fp32 steps); then
`PROFILED_STEPS` under one ``tf.profiler`` session, each marked as a step. Five, not fewer: the
allocator's peak under the rewrite moves from step to step by more than under fp32 (the example's
MLP on one process, on a CPU without native bf16: 27.0 to 34.0 MiB over 31 steps, where fp32 read
18.0 to 20.0; with native bf16, 20.0 to 29.0 MiB over 31 steps, where fp32 read 19.0 to 20.0). Then
the reading calls: `READING_ROUNDS` rounds of the recorded step and the rewrite in turns, a block of
each a round (`alternation.Alternation`: the first call of a block settles after its switch, the
next `READING_BLOCK_CALLS` are timed; the recorded step first, the undo puts its function back, the
rewrite re-traces). The rewrite's change against the recorded step is these rounds' (``turns``,
`predictor/op_precision.rewrite_change`): a drift of the machine's speed cancels in each round,
where ten calls of the rewrite timed after the recorded ones took it whole. The rewrite's blocks
read TF's allocator peak as a timed step's is (`recorder/tf_memory.StepPeaks`): its predicted peak
is calibrated on the most any profiled or reading call read, the largest of about as many steps as a
window measures its peak over, since the largest of five profiled steps falls short of the largest
of twenty (the example's MLP: 27.0 MiB over five, 29.0 over the verify window's 23). Every rank switches
at the same calls. The calls always run, once each; a failure of the probe's own work switches the
step back at once, and the table then only says why nothing was measured (``{"note": ...}``).

Which calls feed what: the probe's calls come after the window's timed calls and none of them is
among the baseline's timed calls (`TFRecorder` times no call from the probe's first on), so the
baseline's measured step time owes nothing to them; their profiled op times and the reading calls'
turns feed the predictions of every bf16 candidate, and nothing else does: a plan's prediction is
made before it is applied, and the calls recorded under it (the verify window) only measure it.
One candidate is in-sample all the same: the plan whose bf16 op types are those the rewrite ran,
the configuration these calls ran; its figure is theirs, and the planner's table says so
(`planner/tf_plans.py`).

`op_type_table` joins the probe with the recorded fp32 trace into ``precision_costs["op_types"]``
(schema in `recorder/trace.py`), with what the allocator gave each op per step in both (what it
made, and its scratch: `allocated_per_step`), and each of the rewrite's casts (what an op-type
plan's peak is priced on, `predictor/op_precision.py`), the most the allocator read in use in the
profiled steps and the peak of each of the rewrite's reading calls (the rewrite's own peaks, on
the largest of which the uniform plan's predicted peak is calibrated:
`op_precision.rewrite_reading`), and the reading calls' turns. The table's unit is TF's: an op
type as its lists name it. The profile names ops after fusion (a ``_FusedMatMul`` named
``mlp/fc1/Relu`` runs MatMul, BiasAdd and Relu): such an op counts as its root type (MatMul).
Tensor sizes come from the traced step function's static shapes. On a CPU without bfloat16 the
rewrite changes no op, and the table has no costs.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import tensorflow as tf

from qsync_callback.alternation import BASELINE, BLOCK_STEPS, MEDIAN_ROUNDS, PLAN, Alternation
from qsync_callback.plan import FULL_PRECISION
from qsync_callback.recorder.tf_memory import StepPeaks
from qsync_callback.recorder.trace import Trace
from qsync_callback.recorder.xspace import STEP_NAME, convert_xspace, find_xspace, load_xspace

LOW = "bf16"
SETTLE_CALLS = 3  # after graph collection: oneDNN creates and caches the bf16 primitives, TF warms up
PROFILED_STEPS = 5
READING_ROUNDS = MEDIAN_ROUNDS  # the fewest rounds whose median has a noise
READING_BLOCK_CALLS = BLOCK_STEPS  # fixed, not from each rank's step time: every rank switches together
READING = Alternation(READING_ROUNDS, looks=1, block_steps=READING_BLOCK_CALLS)
_FIRST_PROFILED = 1 + SETTLE_CALLS
_FIRST_READING = _FIRST_PROFILED + PROFILED_STEPS
_FUSED_ROOT = {
    "_FusedMatMul": "MatMul",
    "_FusedConv2D": "Conv2D",
    "_FusedConv3D": "Conv3D",
    "_FusedBatchMatMulV2": "BatchMatMulV2",
    "_FusedDepthwiseConv2dNative": "DepthwiseConv2dNative",
}
_AMP_CAST = "-AutoMixedPrecision"


class LiveStep(Protocol):
    """The train step as its caller runs it: the function in force and the call in progress."""

    fn: Callable
    args: tuple
    kwargs: dict
    groups: Any  # what the step passes to ``hvd.DistributedGradientTape(tape, groups=...)``


class OpTypeProbe:
    """The probe's calls, driven by the caller at each call's start and end (counted from 0)."""

    def __init__(
        self,
        step: LiveStep,
        logdir: Path,
        switch: Callable[[], Callable[[], None]],
        peaks: StepPeaks,
    ):
        self.step = step
        self.logdir = logdir
        self.switch = switch
        self.peaks = peaks
        self.step_peaks: list[int] = []  # the rewrite's reading calls' allocator peaks (bytes)
        self.turns: dict[str, list[list[float]]] = {  # the reading calls' times, by configuration and round
            config: [[] for _ in range(READING_ROUNDS)] for config in (BASELINE, PLAN)
        }
        self.note: str | None = None  # why nothing was measured
        self._undo: Callable[[], None] | None = None
        self._collecting = False
        self._profiling = False
        self._mark: Any = None
        self._graph: Any = None  # the optimized GraphDef TF ran
        self._shapes: dict[str, tuple[int, int]] = {}  # "op:index" -> (elements, 1 if float32)

    @property
    def calls(self) -> int:
        """How many calls the probe takes: graph collection, settling, profiled, reading."""
        return _FIRST_READING + READING.done_step

    def step_boundary(self, call: int) -> None:
        if call == 0:
            self._guard(self._begin)
        elif call == _FIRST_PROFILED:
            self._guard(self._start_profiler)
        if self._profiling:
            self._mark = tf.profiler.experimental.Trace(STEP_NAME, step_num=call, _r=1)
            self._mark.__enter__()
        elif call >= _FIRST_READING and self._reading():
            reading = call - _FIRST_READING
            self._guard(lambda: self._switch_to(READING.switch_at(reading)))
            block = READING.timed_block(reading + 1)
            if block is not None and block[1] == PLAN and self._reading():
                self.peaks.start()  # a timed call of the rewrite

    def step_end(self, call: int, elapsed_ms: float) -> None:
        self._end_mark()
        if call == 0 and self._collecting:
            self._guard(self._collected)
        elif call == _FIRST_READING - 1:
            self._guard(self._stop_profiler)
        elif call >= _FIRST_READING and self._reading():
            block = READING.timed_block(call - _FIRST_READING + 1)
            if block is not None:
                round_, config = block
                self.turns[config][round_].append(elapsed_ms)
                peak = self.peaks.end() if config == PLAN else None
                if peak is not None:
                    self.step_peaks.append(peak)

    def table(self, trace: Trace) -> dict[str, Any]:
        """Switch the step back, then the op-type table of ``trace`` (or why there is none)."""
        self.close()
        if self.note is None and self._graph is None:
            self.note = "the probe's calls did not run"
        if self.note is None:
            try:
                table = op_type_table(trace, self.logdir, self._graph, self._shapes)
                if any(self.turns[PLAN]):  # the reading calls ran
                    table["step_peak_bytes"] = list(self.step_peaks)
                    table["turns"] = {c: [list(b) for b in blocks] for c, blocks in self.turns.items()}
                return table
            except Exception as exc:  # noqa: BLE001 - a probe that measured nothing is a note, not a failure
                self.note = f"{type(exc).__name__}: {exc}"
        return {"note": f"TF's uniform bf16 rewrite was not measured ({self.note})"}

    def close(self) -> None:
        """Stop measuring and switch the step back; safe at any time, more than once."""
        self._end_mark()
        if self._collecting:
            from tensorflow.python.eager import context

            self._collecting = False
            context.disable_graph_collection()
        if self._profiling:
            self._profiling = False
            try:
                tf.profiler.experimental.stop()
            except Exception as exc:  # noqa: BLE001
                self.note = self.note or f"stopping the profiler: {type(exc).__name__}: {exc}"
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def _guard(self, work: Callable[[], None]) -> None:
        if self.note is not None:
            return
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - measuring must never break the step
            self.note = f"{type(exc).__name__}: {exc}"
            self.close()

    def _reading(self) -> bool:
        """Whether the reading calls go on: the probe's work has not failed."""
        return self.note is None and self._graph is not None

    def _switch_to(self, config: str | None) -> None:
        """At a block's first call: the recorded step (the rewrite undone) or the rewrite again."""
        if config == BASELINE and self._undo is not None:
            undo, self._undo = self._undo, None
            undo()
        elif config == PLAN and self._undo is None:
            self._undo = self.switch()

    def _begin(self) -> None:
        from tensorflow.python.eager import context

        self._undo = self.switch()
        context.enable_graph_collection()
        self._collecting = True

    def _collected(self) -> None:
        """The largest optimized graph TF collected (the step's; the others initialize variables),
        and the static shapes of the traced step's tensors."""
        from tensorflow.python.eager import context

        metadata = context.export_run_metadata()
        context.disable_graph_collection()
        self._collecting = False
        graphs = [f.post_optimization_graph for f in metadata.function_graphs] if metadata else []
        self._graph = max(graphs, key=lambda g: len(g.node), default=None)
        if self._graph is None:
            raise ValueError("TF collected no graph of the rewritten step")
        graph = self.step.fn.get_concrete_function(*self.step.args, **self.step.kwargs).graph
        for op in graph.get_operations():
            for i, out in enumerate(op.outputs):
                if out.shape.is_fully_defined():
                    numel = math.prod(out.shape.as_list())
                    self._shapes[f"{op.name}:{i}"] = (numel, int(out.dtype == tf.float32))

    def _start_profiler(self) -> None:
        shutil.rmtree(self.logdir, ignore_errors=True)
        tf.profiler.experimental.start(str(self.logdir))
        self._profiling = True

    def _stop_profiler(self) -> None:
        self._profiling = False
        tf.profiler.experimental.stop()

    def _end_mark(self) -> None:
        mark, self._mark = self._mark, None
        if mark is not None:
            mark.__exit__(None, None, None)


def op_type(node: Any) -> str:
    """The type TF's lists name a GraphDef node by: a fused op's root type, else its op."""
    return _FUSED_ROOT.get(node.op, node.op)


def _input(name: str) -> tuple[str, str] | None:
    """(producer, "producer:index") of a GraphDef input; None for a control input."""
    if name.startswith("^"):
        return None
    producer, _, index = name.partition(":")
    return producer, f"{producer}:{index or 0}"


def _per_step_us(names_durs: Sequence[tuple[str, float]], steps: int) -> dict[str, float]:
    totals: dict[str, float] = {}
    for name, dur in names_durs:
        totals[name] = totals.get(name, 0.0) + dur / steps
    return totals


def allocated_per_step(
    ops: Sequence[Any], memory_events: Sequence[Sequence], steps: int
) -> tuple[dict[str, int], dict[str, int]]:
    """Per op (by name): the bytes the allocator gave it per step that outlived it (over ``steps``
    steps), and its scratch: the most bytes it was given and freed before it ended alive at once
    (the largest over its runs). An allocation is paired with the next free of its address."""
    by_id = {op.id: op for op in ops}
    events = sorted(memory_events, key=lambda e: (e[0], e[2]))  # at one time, frees first
    freed_at: dict[int, float] = {}  # event index of an allocation -> when its address was freed
    open_at: dict[Any, int] = {}
    for k, (ts, addr, nbytes, _) in enumerate(events):
        if nbytes > 0:
            open_at[addr] = k
        elif addr in open_at:
            freed_at[open_at.pop(addr)] = ts
    made: dict[str, int] = {}
    scratch: dict[str, int] = {}
    alive: dict[int, int] = {}  # op id -> its scratch bytes alive now
    scratch_of: dict[Any, tuple[int, int]] = {}  # address -> (op id, bytes) of scratch alive there
    for k, (_, addr, nbytes, op_id) in enumerate(events):
        if nbytes < 0:
            if addr in scratch_of:
                owner, given = scratch_of.pop(addr)
                alive[owner] -= given
            continue
        op = by_id.get(op_id)
        if op is None:
            continue
        if freed_at.get(k, float("inf")) <= op.start_us + op.dur_us:
            scratch_of[addr] = (op.id, nbytes)
            alive[op.id] = alive.get(op.id, 0) + nbytes
            scratch[op.name] = max(scratch.get(op.name, 0), alive[op.id])
        else:
            made[op.name] = made.get(op.name, 0) + nbytes
    return {name: total // max(steps, 1) for name, total in made.items()}, scratch


def op_type_table(
    trace: Trace, logdir: Path, graph: Any, shapes: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    """``precision_costs["op_types"]`` (schema in `recorder/trace.py`) from the recorded fp32
    ``trace``, the probe's profile (``logdir``), the optimized ``graph`` TF ran and the traced
    step's tensor ``shapes`` (the reading calls' figures are the probe's own, `OpTypeProbe.table`)."""
    converted = convert_xspace(load_xspace(find_xspace(logdir)))
    bf16_us = _per_step_us([(op.name, op.dur_us) for op in converted["ops"]], len(converted["steps"]))
    fp32_us = _per_step_us([(op.name, op.dur_us) for op in trace.ops if op.kind != "comm"], len(trace.steps))
    nodes = {n.name: n for n in graph.node}
    casts = {name: n for name, n in nodes.items() if n.op == "Cast" and name.endswith(_AMP_CAST)}

    def source(name: str) -> tuple[str, str] | None:
        """The producer a (resolved) input comes from, through the rewrite's casts."""
        resolved = _input(name)
        while resolved is not None and resolved[0] in casts:
            resolved = _input(casts[resolved[0]].input[0])
        return resolved

    ops = {name: op_type(nodes[name]) for name in fp32_us if name in nodes and name not in casts}
    bf16 = tf.bfloat16.as_datatype_enum
    low_ops = {
        name
        for name, node in nodes.items()
        if name not in casts and "T" in node.attr and node.attr["T"].type == bf16
    }
    ends = ops.keys() | low_ops  # an edge is kept when one of its ends is one of these
    edges = []
    for name, node in nodes.items():
        if name in casts:
            continue
        for raw in node.input:
            found = source(raw)
            if found is None or not {found[0], name} & ends:
                continue
            numel, is_float = shapes.get(found[1], (0, 0))
            if is_float and numel:
                edges.append([found[0], name, 4 * numel])
    costs: dict[str, dict[str, Any]] = {}
    for name, kind in ops.items():
        entry = costs.setdefault(kind, {"ops": 0, "measured_ops": 0, "fp32_us": 0.0, "bf16_us": 0.0})
        entry["ops"] += 1
        if "T" in nodes[name].attr and nodes[name].attr["T"].type == bf16 and name in bf16_us:
            entry["measured_ops"] += 1
            entry["fp32_us"] += fp32_us[name]
            entry["bf16_us"] += bf16_us[name]
    costs = {kind: c for kind, c in costs.items() if c["measured_ops"]}
    cast_costs: dict[str, dict[str, float]] = {}
    for name, node in casts.items():
        found = source(node.input[0])
        numel = shapes.get(found[1], (0, 0))[0] if found else 0
        if name not in bf16_us or not numel:
            continue
        pair = f"{FULL_PRECISION}->{LOW}" if node.attr["DstT"].type == bf16 else f"{LOW}->{FULL_PRECISION}"
        entry = cast_costs.setdefault(pair, {"us": 0.0, "bytes": 0, "casts": 0})
        entry["us"] += bf16_us[name]
        entry["bytes"] += 4 * numel
        entry["casts"] += 1
    for entry in cast_costs.values():
        entry["us_per_byte"] = entry["us"] / entry["bytes"]
    fp32_bytes, fp32_scratch = allocated_per_step(trace.ops, trace.memory_events, len(trace.steps))
    bf16_bytes, bf16_scratch = allocated_per_step(
        converted["ops"], converted["memory_events"], len(converted["steps"])
    )
    cast_allocated = {}
    for name, node in casts.items():
        found = source(node.input[0])
        if found is not None and (name in bf16_bytes or name in bf16_us):
            direction = LOW if node.attr["DstT"].type == bf16 else FULL_PRECISION
            key = f"{found[0]}->{direction}"
            cast_allocated[key] = cast_allocated.get(key, 0) + bf16_bytes.get(name, 0)
    table = {
        "ops": ops,
        "low_ops": sorted(low_ops),
        "edges": edges,
        "costs": costs,
        "casts": cast_costs,
        "allocated": {name: [fp32_bytes.get(name, 0), bf16_bytes.get(name, 0)] for name in ops},
        "scratch": {
            name: [fp32_scratch.get(name, 0), bf16_scratch.get(name, 0)]
            for name in ops
            if fp32_scratch.get(name) or bf16_scratch.get(name)
        },
        "cast_allocated": cast_allocated,
        "source": (
            f"rank {trace.rank}: fp32 from its {len(trace.steps)} recorded steps, bf16 and the rewrite's "
            f"casts from {len(converted['steps'])} profiled steps of TF's uniform bf16 rewrite"
        ),
    }
    if converted["recorded_peak_bytes"] is not None:
        table["recorded_peak_bytes"] = converted["recorded_peak_bytes"]
    return table
