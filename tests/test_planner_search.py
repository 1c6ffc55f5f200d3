"""The planner's central claim on hand-written steps with several feasible plans and distinct
indicators: the greedy allocator (with its recovery pass) and the exact search both return the
least-indicator plan that meets the constraints, as a brute force written here finds it (every
combination priced by the same predictor). Then the search step by step on a stand-in predictor
whose prices are sums written in each test (`_Table`), and `plan_precision` on a recording."""

import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import PRECISIONS as PLAN_PRECISIONS
from qsync_callback.plan import Plan
from qsync_callback.planner.precision import (
    allocate_precision,
    candidate_precisions,
    exact_precision,
    fastest_plan,
    least_memory_plan,
    plan_precision,
)
from qsync_callback.predictor.indicator import sensitivity
from qsync_callback.predictor.predict import Prediction, Predictor
from qsync_callback.recorder.statistics_schema import TENSOR_ROLES

from tracebuilder import op, trace

PRECISIONS = ("fp32", "bf16", "int8")


def _probe(forward, backward, saved, bwd_temp=0):
    return {
        "forward_us": forward,
        "backward_us": backward,
        "saved_bytes": saved,
        "forward_transient_bytes": 0,
        "backward_transient_bytes": bwd_temp,
    }


def _chain_step(layers, threads=None):
    """Layers one after another, each with one forward and one backward op, no casts fitted (a
    move changes a layer's own op durations and saved bytes only) and no layer table (no links).

    ``layers``: name -> {precision: (forward_us, backward_us, saved_bytes[, backward temporaries])};
    the fp32 entry is what was recorded. Each layer's saved input (its fp32 saved bytes) is born in
    its forward (by an op of no layer: the input arrives from outside) and freed in its backward.
    ``threads``: name -> the compute thread the layer's ops run on ("main" by default); the step
    ends when every thread has, so the step time is the longest thread's sum of durations."""
    threads = threads or {}
    names = list(layers)
    clock: dict[str, float] = {}
    # the inputs the layers save arrive from outside them (born by an op of no layer)
    ops, events, probes = [op(1000, "aten::to", "forward", "main", 0, 0)], [], {}
    for i, name in enumerate(names):  # forwards in order
        thread = threads.get(name, "main")
        forward = layers[name]["fp32"][0]
        start = clock.get(thread, 0.0)
        ops.append(op(2 * i, "aten::linear", "forward", thread, start, forward, layer=name))
        events.append([start + forward / 2, 0x100 + i, layers[name]["fp32"][2], 1000])
        clock[thread] = start + forward
    for i, name in reversed(list(enumerate(names))):  # backwards in reverse
        thread = threads.get(name, "main")
        backward = layers[name]["fp32"][1]
        start = clock[thread]
        ops.append(op(2 * i + 1, "AddmmBackward0", "backward", thread, start, backward, layer=name))
        events.append([start + backward / 2, 0x100 + i, -layers[name]["fp32"][2], 2 * i + 1])
        clock[thread] = start + backward
    for name, costs in layers.items():
        probes[name] = {
            "input_shape": [10, 100],
            "input_numel": 1000,
            "output_numel": 1000,
            "weight_numel": 1000,
            "costs": {p: _probe(*figures) for p, figures in costs.items()},
        }
    events.sort()
    return trace(
        ops,
        step_end=max(clock.values()),
        memory_events=events,
        resident_bytes={"parameters": 10000},
        precision_costs={"casts": {}, "layers": probes},
        layers=[{"name": n} for n in names],
    )


def _brute_force(predictor, indicator, max_step_ms, memory_budget=None):
    """Every combination of every layer's probed precisions priced by ``predictor``: the feasible
    one with the least summed indicator (None if none is), and the one with the least summed
    relative excess over the constraints (the least damaging of those)."""
    layers = predictor.traces[0].precision_costs["layers"]
    names = sorted(layers)
    options = [[p for p in PRECISIONS if p in layers[n]["costs"]] for n in names]
    best, least = None, None
    for combo in itertools.product(*options):
        choice = {n: p for n, p in zip(names, combo, strict=True) if p != "fp32"}
        priced = predictor.predict(Plan(precision=choice))
        excess = max(0.0, priced.step_ms - max_step_ms) / max_step_ms
        if memory_budget is not None:
            excess += max(0.0, priced.peak_bytes - memory_budget) / memory_budget
        damage = sum(indicator[n][p] for n, p in choice.items())
        if excess == 0 and (best is None or damage < best[0]):
            best = (damage, choice, priced)
        if least is None or (excess, damage) < least[0]:
            least = ((excess, damage), choice, priced)
    return best, least


def _agree(step, indicator, max_step_ms=None, memory_budget=None):
    """Greedy, exact and brute force on ``step``: each returns the same feasible plan, the least
    damaging one that meets the constraints (the greedy's default target where none is given)."""
    predictor = Predictor([step])
    greedy = allocate_precision(
        predictor, indicator, PRECISIONS, max_step_ms=max_step_ms, memory_budget=memory_budget
    )
    target = greedy.target_step_ms
    exact = exact_precision(predictor, indicator, PRECISIONS, max_step_ms=target, memory_budget=memory_budget)
    best, _ = _brute_force(predictor, indicator, target, memory_budget)
    assert best is not None
    damage, choice, priced = best
    layers = step.precision_costs["layers"]
    assert exact.plans_priced == len(list(itertools.product(*(layers[n]["costs"] for n in layers))))
    for found in (greedy, exact):
        assert found.feasible
        assert found.plan.precision == choice
        assert found.indicator == pytest.approx(damage, rel=1e-12)
        assert found.prediction.step_ms == priced.step_ms <= target
        if memory_budget is not None:
            assert found.prediction.peak_bytes == priced.peak_bytes <= memory_budget
    return greedy


