"""The activation applier in real training: recompute and offload change no loss bit, free what they
say, refuse what would break, undo exactly, and survive a disk that refuses a write."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback.appliers.torch_activation import ActivationApplier
from qsync_callback.appliers.torch_precision import precision_applier
from qsync_callback.errors import QSyncInputError
from qsync_callback.lp import LPModule
from qsync_callback.plan import MIN_OFFLOAD_BYTES, Plan
from qsync_callback.quiet_profiler import quiet_kineto
from qsync_callback.recorder.module_calls import CallProbe, activation_refusals, output_problem
from qsync_callback.tuning_loop import apply_plan

BATCH, WIDTH = 256, 256


def _net():
    """Dropout and BatchNorm (training mode): the RNG and the buffers a recompute must replay once."""
    return nn.Sequential(
        nn.Linear(64, WIDTH),
        nn.GELU(),
        nn.Dropout(0.3),
        nn.Linear(WIDTH, WIDTH),
        nn.BatchNorm1d(WIDTH),
        nn.GELU(),
        nn.Dropout(0.3),
        nn.Linear(WIDTH, 8),
    )


def _batches(steps):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 64, generator=g), torch.randint(0, 8, (BATCH,), generator=g))
        for _ in range(steps)
    ]


def _train(plan=None, steps=20, apply_at=0, undo_at=None, applier_options=None):
    """Train a seeded `_net` for ``steps`` SGD steps; ``plan`` is applied at the boundary before step
    ``apply_at`` through `apply_plan` (with the activation and the precision appliers), undone before
    ``undo_at`` (None: after the last). Returns the losses, the model, the activation applier and the
    stores' stats of every step."""
    torch.manual_seed(0)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    applier = ActivationApplier(model, **(applier_options or {}))
    appliers = {"activation": applier, "precision": precision_applier(model)}
    losses, stats, undo = [], [], None
    for step, (x, y) in enumerate(_batches(steps)):
        if plan is not None and step == apply_at:
            undo = apply_plan(plan, appliers)
        if undo is not None and step == undo_at:
            undo, _ = None, undo()
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        stats.append(applier.step_stats())
    if undo is not None:
        undo()
    return losses, model, applier, stats


def _buffers(model):
    return {name: b.clone() for name, b in model.named_buffers()}


def _equal_buffers(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _directories(root):
    return sorted(os.listdir(root))


# --- recompute -------------------------------------------------------------------------------------


RECOMPUTE = Plan(activation={"0": "recompute", "2": "recompute", "3": "recompute", "4": "recompute"})


def test_recompute_gives_bit_identical_losses_and_running_stats_from_step_zero_and_mid_run():
    base_losses, base_model, _, _ = _train()
    for apply_at in (0, 10):
        losses, model, _, _ = _train(RECOMPUTE, apply_at=apply_at)
        assert losses == base_losses  # dropout's masks replayed, BatchNorm's statistics updated once
        assert _equal_buffers(_buffers(model), _buffers(base_model))
        assert model[4].num_batches_tracked.item() == 20
        assert all(
            torch.equal(p, q) for p, q in zip(model.parameters(), base_model.parameters(), strict=True)
        )


class _Residual(nn.Module):
    """A ResNet basic block: two conv-BN pairs, an in-place ReLU inside, the skip added."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.drop = nn.Dropout2d(0.2)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.drop(self.bn2(self.conv2(out))) + x)


def test_recompute_of_residual_blocks_with_batch_norm_keeps_losses_and_statistics_bit_identical():
    def run(plan):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), _Residual(8), _Residual(8), nn.Flatten(), nn.Linear(8 * 8 * 8, 4)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        undo = ActivationApplier(model)(plan)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(8):
            x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        undo()
        return losses, _buffers(model)

    base_losses, base_buffers = run(Plan())
    losses, buffers = run(Plan(activation={"1": "recompute", "2": "recompute"}))
    assert losses == base_losses
    assert _equal_buffers(buffers, base_buffers) and buffers["1.bn1.num_batches_tracked"].item() == 8


def _saved_bytes_in_forward(model, x):
    """Bytes autograd saves (outside any checkpoint) in one forward, once per storage, the
    parameters (which the model holds anyway) left out."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in parameters:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    return sum(seen.values()), out


def test_recompute_lets_go_of_what_the_module_saved_but_its_input_and_makes_it_again_in_backward():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
    model = nn.Sequential(nn.Linear(64, WIDTH), block, nn.Linear(WIDTH, 8))
    x = torch.randn(BATCH, 64)
    kept, out = _saved_bytes_in_forward(model, x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    undo = ActivationApplier(model)(Plan(activation={"1": "recompute"}))
    recomputed, out = _saved_bytes_in_forward(model, x)
    # the GELU's input and output (the Linears' output and input inside the block) are let go; the
    # block's input stays (checkpoint keeps it to run the block again)
    assert kept - recomputed == 2 * BATCH * WIDTH * 4
    out.sum().backward()  # made again for the block's backward
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    undo()
    assert _saved_bytes_in_forward(model, x)[0] == kept


def test_recompute_replays_keyword_arguments_and_runs_plain_without_grad():
    class Scaled(nn.Module):
        def forward(self, x, *, scale):
            return nn.functional.dropout(x, 0.5, self.training) * scale

    def run(plan):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), Scaled())
        undo = ActivationApplier(model)(plan)
        x = torch.randn(4, 8)
        out = model[1](model[0](x), scale=torch.tensor(3.0))
        out.sum().backward()
        with torch.no_grad():
            plain = model[1](x, scale=2.0)
        undo()
        return out.detach(), model[0].weight.grad, plain

    assert all(
        torch.equal(a, b) for a, b in zip(run(Plan()), run(Plan(activation={"1": "recompute"})), strict=True)
    )


