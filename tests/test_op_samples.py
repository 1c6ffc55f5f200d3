"""Measured ops from real recorded runs (`recorder/op_samples.py`), ops timed alone
(`recorder/op_probes.py`), and the estimate priced by the learned model (`estimate.py`)."""

import collections
import dataclasses
import json
import math

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback import QSyncCallback
from qsync_callback.estimate import estimate, estimate_trace, probe_order
from qsync_callback.predictor.op_cost_model import OpCostModel, device_model
from qsync_callback.recorder.op_dataset import load_dataset
from qsync_callback.recorder.op_probes import (
    MADE_UP_FLOATS,
    MAX_PROBE_BYTES,
    call_input_bytes,
    made_up,
    probe,
    scratch_bytes,
)
from qsync_callback.recorder.op_samples import decomposes, op_samples, recorded_flops
from qsync_callback.recorder.symbolic_trace import symbolic_trace
from qsync_callback.report import build_report

from tracebuilder import op_samples as synthetic_samples

BATCH, WIDTH, HIDDEN, CLASSES = 32, 64, 256, 10


class ConvNet(pl.LightningModule):
    """A convolution (whose FLOPs need its stride and padding), batch norm, a linear head; SGD."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm2d(16)
        self.head = nn.Linear(16 * 8 * 8, CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.norm(self.conv(x)))
        return nn.functional.cross_entropy(self.head(h.flatten(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _batches(n: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n * BATCH, 3, 16, 16, generator=g), torch.randint(
        0, CLASSES, (n * BATCH,), generator=g
    )


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A real Lightning run of ConvNet recording its window, its data set in a cache of its own."""
    root = tmp_path_factory.mktemp("op_cost_model")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        x, y = _batches(30)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=30,
            callbacks=[QSyncCallback(mode="record", output_dir=root / "run", plan_cache=False)],
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            logger=False,
        )
        trainer.fit(ConvNet(), DataLoader(TensorDataset(x, y), batch_size=BATCH))
        traces = load_dataset("cpu")
    raw = json.loads((root / "run" / "trace" / "rank0" / "kineto.json").read_text())
    overhead = json.loads((root / "run" / "trace" / "rank0" / "trace.json").read_text())[
        "profiler_overhead_us"
    ]
    return {"root": root, "traces": traces, "raw": raw, "overhead": overhead}


def test_a_recorded_run_adds_its_measured_ops_to_the_devices_data_set(recorded):
    (document,) = recorded["traces"]
    assert document["steps"] and all(
        s["ops"] > 0 and 0 < s["ops_us"] < s["step_us"] for s in document["steps"]
    )
    # each step fetched its next batch from the loader (TensorDataset's rows, collated): timed apart
    assert all(0 < s["data_us"] < s["step_us"] - s["ops_us"] for s in document["steps"])
    names = {op["name"] for op in document["ops"]}
    assert {"aten::convolution", "aten::addmm", "aten::convolution_backward"} <= names
    assert all(op["us"] >= 0 and op["count"] >= 1 for op in document["ops"])
    # an op doing arithmetic is timed; a detach or a view can cost less than the profiler's
    # own per-event cost, which is subtracted, and is then 0 (never negative)
    arithmetic = [op for op in document["ops"] if op["flops"] > 0]
    assert len(arithmetic) >= 3 and all(op["us"] > 0 for op in arithmetic)
    assert sum(op["us"] for op in arithmetic) > 0.5 * sum(op["us"] for op in document["ops"])
    # the model's ops only: the data loader's (TensorDataset's indexing, collation) are host time
    assert "aten::stack" not in names


def test_the_recorded_ops_are_the_ops_a_symbolic_trace_of_the_same_step_has(recorded):
    samples, steps = op_samples(recorded["raw"], recorded["overhead"])
    measured = collections.Counter()
    for sample in samples:
        measured[sample.name, repr(sample.shapes)] += sample.count
    x, y = _batches(1)
    traced = symbolic_trace(ConvNet(), (x, y))
    symbolic = collections.Counter((op.name, repr(op.input_shapes)) for op in traced.ops)
    # each step's ops allocate what the symbolic step's do: what the host time is priced on
    allocated = sum(op.bytes for op in traced.ops)
    assert all(s.out_bytes == pytest.approx(allocated, rel=0.05) for s in steps)
    per_step = {key: n / len(steps) for key, n in measured.items()}
    matched = sum(min(per_step.get(key, 0), n) for key, n in symbolic.items())
    # unmatched: a few detaches, and Lightning's own ops on the loss in the real step (its
    # closure's division, the copy it logs)
    assert matched >= 0.9 * sum(symbolic.values())
    assert matched >= 0.85 * sum(per_step.values())
    assert not any(decomposes(name) for name, _ in per_step)  # aten::linear, aten::conv2d: never a sample