def _times(gains, backward=200):
    """fp32 (100, ``backward``, 4000); each other precision with its backward that many us shorter."""
    return {"fp32": (100, backward, 4000), **{p: (100, backward - g, 4000) for p, g in gains.items()}}


def test_greedy_buys_time_where_it_damages_least():
    """The target asks 95 us off a 1200 us step. a alone buys it all, at 10; b then c buy 110 at
    2.5. The greedy takes b (70 us for 1), then c (the 25 us left for 1.5, more per unit than
    b at int8 or d), as exact and the brute force do: a score that ignored the indicator would
    take a (or int8 somewhere) first, which no recovery undoes."""
    layers = {
        "a": _times({"bf16": 100, "int8": 150}),
        "b": _times({"bf16": 70, "int8": 100}),
        "c": _times({"bf16": 40}),
        "d": _times({"bf16": 30, "int8": 35}),
    }
    indicator = {
        "a": {"bf16": 10.0, "int8": 20.0},
        "b": {"bf16": 1.0, "int8": 4.0},
        "c": {"bf16": 1.5},
        "d": {"bf16": 2.0, "int8": 2.2},
    }
    greedy = _agree(_chain_step(layers), indicator, max_step_ms=1.105)
    assert greedy.plan.precision == {"b": "bf16", "c": "bf16"}


def test_recovery_raises_the_most_damaging_layer_first():
    """The target asks 262.3 us off 1150. The greedy lowers l1 (125 us at 0.379), then l4 (125 at
    2.059), then l3 for the 12.3 us left (3.455): 438 us where 313 would do. Recovery, most damaging
    first: l3 back would leave 250 us, short; l4 back leaves l1 and l3's 313: raised. Raising the
    least damaging first raises l1 instead (l3 and l4 still buy 313), a plan of 5.514, not 3.834;
    no recovery keeps all three (5.893)."""
    layers = {
        "l1": {"fp32": (100, 100, 2000), "bf16": (25, 50, 2000), "int8": (100, 100, 500)},
        "l2": {"fp32": (100, 200, 6000), "bf16": (75, 200, 1500), "int8": (200, 100, 6000)},
        "l3": {"fp32": (50, 300, 6000), "bf16": (12, 150, 6000), "int8": (37, 75, 3000)},
        "l4": {"fp32": (100, 200, 4000), "bf16": (75, 100, 1000), "int8": (50, 150, 8000)},
    }
    indicator = {
        "l1": {"bf16": 0.379, "int8": 7.272},
        "l2": {"bf16": 6.904, "int8": 9.606},
        "l3": {"bf16": 3.455, "int8": 6.685},
        "l4": {"bf16": 2.059, "int8": 5.806},
    }
    greedy = _agree(_chain_step(layers), indicator, max_step_ms=0.8877)
    assert greedy.plan.precision == {"l1": "bf16", "l3": "bf16"}


def test_default_target_is_the_fastest_plan_that_fits_the_budget():
    """A 16203-byte budget (24000 recorded) and no time target: the target is the fastest plan that
    fits the budget (every layer at bf16: 1.124 ms, found here by brute force) + 5%. From the
    fastest plan (l2, l3, l4 at bf16: 19000 bytes) the moves by memory saved per time lost take l1
    to int8 (17000), then l4 to int8, which the estimate ranks but which, priced, leaves the peak
    as it was and costs 50 us: kept, it would make the target slower than any plan that fits
    needs. The greedy then meets both constraints only by weighing their excesses together."""
    layers = {
        "l1": {"fp32": (150, 200, 4000), "bf16": (300, 150, 1000), "int8": (150, 200, 2000)},
        "l2": {"fp32": (150, 300, 4000), "bf16": (37, 225, 1000), "int8": (300, 600, 8000)},
        "l3": {"fp32": (200, 200, 4000), "bf16": (150, 200, 1000, 2000), "int8": (150, 200, 1000)},
        "l4": {"fp32": (50, 200, 2000), "bf16": (12, 50, 1000, 2000), "int8": (12, 100, 2000)},
    }
    indicator = {
        "l1": {"bf16": 4.337, "int8": 5.526},
        "l2": {"bf16": 4.421, "int8": 7.565},
        "l3": {"bf16": 0.106, "int8": 6.574},
        "l4": {"bf16": 6.951, "int8": 7.035},
    }
    step = _chain_step(layers)
    budget = 16203
    predictor = Predictor([step])
    fits = [
        predictor.predict(Plan(precision={n: p for n, p in zip(layers, combo, strict=True) if p != "fp32"}))
        for combo in itertools.product(*(list(costs) for costs in layers.values()))
    ]
    fastest_fit = min(p.step_ms for p in fits if p.peak_bytes <= budget)
    assert fastest_fit == pytest.approx(1.124)
    greedy = _agree(step, indicator, memory_budget=budget)
    assert greedy.target_step_ms == pytest.approx(fastest_fit * 1.05, rel=1e-12)
    assert greedy.plan.precision == {n: "bf16" for n in layers}


