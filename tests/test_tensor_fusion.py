"""Pricing Horovod's tensor fusion: hand-written two-rank traces whose answers are worked out by hand
(fused against separate, the threshold splitting, the cycle time delaying, a gradient group), the
recorded graph's responses, refusals. A real two-process run that records Horovod's timeline and
plans from it is in ``test_horovod_timeline.py``."""

import networkx as nx
import pytest

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.planner.tensor_fusion import choose_groups, choose_settings, group_candidates, next_launch
from qsync_callback.predictor.graph import build_global_graph
from qsync_callback.predictor.predict import Predictor
from qsync_callback.predictor.tensor_fusion import (
    ALL_REDUCE,
    apply_fusion,
    can_price_fusion,
    fit_allreduce_cost,
)

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


def _responses(*responses: tuple[int, float, float | None]) -> nx.DiGraph:
    """A graph of recorded all-reduce responses, each (bytes, duration us, negotiation-to-op delay us
    or None): one comm node per response, one tensor each, with its timeline record."""
    graph = nx.DiGraph()
    for i, (nbytes, dur, delay) in enumerate(responses):
        record = {"op_us": [100.0 + (delay or 0.0), 200.0]}
        if delay is not None:
            record["negotiate_us"] = [0.0, 100.0]
        tensor = {"name": f"g{i}", "bytes": nbytes, "timeline": record}
        graph.add_node(
            f"r{i}",
            kind="comm",
            dur=dur,
            parts=[{"tensors": [tensor]}],
            collective={"op": ALL_REDUCE},
        )
    return graph


def test_the_fit_falls_back_on_what_the_responses_allow():
    # two sizes on a line: alpha and beta as recorded; the delay is the median of the recorded ones
    line = fit_allreduce_cost([_responses((1000, 60.0, 4.0), (3000, 80.0, 8.0), (2000, 70.0, None))], 2)
    assert (line.alpha_us, line.beta_us_per_byte, line.delay_us) == pytest.approx((50.0, 0.01, 6.0))
    assert (line.world_size, line.responses) == (2, 3)
    assert line.us(500) == pytest.approx(55.0) and line.to_dict()["responses"] == 3
    # bigger responses faster: no slope, the mean duration
    falling = fit_allreduce_cost([_responses((1000, 90.0, None), (3000, 70.0, None))], 2)
    assert (falling.alpha_us, falling.beta_us_per_byte, falling.delay_us) == pytest.approx((80.0, 0.0, 0.0))
    # a line through a negative intercept: through the origin instead, least squares
    steep = fit_allreduce_cost([_responses((1000, 10.0, None), (3000, 50.0, None))], 2)
    assert steep.alpha_us == 0.0
    assert steep.beta_us_per_byte == pytest.approx((1000 * 10 + 3000 * 50) / (1000**2 + 3000**2))
    # one size: bytes over time through the origin; a negative delay counts as none
    one = fit_allreduce_cost([_responses((2000, 40.0, -5.0), (2000, 60.0, -5.0))], 2)
    assert (one.alpha_us, one.beta_us_per_byte, one.delay_us) == pytest.approx((0.0, 0.025, 0.0))
    # a response without timeline records is left out; none left: refused, saying why
    bare = _responses((1000, 60.0, None))
    bare.nodes["r0"]["parts"][0]["tensors"][0]["timeline"] = None
    with pytest.raises(QSyncInputError, match="^no recorded Horovod response to fit the all-reduce cost on$"):
        fit_allreduce_cost([bare], 2)


