"""The torch recorder on a real training loop under the real torch.profiler."""

import gc
import json

import pytest
import torch

from qsync_callback.predictor.memory import tensor_lifetimes
from qsync_callback.predictor.predict import predict
from qsync_callback.recorder import overhead
from qsync_callback.recorder.kineto import FREED_PREFIX, calibration_event_counts
from qsync_callback.recorder.live_memory import step_peak
from qsync_callback.recorder.torch_recorder import RAW_TRACE_FILE, TorchRecorder
from qsync_callback.recorder.trace import Trace, load_trace_dir, rank_trace_path
from qsync_callback.report import build_report


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(32, 64)
        self.attn = torch.nn.MultiheadAttention(64, 4, batch_first=True)
        self.head = torch.nn.Linear(64, 5)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        h, _ = self.attn(h, h, h)
        return self.head(h.mean(dim=1))


class KeepsATable(Net):
    """Keeps a 64 MiB tensor as a plain attribute (neither a parameter nor a buffer) and reads it in
    forward."""

    def __init__(self):
        super().__init__()
        self.table = torch.ones(16 * 2**20)

    def forward(self, x):
        return super().forward(x) + self.table[:5]


def _train(recorder, steps, fail_at=None):
    torch.manual_seed(0)
    x, y = torch.randn(16, 8, 32), torch.randint(0, 5, (16,))
    for step in range(steps):
        recorder.step_boundary()
        if step == fail_at:
            raise RuntimeError("user code failed")
        loss = torch.nn.functional.cross_entropy(recorder.model(x), y)
        loss.backward()
        recorder.optimizers[0].step()
        recorder.optimizers[0].zero_grad()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace")
    model = Net()
    recorder = TorchRecorder(
        model, [torch.optim.Adam(model.parameters())], out, warmup_steps=3, profile_steps=2
    )
    _train(recorder, 9)
    recorder.save()
    return out, recorder


def _profiler_enabled():
    return torch._C._autograd._profiler_enabled()


def test_writes_raw_and_normalized_trace(recorded):
    out, recorder = recorded
    raw = json.loads((out / "rank0" / RAW_TRACE_FILE).read_text())
    assert any(e.get("name", "").startswith("qsync::step#") for e in raw["traceEvents"])
    trace = Trace.load(rank_trace_path(out, 0))
    assert [s.index for s in trace.steps] == [4, 6]  # every other step after the settling step 3
    assert trace.raw_trace == RAW_TRACE_FILE
    # 0-1 cold, 2 the profiler's warm-up, 3 settles, 4 and 6 recorded; 5 and 7 timed (8 has no
    # closing boundary)
    assert len(trace.measured["step_ms"]) == 2
    assert not _profiler_enabled()


def test_ops_have_phases_and_layers(recorded):
    trace = Trace.load(rank_trace_path(recorded[0], 0))
    kinds = {op.kind for op in trace.ops}
    assert {"forward", "backward", "update"} <= kinds
    forward_layers = {op.layer for op in trace.ops if op.kind == "forward"}
    assert {"embed", "attn", "head"} <= forward_layers
    # the attention's out_proj is read directly by MultiheadAttention: its ops belong to "attn"
    backward_layers = {op.layer for op in trace.ops if op.kind == "backward" and "Addmm" in op.name}
    assert {"embed", "head"} <= backward_layers
    names = {op.name for op in trace.ops if op.kind == "update"}
    assert any("lerp" in n or "add" in n for n in names)


def test_memory_is_resident_plus_lifetimes(recorded):
    out, recorder = recorded
    trace = Trace.load(rank_trace_path(out, 0))
    params = sum(p.numel() * 4 for p in recorder.model.parameters())
    assert trace.resident_bytes["parameters"] == params
    assert trace.resident_bytes["optimizer_state"] >= 2 * params
    categories = {life.category for life in tensor_lifetimes(trace)}
    assert {"activations", "temporaries", "gradients"} <= categories
    prediction = predict(load_trace_dir(out))
    # measured from the live tensors and the allocator's counter, predicted from the resident bytes
    # and the tensors' lifetimes: a prediction off by a few percent fails
    measured = trace.measured["peak_bytes"]
    assert "live tensors" in trace.measured["peak_source"]
    assert "Total Allocated" in trace.measured["peak_source"]
    assert measured > sum(trace.resident_bytes.values())
    assert prediction.peak_bytes == pytest.approx(measured, rel=0.02)
    assert prediction.memory_breakdown["parameters"] == params


