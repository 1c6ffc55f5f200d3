"""Compiler-level features of one aten op call (CDMPP's idea: a cost model that reads the op's
tensor program, not only its framework-level description), from Apache TVM's lowering of it.

An op call is given as `recorder/op_samples.call_json` writes it: ``{"op": "aten::addmm.default",
"args": [...], "kwargs": {...}}``, each tensor as ``{"tensor": [shape, stride, kineto_dtype]}``.
`call_features` makes meta tensors of those shapes (values do not matter for lowering, nor memory),
exports a module calling the overload with ``torch.export`` (non-tensor arguments closed over),
imports it into Relax (``tvm.relax.frontend.torch.from_exported_program``; where that fails, again
after ``ExportedProgram.run_decompositions()``, torch's core-ATen decompositions) and legalizes it
(``relax.transform.LegalizeOps``): the op becomes one or more TIR PrimFuncs, its kernels before any
schedule or fusion. From those it reads `TVM_FEATURES`, in this order:

- ``kernels``: the number of PrimFuncs;
- ``blocks``: their computation blocks (``T.sblock`` other than each function's root), the stages
  of the kernels;
- ``log2 TIR FLOPs``: log2(1 + the sum of ``tvm.s_tir.analysis.estimate_tir_flops`` of each);
- ``log2 iterations``: log2(1 + the sum over all blocks of the product of the extents of the
  ``for`` loops around the block), how many times the kernels' bodies run;
- ``log2 largest kernel iterations``: the same of the PrimFunc with the most;
- ``log2 reduction iterations``: the same over the blocks with a reduction axis only;
- ``reduction axes``: the number of block iteration variables of kind ``CommReduce`` (a matmul's
  k, a sum's reduced axes);
- ``deepest loop nest``: the most ``for`` loops around one statement;
- ``log2 bytes read``, ``log2 bytes written``: log2(1 + the bytes of the PrimFuncs' buffer
  parameters each loads and does not store, resp. stores), summed over the PrimFuncs: an
  intermediate that one kernel writes and the next reads counts in both;
- ``log2 bytes allocated inside``: log2(1 + the bytes of the buffers the PrimFuncs allocate
  inside, ``alloc_buffer``: a softmax's max and sum, a pooling's padded input).

The TIR is walked with ``tvm_ffi.structural_walk`` (TVM 0.27's replacement of
``stmt_functor.post_order_visit``) and by descending through statements' bodies for the loop
nests. A buffer's shape that is not a constant counts as 0 bytes, a loop's extent as 1.

`features_of` lowers many calls: those cached first (one JSON file, `lp.costs.cache_path` kind
``tvm-features``, named by the TVM and torch versions and `TVM_FEATURES`; each call by its
canonical JSON), the rest in child processes (``python -m qsync_callback.predictor.tvm_features``,
the calls as JSON on stdin, one line per call on stdout), two at a time where there are at least
`PARALLEL_FROM` of them, within ``seconds`` in all. TVM can crash the process: a child that dies
loses only the call it was lowering (cached as one that cannot be lowered) and is started again
after it. A call that cannot be lowered is cached as null and never tried again; a call the time
ran out on is not cached. TVM is optional (the ``tvm`` extra): without it every call has None.

Measured with apache-tvm 0.27.0.post1 and torch 2.13.0 (CPU, 2 cores) on one call of every overload
that a training step of an MLP (Adam), a CNN (SGD) and an embedding + LSTM + attention model (AdamW)
dispatched: 0.15-0.45 s a call lowered in a warm process (0.5-0.8 s one that fails), plus 4-5 s to
start a child (importing TVM, torch's first export); `features_of` took 17 s for 55 calls with two
children. Lowered (kernels in parentheses):

- as exported: addmm (2), mm, bmm (1), convolution (3), native_layer_norm (1) and its backward
  (10), native_batch_norm (2) and its backward (10), _native_batch_norm_legit (2), gelu (1) and
  its backward (9), relu (1), threshold_backward (2), _softmax (1) and _softmax_backward_data
  (4), _log_softmax (1) and its backward (4), nll_loss_forward (12) and backward (9),
  max_pool2d_with_indices (2), embedding (4), _scaled_dot_product_flash_attention_for_cpu (24),
  add, add_, mul, div, sum, mean, view, t, transpose, expand, select, zeros (1), stack (2);
  detach, clone (0: no kernel);
- rewritten here first (TVM's importer lacks them, torch has no decomposition of them):
  ``convolution_backward`` (11; as two convolutions and a sum, `_convolution_backward`) and the
  optimizers' ``_foreach_add_/mul_/div_/sqrt/lerp_/addcmul_/addcdiv_`` (1 to 5 kernels a tensor;
  as their per-tensor ops, `_foreach`);
- not lowered: max_pool2d_with_indices_backward, _scaled_dot_product_flash_attention_for_cpu_backward,
  mkldnn_rnn_layer and its backward (the importer lacks them; ``run_decompositions`` leaves them:
  none is in torch's core set, and the max pool's own decomposition, a ``scatter_add``, the
  importer lacks too), embedding_dense_backward (imported as an ``index_put`` that TVM's
  legalization rejects for its 2-D indices), and ops that LegalizeOps leaves as Relax operators
  (cumsum, topk: not legalized there, so None rather than features without their work).

``run_decompositions`` lowered none of the measured calls that failed as exported; it stays as the
fallback for ATen ops outside the importer's table that decompose into ones inside it.

    python -m qsync_callback.predictor.tvm_features   # the child: calls as JSON on stdin
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from qsync_callback.child_runner import run_in_children, serve
from qsync_callback.errors import QSyncInputError
from qsync_callback.jsonio import read_cache_document, write_cache_document
from qsync_callback.lp.costs import cache_path

TVM_FEATURES: tuple[str, ...] = (
    "kernels",
    "blocks",
    "log2 TIR FLOPs",
    "log2 iterations",
    "log2 largest kernel iterations",
    "log2 reduction iterations",
    "reduction axes",
    "deepest loop nest",
    "log2 bytes read",
    "log2 bytes written",
    "log2 bytes allocated inside",
)
CACHE_KIND = "tvm-features"
CACHE_FORMAT = "qsync-tvm-features"
CACHE_VERSION = 1
CACHE_WHAT = "TVM features cache"
PARALLEL_FROM = 8  # calls to lower from which two children share them
CRASH_ON_ENV = "QSYNC_TVM_FEATURES_CRASH_ON"  # tests: a child dies by SIGSEGV on a call of this op
_STATEMENT_CHILDREN = ("body", "block", "init", "then_case", "else_case")


@functools.cache
def tvm_version() -> str | None:
    """The installed Apache TVM's version, found without importing it (TVM loads LLVM and more: a
    training process that only reads cached features or starts children need not); None where it
    is not installed."""
    try:
        if importlib.util.find_spec("tvm") is None:
            return None
    except (ImportError, ValueError):  # ``sys.modules["tvm"] = None``: blocked
        return None
    for distribution in ("apache-tvm", "tvm"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def tvm_available() -> bool:
    """Whether Apache TVM is installed here (its distribution and its ``tvm`` package)."""
    return tvm_version() is not None


@functools.cache
def _tvm() -> Any:
    import tvm
    import tvm.relax.frontend.torch  # noqa: F401 - registers `relax.frontend.torch`
    import tvm.s_tir.analysis  # noqa: F401

    return tvm


def versions() -> dict[str, str]:
    """What cached features are valid for: the TVM and torch versions and the feature names."""
    import torch

    return {"tvm": str(tvm_version()), "torch": torch.__version__, "features": ",".join(TVM_FEATURES)}


# --- one call ---------------------------------------------------------------------------------


class _Slot:
    """Where a call's tensor goes among the exported module's inputs."""

    def __init__(self, index: int):
        self.index = index


def _fill(value: Any, tensors: Sequence[Any]) -> Any:
    if isinstance(value, list):
        return [_fill(v, tensors) for v in value]
    if isinstance(value, _Slot):
        return tensors[value.index]
    return value


def _foreach(func: Any, args: list, kwargs: dict) -> list:
    """A ``_foreach_<op>`` (``_``) call as the per-tensor ``<op>`` calls it stands for (the optimizer's
    arithmetic, which TVM's importer lacks): tensor and scalar lists indexed, the rest as given; the
    last argument passed by name where ``<op>`` takes it keyword-only (``addcdiv``'s ``value``)."""
    import torch

    name = func._schema.name.removeprefix("aten::_foreach_").removesuffix("_")
    per_tensor = getattr(torch.ops.aten, name)
    schema = func._schema.arguments
    listed = {i for i, a in enumerate(schema) if str(a.type) in ("List[Tensor]", "List[number]")}
    keyword = next(  # the per-tensor op's keyword-only scalar (``addcdiv``'s ``value``)
        (
            a.name
            for overload in per_tensor.overloads()
            for a in getattr(per_tensor, overload)._schema.arguments
            if a.kwarg_only and str(a.type) == "number"
        ),
        None,
    )
    results = []
    for k in range(len(args[0])):
        values = [v[k] if i in listed else v for i, v in enumerate(args)]
        try:
            results.append(per_tensor(*values, **kwargs))
        except (RuntimeError, TypeError):
            if keyword is None:
                raise
            results.append(per_tensor(*values[:-1], **{keyword: values[-1]}, **kwargs))
    return results


def _convolution_backward(
    grad: Any, x: Any, weight: Any, bias_sizes: Any, stride: list, padding: list, dilation: list,
    transposed: bool, output_padding: list, groups: int, mask: list,
) -> list:  # fmt: skip
    """``convolution_backward`` (not transposed) as the two convolutions and the sum it computes
    (torch has no decomposition of it, TVM's importer lacks it): the input's gradient a transposed
    convolution of the output's, the weight's a convolution of the input by the output's gradient
    (stride and dilation swapped, the groups made batches), the bias's a sum."""
    import torch

    if transposed:
        raise NotImplementedError("the backward of a transposed convolution")
    aten = torch.ops.aten
    dims = x.dim() - 2
    results = []
    if mask[0]:
        extra = [
            x.shape[2 + d]
            - (
                (grad.shape[2 + d] - 1) * stride[d]
                - 2 * padding[d]
                + dilation[d] * (weight.shape[2 + d] - 1)
                + 1
            )
            for d in range(dims)
        ]
        results.append(aten.convolution(grad, weight, None, stride, padding, dilation, True, extra, groups))
    if mask[1]:
        n, c_in = x.shape[:2]
        c_out = grad.shape[1]
        # batches as channels, one group of them per group of channels: (C_in/g, g*N, ...)
        inputs = x.reshape(n, groups, c_in // groups, *x.shape[2:]).transpose(0, 2)
        inputs = inputs.reshape(c_in // groups, groups * n, *x.shape[2:])
        kernels = grad.reshape(n, groups, c_out // groups, *grad.shape[2:]).transpose(0, 1)
        kernels = kernels.transpose(1, 2).reshape(c_out, n, *grad.shape[2:])
        full = aten.convolution(inputs, kernels, None, dilation, padding, stride, False, [0] * dims, groups)
        wanted = full.transpose(0, 1)
        for d in range(dims):
            wanted = wanted.narrow(2 + d, 0, weight.shape[2 + d])
        results.append(wanted)
    if mask[2]:
        results.append(grad.sum([0, *range(2, grad.dim())]))
    return results


def _exported(call: Mapping[str, Any]) -> Any:
    """``torch.export`` of a module that makes the call, its tensors its inputs (a ``_foreach_`` op
    and ``convolution_backward`` as what they compute, `_foreach` and `_convolution_backward`)."""
    import torch

    from qsync_callback.recorder.op_samples import TORCH_DTYPES, call_overload, call_values

    func = call_overload(call)
    tensors: list = []  # made on the meta device (no memory, whatever their size), the module's inputs

    def slot(spec: list) -> _Slot:
        shape, stride, dtype = spec
        tensors.append(torch.empty_strided(shape, stride, dtype=TORCH_DTYPES[dtype], device="meta"))
        return _Slot(len(tensors) - 1)

    meta = torch.device("meta")  # features are of the program, not of the device
    args = call_values(list(call["args"]), slot, meta)
    kwargs = {key: call_values(v, slot, meta) for key, v in call["kwargs"].items()}
    if func._schema.name.startswith("aten::_foreach_"):
        func = functools.partial(_foreach, func)
        run = lambda a, k: func(a, k)  # noqa: E731
    elif func is torch.ops.aten.convolution_backward.default:
        run = lambda a, k: _convolution_backward(*a, **k)  # noqa: E731
    else:
        run = lambda a, k: func(*a, **k)  # noqa: E731

    class Call(torch.nn.Module):
        def forward(self, *inputs):
            result = run(_fill(args, inputs), {k: _fill(v, inputs) for k, v in kwargs.items()})
            leaves = [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
            return tuple(leaves) if leaves else tuple(inputs)  # an in-place op: the inputs it wrote

    return torch.export.export(Call(), tuple(tensors))


def _legalized(call: Mapping[str, Any]) -> Any:
    """The call as a legalized Relax module; raises where it cannot be lowered."""
    tvm = _tvm()
    importer = tvm.relax.frontend.torch.from_exported_program
    program = _exported(call)
    try:
        mod = importer(program)
    except Exception:  # noqa: BLE001 - an ATen op the importer lacks: try torch's decompositions
        mod = importer(program.run_decompositions())
    mod = tvm.relax.transform.LegalizeOps()(mod)
    left = _relax_ops_left(mod)
    if left:  # no TIR of these (LegalizeOps leaves a cumsum or a topk to a later, target's pass)
        raise NotImplementedError(f"not legalized: {', '.join(sorted(left))}")
    return mod


def _relax_ops_left(mod: Any) -> set[str]:
    """The Relax operators the legalized module still calls, other than calls of its PrimFuncs."""
    import tvm_ffi

    tvm = _tvm()
    left: set[str] = set()

    def call(node: Any) -> None:
        if isinstance(node.op, tvm.ir.Op) and not node.op.name.startswith("relax.call_tir"):
            left.add(node.op.name)

    for func in mod.functions.values():
        if isinstance(func, tvm.relax.Function):
            tvm_ffi.structural_walk(func.body, (tvm.relax.Call, call), order="post")
    return left


def _int(expr: Any) -> int | None:
    try:
        return int(expr)
    except (TypeError, ValueError):
        return None


def _bytes(buffer: Any) -> int:
    """A TIR buffer's bytes, 0 where its shape is not constant."""
    dtype = _tvm().DataType(str(buffer.dtype))
    elements = 1
    for n in buffer.shape:
        size = _int(n)
        if size is None:
            return 0
        elements *= size
    return elements * max(1, (dtype.bits * dtype.lanes + 7) // 8)


def _log2(x: float) -> float:
    return math.log2(1.0 + max(x, 0.0))


def _kernel(func: Any) -> dict[str, float]:
    """What one PrimFunc contributes to the features (see the module docstring)."""
    import tvm_ffi

    tvm = _tvm()
    tirx, s_tir = tvm.tirx, tvm.s_tir
    found = {"blocks": 0, "iterations": 0, "reduction iterations": 0, "reduction axes": 0, "depth": 0}
    allocated: list[Any] = []

    def descend(stmt: Any, runs: int, depth: int, root: bool) -> None:
        if isinstance(stmt, tirx.For):
            extent = _int(stmt.extent)
            runs, depth = runs * (1 if extent is None else extent), depth + 1
        elif isinstance(stmt, s_tir.SBlock):
            allocated.extend(stmt.alloc_buffers)
            if not root:
                reducing = sum(1 for v in stmt.iter_vars if int(v.iter_type) == tirx.IterVar.CommReduce)
                found["blocks"] += 1
                found["iterations"] += runs
                found["reduction axes"] += reducing
                found["reduction iterations"] += runs if reducing else 0
        elif isinstance(stmt, tirx.AllocBuffer):
            allocated.append(stmt.buffer)
        found["depth"] = max(found["depth"], depth)
        if isinstance(stmt, tirx.SeqStmt):
            for child in stmt.seq:
                descend(child, runs, depth, False)
        for name in _STATEMENT_CHILDREN:
            child = getattr(stmt, name, None)
            if isinstance(child, (tirx.Stmt, s_tir.SBlock)):
                descend(child, runs, depth, root and isinstance(stmt, s_tir.SBlockRealize))

    descend(func.body, 1, 0, True)
    stored: set[Any] = set()
    loaded: set[Any] = set()
    tvm_ffi.structural_walk(
        func.body,
        [
            (tirx.BufferStore, lambda node: stored.add(node.buffer)),
            (tvm.ir.TensorLoad, lambda node: loaded.add(node.source)),
        ],
        order="post",
    )
    params = [p for p in func.params if hasattr(p, "shape") and hasattr(p, "dtype")]
    flops = tvm.s_tir.analysis.estimate_tir_flops(tvm.IRModule({"main": func}))
    return {
        **found,
        "flops": float(flops),
        "read": sum(_bytes(p) for p in params if p in loaded and p not in stored),
        "written": sum(_bytes(p) for p in params if p in stored),
        "allocated": sum(_bytes(b) for b in allocated),
    }


def module_features(mod: Any) -> list[float]:
    """`TVM_FEATURES` of a legalized Relax module."""
    tvm = _tvm()
    kernels = [_kernel(f) for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]

    def total(key: str) -> float:
        return float(sum(k[key] for k in kernels))

    return [
        float(len(kernels)),
        total("blocks"),
        _log2(total("flops")),
        _log2(total("iterations")),
        _log2(max((k["iterations"] for k in kernels), default=0)),
        _log2(total("reduction iterations")),
        total("reduction axes"),
        float(max((k["depth"] for k in kernels), default=0)),
        _log2(total("read")),
        _log2(total("written")),
        _log2(total("allocated")),
    ]


def call_features(call: Mapping[str, Any]) -> list[float] | None:
    """`TVM_FEATURES` of one call, lowered in this process; None where TVM is missing or the call
    cannot be lowered (an op torch cannot export or TVM cannot import or legalize)."""
    if not tvm_available():
        return None
    try:
        _tvm()
    except Exception:  # noqa: BLE001 - a broken install lowers nothing
        return None
    try:
        return module_features(_legalized(call))
    except Exception:  # noqa: BLE001 - whatever fails in export or TVM: not lowered
        return None


# --- many calls: the cache and the children ------------------------------------------------------


def features_path(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The cache file of lowered calls, for this TVM and torch."""
    return cache_path("any", cache_dir, kind=CACHE_KIND, key=versions())


def _load(path: str, quiet: bool = False) -> tuple[dict[str, list[float] | None], bool]:
    """The cached calls in ``path`` and whether the file is sound (or absent); a file that is not
    warns (unless ``quiet``) and counts as empty."""
    document, problem = read_cache_document(path, CACHE_FORMAT, CACHE_VERSION, versions(), CACHE_WHAT)
    if document is not None and not isinstance(document.get("calls"), Mapping):
        document, problem = None, "holds no calls"
    if problem is not None and not quiet:
        warnings.warn(f"{path}: {problem}; the TVM features cache starts afresh", stacklevel=3)
    if document is None:
        return {}, problem is None
    width = len(TVM_FEATURES)
    return {
        key: value
        for key, value in document["calls"].items()
        if value is None or (isinstance(value, list) and len(value) == width)
    }, True


def _save(path: str, calls: Mapping[str, list[float] | None]) -> None:
    try:
        body = {"calls": dict(calls)}
        write_cache_document(path, CACHE_FORMAT, CACHE_VERSION, versions(), body, CACHE_WHAT)
    except (OSError, QSyncInputError) as error:
        warnings.warn(f"the TVM features were not cached: {error}", stacklevel=3)


def features_of(
    calls: Sequence[Mapping[str, Any]],
    cache_dir: str | os.PathLike[str] | None = None,
    seconds: float = 120.0,
) -> list[list[float] | None]:
    """`TVM_FEATURES` of each call (see the module docstring), None where it cannot be lowered, TVM
    is missing, or the ``seconds`` ran out before it."""
    if not calls or not tvm_available():
        return [None] * len(calls)
    path = features_path(cache_dir)
    cached, sound = _load(path)
    keys = [json.dumps(call, sort_keys=True) for call in calls]
    todo = list(dict.fromkeys(k for k in keys if k not in cached))
    lowered: dict[str, list[float] | None] = {}
    if todo and seconds > 0:
        deadline = time.monotonic() + seconds
        workers = 2 if len(todo) >= PARALLEL_FROM and (os.cpu_count() or 1) > 1 else 1
        shards = [todo[w::workers] for w in range(workers)]

        def lower(shard: list[str]) -> None:
            def report(i: int, value: list[float] | None) -> None:
                lowered[shard[i]] = value

            run_in_children(__name__, [json.loads(k) for k in shard], deadline, report)

        threads = [threading.Thread(target=lower, args=(shard,)) for shard in shards]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if lowered:  # what another process may have added meanwhile kept
            cached = {**cached, **_load(path, quiet=True)[0], **lowered}
    if lowered or not sound:
        _save(path, cached)
    return [cached.get(k) for k in keys]


def _child() -> None:
    """Lower the calls handed over (`child_runner.serve`) on one thread; a call of the op named in
    `CRASH_ON_ENV` (for the tests) takes the child down."""
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    crash_on = os.environ.get(CRASH_ON_ENV)

    def lower(call: Mapping[str, Any], request: Mapping[str, Any]) -> list[float] | None:
        if call.get("op") == crash_on:
            os.kill(os.getpid(), signal.SIGSEGV)
        return call_features(call)

    serve(lower)


if __name__ == "__main__":
    _child()
