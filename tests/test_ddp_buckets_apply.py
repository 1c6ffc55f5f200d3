"""The DDP bucket applier (`appliers/torch_ddp_buckets.py`) on real DDP: under Lightning on 2 CPU
processes (gloo), and in this process on a gloo group of one (DDP buckets and rebuilds the same way
whatever the world size)."""

import gc
import json
import sys
import weakref
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from qsync_callback.appliers.torch_ddp_buckets import DDPBucketApplier, bucket_caps, bucket_names
from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.recorder.ddp_buckets import fill_buckets

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ddp_buckets_script as script  # noqa: E402

# --- under Lightning, 2 processes -----------------------------------------------------------------


def _as_sets(buckets):
    return [set(bucket) for bucket in buckets]


def test_lightning_rewrap_groups_as_planned_and_keeps_the_math(tmp_path):
    """A plan applied at a step boundary through the run's appliers: after the new wrapper's
    rebuild every rank's buckets are the plan's, one all-reduce per bucket (the old reducer is gone),
    the losses and final parameters are bit-identical to the run left alone, and the undo brings
    DDP's default buckets back; also under manual optimization with a static graph."""
    runs = {}
    for name, apply, manual in (("apply", True, False), ("alone", False, False), ("manual", True, True)):
        (tmp_path / name).mkdir()
        runs[name] = script.run_two_ranks(tmp_path / name, apply, manual)
    for name, process in runs.items():
        output, _ = process.communicate(timeout=240)
        assert process.returncode == 0, f"{name}: {output[-3000:]}"
    widths = script.WIDTHS
    layer_mb = {2 * i: (n_in + 1) * n_out * 4 / 2**20 for i, (n_in, n_out) in enumerate(pairwise(widths))}
    for rank in (0, 1):
        applied = json.loads((tmp_path / "apply" / f"rank{rank}.json").read_text())
        alone = json.loads((tmp_path / "alone" / f"rank{rank}.json").read_text())
        default = applied["before"]
        assert len(default) == 2 and _as_sets(default) != _as_sets(script.PLAN_BUCKETS)
        assert _as_sets(applied["after"]) == _as_sets(script.PLAN_BUCKETS)
        assert applied["all_reduces_before"] == 2
        assert applied["all_reduces_after"] == len(script.PLAN_BUCKETS)  # the old reducer all-reduces nothing
        assert applied["freed"] == {"wrapper": True, "reducer": True}
        assert applied["carried"]["gradient_as_bucket_view"] is True
        assert applied["carried"]["comm_hooks"] == ["allreduce_hook"]
        assert applied["carried"]["caps_mb"] == [sum(layer_mb[i] for i in ls) for ls in script.PLAN_LAYERS]
        assert applied["undone"] == default
        assert applied["undone_caps"] == {"list": [], "default": True}
        assert alone["before"] == alone["after"] == alone["undone"] == default
        assert alone["all_reduces_before"] == alone["all_reduces_after"] == 2
        assert len(applied["losses"]) == script.STEPS
        assert applied["losses"] == alone["losses"]  # bit-identical: grouping does not change the sums
        assert applied["digest"] == alone["digest"]
        # by hand under a static graph: the plan's wrapper flushes its own first iteration, so the
        # ranks all-reduce (without that they would part ways) and the buckets are rebuilt as planned
        manual = json.loads((tmp_path / "manual" / f"rank{rank}.json").read_text())
        assert manual["all_reduces_after"] == len(script.PLAN_BUCKETS)
        assert _as_sets(manual["after"]) == _as_sets(script.PLAN_BUCKETS)
        assert manual["undone"] == default
        assert manual["digest"] == json.loads((tmp_path / "manual" / "rank0.json").read_text())["digest"]