def test_time_and_memory_excesses_add_up():
    """Both constraints at once: a 20626-byte budget (26000 recorded) and the default time target
    (the fastest plan that fits + 5%). Moves trade one for the other (l1 at int8 saves 4500 bytes
    of saved input for 200 us more forward; l2 at int8 saves 200 us for 6000 bytes more), and on
    the way both are exceeded at once: the greedy reaches the least damaging feasible plan by
    weighing the two excesses together (their sum); by the larger alone it ends infeasible."""
    layers = {
        "l1": {"fp32": (200, 200, 6000), "bf16": (50, 200, 6000), "int8": (400, 200, 1500, 6000)},
        "l2": {"fp32": (200, 200, 6000), "bf16": (200, 100, 6000, 2000), "int8": (150, 50, 12000)},
        "l3": {"fp32": (150, 200, 2000), "bf16": (37, 400, 1000), "int8": (37, 50, 4000, 6000)},
        "l4": {"fp32": (50, 300, 2000), "bf16": (37, 150, 1000, 6000), "int8": (50, 75, 1000)},
    }
    indicator = {
        "l1": {"bf16": 2.463, "int8": 5.78},
        "l2": {"bf16": 3.071, "int8": 8.387},
        "l3": {"bf16": 4.336, "int8": 7.256},
        "l4": {"bf16": 7.024, "int8": 8.518},
    }
    greedy = _agree(_chain_step(layers), indicator, memory_budget=20626)
    assert greedy.plan.precision == {"l1": "int8", "l2": "bf16", "l3": "bf16", "l4": "int8"}


def test_a_move_that_buys_nothing_is_not_kept():
    """a1 and a2 run on the training thread (300 us), b on another (250 us, no lower precision):
    the step ends with the later. Each of a1, a2 at bf16 buys 100 us alone, of which 50 show. The
    0.2 ms target is out of reach (b alone takes 250 us). The greedy lowers a1 (less damaging):
    250 us. a2's estimate (from the recording) still promises 50 us, but priced on the plan it buys
    nothing: the greedy drops it and returns a1 alone, the least damaging of the least violating
    plans, as the exact search does."""
    layers = {
        "a1": {"fp32": (50, 100, 4000), "bf16": (25, 25, 4000)},
        "a2": {"fp32": (50, 100, 4000), "bf16": (25, 25, 4000)},
        "b": {"fp32": (100, 150, 4000)},
    }
    indicator = {"a1": {"bf16": 1.0}, "a2": {"bf16": 2.0}, "b": {}}
    step = _chain_step(layers, threads={"b": "tid:1"})
    predictor = Predictor([step])
    assert predictor.predict().step_ms == pytest.approx(0.3)
    assert predictor.predict(Plan(precision={"a1": "bf16", "a2": "bf16"})).step_ms == pytest.approx(0.25)
    _, (excess, choice, priced) = _brute_force(predictor, indicator, 0.2)
    assert choice == {"a1": "bf16"} and excess[0] == pytest.approx(0.25)
    greedy = allocate_precision(predictor, indicator, PRECISIONS, max_step_ms=0.2)
    exact = exact_precision(predictor, indicator, PRECISIONS, max_step_ms=0.2)
    for found in (greedy, exact):
        assert not found.feasible
        assert found.plan.precision == choice
        assert found.prediction.step_ms == priced.step_ms


# The search step by step, on a stand-in predictor whose prices are sums written in each test.


class _Table:
    """A stand-in predictor: the planner sees a predictor only through its traces (probes, layer
    table, fingerprint), `predict` and `estimate`. A plan's step time and peak are ``base`` (ms,
    bytes) plus, for each layer away from fp32, ``moves[layer][precision]`` (ms, bytes), plus
    ``together[(l1, l2)]`` where both layers are at bf16 (linked neighbours, which ``links``, layer
    -> the next layer of its Sequential, makes partners). `estimate` prices the same way, except
    the moves ``estimated`` gives another change (the one-step estimate a move is ranked by).
    Every plan priced is kept, in order, in ``predicted`` and ``estimated_plans``."""

    def __init__(self, base, moves, together=None, estimated=None, links=None, fingerprint=None):
        self.base, self.moves, self.together = base, moves, together or {}
        self.estimated = {n: {**costs, **(estimated or {}).get(n, {})} for n, costs in moves.items()}
        links = links or {}
        probes = {n: {"costs": dict.fromkeys(["fp32", *costs], {})} for n, costs in moves.items()}
        self.traces = [
            SimpleNamespace(
                fingerprint=fingerprint or {},
                layers=[{"name": n, "type": "Linear", "next": links.get(n)} for n in moves],
                precision_costs={"layers": probes},
            )
        ]
        self.predicted, self.estimated_plans = [], []

    def price(self, choice, moves=None):
        moves = moves or self.moves
        ms, nbytes = self.base
        for name, p in choice.items():
            if p != "fp32":
                ms, nbytes = ms + moves[name][p][0], nbytes + moves[name][p][1]
        for (first, second), (dms, dbytes) in self.together.items():
            if choice.get(first) == choice.get(second) == "bf16":
                ms, nbytes = ms + dms, nbytes + dbytes
        return Prediction(step_ms=ms, peak_bytes=nbytes, replayed_step_ms=[ms], per_rank_peak_bytes=[nbytes])

    def predict(self, plan=None):
        choice = dict(plan.precision) if plan is not None else {}
        self.predicted.append(choice)
        return self.price(choice)

    def estimate(self, choice):
        self.estimated_plans.append(dict(choice))
        return self.price(choice, self.estimated)

    def combinations(self):
        """Every plan (layers away from fp32 only), in the order of the exact search."""
        names = list(self.moves)
        for combo in itertools.product(*(["fp32", *self.moves[n]] for n in names)):
            yield {n: p for n, p in zip(names, combo, strict=True) if p != "fp32"}