# --- offload ---------------------------------------------------------------------------------------


OFFLOAD = Plan(activation={"1": "offload", "3": "offload", "4": "offload"})


def test_offload_gives_bit_identical_losses_moves_what_the_modules_saved_and_removes_its_files(tmp_path):
    base_losses, base_model, _, _ = _train(steps=12)
    losses, model, applier, stats = _train(
        OFFLOAD, steps=12, apply_at=2, applier_options={"directory": str(tmp_path), "max_pending_bytes": 0}
    )
    assert losses == base_losses
    assert _equal_buffers(_buffers(model), _buffers(base_model))
    # each step: the GELU's input, the Linear's input and the BatchNorm's input, BATCH x WIDTH fp32 each
    # (the parameters and the BatchNorm's small statistics stay)
    moved = BATCH * WIDTH * 4
    assert moved >= MIN_OFFLOAD_BYTES
    assert stats[:2] == [{}, {}]
    for step in stats[2:]:
        disk = step["cpu"]
        assert disk["tier"] == "disk"
        assert (disk["to_store"]["bytes"], disk["to_store"]["copies"]) == (3 * moved, 3)
        assert disk["from_store"]["bytes"] == 3 * moved
    assert applier.failure() is None
    assert _directories(tmp_path) == []  # the undo closed the store


def test_offload_moves_a_storage_saved_twice_once(tmp_path):
    class Square(nn.Module):
        def forward(self, x):
            return x * x  # mul saves both operands: one storage, saved twice

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, WIDTH), Square(), nn.Linear(WIDTH, 8))
    applier = ActivationApplier(model, directory=str(tmp_path), max_pending_bytes=0)
    undo = applier(Plan(activation={"1": "offload"}))
    x = torch.randn(BATCH, 64)
    model(x).sum().backward()
    grad = model[0].weight.grad.clone()
    moves = applier.step_stats()["cpu"]
    undo()
    model.zero_grad()
    model(x).sum().backward()
    assert torch.equal(model[0].weight.grad, grad)
    assert (moves["to_store"]["bytes"], moves["to_store"]["copies"]) == (BATCH * WIDTH * 4, 1)


def test_offload_leaves_an_argument_held_elsewhere_where_it_is(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 8)
    )
    x = torch.randn(BATCH, 64)
    activation = BATCH * WIDTH * 4

    def moved(name):
        applier = ActivationApplier(model, directory=str(tmp_path))
        undo = applier(Plan(activation={name: "offload"}))
        model(x).sum().backward()
        stats = applier.step_stats()
        undo()
        return stats["cpu"]["to_store"]["bytes"] if stats else 0

    assert moved("0") == 0  # the batch: its caller holds it
    assert moved("2") == 0  # the ReLU's output: the ReLU saved it for its own backward
    assert moved("4") == activation  # the GELU's output: saved by this Linear alone