# --- in this process, on a group of one -----------------------------------------------------------


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Run:
    """A DDP model as a run holds it: the wrapper in place, and what its applier is given."""

    def __init__(self, model: nn.Module, **ddp_options):
        self.model = model
        self.wrapper: nn.Module = DDP(model, **ddp_options)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.swaps = 0
        self.applier = DDPBucketApplier(lambda: self.wrapper, self._set)

    def _set(self, wrapper):
        self.wrapper, self.swaps = wrapper, self.swaps + 1

    def steps(self, n: int = 2) -> None:
        """``n`` training steps (the second rebuilds the buckets of a new wrapper)."""
        for seed in range(n):
            g = torch.Generator().manual_seed(seed)
            first = next(self.model.parameters())
            x = torch.randn(4, first.shape[1], generator=g, dtype=first.dtype)
            self.optimizer.zero_grad()
            self.wrapper(x).square().mean().backward()
            self.optimizer.step()


def mlp(*widths: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for n_in, n_out in pairwise(widths):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def test_unequal_buckets_cut_anywhere_in_the_ready_order(group):
    """Caps of unequal buckets, one cut between a layer's bias and weight, go to the buckets in
    launch order; the first step after the re-wrap may group otherwise, the rebuild groups as
    planned; undo restores DDP's default caps and grouping, and the old reducers are freed."""
    run = Run(mlp(8, 16, 32, 24, 4))
    run.steps()
    default = bucket_names(run.wrapper)
    ready = [name for bucket in default for name in bucket]
    assert ready[:2] == ["6.bias", "6.weight"]  # the last layer's gradients are ready first
    plan = [ready[:1], ready[1:4], ready[4:5], ready[5:]]
    old_reducer = weakref.ref(run.wrapper.reducer)
    undo = run.applier(Plan(buckets=plan))
    gc.collect()
    assert old_reducer() is None
    params = dict(run.model.named_parameters())
    caps = [sum(params[n].numel() * 4 for n in bucket) for bucket in plan]
    assert run.wrapper.bucket_bytes_cap_list == caps and len(set(caps)) == len(caps)
    run.steps()
    assert bucket_names(run.wrapper) == plan
    plan_reducer = weakref.ref(run.wrapper.reducer)
    undo()
    gc.collect()
    assert plan_reducer() is None
    assert bucket_caps(run.wrapper) == {"bucket_cap_mb": None} and run.wrapper.bucket_bytes_cap_default
    run.steps()
    assert bucket_names(run.wrapper) == default
    assert run.swaps == 2


def test_a_bucket_not_contiguous_in_the_ready_order_is_refused(group):
    run = Run(mlp(8, 16, 32, 4))
    run.steps()
    ready = [name for bucket in bucket_names(run.wrapper) for name in bucket]
    wrapper, reducer = run.wrapper, run.wrapper.reducer
    with pytest.raises(QSyncInputError, match="bucket 0 .* not the next run of gradients"):
        run.applier(Plan(buckets=[[ready[0], ready[2]], [ready[1], *ready[3:]]]))
    assert run.wrapper is wrapper and wrapper.reducer is reducer and run.swaps == 0


def test_without_a_rebuild_the_first_assignment_is_the_plan(group):
    """With find_unused_parameters DDP never rebuilds: the applier's reversed caps make its first
    assignment (registration order, reversed) the plan's at once, and it stays."""
    run = Run(mlp(8, 16, 32, 24, 4), find_unused_parameters=True)
    run.steps()
    plan = [["6.bias", "6.weight", "4.bias"], ["4.weight"], ["2.weight", "2.bias", "0.bias", "0.weight"]]
    run.applier(Plan(buckets=plan))
    assert run.wrapper.find_unused_parameters
    assert _as_sets(bucket_names(run.wrapper)) == _as_sets(plan)
    run.steps()
    assert _as_sets(bucket_names(run.wrapper)) == _as_sets(plan)


def test_refusals_change_nothing(group):
    run = Run(mlp(8, 16, 4))
    run.model[2].bias.requires_grad_(False)
    run.wrapper = DDP(run.model)  # the frozen bias is not reduced
    run.steps()
    wrapper, reducer = run.wrapper, run.wrapper.reducer
    cases = {
        "not a parameter of the model: 'head.weight'": [["2.weight", "head.weight"], ["0.bias", "0.weight"]],
        "named twice: '0.bias'": [["2.weight", "0.bias"], ["0.bias", "0.weight"]],
        "in no bucket: '0.weight'": [["2.weight"], ["0.bias"]],
        "not reduced by DDP (frozen, or ignored): '2.bias'": [["2.bias", "2.weight"], ["0.bias", "0.weight"]],
    }
    for message, buckets in cases.items():
        with pytest.raises(QSyncInputError, match=r"nothing was changed") as refused:
            run.applier(Plan(buckets=buckets))
        assert message in str(refused.value)
        assert run.wrapper is wrapper and wrapper.reducer is reducer and run.swaps == 0
    single = Run(mlp(8, 4))
    single.wrapper = single.model  # one process: not wrapped
    with pytest.raises(QSyncInputError, match="not wrapped in DistributedDataParallel"):
        single.applier(Plan(buckets=[["0.weight", "0.bias"]]))
    assert single.wrapper is single.model and single.swaps == 0
    run.steps()  # training goes on through the same wrapper
    assert run.wrapper is wrapper


def test_what_caps_cannot_set_is_refused(group):
    mixed = mlp(8, 16, 4)
    mixed[2].double()
    run = Run(mixed)
    with pytest.raises(QSyncInputError, match="several kinds"):
        run.applier(Plan(buckets=[["2.weight", "2.bias"], ["0.weight", "0.bias"]]))
    assert run.swaps == 0
    model = mlp(8, 16, 4)
    model.register_parameter("empty", nn.Parameter(torch.zeros(0)))  # no elements: 0 bytes
    run = Run(model)
    with pytest.raises(QSyncInputError, match="cannot end with parameters that have no elements"):
        run.applier(Plan(buckets=[["2.weight", "2.bias", "empty"], ["0.weight", "0.bias"]]))
    run.applier(Plan(buckets=[["empty", "2.weight", "2.bias"], ["0.weight", "0.bias"]]))
    assert run.swaps == 1
    run = Run(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)))
    with pytest.raises(QSyncInputError, match="'0' make sparse gradients"):
        run.applier(Plan(buckets=[["1.weight", "1.bias"], ["0.weight"]]))
    assert run.swaps == 0