def _violation(prediction, max_step_ms, memory_budget):
    excess = 0.0 if max_step_ms is None else max(0.0, prediction.step_ms - max_step_ms) / max_step_ms
    if memory_budget is not None:
        excess += max(0.0, prediction.peak_bytes - memory_budget) / memory_budget
    return excess


def _table_optimum(table, indicator, max_step_ms, memory_budget=None):
    """The brute force on a table: the least damaging feasible plan, else the least violating."""
    scored = []
    for choice in table.combinations():
        violation = _violation(table.price(choice), max_step_ms, memory_budget)
        scored.append((violation, sum(indicator[n][p] for n, p in choice.items()), choice))
    feasible = [row for row in scored if row[0] == 0]
    return min(feasible or scored, key=lambda row: row[:2]), bool(feasible)


def _all_agree(table, indicator, max_step_ms=None, memory_budget=None, precisions=PRECISIONS):
    """The greedy and the exact search on ``table`` return the brute force's plan; returns the
    greedy's choice (and keeps the plans it priced in ``table.greedy_priced``)."""
    greedy = allocate_precision(
        table, indicator, precisions, max_step_ms=max_step_ms, memory_budget=memory_budget
    )
    table.greedy_priced = list(table.predicted)  # what the greedy priced, in order
    target = greedy.target_step_ms
    exact = exact_precision(table, indicator, precisions, max_step_ms=target, memory_budget=memory_budget)
    (violation, damage, choice), feasible = _table_optimum(table, indicator, target, memory_budget)
    for found in (greedy, exact):
        assert found.plan.precision == choice and found.feasible == feasible
        assert found.indicator == pytest.approx(damage, rel=1e-12)
        assert _violation(found.prediction, target, memory_budget) == pytest.approx(violation, abs=1e-12)
    return greedy


def test_candidates_are_the_layers_and_precisions_probed_on_every_rank():
    rank0 = {"a": {"costs": {"fp32": {}, "int8": {}, "bf16": {}}}, "b": {"costs": {"fp32": {}, "bf16": {}}}}
    rank1 = {"a": {"costs": {"fp32": {}, "bf16": {}, "int8": {}}}, "c": {"costs": {"fp32": {}, "bf16": {}}}}
    ranks = [SimpleNamespace(precision_costs={"layers": layers}) for layers in (rank0, rank1)]
    # in the order of PRECISIONS whatever the order asked; fp16 was probed nowhere
    assert candidate_precisions(SimpleNamespace(traces=ranks), ["int8", "fp16", "bf16"]) == {
        "a": ["fp32", "bf16", "int8"]
    }
    assert candidate_precisions(SimpleNamespace(traces=ranks[:1]), ["bf16"]) == {
        "a": ["fp32", "bf16"],
        "b": ["fp32", "bf16"],
    }
    # a rank with no probes at all (recorded without precisions to probe): nothing to choose
    ranks[1].precision_costs = {}
    assert candidate_precisions(SimpleNamespace(traces=ranks), ["bf16"]) == {}


def test_every_plan_and_estimate_priced_is_counted_and_the_plan_carries_its_prediction():
    """One layer whose bf16 halves a 1 ms step, a 0.75 ms target: the greedy prices the recording,
    estimates the recording and the move (the estimates every move is ranked by), prices the move
    (0.5 ms: feasible) and, recovering, fp32 again (1 ms: not): 3 predictions and 2 estimates."""
    table = _Table((1.0, 1000), {"a": {"bf16": (-0.5, 0)}}, fingerprint={"model": "abc123"})
    found = allocate_precision(table, {"a": {"bf16": 1.0}}, ["fp32", "bf16"], max_step_ms=0.75)
    assert table.predicted == [{}, {"a": "bf16"}, {}]
    assert table.estimated_plans == [{}, {"a": "bf16"}]
    assert found.plans_priced == 5
    assert found.feasible and found.indicator == 1.0
    assert found.plan.precision == {"a": "bf16"} and found.plan.fingerprint == {"model": "abc123"}
    assert found.plan.prediction == {"step_ms": 0.5, "peak_bytes": 1000} == found.prediction.figures()
    assert (found.target_step_ms, found.memory_budget) == (0.75, None)
    # a budget the least-memory plan meets exactly (1000 bytes, every plan's peak) is met
    found = allocate_precision(
        table, {"a": {"bf16": 1.0}}, ["fp32", "bf16"], max_step_ms=0.75, memory_budget=1000
    )
    assert found.feasible and found.plan.precision == {"a": "bf16"}
    assert (found.target_step_ms, found.memory_budget) == (0.75, 1000)


def test_a_memory_budget_must_be_positive():
    table = _Table((1.0, 1000), {"a": {"bf16": (0, -100)}})
    for budget in (0, -1):
        with pytest.raises(QSyncInputError, match=rf"^memory budget must be positive, not {budget} bytes$"):
            allocate_precision(table, {}, ["fp32", "bf16"], memory_budget=budget)
    # 1 byte is positive: below every plan's peak, so refused as such, or taken with best effort
    with pytest.raises(QSyncInputError, match="below the smallest predicted peak"):
        allocate_precision(table, {}, ["fp32", "bf16"], memory_budget=1)
    taken = allocate_precision(table, {}, ["fp32", "bf16"], memory_budget=1, best_effort=True)
    assert taken.feasible is False and taken.plan.precision == {"a": "bf16"}


