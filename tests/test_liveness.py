"""Tensor liveness (`predictor/liveness.py`) and ``qsync liveness`` (`liveness_report.py`): on a real
recorded trace (torch.profiler over real training), and on hand-written steps whose inactive periods,
curves and kernels are known exactly."""

import csv
import json
import sys

import numpy as np
import pytest
import torch

from qsync_callback.cli import main
from qsync_callback.liveness_report import (
    LIVENESS_FILE,
    MEMORY_COUNTERS_FILE,
    MEMORY_CURVE_CSV,
    MEMORY_CURVE_PNG,
    PLOTS_MISSING,
    SAVED_TENSORS_CSV,
    SAVED_TENSORS_PNG,
    liveness_of,
    write_liveness,
)
from qsync_callback.predictor.liveness import KINDS, analyse_liveness, op_kernels
from qsync_callback.predictor.memory import predict_memory
from qsync_callback.predictor.predict import predict
from qsync_callback.recorder.kineto import STEP_PREFIX
from qsync_callback.recorder.torch_recorder import RAW_TRACE_FILE, TorchRecorder
from qsync_callback.recorder.trace import load_trace_dir, rank_trace_path

from tracebuilder import op, trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SAVING_LAYERS = ["1", "3", "5"]  # the ReLU, Tanh and ReLU: each saves its output for backward


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two recorded steps of a small MLP trained with Adam, and the liveness report of them."""
    trace_dir = tmp_path_factory.mktemp("trace")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    recorder = TorchRecorder(
        model, [torch.optim.Adam(model.parameters())], trace_dir, warmup_steps=3, profile_steps=2
    )
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
    for _ in range(8):
        recorder.step_boundary()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        recorder.optimizers[0].step()
        recorder.optimizers[0].zero_grad()
    recorder.save()
    traces = load_trace_dir(trace_dir)
    out = tmp_path_factory.mktemp("liveness")
    paths = write_liveness(traces, out, memory_budget_bytes=2**20, trace_dir=trace_dir)
    return trace_dir, traces, liveness_of(traces, trace_dir), out, paths


def test_every_file_is_written(recorded):
    _, _, _, out, paths = recorded
    names = [LIVENESS_FILE, SAVED_TENSORS_CSV, MEMORY_CURVE_CSV, MEMORY_COUNTERS_FILE]
    assert [p.name for p in paths] == [*names, MEMORY_CURVE_PNG, SAVED_TENSORS_PNG]
    assert all((out / name).stat().st_size > 0 for name in names)


def test_saved_tensors_are_found_for_the_layers_that_save_activations(recorded):
    """The bytes per layer and step equal what the recorder's saved-tensor hooks counted (in the
    warm-up, independently of the profiler's allocations)."""
    _, traces, liveness, _, _ = recorded
    (trace,) = traces
    saved = liveness.ranks[0].saved
    for step in trace.steps:
        by_layer = {}
        for s in saved:
            if s.step == step.index:
                by_layer[s.layer] = by_layer.get(s.layer, 0) + s.bytes
        for layer in SAVING_LAYERS:
            assert by_layer[layer] == trace.saved_activation_bytes[layer]
    assert {s.step for s in saved} == {step.index for step in trace.steps}


def test_inactive_periods_are_non_negative_and_longest_for_the_first_layer(recorded):
    _, traces, liveness, _, _ = recorded
    saved = liveness.ranks[0].saved
    for s in saved:
        assert s.inactive_us >= 0
        assert s.made_by.start_us <= s.saved_by.start_us <= s.last_forward_use.start_us
        assert s.first_backward_use.start_us <= s.freed_by.start_us
        assert (s.made_by.kind, s.freed_by.kind) == ("forward", "backward")
    for step in traces[0].steps:
        periods = [
            [s.inactive_us for s in saved if s.step == step.index and s.layer == la] for la in SAVING_LAYERS
        ]
        assert all(len(p) == 1 for p in periods)
        assert periods[0][0] > periods[1][0] > periods[2][0] > 0