def test_ddps_fit_takes_alpha_from_the_timings_alone_and_the_higher_beta():
    """DDP's buckets have no timeline: every recorded bucket counts; with all-reduces timed alone,
    alpha and beta are theirs (the ranks averaged), beta raised to the recorded buckets' where
    those cost more per byte beside backward."""
    recorded = _responses((1000, 160.0, None), (3000, 360.0, None))
    for node in recorded.nodes:
        recorded.nodes[node]["parts"][0]["tensors"][0]["timeline"] = None
    plain = fit_allreduce_cost([recorded], 2, "ddp")
    assert (plain.alpha_us, plain.beta_us_per_byte, plain.delay_us, plain.responses) == pytest.approx(
        (60.0, 0.1, 0.0, 2)
    )
    ranks = [{"bytes": [0, 1000], "us": [50.0, 60.0]}, {"bytes": [0, 1000], "us": [70.0, 80.0]}]
    beside = fit_allreduce_cost([recorded], 2, "ddp", ranks)
    # alpha 60 (the ranks' mean line: 60 + 0.01 b); the recorded cost (y - 60) . x / x . x = 0.1 per byte
    assert (beside.alpha_us, beside.beta_us_per_byte, beside.delay_us, beside.responses) == pytest.approx(
        (60.0, 0.1, 0.0, 2)
    )
    alone = fit_allreduce_cost([recorded], 2, "ddp", [{"bytes": [0, 1000], "us": [10.0, 1010.0]}])
    assert (alone.alpha_us, alone.beta_us_per_byte) == pytest.approx((10.0, 1.0))  # alone costs more
    falling = fit_allreduce_cost([recorded], 2, "ddp", [{"bytes": [0, 1000], "us": [90.0, 50.0]}])
    assert falling.alpha_us == pytest.approx(70.0)  # no slope alone: their mean, beta the recorded
    assert falling.beta_us_per_byte == pytest.approx((90 * 1000 + 290 * 3000) / (1000**2 + 3000**2))
    with pytest.raises(
        QSyncInputError, match="^no recorded bucket all-reduce to fit the all-reduce cost on$"
    ):
        fit_allreduce_cost([_responses()], 2, "ddp")


def test_a_regrouped_response_is_a_whole_comm_node_of_its_tensors(predictor):
    graph = build_global_graph([_rank(0), _rank(1)], 0)
    cost = predictor.fusion_cost()
    fused = apply_fusion(graph, cost, threshold_bytes=1 << 20, cycle_ms=1.0)  # both ready in one cycle
    (node,) = [n for n, attrs in fused.nodes(data=True) if attrs["kind"] == "comm"]
    attrs = fused.nodes[node]
    tensors = [
        {"name": "a", "variable": "w/a:0", "bytes": 1000, "dtype": "float32"},
        {"name": "b", "variable": "w/b:0", "bytes": 3000, "dtype": "float32"},
    ]
    assert node == "comm/fused0" and attrs["name"] == "fused all-reduce 0 (2 tensors)"
    assert (attrs["queue"], attrs["bytes"], attrs["rank"], attrs["layer"], attrs["op_id"]) == (
        "comm",
        4000,
        None,
        None,
        None,
    )
    assert attrs["dur"] == pytest.approx(cost.us(4000))
    assert attrs["collective"] == {"op": ALL_REDUCE, "bytes": 4000, "tensors": tensors}
    (part,) = attrs["parts"]
    assert part == {
        "key": node,
        "tensors": tensors,
        "launch": ["r0/0", "r0/1", "r1/0", "r1/1"],
        "consumers": ["r0/4", "r1/4"],
    }
    assert {(u, fused.edges[u, node]["kind"]) for u in fused.predecessors(node)} == {
        (n, "dep") for n in part["launch"]
    }
    assert {(v, fused.edges[node, v]["kind"]) for v in fused.successors(node)} == {
        (n, "dep") for n in part["consumers"]
    }
    # a threshold below the pair: two responses in order of readiness, the second after the first
    split = apply_fusion(graph, cost, threshold_bytes=2000, cycle_ms=1.0)
    names = sorted(n for n, attrs in split.nodes(data=True) if attrs["kind"] == "comm")
    assert names == ["comm/fused0", "comm/fused1"]
    assert [t["name"] for t in split.nodes["comm/fused0"]["collective"]["tensors"]] == ["a"]
    assert split.edges["comm/fused0", "comm/fused1"]["kind"] == "order"
    # no cycle time: each gradient goes out as soon as it is ready, alone
    eager = apply_fusion(graph, cost, threshold_bytes=1 << 20, cycle_ms=0.0)
    comms = sorted(n for n, attrs in eager.nodes(data=True) if attrs["kind"] == "comm")
    assert [[t["name"] for t in eager.nodes[n]["collective"]["tensors"]] for n in comms] == [["a"], ["b"]]