def test_a_tensor_kept_as_a_plain_attribute_is_measured_and_predicted(tmp_path, recorded):
    # 16 MiB in a reference cycle old enough that only a full collection frees it (an earlier run's
    # model, say): garbage, not resident
    garbage = [torch.ones(4 * 2**20)]
    garbage.append(garbage)
    gc.collect()
    del garbage
    model = KeepsATable()
    recorder = TorchRecorder(
        model, [torch.optim.Adam(model.parameters())], tmp_path, warmup_steps=3, profile_steps=2
    )
    _train(recorder, 9)
    trace = Trace.load(rank_trace_path(tmp_path, 0))
    table = 64 * 2**20
    assert table <= trace.resident_bytes["other"] < table + 2**20
    # the same run without the table (the module's fixture, whose model and optimizer are still
    # alive here: a few hundred KiB) measured 64 MiB less
    without = Trace.load(rank_trace_path(recorded[0], 0)).measured["peak_bytes"]
    assert trace.measured["peak_bytes"] - without == pytest.approx(table, abs=2**20)
    prediction = predict(load_trace_dir(tmp_path))
    assert prediction.peak_bytes == pytest.approx(trace.measured["peak_bytes"], rel=0.02)


def _record_zero_grad(tmp_path, zero_grad_before_backward):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    optimizer = torch.optim.Adam(model.parameters())
    recorder = TorchRecorder(model, [optimizer], tmp_path, warmup_steps=3, profile_steps=2)
    x, y = torch.randn(8, 1024), torch.randint(0, 10, (8,))
    for _ in range(9):
        recorder.step_boundary()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if zero_grad_before_backward:
            optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if not zero_grad_before_backward:
            optimizer.zero_grad()
    return Trace.load(rank_trace_path(tmp_path, 0))


def test_frees_the_allocator_counter_misses_are_measured(tmp_path):
    """Lightning's order: ``zero_grad`` between forward and backward frees last step's gradients,
    allocated in the unrecorded step before, whose frees the allocator's counter does not see. The
    peak (in the optimizer's step, with the new gradients) is the same as when the gradients are
    freed at the step's end; counting the old ones as well would add 4 MiB to its 24."""
    at_end = _record_zero_grad(tmp_path / "end", zero_grad_before_backward=False)
    before = _record_zero_grad(tmp_path / "before", zero_grad_before_backward=True)
    assert before.measured["peak_bytes"] == pytest.approx(at_end.measured["peak_bytes"], rel=0.01)
    # the marks of those frees are in the raw trace, not ops
    raw = (tmp_path / "before" / "rank0" / RAW_TRACE_FILE).read_text()
    assert FREED_PREFIX in raw and not any(op.name.startswith(FREED_PREFIX) for op in before.ops)


def test_step_peak_takes_off_the_frees_the_counter_missed():
    start = {0xA: 100, 0xB: 50, 0xC: 30}  # live at the step's start: 180 bytes
    counter = [
        [1, 0xA, -100, -100],  # seen freed
        [2, 0x1, 400, 300],
        [3, 0xC, -10, 290],  # seen, with the size of an older block at that address
        [4, 0x2, 200, 490],  # 0xB (freed at 2.5, unseen) and 20 bytes of 0xC are gone by now
        [5, 0xB, 80, 570],  # a new block where 0xB was
    ]
    freed = [[1, 0xA], [2.5, 0xB], [3, 0xC]]
    assert step_peak(start, counter, freed) == 180 + 570 - 50 - 20
    assert step_peak(start, counter, []) == 180 + 570
    assert step_peak(start, [], []) == 180