def _step_peak_rise(model, x, y):
    """The largest rise of the CPU allocator's "Total Allocated" counter (the profiler's memory
    events) over one forward and backward, above its value when the step starts."""
    quiet_kineto()
    with tempfile.TemporaryDirectory() as folder:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            nn.functional.cross_entropy(model(x), y).backward()
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            events = json.load(file)["traceEvents"]
    memory = sorted(
        (e["ts"], int(e["args"]["Total Allocated"]), int(e["args"]["Bytes"]))
        for e in events
        if e.get("name") == "[memory]"
    )
    start = memory[0][1] - memory[0][2]  # the counter before the step's first allocation
    return max(total for _, total, _ in memory) - start


def test_offload_lowers_the_steps_peak_of_allocated_bytes(tmp_path):
    torch.manual_seed(0)
    depth = 6
    model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(WIDTH, WIDTH), nn.GELU())])
    x, y = torch.randn(4 * BATCH, WIDTH), torch.randint(0, 8, (4 * BATCH,))
    _step_peak_rise(model, x, y)  # warm the allocator up
    baseline = _step_peak_rise(model, x, y)
    # every module's saved input but the first Linear's (the batch, held by the caller anyway)
    plan = Plan(activation={str(i): "offload" for i in range(1, 2 * depth)})
    applier = ActivationApplier(model, directory=str(tmp_path), max_pending_bytes=0)
    undo = applier(plan)
    offloaded = _step_peak_rise(model, x, y)
    moved = applier.step_stats()["cpu"]["to_store"]["bytes"]
    undo()
    activation = 4 * BATCH * WIDTH * 4
    assert moved == (2 * depth - 1) * activation
    # the baseline holds every activation at the end of forward; offloaded, about two modules' worth
    # (one written back in, the lookahead's) besides a backward's own temporaries
    assert offloaded < baseline - (depth - 1) * activation, (baseline, offloaded)


# --- both, and with a precision plan ---------------------------------------------------------------


def test_a_combined_plan_and_its_undo_leave_the_losses_bit_identical(tmp_path):
    base_losses, base_model, _, _ = _train(steps=16)
    combined = Plan(
        activation={"0": "recompute", "2": "recompute", "3": "offload", "4": "offload", "5": "keep"}
    )
    losses, model, applier, _ = _train(
        combined, steps=16, apply_at=3, undo_at=9, applier_options={"directory": str(tmp_path)}
    )
    assert losses == base_losses
    assert _equal_buffers(_buffers(model), _buffers(base_model))
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert applier.step_stats() == {} and _directories(tmp_path) == []


def test_recompute_on_a_precision_plans_lp_modules(tmp_path):
    precision = {"0": "bf16", "3": "bf16", "7": "bf16"}
    lp_losses, _, _, _ = _train(Plan(precision=precision), steps=8)
    both = Plan(precision=precision, activation={"0": "recompute", "3": "offload", "7": "recompute"})
    losses, model, _, _ = _train(both, steps=8, applier_options={"directory": str(tmp_path)})
    assert losses == lp_losses
    fp32_losses, _, _, _ = _train(steps=8)
    assert losses != fp32_losses  # the bf16 layers did run
    # the undo ran the activation applier's first: the stock layers are back, unwrapped
    assert not any(isinstance(m, LPModule) or "forward" in m.__dict__ for m in model.modules())


# --- refusals --------------------------------------------------------------------------------------


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.act = nn.ReLU(inplace=True)
        self.front = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(16, 16))  # changes its input
        self.unused = nn.Linear(16, 16)
        self.alias = self.head

    def forward(self, x):
        h = self.shared(self.shared(x))  # called twice per step
        h = self.act(h + self.mha(h, h, h, need_weights=False)[0])
        h = self.front(h + 0)
        return self.head(h)


class _Pair:
    """An object holding a tensor."""

    def __init__(self, tensor):
        self.tensor = tensor


class _WithObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _ObjectOut()

    def forward(self, x):
        return self.inner(x).tensor


class _ObjectOut(nn.Module):
    def forward(self, x):
        return _Pair(x * 2)


