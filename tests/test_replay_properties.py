"""Property-based tests of the replay (`predictor/replay.py`) and the step graph it replays
(`predictor/graph.py`): random steps of ops on a few queues, with waits across them, against a
reference simulator written here, the plainest statement of the replay's rule: an op starts once
its queue is free and every op it waits for has ended, plus its host gap; the step ends when the
last op of every compute thread has, plus the gap after it. Across ranks (the global graph): a
collective starts once every rank has launched it and the collective before it has ended, plus
its gap, and the step ends with the last rank."""

from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_callback.predictor.graph import build_global_graph, build_step_graph, end_node, op_node, start_node
from qsync_callback.predictor.replay import replay

from tracebuilder import op, trace

QUEUES = ("main", "tid:1", "tid:2", "comm:1")  # three compute threads and a communication one
SETTINGS = settings(max_examples=300, deadline=None, database=None)


@st.composite
def steps(draw):
    """A random step: ops in an order that is topological (each waits only for earlier ones),
    each with its queue, duration, host gap and waits (at most 3); the first runs on "main";
    integer microseconds, so that every sum is exact."""
    count = draw(st.integers(1, 24))
    ops = []
    for i in range(count):
        queue = "main" if i == 0 else draw(st.sampled_from(QUEUES))
        deps = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        ops.append(
            {
                "queue": queue,
                "dur": float(draw(st.integers(0, 50))),
                "gap": float(draw(st.integers(0, 5))),
                "deps": sorted(deps),
            }
        )
    end_gap = float(draw(st.integers(0, 5)))
    return ops, end_gap


def simulate(ops, end_gap, durations=None):
    """The reference: each op in order starts when its queue's previous op and every op it waits
    for have ended, plus its gap. Returns (starts, ends, step end)."""
    durations = [o["dur"] for o in ops] if durations is None else durations
    free: dict[str, float] = {}
    last: dict[str, int] = {}
    starts, ends = [], []
    for i, o in enumerate(ops):
        ready = max([free.get(o["queue"], 0.0), *(ends[d] for d in o["deps"])])
        starts.append(ready + o["gap"])
        ends.append(starts[-1] + durations[i])
        free[o["queue"]] = ends[-1]
        last[o["queue"]] = i
    compute_ends = [ends[i] for q, i in last.items() if q != "comm:1"]
    return starts, ends, max(compute_ends) + end_gap


def recorded(ops, end_gap):
    """The step as a recorder would have written it: the reference's times."""
    starts, _, step_end = simulate(ops, end_gap)
    kinds = {"comm:1": "comm"}
    return trace(
        [
            op(i, f"op{i}", kinds.get(o["queue"], "forward"), o["queue"], starts[i], o["dur"], deps=o["deps"])
            for i, o in enumerate(ops)
        ],
        step_end=step_end,
    )


@SETTINGS
@given(steps())
def test_replay_reproduces_the_recorded_step(step):
    """Each op's gap read back from the recorded times is the one it had, and replayed, every op
    starts and ends as recorded, and the step with it."""
    ops, end_gap = step
    starts, ends, step_end = simulate(ops, end_gap)
    graph = build_step_graph(recorded(ops, end_gap), 0)
    assert [graph.nodes[op_node(0, i)]["gap"] for i in range(len(ops))] == [o["gap"] for o in ops]
    result = replay(graph)
    assert result.step_us == step_end
    assert [result.start[op_node(0, i)] for i in range(len(ops))] == starts
    assert [result.end[op_node(0, i)] for i in range(len(ops))] == ends


@SETTINGS
@given(steps(), st.data())
def test_replay_with_other_durations_matches_the_reference(step, data):
    """A what-if: every op given another duration, replayed on the recorded graph, against the
    reference run with those durations and the recorded gaps."""
    ops, end_gap = step
    graph = build_step_graph(recorded(ops, end_gap), 0)
    durations = [
        float(d) for d in data.draw(st.lists(st.integers(0, 80), min_size=len(ops), max_size=len(ops)))
    ]
    for i, dur in enumerate(durations):
        graph.nodes[op_node(0, i)]["dur"] = dur
    starts, ends, step_end = simulate(ops, end_gap, durations)
    result = replay(graph)
    assert result.step_us == step_end
    assert [result.start[op_node(0, i)] for i in range(len(ops))] == starts
    assert [result.end[op_node(0, i)] for i in range(len(ops))] == ends


@SETTINGS
@given(steps(), st.data())
def test_critical_path_is_a_chain_of_waits_that_spans_the_step(step, data):
    """The critical path runs from the step's start to its end along the graph's edges; each op on
    it started right when the op before it on the path ended (plus its gap), that op being one
    that ended last among those it waited for; so its gaps and durations add up to the step time,
    and its shares (compute, communication, host) to 1."""
    ops, end_gap = step
    graph = build_step_graph(recorded(ops, end_gap), 0)
    for i in range(len(ops)):
        graph.nodes[op_node(0, i)]["dur"] = float(data.draw(st.integers(0, 80)))
    result = replay(graph)
    path = result.critical_path
    assert path[0] == start_node(0) and path[-1] == end_node(0)
    total = 0.0
    for before, node in zip(path, path[1:], strict=False):
        assert graph.has_edge(before, node)
        waited = max(result.end[p] for p in graph.predecessors(node))
        assert result.end[before] == waited
        assert result.start[node] == waited + graph.nodes[node]["gap"]
        total += graph.nodes[node]["gap"] + graph.nodes[node]["dur"]
    assert total == result.step_us
    share = result.critical_share
    assert abs(sum(share.values()) - 1) < 1e-12 or result.step_us == 0
    if result.step_us:
        comm = sum(graph.nodes[n]["dur"] for n in path if graph.nodes[n]["kind"] == "comm")
        host = sum(graph.nodes[n]["gap"] for n in path)
        assert abs(share["communication"] - comm / result.step_us) < 1e-12
        assert abs(share["host"] - host / result.step_us) < 1e-12


