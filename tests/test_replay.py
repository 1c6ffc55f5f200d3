"""Graph building and replay on small hand-written traces whose answer is known."""

import networkx as nx
import pytest

from qsync_callback.predictor.graph import build_global_graph, build_step_graph, end_node
from qsync_callback.predictor.replay import CompiledGraph, replay
from qsync_callback.recorder.trace import clock_offsets_us, load_trace_dir

from report_checks import profiler_adds_at_most_us, profiler_removes_at_most_us
from tracebuilder import op, trace


def test_chain_replays_to_the_recorded_step():
    # three ops back to back with host gaps of 5 and 10 us, and 3 us after the last one
    t = trace(
        [
            op(0, "a", "forward", "main", 5, 10),
            op(1, "b", "forward", "main", 25, 20),
            op(2, "c", "backward", "main", 45, 30),
        ],
        step_end=78,
    )
    graph = build_step_graph(t, 0)
    assert [graph.nodes[f"r0/{i}"]["gap"] for i in range(3)] == [5, 10, 0]
    result = replay(graph)
    assert result.step_us == pytest.approx(78)
    assert result.critical_path == ["r0/start", "r0/0", "r0/1", "r0/2", "r0/end"]
    assert result.critical_share["host"] == pytest.approx((5 + 10 + 3) / 78)


def test_what_if_shorter_op_shortens_the_chain():
    t = trace([op(0, "a", "forward", "main", 0, 10), op(1, "b", "forward", "main", 10, 20)], step_end=30)
    graph = build_step_graph(t, 0)
    graph.nodes["r0/1"]["dur"] = 5
    assert replay(graph).step_us == pytest.approx(15)


def test_profiler_overhead_is_removed_from_durations_and_gaps():
    t = trace([op(0, "a", "forward", "main", 10, 50, overhead_us=8, gap_overhead_us=4)], step_end=60)
    result = replay(build_step_graph(t, 0))
    assert result.step_us == pytest.approx(60 - 8 - 4)


def test_fork_that_overlaps_hides_communication_behind_compute():
    # main: launch (0-10), compute (10-60), waiter (70-75); comm thread: 10-40, waited by op 3
    ops = [
        op(0, "launch", "backward", "main", 0, 10),
        op(1, "compute", "backward", "main", 10, 50),
        op(2, "all_reduce", "comm", "comm:1", 12, 28, deps=[0]),
        op(3, "copy_back", "other", "main", 60, 5, deps=[2]),
    ]
    graph = build_step_graph(trace(ops, step_end=65), 0)
    assert graph.nodes["r0/2"]["gap"] == pytest.approx(2)
    assert replay(graph).step_us == pytest.approx(65)
    # slower communication: the waiter now waits for it instead of for compute
    graph.nodes["r0/2"]["dur"] = 100
    result = replay(graph)
    assert result.step_us == pytest.approx(10 + 2 + 100 + 5)
    assert "r0/2" in result.critical_path
    assert result.critical_share["communication"] > 0.8


def _rank(rank: int, launch_end: float, offset: float, seen_done: float = 150, tail: float | None = None):
    """backward overlapping an all-reduce: launch at launch_end, compute until 100, wait at 100; the
    rank sees the all-reduce done at ``seen_done`` and copies the bucket back, then (``tail``) runs
    that many us of update: ranks given different ones end at different times."""
    ops = [
        op(0, "grad_a", "backward", "main", 0, launch_end),
        op(1, "grad_b", "backward", "main", launch_end, 100 - launch_end),
        op(
            2,
            "gloo:all_reduce",
            "comm",
            "comm:9",
            launch_end,
            seen_done - launch_end,
            deps=[0],
            collective={"op": "all_reduce", "numel": 10, "bytes": 40},
        ),
        op(3, "copy_bucket_to_grad", "other", "main", seen_done, 10, deps=[2]),
    ]
    if tail is not None:
        ops.append(op(4, "sgd", "update", "main", seen_done + 10, tail))
    for o in ops:
        o.start_us -= offset
    end = seen_done + 10 + (tail or 0)
    t = trace(ops, step_end=end - offset, rank=rank, world_size=2, clock_offset_us=offset)
    t.steps[0].start_us -= offset
    return t


def test_global_graph_joins_ranks_through_the_collective():
    # rank 1 launches later (at 40 instead of 20); its clock runs 1000 us behind the common clock
    traces = [_rank(0, 20, 0.0), _rank(1, 40, 1000.0)]
    graph = build_global_graph(traces, 0)
    assert "comm/0" in graph and "r0/2" not in graph and "r1/2" not in graph
    assert set(graph.predecessors("comm/0")) >= {"r0/0", "r1/0"}
    # the collective starts when the last rank launched (40) and ends when it was seen done (150)
    assert graph.nodes["comm/0"]["dur"] == pytest.approx(110)
    result = replay(graph)
    assert result.start["comm/0"] == pytest.approx(40)
    assert result.step_us == pytest.approx(160)
    # make rank 1's backward slower before the launch: both ranks now wait for it
    graph.nodes["r1/0"]["dur"] = 90
    result = replay(graph)
    assert result.start["comm/0"] == pytest.approx(90)
    assert result.end[end_node(0)] == pytest.approx(90 + 110 + 10)


