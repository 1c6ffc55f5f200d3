"""One training step traced symbolically: the recorder's trace with no real compute (Siu's idea).

A copy of the LightningModule and its batch are made of fake tensors (``FakeTensorMode``: shapes,
dtypes and devices, no data and no memory), and two training steps run on them as Lightning runs
an automatic-optimization step: ``training_step``, ``zero_grad(set_to_none=True)``, ``backward``,
``optimizer.step()``. The first builds what a run holds across steps (the gradients, the optimizer
state); the second is traced, as the recorder records a step after its warm-up:

- every aten op, through a dispatch mode: its name (``aten::<op>``, after decomposition, so
  ``nn.Linear`` shows as ``aten::t`` and ``aten::addmm``), its inputs' shapes and dtypes (named as
  Kineto names them), its FLOPs (torch's own per-op formulas, `torch.utils.flop_counter`), the bytes
  it allocates, its phase (forward, backward, update; ``other``: ``zero_grad``), and the module and
  layer that ran it: in forward the innermost module whose forward is running, in backward the
  module whose forward op made the autograd node being run (by the node's sequence number, which
  autograd takes before it dispatches the op down to this mode);
- memory: every tensor storage an op makes is an allocation, and a weak reference on it gives its
  free (at the op after which it died). Storages alive when the step starts (parameters, buffers,
  last step's gradients, optimizer state, the batch) are the resident bytes, and their frees in
  the step are reported too (last step's gradients at ``zero_grad``), as the profiler reports them;
- what fake tensors cannot know of memory, learned from real runs of single ops on made-up values:
  an output a fake kernel leaves empty where the real one fills it (oneDNN's RNN layer returns a
  workspace for its backward, 12 MB for the benchmarks' LSTM, as an empty tensor) is made at its
  real size, from one run of the op in this process (`real_output_shapes`); and the scratch a
  native kernel holds inside its call (oneDNN's convolutions and RNN layers), which no tensor
  shows, is measured per distinct call in a child process (`op_probes.scratch_bytes`) and added
  as an allocation freed before the next op.

The step runs at the Trainer's ``precision`` as Lightning runs it: ``bf16-mixed`` and ``16-mixed``
run ``training_step`` under ``torch.autocast`` (so its casts and its low-precision ops are the
trace's, the backward and the optimizer step outside it, the parameters and their optimizer state
fp32; ``16-mixed`` on a CPU is ``bf16-mixed``, as Lightning makes it); ``bf16-true``, ``16-true`` and
``64-true`` convert the module and the batch's floating-point tensors to that dtype and run
``training_step`` with it as the default dtype.

Durations are not known here: each op gets 1 us, one after the other, and the estimate prices them
(`predictor/op_costs.py`) and says so in the trace's ``symbolic`` field. The module and batch given
are not changed, and no real tensor is made: a model too large for this machine can be traced.

A module that needs real values (``.item()``, a data-dependent shape) cannot run on fake tensors:
`SymbolicTraceError` names the op that needed them.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeCopyMode,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from qsync_callback.errors import QSyncInputError
from qsync_callback.model_layers import layer_table, layers_of
from qsync_callback.plan import module_layers
from qsync_callback.recorder.flop_formulas import flop_registry
from qsync_callback.recorder.module_calls import activation_refusals
from qsync_callback.recorder.op_probes import MAX_PROBE_BYTES, SCRATCH_SECONDS, made_up, scratch_bytes
from qsync_callback.recorder.op_samples import KINETO_DTYPES, OpSample, call_json, op_class, op_key
from qsync_callback.recorder.trace import Op, Step, Trace

STEP_INDEX = 1  # the traced step (the first, untraced, builds the gradients and optimizer state)
UNRECORDED_OPS = {  # not ops of the step: queries of a tensor's metadata (fake tensors answer them
    # through the dispatcher), and the profiler's ranges below
    "device", "size", "sym_size", "stride", "sym_stride", "numel", "sym_numel", "dim",
    "is_contiguous", "storage_offset", "sym_storage_offset", "is_same_size",
    # the profiler's ranges (an optimizer's step opens one), which a real run's profiler records as
    # ranges, not ops
    "_record_function_enter", "_record_function_enter_new", "_record_function_exit",
}  # fmt: skip


LIGHTNING_PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    # Lightning's precision settings: (training_step's autocast dtype, the module's and batch's dtype)
    "64-true": (None, torch.float64),
    "32-true": (None, None),
    "bf16-mixed": (torch.bfloat16, None),
    "16-mixed": (torch.float16, None),
    "bf16-true": (None, torch.bfloat16),
    "16-true": (None, torch.float16),
}
LIGHTNING_ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}  # Lightning's


def lightning_precision(precision: str | int, device: str = "cpu") -> str:
    """``precision`` (a ``Trainer(precision=...)`` value) as Lightning runs it on ``device``: its
    full name, ``16-mixed`` on a CPU as ``bf16-mixed``; `QSyncInputError` for one it does not take."""
    name = LIGHTNING_ALIASES.get(str(precision), str(precision))
    if name not in LIGHTNING_PRECISIONS:
        accepted = ", ".join([*LIGHTNING_PRECISIONS, *LIGHTNING_ALIASES])
        raise QSyncInputError(f"precision {precision!r}: expected one of Lightning's: {accepted}")
    return "bf16-mixed" if name == "16-mixed" and not device.startswith("cuda") else name


class SymbolicTraceError(QSyncInputError):
    """The module cannot be traced on fake tensors (it needs real values)."""


class _StepRecorder(TorchDispatchMode):
    """Records every aten op run under it, with its phase, module, FLOPs and the storages it
    makes (see the module docstring); ``phase`` is set by the caller."""

    def __init__(
        self, model: nn.Module, distinct_ops: dict[tuple, OpSample] | None = None, fake: bool = True
    ):
        super().__init__()
        self.distinct_ops = distinct_ops
        self.fake = fake
        self._real_shapes: dict[str, list[tuple[list[int], torch.dtype] | None]] = {}  # call -> outputs
        self.phase = "other"
        self.ops: list[Op] = []
        self.memory_events: list[list] = []
        self._layers = set(layers_of(model))
        self._modules: list[str] = []  # the forward calls running, outermost first
        self.calls: dict[str, int] = {}  # forward calls per module in the traced step
        self._made_by: dict[int, tuple[str | None, str | None]] = {}  # autograd seq -> (module, layer)
        self._addresses: dict[int, int] = {}  # id(storage) -> its address here
        self._refs: dict[int, weakref.ref] = {}  # keeps the free callbacks alive
        self._next_address = 1
        self.closed = False  # frees after the traced step are not the step's
        self._handles = [
            handle
            for name, module in model.named_modules()
            if name
            for handle in (
                module.register_forward_pre_hook(self._enter(name)),
                module.register_forward_hook(self._leave(name)),
            )
        ]

    def _enter(self, name: str) -> Callable[..., None]:
        def enter(*_: Any) -> None:
            self._modules.append(name)
            if not self.closed:
                self.calls[name] = self.calls.get(name, 0) + 1

        return enter

    def _leave(self, name: str) -> Callable[..., None]:
        def leave(*_: Any) -> None:
            if self._modules and self._modules[-1] == name:
                self._modules.pop()

        return leave

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def address(self, storage: torch.UntypedStorage, op_id: int, nbytes: int | None = None) -> int:
        """The storage's address here, given one at its first sight, with its free watched (a
        storage already alive: ``op_id`` -1, no allocation event)."""
        key = id(storage)
        if key in self._addresses:
            return self._addresses[key]
        addr, self._next_address = self._next_address, self._next_address + 1
        self._addresses[key] = addr
        size = storage.nbytes() if nbytes is None else nbytes
        if op_id >= 0:
            self.memory_events.append([self._clock(), addr, size, op_id])
        self._refs[key] = weakref.ref(storage, self._freed(key, addr, size))
        return addr

    def hold_within(self, op_id: int, nbytes: int) -> None:
        """An allocation of ``nbytes`` no tensor shows, made as op ``op_id`` starts and freed before
        the next op (a kernel's scratch)."""
        addr, self._next_address = self._next_address, self._next_address + 1
        self.memory_events += [[float(op_id), addr, nbytes, op_id], [op_id + 0.25, addr, -nbytes, op_id]]

    def _freed(self, key: int, addr: int, nbytes: int) -> Callable[[weakref.ref], None]:
        def freed(_: weakref.ref) -> None:
            self._addresses.pop(key, None)
            self._refs.pop(key, None)
            if self.closed:
                return
            op_id = self.ops[-1].id if self.ops else -1
            self.memory_events.append([self._clock() + 0.5, addr, -nbytes, op_id])

        return freed

    def _clock(self) -> float:
        return float(len(self.ops) - 1) if self.ops else 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except DataDependentOutputException as error:
            raise _needs_values(error) from error
        if self.fake:
            out = self._workspaces_sized(func, args, kwargs, out)
        if func.overloadpacket.__name__ not in UNRECORDED_OPS:
            self._record(func, args, kwargs, out)
        return out

    def _workspaces_sized(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """``out`` with each empty tensor that the op fills on real tensors made at its real size:
        a native kernel's workspace (oneDNN's RNN layer returns one for its backward), which a
        fake kernel cannot size. Learned by running the op once on made-up values of the same
        shapes (`real_output_shapes`), once per distinct call."""
        outputs, spec = tree_flatten(out)
        empty = [isinstance(t, torch.Tensor) and t.numel() == 0 for t in outputs]
        if not any(empty) or not any(
            isinstance(t, torch.Tensor) and t.numel() for t in tree_leaves((args, kwargs))
        ):
            return out
        try:
            key = json.dumps(call_json(func, args, kwargs), sort_keys=True)
        except ValueError:  # arguments JSON cannot hold: left as they are
            return out
        if key not in self._real_shapes:
            self._real_shapes[key] = real_output_shapes(func, args, kwargs)
        real = self._real_shapes[key]
        if real is None or len(real) != len(outputs):
            return out
        for i, is_empty in enumerate(empty):
            if is_empty and real[i] is not None and math.prod(real[i][0]):
                outputs[i] = torch.empty(real[i][0], dtype=real[i][1], device=outputs[i].device)
        return tree_unflatten(outputs, spec)

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        module, layer = self._owner()
        op = Op(
            id=len(self.ops),
            name=f"aten::{func.overloadpacket.__name__}",
            kind=self.phase,
            thread="main",
            start_us=float(len(self.ops)),
            dur_us=1.0,
            step=STEP_INDEX,
            layer=layer,
            module=module,
            input_shapes=[list(t.shape) for t in inputs],
            input_dtypes=[KINETO_DTYPES.get(t.dtype, str(t.dtype)) for t in inputs],
            flops=float(_flops(func, args, kwargs, out)),
        )
        self.ops.append(op)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        before = len(self.memory_events)
        for t in outputs:
            self.address(t.untyped_storage(), op.id)
        if self.phase == "forward":
            # autograd made this op's node (if it has one) before dispatching down to this mode,
            # taking the sequence number before the next one
            self._made_by.setdefault(torch._C._autograd._get_sequence_nr() - 1, (module, layer))
        op.bytes = sum(e[2] for e in self.memory_events[before:] if e[2] > 0)
        key = op_key(op.name, op.input_shapes, op.input_dtypes)
        if self.distinct_ops is not None and key not in self.distinct_ops:
            try:
                call = call_json(func, args, kwargs)
            except ValueError:  # arguments JSON cannot hold: left to the model
                return
            self.distinct_ops[key] = OpSample(
                op.name, op.input_shapes, op.input_dtypes, op.flops, op.bytes, 0.0, call=call
            )

    def _owner(self) -> tuple[str | None, str | None]:
        """The module and layer running the op: the forward calls in progress, or in backward
        those whose forward made the autograd node being run."""
        if self.phase == "forward":
            layer = next((m for m in reversed(self._modules) if m in self._layers), None)
            return (self._modules[-1] if self._modules else None), layer
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is not None:
                return self._made_by.get(node._sequence_nr(), (None, None))
        return None, None


def _needs_values(error: DataDependentOutputException) -> SymbolicTraceError:
    return SymbolicTraceError(
        f"the model's {error.func} needs real values (a data-dependent result, such as .item() or a "
        "shape that depends on the data), which a symbolic trace does not have"
    )


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """The op's floating-point operations by torch's own formula (0 where it has none: pointwise
    ops and the like are priced by their bytes)."""
    count = flop_registry.get(func.overloadpacket)
    if count is None:
        return 0
    return int(count(*args, **kwargs, out_val=out))


def symbolic_trace(
    module: nn.Module,
    batch: Any,
    device: str = "cpu",
    fake: bool = True,
    distinct_ops: dict[tuple, OpSample] | None = None,
    scratch_seconds: float = SCRATCH_SECONDS,
    precision: str | int = "32-true",
) -> Trace:
    """The trace of one training step of LightningModule ``module`` on ``batch`` (any nest of
    tensors), on fake tensors, at the Trainer's ``precision`` (see the module docstring); its ops
    last 1 us each until priced.
    ``fake=False``: on real tensors, a copy of the module's (for a module that needs real values:
    the same trace, at the cost of two real steps and the copy's memory). ``distinct_ops``, where given,
    gets each distinct op (by name, input shapes and dtypes) as an `OpSample` with its ``call``, to
    time alone or to lower. ``scratch_seconds``: the most spent measuring the kernels' scratch in a
    child process (0: not measured, as in a live run)."""
    precision = lightning_precision(precision, device)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with FakeCopyMode(fake_mode) if fake else contextlib.nullcontext():
        model = copy.deepcopy(module)
    if fake:
        batch = tree_map(lambda v: fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, batch)
    dtype = LIGHTNING_PRECISIONS[precision][1]
    with fake_mode:  # an optimizer that makes its state when built (Adagrad) makes it fake
        if dtype is not None:  # Lightning's "-true" precisions: the module and the batch's floats
            _convert_floats(model, dtype)
            batch = tree_map(
                lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, batch
            )
        optimizers = _optimizers(model)
    in_training_step = _precision_context(precision, device)
    if distinct_ops is None and scratch_seconds > 0:  # the scratch is measured per distinct call
        distinct_ops = {}
    recorder = _StepRecorder(model, distinct_ops, fake=fake)
    shapes = [list(t.shape) for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    try:
        with fake_mode, _quiet_outside_a_trainer():
            try:
                _train_step(model, batch, optimizers, None, in_training_step)
            except (RuntimeError, ValueError, IndexError) as error:
                if isinstance(error, DataDependentOutputException):
                    raise
                raise QSyncInputError(
                    f"the batch (tensor shapes {shapes}) does not fit the model: "
                    f"{type(error).__name__}: {error}"
                ) from error
            resident = _resident(recorder, model, optimizers, batch)
            recorder.calls.clear()  # the traced step's calls only
            with recorder:
                _train_step(model, batch, optimizers, recorder, in_training_step)
            recorder.closed = True
    except DataDependentOutputException as error:
        raise _needs_values(error) from error
    finally:
        recorder.closed = True
        recorder.remove()
    scratch = _add_scratch(recorder, (distinct_ops or {}).values(), device, scratch_seconds)
    end = float(len(recorder.ops))
    return Trace(
        rank=0,
        world_size=1,
        device=device,
        steps=[Step(STEP_INDEX, 0.0, max(end, 1.0))],
        ops=recorder.ops,
        framework="torch",
        framework_version=torch.__version__.split("+")[0],
        memory_events=sorted(recorder.memory_events, key=lambda e: e[0]),
        resident_bytes=resident,
        layers=layer_table(module),
        activation_costs={"refused": _refusals(model, recorder.calls)},
        symbolic={
            "durations": "not priced yet (1 us per op)",
            "batch": f"shapes {shapes}",
            "tensors": "fake" if fake else "real",
            "scratch": scratch,
            "threads": torch.get_num_threads(),  # the intra-op threads its ops are priced at
            "precision": precision,
        },
    )


def real_output_shapes(
    func: Any, args: tuple, kwargs: dict
) -> list[tuple[list[int], torch.dtype] | None] | None:
    """The shape and dtype of each output (None where it is not a tensor) of ``func`` run once on
    real tensors made up at the shapes of fake ``args`` (as `op_probes` makes them), in this
    process; None where its inputs are over `op_probes.MAX_PROBE_BYTES` or it fails."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if sum(t.untyped_storage().nbytes() for t in tensors) > MAX_PROBE_BYTES:
        return None

    def real(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return made_up(value.shape, value.stride(), value.dtype, value.device)

    # the random numbers a random op draws here are not the run's (a live run's check_fit traces too)
    with unset_fake_temporarily(), torch.random.fork_rng(devices=[]):
        try:
            out = func(*tree_map(real, args), **tree_map(real, kwargs))
        except (RuntimeError, ValueError, TypeError, IndexError):
            return None
        return [
            (list(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in tree_flatten(out)[0]
        ]


def _add_scratch(recorder: _StepRecorder, samples: Iterable[OpSample], device: str, seconds: float) -> str:
    """Add to the recorder's memory each op's kernel scratch (`op_probes.scratch_bytes`: its
    distinct calls that are neither views nor pointwise, each run on made-up values in a child
    process), allocated as the op starts and freed before the next; what was measured, as a line."""
    if seconds <= 0:
        return "not measured"
    calls = {
        op_key(s.name, s.shapes, s.dtypes): s.call
        for s in samples
        if s.call and op_class(s.name) not in ("pointwise", "view")  # those allocate only their outputs
    }
    if not calls:
        return "not measured"
    sized = dict(zip(calls, scratch_bytes(list(calls.values()), device, seconds), strict=True))
    with_scratch = 0
    for op in recorder.ops:
        nbytes = sized.get(op_key(op.name, op.input_shapes, op.input_dtypes))
        if nbytes:
            recorder.hold_within(op.id, nbytes)
            with_scratch += 1
    measured = sum(v is not None for v in sized.values())
    return (
        f"kernel scratch measured on made-up values for {measured} of {len(calls)} distinct calls "
        f"(recorder/op_probes.py), held by {with_scratch} ops"
    )


def _refusals(model: nn.Module, calls: Mapping[str, int]) -> dict[str, str]:
    """The modules that cannot take a recompute policy (`activation_refusals`, on the traced
    step's forward calls); offload's copy costs are measured in a real run, so it is not offered."""
    counted = {name: calls.get(name, 0) for name, _ in model.named_modules() if name}
    return activation_refusals(model, module_layers(layers_of(model)), counted)


def _optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers ``configure_optimizers`` returns, in any of Lightning's forms."""
    if getattr(model, "automatic_optimization", True) is False:
        raise QSyncInputError(
            "the module optimizes by hand (automatic_optimization = False): a symbolic trace runs "
            "Lightning's automatic optimization step only"
        )
    configured = model.configure_optimizers()
    found: list[torch.optim.Optimizer] = []

    def take(value: Any) -> None:
        if isinstance(value, torch.optim.Optimizer):
            found.append(value)
        elif isinstance(value, Mapping):
            take(value.get("optimizer"))
        elif isinstance(value, (list, tuple)):
            for item in value:
                take(item)

    take(configured)
    if not found:
        raise QSyncInputError(f"configure_optimizers returned no optimizer ({type(configured).__name__})")
    return found


@contextlib.contextmanager
def _quiet_outside_a_trainer() -> Iterator[None]:
    """Keep off the user's console what the traced step says only because it runs on fake tensors
    outside a Trainer: Lightning's warning that ``self.log`` has no trainer, and the traceback
    FakeTensor logs before raising an error of a batch that does not fit (the estimate says it once)."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*`self\.log\(\)` but the `self\.trainer` reference")
            yield
    finally:
        fake_log.setLevel(level)


def _convert_floats(model: nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` as Lightning's "-true" precisions convert it (floating-point parameters and
    buffers; a parameter shared by two modules stays shared), by replacing them: ``Module.to`` swaps
    a fake tensor in place, which the fake mode's own references to it refuse."""
    converted: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_floating_point():
                    continue
                if id(tensor) not in converted:
                    data = tensor.detach().to(dtype)
                    if isinstance(tensor, nn.Parameter):
                        data = nn.Parameter(data, requires_grad=tensor.requires_grad)
                    converted[id(tensor)] = data
                table[name] = converted[id(tensor)]


def _precision_context(precision: str, device: str) -> Callable[[], contextlib.AbstractContextManager]:
    """What Lightning's precision plugin runs ``training_step`` under at ``precision``: autocast
    (``-mixed``), the module's dtype as the default dtype (``-true``), or nothing (``32-true``)."""
    autocast, dtype = LIGHTNING_PRECISIONS[precision]
    if autocast is not None:
        return lambda: torch.autocast(torch.device(device).type, dtype=autocast, cache_enabled=False)
    if dtype is None:
        return contextlib.nullcontext

    @contextlib.contextmanager
    def default_dtype() -> Iterator[None]:
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(before)

    return default_dtype


def _train_step(
    model: nn.Module,
    batch: Any,
    optimizers: Sequence[torch.optim.Optimizer],
    recorder: _StepRecorder | None,
    in_training_step: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """Lightning's automatic-optimization step: training_step (under ``in_training_step``, the
    precision's context), zero_grad, backward, step."""

    def phase(name: str) -> None:
        if recorder is not None:
            recorder.phase = name

    phase("forward")
    with in_training_step():
        out = model.training_step(batch, 0)
    loss = out["loss"] if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise QSyncInputError(f"training_step returned {type(out).__name__}, not a loss tensor")
    phase("other")
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    phase("backward")
    loss.backward()
    del loss, out
    phase("update")
    for optimizer in optimizers:
        optimizer.step()
    phase("other")


def _resident(
    recorder: _StepRecorder, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], batch: Any
) -> dict[str, int]:
    """The bytes alive when the traced step starts, by category (as `torch_recorder.resident_bytes`
    counts them), each storage counted once and given its address."""
    seen: set[int] = set()

    def total(tensors: Iterable[Any]) -> int:
        nbytes = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if id(storage) not in seen:
                seen.add(id(storage))
                recorder.address(storage, -1)
                nbytes += storage.nbytes()
        return nbytes

    params = list(model.parameters())
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values()]
    return {
        "parameters": total(params),
        "buffers": total(model.buffers()),
        "gradients": total(p.grad for p in params),
        "optimizer_state": total(state),
        "gradient_buckets": 0,
        "other": total(tree_leaves(batch)),
    }
