"""Pricing and choosing precision plans on a hand-written step: graph and liveness transforms,
the greedy allocator against the exact search and size parsing."""

import pytest

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.planner.precision import (
    PrecisionChoice,
    allocate_precision,
    exact_precision,
    fastest_plan,
    least_memory_plan,
)
from qsync_callback.predictor.graph import build_global_graph
from qsync_callback.predictor.precision import apply_precision
from qsync_callback.predictor.predict import Predictor, predict
from qsync_callback.predictor.replay import replay
from qsync_callback.recorder.precision_probes import layer_input_shapes
from qsync_callback.report import format_precision_plan
from qsync_callback.units import parse_bytes, parse_share

from tracebuilder import op, trace

CASTS = {
    "fp32->bf16": {"alpha_us_per_element": 0.001, "beta_us": 1.0, "r2": 1.0},
    "bf16->fp32": {"alpha_us_per_element": 0.001, "beta_us": 1.0, "r2": 1.0},
    "fp32->int8": {"alpha_us_per_element": 0.002, "beta_us": 2.0, "r2": 1.0},
    "int8->fp32": {"alpha_us_per_element": 0.002, "beta_us": 2.0, "r2": 1.0},
}


def _probe(forward, backward, saved, fwd_temp=0.0, bwd_temp=0.0):
    return {
        "forward_us": forward,
        "backward_us": backward,
        "saved_bytes": saved,
        "forward_transient_bytes": fwd_temp,
        "backward_transient_bytes": bwd_temp,
    }


def _layer(costs):
    return {
        "input_shape": [10, 100],
        "input_numel": 1000,
        "output_numel": 1000,
        "weight_numel": 1000,
        "costs": costs,
    }


def _two_layer_step():
    """fc1 -> act -> fc2, backward in reverse, one update; fc2's input (act's output, 0xB) is saved
    by fc2 alone and freed in its backward. Probes: bf16 halves fc1's compute; int8 is slower."""
    ops = [
        op(0, "aten::linear", "forward", "main", 0, 100, layer="fc1"),
        op(1, "aten::gelu", "forward", "main", 100, 20, layer="act"),
        op(2, "aten::linear", "forward", "main", 120, 100, layer="fc2"),
        op(7, "aten::cross_entropy_loss", "forward", "main", 220, 15),
        op(3, "AddmmBackward0", "backward", "main", 240, 200, layer="fc2"),
        op(4, "GeluBackward0", "backward", "main", 440, 40, layer="act"),
        op(5, "AddmmBackward0", "backward", "main", 480, 200, layer="fc1"),
        op(6, "sgd", "update", "main", 700, 50),
    ]
    events = [
        [1, 0xA, 4000, 0],  # fc1 output: act's saved input
        [101, 0xB, 4000, 1],  # act output: fc2's saved input, freed in fc2's backward
        [121, 0xC, 4000, 2],  # fc2 output
        [225, 0xD, 2000, 7],  # a temporary of the loss
        [233, 0xD, -2000, 7],
        [250, 0xB, -4000, 3],
        [260, 0xC, -4000, 3],
        [450, 0xA, -4000, 4],
    ]
    costs = {
        "casts": CASTS,
        "layers": {
            "fc1": _layer(
                {
                    "fp32": _probe(100, 200, 4000),
                    "bf16": _probe(56, 150, 3000),
                    "int8": _probe(300, 400, 1500),
                }
            ),
            "fc2": _layer(
                {
                    "fp32": _probe(100, 200, 4000),
                    "bf16": _probe(56, 150, 3000),
                    "int8": _probe(300, 400, 1500, bwd_temp=6000),
                }
            ),
        },
    }
    return trace(
        ops,
        step_end=760,
        memory_events=events,
        resident_bytes={"parameters": 10000},
        precision_costs=costs,
        layers=[{"name": n} for n in ("fc1", "act", "fc2")],
    )