def test_flops_of_a_recorded_op_are_torchs_own_formula(recorded):
    events = {e["name"]: e for e in recorded["raw"]["traceEvents"] if e.get("cat") == "cpu_op"}
    x, y = _batches(1)
    symbolic = {op.name: op for op in symbolic_trace(ConvNet(), (x, y)).ops if op.kind == "forward"}
    for name in ("aten::convolution", "aten::addmm"):
        assert recorded_flops(name, events[name]["args"]) == symbolic[name].flops > 0
    assert recorded_flops("aten::relu", events["aten::relu"]["args"]) == 0


def test_the_estimate_is_priced_by_the_learned_model_once_the_device_has_data(recorded):
    x, y = _batches(1)
    cache = recorded["root"] / "cache" / "qsync_callback"
    model = device_model("cpu", cache)
    assert model is not None and model.sources == [recorded["traces"][0]["source"]]
    learned = estimate(ConvNet(), (x, y), cost_model=model)
    assert learned["symbolic"]["durations"].startswith("predicted by the learned per-op model")
    rooflined = estimate(ConvNet(), (x, y), learned=False)
    assert "roofline" in rooflined["symbolic"]["durations"]
    # the same trace, the same memory; only the durations differ
    assert learned["predicted"]["peak_bytes"] == rooflined["predicted"]["peak_bytes"]
    # trained on this very model's run, its price of the step (without the ops timed alone, which
    # run later and drift apart from the recording, and without the loader's fetch, which an
    # estimate from a batch leaves out) lies within the run's own steps' spread, widened by 35% for
    # the model's fit
    unprobed = build_report([estimate_trace(ConvNet(), (x, y), cost_model=model, probe_seconds=0)])
    steps_ms = [(s["step_us"] - s["data_us"]) / 1e3 for s in recorded["traces"][0]["steps"]]
    assert min(steps_ms) / 1.35 <= unprobed["predicted"]["step_ms"] <= max(steps_ms) * 1.35
    assert math.isfinite(learned["predicted"]["step_ms"])
    assert math.isfinite(rooflined["predicted"]["step_ms"])


class LSTMNet(pl.LightningModule):
    """An LSTM: on this CPU its backward is oneDNN's, which reads a workspace made in forward."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out, _ = self.lstm(x)
        return nn.functional.cross_entropy(self.head(out[:, -1]), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())


def test_ops_are_timed_alone_in_a_child_that_a_crashing_kernel_does_not_take_down():
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(8, 12, 16, generator=g), torch.randint(0, CLASSES, (8,), generator=g)
    distinct_ops = {}
    symbolic_trace(LSTMNet(), batch, distinct_ops=distinct_ops)
    assert len(distinct_ops) > 20 and all(r.call["op"].startswith("aten::") for r in distinct_ops.values())
    timed = probe(distinct_ops.values(), seconds=120)
    # every op is timed, the RNN backward too: its forward's workspace, which a fake kernel leaves
    # empty, was sized by a real run of the forward, and the backward's made-up one has that size
    # (an empty one crashed the child: `test_child_runner.py` has a child that crashes)
    assert {r.name for r in distinct_ops.values()} == {s.name for s in timed}
    # less the harness's own cost of a call: a view can be 0, never below; arithmetic is not 0
    assert len(timed) == len(distinct_ops) and all(s.us >= 0 for s in timed)
    assert all(s.us > 0 for s in timed if s.flops > 0)
    mm = next(s for s in timed if s.name == "aten::mm")
    assert mm.shapes == next(r.shapes for r in distinct_ops.values() if r.name == "aten::mm")


def test_an_estimate_times_its_ops_alone_the_types_its_model_never_saw_first_and_keeps_them(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = OpCostModel([{"source": "matmuls and adds", "ops": synthetic_samples(40), "steps": []}])
    x, y = _batches(1)
    distinct_ops = {}
    trace = symbolic_trace(ConvNet(), (x, y), distinct_ops=distinct_ops)
    order = probe_order(trace, distinct_ops.values(), model)
    known = [s.name in model.known_types for s in order]
    assert sorted(known) == known and 0 < sum(known) < len(known)  # the types it never saw first
    runs = collections.Counter((op.name, repr(op.input_shapes), repr(op.input_dtypes)) for op in trace.ops)
    shares = [
        price * runs[s.name, repr(s.shapes), repr(s.dtypes)]
        for s, price in zip(order, model.predict_us([dataclasses.asdict(s) for s in order]), strict=True)
        if s.name in model.known_types
    ]
    assert shares == sorted(shares, reverse=True)  # then the largest share of the step first
    report = estimate(ConvNet(), (x, y), cost_model=model)
    durations = report["symbolic"]["durations"]
    timed = durations.split("timed alone on made-up tensors: ")[1].split(";")[0].split(", ")
    assert {"aten::convolution", "aten::convolution_backward", "aten::native_batch_norm"} <= set(timed)
    assert "aten::mm" not in timed  # the model has measured matmuls: blended with its time alone
    assert f"; {sum(known)} distinct ops of types it knows also timed alone" in durations
    (probes,) = load_dataset("cpu")
    assert probes["source"] == f"probes at {torch.get_num_threads()} thread(s)" and {
        o["name"] for o in probes["ops"]
    } == {s.name for s in order}


def test_an_rnn_layers_flops_are_its_gates_matmuls_recorded_or_symbolic(tmp_path):
    """oneDNN's RNN layer has no formula of torch's: `flop_formulas.py` gives it one, and the
    recorded op (its Kineto arguments) and the symbolic trace's op count alike."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 12, 16, generator=g), torch.randint(0, CLASSES, (8,), generator=g)
    model = LSTMNet()
    with torch.profiler.profile(record_shapes=True) as prof:
        model.training_step((x, y), 0).backward()
    prof.export_chrome_trace(str(tmp_path / "kineto.json"))
    events = json.loads((tmp_path / "kineto.json").read_text())["traceEvents"]
    recorded = {e["name"]: recorded_flops(e["name"], e["args"]) for e in events if e.get("cat") == "cpu_op"}
    symbolic = {op.name: op.flops for op in symbolic_trace(LSTMNet(), (x, y)).ops}
    gates, time_rows = 4 * 32, 12 * 8  # an LSTM's four gates of the hidden size; time steps x batch
    forward = 2 * time_rows * gates * (16 + 32)
    assert recorded["aten::mkldnn_rnn_layer"] == symbolic["aten::mkldnn_rnn_layer"] == forward
    backward = recorded["aten::mkldnn_rnn_layer_backward"]
    assert backward == symbolic["aten::mkldnn_rnn_layer_backward"] == 2 * forward


