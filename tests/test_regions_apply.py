"""Compiled regions applied to live torch models (`appliers.torch_regions`): refusals that change
nothing, outputs and gradients as eager, undo back to eager, a graph break or a failing compiler
rolled back for its region alone, recompiles counted, and a plan applied in real Lightning training.

Real torch.compile throughout: backend "aot_eager" (dynamo and AOTAutograd, no code generation) but
for one test with inductor, and the Lightning run (the integration compiles with inductor).
"""

import copy
import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch._dynamo
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback import QSyncCallback
from qsync_callback.appliers.torch_activation import ActivationApplier
from qsync_callback.appliers.torch_precision import precision_applier
from qsync_callback.appliers.torch_regions import RegionApplier
from qsync_callback.errors import QSyncInputError
from qsync_callback.model_layers import blocks_of, layers_of
from qsync_callback.plan import Plan
from qsync_callback.recorder.layer_ranges import LayerRanges
from qsync_callback.tuning_loop import apply_plan

FAST = "aot_eager"


class Block(nn.Module):
    """A residual block with a buffer a training forward updates (BatchNorm's running statistics)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1, self.bn, self.act, self.fc2 = (
            nn.Linear(width, width),
            nn.BatchNorm1d(width),
            nn.ReLU(),
            nn.Linear(width, width),
        )

    def forward(self, x):
        return x + self.fc2(self.act(self.bn(self.fc1(x))))


class Breaking(Block):
    """Breaks dynamo's graph in the middle of its forward."""

    def forward(self, x):
        y = self.fc1(x)
        torch._dynamo.graph_break()
        return x + self.fc2(self.act(self.bn(y)))


class GeluBlock(Block):
    """What `_no_gelu`, a compiler without gelu, fails on."""

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.bn(self.fc1(x))))


class Resized(Block):
    """The block of the recompile test alone: dynamo remembers, per class, which sizes changed."""


class Ranged(Block):
    """The block of the recorder's-ranges test alone (dynamo's per-class memory of sizes)."""


class LowPrecision(Block):
    """The block of the precision test alone (dynamo's per-class memory of sizes)."""


class LitBlock(Block):
    """The inductor and Lightning tests' block, likewise: inductor's cache keeps the graph of one for
    the other."""


class Limited(nn.Linear):
    """The recompile limit test's layer, likewise."""


def _no_gelu(gm: torch.fx.GraphModule, example_inputs):
    if any("gelu" in str(node.target) for node in gm.graph.nodes):
        raise RuntimeError("this compiler has no gelu")
    return torch._dynamo.lookup_backend(FAST)(gm, example_inputs)


torch._dynamo.register_backend(_no_gelu, "qsync_test_no_gelu")


