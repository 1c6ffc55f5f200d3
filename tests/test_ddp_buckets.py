"""DDP's gradient buckets: recorded from a real 2-process Lightning run, priced by regrouping its
all-reduces, chosen by dynamic programming against enumeration and DDP's own assignment."""

import itertools
import json
import math
import re

import pytest
import torch
import torch.distributed as dist
from ddp_buckets_run import DEPTH, WIDTH, run_two_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Constraints, Plan
from qsync_callback.planner.choose import choose_plan
from qsync_callback.planner.ddp_buckets import (
    RECORDED,
    Layer,
    best_partition,
    choose_buckets,
    ddp_assignment,
    gradient_layers,
)
from qsync_callback.predictor.predict import Predictor
from qsync_callback.predictor.replay import replay
from qsync_callback.predictor.tensor_fusion import (
    AllreduceCost,
    all_reduces,
    fit_allreduce_cost,
    fusion_correction_us,
    regroup,
    shared_core_us,
)
from qsync_callback.recorder.trace import load_trace_dir

LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4


def _finish(layers, ends, cost):
    """The last all-reduce's end for buckets ending at ``ends`` (the recurrence, written plainly)."""
    finish, start = -math.inf, 0
    for end in ends:
        size = sum(layer.bytes for layer in layers[start:end])
        finish = max(layers[end - 1].ready_us, finish) + cost.us(size)
        start = end
    return finish


_layers = st.lists(
    st.tuples(st.integers(1, 8 << 20), st.floats(0, 5e4, allow_nan=False)), min_size=1, max_size=7
).map(lambda rows: [Layer([f"p{i}"], b, r) for i, (b, r) in enumerate(sorted(rows, key=lambda x: x[1]))])


@settings(max_examples=150, deadline=None)
@given(_layers, st.floats(0, 5e3), st.floats(0, 1e-2))
def test_the_best_partition_finishes_no_later_than_any_other(layers, alpha, beta):
    cost = AllreduceCost(alpha, beta, 0.0, 2, 1)
    ends = best_partition(layers, cost)
    assert ends[-1] == len(layers) and ends == sorted(set(ends))
    best = _finish(layers, ends, cost)
    n = len(layers)
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            assert best <= _finish(layers, [*cuts, n], cost) + 1e-6