def test_bf16_layer_is_rescaled_and_gets_its_cast_nodes():
    step = _two_layer_step()
    base = predict([step])
    planned = predict([step], Plan(precision={"fc1": "bf16"}))
    # casts: before 2 x (0.001 * 1000 + 1) = 4 us, after 2 us; compute 56 - 6 = 50 of the probed 100
    forward = 100 * 50 / 100 + 4 + 2
    backward = 200 * 150 / 200
    assert planned.step_ms * 1e3 == pytest.approx(base.step_ms * 1e3 - 300 + forward + backward)
    assert planned.layer_ms["fc1"] * 1e3 == pytest.approx(forward + backward)


def _fork_step(comm_us: float, rank: int = 0, world_size: int = 1):
    """fc1's last forward op launches an all-reduce (comm_us long) and the step runs on into fc2;
    the loss waits for both. Durations and casts are exact binary fractions: at bf16, fc2's forward
    (100 * 0.5 + 4 + 2) ends exactly when a 56 us all-reduce does."""
    casts = {
        "fp32->bf16": {"alpha_us_per_element": 2**-10, "beta_us": 1.0, "r2": 1.0},
        "bf16->fp32": {"alpha_us_per_element": 2**-10, "beta_us": 1.0, "r2": 1.0},
        "fp32->int8": {"alpha_us_per_element": 2**-9, "beta_us": 2.0, "r2": 1.0},
        "int8->fp32": {"alpha_us_per_element": 2**-9, "beta_us": 2.0, "r2": 1.0},
    }
    probes = {"fp32": _probe(100, 200, 4096), "bf16": _probe(56, 150, 2048), "int8": _probe(300, 400, 1024)}
    layer = {**_layer(probes), "input_numel": 1024, "output_numel": 1024, "weight_numel": 1024}
    collective = {"op": "all_reduce", "numel": 10, "bytes": 40}
    ops = [
        op(0, "aten::linear", "forward", "main", 0, 40, layer="fc1"),
        op(1, "aten::add", "forward", "main", 40, 60, layer="fc1"),
        op(2, "gloo:all_reduce", "comm", "comm:1", 100, comm_us, deps=[1], collective=collective),
        op(3, "aten::linear", "forward", "main", 100, 100, layer="fc2"),
        op(4, "aten::cross_entropy_loss", "forward", "main", 200, 10, deps=[2]),
        op(5, "AddmmBackward0", "backward", "main", 210, 200, layer="fc2"),
        op(6, "AddmmBackward0", "backward", "main", 410, 200, layer="fc1"),
        op(7, "sgd", "update", "main", 610, 50),
    ]
    return trace(
        ops,
        step_end=660,
        rank=rank,
        world_size=world_size,
        host="h",
        precision_costs={"casts": casts, "layers": {"fc1": layer, "fc2": layer}},
        layers=[{"name": "fc1"}, {"name": "fc2"}],
    )


def _graph_path(traces, precision):
    """Step time, critical-path share and layer times of the first step priced on a transformed
    copy of its graph (cast nodes inserted), then replayed."""
    graph = apply_precision(build_global_graph(traces, 0), traces, precision)
    result = replay(graph)
    layer_ms = {}
    for _, attrs in graph.nodes(data=True):
        if attrs["layer"] is not None and attrs["kind"] in ("forward", "backward", "cast"):
            layer_ms[attrs["layer"]] = layer_ms.get(attrs["layer"], 0.0) + attrs["dur"] / 1e3
    return result.step_us / 1e3, result.critical_share, layer_ms


@pytest.mark.parametrize("ranks", [1, 2])
def test_precision_plans_priced_in_place_match_the_graph_transform(ranks):
    """The predictor folds each cast into the op it would be inserted next to instead of copying
    the graph: the same step time, critical path and layer times, through a fork and a join."""
    traces = [_fork_step(56.0 - 16 * r, rank=r, world_size=ranks) for r in range(ranks)]
    predictor = Predictor(traces)
    plans = [{}, {"fc1": "bf16"}, {"fc2": "bf16"}, {"fc1": "int8", "fc2": "bf16"}, {"fc2": "int8"}]
    for precision in plans:
        priced = predictor.predict(Plan(precision=precision))
        step_ms, share, layer_ms = _graph_path(traces, precision)
        assert priced.step_ms == pytest.approx(step_ms, rel=1e-12)
        assert priced.critical_path_share == pytest.approx(share, rel=1e-12)
        assert priced.layer_ms == pytest.approx(layer_ms, rel=1e-12)
        assert predictor.estimate(precision).step_ms == priced.step_ms  # one recorded step
    if ranks == 1:
        # fc2 at bf16 ends with the all-reduce: the loss waited for the all-reduce (the cast after
        # fc2 came last among its predecessors), as on the transformed graph
        assert predictor.predict(Plan(precision={"fc2": "bf16"})).critical_path_share["communication"] > 0


