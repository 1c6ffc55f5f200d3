"""Mixed precision per op type for TensorFlow: measure each op type at bfloat16, plan which types run
there, and enact the plan through TF's auto-mixed-precision env lists.

What TF 2.15.1 does (found by experiment on this project's AVX512-BF16 CPU, with ``bf16_op_counts``
of `apply` and a MatMul whose fp32 and bf16 results differ visibly):

- The oneDNN bfloat16 rewrite (``auto_mixed_precision_onednn_bfloat16``) builds its four lists
  (allow, infer, deny, clear) each time Grappler optimizes a function, and reads
  ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_<LIST>_ADD`` and ``..._<LIST>_REMOVE`` (comma-separated op
  types) then. Set in this process before a new ``tf.function`` is first called, they take effect
  on it (a MatMul denied so computes exactly as in fp32; the same function with the default lists
  differs by bf16 rounding); functions optimized before keep what they got. So a plan is enacted
  by setting the env and re-tracing the step (``tf.function`` of its Python function again).
- An op type on two lists (e.g. ``ALLOWLIST_ADD=AddV2``, AddV2 being on the default infer list)
  makes the whole rewrite fail ("Op lists have conflicting entries", logged by Grappler, nothing
  raised): the step silently stays fp32. So an op type moved to one list is removed from the three
  others (``_REMOVE``; removing a type a list does not hold does nothing).
- ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL`` is read by the CUDA fp16 lists only
  (``TENSOR_CORES_ONLY`` empties their infer, deny and clear lists): on the bf16 rewrite it changes
  nothing (same op counts). It is left alone.
- ``..._PRIORLIST_FILE`` and ``..._PRIORLIST_ADD`` (op types to force to low precision, dPRO's fork
  of TF) are not read by TF: no effect here. They are written anyway, for forks that read them.
- On the bf16 lists of 2.15, ``Sum`` and ``Tanh`` are on none (a missing comma in TF's source joins
  them into one name); ``_REMOVE`` makes this harmless.
- Denying an op type keeps it fp32 (so does only removing it from its list: the same op counts in
  our checks). Its infer-list neighbours can follow it: TF paints an infer or clear op bf16 only
  after or between bf16 ops, so in the example's CNN a ReluGrad kept at fp32 keeps the BiasAddGrad
  after it at fp32 too. The table lists the ops the uniform rewrite ran at bf16 (``low_ops``); the
  op-type prediction lets those whose type a plan does not decide follow the ops upstream of them
  (`predictor/op_precision.py`).

The plan's unit is TF's: an op type as the lists name it. The profile names ops after fusion (a
``_FusedMatMul`` named ``mlp/fc1/Relu`` runs MatMul, BiasAdd and Relu): such an op counts as its
root type (MatMul); the fused types follow the root through TF's infer and clear lists.

Measured costs (`Bf16Probe`, on rank 0, during the uniform bf16 candidate's warm-up calls): the
candidate's first call runs with TF's graph collection on, which yields the graph TF really runs
(names, fused types, dtypes, data inputs, the rewrite's Cast ops); after ``SETTLE_CALLS`` more,
the next ``PROFILED_STEPS`` calls run under one ``tf.profiler`` session, converted by
`recorder/xspace.py`. `op_type_table` joins them with the recorded fp32 trace into
``precision_costs["op_types"]`` (schema in `recorder/trace.py`): tensor sizes come from the traced
step function's static shapes.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tensorflow as tf

from qsync_callback.jsonio import write_text_atomic
from qsync_callback.plan import FULL_PRECISION
from qsync_callback.recorder.trace import Trace
from qsync_callback.recorder.xspace import STEP_NAME, convert_xspace, find_xspace, load_xspace

ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"
LISTS = ("ALLOWLIST", "INFERLIST", "DENYLIST", "CLEARLIST")
PRIORLIST_FILE_VAR = ENV_PREFIX + "PRIORLIST_FILE"
PRIORLIST_ADD_VAR = ENV_PREFIX + "PRIORLIST_ADD"
PRIORLIST_FILE = "amp_priorlist.txt"
LOW = "bf16"
# TF 2.15's oneDNN bfloat16 lists (tensorflow/core/grappler/optimizers/auto_mixed_precision_lists.h,
# AutoMixedPrecisionListsMkl): the allow list, and the deny list of numerically dangerous ops
TF_BF16_ALLOWLIST = frozenset(
    {
        "Conv2D",
        "Conv2DBackpropFilter",
        "Conv2DBackpropInput",
        "Conv3D",
        "Conv3DBackpropFilterV2",
        "Conv3DBackpropInputV2",
        "DepthwiseConv2dNative",
        "DepthwiseConv2dNativeBackpropFilter",
        "DepthwiseConv2dNativeBackpropInput",
        "MatMul",
        "BatchMatMul",
        "BatchMatMulV2",
        "Einsum",
    }
)
TF_BF16_DENYLIST = frozenset(
    {
        "Exp",
        "Expm1",
        "L2Loss",
        "Mean",
        "Pow",
        "SaveV2",
        "SoftmaxCrossEntropyWithLogits",
        "SparseSoftmaxCrossEntropyWithLogits",
    }
)
# never planned into bf16 unless asked: the deny list, softmax and the reductions TF leaves unlisted
UNSAFE_OP_TYPES = TF_BF16_DENYLIST | {"Softmax", "LogSoftmax", "Sum", "Prod"}
SETTLE_CALLS = 3  # after graph collection: oneDNN creates and caches the bf16 primitives, TF warms up
PROFILED_STEPS = 3
PROBE_CALLS = 1 + SETTLE_CALLS + PROFILED_STEPS + 1  # collection, settling, profiled calls, one after
_FUSED_ROOT = {
    "_FusedMatMul": "MatMul",
    "_FusedConv2D": "Conv2D",
    "_FusedConv3D": "Conv3D",
    "_FusedBatchMatMulV2": "BatchMatMulV2",
    "_FusedDepthwiseConv2dNative": "DepthwiseConv2dNative",
}
_AMP_CAST = "-AutoMixedPrecision"


# ----------------------------------------------------------------------------- the env lists


def env_lists(op_precision: Mapping[str, str], priorlist_file: Path | None = None) -> dict[str, str]:
    """The env that enacts ``op_precision`` (op type -> "bf16" or "fp32") on TF's bf16 rewrite:
    low-precision types not on TF's allow list go to ``ALLOWLIST_ADD``, fp32 types to
    ``DENYLIST_ADD``, each removed from the other lists (see the module docstring); the low-precision
    types also go to ``PRIORLIST_ADD`` and, one per line, to ``priorlist_file`` (written here) for
    forks that read them. Only non-empty variables are returned."""
    low = sorted(t for t, p in op_precision.items() if p == LOW)
    full = sorted(t for t, p in op_precision.items() if p == FULL_PRECISION)
    other = sorted(set(op_precision) - set(low) - set(full))
    if other:
        raise ValueError(
            f"TF's bf16 rewrite runs op types at bf16 or fp32 only, not {op_precision[other[0]]}"
        )
    names = {
        "ALLOWLIST_ADD": [t for t in low if t not in TF_BF16_ALLOWLIST],
        "ALLOWLIST_REMOVE": full,
        "INFERLIST_REMOVE": low + full,
        "CLEARLIST_REMOVE": low + full,
        "DENYLIST_REMOVE": low,
        "DENYLIST_ADD": full,
        "PRIORLIST_ADD": low,
    }
    env = {ENV_PREFIX + key: ",".join(types) for key, types in names.items() if types}
    if priorlist_file is not None and low:
        write_text_atomic(priorlist_file, "".join(f"{t}\n" for t in low), what="AMP priorlist")
        env[PRIORLIST_FILE_VAR] = str(priorlist_file)
    return env


class EnvSetting:
    """Sets env variables and puts back what was there before (absent ones removed again)."""

    def __init__(self) -> None:
        self._before: dict[str, str | None] = {}

    def set(self, env: Mapping[str, str]) -> None:
        """Set ``env``, remembering each variable's value before the first change."""
        for key, value in env.items():
            self._before.setdefault(key, os.environ.get(key))
            os.environ[key] = value

    def restore(self) -> None:
        """Every variable changed back to its value before (or removed)."""
        for key, value in self._before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._before = {}


