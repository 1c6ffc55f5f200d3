"""Horovod's collectives in a TF train step: the gradients it all-reduces, read from the step's
concrete function graph, and Horovod's timeline records joined to the recorded collective ops.

- `graph_collectives`: per ``HorovodAllreduce`` / ``HorovodGroupedAllreduce`` op of the graph
  (inside the ``cond`` branches ``DistributedGradientTape`` builds), its tensors' shapes, dtypes
  and bytes, and the variable each gradient belongs to (Horovod builds the ops for the ``groups``
  in order, then one per remaining variable in ``sources`` order; gradients are matched to
  variables in that order by shape);
- `attach_timeline`: each recorded collective op's tensors get the coordinator's record of them
  (`horovod_timeline.TensorRecord`: phases, the response that fused them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qsync_callback.recorder.horovod_timeline import TensorRecord, part_keys, tensor_key
from qsync_callback.recorder.trace import Op

_COLLECTIVE_OPS = ("HorovodAllreduce", "HorovodGroupedAllreduce")


def graph_collectives(
    fn: Callable, args: Sequence, kwargs: Mapping, variables: Sequence[Any], groups: Any
) -> dict[str, list[dict[str, Any]]]:
    """Per Horovod collective op of the step's graph (by `tensor_key` of its name): its tensors,
    ``{"name", "shape", "dtype", "bytes", "variable"}``. ``fn`` must be a ``tf.function``;
    ``variables`` the ``sources`` of the tape's gradient (usually ``model.trainable_variables``);
    ``groups`` what the step passed to ``DistributedGradientTape`` (a list of lists of variables
    maps gradients to variables; otherwise they map in ``variables`` order)."""
    concrete = fn.get_concrete_function(*args, **kwargs)
    graphs = _graphs(concrete.graph)
    ops = [op for graph in graphs for op in graph.get_operations() if op.type in _COLLECTIVE_OPS]
    order = list(variables)
    if isinstance(groups, list):
        named = [v for group in groups for v in group]
        order = named + [v for v in variables if all(v is not n for n in named)]
    out: dict[str, list[dict[str, Any]]] = {}
    for op in ops:
        key = tensor_key(op.name)
        tensors = []
        for name, tensor in zip(part_keys(key, len(op.inputs)), op.inputs, strict=True):
            shape = [int(d) if d is not None else -1 for d in tensor.shape]
            numel = math.prod(shape) if all(d >= 0 for d in shape) else None
            tensors.append(
                {
                    "name": name,
                    "variable": _take_variable(order, shape),
                    "shape": shape,
                    "dtype": tensor.dtype.name,
                    "bytes": numel * tensor.dtype.size if numel is not None else None,
                }
            )
        out[key] = tensors
    return out


def _graphs(graph: Any) -> list[Any]:
    """A function graph and the graphs of the functions it calls (cond branches...), breadth first
    in the order they were created."""
    out, queue, seen = [], [graph], set()
    while queue:
        g = queue.pop(0)
        if id(g) in seen:
            continue
        seen.add(id(g))
        out.append(g)
        queue.extend(f.graph for f in getattr(g, "_functions", {}).values() if getattr(f, "graph", None))
    return out


def _take_variable(order: list[Any], shape: list[int]) -> str | None:
    """The name of the first variable left in ``order`` with this shape (removed from it)."""
    for i, v in enumerate(order):
        if [int(d) for d in v.shape] == shape:
            return order.pop(i).name
    return None


def attach_timeline(ops: Sequence[Op], records: Sequence[TensorRecord]) -> int:
    """Put each collective op's tensors' timeline records into ``op.collective["tensors"]``: per
    tensor, the record with its key that ended closest to the op's completion (with the tensor's
    dtype, shape and bytes from the record where the graph did not give them). Returns how many
    tensors got a record."""
    by_key: dict[str, list[TensorRecord]] = {}
    for r in records:
        by_key.setdefault(r.key, []).append(r)
    found = 0
    for op in ops:
        if op.kind != "comm" or op.collective is None:
            continue
        key = tensor_key(op.name)
        tensors = op.collective.get("tensors")
        if tensors is None:
            names = [k for k in by_key if k == key or k.startswith(f"{key}_")]
            tensors = [{"name": k, "variable": None} for k in sorted(names)]
        for tensor in tensors:
            candidates = by_key.get(tensor["name"], [])
            if not candidates:
                continue
            record = min(candidates, key=lambda r: abs(r.end_us - op.end_us))
            tensor["timeline"] = record.to_dict()
            tensor.setdefault("shape", record.shape)
            tensor.setdefault("dtype", record.dtype)
            if tensor.get("bytes") is None:
                tensor["bytes"] = record.bytes
            found += 1
        if tensors:
            op.collective["tensors"] = tensors
            op.collective["bytes"] = sum(int(t.get("bytes") or 0) for t in tensors)
    return found