def test_saved_bytes_follow_the_precision_and_the_freed_input():
    step = _two_layer_step()
    base = predict([step])
    assert base.peak_bytes == 10000 + 12000 + 2000
    # fc2 at int8 saves 1500 instead of its fp32 input (4000, freed after its forward now)...
    planned = predict([step], Plan(precision={"fc2": "int8"}))
    # ...but its backward's temporaries (6000 more) make the peak there: 10000 + 4000 (0xA) + 4000
    # (0xC, freed in fc2's backward) + 1500 saved + 6000 at the backward's start
    assert planned.peak_bytes == 10000 + 4000 + 4000 + 1500 + 6000
    # at bf16 it saves 3000 instead: 1000 less through the loss
    assert predict([step], Plan(precision={"fc2": "bf16"})).peak_bytes == 10000 + 12000 + 2000 - 1000
    # fc1's input is the batch, not freed: its saved bf16 copy is extra
    assert predict([step], Plan(precision={"fc1": "bf16"})).peak_bytes == 10000 + 12000 + 2000 + 3000


def test_a_partial_batch_saves_and_casts_in_proportion():
    """A step whose fc1 input has half the probed elements (an epoch's last batch): its saved
    activations, temporaries and activation casts are halved; the weight's copy and cast are not."""
    step = _two_layer_step()
    step.ops[0].input_shapes = [[5, 100]]
    base = predict([step])
    planned = predict([step], Plan(precision={"fc1": "bf16"}))
    assert planned.peak_bytes == base.peak_bytes + 3000 // 2
    # casts: before (0.001 * 500 + 1) + (0.001 * 1000 + 1), after 0.001 * 500 + 1; compute 50
    assert planned.layer_ms["fc1"] * 1e3 == pytest.approx(50 + 3.5 + 1.5 + 150)
    bf16 = step.precision_costs["layers"]["fc1"]["costs"]["bf16"]
    bf16.update(saved_activation_bytes=2000, saved_weight_bytes=1000)
    assert predict([step], Plan(precision={"fc1": "bf16"})).peak_bytes == base.peak_bytes + 1000 + 1000


def test_layers_are_probed_at_the_shape_most_recorded_steps_had():
    ops = []
    for step, rows in enumerate([67, 256, 256]):  # the window began with an epoch's last batch
        linear = op(step, "aten::linear", "forward", "main", 100.0 * step, 10, layer="fc1")
        linear.step, linear.input_shapes = step, [[rows, 64]]
        ops.append(linear)
    assert layer_input_shapes(trace(ops, step_end=300), ["fc1", "fc2"]) == {"fc1": [256, 64]}


def test_plans_that_cannot_be_priced_are_refused():
    step = _two_layer_step()
    with pytest.raises(QSyncInputError, match="'act' at bf16 has no probe|has no probe"):
        predict([step], Plan(precision={"act": "bf16"}))
    with pytest.raises(QSyncInputError, match="fc1.*at fp16 has no probe"):
        predict([step], Plan(precision={"fc1": "fp16"}))
    step.precision = {"fc1": "bf16"}
    with pytest.raises(QSyncInputError, match="recorded at bf16"):
        predict([step], Plan(precision={"fc1": "int8"}))