# ----------------------------------------------------------------------------- measuring


class Bf16Probe:
    """The uniform bf16 candidate's first `PROBE_CALLS` calls on rank 0: graph collection on the
    first, `SETTLE_CALLS` unprofiled (the first calls of a rewritten step are slower: TF and oneDNN
    build and cache its kernels, which would make bf16 look slow against the recorded fp32 steps), a
    profiler session over the next `PROFILED_STEPS` (each marked as a step), then one call to
    settle. ``error`` says why it measured nothing; the calls themselves always run, once."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.graph: Any = None  # the optimized GraphDef of the candidate
        self.shapes: dict[str, tuple[int, int]] = {}  # "op:index" -> (elements, 1 if float32)
        self.error: str | None = None
        self._profiling = False

    def call(self, k: int, fn: Callable, args: Sequence, kwargs: Mapping) -> Any:
        """Run call ``k`` (1-based) of the candidate."""
        if self.error is None and k == 1:
            from tensorflow.python.eager import context

            self._guard(context.enable_graph_collection)
            try:
                result = fn(*args, **kwargs)
            finally:
                self._guard(self._collected, context)
            self._guard(self._read_shapes, fn, args, kwargs)
            return result
        first = 2 + SETTLE_CALLS
        if self.error is None and first <= k < first + PROFILED_STEPS:
            if k == first:
                self._guard(self._start)
            try:
                if self._profiling:
                    with tf.profiler.experimental.Trace(STEP_NAME, step_num=k, _r=1):
                        result = fn(*args, **kwargs)
                else:
                    result = fn(*args, **kwargs)
            except BaseException:
                self.stop()
                raise
            if k == first + PROFILED_STEPS - 1:
                self.stop()
            return result
        return fn(*args, **kwargs)

    def _guard(self, work: Callable, *args: Any) -> None:
        try:
            work(*args)
        except Exception as exc:  # noqa: BLE001 - measuring must never break the step
            self.error = f"{type(exc).__name__}: {exc}"
            self.stop()

    def _collected(self, context: Any) -> None:
        """The largest optimized graph TF collected (the step's; the others initialize variables)."""
        metadata = context.export_run_metadata()
        context.disable_graph_collection()
        graphs = [f.post_optimization_graph for f in metadata.function_graphs] if metadata else []
        self.graph = max(graphs, key=lambda g: len(g.node), default=None)

    def _read_shapes(self, fn: Callable, args: Sequence, kwargs: Mapping) -> None:
        """Static shapes of the traced step function's tensors, for the bytes of each tensor."""
        if self.graph is None:
            raise ValueError("TF collected no graph of the candidate")
        graph = fn.get_concrete_function(*args, **kwargs).graph
        for op in graph.get_operations():
            for i, out in enumerate(op.outputs):
                if out.shape.is_fully_defined():
                    self.shapes[f"{op.name}:{i}"] = (
                        math.prod(out.shape.as_list()),
                        int(out.dtype == tf.float32),
                    )

    def _start(self) -> None:
        shutil.rmtree(self.logdir, ignore_errors=True)
        tf.profiler.experimental.start(str(self.logdir))
        self._profiling = True

    def stop(self) -> None:
        """Stop the profiler session if one runs; safe to call at any time."""
        if self._profiling:
            self._profiling = False
            try:
                tf.profiler.experimental.stop()
            except Exception as exc:  # noqa: BLE001
                self.error = self.error or f"stopping the profiler: {type(exc).__name__}: {exc}"


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


def op_type_table(trace: Trace, probe: Bf16Probe) -> dict[str, Any]:
    """``precision_costs["op_types"]`` (schema in `recorder/trace.py`) from the recorded fp32
    ``trace`` and the probe of the uniform bf16 rewrite (graph, shapes, profiled steps)."""
    converted = convert_xspace(load_xspace(find_xspace(probe.logdir)))
    bf16_us = _per_step_us([(op.name, op.dur_us) for op in converted["ops"]], len(converted["steps"]))
    fp32_us = _per_step_us([(op.name, op.dur_us) for op in trace.ops if op.kind != "comm"], len(trace.steps))
    nodes = {n.name: n for n in probe.graph.node}
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
            numel, is_float = probe.shapes.get(found[1], (0, 0))
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
        numel = probe.shapes.get(found[1], (0, 0))[0] if found else 0
        if name not in bf16_us or not numel:
            continue
        pair = f"{FULL_PRECISION}->{LOW}" if node.attr["DstT"].type == bf16 else f"{LOW}->{FULL_PRECISION}"
        entry = cast_costs.setdefault(pair, {"us": 0.0, "bytes": 0, "casts": 0})
        entry["us"] += bf16_us[name]
        entry["bytes"] += 4 * numel
        entry["casts"] += 1
    for entry in cast_costs.values():
        entry["us_per_byte"] = entry["us"] / entry["bytes"]
    return {
        "ops": ops,
        "low_ops": sorted(low_ops),
        "edges": edges,
        "costs": costs,
        "casts": cast_costs,
        "source": (
            f"rank {trace.rank}: fp32 from its {len(trace.steps)} recorded steps, bf16 and the rewrite's "
            f"casts from {len(converted['steps'])} profiled steps of TF's uniform bf16 rewrite"
        ),
    }
