"""The global graph of hand-written two-rank steps: clocks that differ between hosts, collectives
joined by name (launched in different orders) or by position (repeated or differing names), the
collectives' queue in order of their start, and a rank's step sentinels. Times are microseconds on
the common clock unless said otherwise."""

import pytest

from qsync_callback.predictor.graph import build_global_graph, build_step_graph, end_node, start_node
from qsync_callback.predictor.replay import replay

from tracebuilder import op, trace

COLLECTIVE = {"op": "all_reduce", "numel": 10, "bytes": 40}


def _shifted(ops, step_end: float, rank: int, offset: float, **extra):
    """A rank's trace whose clock reads ``offset`` us behind the common clock, on its own host."""
    for o in ops:
        o.start_us -= offset
    t = trace(
        ops, step_end=step_end, rank=rank, world_size=2, host=f"h{rank}", clock_offset_us=offset, **extra
    )
    t.steps[0].start_us -= offset
    t.steps[0].end_us -= offset
    return t


def _timeline_rank(rank: int, offset: float, records: bool):
    """backward 0-100 launches all-reduce ``a`` (100-260 as this rank saw it), the update 270-300
    waits for it. With ``records``, Horovod's timeline on this rank says ``a`` ran 160-260 (on this
    rank's clock)."""
    tensor = {"name": "a", "variable": "w/a:0", "shape": [250], "dtype": "float32", "bytes": 1000}
    if records:
        span = [160 - offset, 260 - offset]
        tensor["timeline"] = {"response": 0, "op_us": span, "negotiate_us": [100 - offset, span[0] - 10]}
    collective = {"op": "all_reduce", "bytes": 1000, "tensors": [tensor]}
    ops = [
        op(0, "gradient_tape/b", "backward", "main", 0, 100),
        op(1, "Allreduce/a", "comm", "comm:1", 100, 160, deps=[0], collective=collective),
        op(2, "SGD/update", "update", "main", 270, 30, deps=[1]),
    ]
    return _shifted(ops, 300, rank, offset, communication={"library": "horovod"})


def test_ranks_with_different_clocks_meet_on_the_common_clock():
    """Rank 1's clock runs 1000 us behind and carries the timeline: its sentinels and the response's
    span are put on the common clock by adding its offset."""
    traces = [_timeline_rank(0, 0.0, records=False), _timeline_rank(1, 1000.0, records=True)]
    graph = build_global_graph(traces, 0)
    for rank in (0, 1):
        assert graph.nodes[start_node(rank)]["recorded_start"] == pytest.approx(0)
        assert graph.nodes[end_node(rank)]["recorded_start"] == pytest.approx(300)
        assert graph.nodes[f"r{rank}/2"]["recorded_start"] == pytest.approx(270)
    comm = graph.nodes["comm/0"]
    assert (comm["recorded_start"], comm["dur"], comm["gap"]) == pytest.approx((160, 100, 60))
    assert replay(graph).step_us == pytest.approx(300)


def _named_rank(rank: int, launches: dict[str, tuple[float, float]], names: dict[str, str] | None = None):
    """backward ops launch one all-reduce each (name -> (start, end) as this rank saw it, each on its
    own comm thread); the update at 200-210 waits for all of them. Op ids: launches 0.., collectives
    10.., update 20."""
    names = names or {}
    ops, waits = [], []
    for i, (key, (start, end)) in enumerate(launches.items()):
        ops.append(op(i, f"grad_{key}", "backward", "main", 5 * i, 5))
        name = names.get(key, f"Allreduce/{key}")
        ops.append(
            op(10 + i, name, "comm", f"comm:{i}", start, end - start, deps=[i], collective=dict(COLLECTIVE))
        )
        waits.append(10 + i)
    ops.append(op(20, "update", "update", "main", 200, 10, deps=waits))
    return trace(ops, step_end=210, rank=rank, world_size=2)


def _comms(graph) -> dict[str, dict]:
    return {n: a for n, a in graph.nodes(data=True) if a["kind"] == "comm"}