def test_greedy_matches_the_exact_search_and_meets_its_constraints():
    step = _two_layer_step()
    predictor = Predictor([step])
    indicator = {"fc1": {"bf16": 1.0, "int8": 5.0}, "fc2": {"bf16": 2.0, "int8": 3.0}}
    choice, fastest = fastest_plan(predictor, ["fp32", "bf16", "int8"])
    assert choice == {"fc1": "bf16", "fc2": "bf16"}
    greedy = allocate_precision(predictor, indicator, ["fp32", "bf16", "int8"])
    assert greedy.feasible and greedy.prediction.step_ms <= greedy.target_step_ms
    assert greedy.target_step_ms == pytest.approx(fastest.step_ms * 1.05)
    exact = exact_precision(predictor, indicator, ["fp32", "bf16", "int8"], max_step_ms=greedy.target_step_ms)
    assert exact.plans_priced == 9
    assert greedy.indicator == pytest.approx(exact.indicator)
    # a memory budget that only bf16 on fc2 meets (int8's backward temporaries are too large)
    budget = 10000 + 13500
    memory = allocate_precision(
        predictor, indicator, ["fp32", "bf16", "int8"], max_step_ms=10, memory_budget=budget
    )
    assert memory.feasible and memory.plan.precision == {"fc2": "bf16"}
    assert memory.prediction.peak_bytes <= budget


def test_impossible_budget_is_refused_naming_the_closest_plan_unless_best_effort():
    predictor = Predictor([_two_layer_step()])
    closest, least = least_memory_plan(predictor, ["fp32", "bf16", "int8"])
    assert closest == {"fc2": "bf16"}
    with pytest.raises(QSyncInputError, match="below the smallest predicted peak .* closest plan: fc2 bf16"):
        allocate_precision(predictor, {}, ["fp32", "bf16", "int8"], memory_budget=20000)
    taken = allocate_precision(predictor, {}, ["fp32", "bf16", "int8"], memory_budget=20000, best_effort=True)
    assert not taken.feasible and taken.plan.precision == closest
    assert taken.prediction.peak_bytes == least.peak_bytes > 20000