def test_the_curve_peaks_where_the_predictor_says(recorded):
    _, traces, liveness, _, _ = recorded
    (trace,) = traces
    memory = predict_memory(trace)
    curves = liveness.ranks[0].curves
    assert [c.step for c in curves] == [s.index for s in trace.steps]
    for curve in curves:
        assert curve.peak_bytes == memory.step_peaks[curve.step]
        assert int(curve.total[0]) == sum(trace.resident_bytes.values())
        assert all((curve.by_kind[kind] >= 0).all() for kind in KINDS)
        assert (np.diff(curve.times_us) >= 0).all()
    assert liveness.peak_bytes == memory.peak_bytes == predict(traces).peak_bytes
    peak = liveness.peak_curve.at(liveness.peak_curve.peak_index)
    assert peak["parameters"] == trace.resident_bytes["parameters"]
    assert min(peak["gradients"], peak["optimizer_state"]) > 0


def test_each_op_lists_the_events_nested_in_it(recorded):
    trace_dir, traces, liveness, _, _ = recorded
    rank = liveness.ranks[0]
    linear = [o for o in traces[0].ops if o.name == "aten::linear"]
    assert len(linear) == 8  # 4 Linear layers, 2 steps
    for o in linear:
        kernels = rank.kernels[o.id]
        assert "aten::addmm" in [k.name for k in kernels if k.depth == 1]
        assert all(o.start_us <= k.start_us and k.start_us + k.dur_us <= o.end_us + 1e-3 for k in kernels)
        assert 0 < sum(k.self_us for k in kernels) <= o.dur_us
    # the raw events of the op with no nested events: none listed
    raw = json.loads((trace_dir / "rank0" / RAW_TRACE_FILE).read_text())
    kernels = op_kernels(traces[0], raw)
    assert kernels == rank.kernels
    assert any(not found for found in kernels.values())


def test_liveness_json_has_everything_and_a_version(recorded):
    _, traces, liveness, out, _ = recorded
    document = json.loads((out / LIVENESS_FILE).read_text())
    assert (document["format"], document["version"]) == ("qsync-liveness", 1)
    assert document["peak"]["bytes"] == liveness.peak_bytes
    assert document["memory_budget_bytes"] == 2**20
    assert document["notes"] == []
    (rank,) = document["ranks"]
    assert len(rank["ops"]) == len(traces[0].ops)
    assert all(
        o["kernels"] is not None and o["replayed_end_us"] >= o["replayed_start_us"] for o in rank["ops"]
    )
    step = rank["steps"][0]
    assert sum(step["memory_curve"]["by_kind"][kind][0] for kind in KINDS) == sum(
        traces[0].resident_bytes.values()
    )
    assert {s["layer"] for s in step["saved_tensors"]} >= set(SAVING_LAYERS)
    saved = [s for s in liveness.ranks[0].saved if s.step == step["step"]]
    assert [(s["bytes"], s["inactive_us"]) for s in step["saved_tensors"]] == [
        (s.bytes, s.inactive_us) for s in saved
    ]


def test_the_csv_files_parse(recorded):
    _, _, liveness, out, _ = recorded
    with open(out / SAVED_TENSORS_CSV, newline="") as handle:
        saved = list(csv.DictReader(handle))
    assert len(saved) == len(liveness.ranks[0].saved)
    assert {row["layer"] for row in saved} >= set(SAVING_LAYERS)
    assert all(float(row["inactive_us"]) >= 0 and int(row["bytes"]) > 0 for row in saved)
    with open(out / MEMORY_CURVE_CSV, newline="") as handle:
        curve = list(csv.DictReader(handle))
    assert len(curve) == sum(len(c.times_us) for c in liveness.ranks[0].curves)
    assert all(int(row["total"]) == sum(int(row[kind]) for kind in KINDS) for row in curve)
    assert max(int(row["total"]) for row in curve) == liveness.peak_bytes


def test_the_counter_track_is_a_chrome_trace_on_the_kineto_clock(recorded):
    trace_dir, traces, liveness, out, _ = recorded
    events = json.loads((out / MEMORY_COUNTERS_FILE).read_text())["traceEvents"]
    assert {e["ph"] for e in events} == {"C"}
    names = {e["name"] for e in events}
    assert names == {f"qsync memory: {kind}" for kind in KINDS} | {"qsync memory: total"}
    raw = json.loads((trace_dir / "rank0" / RAW_TRACE_FILE).read_text())
    step_ranges = [e for e in raw["traceEvents"] if e.get("name", "").startswith(STEP_PREFIX)]
    assert {e["pid"] for e in events} == {step_ranges[0]["pid"]}
    first, last = min(s.start_us for s in traces[0].steps), max(s.end_us for s in traces[0].steps)
    assert all(first <= e["ts"] <= last for e in events)
    totals = [e["args"]["bytes"] for e in events if e["name"] == "qsync memory: total"]
    assert max(totals) == liveness.peak_bytes


