"""Carry out a plan's gradient buckets on a live DDP run: re-wrap the module in a new DDP.

``plan.buckets`` lists DDP's buckets in launch order, each as the names of its parameters
(``module.named_parameters()``); bucket 0 holds the gradients ready first in backward (the last
layers'). The applier builds a new `torch.nn.parallel.DistributedDataParallel` around the same
module (the same Parameter objects: the optimizer and its state are untouched) whose per-bucket
caps (``bucket_cap_mb_list``) give that grouping, and hands it to the run (``set_wrapper``) in place
of the old one. The loop calls it on every rank at the same step boundary; building a DDP is local
here (``init_sync=False``: the parameters and buffers are already what the ranks agreed on, and a
broadcast would overwrite buffers a run keeps per rank, ``broadcast_buffers=False``).

How DDP groups gradients (torch 2.13, `_BucketCapacityConfig` and the C++
``compute_bucket_assignment_by_size``; each point checked on live gloo runs, 2 processes under
Lightning and a group of one, in ``tests/test_ddp_buckets_apply.py``):

- it fills one bucket at a time, adding gradients in order until the bucket's bytes reach its cap
  (``>=``), then starts the next bucket with the next cap (the last cap repeats). So a cap equal to
  a bucket's bytes closes it exactly after its last gradient, and caps made that way, in order,
  reproduce any partition that is contiguous in the filling order: the k-th cap goes to the k-th
  bucket in launch order (checked with unequal caps). Caps are given in MiB as floats, bytes / 2**20,
  which DDP turns back into the same whole number of bytes.
- the filling order: DDP rebuilds its buckets once, over the order in which the gradients became
  ready in its first iteration, with the same caps, and keeps them (the default, and
  ``static_graph``); the rebuilt buckets are in force from the second iteration's forward (under a
  static graph optimized by hand in Lightning, from the third). The iterations before run under
  the first assignment: another grouping, the same sums. With ``find_unused_parameters=True`` and
  no static graph it never rebuilds: its buckets are the first assignment, filled in registration
  order (``named_parameters``) and then reversed, so the applier passes the caps reversed.
- the grouping does not change the math on 2 ranks: the losses and parameters are bit-identical to
  a run left alone (checked). With more ranks a ring all-reduce may add an element's terms in an
  order that depends on where it sits in its bucket, so the last bits may differ.
- within a bucket the gradients are in filling order: a plan's bucket is compared as a set.
- what cannot be reproduced, refused: a bucket boundary inside a compiled region of the same plan
  (its gradients become ready together at the end of its backward graph, in the compiler's order:
  `plan.regions_split_by_buckets`; the planner merges such buckets, `plan.buckets_around_regions`);
  a bucket that is not a contiguous run of the filling order
  (it is known when the wrapper in place has rebuilt its buckets: the concatenation of its buckets
  is the ready order; before that, at step 0, the plan's own order, which the recorder read off a
  rebuilt run of the same model, is taken as the ready order); a bucket ending in parameters with no
  elements (the bucket is closed before them); gradients of several dtypes or devices (DDP fills a
  bucket per dtype and device, each with the whole list of caps); sparse gradients (each has a
  bucket of its own outside the caps).

What carries over, read off the old wrapper: ``device_ids``, ``output_device``, ``dim``,
``process_group``, ``broadcast_buffers`` (as ``forward_sync_buffers``), ``find_unused_parameters``,
``gradient_as_bucket_view``, ``static_graph``, ``skip_all_reduce_unused_params``,
``batched_grad_copy`` and the DDPSink clone setting. Gradients already there are kept (with
``gradient_as_bucket_view`` the new reducer copies them into its buckets). A registered comm hook
is registered again on the new wrapper when it keeps no state per bucket: torch's
``allreduce_hook``, ``fp16_compress_hook`` and ``bf16_compress_hook`` (their state is a process
group or None). Any other hook is refused, naming it: its state may be kept per bucket (PowerSGD
keeps its error feedback and low-rank factors by bucket index) and a new grouping would misuse it;
so are a C++ built-in hook (`_register_builtin_comm_hook`, whose state cannot be read back), a
buffer comm hook, DDP's ``mixed_precision`` (it hooks every submodule at construction),
``delay_all_reduce_named_params``, a device mesh and the Python reducer (no per-bucket caps).

The old wrapper is spent: its reducer's autograd hooks are removed (`_remove_autograd_hooks`) and
its reducer and logger dropped, so its bucket memory is freed and nothing of it runs in backward
even where something still holds the wrapper (using it again raises AttributeError). Before that,
only the new wrapper's reducer all-reduces anyway: the old one's hooks return at once unless a
forward through the old wrapper prepared it. The undo builds a wrapper with the old settings and
bucket caps (DDP's default ``None`` included), the hooks again, and retires the plan's wrapper; if
something else replaced the plan's wrapper meanwhile (Lightning's teardown unwraps the module), the
undo leaves the run as it is. All or nothing: a plan naming a parameter the module does not have,
one twice, one DDP does not reduce (frozen, or ignored), or leaving one out, and a module not
wrapped in DDP (one process: nothing to regroup), raise QSyncInputError before anything changes.

Reading the ready order off a wrapper asks its reducer for its buckets, which makes a zero-filled
copy of them for the moment (gradient-sized memory, at a step boundary).

Under Lightning (`LightningRun`) the wrapper is ``trainer.strategy.model`` (its setter sets the
strategy's ``_model``). Nothing else in Lightning 2.6 holds it between steps: the training step
passes the strategy's current model to ``_forward_redirection`` at each call, ``trainer.model``
reads the strategy's, and ``_ddp_kwargs`` and ``_ddp_comm_hook`` are only read when the strategy
wraps the module (Lightning registers its comm hook only on CUDA); so the next step runs through the
new wrapper, and the old one is freed (checked with weak references). One flag must follow the
swap: under manual optimization with a static graph Lightning flushes the first iteration's
all-reduces itself, once (``_pl_static_graph_delay_done``); a new wrapper has a first iteration
again, so the run clears the flag (without that, the new wrapper all-reduced nothing and the ranks
parted ways).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan, regions_split_by_buckets
from qsync_callback.recorder.ddp_buckets import fill_buckets

MIB = 2**20
# comm hooks whose state (a process group or None) holds nothing per bucket: registered again
STATELESS_HOOKS = (
    default_hooks.allreduce_hook,
    default_hooks.fp16_compress_hook,
    default_hooks.bf16_compress_hook,
)
_LISTED = 5  # names listed in a refusal, then a count


def bucket_names(wrapper: DistributedDataParallel) -> list[list[str]]:
    """The wrapper's buckets in launch order, each as its parameters' names in DDP's order within
    the bucket (after the first iteration: the order they became ready)."""
    names = {id(p): name for name, p in wrapper.module.named_parameters()}
    buckets = wrapper.reducer._get_zeros_like_grad_buckets()
    return [[names[id(p)] for p in bucket.parameters()] for bucket in buckets]


def reduced_parameters(wrapper: DistributedDataParallel) -> list[nn.Parameter]:
    """The parameters DDP's reducer reduces, in DDP's order (as `_build_params_for_reducer`: each
    module's own parameters that require grad and that DDP does not ignore, once each)."""
    ignored = wrapper.parameters_to_ignore
    seen: set[int] = set()
    out = []
    for module_name, module in wrapper.module.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{module_name}.{name}" not in ignored and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def bucket_caps(wrapper: DistributedDataParallel) -> dict[str, Any]:
    """The wrapper's bucket caps as DDP's arguments: ``bucket_cap_mb_list``, else ``bucket_cap_mb``
    (None where DDP's default is in force: a small first bucket, then 25 MiB)."""
    config = wrapper._bucket_config
    if config.per_bucket_bytes_caps:
        return {"bucket_cap_mb_list": [cap / MIB for cap in config.per_bucket_bytes_caps]}
    if config.first_bucket_bytes_cap < config.bucket_bytes_cap:
        return {"bucket_cap_mb": None}
    return {"bucket_cap_mb": config.bucket_bytes_cap / MIB}


def ddp_settings(wrapper: DistributedDataParallel) -> dict[str, Any]:
    """DDP's arguments to build a wrapper like ``wrapper``, bucket caps aside (see the module
    docstring); raises QSyncInputError for what cannot be carried over."""
    problems = []
    if wrapper.mixed_precision is not None:
        problems.append("DDP's mixed_precision (it hooks every submodule when built)")
    if wrapper._delay_all_reduce_params:
        problems.append("delay_all_reduce_named_params")
    if hasattr(wrapper, "device_mesh"):
        problems.append("a device mesh")
    if wrapper._use_python_reducer:
        problems.append("the Python reducer (it has no per-bucket caps)")
    if getattr(wrapper, "buffer_hook", None) is not None:
        problems.append("a buffer comm hook")
    for hook, _ in wrapper._comm_hooks:
        if hook not in STATELESS_HOOKS:
            name = getattr(hook, "__qualname__", repr(hook))
            problems.append(f"the comm hook {name} (its state may be kept per bucket)")
    if not wrapper._comm_hooks and wrapper._get_ddp_logging_data().get("comm_hook"):
        problems.append(f"the built-in comm hook {wrapper._get_ddp_logging_data()['comm_hook']}")
    if problems:
        raise QSyncInputError(
            f"buckets: cannot re-wrap a DDP with {'; '.join(problems)}; nothing was changed"
        )
    return {
        "device_ids": wrapper.device_ids,
        "output_device": wrapper.output_device,
        "dim": wrapper.dim,
        "process_group": wrapper.process_group,
        "forward_sync_buffers": wrapper.forward_sync_buffers,
        "find_unused_parameters": wrapper.find_unused_parameters,
        "gradient_as_bucket_view": wrapper.gradient_as_bucket_view,
        "static_graph": wrapper.static_graph,
        "skip_all_reduce_unused_params": wrapper.skip_all_reduce_unused_params,
        "batched_grad_copy": wrapper.batched_grad_copy,
    }


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(map(repr, names[:_LISTED]))
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


class DDPBucketApplier:
    """The applier of ``plan.buckets`` (`qsync_callback.tuning_loop.Applier`) on the DDP wrapper
    that ``get_wrapper()`` returns; ``set_wrapper(new)`` puts a new wrapper in its place, so that
    the next step runs through it. See the module docstring."""

    def __init__(
        self,
        get_wrapper: Callable[[], nn.Module | None],
        set_wrapper: Callable[[DistributedDataParallel], None],
    ):
        self.get_wrapper = get_wrapper
        self.set_wrapper = set_wrapper
        self._ready: list[int] | None = None  # ids of the reduced parameters, in the last ready order read

    def __call__(self, plan: Plan) -> Callable[[], None]:
        wrapper = self.get_wrapper()
        if not isinstance(wrapper, DistributedDataParallel):
            raise QSyncInputError(
                "buckets: the model is not wrapped in DistributedDataParallel (one process?), so it has"
                " no gradient buckets to regroup; nothing was changed"
            )
        if not plan.buckets:
            return lambda: None
        split = regions_split_by_buckets(plan.buckets, plan.fused_regions)
        if split:
            raise QSyncInputError(
                f"buckets: the plan's buckets split the parameters of compiled region(s) "
                f"{', '.join(repr(r) for r in split)}; a compiled region's gradients become ready together, "
                "in an order of the compiler's, so DDP cannot fill those buckets as planned: put each "
                "region's parameters in one bucket; nothing was changed"
            )
        buckets = self._plan_parameters(wrapper, plan.buckets)
        settings = ddp_settings(wrapper)
        caps = self._caps(wrapper, buckets, plan.buckets)
        old_caps = bucket_caps(wrapper)
        hooks = list(wrapper._comm_hooks)
        module, sink_clone = wrapper.module, wrapper._ddp_sink_clone

        def build(caps: dict[str, Any]) -> DistributedDataParallel:
            new = DistributedDataParallel(module, init_sync=False, **settings, **caps)
            try:
                for hook, state in hooks:
                    new.register_comm_hook(state, hook)
                new._set_ddp_sink_clone(sink_clone)
            except BaseException:
                _retire(new)
                raise
            return new

        new = build({"bucket_cap_mb_list": caps})
        self._swap(wrapper, new)

        def undo() -> None:
            if self.get_wrapper() is new:  # else something else replaced it: leave the run as it is
                self._swap(new, build(old_caps))

        return undo

    def _swap(self, old: DistributedDataParallel, new: DistributedDataParallel) -> None:
        try:
            self.set_wrapper(new)
        except BaseException:
            _retire(new)
            raise
        _retire(old)

    def _plan_parameters(
        self, wrapper: DistributedDataParallel, buckets: Sequence[Sequence[str]]
    ) -> list[list[nn.Parameter]]:
        """The plan's buckets as parameters; QSyncInputError naming every wrong name."""
        named = dict(wrapper.module.named_parameters(remove_duplicate=False))
        reduced = {id(p) for p in reduced_parameters(wrapper)}
        names = [name for bucket in buckets for name in bucket]
        unknown = [name for name in names if name not in named]
        named_by: dict[int, str] = {}
        twice, not_reduced = [], []
        for name in names:
            if name not in named:
                continue
            p = named[name]
            if id(p) in named_by:
                twice.append(name)
            named_by.setdefault(id(p), name)
            if id(p) not in reduced:
                not_reduced.append(name)
        canonical = {id(p): name for name, p in wrapper.module.named_parameters()}
        missing = [canonical[id(p)] for p in reduced_parameters(wrapper) if id(p) not in named_by]
        problems = [
            f"{what} {_listed(found)}"
            for what, found in (
                ("not a parameter of the model:", unknown),
                ("named twice:", twice),
                ("not reduced by DDP (frozen, or ignored):", not_reduced),
                ("in no bucket:", missing),
            )
            if found
        ]
        if problems:
            raise QSyncInputError(f"buckets: {'; '.join(problems)}; nothing was changed")
        return [[named[name] for name in bucket] for bucket in buckets]

    def _caps(
        self,
        wrapper: DistributedDataParallel,
        buckets: Sequence[Sequence[nn.Parameter]],
        names: Sequence[Sequence[str]],
    ) -> list[float]:
        """The caps (MiB, in the order DDP takes them) that give ``buckets``; QSyncInputError if
        DDP's filling cannot give them (see the module docstring)."""
        params = reduced_parameters(wrapper)
        kinds = sorted({f"{p.dtype} on {p.device}" for p in params})
        if len(kinds) > 1:
            raise QSyncInputError(
                f"buckets: the gradients are of several kinds ({', '.join(kinds)}); DDP fills a bucket per"
                " dtype and device with the same caps, so caps cannot set the grouping; nothing was changed"
            )
        by_id = {id(p): p for p in params}
        sparse = [
            name
            for name, module in wrapper.module.named_modules()
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
            and module.sparse
            and id(module.weight) in by_id
        ]
        if sparse:
            raise QSyncInputError(
                f"buckets: {_listed(sparse)} make sparse gradients, which DDP buckets alone, outside the"
                " caps; nothing was changed"
            )
        rebuilds = wrapper.static_graph or not wrapper.find_unused_parameters
        if not rebuilds:  # the first assignment, for good: registration order, reversed
            order = [id(p) for p in reversed(params)]
        else:
            if wrapper._has_rebuilt_buckets:  # its buckets, end to end, are the ready order
                ready = wrapper.reducer._get_zeros_like_grad_buckets()
                self._ready = [id(p) for bucket in ready for p in bucket.parameters()]
            known = self._ready is not None and sorted(self._ready) == sorted(by_id)
            order = self._ready if known else [id(p) for bucket in buckets for p in bucket]
        position = {pid: i for i, pid in enumerate(order)}
        start = 0
        for k, bucket in enumerate(buckets):
            span = sorted(position[id(p)] for p in bucket)
            if span != list(range(start, start + len(bucket))):
                raise QSyncInputError(
                    f"buckets: bucket {k} ({_listed(list(names[k]))}) is not the next run of gradients in"
                    " the order DDP fills its buckets (the order they become ready in backward); nothing"
                    " was changed"
                )
            start += len(bucket)
        sizes = [_nbytes(by_id[pid]) for pid in order]
        caps = [sum(_nbytes(p) for p in bucket) for bucket in buckets]
        if not rebuilds:
            sizes, caps = sizes[::-1], caps[::-1]
        counts = fill_buckets(sizes, caps)
        wanted = [len(bucket) for bucket in buckets]
        if counts != (wanted if rebuilds else wanted[::-1]):
            raise QSyncInputError(
                "buckets: DDP closes a bucket as soon as its bytes reach its cap, so a bucket cannot end"
                " with parameters that have no elements; nothing was changed"
            )
        return [cap / MIB for cap in caps]


def _retire(wrapper: DistributedDataParallel) -> None:
    """Spend a wrapper: remove its reducer's autograd hooks and drop its reducer and logger (the
    logger holds the reducer too), which frees its buckets."""
    if "reducer" in wrapper.__dict__:
        wrapper._remove_autograd_hooks()
        del wrapper.reducer
    wrapper.logger = None