def test_a_per_bucket_cost_merges_buckets_and_free_buckets_split_them():
    layers = [Layer([f"p{i}"], 1 << 20, 1000.0 * i) for i in range(4)]
    assert best_partition(layers, AllreduceCost(1e6, 0.0, 0.0, 2, 1)) == [4]  # a bucket costs a second
    assert best_partition(layers, AllreduceCost(0.0, 1e-3, 0.0, 2, 1)) == [1, 2, 3, 4]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 3 << 20), min_size=1, max_size=12),
    st.integers(1, 8 << 20),
    st.integers(1, 8 << 20),
)
def test_ddp_assignment_is_ddps_own(sizes, first, cap):
    """Against torch's own bucket assignment (the C++ reducer's), on float32 tensors in that order."""
    sizes = [4 * max(1, s // 4) for s in sizes]
    layers = [Layer([f"p{i}"], s, float(i)) for i, s in enumerate(sizes)]
    tensors = [torch.empty(s // 4) for s in sizes]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap])
    assert ddp_assignment(layers, first, cap) == [max(b) + 1 for b in buckets]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_report")
    result = run_two_ranks(out, "report", 30)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_trace_dir(out / "trace")


def test_the_trace_names_each_buckets_gradients_and_the_all_reduce_that_carried_it(recorded):
    params = {f"net.{2 * i}.{kind}" for i in range(DEPTH + 1) for kind in ("weight", "bias")}
    for trace in recorded:
        buckets = trace.communication["buckets"]
        assert trace.communication["library"] == "ddp"
        assert trace.communication["bucket_cap_mb"] is None  # DDP's default
        assert {t["name"] for b in buckets for t in b} == params
        assert buckets[0][0]["layer"] == f"net.{2 * DEPTH}"  # the last layer's gradients are ready first
        # the default: a first bucket of 1 MiB, then the rest (under 25 MiB) in one
        assert [sum(t["bytes"] for t in b) for b in buckets] == [
            (10 * WIDTH + 10) * 4 + LAYER_BYTES,
            (DEPTH - 1) * LAYER_BYTES,
        ]
        for step in trace.steps:
            carried = [
                op.collective
                for op in trace.ops
                if op.step == step.index and op.kind == "comm" and op.collective.get("tensors")
            ]
            assert sorted([t["name"] for t in c["tensors"]] for c in carried) == sorted(
                [t["name"] for t in b] for b in buckets
            )
            assert all(c["numel"] * 4 == sum(t["bytes"] for t in c["tensors"]) for c in carried)


def test_the_cost_of_a_bucket_comes_from_all_reduces_timed_alone(recorded):
    for trace in recorded:
        timed = trace.communication["allreduce_us"]
        assert timed["bytes"] == sorted(timed["bytes"]) and len(timed["us"]) == len(timed["bytes"])
        assert timed["us"][-1] > timed["us"][0] > 0
    graphs = Predictor(recorded).graphs
    # timed alone at 1 us a collective and 1e-6 us a byte: the recorded buckets (tens of microseconds
    # or more for their bytes, whatever the machine's load) cost far more per byte
    cheap = fit_allreduce_cost(graphs, 2, "ddp", [{"bytes": [0, 1000], "us": [1.0, 1.001]}])
    assert cheap.alpha_us == pytest.approx(1.0)  # the per-collective cost is the timing alone's
    assert cheap.beta_us_per_byte > 1e-5  # the per-byte cost the recorded buckets', higher here
    dear = fit_allreduce_cost(graphs, 2, "ddp", [{"bytes": [0, 1000], "us": [0.0, 1e6]}])
    assert dear.beta_us_per_byte == pytest.approx(1e3)  # alone costs more per byte: kept
    two_ranks = [{"bytes": [0, 1000], "us": [100.0, 300.0]}, {"bytes": [0, 1000], "us": [300.0, 500.0]}]
    assert fit_allreduce_cost(graphs, 2, "ddp", two_ranks).alpha_us == pytest.approx(200.0)  # their mean
    assert Predictor(recorded).fusion_cost().alpha_us > 0  # the timings alone give a per-collective cost


def test_the_recorded_buckets_as_a_plan_price_as_the_recorded_run(recorded):
    predictor = Predictor(recorded)
    buckets = [[t["name"] for t in b] for b in recorded[0].communication["buckets"]]
    plan = Plan(fingerprint=recorded[0].fingerprint, buckets=buckets)
    assert predictor.predict(plan).step_ms == pytest.approx(predictor.predict().step_ms, rel=1e-9)
    # one bucket launched after backward cannot end sooner than the recorded split
    names = [n for b in buckets for n in b]
    one = predictor.predict(Plan(fingerprint=recorded[0].fingerprint, buckets=[names]))
    graph = predictor.graphs[0]
    assert len(all_reduces(graph)) == 2
    assert one.step_ms != predictor.predict().step_ms


def test_on_a_cpu_an_all_reduce_beside_backward_is_charged_to_the_step(recorded):
    predictor = Predictor(recorded)
    graph, cost, settings = predictor.graphs[0], predictor.fusion_cost(), recorded[0].communication
    names = [t["name"] for b in settings["buckets"] for t in b]
    per_layer = regroup(graph, cost, settings, [names[i : i + 2] for i in range(0, len(names), 2)])
    after_backward = regroup(graph, cost, settings, [names])
    assert shared_core_us(after_backward) == 0.0  # one bucket, launched by the last backward op
    assert shared_core_us(per_layer) > 0.0
    fingerprint = recorded[0].fingerprint
    with_charge = predictor.predict(
        Plan(fingerprint=fingerprint, buckets=[names[i : i + 2] for i in range(0, len(names), 2)])
    )
    correction = fusion_correction_us(graph, cost, settings, shared_cores=True)
    replayed = replay(per_layer).step_us + correction + shared_core_us(per_layer)
    assert with_charge.replayed_step_ms[0] == pytest.approx(replayed / 1e3)
    # priced on one recorded step: that step's figure, and the step's exposed communication
    one_bucket = Plan(fingerprint=fingerprint, buckets=[names])
    typical = predictor.typical_step
    one_step = predictor.predict(one_bucket, steps=[typical])
    assert one_step.replayed_step_ms == [predictor.predict(one_bucket).replayed_step_ms[typical]]
    timing = replay(after_backward)
    backward_end = max(timing.end[n] for n, kind in after_backward.nodes(data="kind") if kind == "backward")
    exposed_us = max(timing.end[n] for n in all_reduces(after_backward)) - backward_end
    assert exposed_us > 0  # one bucket, all-reduced after backward: all of it exposed
    assert predictor.predict(one_bucket, steps=[0]).exposed_comm_ms == pytest.approx(exposed_us / 1e3)


def test_a_bucket_plan_must_name_every_gradient_once(recorded):
    predictor = Predictor(recorded)
    names = [t["name"] for b in recorded[0].communication["buckets"] for t in b]
    fingerprint = recorded[0].fingerprint
    with pytest.raises(QSyncInputError, match="in none: net.0.bias"):
        predictor.predict(Plan(fingerprint=fingerprint, buckets=[[n for n in names if n != "net.0.bias"]]))
    with pytest.raises(QSyncInputError, match="more than one bucket"):
        predictor.predict(Plan(fingerprint=fingerprint, buckets=[names, names[:1]]))
    with pytest.raises(QSyncInputError, match="not an all-reduced gradient"):
        predictor.predict(Plan(fingerprint=fingerprint, buckets=[[*names, "net.99.weight"]]))


def test_the_planner_prices_ddps_caps_and_the_best_partition_against_the_recorded_buckets(recorded):
    predictor = Predictor(recorded)
    layers = gradient_layers(predictor)
    assert [layer.names[0].rsplit(".", 1)[0] for layer in layers] == [
        f"net.{2 * i}" for i in range(DEPTH, -1, -1)
    ]
    assert [layer.ready_us for layer in layers] == sorted(layer.ready_us for layer in layers)
    choice = choose_buckets(predictor)
    assert choice.recorded.name == RECORDED
    names = [c.name for c in choice.candidates]
    assert names[0] == "fastest finish (dynamic programming)" or "fastest" not in " ".join(names)
    assert "one bucket" in names or any(len(c.buckets) == 1 for c in choice.candidates)
    everything = sorted(n for layer in layers for n in layer.names)
    for candidate in choice.candidates:
        assert sorted(n for b in candidate.buckets for n in b) == everything
        assert candidate.buckets != choice.recorded.buckets
    if choice.plan is not None:  # decided on the typical step, its figure priced on every step
        assert choice.chosen.prediction.step_ms < 0.98 * choice.recorded.prediction.step_ms
        assert choice.plan.prediction == Predictor(recorded).predict(choice.plan).figures()
        assert choice.plan.buckets == choice.chosen.buckets


def test_choose_plan_with_the_buckets_lever_prints_the_bucket_table(recorded):
    constraints = Constraints.from_arguments(levers=("buckets",))
    recorded_prediction = Predictor(recorded).predict().figures()
    choice = choose_plan(recorded, constraints, recorded_prediction)
    assert "qsync DDP buckets" in choice.table and RECORDED in choice.table
    assert choice.feasible
    assert choice.plan.constraints["levers"] == ["buckets"]


def test_a_plan_file_with_per_layer_buckets_is_applied_from_step_zero(tmp_path, recorded):
    names = [t["name"] for b in recorded[0].communication["buckets"] for t in b]
    per_layer = [names[i : i + 2] for i in range(0, len(names), 2)]
    plan = Plan(fingerprint=recorded[0].fingerprint, buckets=per_layer)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan.to_dict()))
    result = run_two_ranks(tmp_path, "apply", 12, plan_file)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        sizes = json.loads((tmp_path / f"rank{rank}.json").read_text())["bucket_sizes"]
        assert sizes == [(10 * WIDTH + 10) * 4] + [LAYER_BYTES] * DEPTH


def _bucket_and_region_plan(out, recorded, region: str):
    names = [t["name"] for b in recorded[0].communication["buckets"] for t in b]
    per_layer = [names[i : i + 2] for i in range(0, len(names), 2)]
    plan = Plan(fingerprint=recorded[0].fingerprint, buckets=per_layer, fused_regions=[[region]])
    plan_file = out / "plan.json"
    plan_file.write_text(json.dumps(plan.to_dict()))
    return run_two_ranks(out, "apply", 12, plan_file, levers=("buckets", "regions"))


def test_buckets_and_a_compiled_region_inside_one_of_them_are_applied_together(tmp_path, recorded):
    """DDP's buckets re-wrapped around a model whose layer net.10 runs compiled in place: both at
    step 0, on both ranks; its gradients, ready together at the end of its compiled backward, fill
    its bucket as planned."""
    result = _bucket_and_region_plan(tmp_path, recorded, "net.10")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "steps aside" not in result.stderr, result.stderr[-3000:]
    for rank in (0, 1):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["bucket_sizes"] == [(10 * WIDTH + 10) * 4] + [LAYER_BYTES] * DEPTH
        assert outcome["compiled"] == ["net.10"]
        assert len(outcome["losses"]) == 12 and all(math.isfinite(x) for x in outcome["losses"])


def test_buckets_that_split_a_compiled_region_are_refused_with_nothing_applied(tmp_path, recorded):
    """The whole MLP compiled makes its gradients ready at once, weight and bias apart, out of layer
    order (DDP filled buckets of 1 MiB, 1 MiB + the head, ... and a lone bias when this was applied):
    per-layer buckets cannot be kept. Refused whole: neither the buckets nor the region."""
    result = _bucket_and_region_plan(tmp_path, recorded, "net")
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"steps aside: .*the plan's buckets split the parameters of compiled region\(s\) 'net'",
                     result.stderr)  # fmt: skip
    default = [(10 * WIDTH + 10) * 4 + LAYER_BYTES, (DEPTH - 1) * LAYER_BYTES]
    for rank in (0, 1):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["bucket_sizes"] == default and outcome["compiled"] == []
        assert len(outcome["losses"]) == 12


def test_a_plan_one_rank_cannot_apply_leaves_every_rank_on_ddps_own_buckets(tmp_path, recorded):
    """Rank 1 holds a comm hook of the user's, which the re-wrap refuses there: rank 0, which
    re-wrapped, goes back to its old wrapper, both train on with DDP's default buckets, and the
    callback steps aside naming rank 1's reason."""
    names = [t["name"] for b in recorded[0].communication["buckets"] for t in b]
    plan = Plan(
        fingerprint=recorded[0].fingerprint, buckets=[names[i : i + 2] for i in range(0, len(names), 2)]
    )
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan.to_dict()))
    result = run_two_ranks(tmp_path, "apply", 12, plan_file, user_hook_on=1)
    assert result.returncode == 0, result.stderr[-3000:]
    default = [(10 * WIDTH + 10) * 4 + LAYER_BYTES, (DEPTH - 1) * LAYER_BYTES]
    for rank in (0, 1):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["bucket_sizes"] == default
        assert len(outcome["losses"]) == 12
    assert re.search(r"steps aside: the plan from \S+ cannot be applied: .*users_allreduce", result.stderr)