def test_the_plots_are_png_files(recorded):
    _, _, _, out, _ = recorded
    for name in (MEMORY_CURVE_PNG, SAVED_TENSORS_PNG):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


def test_without_matplotlib_the_rest_is_written_and_the_install_is_said_once(
    recorded, tmp_path, monkeypatch, capsys
):
    trace_dir, traces, _, _, _ = recorded
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    paths = write_liveness(traces, tmp_path, trace_dir=trace_dir)
    assert [p.name for p in paths] == [
        LIVENESS_FILE,
        SAVED_TENSORS_CSV,
        MEMORY_CURVE_CSV,
        MEMORY_COUNTERS_FILE,
    ]
    assert not list(tmp_path.glob("*.png"))
    err = capsys.readouterr().err
    assert err.count(PLOTS_MISSING) == 1
    assert "pip install 'qsync-callback[plots]'" in PLOTS_MISSING


def test_without_the_profiler_trace_the_kernels_are_missing_and_said_so(recorded, tmp_path):
    _, traces, _, _, _ = recorded
    write_liveness(traces, tmp_path)
    document = json.loads((tmp_path / LIVENESS_FILE).read_text())
    assert all(o["kernels"] is None for o in document["ranks"][0]["ops"])
    assert document["notes"] == ["rank 0: no kernel lists (no trace directory given)"]