def test_an_impossible_budget_is_refused_naming_the_closest_plan_in_full():
    """The least-memory plan moves both layers (1000 + 500 bytes off 3000, 0.5 ms more): 1500
    bytes, over a 1 KiB budget. Where no move lowers the peak the closest plan is the recording."""
    table = _Table((2.0, 3000), {"a": {"bf16": (0, -1000)}, "b": {"int8": (0.5, -500)}})
    message = (
        "memory budget 1.0 KiB is below the smallest predicted peak 1.5 KiB, reached by the closest "
        "plan: a bf16, b int8 (2.5 ms/step predicted); best effort (best_effort=True, qsync plan "
        "--best-effort) takes it anyway"
    )
    with pytest.raises(QSyncInputError) as refused:
        allocate_precision(table, {}, PRECISIONS, max_step_ms=5.0, memory_budget=1024)
    assert str(refused.value) == message
    taken = allocate_precision(table, {}, PRECISIONS, max_step_ms=5.0, memory_budget=1024, best_effort=True)
    assert taken.feasible is False and taken.plan.precision == {"a": "bf16", "b": "int8"}
    assert (taken.target_step_ms, taken.memory_budget) == (5.0, 1024)
    assert taken.indicator == 0.0  # layers the indicator does not know cost nothing
    assert (taken.prediction.step_ms, taken.prediction.peak_bytes) == (2.5, 1500)
    table = _Table((2.0, 3000), {"a": {"bf16": (0, 100)}})
    with pytest.raises(QSyncInputError) as refused:
        allocate_precision(table, {}, PRECISIONS, memory_budget=1024)
    assert str(refused.value) == (
        "memory budget 1.0 KiB is below the smallest predicted peak 2.9 KiB, reached by the closest "
        "plan: the recorded configuration (2.0 ms/step predicted); best effort (best_effort=True, "
        "qsync plan --best-effort) takes it anyway"
    )


def test_the_simple_plans_keep_only_the_moves_that_pay():
    """fastest_plan: b at bf16 changes nothing, so the per-layer plan leaves it out, and the
    uniform bf16 plan, as fast, does not replace it; where every move is slower it is the
    recording."""
    table = _Table((4.0, 1000), {"a": {"bf16": (-1.0, 0)}, "b": {"bf16": (0, 0)}})
    choice, prediction = fastest_plan(table, PRECISIONS)
    assert choice == {"a": "bf16"} and prediction.step_ms == 3.0
    choice, prediction = least_memory_plan(
        _Table((4.0, 1000), {"a": {"bf16": (0, -10)}, "b": {"bf16": (1.0, 0)}}), PRECISIONS
    )
    assert choice == {"a": "bf16"} and prediction.peak_bytes == 990
    choice, prediction = fastest_plan(_Table((4.0, 1000), {"a": {"bf16": (1.0, 0)}}), PRECISIONS)
    assert choice == {} and prediction.step_ms == 4.0


def test_the_fit_to_a_budget_takes_the_most_memory_per_time_lost_first():
    """No time target and a 11000-byte budget. The fastest plan (f at bf16: 4 ms, 12000 bytes) is
    over it; of the moves that save memory, x saves 1000 bytes for 0.125 ms (8000 bytes/ms), w 400
    for 0.0625 (6400), y 1500 for 0.5 (3000). x alone fits (11000, exactly the budget): the target
    is 4.125 ms + 5%, the fastest plan that fits (by brute force). Ranking by bytes saved alone
    takes y (4.5 ms), by time lost alone w then x (4.1875); going on past the budget, all three."""
    table = _Table(
        (8.0, 10000),
        {
            "f": {"bf16": (-4.0, 2000)},
            "w": {"int8": (0.0625, -400)},
            "x": {"int8": (0.125, -1000)},
            "y": {"int8": (0.5, -1500)},
        },
    )
    budget = 11000
    fits = [table.price(choice) for choice in table.combinations()]
    assert min(p.step_ms for p in fits if p.peak_bytes <= budget) == 4.125
    indicator = {n: dict.fromkeys(costs, 1.0) for n, costs in table.moves.items()}
    greedy = _all_agree(table, indicator, memory_budget=budget)
    assert greedy.target_step_ms == pytest.approx(4.125 * 1.05, rel=1e-12)
    assert greedy.plan.precision == {"f": "bf16", "x": "int8"}


def test_the_fit_stops_where_no_move_promises_memory():
    """The fastest plan (f at bf16: 4 ms, 12000 bytes) is over an 11000-byte budget; x at int8
    saves 3000 bytes when priced, but its estimate shows none: the fit has no move to make and the
    target is the fastest plan's 4 ms + 5%. No plan meets both (x costs 1 ms): the greedy ends on
    the least violating one, as the exact search does."""
    table = _Table(
        (8.0, 10000),
        {"f": {"bf16": (-4.0, 2000)}, "x": {"int8": (1.0, -3000)}},
        estimated={"x": {"int8": (1.0, 0)}},
    )
    indicator = {"f": {"bf16": 1.0}, "x": {"int8": 1.0}}
    greedy = _all_agree(table, indicator, memory_budget=11000)
    assert greedy.target_step_ms == pytest.approx(4.0 * 1.05, rel=1e-12)
    assert not greedy.feasible and greedy.plan.precision == {"f": "bf16"}


