"""Pricing Horovod's tensor fusion: hand-written two-rank traces whose answers are worked out by hand
(fused against separate, the threshold splitting, the cycle time delaying, a gradient group), the
recorded graph's responses, refusals; and a real two-process run under ``horovodrun --gloo`` that
records Horovod's timeline, prices and tries a gradient-groups plan, writes the fusion settings
for the next launch, and on that launch says they are in effect."""

import json

import pytest

from qsync_callback.cli import main as qsync_main
from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.planner.tensor_fusion import choose_groups, choose_settings
from qsync_callback.predictor.graph import build_global_graph
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.trace import load_trace_dir

from tf_launch import EXAMPLE, run_horovod
from tracebuilder import op, trace

MIB = 2**20
RECORDED = {"library": "horovod", "fusion_threshold_bytes": MIB, "cycle_time_ms": 0.1}


def _tensor(name: str, nbytes: int, timeline: dict | None) -> dict:
    out = {
        "name": name,
        "variable": f"w/{name}:0",
        "shape": [nbytes // 4],
        "dtype": "float32",
        "bytes": nbytes,
    }
    return {**out, "timeline": timeline} if timeline else out


def _rank(rank: int, fused: bool = False) -> object:
    """One rank's step (microseconds): backward b1 0-100 launches a (1000 bytes), b2 100-300
    launches b (3000 bytes); the update at 580-620 waits for both. Rank 0 carries the timeline:
    a ran 160-260, b 370-570, each 10 us after its negotiation ended (or both 360-570, fused)."""
    a_span, b_span = ([360, 570], [360, 570]) if fused else ([160, 260], [370, 570])
    records = {
        "a": {"response": 0, "op_us": a_span, "negotiate_us": [100, a_span[0] - 10], "phases_us": {}},
        "b": {
            "response": 0 if fused else 1,
            "op_us": b_span,
            "negotiate_us": [300, b_span[0] - 10],
            "phases_us": {},
        },
    }

    def collective(name: str, nbytes: int) -> dict:
        tensors = [_tensor(name, nbytes, records[name] if rank == 0 else None)]
        return {"op": "all_reduce", "bytes": nbytes, "tensors": tensors}

    ops = [
        op(0, "gradient_tape/b1", "backward", "main", 0, 100),
        op(1, "gradient_tape/b2", "backward", "main", 100, 200),
        op(2, "Allreduce/cond/a", "comm", "comm:1", 100, 160, deps=[0], collective=collective("a", 1000)),
        op(3, "Allreduce/cond_1/b", "comm", "comm:1", 300, 270, deps=[1], collective=collective("b", 3000)),
        op(4, "SGD/update", "update", "main", 580, 40, deps=[2, 3]),
    ]
    return trace(ops, 620, rank=rank, world_size=2, host="h", communication=dict(RECORDED))


@pytest.fixture
def predictor():
    return Predictor([_rank(0), _rank(1)])


def _ms(predictor, **decisions) -> float:
    return predictor.predict(Plan(**decisions)).step_ms


def test_recorded_graph_has_one_node_per_response_with_its_parts():
    graph = build_global_graph([_rank(0), _rank(1)], 0)
    a, b = graph.nodes["comm/0"], graph.nodes["comm/1"]
    assert (a["dur"], a["gap"], b["dur"], b["gap"]) == (100, 60, 200, 70)
    assert a["parts"][0]["launch"] == ["r0/0", "r1/0"] and a["parts"][0]["consumers"] == ["r0/4", "r1/4"]
    assert [t["name"] for t in b["collective"]["tensors"]] == ["b"] and b["collective"]["bytes"] == 3000
    fused = build_global_graph([_rank(0, fused=True), _rank(1)], 0)
    (node,) = [n for n, attrs in fused.nodes(data=True) if attrs["kind"] == "comm"]
    assert fused.nodes[node]["dur"] == 210 and [p["key"] for p in fused.nodes[node]["parts"]] == ["a", "b"]


def test_cost_is_fitted_on_the_recorded_responses(predictor):
    cost = predictor.fusion_cost()
    assert (cost.alpha_us, cost.beta_us_per_byte, cost.delay_us) == pytest.approx((50, 0.05, 10))
    assert (cost.world_size, cost.responses) == (2, 2)


def test_recorded_settings_reproduce_the_recorded_step(predictor):
    assert predictor.predict().step_ms == pytest.approx(0.620)
    assert _ms(predictor, communication={"cycle_time_ms": 0.1}) == pytest.approx(0.620)


def test_fused_against_separate_and_the_threshold_split(predictor):
    """Cycle 0.5 ms: the first cycle comes at 350 us, both ready. Fused: one response of 4000 bytes,
    360-610 (50 + 0.05 * 4000), update 620-660. Separate: a 360-460, b 460-660, update 670-710."""
    slow_cycle = {"cycle_time_ms": 0.5}
    assert _ms(predictor, communication={**slow_cycle, "fusion_threshold_bytes": MIB}) == pytest.approx(0.660)
    assert _ms(predictor, communication={**slow_cycle, "fusion_threshold_bytes": 0}) == pytest.approx(0.710)
    assert _ms(predictor, communication={**slow_cycle, "fusion_threshold_bytes": 2000}) == pytest.approx(
        0.710
    )
    assert _ms(predictor, communication={**slow_cycle, "fusion_threshold_bytes": 4000}) == pytest.approx(
        0.660
    )


def test_a_group_launches_when_its_last_gradient_is_ready(predictor):
    """a and b in one group: ready at 300, the cycle at 350, fused 360-610, update 620-660."""
    assert _ms(predictor, buckets=[["w/a:0", "w/b:0"]]) == pytest.approx(0.660)
    assert _ms(predictor, buckets=[["a", "b"]]) == pytest.approx(0.660)  # Horovod's tensor names too
    with pytest.raises(QSyncInputError, match="bucket entry 'w/c:0' is not an all-reduced gradient"):
        predictor.predict(Plan(buckets=[["w/a:0", "w/c:0"]]))


def test_planners_pick_the_best_predicted(predictor):
    settings = choose_settings(predictor)
    assert settings.prediction.step_ms == min(c["step_ms"] for c in settings.candidates)
    assert settings.plan.prediction["step_ms"] == settings.prediction.step_ms
    groups = choose_groups(predictor)
    assert groups.plan.buckets == [["w/a:0", "w/b:0"]] and groups.prediction.step_ms == pytest.approx(0.660)


def test_fusion_plans_are_refused_on_traces_without_horovods_records():
    plain = [trace([op(0, "b", "backward", "main", 0, 10)], 20, rank=r, world_size=2) for r in (0, 1)]
    with pytest.raises(QSyncInputError, match="communication decisions cannot be priced: only Horovod"):
        Predictor(plain).predict(Plan(communication={"cycle_time_ms": 2.0}))
    no_timeline = [_rank(1), _rank(1)]
    no_timeline[0].rank = 0
    with pytest.raises(QSyncInputError, match="buckets decisions cannot be priced: .* no collective records"):
        Predictor(no_timeline).predict(Plan(buckets=[["w/a:0", "w/b:0"]]))


# ----------------------------------------------------------------------------- two processes


def test_two_processes_record_the_timeline_and_try_a_groups_plan(tmp_path, capsys):
    out = tmp_path / "qsync"
    window = ["--warmup-steps", "2", "--profile-steps", "2", "--measure-steps", "2", "--verify-steps", "3"]
    example = [str(EXAMPLE), "--mode", "apply", "--horovod-timeline", "--batch-size", "16"]
    run = run_horovod([*example, "--output-dir", str(out), *window])

    traces = load_trace_dir(out / "trace")
    assert sorted(p.name for p in (out / "trace" / "rank0" / "horovod_timeline").iterdir()) == [
        "step3.json",
        "step5.json",
    ]
    assert not (out / "trace" / "rank1" / "horovod_timeline").exists()  # only the coordinator writes
    variables = {"fc1/kernel:0", "fc1/bias:0", "fc2/kernel:0", "fc2/bias:0", "head/kernel:0", "head/bias:0"}
    for trace_ in traces:
        assert trace_.communication["fusion_threshold_bytes"] == 128 * MIB
        tensors = [t for o in trace_.ops if o.kind == "comm" for t in o.collective["tensors"]]
        assert {t["variable"] for t in tensors} == variables and all(t["bytes"] > 0 for t in tensors)
        assert all(("timeline" in t) == (trace_.rank == 0) for t in tensors)
    assert traces[0].communication["timeline"] == "horovod_timeline"

    verification = json.loads((out / "verification.json").read_text())
    groups = next(c for c in verification["candidates"] if c["name"] == "groups")
    assert groups["error"] is None and groups["all_ranks_step_ms"] > 0
    assert groups["prediction"]["step_ms"] > 0 and groups["evidence"]["grouped_tensors"]
    assert "qsync fusion:" in run.stdout
    plan_file = tmp_path / "groups.json"
    Plan.from_dict(groups["plan"]).save(plan_file)
    capsys.readouterr()
    assert qsync_main(["predict", str(out / "trace"), "--plan", str(plan_file), "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["step_ms"]
    assert predicted == pytest.approx(groups["prediction"]["step_ms"], rel=1e-6)

    # the next launch, with the plan's fusion threshold and cycle time in Horovod's environment
    plan = Plan.load(out / "plan.json")
    plan.communication = {"fusion_threshold_bytes": 16 * MIB, "cycle_time_ms": 2.0}
    plan.save(out / "plan.json")
    env = {"HOROVOD_FUSION_THRESHOLD": str(16 * MIB), "HOROVOD_CYCLE_TIME": "2"}
    window = ["--warmup-steps", "2", "--profile-steps", "1", "--measure-steps", "0"]
    run = run_horovod(
        [str(EXAMPLE), "--mode", "record", "--batch-size", "16", "--output-dir", str(out), *window], env
    )
    assert "fusion threshold and cycle time are in effect" in run.stdout
    recorded = load_trace_dir(out / "trace")[0].communication
    assert recorded["plan_in_effect"] and recorded["cycle_time_ms"] == 2.0
