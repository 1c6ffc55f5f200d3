"""Pricing Horovod's tensor fusion and DDP's buckets: hand-written two-rank traces whose answers are
worked out by hand (fused against separate, the threshold splitting, the cycle time delaying, a
gradient group; DDP's buckets in bucket order, their waiters after backward, the all-reduce time
beside backward charged on a CPU), the recorded graph's responses, refusals. Real two-process runs
are in ``test_horovod_timeline.py`` (Horovod's timeline) and ``test_ddp_buckets.py`` (DDP)."""

import re
import warnings

import networkx as nx
import pytest

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.planner.tensor_fusion import choose_groups, choose_settings, group_candidates, next_launch
from qsync_callback.predictor.graph import build_global_graph
from qsync_callback.predictor.predict import Predictor
from qsync_callback.predictor.replay import replay
from qsync_callback.predictor.tensor_fusion import (
    ALL_REDUCE,
    CYCLE_PHASES,
    MIDDLE_PHASE,
    AllreduceCost,
    all_reduces,
    apply_fusion,
    can_price_fusion,
    check_buckets,
    collective_tensors,
    fit_allreduce_cost,
    fusion_correction_us,
    loop_phases,
    regroup,
    shared_core_us,
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
    """Cycle 0.5 ms, priced at the loop's four phases (its first tick 0, 125, 250 and 375 us after a
    is ready at 100; b is ready at 300), each with the recorded settings' correction at that phase.
    Tick at 100 or 225: a alone (110-210, 235-335), b at the next tick (600, 725: 610-810, 735-935),
    update 820-860 and 945-985, fused or not. Tick at 350 or 475, both ready: fused, one response of
    4000 bytes (50 + 0.05 * 4000 = 250 us): 360-610 and 485-735, update 620-660 and 745-785;
    separate, a then b: update 670-710 and 795-835. The recorded settings (cycle 0.1 ms) replay to
    570, 595, 620 and 645 at the four phases against the recorded 620: corrections +50, +25, 0, -25.
    Fused: (860 + 985 + 660 + 785 + 50) / 4 = 835; separate: (860 + 985 + 710 + 835 + 50) / 4 = 860."""
    slow_cycle = {"cycle_time_ms": 0.5}
    assert _ms(predictor, communication={**slow_cycle, "fusion_threshold_bytes": MIB}) == pytest.approx(0.835)
    assert _ms(predictor, communication={**slow_cycle, "fusion_threshold_bytes": 0}) == pytest.approx(0.860)
    assert _ms(predictor, communication={**slow_cycle, "fusion_threshold_bytes": 2000}) == pytest.approx(
        0.860
    )
    assert _ms(predictor, communication={**slow_cycle, "fusion_threshold_bytes": 4000}) == pytest.approx(
        0.835
    )
    # at the middle phase alone (the loop's model, `apply_fusion`), the figures the tick at 350 gives
    cost = predictor.fusion_cost()
    graph = predictor.graphs[0]
    assert replay(apply_fusion(graph, cost, MIB, 0.5)).step_us == pytest.approx(660)
    assert replay(apply_fusion(graph, cost, 0, 0.5)).step_us == pytest.approx(710)
    assert replay(apply_fusion(graph, cost, MIB, 0.5, phase=0.25)).step_us == pytest.approx(985)


def test_every_plan_on_two_horovod_ranks_is_priced_through_the_loop():
    """Both backward ops are MatMuls, 0.8x at bf16: b1 0-80, b2 80-240, so a is ready at 80 and b at
    240. Through the loop (cycle 0.1 ms, first tick 80, 105, 130 or 155): a 90-190, 115-215,
    140-240 or 165-265; b at the tick at or after 240 (300, 325, 250, 275) for 200 us; the update
    40 us from 10 us after it: 550, 575, 500, 525, with the corrections (+50, +25, 0, -25) 600, 600,
    500, 500: 550 on average. The plan is priced so whether or not it spells out the recorded
    settings; on the recorded responses' spans (a's 60 us after it is ready and b's 70, whatever the
    ticks) it was 560 without them and 500 with them."""
    costs = {"MatMul": {"ops": 2, "measured_ops": 2, "fp32_us": 100.0, "bf16_us": 80.0}}
    casts = {"fp32->bf16": {"us_per_byte": 0.01}, "bf16->fp32": {"us_per_byte": 0.02}}  # none made: no edges
    types = {"gradient_tape/b1": "MatMul", "gradient_tape/b2": "MatMul"}
    table = {"ops": types, "edges": [], "costs": costs, "casts": casts}
    ranks = [_rank(0), _rank(1)]
    for rank_trace in ranks:
        rank_trace.precision_costs = {"op_types": table}
    predictor = Predictor(ranks)
    assert _ms(predictor, op_precision={"MatMul": "bf16"}) == pytest.approx(0.550)
    assert _ms(predictor, op_precision={"MatMul": "bf16"}, communication={"cycle_time_ms": 0.1}) == (
        pytest.approx(0.550)
    )
    assert _ms(predictor) == pytest.approx(0.620)  # the recorded configuration: its replay


def test_the_loop_is_priced_at_its_phases_only_where_it_ticks():
    assert loop_phases({"library": "horovod", "cycle_time_ms": 1.0}) == CYCLE_PHASES
    assert MIDDLE_PHASE in CYCLE_PHASES  # the graph a plan's figures come from is the middle one's
    assert loop_phases({"library": "horovod", "cycle_time_ms": 0.0}) == (MIDDLE_PHASE,)
    assert loop_phases({"library": "horovod"}) == (MIDDLE_PHASE,)
    assert loop_phases({"library": "ddp", "cycle_time_ms": 1.0}) == (MIDDLE_PHASE,)


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
    # Timings a CI machine recorded, the smallest slowed by a busy core: in absolute error the
    # 16 MiB point sets the line and alpha fell below 0 (every split looked free); in relative
    # error each size counts alike and alpha is the latency the small sizes show.
    noisy = {
        "bytes": [4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20],
        "us": [665.6, 376.6, 810.7, 2473.9, 14420.7],
    }
    relative = fit_allreduce_cost([recorded], 2, "ddp", [noisy])
    assert 300.0 < relative.alpha_us < 400.0
    assert relative.beta_us_per_byte == pytest.approx(5.46e-4, rel=0.01)


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
    assert all_reduces(build_global_graph(plain, 0)) == []  # nor is it an all-reduce of the step graph


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


def test_the_fit_leaves_out_responses_without_records_and_keeps_small_figures():
    # a response without timeline records before one with them: the fit is on the second alone
    mixed = _responses((1000, 60.0, None), (3000, 80.0, 4.0))
    mixed.nodes["r0"]["parts"][0]["tensors"][0]["timeline"] = None
    fitted = fit_allreduce_cost([mixed], 2)
    assert (fitted.alpha_us, fitted.beta_us_per_byte, fitted.delay_us, fitted.responses) == pytest.approx(
        (0.0, 80.0 / 3000, 4.0, 1)
    )
    # an intercept under a microsecond is kept, not fitted through the origin
    small = fit_allreduce_cost([_responses((1000, 10.5, None), (3000, 30.5, None))], 2)
    assert (small.alpha_us, small.beta_us_per_byte) == pytest.approx((0.5, 0.01))
    # one size of one byte: its duration per byte
    assert fit_allreduce_cost([_responses((1, 40.0, None))], 2).beta_us_per_byte == pytest.approx(40.0)


def _buckets_of(*responses: tuple[list[int | None], float]) -> nx.DiGraph:
    """Recorded DDP buckets, each (its gradients' bytes, duration us): no timeline records."""
    graph = _responses(*((0, dur, None) for _, dur in responses))
    for i, (sizes, _) in enumerate(responses):
        tensors = [{"name": f"p{i}.{j}", "bytes": nbytes, "timeline": None} for j, nbytes in enumerate(sizes)]
        graph.nodes[f"r{i}"]["parts"][0]["tensors"] = tensors
    return graph


def test_ddps_fit_counts_a_gradient_of_unknown_size_as_no_bytes():
    # one bucket of 1000 known bytes and a gradient of unknown size: 0.1 us per byte, no alpha
    one = fit_allreduce_cost([_buckets_of(([1000, None], 100.0))], 2, "ddp")
    assert (one.alpha_us, one.beta_us_per_byte, one.delay_us, one.world_size) == pytest.approx(
        (0.0, 0.1, 0.0, 2)
    )
    # buckets of no known bytes: the timings alone give alpha and beta, with no division by nothing
    alone = [{"bytes": [0, 1000], "us": [10.0, 20.0]}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sizeless = fit_allreduce_cost([_buckets_of(([None], 60.0), ([None, None], 80.0))], 4, "ddp", alone)
    assert (sizeless.alpha_us, sizeless.beta_us_per_byte, sizeless.delay_us) == pytest.approx(
        (10.0, 0.01, 0.0)
    )
    assert (sizeless.world_size, sizeless.responses) == (4, 2)
    # a bucket of one byte that took 60 us beside backward: 50 us more than alone, per byte
    tiny = fit_allreduce_cost([_buckets_of(([1], 60.0))], 2, "ddp", alone)
    assert (tiny.alpha_us, tiny.beta_us_per_byte) == pytest.approx((10.0, 50.0))


# DDP's buckets on a hand-written two-rank step (microseconds, the same on both ranks):
#   backward of fc2 0-50 and its AccumulateGrad 50-60; backward of fc1 60-140 and its AccumulateGrad
#   140-150, which waits for bucket 0 (the training thread stalled beside it, inside backward);
#   bucket 0 (fc2.weight 400 bytes, fc2.bias 100, scale 100: a parameter of no recorded layer)
#   all-reduced 50-110 on comm:1, launched by fc2's backward op; bucket 1 (fc1.weight 800, fc1.bias
#   100) 150-250 on comm:2, launched by fc1's AccumulateGrad; the optimizer 260-300 waits for both.
#   A buffer broadcast (no bucket) runs 0-10 on comm:0. Op ids: backward 0-3, buckets 4 and 5,
#   optimizer 6, broadcast 7.
# With `BUCKET_COST` (50 + 0.1 us per byte) bucket 0 costs 110, bucket 1 140, both in one 200.

DDP_BUCKETS = [["fc2.weight", "fc2.bias", "scale"], ["fc1.weight", "fc1.bias"]]
GRADIENTS = {
    "fc2.weight": (400, "fc2"),
    "fc2.bias": (100, "fc2"),
    "scale": (100, None),
    "fc1.weight": (800, "fc1"),
    "fc1.bias": (100, "fc1"),
}
BUCKET_COST = AllreduceCost(50.0, 0.1, 0.0, 2, 2)
DDP = {"library": "ddp"}


def _gradient(name: str) -> dict:
    nbytes, layer = GRADIENTS[name]
    return {"name": name, "variable": name, "bytes": nbytes, "dtype": "float32", "layer": layer}


def _ddp_rank(rank: int) -> object:
    def bucket(k: int) -> dict:
        tensors = [_gradient(n) for n in DDP_BUCKETS[k]]
        nbytes = sum(t["bytes"] for t in tensors)
        return {"op": "all_reduce", "numel": nbytes // 4, "bytes": nbytes, "tensors": tensors}

    ops = [
        op(0, "fc2_backward", "backward", "main", 0, 50, layer="fc2"),
        op(1, "AccumulateGrad", "backward", "main", 50, 10, layer="fc2"),
        op(2, "fc1_backward", "backward", "main", 60, 80, layer="fc1"),
        op(3, "AccumulateGrad", "backward", "main", 140, 10, layer="fc1", deps=[4]),
        op(4, "gloo:all_reduce", "comm", "comm:1", 50, 60, deps=[0], collective=bucket(0)),
        op(5, "gloo:all_reduce", "comm", "comm:2", 150, 100, deps=[3], collective=bucket(1)),
        op(6, "Optimizer.step", "update", "main", 260, 40, deps=[4, 5]),
        op(7, "gloo:broadcast", "comm", "comm:0", 0, 10, collective={"op": "broadcast", "bytes": 16}),
    ]
    communication = {
        "library": "ddp",
        "buckets": [[_gradient(n) for n in b] for b in DDP_BUCKETS],
        "allreduce_us": {"bytes": [0, 1000], "us": [50.0, 150.0]},  # 50 + 0.1 us per byte alone
    }
    return trace(ops, 300, rank=rank, world_size=2, host="h", communication=communication)


def _ddp_ranks() -> list:
    return [_ddp_rank(0), _ddp_rank(1)]


def _ddp_graph(ranks: list | None = None) -> nx.DiGraph:
    return build_global_graph(ranks or _ddp_ranks(), 0)


def _op(rank_trace, op_id: int):
    return next(o for o in rank_trace.ops if o.id == op_id)


def _buckets(graph: nx.DiGraph) -> list[tuple[str, float, float, list[str], list[str], list[str]]]:
    """Each all-reduce of ``graph`` as replayed: node, start, end, tensors, launch, consumers."""
    timing = replay(graph)
    return [
        (
            n,
            timing.start[n],
            timing.end[n],
            [t["name"] for t in graph.nodes[n]["collective"]["tensors"]],
            graph.nodes[n]["parts"][0]["launch"],
            graph.nodes[n]["parts"][0]["consumers"],
        )
        for n in sorted(all_reduces(graph))
    ]


def test_a_ddp_gradient_is_ready_when_the_last_backward_op_of_its_layer_ended_on_every_rank():
    """fc2's gradients wait for its AccumulateGrad (ends 60), not for the op that launched their
    bucket (50); scale, of no recorded layer, for its bucket's launch (50); fc1's for its
    AccumulateGrad (150)."""
    graph = _ddp_graph()
    assert replay(graph).step_us == pytest.approx(300)
    ready = [(t.name, t.launch, t.bytes) for t in collective_tensors(graph, replay(graph).end)]
    assert ready == [
        ("scale", ("r0/0", "r1/0"), 100),
        ("fc2.weight", ("r0/1", "r1/1"), 400),
        ("fc2.bias", ("r0/1", "r1/1"), 100),
        ("fc1.weight", ("r0/3", "r1/3"), 800),
        ("fc1.bias", ("r0/3", "r1/3"), 100),
    ]
    # a layer that rank 1 did not record: its gradients are ready when their bucket was launched;
    # a gradient of unknown size counts no bytes
    ranks = _ddp_ranks()
    _op(ranks[1], 0).layer = _op(ranks[1], 1).layer = None
    for rank_trace in ranks:
        _op(rank_trace, 4).collective["tensors"][2]["bytes"] = None
    graph = _ddp_graph(ranks)
    partial = {t.name: (t.launch, t.bytes) for t in collective_tensors(graph, replay(graph).end)}
    assert partial["fc2.weight"] == (("r0/0", "r1/0"), 400) and partial["scale"] == (("r0/0", "r1/0"), 0)
    assert partial["fc1.bias"] == (("r0/3", "r1/3"), 100)


def test_ddp_buckets_go_one_after_the_other_in_bucket_order_each_once_its_gradients_are_ready():
    """A bucket starts once its last gradient is ready and the bucket before it is done. The
    recorded buckets: 0 at 60-170 (fc2's AccumulateGrad ends at 60), 1 at 170-310, the optimizer
    320-360 (its 10 us gap kept). scale alone first: 50-110, then fc2's 110-210, fc1's 210-350."""
    graph = _ddp_graph()
    recorded = regroup(graph, BUCKET_COST, DDP, DDP_BUCKETS)
    after = ["r0/6", "r1/6"]
    fc2, fc1 = ["r0/0", "r0/1", "r1/0", "r1/1"], ["r0/3", "r1/3"]
    assert _buckets(recorded) == [
        ("comm/fused0", 60, 170, DDP_BUCKETS[0], fc2, after),
        ("comm/fused1", 170, 310, DDP_BUCKETS[1], fc1, after),
    ]
    assert replay(recorded).step_us == pytest.approx(360)
    assert (
        recorded.nodes["comm/fused1"]["dur"] == pytest.approx(140)
        and recorded.nodes["comm/fused1"]["gap"] == 0
    )
    assert recorded.edges["comm/fused0", "comm/fused1"]["kind"] == "order"
    assert recorded.nodes["comm/0"]["name"] == "gloo:broadcast"  # not an all-reduce: left as it was
    # no plan: the recorded buckets
    assert _buckets(regroup(graph, BUCKET_COST, DDP)) == _buckets(recorded)
    scale_first = regroup(graph, BUCKET_COST, DDP, [["scale"], ["fc2.weight", "fc2.bias"], DDP_BUCKETS[1]])
    assert _buckets(scale_first) == [
        ("comm/fused0", 50, 110, ["scale"], ["r0/0", "r1/0"], after),
        ("comm/fused1", 110, 210, ["fc2.weight", "fc2.bias"], ["r0/1", "r1/1"], after),
        ("comm/fused2", 210, 350, DDP_BUCKETS[1], fc1, after),
    ]
    assert replay(scale_first).step_us == pytest.approx(400)
    # in bucket order, not in order of readiness: fc1's first (150-290), then fc2's (290-400)
    reversed_ = regroup(graph, BUCKET_COST, DDP, DDP_BUCKETS[::-1])
    assert [(n, start, end) for n, start, end, *_ in _buckets(reversed_)] == [
        ("comm/fused0", 150, 290),
        ("comm/fused1", 290, 400),
    ]
    assert replay(reversed_).step_us == pytest.approx(450)
    one = regroup(graph, BUCKET_COST, DDP, [[n for b in DDP_BUCKETS for n in b]])
    assert [(n, start, end) for n, start, end, *_ in _buckets(one)] == [("comm/fused0", 150, 350)]


def test_ddp_buckets_are_waited_for_after_backward_not_by_a_stall_inside_it():
    """fc1's AccumulateGrad waited for bucket 0 in the recording (a stall beside the all-reduce on a
    shared core): no new bucket is waited for there, every one by the optimizer. Where every
    recorded waiter is inside backward, those are the waiters, each for the buckets launched
    before it."""
    recorded = regroup(_ddp_graph(), BUCKET_COST, DDP, DDP_BUCKETS)
    assert set(recorded.predecessors("r0/3")) == {"r0/2"}
    assert set(recorded.successors("comm/fused0")) == {"comm/fused1", "r0/6", "r1/6"}
    # the optimizer waits for no bucket: the stalled AccumulateGrad waits for bucket 0 (60-170, so
    # it runs 170-180), bucket 1 (launched by it) for nothing (180-320)
    ranks = _ddp_ranks()
    for rank_trace in ranks:
        _op(rank_trace, 6).deps = []
    inside = regroup(_ddp_graph(ranks), BUCKET_COST, DDP, DDP_BUCKETS)
    fc2, fc1 = ["r0/0", "r0/1", "r1/0", "r1/1"], ["r0/3", "r1/3"]
    assert _buckets(inside) == [
        ("comm/fused0", 60, 170, DDP_BUCKETS[0], fc2, ["r0/3", "r1/3"]),
        ("comm/fused1", 180, 320, DDP_BUCKETS[1], fc1, []),
    ]


def test_on_a_cpu_the_all_reduce_time_beside_backward_is_charged_to_the_step():
    """Backward ends at 150. The recorded buckets: bucket 0 runs 60-170, 90 us of it beside
    backward; bucket 1 none. scale first: 60 + 40 us. One bucket, or fc1's first: none."""
    graph = _ddp_graph()
    plans = {
        "recorded": (DDP_BUCKETS, 90.0),
        "scale first": ([["scale"], ["fc2.weight", "fc2.bias"], DDP_BUCKETS[1]], 100.0),
        "one": ([[n for b in DDP_BUCKETS for n in b]], 0.0),
        "reversed": (DDP_BUCKETS[::-1], 0.0),
    }
    for name, (buckets, beside) in plans.items():
        assert shared_core_us(regroup(graph, BUCKET_COST, DDP, buckets)) == pytest.approx(beside), name
    no_backward = _ddp_ranks()
    for rank_trace in no_backward:
        for o in rank_trace.ops:
            o.kind = "forward" if o.kind == "backward" else o.kind
    assert shared_core_us(_ddp_graph(no_backward)) == 0.0
    # the correction: the recorded step (300) less the model's for the recorded buckets (360), and
    # less the model's charge where it is charged (90)
    assert fusion_correction_us(graph, BUCKET_COST, DDP) == pytest.approx(-60)
    assert fusion_correction_us(graph, BUCKET_COST, DDP, shared_cores=True) == pytest.approx(-150)
    # priced: replayed + correction + charge; the recorded buckets price as the recorded step
    predictor = Predictor(_ddp_ranks())
    cost = predictor.fusion_cost()
    assert (cost.alpha_us, cost.beta_us_per_byte, cost.world_size) == pytest.approx((50.0, 0.1, 2))
    assert predictor.predict().step_ms == pytest.approx(0.300)
    expected_ms = {"recorded": 0.360 - 0.150 + 0.090, "scale first": 0.400 - 0.150 + 0.100}
    expected_ms.update({"one": 0.400 - 0.150, "reversed": 0.450 - 0.150})
    for name, (buckets, _) in plans.items():
        assert _ms(predictor, buckets=buckets) == pytest.approx(expected_ms[name]), name


def test_a_ddp_bucket_plan_names_every_gradient_once():
    graph = _ddp_graph()
    names = [n for b in DDP_BUCKETS for n in b]
    check_buckets(graph, DDP_BUCKETS, "plan.json", complete=True)
    check_buckets(graph, [], "plan.json", complete=True)  # no buckets: the recorded ones
    refusals = [
        (DDP_BUCKETS + [[]], "plan.json: an empty bucket"),
        (
            [["fc2.weight", "fc2.bias"], ["fc1.weight"]],
            "plan.json: DDP all-reduces every gradient in some bucket; in none: fc1.bias, scale",
        ),
        ([names, ["fc2.bias"]], "plan.json: 'fc2.bias' is in more than one bucket"),
        ([[*names, "fc3.weight"]], "plan.json: bucket entry 'fc3.weight' is not an all-reduced gradient"),
    ]
    for buckets, message in refusals:
        with pytest.raises(QSyncInputError, match=f"^{re.escape(message)}$"):
            check_buckets(graph, buckets, "plan.json", complete=True)
    # Horovod's groups (not complete): a gradient in no group goes alone, an empty group is nothing
    check_buckets(graph, [["fc2.weight"], []], "plan.json")
    with pytest.raises(QSyncInputError, match="^plan.json: 'scale' is in more than one bucket$"):
        check_buckets(graph, [["scale"], ["scale"]], "plan.json")


def test_what_ddp_pricing_needs_is_named_when_missing():
    # the buffers' broadcast carries no bucket (no tensors) and needs no timeline
    assert can_price_fusion(_ddp_ranks()) is None
    unnamed = _ddp_ranks()
    for rank_trace in unnamed:
        for o in rank_trace.ops:
            if o.collective:
                o.collective.pop("tensors", None)
    assert can_price_fusion(unnamed) == "no recorded all-reduce carried one of DDP's buckets"
    sizeless = _ddp_ranks()
    _op(sizeless[1], 5).collective["tensors"][0]["bytes"] = None
    assert can_price_fusion(sizeless) == "some all-reduced tensors have no known size"


# Horovod's loop, by hand (each rank the same): the cost and the recorded times are chosen so that
# each figure below follows from the module docstring's rules.


def _collective(name: str, nbytes: int) -> dict:
    tensor = {"name": name, "variable": f"w/{name}:0", "dtype": "float32", "bytes": nbytes}
    return {"op": "all_reduce", "bytes": nbytes, "tensors": [tensor]}


def _stalled_rank(rank: int) -> object:
    """b1 0-100 launches a (1000 bytes, 100-180); b2 waits for a (180-280); b3 280-380 launches b
    (3000 bytes, 380-480); the update 490-530 waits for both."""
    ops = [
        op(0, "b1", "backward", "main", 0, 100),
        op(1, "b2", "backward", "main", 180, 100, deps=[3]),
        op(2, "b3", "backward", "main", 280, 100),
        op(3, "Allreduce/a", "comm", "comm:1", 100, 80, deps=[0], collective=_collective("a", 1000)),
        op(4, "Allreduce/b", "comm", "comm:1", 380, 100, deps=[2], collective=_collective("b", 3000)),
        op(5, "SGD/update", "update", "main", 490, 40, deps=[3, 4]),
    ]
    return trace(ops, 530, rank=rank, world_size=2, host="h", communication=dict(RECORDED))


def test_a_waiter_inside_backward_is_not_made_to_wait_for_a_response_launched_after_it():
    """a and b fused (cycle 1 ms): b2 runs before b's launch (b3), so it cannot wait for the fused
    response; only the update does. Without its wait b2 runs 100-200 and b3 200-300: readiness from
    the first transformed graph, b at 300. The first cycle is at 100 + 500 = 600: the response runs
    600-700 (20 + 0.02 * 4000), its gap 300 after b was ready; the update 710-750."""
    graph = build_global_graph([_stalled_rank(0), _stalled_rank(1)], 0)
    fused = apply_fusion(graph, AllreduceCost(20.0, 0.02, 0.0, 2, 2), threshold_bytes=MIB, cycle_ms=1.0)
    assert _buckets(fused) == [
        ("comm/fused0", 600, 700, ["a", "b"], ["r0/0", "r0/2", "r1/0", "r1/2"], ["r0/5", "r1/5"])
    ]
    assert fused.nodes["comm/fused0"]["gap"] == pytest.approx(300)
    assert replay(fused).step_us == pytest.approx(750)


def _spaced_rank(rank: int, ends: list[float]) -> object:
    """Backward ops end at ``ends``, each launching a tensor t<i> of 1000 bytes (10 us recorded);
    the update waits for all, 100 us after the last backward op."""
    ops, start = [], 0.0
    for i, end in enumerate(ends):
        ops.append(op(2 * i, f"b{i}", "backward", "main", start, end - start))
        collective = _collective(f"t{i}", 1000)
        ops.append(
            op(2 * i + 1, f"Allreduce/t{i}", "comm", "comm:1", end, 10, deps=[2 * i], collective=collective)
        )
        start = end
    waits = [2 * i + 1 for i in range(len(ends))]
    ops.append(op(99, "SGD/update", "update", "main", ends[-1] + 100, 40, deps=waits))
    return trace(ops, ends[-1] + 140, rank=rank, world_size=2, host="h", communication=dict(RECORDED))


def _fused_starts(ranks: list, cost: AllreduceCost, threshold: int, cycle_ms: float) -> list:
    return [
        (start, tensors)
        for _, start, _, tensors, *_ in _buckets(
            apply_fusion(build_global_graph(ranks, 0), cost, threshold, cycle_ms)
        )
    ]


def test_horovods_cycles_tick_on_from_the_first_and_wait_for_the_loop():
    """Responses of 10 us (no per-byte cost), cycle 100 us: t0 (ready 100) goes at the first cycle,
    150; the next cycles are at 250 (nothing ready) and 350 (t1, ready then); t2 (ready 600) at
    650."""
    flat = AllreduceCost(10.0, 0.0, 0.0, 2, 3)
    spaced = [_spaced_rank(r, [100, 350, 600]) for r in (0, 1)]
    assert _fused_starts(spaced, flat, MIB, 0.1) == [(150, ["t0"]), (350, ["t1"]), (650, ["t2"])]
    # a cycle of 1 ms: all three at the first cycle (600), packed while they fit 2500 bytes
    assert _fused_starts(spaced, flat, 2500, 1.0) == [(600, ["t0", "t1"]), (610, ["t2"])]
    # a cycle of 0.5 us and responses of 0.1 us: t0 at 100.25, the loop free again at 100.35; the
    # cycles go on every 0.5 us from 100.25, and t1 (ready 300.2) goes at the next, 300.25
    fine = [_spaced_rank(r, [100, 300.2]) for r in (0, 1)]
    starts = _fused_starts(fine, AllreduceCost(0.1, 0.0, 0.0, 2, 2), MIB, 0.0005)
    assert [s for s, _ in starts] == pytest.approx([100.25, 300.25])
    # a collective launched by no op of the step (the second on its thread, waiting for nothing) is
    # ready at the step's start: it goes at the first cycle, 50, alone
    unlaunched = [_spaced_rank(r, [100, 350, 600]) for r in (0, 1)]
    for rank_trace in unlaunched:
        _op(rank_trace, 3).deps = []
    graph = build_global_graph(unlaunched, 0)
    assert [(t.name, t.launch) for t in collective_tensors(graph, replay(graph).end)] == [
        ("t1", ()),
        ("t0", ("r0/0", "r1/0")),
        ("t2", ("r0/4", "r1/4")),
    ]
    assert _fused_starts(unlaunched, flat, MIB, 0.1) == [(50, ["t1"]), (150, ["t0"]), (650, ["t2"])]