@pytest.mark.parametrize(
    ("c_ms", "fit"), [(1.0, {"a": "bf16", "b": "bf16"}), (0.25, {"a": "bf16", "c": "int8"})]
)
def test_the_fit_prices_a_move_with_its_link_partners_as_they_are(c_ms, fit):
    """a and b are linked neighbours (a's next layer is b): at bf16 together they save 3000 bytes
    more than apart. The fastest plan, a at bf16 (6 ms, 12000 bytes), is over a 10000-byte budget.
    b's move, with a at bf16, saves 2500 bytes for 0.5 ms (5000 bytes/ms; alone it would cost 500
    bytes); c's saves 2500 for ``c_ms``: 2500 or 10000 bytes/ms. The fit takes the better one and
    fits: the target is the fastest plan that fits (by brute force) + 5%."""
    table = _Table(
        (10.0, 10000),
        {"a": {"bf16": (-4.0, 2000)}, "b": {"bf16": (0.5, 500)}, "c": {"int8": (c_ms, -2500)}},
        together={("a", "b"): (0, -3000)},
        links={"a": "b"},
    )
    budget = 10000
    fitting = [choice for choice in table.combinations() if table.price(choice).peak_bytes <= budget]
    assert min(fitting, key=lambda choice: table.price(choice).step_ms) == fit
    indicator = {"a": {"bf16": 1.0}, "b": {"bf16": 1.0}, "c": {"int8": 1.0}}
    greedy = allocate_precision(table, indicator, PRECISIONS, memory_budget=budget)
    assert greedy.target_step_ms == pytest.approx(table.price(fit).step_ms * 1.05, rel=1e-12)
    assert greedy.feasible and greedy.prediction.peak_bytes <= budget


def test_the_greedy_prices_a_move_with_its_link_partners_as_they_are():
    """a and b are linked: at bf16 together they save 2 ms more than apart, while b alone costs
    0.5 ms (its casts). The 8 ms target asks 2 ms off 10: the greedy lowers a (9 ms), then b, whose
    move with a at bf16 saves 1.5 ms (7.5 ms): feasible, as the exact search finds. Neither can be
    raised back."""
    table = _Table(
        (10.0, 1000),
        {"a": {"bf16": (-1.0, 0)}, "b": {"bf16": (0.5, 0)}},
        together={("a", "b"): (-2.0, 0)},
        links={"a": "b"},
    )
    greedy = _all_agree(table, {"a": {"bf16": 1.0}, "b": {"bf16": 1.5}}, max_step_ms=8.0)
    assert greedy.plan.precision == {"a": "bf16", "b": "bf16"} and greedy.prediction.step_ms == 7.5
    assert table.greedy_priced == [
        {},
        {"a": "bf16"},
        {"a": "bf16", "b": "bf16"},
        {"a": "bf16"},
        {"b": "bf16"},
    ]


def test_a_move_its_link_partner_makes_worse_is_not_priced():
    """As above, but together a and b save only 0.25 ms more than apart: with a at bf16, b's move
    costs 0.25 ms. The greedy lowers a, then c (1 ms for 3), never pricing a plan with b at bf16
    (measured from the recording, b's move would seem to save 0.75 ms)."""
    table = _Table(
        (10.0, 1000),
        {"a": {"bf16": (-1.0, 0)}, "b": {"bf16": (0.5, 0)}, "c": {"int8": (-1.0, 0)}},
        together={("a", "b"): (-0.25, 0)},
        links={"a": "b"},
    )
    indicator = {"a": {"bf16": 1.0}, "b": {"bf16": 1.5}, "c": {"int8": 3.0}}
    greedy = _all_agree(table, indicator, max_step_ms=8.0)
    assert greedy.plan.precision == {"a": "bf16", "c": "int8"}
    assert table.greedy_priced == [
        {},
        {"a": "bf16"},
        {"a": "bf16", "c": "int8"},
        {"a": "bf16"},
        {"c": "int8"},
    ]


def test_small_indicators_are_weighed_as_they_are():
    """Indicators are noise-to-signal ratios, far below 1. The 8.5 ms target asks 1.5 ms off 10:
    a buys 1 ms for 0.001, c 0.5 for 0.0015, b all 1.5 for 0.004. Per unit of indicator a then c
    (0.0025 together) beat b (0.004): the greedy's plan is the exact search's."""
    table = _Table(
        (10.0, 1000), {"a": {"bf16": (-1.0, 0)}, "b": {"bf16": (-1.5, 0)}, "c": {"bf16": (-0.5, 0)}}
    )
    indicator = {"a": {"bf16": 0.001}, "b": {"bf16": 0.004}, "c": {"bf16": 0.0015}}
    greedy = _all_agree(table, indicator, max_step_ms=8.5)
    assert greedy.plan.precision == {"a": "bf16", "c": "bf16"}


def test_a_move_from_one_low_precision_to_another_costs_the_difference():
    """The 8.5 ms target asks 1.5 ms off 10. The greedy lowers a to bf16 (1 ms for 1.0), then needs
    0.5 ms: a from bf16 to int8 buys it for 2.0 - 1.0 = 1.0 more, b for 1.25 (b's 1 ms is worth no
    more than the 0.5 left). a at int8 (2.0) is the exact search's plan; a and b at bf16 cost 2.25."""
    table = _Table((10.0, 1000), {"a": {"bf16": (-1.0, 0), "int8": (-1.5, 0)}, "b": {"bf16": (-1.0, 0)}})
    indicator = {"a": {"bf16": 1.0, "int8": 2.0}, "b": {"bf16": 1.25}}
    greedy = _all_agree(table, indicator, max_step_ms=8.5)
    assert greedy.plan.precision == {"a": "int8"}