def test_collectives_launched_in_different_orders_are_joined_by_name_and_queued_by_start():
    """Rank 0 launches a (10-80) then b (20-150); rank 1 b (30-150) then a (50-80). Joined by name:
    a spans 50-80 (last launch to first completion), b 30-150. comm/k is rank 0's k-th; the
    collectives' queue is in order of start (b before a), not of end or number."""
    traces = [
        _named_rank(0, {"a": (10, 80), "b": (20, 150)}),
        _named_rank(1, {"b": (30, 150), "a": (50, 80)}),
    ]
    graph = build_global_graph(traces, 0)
    comms = _comms(graph)
    assert sorted(comms) == ["comm/0", "comm/1"]
    a, b = comms["comm/0"], comms["comm/1"]
    assert [p["key"] for p in a["parts"]] == ["a"] and [p["key"] for p in b["parts"]] == ["b"]
    # rank 0's a was launched by its op 0, rank 1's by its op 1 (it launched b first)
    assert a["parts"][0]["launch"] == ["r0/0", "r1/1"] and b["parts"][0]["launch"] == ["r0/1", "r1/0"]
    assert (a["recorded_start"], a["dur"]) == pytest.approx((50, 30))
    assert (b["recorded_start"], b["dur"]) == pytest.approx((30, 120))
    assert graph.has_edge("comm/1", "comm/0") and not graph.has_edge("comm/0", "comm/1")
    assert graph.edges["comm/1", "comm/0"]["kind"] == "order"


def test_repeated_names_are_joined_by_position_in_order_of_start():
    """Both ranks call every collective "gloo:all_reduce". Rank 0's op 11 starts first (10) but ends
    last; rank 1 starts its op 10 first. The k-th by start of each rank are one collective: (r0/11,
    r1/10) and (r0/10, r1/11), not the pairs by op id or by end."""
    r0 = _named_rank(
        0, {"x": (20, 50), "y": (10, 100)}, names={"x": "gloo:all_reduce", "y": "gloo:all_reduce"}
    )
    r1 = _named_rank(
        1, {"x": (10, 40), "y": (20, 60)}, names={"x": "gloo:all_reduce", "y": "gloo:all_reduce"}
    )
    graph = build_global_graph([r0, r1], 0)
    comms = _comms(graph)
    assert sorted(comms) == ["comm/0", "comm/1"]
    assert comms["comm/0"]["parts"][0]["launch"] == ["r0/1", "r1/0"]
    assert comms["comm/1"]["parts"][0]["launch"] == ["r0/0", "r1/1"]
    # comm/0: launched 10 and 10, seen done at 100 and 40; comm/1: 20 and 20, done at 50 and 60
    assert (comms["comm/0"]["recorded_start"], comms["comm/0"]["dur"]) == pytest.approx((10, 30))
    assert (comms["comm/1"]["recorded_start"], comms["comm/1"]["dur"]) == pytest.approx((20, 30))
    assert graph.has_edge("comm/0", "comm/1")


def test_ranks_naming_a_collective_differently_are_joined_by_position_and_named_after_rank_0():
    """Rank 0 has one more collective (z) than rank 1: the first two of each are joined, the third
    is left on rank 0's graph as it was recorded."""
    r0 = _named_rank(0, {"x": (10, 50), "z": (30, 60)}, names={"x": "rank0/all_reduce"})
    r1 = _named_rank(1, {"x": (20, 40)}, names={"x": "rank1/allreduce"})
    graph = build_global_graph([r0, r1], 0)
    comms = _comms(graph)
    assert sorted(comms) == ["comm/0", "r0/11"]
    assert comms["comm/0"]["name"] == "rank0/all_reduce"
    assert [p["key"] for p in comms["comm/0"]["parts"]] == ["all_reduce"]
    assert comms["comm/0"]["parts"][0]["launch"] == ["r0/0", "r1/0"]


GLOO = "gloo:all_reduce"


