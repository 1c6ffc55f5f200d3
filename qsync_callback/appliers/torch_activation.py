"""Carry out a plan's activation policies on a live torch model: keep, recompute or offload.

Each module a plan gives ``"recompute"`` or ``"offload"`` gets a forward of its own, an instance
attribute that calls the class's forward; the undo deletes it. Forward without grad (validation)
runs as it is: nothing is saved for backward there.

- **recompute**: the forward runs through ``torch.utils.checkpoint.checkpoint`` (non-reentrant,
  ``preserve_rng_state=True``): what its ops save for backward is let go after forward, and made
  again by running the forward again just before its backward needs it. Its tensor arguments are
  kept (checkpoint saves them to run it again): a single layer whose saved tensors are its input
  frees nothing, a block frees everything saved inside it. The run again calls the forward, not
  the module: the module's own hooks do not fire twice, its children's do. The RNG states (the CPU's
  and those of the devices of its tensor arguments, keyword arguments included) are replayed, so a
  dropout draws the same mask and the losses are bit-identical to the run without the policy. A
  forward that updates buffers (BatchNorm's running statistics in training) would update them
  twice: checkpoint's ``context_fn`` gives the recompute a context of its own (that is how the
  recompute is told from the forward), `_buffers_kept`, which restores every buffer of the module
  (the objects and their values) as they were before the recompute, so they end the step as they
  would without the policy.
- **offload**: the forward runs under ``torch.autograd.graph.saved_tensors_hooks``: each tensor
  its ops save whose storage holds at least `MIN_OFFLOAD_BYTES` and is not a parameter's or a
  buffer's, nor an argument of the call held elsewhere anyway (the batch; the output of a ReLU,
  which the ReLU saved: a residual block's input), nor a view of any of these, nor a sparse,
  conjugate or subclass tensor, is put in the offload
  store of its device (`qsync_callback.offload_store.store_for`: files on local disk for the CPU,
  pinned host memory for CUDA) and got back when backward unpacks it. Smaller tensors stay where
  they are: moving them costs more than they free. Prefetch (on CUDA, and on the CPU when the
  applier is not ``synchronous``), with a lookahead of one module call: when backward first unpacks
  a tensor of an offloaded call, every tensor of that call and of the offloaded call before it in
  forward (the next one backward reaches) start coming back; so the previous call's reads overlap
  this call's backward, and the first call backward reaches (the last in forward) waits for its
  own. A synchronous CPU store reads each tensor when backward unpacks it.

A module can take a policy unless `activation_refusals` says why not (the applier refuses a plan
that names one, with the reason, before changing anything; see there). What a module's calls do
(how often it runs in a step, what it returns, whether it changes its input in place) is observed
on a real step by `CallProbe`.

The applier wraps whatever module is registered under the name when it applies (after the
precision applier swapped in its LP modules); apply is all or nothing and the undo restores every
module exactly and closes the stores (their files are removed). A store's fault (a disk that
filled up) never breaks the step: the tensor stays in memory, and `ActivationApplier.failure`
says what failed, for the loop to roll the plan back.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from qsync_callback.errors import QSyncInputError
from qsync_callback.offload_store import DEFAULT_MAX_PENDING_BYTES, OffloadStore, store_for
from qsync_callback.plan import KEEP, MIN_OFFLOAD_BYTES, RECOMPUTE, Plan
from qsync_callback.recorder.module_calls import activation_refusals

# --- recompute ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    """Run the block, then put every buffer of ``module`` back as it was before it (object and
    values): the recompute's context, so a forward that updates its buffers does it once."""
    kept = [
        (owner, name, buffer, buffer.clone())
        for owner in module.modules()
        for name, buffer in owner._buffers.items()
        if buffer is not None
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, buffer, value in kept:
                owner._buffers[name] = buffer
                buffer.copy_(value)


def _call(forward: Callable[..., Any], kwargs: dict[str, Any], *args: Any) -> Any:
    return forward(*args, **kwargs)


def _recomputed(module: nn.Module) -> Callable[..., Any]:
    """``module``'s forward through a non-reentrant checkpoint (see the module docstring)."""
    forward = module.forward
    contexts = lambda: (contextlib.nullcontext(), _buffers_kept(module))  # noqa: E731 (forward, recompute)

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # keyword arguments travel as a positional dict: checkpoint reads the devices whose RNG it
        # replays from its positional arguments only
        return checkpoint(
            _call,
            forward,
            kwargs,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=contexts,
        )

    return recomputed


# --- offload --------------------------------------------------------------------------------------


class _Call:
    """One call of an offloaded module: the keys of what it put in the stores, and a weak reference
    to the offloaded call before it in forward (the next one backward reaches)."""

    __slots__ = ("inputs", "saved", "previous", "fetching", "__weakref__")

    def __init__(self, inputs: set[int]) -> None:
        self.inputs = inputs  # the storages of its arguments held elsewhere: left where they are
        self.saved: list[tuple[OffloadStore, int]] = []
        self.previous: weakref.ref[_Call] | None = None
        self.fetching = False

    def prefetch(self) -> None:
        if not self.fetching:
            self.fetching = True
            by_store: dict[int, tuple[OffloadStore, list[int]]] = {}
            for store, key in self.saved:
                by_store.setdefault(id(store), (store, []))[1].append(key)
            for store, keys in by_store.values():
                store.prefetch(keys)


class _Saved:
    """What autograd holds for an offloaded tensor: its key; releasing it frees the store's copy."""

    __slots__ = ("store", "key", "call")

    def __init__(self, store: OffloadStore, key: int, call: _Call):
        self.store, self.key, self.call = store, key, call

    def __del__(self) -> None:
        try:
            self.store.release(self.key)
        except Exception:  # at interpreter exit the store may be half torn down: nothing to free then
            pass


def _held_elsewhere(argument: Any) -> bool:
    """Whether a module's argument is a tensor that stays in memory whatever the module does: one
    autograd does not track (the batch, which its caller holds), or the output of an op whose
    backward saved it (a ReLU's, a softmax's)."""
    if not isinstance(argument, torch.Tensor):
        return False
    node = argument.grad_fn
    return node is None or hasattr(node, "_raw_saved_result")


class _Offloader:
    """The saved-tensor hooks of one applied plan's offloaded modules, and their stores."""

    def __init__(self, model: nn.Module, directory: str | None, max_pending_bytes: int, synchronous: bool):
        self._kept = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self._directory = directory
        self._max_pending_bytes = max_pending_bytes
        self._synchronous = synchronous
        self.stores: dict[torch.device, OffloadStore] = {}
        self._last: weakref.ref[_Call] | None = None
        self._fault: str | None = None  # a store that could not be made

    def wrap(self, module: nn.Module) -> Callable[..., Any]:
        forward = module.forward

        def offloaded(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            call = _Call(
                {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _held_elsewhere(t)}
            )
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(call, t), self._unpack):
                return forward(*args, **kwargs)

        return offloaded

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return False  # parameters, subclasses, sparse tensors: left as they are
        if tensor.is_conj() or tensor.is_neg() or tensor.device.type not in ("cpu", "cuda"):
            return False  # a lazy conjugate or negation is a flag of the view the bytes do not keep
        storage = tensor.untyped_storage()
        return storage.nbytes() >= MIN_OFFLOAD_BYTES and storage.data_ptr() not in self._kept

    def _pack(self, call: _Call, tensor: torch.Tensor) -> Any:
        if not self._offloadable(tensor) or tensor.untyped_storage().data_ptr() in call.inputs:
            return tensor
        store = self.stores.get(tensor.device)
        if store is None:
            if self._fault is not None:
                return tensor
            try:
                store = self.stores[tensor.device] = store_for(
                    tensor.device, self._directory, self._max_pending_bytes, self._synchronous
                )
            except (OSError, RuntimeError) as error:  # no directory there, no CUDA stream: keep it
                self._fault = f"cannot make the offload store of {tensor.device}: {error}"
                return tensor
        if not call.saved:  # the first of this call in a store: it follows the last call that was
            call.previous = self._last
            self._last = weakref.ref(call)
        key = store.put(tensor)
        call.saved.append((store, key))
        return _Saved(store, key, call)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        call = packed.call
        call.prefetch()
        previous = call.previous() if call.previous is not None else None
        if previous is not None:
            previous.prefetch()
        return packed.store.get(packed.key)

    def failure(self) -> str | None:
        faults = (self._fault, *(store.failure() for store in self.stores.values()))
        return next((fault for fault in faults if fault is not None), None)

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


# --- the applier ----------------------------------------------------------------------------------


class ActivationApplier:
    """The applier of ``plan.activation`` on ``model`` (`qsync_callback.tuning_loop.Applier`).

    ``calls_per_step`` and ``call_problems`` (see `activation_refusals`) may be set on the object
    once a step was observed; ``directory`` is where the disk store makes its private directory
    (None: the system's temporary directory); ``synchronous`` (the default) has it write and read in
    the training thread, as the copy costs are measured (`recorder.copy_costs`); without it, a
    background thread writes, with ``max_pending_bytes`` of backlog, and prefetches.
    `failure` and `step_stats` are for the loop to poll at each step boundary."""

    def __init__(
        self,
        model: nn.Module,
        calls_per_step: Mapping[str, int] | None = None,
        call_problems: Mapping[str, str] | None = None,
        directory: str | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        synchronous: bool = True,
    ):
        self.model = model
        self.calls_per_step = calls_per_step
        self.call_problems = call_problems
        self.directory = directory
        self.max_pending_bytes = max_pending_bytes
        self.synchronous = synchronous
        self._offloader: _Offloader | None = None

    def __call__(self, plan: Plan) -> Callable[[], None]:
        chosen = self._check(plan.activation)
        offloader = _Offloader(self.model, self.directory, self.max_pending_bytes, self.synchronous)
        wrapped: list[tuple[nn.Module, Callable[..., Any]]] = []
        for module, policy in chosen:
            wrapper = _recomputed(module) if policy == RECOMPUTE else offloader.wrap(module)
            module.forward = wrapper
            wrapped.append((module, wrapper))
        self._offloader = offloader

        def undo() -> None:
            for module, wrapper in wrapped:
                if module.__dict__.get("forward") is wrapper:
                    del module.forward
            wrapped.clear()
            offloader.close()
            if self._offloader is offloader:
                self._offloader = None

        return undo

    def _check(self, policies: Mapping[str, str]) -> list[tuple[nn.Module, str]]:
        """The modules to wrap and their policies; QSyncInputError naming each refused layer."""
        modules = dict(self.model.named_modules(remove_duplicate=False))
        unknown = [name for name in policies if name not in modules]
        if unknown:
            raise QSyncInputError(f"activation: {', '.join(map(repr, unknown))} not a module of the model")
        acting = {name: policy for name, policy in policies.items() if policy != KEEP}
        reasons = activation_refusals(self.model, acting, self.calls_per_step, self.call_problems)
        chosen: dict[int, tuple[nn.Module, str, str]] = {}
        for name, policy in acting.items():
            module = modules[name]
            other = chosen.setdefault(id(module), (module, policy, name))
            if other[1] != policy:
                reasons.setdefault(name, f"{other[2]!r}, the same module, is given {other[1]}")
        for module, _, name in chosen.values():
            for inner_name, inner in module.named_modules():
                if inner_name and id(inner) in chosen:
                    reasons.setdefault(
                        chosen[id(inner)][2],
                        f"it is inside {name!r}, which has a policy too (they do not nest)",
                    )
        if reasons:
            listed = "; ".join(f"{name!r} ({policies[name]}): {why}" for name, why in reasons.items())
            raise QSyncInputError(f"activation: cannot apply to {listed}; nothing was changed")
        return [(module, policy) for module, policy, _ in chosen.values()]

    def failure(self) -> str | None:
        """The first fault of the plan in force's offload (a store that could not be made, a write
        that failed: the tensors stayed in memory), as one line; None if there is none or no plan
        is in force."""
        offloader = self._offloader
        return offloader.failure() if offloader is not None else None

    def step_stats(self) -> dict[str, dict[str, Any]]:
        """What the plan in force's stores moved since the last call, by device
        (`OffloadStore.step_stats`); empty when nothing is offloaded."""
        offloader = self._offloader
        if offloader is None:
            return {}
        return {str(device): store.step_stats() for device, store in offloader.stores.items()}