def test_recovery_raises_a_layer_to_the_least_damaging_precision_that_stays_feasible():
    """The 5 ms target asks 5 ms off 10. The greedy lowers a to int8 (4 ms for 3.9), then b (3 ms
    for 3.5): 3 ms, 2 to spare. Recovery, a first (the more damaging): fp32 leaves 7 ms; fp16
    (damage 2.0, 2 ms) meets the target exactly and is taken before bf16 (3.0, as fast), whatever
    the order the precisions come in; then b cannot go back to fp32. Nothing else is priced."""
    table = _Table(
        (10.0, 1000),
        {"a": {"bf16": (-2.0, 0), "fp16": (-2.0, 0), "int8": (-4.0, 0)}, "b": {"bf16": (-3.0, 0)}},
    )
    indicator = {"a": {"bf16": 3.0, "fp16": 2.0, "int8": 3.9}, "b": {"bf16": 3.5}}
    greedy = _all_agree(table, indicator, max_step_ms=5.0, precisions=("fp32", "bf16", "fp16", "int8"))
    assert greedy.plan.precision == {"a": "fp16", "b": "bf16"} and greedy.indicator == 5.5
    assert table.greedy_priced == [
        {},
        {"a": "int8"},
        {"a": "int8", "b": "bf16"},
        {"b": "bf16"},
        {"a": "fp16", "b": "bf16"},
        {"a": "fp16"},
    ]


def test_a_move_whose_estimate_does_not_hold_is_dropped_and_the_search_goes_on():
    """a's estimate promises 2 ms for 0.5, but priced it buys nothing: dropped, the greedy goes on
    to b (2 ms for 1.0) and meets the 8 ms target."""
    table = _Table(
        (10.0, 1000),
        {"a": {"bf16": (0, 0)}, "b": {"bf16": (-2.0, 0)}},
        estimated={"a": {"bf16": (-2.0, 0)}},
    )
    greedy = _all_agree(table, {"a": {"bf16": 0.5}, "b": {"bf16": 1.0}}, max_step_ms=8.0)
    assert greedy.plan.precision == {"b": "bf16"}
    assert table.greedy_priced == [{}, {"a": "bf16"}, {"b": "bf16"}, {}]


def test_a_memory_move_that_saves_nothing_when_priced_is_dropped():
    """A 9000-byte budget (10000 recorded) and a 20 ms target (10 recorded). a's estimate saves
    2000 bytes, priced nothing: dropped; b saves 500. c saves 5000 but costs 20 ms: the
    least-memory plan (all three) meets the budget, not the target, so the greedy does not start
    from it. No plan meets both: the greedy ends on b alone, the least violating plan."""
    table = _Table(
        (10.0, 10000),
        {"a": {"bf16": (0, 0)}, "b": {"bf16": (0, -500)}, "c": {"bf16": (20.0, -5000)}},
        estimated={"a": {"bf16": (0, -2000)}},
    )
    indicator = {n: {"bf16": 1.0} for n in "abc"}
    greedy = _all_agree(table, indicator, max_step_ms=20.0, memory_budget=9000)
    assert not greedy.feasible and greedy.plan.precision == {"b": "bf16"}
    assert least_memory_plan(table, PRECISIONS) == (
        {"a": "bf16", "b": "bf16", "c": "bf16"},
        table.price({"a": "bf16", "b": "bf16", "c": "bf16"}),
    )


def test_the_greedy_starts_from_a_least_memory_plan_that_leaves_layers_out():
    """a and b are linked; a alone adds 1000 bytes, b alone nothing, together they save 2000; c
    only adds. The greedy has no move toward the 8500-byte budget; the least-memory plan (a and b
    at bf16, c as recorded) meets it: the allocator starts there, and keeps it."""
    table = _Table(
        (10.0, 10000),
        {"a": {"bf16": (0, 1000)}, "b": {"bf16": (0, 0)}, "c": {"int8": (0, 500)}},
        together={("a", "b"): (0, -3000)},
        links={"a": "b"},
    )
    indicator = {"a": {"bf16": 2.0}, "b": {"bf16": 1.0}, "c": {"int8": 1.0}}
    greedy = _all_agree(table, indicator, max_step_ms=20.0, memory_budget=8500)
    assert greedy.feasible and greedy.plan.precision == {"a": "bf16", "b": "bf16"}
    assert greedy.prediction.peak_bytes == 8000


def test_the_exact_search_weighs_relative_excesses_and_keeps_the_first_of_equals():
    # bf16 misses the 5000-byte budget by 20% and meets the time; int8 misses both, by 2% and 60%
    table = _Table((10.0, 10000), {"x": {"bf16": (-5.0, -4000), "int8": (-2.0, -4900)}})
    exact = exact_precision(table, {"x": {"bf16": 1.0, "int8": 1.0}}, max_step_ms=5.0, memory_budget=5000)
    assert not exact.feasible and exact.plan.precision == {"x": "bf16"}
    assert (exact.target_step_ms, exact.memory_budget, exact.plans_priced) == (5.0, 5000, 3)
    # no indicator to tell plans apart: the first combination (layers as recorded first) is kept,
    # so a move that buys nothing is not made, feasible or not
    table = _Table((1.0, 1000), {"a": {"bf16": (-0.5, 0)}, "b": {"int8": (0, 0)}})
    assert exact_precision(table, {}, max_step_ms=2.0).plan.precision == {}
    infeasible = exact_precision(table, {}, max_step_ms=0.25)
    assert not infeasible.feasible and infeasible.plan.precision == {"a": "bf16"}
    # 4 combinations: at most 4 allowed, not 3
    assert exact_precision(table, {}, max_step_ms=2.0, max_plans=4).plans_priced == 4
    with pytest.raises(ValueError, match=r"^4 combinations is more than max_plans=3$"):
        exact_precision(table, {}, max_step_ms=2.0, max_plans=3)