def test_refusals_name_each_reason_on_real_modules():
    model = _Twice()
    model.head.forward = model.head.forward  # a wrapper of someone else's, on the instance
    with CallProbe(model) as probe:
        model(torch.randn(2, 3, 16)).sum().backward()
    assert (probe.calls["shared"], probe.calls["front.1"], probe.calls["unused"]) == (2, 1, 0)
    names = ["", "nope", "shared", "act", "mha.out_proj", "head", "alias", "front", "unused", "mha"]
    refusals = activation_refusals(model, names, probe.calls, probe.problems)
    assert refusals == {
        "": "the model itself: a policy applies to a module inside it",
        "nope": "not a module of the model",
        "shared": "it is called 2 times per step",
        "act": "it changes its input in place (inplace=True), which a recompute would read again",
        "mha.out_proj": "nn.MultiheadAttention reads its weights instead of calling it: a policy never runs",
        "head": "its forward is already replaced on the instance (another wrapper)",
        "alias": "its forward is already replaced on the instance (another wrapper)",
        "front": "its forward changes an input in place",
        "unused": "it is not called in a step: a policy changes nothing",
    }
    other = _WithObject()
    with CallProbe(other) as probe:
        other(torch.randn(3))
    assert activation_refusals(other, ["inner"], probe.calls, probe.problems) == {
        "inner": "its forward returns a _Pair, not tensors"
    }
    assert output_problem({"a": (torch.ones(1), [None, torch.ones(1)])}) is None
    assert output_problem((torch.ones(1), 3)) == "its forward returns a int, not tensors"


