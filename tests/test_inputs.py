"""Bad input: trace directories that are missing, truncated or not ours, traces with fields of the
wrong type or shape, rank traces of different runs, and bad plans.

Each gives one clear line naming the file (and the field), exit code 2 from the CLI and no
traceback."""

import json
import subprocess
import sys

import pytest

from qsync_callback.cli import main
from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.predictor.predict import predict
from qsync_callback.recorder.trace import Trace, check_rank_traces, load_trace_dir, rank_trace_path

from tracebuilder import op, trace


@pytest.fixture
def trace_dir(tmp_path):
    t = trace(
        [op(0, "aten::linear", "forward", "main", 0, 10, layer="fc")],
        step_end=12,
        layers=[{"name": "fc", "type": "Linear", "param_bytes": 4}],
        measured={"step_ms": [0.012, 0.013, 0.011], "peak_bytes": 100},
    )
    t.save(rank_trace_path(tmp_path, 0))
    return tmp_path


def _run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_report_on_a_good_trace(trace_dir, capsys):
    code, out, err = _run_cli(capsys, "report", str(trace_dir))
    assert code == 0 and "qsync report" in out and "predicted 0.01 ms" in out


def test_predict_json_on_a_good_trace(trace_dir, capsys):
    code, out, _ = _run_cli(capsys, "predict", str(trace_dir), "--json")
    assert code == 0
    assert json.loads(out)["step_ms"] == pytest.approx(0.012)


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda p: p.unlink(), "no rank*/trace.json inside"),
        (lambda p: p.write_text(p.read_text()[:40]), "invalid JSON at line 1"),
        (lambda p: p.write_text(""), "trace file is empty"),
        (lambda p: p.write_text('{"traceEvents": []}'), "not a qsync trace"),
        (
            lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "version": 99})),
            "trace version 99",
        ),
        (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "steps": []})), "no recorded steps"),
    ],
)
def test_damaged_trace_gives_one_line_and_exit_code_2(trace_dir, capsys, damage, expected):
    path = rank_trace_path(trace_dir, 0)
    damage(path)
    code, out, err = _run_cli(capsys, "report", str(trace_dir))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and expected in err and "Traceback" not in err


def test_missing_directory_and_missing_rank(tmp_path, trace_dir):
    with pytest.raises(QSyncInputError, match="no such trace directory"):
        load_trace_dir(tmp_path / "nope")
    data = json.loads(rank_trace_path(trace_dir, 0).read_text())
    data["world_size"] = 2
    rank_trace_path(trace_dir, 0).write_text(json.dumps(data))
    with pytest.raises(QSyncInputError, match=r"traces of ranks \[1\] are missing"):
        load_trace_dir(trace_dir)