HEADS = 4


class AttentionNet(pl.LightningModule):
    """One self-attention of ``HEADS`` heads by ``scaled_dot_product_attention``: on a CPU, the
    flash-attention kernel torch registers no FLOP formula for."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 3 * 16)
        self.out = nn.Linear(16, CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch  # (batch, tokens, 16)
        q, k, v = (t.unflatten(-1, (HEADS, 16 // HEADS)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        attended = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return nn.functional.cross_entropy(self.out(attended.mean(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_cpu_attentions_flops_are_its_matmuls_recorded_or_symbolic(tmp_path):
    """The CPU's flash attention (`flop_formulas.py`): ``Q K^T`` and the scores times ``V``, each
    2 * batch * heads * tokens^2 * head size FLOPs; its backward five such matmuls; the recorded
    op and the symbolic one count alike."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 12, 16, generator=g), torch.randint(0, CLASSES, (8,), generator=g)
    with torch.profiler.profile(record_shapes=True) as prof:
        AttentionNet().training_step((x, y), 0).backward()
    prof.export_chrome_trace(str(tmp_path / "kineto.json"))
    events = json.loads((tmp_path / "kineto.json").read_text())["traceEvents"]
    recorded = {e["name"]: recorded_flops(e["name"], e["args"]) for e in events if e.get("cat") == "cpu_op"}
    symbolic = {op.name: op.flops for op in symbolic_trace(AttentionNet(), (x, y)).ops}
    name = "aten::_scaled_dot_product_flash_attention_for_cpu"
    matmul = 2 * 8 * HEADS * 12 * 12 * (16 // HEADS)
    assert recorded[name] == symbolic[name] == 2 * matmul
    assert recorded[f"{name}_backward"] == symbolic[f"{name}_backward"] == 5 * matmul


def test_a_kernels_scratch_is_measured_in_a_child_and_a_call_too_large_is_left_out():
    mm = {"op": "aten::mm.default", "args": [{"tensor": [[64, 32], [32, 1], "float"]}] * 2, "kwargs": {}}
    mm["args"][1] = {"tensor": [[32, 64], [64, 1], "float"]}
    huge = {"op": "aten::relu.default", "args": [{"tensor": [[1 << 28], [1], "float"]}], "kwargs": {}}
    assert call_input_bytes(huge) > MAX_PROBE_BYTES
    small, too_large = scratch_bytes([mm, huge], seconds=60)
    assert isinstance(small, int) and small >= 0 and too_large is None


def test_made_up_floats_are_positive_and_away_from_zero_so_no_op_takes_its_nan_or_inf_path():
    made = made_up([64, 64], [64, 1], torch.float32, "cpu")
    low, high = MADE_UP_FLOATS
    assert made.shape == (64, 64) and low <= made.min() and made.max() < high and low > 0
    assert torch.isfinite(made.sqrt()).all() and torch.isfinite(1 / made).all()
    assert (made_up([8], [1], torch.int64, "cpu") == 0).all()  # integers: valid indices