def _layers_step(rank: int, variables: bool = True) -> object:
    """Five gradients ready one after another (backward ops 0-100, 100-200, ...), each all-reduced
    alone: l1's kernel (1000 bytes) and bias (100), l2's kernel (2000) and bias (100), l3's kernel
    (800); the update waits for all."""
    sizes = [
        ("l1/kernel:0", 1000),
        ("l1/bias:0", 100),
        ("l2/kernel:0", 2000),
        ("l2/bias:0", 100),
        ("l3/kernel:0", 800),
    ]
    ops = []
    for i, (variable, nbytes) in enumerate(sizes):
        tensor = {"name": f"g{i}", "variable": variable if variables or i else None, "shape": [nbytes // 4]}
        tensor.update(dtype="float32", bytes=nbytes)
        ops.append(op(2 * i, f"gradient_tape/b{i}", "backward", "main", 100 * i, 100))
        collective = {"op": "all_reduce", "bytes": nbytes, "tensors": [tensor]}
        ops.append(
            op(
                2 * i + 1,
                f"Allreduce/{i}",
                "comm",
                "comm:1",
                100 * i + 100,
                50,
                deps=[2 * i],
                collective=collective,
            )
        )
    ops.append(op(10, "SGD/update", "update", "main", 800, 40, deps=[2 * i + 1 for i in range(5)]))
    return trace(ops, 840, rank=rank, world_size=2, host="h", communication=dict(RECORDED))


def test_gradient_groupings_are_one_group_per_layer_and_balanced_by_bytes_in_order_of_readiness():
    kernels_and_biases = Predictor([_layers_step(0), _layers_step(1)])
    names = ["l1/kernel:0", "l1/bias:0", "l2/kernel:0", "l2/bias:0", "l3/kernel:0"]
    assert (
        group_candidates(kernels_and_biases)
        == [
            [names],
            [names[:2], names[2:4], names[4:]],
            [names[:3], names[3:]],  # 2 groups: a new one once 2000 of the 4000 bytes are in
            [names[:3], names[3:4], names[4:]],  # 3 groups: at 1333 and 2667 bytes
        ]
    )
    # a gradient without a variable: tensor names, and no grouping by layer
    unnamed = group_candidates(
        Predictor([_layers_step(0, variables=False), _layers_step(1, variables=False)])
    )
    tensors = [f"g{i}" for i in range(5)]
    assert unnamed == [[tensors], [tensors[:3], tensors[3:]], [tensors[:3], tensors[3:4], tensors[4:]]]


def test_what_fusion_pricing_needs_is_named_when_missing():
    both = [_rank(0), _rank(1)]
    assert can_price_fusion(both) is None
    assert can_price_fusion([_rank(0)]) == "a single process all-reduces nothing"
    # the settings are read from the first rank's trace
    foreign = [_rank(0), _rank(1)]
    foreign[0].communication = {}
    assert can_price_fusion(foreign) == (
        "only Horovod's tensor fusion and DDP's buckets can be priced (the traces record neither "
        "Horovod's settings nor DDP's buckets)"
    )
    no_timeline = [_rank(1), _rank(1)]
    assert can_price_fusion(no_timeline) == "the traces have no collective records from Horovod's timeline"
    sizeless = [_rank(0), _rank(1)]
    for op_ in sizeless[1].ops:
        if op_.collective:
            op_.collective["tensors"][0]["bytes"] = None
    assert can_price_fusion(sizeless) == "some all-reduced tensors have no known size"
    # an op with a collective that is not a comm op carries no all-reduced tensor
    plain = [_rank(0), _rank(1)]
    for op_ in plain[0].ops + plain[1].ops:
        if op_.collective:
            op_.kind = "backward"
    assert can_price_fusion(plain) == "the traces have no collective records from Horovod's timeline"


def test_the_next_launch_says_the_settings_as_flags_and_as_environment():
    assert next_launch({"fusion_threshold_bytes": 16 * 2**20, "cycle_time_ms": 0.5}) == (
        "horovodrun --fusion-threshold-mb 16 --cycle-time-ms 0.5 ...   "
        "(or HOROVOD_FUSION_THRESHOLD=16777216 HOROVOD_CYCLE_TIME=0.5)"
    )
    # a threshold that is no whole number of MiB has no flag; the environment says it
    assert next_launch({"fusion_threshold_bytes": 3 * 2**19}) == (
        "horovodrun  ...   (or HOROVOD_FUSION_THRESHOLD=1572864)"
    )
    assert (
        next_launch({"cycle_time_ms": 5.0}) == "horovodrun --cycle-time-ms 5 ...   (or HOROVOD_CYCLE_TIME=5)"
    )