def test_sizes_and_shares_parse_as_people_write_them():
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes(1024) == 1024
    assert parse_share("90%") == pytest.approx(0.9)
    assert parse_share("2GB") is None
    assert parse_bytes("1e9") == parse_bytes(1e9) == 10**9
    for bad in ("lots", "-1GB", "0", "2 GiBs", "0.5", float("nan"), float("inf"), "inf"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(ValueError):
        parse_share("-5%")


def _linked_step():
    """`_two_layer_step` with its layer table (fc1 -> act -> fc2 in one Sequential) and act's
    probes: at bf16 it takes 1.5x as long and saves half."""
    step = _two_layer_step()
    step.layers = [
        {"name": "fc1", "type": "Linear", "next": "act"},
        {"name": "act", "type": "GELU", "next": "fc2"},
        {"name": "fc2", "type": "Linear", "next": None},
    ]
    step.precision_costs["pass_through"] = {
        "act": {
            "input_shape": [10, 100],
            "input_numel": 1000,
            "costs": {
                "fp32": {"forward_us": 20.0, "backward_us": 40.0, "saved_bytes": 4000.0},
                "bf16": {"forward_us": 30.0, "backward_us": 60.0, "saved_bytes": 2000.0},
            },
        }
    }
    return step


def test_linked_neighbours_drop_their_casts_and_halve_what_runs_between():
    step = _linked_step()
    plan = Plan(precision={"fc1": "bf16", "fc2": "bf16"})
    linked = predict([step], plan)
    # fc1: compute 56 - 4 (input, weight casts) - 2 (output cast) = 50, its input and weight casts
    # (4), no output cast; backward 150 less the gradient cast it no longer needs (2)
    assert linked.layer_ms["fc1"] * 1e3 == pytest.approx(50 + 4 + 148)
    # act runs at bf16: its own probes' ratios
    assert linked.layer_ms["act"] * 1e3 == pytest.approx(30 + 60)
    # fc2: only its weight is cast in, its output back; backward keeps its input gradient at bf16
    assert linked.layer_ms["fc2"] * 1e3 == pytest.approx(50 + 2 + 2 + 148)
    # memory at the loss's temporary: fc1's bf16 copy of its input (+3000); act saves what its
    # probe saves at bf16 (2000 less); fc2 saves act's output, now bf16, instead of a copy of its
    # own: its probe's 3000 in place of the 4000 it freed
    assert linked.peak_bytes == 24000 + 3000 - 2000 - 1000
    # the same plan without the layer table's links pays every cast and keeps act at fp32
    step.layers = [{"name": row["name"], "type": row["type"]} for row in step.layers]
    unlinked = predict([step], plan)
    assert unlinked.layer_ms["act"] * 1e3 == pytest.approx(20 + 40)
    assert unlinked.layer_ms["fc1"] * 1e3 == pytest.approx(50 + 4 + 2 + 150)
    assert unlinked.peak_bytes == 24000 + 3000 - 1000  # fc2's copy: 3000 in place of 4000
    # priced in place and on a transformed graph alike
    traces = [_linked_step()]
    step_ms, _, layer_ms = _graph_path(traces, plan.precision)
    assert Predictor(traces).predict(plan).layer_ms == pytest.approx(layer_ms, rel=1e-12)
    assert Predictor(traces).predict(plan).step_ms == pytest.approx(step_ms, rel=1e-12)


def test_a_linked_layer_saves_the_tensor_a_pass_through_layer_also_saves():
    """act saves its own output (as ReLU does), which fc2 saves too: linked, fc2 keeps no copy of
    its own, and that shared tensor shrinks through act's probe alone."""
    step = _linked_step()
    events = {(e[1], e[2] > 0): e for e in step.memory_events}
    events[(0xA, False)][::3] = [101, 1]  # fc1's output: a temporary of act's forward
    events[(0xB, False)][::3] = [450, 4]  # act's output: freed in act's backward
    step.memory_events.sort()
    base = predict([step]).peak_bytes
    assert base == 10000 + 8000 + 2000
    plan = Plan(precision={"fc1": "bf16", "fc2": "bf16"})
    assert predict([step], plan).peak_bytes == base + 3000 - 2000
    step.layers = [{"name": row["name"], "type": row["type"]} for row in step.layers]
    assert predict([step], plan).peak_bytes == base + 3000 + 3000


def _copied_input_step(linked=True):
    """`_linked_step` whose fc1 input is a copy of the batch, freed in fc1's backward; act saves
    nothing at bf16; fc2's int8 backward has no temporaries. ``linked=False``: no layer table links."""
    s = _linked_step()
    s.ops.insert(0, op(8, "aten::copy_", "forward", "main", 0, 0))
    s.memory_events += [[0, 0xE, 4000, 8], [690, 0xE, -4000, 5]]
    s.memory_events.sort()
    s.precision_costs["layers"]["fc2"]["costs"]["int8"]["backward_transient_bytes"] = 0
    s.precision_costs["pass_through"]["act"]["costs"]["bf16"]["saved_bytes"] = 0
    if not linked:
        s.layers = [{"name": row["name"], "type": row["type"]} for row in s.layers]
    return s


def test_least_memory_plan_finds_a_linked_plan_no_single_move_shows():
    """fc1's input (the batch, copied in) is freed in its backward, so each layer alone saves most
    at int8; but bf16 on both links them, and act, between, then saves nothing at bf16."""
    step = _copied_input_step
    choice, prediction = least_memory_plan(Predictor([step(True)]), ["bf16", "int8"])
    assert choice == {"fc1": "bf16", "fc2": "bf16"}
    assert (
        prediction.peak_bytes
        < predict([step(True)], Plan(precision={"fc1": "int8", "fc2": "int8"})).peak_bytes
    )
    choice, _ = least_memory_plan(Predictor([step(False)]), ["bf16", "int8"])
    assert choice == {"fc1": "int8", "fc2": "int8"}


def test_the_printed_plan_says_which_layer_passes_its_output_uncast():
    step = _linked_step()
    plan = Plan(precision={"fc1": "bf16", "fc2": "bf16"})
    choice = PrecisionChoice(plan, predict([step], plan), 0.0, None, None, True, 1)
    indicator = {"fc1": {"bf16": 0.0}, "fc2": {"bf16": 0.0}}
    rows = format_precision_plan(choice, indicator, predict([step]).to_dict(), step.layers).splitlines()
    assert "passes its output uncast to" in rows[4]
    assert rows[5].split()[0] == "fc1" and rows[5].split()[-1] == "fc2"
    assert rows[6].split()[0] == "fc2" and rows[6].split()[-1] != "fc2"  # the last one casts back
    # without a layer table nothing is linked
    assert "fc2" not in format_precision_plan(choice, indicator, predict([step]).to_dict()).splitlines()[5]


def test_greedy_reaches_a_budget_only_linked_moves_meet():
    """Alone, fc1 at bf16 raises the peak and fc2 at bf16 leaves it as it is, so the greedy has no
    move to make; together they are linked and meet the budget: the allocator starts from the
    least-memory plan and keeps what the recovery cannot raise back."""
    step = _copied_input_step()
    step.precision_costs["layers"]["fc1"]["costs"]["bf16"]["saved_bytes"] = 6000
    step.precision_costs["layers"]["fc2"]["costs"]["bf16"]["saved_bytes"] = 4000
    peak = {
        name: predict([step], Plan(precision=plan)).peak_bytes
        for name, plan in [("base", {}), ("fc1", {"fc1": "bf16"}), ("fc2", {"fc2": "bf16"})]
    }
    linked = predict([step], Plan(precision={"fc1": "bf16", "fc2": "bf16"})).peak_bytes
    assert peak["fc1"] > peak["base"] and peak["fc2"] == peak["base"] and linked < peak["base"]
    indicator = {"fc1": {"bf16": 1.0}, "fc2": {"bf16": 1.0}}
    budget = (linked + peak["base"]) // 2
    chosen = allocate_precision(
        Predictor([step]), indicator, ["fp32", "bf16"], max_step_ms=1e9, memory_budget=budget
    )
    assert chosen.feasible and chosen.plan.precision == {"fc1": "bf16", "fc2": "bf16"}
    assert chosen.prediction.peak_bytes == linked <= budget


def test_gradients_flow_back_through_a_link_at_its_precision():
    """A gradient act's backward hands to fc1's (20000 bytes, the backward's peak) is bf16 when fc1
    and fc2 are linked: half of it is gone from the peak; unlinked it stays fp32."""
    plan = Plan(precision={"fc1": "bf16", "fc2": "bf16"})
    step = _linked_step()
    step.memory_events += [[460, 0xF, 20000, 4], [690, 0xF, -20000, 5]]
    step.memory_events.sort()
    assert predict([step]).peak_bytes == 10000 + 20000
    # in the backward: parameters, half the gradient, fc1's bf16 input copy; the loss's peak is higher
    assert predict([step], plan).peak_bytes == 24000 > 10000 + 10000 + 3000
    step.layers = [{"name": row["name"], "type": row["type"]} for row in step.layers]
    assert predict([step], plan).peak_bytes == 10000 + 20000 + 3000


def test_the_plan_table_sets_the_predicted_change_against_the_measured_noise():
    step = _two_layer_step()
    indicator = {"fc1": {"bf16": 0.1}, "fc2": {"bf16": 0.2}}
    choice = allocate_precision(Predictor([step]), indicator, ["fp32", "bf16"])
    recorded = predict([step]).to_dict()
    change = 100 * (choice.prediction.step_ms / recorded["step_ms"] - 1)
    assert change < -1  # the plan is predicted faster
    within = format_precision_plan(choice, indicator, recorded, step.layers, noise_pct=abs(change) + 0.1)
    assert f"predicted change {change:+.1f}% is within the measured step time's noise" in within
    beyond = format_precision_plan(choice, indicator, recorded, step.layers, noise_pct=abs(change) - 0.1)
    assert f"predicted change {change:+.1f}% (measured step time's noise" in beyond
    assert "predicted change" not in format_precision_plan(choice, indicator, recorded, step.layers)