def _bucket_rank(rank: int, launches: dict[str, tuple[float, float]]):
    """DDP's buckets as gloo records them: every all-reduce named "gloo:all_reduce", each naming its
    gradients (bucket -> (start, end) as this rank saw it, in this rank's order of launch: op i
    launches all-reduce 10 + i); the update at 200-210 waits for all of them."""
    gradients = {"b0": ["fc2.weight", "fc2.bias"], "b1": ["fc1.weight", "fc1.bias"]}
    ops, waits = [], []
    for i, (bucket, (start, end)) in enumerate(launches.items()):
        tensors = [{"name": n, "variable": n, "bytes": 40, "dtype": "float32"} for n in gradients[bucket]]
        collective = {"op": "all_reduce", "numel": 20, "bytes": 80, "tensors": tensors}
        ops.append(op(i, f"grad_{bucket}", "backward", "main", 5 * i, 5))
        ops.append(op(10 + i, GLOO, "comm", f"comm:{i}", start, end - start, deps=[i], collective=collective))
        waits.append(10 + i)
    ops.append(op(20, "update", "update", "main", 200, 10, deps=waits))
    return trace(ops, step_end=210, rank=rank, world_size=2)


def test_collectives_of_one_name_are_joined_by_their_first_tensor():
    """Rank 0 starts bucket 0 (10-80) then bucket 1 (20-150); rank 1, on gloo's two threads, bucket 1
    (30-150) then bucket 0 (50-80). Joined by name and first tensor, not by position: bucket 0 spans
    50-80, launched by rank 0's op 0 and rank 1's op 1."""
    traces = [
        _bucket_rank(0, {"b0": (10, 80), "b1": (20, 150)}),
        _bucket_rank(1, {"b1": (30, 150), "b0": (50, 80)}),
    ]
    comms = _comms(build_global_graph(traces, 0))
    joined = {
        n: (
            [t["name"] for t in a["collective"]["tensors"]],
            a["parts"][0]["launch"],
            a["recorded_start"],
            a["dur"],
        )
        for n, a in comms.items()
    }
    assert joined == {
        "comm/0": (["fc2.weight", "fc2.bias"], ["r0/0", "r1/1"], 50, 30),
        "comm/1": (["fc1.weight", "fc1.bias"], ["r0/1", "r1/0"], 30, 120),
    }


def test_ranks_with_as_many_collectives_named_differently_are_joined_by_position():
    r0 = _named_rank(0, {"x": (10, 50), "y": (30, 60)}, names={"x": "rank0/all_reduce"})
    r1 = _named_rank(1, {"x": (20, 40), "z": (35, 70)}, names={"x": "rank1/allreduce"})
    comms = _comms(build_global_graph([r0, r1], 0))
    assert {n: a["parts"][0]["launch"] for n, a in comms.items()} == {
        "comm/0": ["r0/0", "r1/0"],
        "comm/1": ["r0/1", "r1/1"],
    }
    assert [p["key"] for p in comms["comm/1"]["parts"]] == ["y"]  # named after rank 0's


def test_the_main_queue_hangs_off_the_step_start_even_when_its_first_op_waits_for_another_thread():
    """TF's executor thread runs op 0 (0-10); the main thread's first op (10-30) waits for it. Both
    queues start at the step start."""
    ops = [op(0, "matmul", "forward", "tid:7", 0, 10), op(1, "loss", "forward", "main", 10, 20, deps=[0])]
    graph = build_step_graph(trace(ops, step_end=30), 0)
    assert set(graph.successors(start_node(0))) == {"r0/0", "r0/1"}
    assert set(graph.predecessors(end_node(0))) == {"r0/0", "r0/1"}
    assert not graph.has_edge(start_node(0), end_node(0))


def test_a_step_that_waited_for_no_compute_op_ends_after_its_start():
    """The only compute op ends after the step's end (40): the end sentinel follows the start sentinel."""
    ops = [op(0, "late", "forward", "main", 10, 50)]
    graph = build_step_graph(trace(ops, step_end=40), 0)
    assert list(graph.predecessors(end_node(0))) == [start_node(0)]
    assert graph.edges[start_node(0), end_node(0)]["kind"] == "order"
    assert replay(graph).step_us == pytest.approx(40)  # the end sentinel keeps its recorded gap