def test_what_is_refused_really_breaks_or_does_nothing():
    """The reasons' facts: a checkpointed in-place module fails in backward; a policy on
    MultiheadAttention's out_proj never runs."""
    relu = nn.ReLU(inplace=True)
    x = torch.randn(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        checkpoint(relu, x * 1, use_reentrant=False).sum().backward()
    mha = nn.MultiheadAttention(16, 2)
    calls = []
    mha.out_proj.register_forward_hook(lambda *args: calls.append(1))
    mha(*(torch.randn(3, 1, 16),) * 3)
    assert calls == []


def test_the_applier_refuses_before_changing_anything():
    model = _Twice()
    applier = ActivationApplier(model, calls_per_step={"shared": 2})
    refused = [
        ({"shared": "recompute", "head": "offload"}, "'shared' (recompute): it is called 2 times per step"),
        ({"head": "offload", "nope": "recompute"}, "'nope' not a module of the model"),
        (
            {"head": "offload", "alias": "recompute"},
            "'alias' (recompute): 'head', the same module, is given offload",
        ),
        (
            {"front": "recompute", "front.1": "offload"},
            "'front.1' (offload): it is inside 'front', which has a policy",
        ),
        ({"act": "offload"}, "'act' (offload): it changes its input in place"),
    ]
    for policies, reason in refused:
        with pytest.raises(QSyncInputError, match="activation: ") as error:
            applier(Plan(activation=policies))
        assert reason in str(error.value)
        assert all("forward" not in m.__dict__ for m in model.modules())
    # keep needs nothing of a module; an alias given the same policy wraps the module once
    undo = applier(Plan(activation={"shared": "keep", "head": "recompute", "alias": "recompute"}))
    assert "forward" in model.head.__dict__ and "forward" not in model.shared.__dict__
    with pytest.raises(QSyncInputError, match="already replaced on the instance"):
        applier(Plan(activation={"head": "offload"}))  # a plan in force is undone before the next
    undo()
    undo()
    assert "forward" not in model.head.__dict__


# --- faults and the process's end ------------------------------------------------------------------


_TRAIN = """
import json, os, resource, signal, sys, torch
from torch import nn
from qsync_callback.appliers.torch_activation import ActivationApplier
from qsync_callback.plan import Plan

def train(plan, steps, directory, undo_at_end):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    applier = ActivationApplier(model, directory=directory, max_pending_bytes=0)
    undo = applier(plan) if plan else None
    g = torch.Generator().manual_seed(1)
    losses, failures, directories = [], [], []
    for _ in range(steps):
        x, y = torch.randn(256, 64, generator=g), torch.randint(0, 8, (256,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        failures.append(applier.failure())
        directories = sorted(os.listdir(directory))
    if undo and undo_at_end:
        undo()
    return losses, failures, directories
"""


def _run_python(code):
    done = subprocess.run(
        [sys.executable, "-c", _TRAIN + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_disk_that_refuses_writes_keeps_training_and_says_what_failed(tmp_path):
    out = _run_python(
        f"""
        base, _, _ = train(None, 4, {str(tmp_path)!r}, True)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        losses, failures, directories = train(Plan(activation={{"1": "offload", "2": "offload"}}), 4,
                                              {str(tmp_path)!r}, True)
        print(json.dumps({{"same": losses == base, "failures": failures, "directories": directories,
                          "left": os.listdir({str(tmp_path)!r})}}))
        """
    )
    assert out["same"]
    failure = out["failures"][0]
    assert (
        failure.startswith("disk offload store: writing ") and "(256.0 KiB) failed: File too large" in failure
    )
    assert out["failures"] == [failure] * 4  # the first fault is kept until the plan is undone
    assert len(out["directories"]) == 1 and out["left"] == []


def test_a_store_that_cannot_be_made_keeps_training_and_says_why(tmp_path):
    torch.manual_seed(0)
    model = _net()
    ((x, y),) = _batches(1)
    model.eval()  # the same dropout masks (none) and BatchNorm statistics for both passes
    nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    missing = tmp_path / "missing"  # no such directory: the store's own cannot be made in it
    applier = ActivationApplier(model, directory=str(missing))
    undo = applier(OFFLOAD)
    nn.functional.cross_entropy(model(x), y).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    failure = applier.failure()
    assert failure.startswith("cannot make the offload store of cpu: ") and str(missing) in failure
    assert applier.step_stats() == {}
    undo()
    assert applier.failure() is None


def test_the_files_go_with_a_process_that_never_undid(tmp_path):
    out = _run_python(
        f"""
        plan = Plan(activation={{"1": "offload"}})
        losses, failures, directories = train(plan, 2, {str(tmp_path)!r}, False)
        print(json.dumps({{"directories": directories, "failures": failures}}))
        """
    )
    assert len(out["directories"]) == 1 and out["failures"] == [None, None]
    assert os.listdir(tmp_path) == []


# --- Lightning -------------------------------------------------------------------------------------


class _Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _net()
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _ApplyAt(pl.Callback):
    """Apply ``plan`` at the boundary before step ``step`` through `apply_plan`; undo at the end."""

    def __init__(self, plan, step, directory):
        self.plan, self.step, self.directory = plan, step, directory
        self.applier = None
        self.undo = None
        self.stats = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.applier = ActivationApplier(pl_module, directory=self.directory, max_pending_bytes=0)
            self.undo = apply_plan(self.plan, {"activation": self.applier})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.undo is not None:
            self.stats.append(self.applier.step_stats())

    def on_train_end(self, trainer, pl_module):
        if self.undo is not None:
            self.undo()


def _fit(callback=None, steps=20):
    pl.seed_everything(0, verbose=False)
    module = _Module()
    g = torch.Generator().manual_seed(0)
    n = BATCH * steps
    data = DataLoader(
        TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 8, (n,), generator=g)), BATCH
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[callback] if callback else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    return module


def test_lightning_fit_with_a_plan_applied_at_a_step_boundary(tmp_path):
    baseline = _fit()
    plan = Plan(
        activation={"net.0": "recompute", "net.2": "recompute", "net.3": "offload", "net.4": "recompute"}
    )
    for step in (0, 7):
        callback = _ApplyAt(plan, step, str(tmp_path))
        module = _fit(callback)
        assert module.losses == baseline.losses
        assert _equal_buffers(_buffers(module), _buffers(baseline))
        assert len(callback.stats) == 20 - step
        # net.3's input (the dropout's output) goes to disk and back once a step
        moved = {"to": BATCH * WIDTH * 4, "from": BATCH * WIDTH * 4}
        assert all(
            {"to": s["cpu"]["to_store"]["bytes"], "from": s["cpu"]["from_store"]["bytes"]} == moved
            for s in callback.stats
        )
        assert all("forward" not in m.__dict__ for m in module.modules())
        assert _directories(tmp_path) == []