def test_overhead_is_calibrated_and_removed(recorded):
    out = recorded[0]
    trace = Trace.load(rank_trace_path(out, 0))
    assert set(trace.profiler_overhead_us) == {"op", "memory", "range"}
    assert trace.profiler_overhead_us["op"] > 0
    assert sum(op.overhead_us + op.gap_overhead_us for op in trace.ops) > 0
    # each loop's cost is divided among the events the profiler recorded for it: one op event per
    # add, plus an allocation and a free out of place, one layer range per hooked call
    counts = calibration_event_counts(json.loads((out / "rank0" / RAW_TRACE_FILE).read_text()))
    iterations = counts["op"]["op"]
    assert iterations > 0
    assert counts == {
        "op": {"op": iterations},
        "memory": {"op": iterations, "memory": 2 * iterations},
        "range": {"range": iterations},
    }
    # a per-event cost in the right unit seldom exceeds the duration of an op: far fewer than half
    # are cut to 0 (a per-loop cost charged per event, the old unit, clipped about half of them; a
    # drift of the machine within the calibration clips some: 9% in a clean-clone run, 17.6% in a
    # full suite in session 27, both beside nothing else)
    main = [op for op in trace.ops if op.thread == "main"]
    assert sum(0 < op.dur_us <= op.overhead_us for op in main) < 0.3 * len(main)
    prediction = predict(load_trace_dir(recorded[0]))
    recorded_ms = [s.dur_us / 1e3 for s in trace.steps]
    assert prediction.step_ms < max(recorded_ms)


def test_overhead_per_event_divides_each_loop_among_its_events():
    iterations = overhead._LOOPS * overhead._REPEATS
    # extra microseconds per iteration: 5 op events and 4 memory events (an add of a Python
    # scalar), those plus 2 memory events, one layer range
    extra = {"op": 2.4e-6, "memory": 2.6e-6, "range": 2e-6}
    counts = {
        "op": {"op": 5 * iterations, "memory": 4 * iterations},
        "memory": {"op": 5 * iterations, "memory": 6 * iterations},
        "range": {"range": iterations},
    }
    costs = overhead.overhead_per_event([extra], counts)
    assert costs == {"op": pytest.approx(0.4), "memory": pytest.approx(0.1), "range": pytest.approx(2.0)}
    # two rounds: the events of both counted, each loop's lower extra taken (the op loop ran slow in
    # the first, the others in the second)
    slow = {"op": 9e-6, "memory": extra["memory"], "range": extra["range"]}
    later = {"op": extra["op"], "memory": 7e-6, "range": 5e-6}
    both = {loop: {kind: 2 * n for kind, n in kinds.items()} for loop, kinds in counts.items()}
    assert overhead.overhead_per_event([slow, later], both) == costs


def test_profiler_is_stopped_when_the_run_fails_inside_the_window(tmp_path):
    model = Net()
    recorder = TorchRecorder(
        model, [torch.optim.SGD(model.parameters(), lr=0.1)], tmp_path, warmup_steps=2, profile_steps=3
    )
    with pytest.raises(RuntimeError, match="user code failed"):
        _train(recorder, 9, fail_at=5)  # recorded steps: 3, 5, 7
    assert _profiler_enabled()
    assert len(list(tmp_path.rglob("kineto.part*.json"))) == 2  # the warm-up session's and step 3's
    recorder.close()
    recorder.close()
    assert not _profiler_enabled()
    assert not any(module._forward_pre_hooks for module in model.modules())
    assert not list(tmp_path.rglob("kineto.part*.json"))


def test_saved_activations_are_counted_per_layer(recorded):
    trace = Trace.load(rank_trace_path(recorded[0], 0))
    saved = trace.saved_activation_bytes
    # embed saves its input (16x8x32 floats) for the weight gradient; head saves the mean (16x64)
    assert saved["embed"] == 16 * 8 * 32 * 4
    assert saved["head"] == 16 * 64 * 4
    assert saved["attn"] > 0
    layers = {row["layer"]: row for row in build_report(load_trace_dir(recorded[0]))["layers"]}
    # out_proj's own forward never runs: MultiheadAttention reads its weight directly
    assert list(layers) == ["embed", "attn", "head"]
    assert layers["head"]["saved_bytes"] == saved["head"] and layers["attn"]["saved_bytes"] == saved["attn"]
    # the phase-based liveness finds the attention's own saved tensors too (embed's saved input is
    # the batch, allocated before the step, and relu/mean run outside any layer)
    lives = tensor_lifetimes(trace)
    assert "attn" in {life.layer for life in lives if life.category == "activations"}