def test_a_single_rank_graph_keeps_its_recorded_times():
    ops = [op(0, "a", "forward", "main", 5, 10), op(1, "b", "backward", "main", 25, 20)]
    graph = build_step_graph(trace(ops, step_end=50), 0)
    starts = {n: a["recorded_start"] for n, a in graph.nodes(data=True)}
    assert starts == {start_node(0): 0, "r0/0": 5, "r0/1": 25, end_node(0): 50}
    assert (graph.nodes["r0/0"]["gap"], graph.nodes["r0/1"]["gap"]) == (5, 10)


def _attrs_rank(rank: int, tensor_bytes: int | None = 1000):
    """main: backward 0-100 (layer fc, module fc.act, 64 bytes, one 8x16 float input) launches the
    all-reduce (comm:1, 100-250), the update 260-300 waits for it; TF's executor thread tid:3 runs
    two ops (0-20, 20-50) that wait for nothing. The op's collective says 999 bytes, its one tensor
    ``tensor_bytes``."""
    tensor = {"name": "a", "variable": "w/a:0", "shape": [250], "dtype": "float32", "bytes": tensor_bytes}
    shapes = {"input_shapes": [[8, 16]], "input_dtypes": ["float"]}
    ops = [
        op(0, "grad", "backward", "main", 0, 100, layer="fc", bytes=64, module="fc.act", **shapes),
        op(
            1,
            "Allreduce/a",
            "comm",
            "comm:1",
            100,
            150,
            deps=[0],
            collective={"op": "all_reduce", "bytes": 999, "tensors": [tensor]},
        ),
        op(2, "update", "update", "main", 260, 40, deps=[1]),
        op(3, "matmul", "forward", "tid:3", 0, 20),
        op(4, "relu", "forward", "tid:3", 20, 30),
    ]
    return trace(ops, step_end=300, rank=rank, world_size=2)


def test_the_global_graphs_attributes_and_edge_kinds():
    graph = build_global_graph([_attrs_rank(0), _attrs_rank(1)], 0)
    assert graph.graph == {"step": 0, "ranks": [0, 1]}
    edges = {(u, v): kind for u, v, kind in graph.edges(data="kind")}
    expected = {("comm/0", "r0/2"): "dep", ("comm/0", "r1/2"): "dep"}
    for r in (0, 1):
        expected.update(
            {
                (f"r{r}/start", f"r{r}/0"): "order",  # the main thread always starts at the step start
                (f"r{r}/start", f"r{r}/3"): "order",  # another thread's first op waits for nothing
                (f"r{r}/0", f"r{r}/2"): "order",
                (f"r{r}/3", f"r{r}/4"): "order",
                (f"r{r}/0", "comm/0"): "dep",
                (f"r{r}/2", f"r{r}/end"): "order",
                (f"r{r}/4", f"r{r}/end"): "dep",
            }
        )
    assert edges == expected
    sentinel = {"dur": 0.0, "gap": 0.0, "queue": "r1/main", "rank": 1, "layer": None, "bytes": 0}
    sentinel.update({"collective": None, "op_id": None, "kind": "sentinel"})
    assert graph.nodes["r1/start"] == {**sentinel, "name": "step start", "recorded_start": 0.0}
    assert graph.nodes["r1/end"] == {**sentinel, "name": "step end", "recorded_start": 300.0}
    assert graph.nodes["r1/0"] == {
        "name": "grad",
        "kind": "backward",
        "queue": "r1/main",
        "dur": 100.0,
        "gap": 0.0,
        "rank": 1,
        "layer": "fc",
        "module": "fc.act",
        "shapes": [[8, 16]],
        "dtypes": ["float"],
        "bytes": 64,
        "collective": None,
        "op_id": 0,
        "recorded_start": 0.0,
    }
    assert graph.nodes["r1/4"]["queue"] == "r1/tid:3"
    tensor = {"name": "a", "variable": "w/a:0", "shape": [250], "dtype": "float32", "bytes": 1000}
    assert graph.nodes["comm/0"] == {
        "name": "Allreduce/a",
        "kind": "comm",
        "queue": "comm",
        "dur": 150.0,
        "gap": 0.0,
        "rank": None,
        "layer": None,
        "module": None,
        "shapes": [],
        "dtypes": [],
        "bytes": 0,
        "collective": {"op": "all_reduce", "bytes": 1000, "tensors": [tensor]},
        "op_id": 1,
        "recorded_start": 100.0,
        "parts": [
            {"key": "a", "tensors": [tensor], "launch": ["r0/0", "r1/0"], "consumers": ["r0/2", "r1/2"]}
        ],
    }