def test_plan_for_other_layers_is_refused(trace_dir, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    Plan(precision={"not_a_layer": "fp16"}).save(plan_path)
    code, _, err = _run_cli(capsys, "predict", str(trace_dir), "--plan", str(plan_path))
    assert code == 2 and "not_a_layer" in err and str(plan_path) in err


def test_plan_decisions_not_priced_yet_are_refused_not_ignored(trace_dir):
    traces = load_trace_dir(trace_dir)
    with pytest.raises(QSyncInputError, match="names no op's module .* record it again"):
        predict(traces, Plan(fused_regions=[["fc"]]))
    with pytest.raises(QSyncInputError, match="offload cannot be priced: .* no fitted copy cost"):
        predict(traces, Plan(activation={"fc": "offload"}))
    with pytest.raises(QSyncInputError, match="no per-precision costs"):
        predict(traces, Plan(precision={"fc": "fp16"}))
    assert predict(traces, Plan.empty()).step_ms == pytest.approx(0.012)


def test_cli_entry_point_runs_as_a_command(trace_dir):
    result = subprocess.run(
        [sys.executable, "-m", "qsync_callback.cli", "report", str(trace_dir / "x")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("qsync: error: ") and "Traceback" not in result.stderr


def test_plan_for_another_run_is_refused(trace_dir):
    traces = load_trace_dir(trace_dir)
    traces[0].fingerprint = {"model": "abc", "world_size": 1}
    with pytest.raises(QSyncInputError, match="made for another run.*world_size: plan made for 2, run has 1"):
        predict(traces, Plan(fingerprint={"model": "abc", "world_size": 2}), plan_source="p.json")


def test_report_notes_page_fault_noise_only_when_there_is_some(trace_dir, capsys):
    code, out, _ = _run_cli(capsys, "report", str(trace_dir))
    assert code == 0 and "page faults" not in out
    path = rank_trace_path(trace_dir, 0)
    data = json.loads(path.read_text())
    data["measured"].update(page_faults=[2000, 2100, 1900], page_size=4096)
    path.write_text(json.dumps(data))
    code, out, _ = _run_cli(capsys, "report", str(trace_dir))
    assert code == 0 and "2000 page faults per step (7.8 MiB of fresh pages)" in out


def _full_trace(rank: int = 0, world_size: int = 1, fingerprint: dict | None = None) -> Trace:
    """A trace with every field the schema knows filled in, as the recorders write them."""
    timeline = {
        "response": 0,
        "op_us": [11.0, 12.0],
        "negotiate_us": [10.0, 11.0],
        "phases_us": {"GLOO_ALLREDUCE": [11.0, 12.0]},
    }
    collective = {
        "op": "all_reduce",
        "numel": 4,
        "bytes": 16,
        "dtype": "float32",
        "tensors": [
            {
                "name": "g0",
                "variable": "w:0",
                "shape": [4],
                "dtype": "float32",
                "bytes": 16,
                "timeline": timeline,
            }
        ],
    }
    probe = {"forward_us": 3.0, "backward_us": 5.0, "saved_bytes": 64.0, "forward_transient_bytes": 0.0}
    return trace(
        [
            op(
                0,
                "aten::linear",
                "forward",
                "main",
                0,
                10,
                layer="fc",
                seq=1,
                input_shapes=[[2, 4]],
                input_dtypes=["float"],
                bytes=32,
                overhead_us=0.5,
                gap_overhead_us=0.1,
            ),
            op(1, "allreduce", "comm", "comm:1", 10, 2, deps=[0], collective=collective),
        ],
        step_end=12,
        rank=rank,
        world_size=world_size,
        framework_version="2.13.0",
        host="node-1",
        clock_offset_us=1.5,
        memory_events=[[1.0, 4096, 32, 0], [9.0, 4096, -32, -1]],
        resident_bytes={"parameters": 16, "gradients": 16},
        saved_activation_bytes={"fc": 32},
        precision={"fc": "bf16"},
        precision_costs={
            "precisions": ["fp32", "bf16"],
            "device": "cpu",
            "probe_s": 0.1,
            "casts": {"fp32->bf16": {"alpha_us_per_element": 0.001, "beta_us": 1.0, "r2": 0.9}},
            "layers": {
                "fc": {
                    "input_shape": [2, 4],
                    "input_numel": 8,
                    "output_numel": 8,
                    "weight_numel": 16,
                    "costs": {"fp32": probe, "bf16": probe},
                }
            },
            "pass_through": {"act": {"input_shape": [2, 4], "input_numel": 8, "costs": {"fp32": probe}}},
            "op_types": {
                "ops": {"fc/MatMul": "MatMul"},
                "low_ops": ["fc/MatMul"],
                "edges": [["x", "fc/MatMul", 32]],
                "costs": {"MatMul": {"ops": 1, "measured_ops": 1, "fp32_us": 3.0, "bf16_us": 1.0}},
                "casts": {"fp32->bf16": {"us": 1.0, "bytes": 32, "casts": 1, "us_per_byte": 0.03}},
                "source": "rank 0",
            },
        },
        layer_statistics={"format": "qsync-layer-statistics", "version": 1, "layers": {}},
        layers=[{"name": "fc", "type": "Linear", "param_bytes": 16, "next": None}],
        measured={
            "step_ms": [0.012, 0.013],
            "peak_bytes": 100,
            "peak_source": "the allocator",
            "page_faults": [0, 1],
            "page_size": 4096,
            "recorder_overhead_s": 0.2,
        },
        profiler_overhead_us={"op": 0.4, "memory": 0.05, "range": 2.0},
        fingerprint=fingerprint if fingerprint is not None else {"model": "abc", "world_size": world_size},
        raw_trace="kineto.json",
        communication={
            "library": "horovod",
            "fusion_threshold_bytes": 1 << 20,
            "cycle_time_ms": 0.5,
            "from_env": [],
            "groups": None,
            "plan_in_effect": False,
            "timeline": None,
        },
    )


def test_a_trace_with_every_field_loads_as_saved(tmp_path):
    original = _full_trace()
    original.save(rank_trace_path(tmp_path, 0))
    (loaded,) = load_trace_dir(tmp_path)
    assert loaded.to_dict() == json.loads(json.dumps(original.to_dict()))


def _set(path: tuple, value):
    """Damage: put ``value`` at ``path`` in the trace's JSON."""

    def damage(data: dict) -> None:
        *parents, last = path
        for key in parents:
            data = data[key]
        data[last] = value

    return damage


def _drop(path: tuple):
    def damage(data: dict) -> None:
        *parents, last = path
        for key in parents:
            data = data[key]
        del data[last]

    return damage


@pytest.mark.parametrize(
    "damage, expected",
    [
        (_set(("layers",), [1, 2]), "layers[0] is 1; expected an object with name, type"),
        (_set(("memory_events", 0), [1.0, 4096]), "memory_events[0] is a list of 2; expected a list of 4"),
        (_set(("memory_events", 1, 2), "32"), 'memory_events[1][2] is "32"; expected an integer'),
        (_set(("measured", "step_ms", 1), "fast"), 'measured.step_ms[1] is "fast"; expected a finite number'),
        (
            _set(("measured", "peak_bytes"), "100"),
            'measured.peak_bytes is "100"; expected null or a finite number >= 0',
        ),
        (_set(("precision_costs", "layers"), "fc"), 'precision_costs.layers is "fc"; expected an object of'),
        (
            _set(("precision_costs", "layers", "fc", "costs", "bf16", "forward_us"), "3"),
            'precision_costs.layers.fc.costs.bf16.forward_us is "3"; expected a number',
        ),
        (_drop(("precision_costs", "layers", "fc", "input_numel")), "precision_costs.layers.fc is an object"),
        (
            _set(("precision_costs", "op_types", "edges", 0), ["x", "y"]),
            "precision_costs.op_types.edges[0] is a list of 2; expected [producer, consumer, bytes]",
        ),
        (_set(("precision", "fc"), "fp12"), 'precision.fc is "fp12"; expected one of fp32'),
        (
            _set(("resident_bytes", "parameters"), -1),
            "resident_bytes.parameters is -1; expected a finite number >= 0",
        ),
        (_set(("rank",), "0"), 'rank is "0"; expected an integer >= 0'),
        (_set(("world_size",), 0), "world_size is 0; expected an integer > 0"),
        (_set(("steps", 0, "index"), "0"), 'steps[0].index is "0"; expected an integer'),
        (_set(("steps", 0, "end_us"), 0), "steps[0] does not end after it starts"),
        (_set(("fingerprint",), ["abc"]), "fingerprint is a list of 1; expected an object"),
        (_set(("layer_statistics", "layers"), []), "layer_statistics: 'layers' must be an object"),
        (_set(("communication", "cycle_time_ms"), "0.5"), 'communication.cycle_time_ms is "0.5"; expected a'),
        (_set(("ops", 0, "dur_us"), "10"), 'ops[0].dur_us is "10"; expected a finite number >= 0'),
        (_set(("ops", 0, "dur_us"), -1), "ops[0].dur_us is -1; expected a finite number >= 0"),
        (_set(("ops", 0, "kind"), "fwd"), 'ops[0].kind is "fwd"; expected one of forward, backward'),
        (_set(("ops", 0, "deps"), 3), "ops[0].deps is 3; expected a list of an integer"),
        (_set(("ops", 0, "layer"), 7), "ops[0].layer is 7; expected null or a string"),
        (_set(("ops", 1), "op"), 'ops[1] is "op"; expected an object with id'),
        (_drop(("ops", 0, "name")), "ops[0] is an object; expected an object with id, name, kind"),
        (
            _set(("ops", 1, "collective", "tensors", 0, "timeline", "op_us"), [1]),
            "ops[1].collective.tensors[0]",
        ),
        (_set(("ops", 1, "step"), 5), "ops[1] (allreduce) belongs to unrecorded step 5"),
        (_set(("ops", 1, "deps"), [9]), "ops[1] (id 1) depends on unknown op 9"),
    ],
)
def test_a_field_of_the_wrong_type_or_shape_gives_one_line_and_exit_code_2(
    tmp_path, capsys, damage, expected
):
    _full_trace().save(rank_trace_path(tmp_path, 0))
    path = rank_trace_path(tmp_path, 0)
    data = json.loads(path.read_text())
    damage(data)
    path.write_text(json.dumps(data))
    for command in ("report", "predict", "plan"):
        code, out, err = _run_cli(capsys, command, str(tmp_path))
        assert code == 2 and out == "", (command, err)
        assert err.count("\n") == 1 and "Traceback" not in err
        assert err.startswith(f"qsync: error: {path}: ") and expected in err, err


def _save_ranks(trace_dir, *traces: Trace) -> None:
    for t in traces:
        t.save(rank_trace_path(trace_dir, t.rank))


@pytest.mark.parametrize(
    "ranks, expected",
    [
        (
            [_full_trace(0, 2), _full_trace(1, 2, fingerprint={"model": "other", "world_size": 2})],
            "the traces of ranks 0 and 1 are of different runs (their fingerprints differ in model)",
        ),
        (
            [_full_trace(0, 2), _full_trace(1, 3)],
            "ranks disagree on the world size (2, 3): traces of different runs?",
        ),
    ],
)
def test_rank_traces_of_different_runs_are_refused(tmp_path, capsys, ranks, expected):
    _save_ranks(tmp_path, *ranks)
    code, out, err = _run_cli(capsys, "report", str(tmp_path))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err == f"qsync: error: {tmp_path}: {expected}\n"


def test_a_rank_trace_in_another_ranks_folder_or_twice_is_refused(tmp_path):
    _full_trace(0, 2).save(rank_trace_path(tmp_path, 0))
    _full_trace(0, 2).save(rank_trace_path(tmp_path, 1))
    with pytest.raises(QSyncInputError, match=r"rank1/trace.json: holds the trace of rank 0$"):
        load_trace_dir(tmp_path)
    with pytest.raises(QSyncInputError, match="^gathered: more than one trace of rank 0"):
        check_rank_traces([_full_trace(0, 2), _full_trace(0, 2)], "gathered")