class Small(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self, *blocks: type[nn.Module], width: int = 16):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.Sequential(*(block(width) for block in blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def _twins(*blocks: type[nn.Module]) -> tuple[Net, Net]:
    """A model and an eager copy of it, the same weights."""
    torch.manual_seed(0)
    model = Net(*blocks)
    return model, copy.deepcopy(model)


def _batch(size: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(size, 8, generator=torch.Generator().manual_seed(seed))


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward and backward (gradients cleared first); the output."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().mean().backward()
    return out.detach()


def _assert_same_step(model: nn.Module, eager: nn.Module, x: torch.Tensor, atol: float = 1e-6) -> None:
    """One step of each: the same outputs, gradients and buffers."""
    torch.testing.assert_close(_step(model, x), _step(eager, x), atol=atol, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=1e-5, msg=name)
    for b, c in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(b, c, atol=atol, rtol=1e-5)


def _compiled(model: nn.Module) -> set[str]:
    """The modules that have a compiled call of their own."""
    return {name for name, m in model.named_modules() if "_compiled_call_impl" in m.__dict__}


# --- refusals ------------------------------------------------------------------------------------


class Aliased(nn.Module):
    """One Linear registered under two names."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a


@pytest.mark.parametrize(
    ("regions", "why"),
    [
        ([["blocks.0", "blocks.1"]], "a torch region is exactly one module name, not 2"),
        ([[""]], "the whole model is no region"),
        ([["blocks.7"]], "not a module of the model"),
        ([["blocks.0"], ["blocks.0"]], "the same module as the region ['blocks.0']"),
        ([["blocks"], ["blocks.0"]], "it is inside the region ['blocks'] (regions do not nest)"),
        ([["blocks.1.fc1"], ["blocks.1"]], "it holds the region ['blocks.1.fc1'] (regions do not nest)"),
    ],
)
def test_a_bad_region_is_refused_and_nothing_changes(regions, why):
    model, _ = _twins(Block, Block)
    applier = RegionApplier(model, backend=FAST)
    with pytest.raises(QSyncInputError) as info:
        applier(Plan(fused_regions=regions))
    assert why in str(info.value) and str(info.value).endswith("nothing was changed")
    assert _compiled(model) == set() and applier.region_stats() == {}


def test_one_message_names_each_bad_region_and_a_module_is_one_under_two_names():
    model = Aliased()
    with pytest.raises(QSyncInputError) as info:
        RegionApplier(model, backend=FAST)(Plan(fused_regions=[["a"], ["b"], ["c"], ["a", "b"]]))
    assert str(info.value) == (
        "fused_regions: cannot compile ['b']: the same module as the region ['a']; "
        "['c']: not a module of the model; "
        "['a', 'b']: a torch region is exactly one module name, not 2; nothing was changed"
    )
    assert _compiled(model) == set()


def test_a_module_compiled_already_is_refused_and_one_compiled_no_more_gets_its_none_back():
    model, _ = _twins(Block, Block, Block)
    model.blocks[0].fc1.compile(backend=FAST)
    model.blocks[1].compile(backend=FAST)
    applier = RegionApplier(model, backend=FAST)
    # a region holding a compiled module, the compiled module itself, a region inside one
    for region, compiled in (
        ("blocks.0", "blocks.0.fc1"),
        ("blocks.0.fc1", "blocks.0.fc1"),
        ("blocks.1.fc2", "blocks.1"),
    ):
        with pytest.raises(QSyncInputError, match=rf"'{compiled}' is compiled already"):
            applier(Plan(fused_regions=[[region]]))
    model.blocks[2]._compiled_call_impl = None  # compiled once, not any more
    undo = applier(Plan(fused_regions=[["blocks.2"]]))
    with pytest.raises(QSyncInputError, match=r"'blocks\.2' is compiled already"):  # applied twice
        applier(Plan(fused_regions=[["blocks.2"]]))
    undo()
    assert _compiled(model) == {"blocks.0.fc1", "blocks.1", "blocks.2"}
    assert model.blocks[2]._compiled_call_impl is None
    model.compile(backend=FAST)
    with pytest.raises(QSyncInputError, match="the model is compiled already"):
        applier(Plan(fused_regions=[["blocks.2"]]))


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="torch.compile has no backend 'no-such-compiler'"):
        RegionApplier(nn.Linear(2, 2), backend="no-such-compiler")


def test_a_plan_may_name_a_block_holding_recorded_layers():
    layers = ["stem", "blocks.0.fc1", "blocks.0.fc2", "head"]
    Plan(fused_regions=[["blocks.0"], ["head"]]).validate_for(layers)
    with pytest.raises(QSyncInputError, match="'blocks.1'"):
        Plan(fused_regions=[["blocks.1"]]).validate_for(layers)


# --- applied -------------------------------------------------------------------------------------


def test_regions_run_as_eager_share_identical_graphs_and_undo_back_to_eager():
    model, eager = _twins(Block, Block)
    applier = RegionApplier(model, backend=FAST)
    regions = [["blocks.0"], ["blocks.1"], ["head"]]
    undo = applier(Plan(fused_regions=regions))
    assert _compiled(model) == {"blocks.0", "blocks.1", "head"}
    for seed in (1, 2):
        _assert_same_step(model, eager, _batch(seed=seed))
    stats = applier.region_stats()
    assert set(stats) == {"blocks.0", "blocks.1", "head"}
    # blocks.1 runs the graph compiled for blocks.0 (one class, the same shapes); an nn.Linear,
    # which Module.compile() would leave eager, is compiled
    assert [stats[name]["graphs"] for name in ("blocks.0", "blocks.1", "head")] == [1, 0, 1]
    assert all(s["compiled"] and s["first_call_s"] > 0 and s["recompiles"] == 0 for s in stats.values())
    assert applier.notes() == [] and applier.failure() is None and applier.went_back() == {}
    undo()
    undo()  # twice: nothing more
    assert _compiled(model) == set() and applier.region_stats() == {}
    _assert_same_step(model, eager, _batch(seed=3))
    undo = applier(Plan(fused_regions=regions))  # the loop's turns apply the plan again
    _assert_same_step(model, eager, _batch(seed=4))
    assert [s["graphs"] for s in applier.region_stats().values()] == [0, 0, 0]  # nothing compiled again
    undo()


def test_each_module_class_has_its_own_compiled_code_and_recompile_limit():
    limit = torch._dynamo.config.recompile_limit
    classes = [type(f"Kind{i}", (Small,), {}) for i in range(limit + 1)]
    model, eager = _twins(*classes)
    applier = RegionApplier(model, backend=FAST)
    applier(Plan(fused_regions=[[f"blocks.{i}"] for i in range(len(classes))]))
    _assert_same_step(model, eager, _batch())
    assert all(s["compiled"] and s["graphs"] == 1 for s in applier.region_stats().values())


def test_past_the_recompile_limit_a_region_goes_back_to_eager_alone():
    # one class, as many parameter shapes as entries allowed and one more: parameters keep static shapes
    limit = torch._dynamo.config.recompile_limit
    model = nn.ModuleList(Limited(4, k) for k in range(1, limit + 2))
    applier = RegionApplier(model, backend=FAST)
    applier(Plan(fused_regions=[[str(i)] for i in range(limit + 1)]))
    x = torch.randn(2, 4)
    with pytest.warns(RuntimeWarning, match=rf"region '{limit}' rolled back alone"):
        outs = [layer(x) for layer in model]
    assert [out.shape[1] for out in outs] == list(range(1, limit + 2))
    assert applier.notes() == [
        f"region '{limit}' rolled back alone to eager: its first call failed to compile "
        f"(FailOnRecompileLimitHit: the compiled code of its class holds "
        f"torch._dynamo.config.recompile_limit ({limit}) entries)"
    ]
    assert _compiled(model) == {str(i) for i in range(limit)}
    with pytest.warns(RuntimeWarning, match="region '0' rolled back alone to eager: a later call failed"):
        model[0](torch.randn(3, 4))  # a new batch size: a recompile, past the limit
    assert not applier.region_stats()["0"]["compiled"] and len(applier.notes()) == 2


def test_a_graph_break_rolls_its_region_back_alone():
    model, eager = _twins(Block, Breaking)
    applier = RegionApplier(model, backend=FAST)
    applier(Plan(fused_regions=[["blocks.0"], ["blocks.1"]]))
    with pytest.warns(RuntimeWarning, match=r"region 'blocks\.1' rolled back alone to eager"):
        _assert_same_step(model, eager, _batch())
    stats = applier.region_stats()
    assert stats["blocks.0"]["compiled"] and not stats["blocks.1"]["compiled"]
    note = stats["blocks.1"]["eager_fallback"]
    assert "its first call failed to compile (Unsupported: Call to `torch._dynamo.graph_break()`" in note
    assert applier.notes() == [note]
    assert applier.went_back() == {
        "fused_regions": [["blocks.1"]]
    }  # what the loop leaves out of the kept plan
    assert applier.failure() is None  # the rest of the plan stays in force
    assert _compiled(model) == {"blocks.0"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eager now: no second warning
        _assert_same_step(model, eager, _batch(seed=2))


def test_a_failing_compiler_rolls_its_region_back_alone_and_training_goes_on():
    model, eager = _twins(GeluBlock, Block)
    applier = RegionApplier(model, backend="qsync_test_no_gelu")
    applier(Plan(fused_regions=[["blocks.0"], ["blocks.1"]]))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    with pytest.warns(RuntimeWarning, match=r"region 'blocks\.0' rolled back alone"):
        for seed in (1, 2, 3):
            _assert_same_step(model, eager, _batch(seed=seed))
            for optimizer in optimizers:
                optimizer.step()
    assert applier.notes() == [
        "region 'blocks.0' rolled back alone to eager: its first call failed to compile "
        "(BackendCompilerFailed: backend='qsync_test_no_gelu' raised: RuntimeError: this compiler has no "
        "gelu)"
    ]
    assert _compiled(model) == {"blocks.1"}


def test_an_error_of_the_users_own_is_raised_as_without_the_plan():
    model, eager = _twins(Block)
    applier = RegionApplier(model, backend=FAST)
    applier(Plan(fused_regions=[["blocks.0"]]))
    wrong = torch.randn(4, 5)  # the block takes 16 features
    with pytest.raises(RuntimeError) as eager_error:
        eager.blocks[0](wrong)
    with pytest.raises(type(eager_error.value), match="cannot be multiplied"):
        model.blocks[0](wrong)
    assert applier.notes() == [] and _compiled(model) == {"blocks.0"}  # not the compiler's fault
    _assert_same_step(model, eager, _batch())


def test_a_new_batch_size_recompiles_once_then_runs_for_any_size():
    model, eager = _twins(Resized)
    applier = RegionApplier(model, backend=FAST)
    applier(Plan(fused_regions=[["blocks.0"]]))
    _assert_same_step(model, eager, _batch(8))
    _assert_same_step(model, eager, _batch(5))  # a last partial batch: dynamic in the batch now
    _assert_same_step(model, eager, _batch(3))
    stats = applier.region_stats()["blocks.0"]
    assert (stats["graphs"], stats["recompiles"]) == (2, 1) and stats["recompile_s"][0] > 0
    model.eval()
    with torch.no_grad():  # validation runs eagerly: no compile of its own
        torch.testing.assert_close(model(_batch(6)), eager.eval()(_batch(6)))
    assert applier.region_stats()["blocks.0"] == stats
    assert stats["compiled"] and stats["eager_fallback"] is None


def test_a_region_compiles_and_recompiles_under_the_recorders_layer_ranges():
    """A region compiled, or compiled again for a new batch size, while the recorder's module hooks
    are installed (a recorded window) traces them as doing nothing and stays compiled."""
    model, eager = _twins(Ranged)
    ranges = LayerRanges(layers_of(model), blocks_of(model))
    ranges.install()
    try:
        applier = RegionApplier(model, backend=FAST)
        applier(Plan(fused_regions=[["blocks.0"]]))
        with torch.profiler.profile() as prof:
            _assert_same_step(model, eager, _batch(8))
            _assert_same_step(model, eager, _batch(5))
    finally:
        ranges.remove()
    stats = applier.region_stats()["blocks.0"]
    assert stats["compiled"] and stats["eager_fallback"] is None
    assert (stats["graphs"], stats["recompiles"]) == (2, 1)
    names = {e.name for e in prof.events()}
    assert "qsync::layer::stem" in names and "qsync::module::blocks" in names
    assert not any(name.startswith("qsync::layer::blocks.0") for name in names)  # traced away


def test_a_region_holding_low_precision_layers_compiles_under_the_profiler():
    """The precision applier's LP layers (bf16 here) open a profiler range only outside a compiled
    region, so a region holding them compiles, under the profiler too, and computes as they do."""
    model, eager = _twins(LowPrecision)
    plan = Plan(precision={"blocks.0.fc1": "bf16", "blocks.0.fc2": "bf16"}, fused_regions=[["blocks.0"]])
    precision_applier(eager)(plan)
    applier = RegionApplier(model, backend=FAST)
    apply_plan(plan, {"precision": precision_applier(model), "fused_regions": applier})
    with torch.profiler.profile():
        _assert_same_step(model, eager, _batch(8), atol=1e-2)
    stats = applier.region_stats()["blocks.0"]
    assert stats["compiled"] and stats["eager_fallback"] is None and stats["graphs"] == 1


def test_a_region_holding_an_activation_policy_is_refused_and_one_inside_a_policy_runs():
    model, eager = _twins(Block, Block)
    appliers = {"activation": ActivationApplier(model), "fused_regions": RegionApplier(model, backend=FAST)}
    for policy in ("recompute", "offload"):
        plan = Plan(activation={"blocks.0.fc2": policy}, fused_regions=[["blocks.0"]])
        with pytest.raises(QSyncInputError, match=rf"'blocks\.0\.fc2' has the activation policy {policy}, "):
            apply_plan(plan, appliers)
        assert _compiled(model) == set() and "forward" not in model.blocks[0].fc2.__dict__  # all undone
    # a region inside a recomputed module, the last one it runs: the recompute calls the compiled
    # region again, and stops early inside it
    undo = apply_plan(Plan(activation={"blocks": "recompute"}, fused_regions=[["blocks.1"]]), appliers)
    for seed in (1, 2):
        _assert_same_step(model, eager, _batch(seed=seed), atol=1e-5)
    assert _compiled(model) == {"blocks.1"}
    undo()
    # a plan of other levers leaves the regions alone
    undo = apply_plan(Plan(activation={"blocks.0": "recompute"}), appliers)
    assert _compiled(model) == set() and appliers["fused_regions"].region_stats() == {}
    undo()


def test_inductor_compiles_a_region_whose_outputs_and_gradients_are_eager_ones():
    model, eager = _twins(LitBlock)
    applier = RegionApplier(model)  # inductor
    applier(Plan(fused_regions=[["blocks.0"]]))
    for seed in (1, 2):  # the Lightning test's batch size: inductor's cache has its graph then
        _assert_same_step(model, eager, _batch(16, seed=seed), atol=1e-5)
    stats = applier.region_stats()["blocks.0"]
    assert stats["compiled"] and stats["graphs"] == 1 and stats["first_call_s"] > 0
    assert stats["recompiles"] == 0 and applier.notes() == []


# --- in Lightning --------------------------------------------------------------------------------


class TinyNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Net(LitBlock, LitBlock)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(callback=None, max_steps: int = 5) -> TinyNet:
    pl.seed_everything(0, verbose=False)
    model = TinyNet()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 4, (40,), generator=g))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,  # epochs of 16, 16 and a last batch of 8
        callbacks=[callback] if callback else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=16))
    return model


def test_a_region_plan_given_to_the_callback_is_compiled_in_lightning_training(tmp_path):
    plan_file = tmp_path / "plan.json"
    Plan(fused_regions=[["net.blocks.0"], ["net.blocks.1"]]).save(plan_file)
    callback = QSyncCallback(mode="apply", plan=plan_file, plan_cache=False, output_dir=tmp_path / "q")
    model = _fit(callback)
    plain = _fit()
    assert callback.plan is not None and callback.plan.fused_regions  # applied at step 0 and kept
    stats = callback._run.appliers()["fused_regions"].region_stats()
    assert {name: (s["compiled"], s["graphs"]) for name, s in stats.items()} == {
        "net.blocks.0": (True, 2),  # the first batch size, then the last batch's: dynamic
        "net.blocks.1": (True, 0),  # the same graphs as net.blocks.0
    }
    assert stats["net.blocks.0"]["recompiles"] == 1
    assert _compiled(model) == {"net.blocks.0", "net.blocks.1"}
    assert len(model.losses) == 5 and all(torch.isfinite(torch.tensor(model.losses)))
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(plain.losses), rtol=1e-4, atol=1e-5)


def test_a_run_recorded_under_a_region_plan_keeps_its_regions_compiled(tmp_path):
    # the recorder's hooks, installed after the regions' first calls (the window opens at step 3,
    # after the epoch's last batch recompiled), do not run inside the compiled regions
    plan_file = tmp_path / "plan.json"
    Plan(fused_regions=[["net.blocks.0"], ["net.blocks.1"]]).save(plan_file)
    out = tmp_path / "q"
    callback = QSyncCallback(
        mode="report",
        plan=plan_file,
        plan_cache=False,
        output_dir=out,
        warmup_steps=4,
        profile_steps=1,
        measure_steps=0,
    )
    model = _fit(callback, max_steps=7)
    applier = callback._run.appliers()["fused_regions"]
    assert (out / "report.json").exists() and applier.notes() == []
    assert _compiled(model) == {"net.blocks.0", "net.blocks.1"}
    assert all(torch.isfinite(torch.tensor(model.losses)))