def test_ranks_on_one_host_share_its_clock():
    # the barrier-based offsets differ by the barrier's release skew; on one host they are not used
    traces = [_rank(0, 20, 0.0), _rank(1, 40, 0.0)]
    for t, skew in zip(traces, (0.0, 2500.0), strict=True):
        t.host, t.clock_offset_us = "node-1", skew
    assert clock_offsets_us(traces) == [0.0, 0.0]
    assert replay(build_global_graph(traces, 0)).step_us == pytest.approx(160)
    traces[1].host = "node-2"
    assert clock_offsets_us(traces) == [0.0, 2500.0]


def test_timeline_lists_every_op_with_its_replayed_times():
    t = trace(
        [op(0, "a", "forward", "main", 5, 10, layer="fc"), op(1, "b", "backward", "main", 25, 20)],
        step_end=50,
    )
    graph = build_step_graph(t, 0)
    rows = replay(graph).timeline(graph)
    assert [(r["name"], r["start_us"], r["end_us"], r["layer"]) for r in rows] == [
        ("a", 5, 15, "fc"),
        ("b", 25, 45, None),
    ]


def test_the_step_ends_with_the_last_rank_and_a_collective_when_the_first_saw_it_done():
    """Rank 0 sees the all-reduce done at 150 and updates for 60 us (ends at 220); rank 1 launched
    it later (40), saw it done at 165 and ends at 185. The collective spans the last launch to the
    first completion (40-150); rank 1's 15 us after it is its own. Replayed, each rank ends when it
    did, and the step when the last one did."""
    traces = [_rank(0, 20, 0.0, 150, 60), _rank(1, 40, 1000.0, 165, 10)]
    graph = build_global_graph(traces, 0)
    assert graph.nodes["comm/0"]["dur"] == pytest.approx(110)
    result = replay(graph)
    assert (result.start["comm/0"], result.end["comm/0"]) == pytest.approx((40, 150))
    assert result.end[end_node(0)] == pytest.approx(220)
    assert result.end[end_node(1)] == pytest.approx(185)
    assert result.step_us == pytest.approx(220)
    assert result.critical_path[-1] == end_node(0) and "comm/0" in result.critical_path
    # rank 1's update 80 us longer: it ends last now (265), and the step with it
    graph.nodes["r1/4"]["dur"] = 90
    result = replay(graph)
    assert result.end[end_node(1)] == pytest.approx(265) and result.step_us == pytest.approx(265)
    assert result.critical_path[-1] == end_node(1)


def test_an_op_with_no_predecessor_waited_for_first_in_topological_order():
    """An all-reduce launched before the step (its launching op is not in it) has no predecessor:
    it starts with the step, like the step's start sentinel. Where it comes first in the graph's
    topological order (networkx puts the sources in the order the nodes were added: here, with the
    nodes added in reverse), it is op 0 of the compiled graph, and the copy that waits for it still
    starts when it ends (30), not at 0."""
    ops = [
        op(0, "a", "forward", "main", 0, 10),
        op(1, "b", "forward", "main", 10, 10),
        op(2, "all_reduce", "comm", "comm:1", 0, 30, deps=[99]),
        op(3, "copy_back", "other", "main", 30, 5, deps=[2]),
    ]
    graph = build_step_graph(trace(ops, step_end=35), 0)
    assert not list(graph.predecessors("r0/2"))
    reversed_graph = nx.DiGraph(**graph.graph)
    reversed_graph.add_nodes_from(reversed(list(graph.nodes(data=True))))
    reversed_graph.add_edges_from(graph.edges(data=True))
    assert CompiledGraph(reversed_graph).nodes[0] == "r0/2"
    for g in (graph, reversed_graph):
        result = replay(g)
        assert (result.start["r0/3"], result.end["r0/3"]) == pytest.approx((30, 35))
        assert result.step_us == pytest.approx(35)
        assert result.critical_path == ["r0/2", "r0/3", "r0/end"]


def test_each_recorded_step_replays_as_its_wall_time_less_the_profilers_share(tmp_path):
    """On a real recording (3 steps of a small attention model under torch.profiler): each step's
    replay is its profiled wall time less no more than the profiler's own share (what the graph
    removes from durations and gaps)."""
    import torch
    from test_torch_recorder import Net

    from qsync_callback.recorder.torch_recorder import TorchRecorder

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    recorder = TorchRecorder(model, [optimizer], tmp_path, warmup_steps=2, profile_steps=3)
    x, y = torch.randn(16, 8, 32), torch.randint(0, 5, (16,))
    for _ in range(11):
        recorder.step_boundary()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    recorder.save()
    traces = load_trace_dir(tmp_path)
    assert len(traces[0].steps) == 3
    for position, step in enumerate(traces[0].steps):
        wall = step.end_us - step.start_us
        profiler = profiler_removes_at_most_us(traces[0], step.index, wall)
        replayed = replay(build_global_graph(traces, position)).step_us
        # the step as recorded, less no more than the profiler's own calibrated share (how large
        # that share is depends on the machine's load: benchmarks/prediction_accuracy.py reports it)
        # and longer by no more than a negative slowdown lengthens its idle time
        # (timestamps near 4.7e12 us carry about 1e-3 us of float64 rounding each: 0.01 us allowed)
        assert (
            wall - profiler - 1e-5 * wall
            <= replayed
            <= wall + profiler_adds_at_most_us(traces[0], wall) + 0.01
        )