def test_comm_hooks(group):
    """A stateless hook is registered again on the new wrapper (and the undo's); any other is
    refused, naming it, as is a built-in C++ hook."""
    run = Run(mlp(8, 16, 4))
    run.wrapper.register_comm_hook(None, default_hooks.fp16_compress_hook)
    plan = Plan(buckets=[["2.weight", "2.bias"], ["0.weight", "0.bias"]])
    undo = run.applier(plan)
    assert run.wrapper._comm_hooks == [(default_hooks.fp16_compress_hook, None)]
    assert run.wrapper._get_ddp_logging_data()["comm_hook"] == "fp16_compress_hook"
    undo()
    assert run.wrapper._comm_hooks == [(default_hooks.fp16_compress_hook, None)]
    run.steps()
    stateful = Run(mlp(8, 16, 4))
    state = powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=2)
    stateful.wrapper.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    with pytest.raises(QSyncInputError, match="the comm hook powerSGD_hook"):
        stateful.applier(plan)
    builtin = Run(mlp(8, 16, 4))
    builtin.wrapper._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    with pytest.raises(QSyncInputError, match="built-in comm hook"):
        builtin.applier(plan)
    assert stateful.swaps == builtin.swaps == 0


def test_undo_leaves_a_replaced_wrapper_alone(group):
    """Lightning's teardown unwraps the module before the callback's teardown undoes a candidate:
    the undo must not wrap it again."""
    run = Run(mlp(8, 16, 4))
    undo = run.applier(Plan(buckets=[["2.weight", "2.bias"], ["0.weight", "0.bias"]]))
    run.wrapper = run.model
    undo()
    assert run.wrapper is run.model and run.swaps == 1


def test_fill_is_ddps_rule():
    assert fill_buckets([4, 4, 4, 4], [8]) == [2, 2]
    assert fill_buckets([4, 4, 4, 4], [4, 12]) == [1, 3]
    assert fill_buckets([4, 0, 4], [4, 4]) == [1, 2]  # closed at its cap: the empty one goes to the next
    assert fill_buckets([3, 3, 3], [4, 100]) == [2, 1]