def _statistics(names):
    """Layer statistics (`LayerStatistics.to_dict()`) of Linear layers ``names``, in depth order."""
    tensor = {"numel": 1000, "sumsq": 1000.0, "amax_sq_numel": 4000.0, "under_count": 0, "under_sumsq": 0.0}
    return {
        "format": "qsync-layer-statistics",
        "version": 1,
        "layers": {
            name: {
                "kind": "linear",
                "fan_in": 100,
                "depth": depth,
                "calls": 1,
                "input_grad": depth > 1,
                "tensors": {role: {**tensor, "amax": 2.0} for role in TENSOR_ROLES},
            }
            for depth, name in enumerate(names, start=1)
        },
    }


def test_plan_precision_plans_a_recording_with_the_indicator_of_its_statistics():
    """A recorded run's plan: the indicator of rank 0's layer statistics for the precisions asked
    for, then the greedy over its predictor with the constraints given."""
    layers = {
        "a": {"fp32": (100, 200, 4000), "bf16": (100, 150, 4000), "int8": (100, 100, 4000)},
        "b": {"fp32": (100, 200, 4000), "bf16": (100, 150, 4000)},
    }
    step = _chain_step(layers)
    with pytest.raises(
        QSyncInputError, match=r"^the trace has no layer statistics for the precision indicator"
    ):
        plan_precision([step])
    with pytest.raises(QSyncInputError, match=r"record it with QSyncCallback\(mode='apply'\)$"):
        plan_precision([])
    step.layer_statistics = _statistics(["a", "b"])
    # a 0.55 ms target (0.6 recorded): either layer at bf16 buys the 0.05 ms; a at int8 is not asked for
    choice, indicator = plan_precision([step], ["fp32", "bf16"], max_step_ms=0.55)
    assert indicator == sensitivity(step.layer_statistics, ["fp32", "bf16"])
    least = min(indicator, key=lambda name: indicator[name]["bf16"])
    assert choice.feasible and choice.plan.precision == {least: "bf16"} and choice.target_step_ms == 0.55
    greedy = allocate_precision(Predictor([step]), indicator, ["fp32", "bf16"], max_step_ms=0.55)
    assert (choice.plan, choice.indicator) == (greedy.plan, greedy.indicator)
    # every precision by default; a target and a budget the recording meets: nothing to move
    peak = Predictor([step]).predict().peak_bytes
    choice, indicator = plan_precision([step], max_step_ms=1.0, memory_budget=peak)
    assert indicator == sensitivity(step.layer_statistics, PLAN_PRECISIONS) and "int8" in indicator["a"]
    assert choice.feasible and choice.plan.precision == {}
    assert (choice.target_step_ms, choice.memory_budget) == (1.0, peak)
    # a budget below every plan's peak: refused, or taken with best effort
    with pytest.raises(QSyncInputError, match="below the smallest predicted peak"):
        plan_precision([step], memory_budget=1000)
    choice, _ = plan_precision([step], memory_budget=1000, best_effort=True)
    assert choice.feasible is False and choice.memory_budget == 1000


@st.composite
def _tables(draw):
    """Up to three layers, each with one to three low precisions whose moves change the step time
    (multiples of 1/8 ms) and the peak (of 100 bytes) either way, the first two maybe linked; an
    indicator per move; a time target (or the default) and a memory budget (or none)."""
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    ms, nbytes = st.integers(-16, 16).map(lambda k: k / 8), st.integers(-10, 10).map(lambda k: 100 * k)
    moves, indicator = {}, {}
    for name in names:
        lows = draw(st.lists(st.sampled_from(["bf16", "fp16", "int8"]), min_size=1, max_size=3, unique=True))
        moves[name] = {p: (draw(ms), draw(nbytes)) for p in lows}
        indicator[name] = {p: draw(st.integers(1, 16)) / 4 for p in lows}
    together, links = {}, {}
    if len(names) > 1 and "bf16" in moves["a"] and "bf16" in moves["b"] and draw(st.booleans()):
        together, links = {("a", "b"): (draw(ms), draw(nbytes))}, {"a": "b"}
    table = _Table((4.0, 5000), moves, together=together, links=links)
    max_step_ms = draw(st.none() | st.integers(8, 48).map(lambda k: k / 8))
    memory_budget = draw(st.none() | st.integers(8, 28).map(lambda k: 250 * k))
    return table, indicator, max_step_ms, memory_budget


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(_tables())
def test_the_searches_claims_hold_against_the_brute_force(case):
    """On any table: the exact search is the brute force (the least damaging feasible plan, else
    the least damaging of the least violating); the greedy's plan is priced as it says, is
    feasible exactly when it meets both constraints, and is never better than the exact one."""
    table, indicator, max_step_ms, memory_budget = case
    low = ("fp32", "bf16", "fp16", "int8")
    greedy = allocate_precision(
        table, indicator, low, max_step_ms=max_step_ms, memory_budget=memory_budget, best_effort=True
    )
    target = greedy.target_step_ms
    assert target == max_step_ms or max_step_ms is None
    assert greedy.memory_budget == memory_budget
    assert greedy.prediction == table.price(greedy.plan.precision)
    assert greedy.indicator == sum(indicator[n][p] for n, p in greedy.plan.precision.items())
    assert all(p in table.moves[n] for n, p in greedy.plan.precision.items())
    assert greedy.feasible == (_violation(greedy.prediction, target, memory_budget) == 0)
    exact = exact_precision(table, indicator, low, max_step_ms=target, memory_budget=memory_budget)
    (violation, damage, _), feasible = _table_optimum(table, indicator, target, memory_budget)
    assert exact.feasible == feasible and exact.indicator == damage
    assert _violation(exact.prediction, target, memory_budget) == violation
    assert exact.prediction == table.price(exact.plan.precision)
    if greedy.feasible:
        assert exact.feasible and exact.indicator <= greedy.indicator