@st.composite
def ranked_steps(draw):
    """Two or three ranks, each a chain of ops on its training thread, joined by up to 3
    collectives in order: collective k is launched on each rank by one op and waited for by a
    later one (both in collective order, so that no rank waits for a collective it launches
    later). Returns (per rank: [{dur, gap}], end gap, {launch op: [k]}, {waiting op: [k]}), and
    the collectives' [{dur, gap}]."""
    count = draw(st.integers(0, 3))
    ranks = []
    for _ in range(draw(st.integers(2, 3))):
        n = draw(st.integers(2 if count else 1, 10))
        ops = [
            {"dur": float(draw(st.integers(0, 50))), "gap": float(draw(st.integers(0, 5)))} for _ in range(n)
        ]
        launch = (
            sorted(draw(st.lists(st.integers(0, n - 2), min_size=count, max_size=count))) if count else []
        )
        wait, latest = [], 0
        for at in launch:
            latest = max(latest, draw(st.integers(at + 1, n - 1)))
            wait.append(latest)
        ranks.append((ops, float(draw(st.integers(0, 5))), launch, wait))
    collectives = [
        {"dur": float(draw(st.integers(0, 60))), "gap": float(draw(st.integers(0, 5)))} for _ in range(count)
    ]
    return ranks, collectives


def simulate_ranks(ranks, collectives):
    """The reference across ranks, as events: whatever can start next starts, until all ran.
    Returns per rank (starts, ends, step end), and per collective (start, end)."""
    done = [0] * len(ranks)
    starts = [[] for _ in ranks]
    ends = [[] for _ in ranks]
    spans: list[tuple[float, float]] = []
    progress = True
    while progress:
        progress = False
        for r, (ops, _, _, wait) in enumerate(ranks):
            while done[r] < len(ops):
                i = done[r]
                waits = [k for k, at in enumerate(wait) if at == i]
                if any(k >= len(spans) for k in waits):
                    break
                ready = max([ends[r][-1] if i else 0.0, *(spans[k][1] for k in waits)])
                starts[r].append(ready + ops[i]["gap"])
                ends[r].append(starts[r][-1] + ops[i]["dur"])
                done[r] += 1
                progress = True
        k = len(spans)
        if k < len(collectives) and all(done[r] > ranks[r][2][k] for r in range(len(ranks))):
            launched = [ends[r][ranks[r][2][k]] for r in range(len(ranks))]
            start = max([*launched, spans[-1][1] if spans else 0.0]) + collectives[k]["gap"]
            spans.append((start, start + collectives[k]["dur"]))
            progress = True
    assert all(d == len(ops) for d, (ops, *_) in zip(done, ranks, strict=True))
    rank_ends = [e[-1] + end_gap for e, (_, end_gap, _, _) in zip(ends, ranks, strict=True)]
    return starts, ends, rank_ends, spans


def recorded_ranks(ranks, collectives):
    """Each rank's trace as a recorder would have written it: its ops at the reference's times,
    each collective as an op of its communication thread there (the collective's span on every
    rank), launched by one op and waited for by another."""
    starts, _, rank_ends, spans = simulate_ranks(ranks, collectives)
    traces = []
    for r, (ops, _, launch, wait) in enumerate(ranks):
        recorded = [
            op(
                i,
                f"op{i}",
                "backward",
                "main",
                starts[r][i],
                o["dur"],
                deps=[100 + k for k, at in enumerate(wait) if at == i],
            )
            for i, o in enumerate(ops)
        ]
        recorded += [
            op(
                100 + k,
                f"allreduce.{k}",
                "comm",
                "comm:1",
                spans[k][0],
                spans[k][1] - spans[k][0],
                deps=[launch[k]],
                collective={"op": "all_reduce", "numel": 1, "bytes": 4},
            )
            for k in range(len(collectives))
        ]
        traces.append(trace(recorded, step_end=rank_ends[r], rank=r, world_size=len(ranks)))
    return traces


@SETTINGS
@given(ranked_steps(), st.data())
def test_ranks_joined_by_collectives_replay_as_the_reference(step, data):
    """Replayed as recorded, every op, collective and rank end where the reference put them and
    the step ends with the last rank; with other durations (ops and collectives), where the
    reference puts them then."""
    ranks, collectives = step
    graph = build_global_graph(recorded_ranks(ranks, collectives), 0)
    for what_if in (False, True):
        if what_if:
            for r, (ops, *_) in enumerate(ranks):
                for i, o in enumerate(ops):
                    o["dur"] = float(data.draw(st.integers(0, 80)))
                    graph.nodes[op_node(r, i)]["dur"] = o["dur"]
            for k, c in enumerate(collectives):
                c["dur"] = float(data.draw(st.integers(0, 80)))
                graph.nodes[f"comm/{k}"]["dur"] = c["dur"]
        starts, ends, rank_ends, spans = simulate_ranks(ranks, collectives)
        result = replay(graph)
        for r, (ops, *_) in enumerate(ranks):
            assert [result.start[op_node(r, i)] for i in range(len(ops))] == starts[r]
            assert [result.end[op_node(r, i)] for i in range(len(ops))] == ends[r]
            assert result.end[end_node(r)] == rank_ends[r]
        assert [(result.start[f"comm/{k}"], result.end[f"comm/{k}"]) for k in range(len(spans))] == spans
        assert result.step_us == max(rank_ends)
        assert result.critical_path[-1] == end_node(rank_ends.index(max(rank_ends))) or (
            rank_ends.count(max(rank_ends)) > 1
        )