def test_the_command_writes_the_report_and_prints_a_summary(recorded, tmp_path, capsys):
    trace_dir, _, liveness, _, _ = recorded
    out = tmp_path / "liveness"
    assert main(["liveness", str(trace_dir), "--out", str(out), "--memory-budget", "60%"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("predicted peak ")
    assert "budget " in printed and "over it by" in printed
    assert "inactive" in printed and "aten::relu" in printed
    assert str(out / MEMORY_CURVE_PNG) in printed
    document = json.loads((out / LIVENESS_FILE).read_text())
    assert document["memory_budget_bytes"] == int(0.6 * liveness.peak_bytes)


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda d: rank_trace_path(d, 0).write_text('{"format": "qsync-trace", "vers'), "invalid JSON"),
        (
            lambda d: (d / "rank0" / RAW_TRACE_FILE).write_text("[1, 2]"),
            "kineto.json: the document is a list",
        ),
        (
            lambda d: (d / "rank0" / RAW_TRACE_FILE).write_text('{"traceEvents": []}'),
            "no qsync::step# ranges",
        ),
    ],
)
def test_a_corrupt_trace_directory_is_one_line_and_exit_2(recorded, tmp_path, capsys, damage, expected):
    trace_dir = tmp_path / "trace"
    (trace_dir / "rank0").mkdir(parents=True)
    for name in ("trace.json", RAW_TRACE_FILE):
        (trace_dir / "rank0" / name).write_bytes((recorded[0] / "rank0" / name).read_bytes())
    damage(trace_dir)
    assert main(["liveness", str(trace_dir), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("qsync: error: ") and captured.err.count("\n") == 1
    assert expected in captured.err


def test_a_bad_budget_is_refused_before_the_trace_is_read(tmp_path, capsys):
    assert (
        main(["liveness", str(tmp_path / "missing"), "--out", str(tmp_path), "--memory-budget", "lots"]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("qsync: error: --memory-budget: not a size: 'lots'") and err.count("\n") == 1


# --- hand-written steps ---------------------------------------------------------------------------


def _mlp_step():
    """fc1 -> act -> fc2 -> loss, then their backward ops, with no profiler overhead (the replay is
    the recording). Sequence numbers: fc's linear takes n and its nested addmm n + 1."""
    ops = [
        op(0, "aten::linear", "forward", "main", 10, 10, layer="fc1", seq=10),
        op(1, "aten::relu", "forward", "main", 20, 5, layer="act", seq=12),
        op(2, "aten::linear", "forward", "main", 25, 15, layer="fc2", seq=13),
        op(3, "aten::mse_loss", "forward", "main", 40, 5, seq=15),
        op(4, "evaluate_function: MseLossBackward0", "backward", "main", 50, 5, seq=15),
        op(5, "evaluate_function: AddmmBackward0", "backward", "main", 55, 15, layer="fc2", seq=14),
        op(6, "evaluate_function: ReluBackward0", "backward", "main", 70, 5, layer="act", seq=12),
        op(7, "evaluate_function: AddmmBackward0", "backward", "main", 75, 15, layer="fc1", seq=11),
        op(8, "evaluate_function: torch::autograd::AccumulateGrad", "backward", "main", 90, 2, layer="fc1"),
    ]
    events = [
        [11, 0xA, 1000, 0],  # fc1's input to its backward (made by fc1, freed by its AddmmBackward)
        [12, 0xB, 400, 0],  # fc1's output, freed by relu: a temporary
        [21, 0xC, 400, 1],  # relu's output, saved by relu
        [22, 0xB, -400, 1],
        [30, 0xD, 200, 2],  # fc2's output, saved by the loss
        [41, 0xE, 8, 3],  # freed by AccumulateGrad, which has no sequence number
        [54, 0xD, -200, 4],
        [74, 0xC, -400, 6],
        [89, 0xA, -1000, 7],
        [91, 0xE, -8, 8],
    ]
    return trace(ops, step_end=100, memory_events=events, resident_bytes={"parameters": 5000})


def _by_bytes(saved):
    return {s.bytes: s for s in saved}


def test_a_tensor_waits_from_its_saving_op_to_its_freeing_op_by_their_sequence_numbers():
    saved = _by_bytes(analyse_liveness([_mlp_step()]).ranks[0].saved)
    assert set(saved) == {1000, 400, 200, 8}  # the temporary is no saved tensor
    fc1 = saved[1000]  # freed by seq 11: the forward op of the largest number not above it is fc1's
    assert (fc1.layer, fc1.saved_by.id, fc1.last_forward_use.id, fc1.first_backward_use.id) == (
        "fc1",
        0,
        0,
        7,
    )
    assert (fc1.last_forward_use_end_us, fc1.first_backward_use_start_us, fc1.inactive_us) == (20, 75, 55)
    act = saved[400]
    assert (act.layer, act.saved_by.id, act.inactive_us) == ("act", 1, 70 - 25)
    loss = saved[200]  # made by fc2, saved by the loss, outside any layer
    assert (loss.layer, loss.made_by.id, loss.saved_by.id, loss.inactive_us) == (None, 2, 3, 50 - 45)
    # no sequence number on the freeing op: the op that made it saved it; the backward run of fc1
    # (AddmmBackward0, AccumulateGrad) starts at 75
    seed = saved[8]
    assert (seed.saved_by.id, seed.last_forward_use.id, seed.first_backward_use.id) == (3, 3, 7)
    assert seed.inactive_us == 75 - 45


def _block_step():
    """A block of two forward ops (linear, gelu) and two backward ops, then a head; the head's op
    carries 4 us of profiler overhead, which the replay removes."""
    ops = [
        op(0, "aten::linear", "forward", "main", 0, 10, layer="block", seq=20),
        op(1, "aten::gelu", "forward", "main", 10, 10, layer="block", seq=22),
        op(2, "aten::linear", "forward", "main", 20, 10, layer="head", seq=23, overhead_us=4.0),
        op(3, "evaluate_function: AddmmBackward0", "backward", "main", 40, 10, layer="head", seq=24),
        op(4, "evaluate_function: GeluBackward0", "backward", "main", 50, 5, layer="block", seq=22),
        op(5, "evaluate_function: AddmmBackward0", "backward", "main", 55, 10, layer="block", seq=21),
    ]
    events = [
        [5, 0xA, 3000, 0],  # the block's input to its linear's backward
        [6, 0xB, 700, 0],  # made in the block, held by the head (its saver, by seq 24)
        [25, 0xC, 50, 2],  # the head's own
        [48, 0xB, -700, 3],
        [49, 0xC, -50, 3],
        [64, 0xA, -3000, 5],
    ]
    return trace(ops, step_end=70, memory_events=events)


def test_a_layer_waits_from_the_end_of_its_forward_run_to_the_start_of_its_backward_run_as_replayed():
    liveness = analyse_liveness([_block_step()])
    rank = liveness.ranks[0]
    assert rank.replayed[2] == (20, 26)  # the head's overhead gone: everything after it 4 us earlier
    saved = _by_bytes(rank.saved)
    block = saved[3000]
    assert (block.layer, block.last_forward_use.id, block.first_backward_use.id) == ("block", 1, 4)
    assert (block.last_forward_use_end_us, block.first_backward_use_start_us) == (20, 46)
    held = saved[700]
    assert (held.layer, held.made_by.id, held.saved_by.id, held.inactive_us) == ("head", 0, 2, 36 - 26)
    assert saved[50].inactive_us == 36 - 26
    assert rank.replayed_step_us[0] == 66


def test_the_curve_splits_by_kind_and_a_resident_free_comes_off_the_gradients_first():
    t = trace(
        [
            op(0, "aten::linear", "forward", "main", 10, 10, layer="fc"),
            op(1, "evaluate_function: AddmmBackward0", "backward", "main", 30, 10, layer="fc"),
            op(2, "aten::add_", "update", "main", 50, 10),
        ],
        step_end=80,
        memory_events=[
            [11, 0xA, 100, 0],  # saved for backward
            [15, 0xB, 30, 0],  # a temporary, born at the time of a resident free
            [15, 0x1, -300, 0],  # resident, freed: off the resident gradients (last step's)...
            [16, 0xB, -30, 0],
            [16, 0x2, -50, 0],  # ...and, once they are gone, off "other"
            [31, 0xC, 300, 1],  # a gradient, kept
            [35, 0xA, -100, 1],
            [51, 0xD, 600, 2],  # optimizer state, kept
        ],
        resident_bytes={"parameters": 1000, "buffers": 24, "gradients": 300, "other": 80},
    )
    (curve,) = analyse_liveness([t]).ranks[0].curves
    assert curve.times_us.tolist() == [0, 11, 15, 16, 31, 35, 51, 80]  # one point per time
    expected = {
        "parameters": [1024] * 8,
        "gradients": [300, 300, 0, 0, 300, 300, 300, 300],
        "optimizer_state": [0] * 6 + [600, 600],
        "activations": [0, 100, 100, 100, 100, 0, 0, 0],
        "temporaries": [0, 0, 30, 0, 0, 0, 0, 0],
        "other": [80, 80, 80, 30, 30, 30, 30, 30],
    }
    assert {kind: curve.by_kind[kind].tolist() for kind in KINDS} == expected
    assert curve.peak_bytes == predict_memory(t).peak_bytes == 1024 + 300 + 600 + 30
    assert curve.at(curve.peak_index)["optimizer_state"] == 600


def test_kernels_are_the_nested_events_on_cpu_and_the_launched_kernels_on_cuda():
    ops = [
        op(0, "aten::linear", "forward", "main", 10, 10, layer="fc"),
        op(1, "aten::relu", "forward", "main", 20, 2, layer="act"),
        op(2, "ampere_sgemm", "other", "cuda:7", 30, 8),
    ]
    events = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": f"{STEP_PREFIX}0",
            "pid": 9,
            "tid": 1,
            "ts": 0,
            "dur": 100,
        },
        {"ph": "X", "cat": "cpu_op", "name": "qsync::layer::fc", "pid": 9, "tid": 1, "ts": 9, "dur": 12},
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 9, "tid": 1, "ts": 10, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::t", "pid": 9, "tid": 1, "ts": 11, "dur": 2},
        {"ph": "X", "cat": "cpu_op", "name": "aten::transpose", "pid": 9, "tid": 1, "ts": 11.5, "dur": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": 9, "tid": 1, "ts": 14, "dur": 5},
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": 9,
            "tid": 1,
            "ts": 15,
            "dur": 3,
            "args": {"correlation": 77},
        },
        {"ph": "X", "cat": "cpu_op", "name": "aten::relu", "pid": 9, "tid": 1, "ts": 20, "dur": 2},
        {
            "ph": "X",
            "cat": "kernel",
            "name": "ampere_sgemm",
            "pid": 0,
            "tid": 7,
            "ts": 30,
            "dur": 8,
            "args": {"correlation": 77},
        },
    ]
    on_cpu = op_kernels(trace(ops, step_end=100), {"traceEvents": events})
    assert [(k.name, k.depth, k.self_us) for k in on_cpu[0]] == [
        ("aten::t", 1, 1.0),
        ("aten::transpose", 2, 1.0),
        ("aten::addmm", 1, 5.0),
    ]
    assert on_cpu[1] == []
    on_device = trace(ops, step_end=100)
    on_device.device = "cuda"
    on_cuda = op_kernels(on_device, {"traceEvents": events})
    assert [(k.name, k.start_us, k.dur_us, k.depth) for k in on_cuda[0]] == [("ampere_sgemm", 30.0, 8.0, 1)]
    assert on_cuda[1] == []
    assert [k.name for k in on_cuda[2]] == ["ampere_sgemm"]  # an op on a device stream is its own kernel
