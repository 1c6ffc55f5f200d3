"""Pricing Horovod's tensor fusion: hand-written two-rank traces whose answers are worked out by hand
(fused against separate, the threshold splitting, the cycle time delaying, a gradient group), the
recorded graph's responses, refusals. A real two-process run that records Horovod's timeline and
plans from it is in ``test_horovod_timeline.py``."""

import pytest

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.planner.tensor_fusion import choose_groups, choose_settings
from qsync_callback.predictor.graph import build_global_graph
from qsync_callback.predictor.predict import Predictor

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