def test_a_collective_with_no_tensor_list_keeps_its_record_and_empty_parts():
    traces = [_named_rank(0, {"a": (10, 50)}), _named_rank(1, {"a": (20, 60)})]
    graph = build_global_graph(traces, 0)
    assert graph.nodes["comm/0"]["parts"] == [
        {"key": "a", "tensors": [], "launch": ["r0/0", "r1/0"], "consumers": ["r0/20", "r1/20"]}
    ]
    assert graph.nodes["comm/0"]["collective"] == COLLECTIVE


def test_a_tensor_of_unknown_size_adds_no_bytes_to_its_collective():
    graph = build_global_graph([_attrs_rank(0, None), _attrs_rank(1, None)], 0)
    assert graph.nodes["comm/0"]["collective"]["bytes"] == 0


def test_a_single_ranks_graph_names_its_step_and_rank():
    graph = build_step_graph(_attrs_rank(1), 0)
    assert graph.graph == {"step": 0, "ranks": [1]}


# predictor/replay.py: the timeline's rows and the critical path's shares


def _fork_step():
    """main: a (0-10) launches an all-reduce c (10-40 on comm:1) and runs b (10-30); d (40-50)
    waits for both. Node names sort r0/0, r0/1, r0/2, r0/3; starts sort a, c/b (both 10), d."""
    ops = [
        op(0, "a", "forward", "main", 0, 10, layer="fc"),
        op(3, "c", "comm", "comm:1", 10, 30, deps=[0], collective=dict(COLLECTIVE)),
        op(1, "b", "backward", "main", 10, 20),
        op(2, "d", "update", "main", 40, 10, deps=[3]),
    ]
    return build_step_graph(trace(ops, step_end=50), 0)


def test_the_timeline_has_a_row_per_op_in_order_of_replayed_start():
    graph = _fork_step()
    graph.nodes["r0/0"]["dur"] = 20  # a 0-20: b 20-40 and c (shortened to 5) 20-25; d after b, 40-50
    graph.nodes["r0/3"]["dur"] = 5
    rows = replay(graph).timeline(graph)
    keys = ("node", "name", "kind", "queue", "layer", "start_us", "end_us")
    assert [tuple(r[k] for k in keys) for r in rows[:1]] == [("r0/0", "a", "forward", "r0/main", "fc", 0, 20)]
    assert {tuple(r[k] for k in keys) for r in rows[1:3]} == {
        ("r0/1", "b", "backward", "r0/main", None, 20, 40),
        ("r0/3", "c", "comm", "r0/comm:1", None, 20, 25),
    }
    assert [tuple(r[k] for k in keys) for r in rows[3:]] == [("r0/2", "d", "update", "r0/main", None, 40, 50)]
    assert all(set(r) == set(keys) for r in rows)


def test_the_critical_share_splits_the_path_into_compute_communication_and_host():
    graph = _fork_step()
    graph.nodes["r0/3"]["dur"] = 100  # c 10-110 is now on the critical path: a, c, d
    result = replay(graph)
    share = result.critical_share
    assert set(share) == {"compute", "communication", "host"}
    assert sum(share.values()) == pytest.approx(1)
    assert share["compute"] == pytest.approx(20 / 120) and share["communication"] == pytest.approx(100 / 120)
