"""Pricing and choosing activation policies (recompute, offload) on a hand-written step whose
answers are worked out by hand: a block ``b`` of two layers and a residual add, then a ``head``."""

import itertools
from dataclasses import replace

import numpy as np
import pytest

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Constraints, Plan, module_layers
from qsync_callback.planner.activation import (
    NOTHING_TO_FREE,
    choose_activation,
    exact_activation,
    greedy_activation,
)
from qsync_callback.planner.memory_plan import plan_memory
from qsync_callback.predictor.activation import (
    _bounds,
    _extend,
    _lane,
    module_spans,
    nested_pairs,
    overlaps,
    price_stands,
)
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.trace import Step
from qsync_callback.report import format_memory_plan

from tracebuilder import op, trace

KIB = 4 * 2**10  # the unit of the step's tensors: "100" is 100 of them (400 KiB)
COPY = {  # pinned host memory: copies on a side stream, overlapping the step (the disk tier: below)
    "tier": "pinned",
    "to_store": {"alpha_us": 1.0, "us_per_byte": 0.01 / KIB},
    "from_store": {"alpha_us": 1.0, "us_per_byte": 0.01 / KIB},
}


def _step_ops(gap=0, head_gap=0, step=0, at=0.0):
    """The ops and memory events of `_step`'s step number ``step``, starting at ``at`` us; ``gap``
    as there, ``head_gap``: the host's time before the head's op (everything after it that much
    later). Its end: 80 us after ``at``, plus both gaps."""
    g, h, first = gap, gap + head_gap, 8 * step
    ops = [
        op(first, "aten::conv", "forward", "main", at, 10, step, layer="b.l1", seq=1),
        op(first + 1, "aten::bn", "forward", "main", at + 10 + g, 10, step, layer="b.l2", seq=2),
        op(first + 2, "aten::add", "forward", "main", at + 20 + g, 5, step, seq=3),
        op(first + 3, "aten::linear", "forward", "main", at + 25 + h, 10, step, layer="head", seq=4),
        op(first + 4, "LinearBackward", "backward", "main", at + 40 + h, 10, step, layer="head", seq=4),
        op(first + 5, "AddBackward", "backward", "main", at + 50 + h, 2, step, seq=3),
        op(first + 6, "BnBackward", "backward", "main", at + 52 + h, 10, step, layer="b.l2", seq=2),
        op(first + 7, "ConvBackward", "backward", "main", at + 62 + h, 10, step, layer="b.l1", seq=1),
    ]
    events = [
        [at + 1, 0xA, 100 * KIB, first],
        [at + 11 + g, 0xB, 200 * KIB, first + 1],
        [at + 21 + g, 0xC, 50 * KIB, first + 2],
        [at + 26 + h, 0xD, 10 * KIB, first + 3],
        [at + 45 + h, 0xD, -10 * KIB, first + 4],
        [at + 48 + h, 0xC, -50 * KIB, first + 4],
        [at + 60 + h, 0xB, -200 * KIB, first + 6],
        [at + 70 + h, 0xA, -100 * KIB, first + 7],
    ]
    return ops, events, at + 80 + h


LAYERS = [{"name": n, "type": "X"} for n in ("b.l1", "b.l2", "head")]


def _step(activation_costs=None, temporary=0, gap=0):
    """Forward: b.l1 makes A (100 units), b.l2 makes B (200), the add (no layer) makes C (50, the
    block's output, saved by the head), the head makes D (10: under `MIN_OFFLOAD_BYTES`). Backward
    in reverse, each freeing what its forward op's layer saved. Peak: A+B+C+D = 360 at 26 us.
    ``gap``: the host's time between b.l1's op and b.l2's (everything after it that much later)."""
    ops, events, end = _step_ops(gap)
    if temporary:  # made by b.l2's op, freed by the add: one of the block's forward temporaries
        events += [[11.5 + gap, 0xE, temporary * KIB, 1], [21.5 + gap, 0xE, -temporary * KIB, 2]]
    costs = {"copy": COPY} if activation_costs is None else activation_costs
    return trace(ops, end, memory_events=events, layers=LAYERS, activation_costs=costs)


@pytest.fixture
def predictor():
    return Predictor([_step()])


def test_modules_are_the_layers_and_their_dotted_prefixes():
    assert module_layers(["b.l1", "b.l2", "head"]) == {
        "b": frozenset({"b.l1", "b.l2"}),
        "b.l1": frozenset({"b.l1"}),
        "b.l2": frozenset({"b.l2"}),
        "head": frozenset({"head"}),
    }
    assert nested_pairs(["b", "b.l1", "head", "bb"]) == [("b", "b.l1")]


def test_a_block_span_takes_the_ops_of_no_layer_inside_it(predictor):
    span = predictor.activation.spans(0)[(0, "b")]
    assert [o.id for o in span.forward] == [0, 1, 2]  # the add after its layers
    assert [o.id for o in span.backward] == [5, 6, 7]  # the add's backward before them
    assert sorted(life.bytes for life in span.inside) == [100 * KIB, 200 * KIB]
    assert span.held == [] and span.outputs == []  # C is saved (and freed) by the head


def test_recompute_frees_the_blocks_tensors_after_their_consumer_and_pays_its_forward_again(predictor):
    recorded = predictor.predict()
    assert (recorded.step_ms * 1e3, recorded.peak_bytes) == (80.0, 360 * KIB)
    planned = predictor.predict(Plan(activation={"b": "recompute"}))
    # A is gone after b.l2 (20 us), B after the add (25 us): at 26 us only C and D; the peak is A+B
    # at 11 us, and again when the recompute makes A and B before the add's backward (C, D freed)
    assert planned.peak_bytes == 300 * KIB
    assert planned.step_ms * 1e3 == pytest.approx(80 + 25)  # the block's forward: 10 + 10 + 5 us
    # a policy listed before it, of another kind, does not keep the recompute from being priced
    head = predictor.predict(Plan(activation={"head": "offload"}))
    both = predictor.predict(Plan(activation={"head": "offload", "b": "recompute"}))
    assert both.step_ms * 1e3 == pytest.approx(head.step_ms * 1e3 + 25)


def test_a_recompute_pays_its_forwards_host_gaps_again_too():
    predictor = Predictor([_step(gap=3)])
    assert predictor.predict().step_ms * 1e3 == pytest.approx(83.0)
    planned = predictor.predict(Plan(activation={"b": "recompute"}))
    assert planned.step_ms * 1e3 == pytest.approx(83 + 25 + 3)  # its ops and the 3 us between them


def test_a_plans_step_is_the_recorded_median_step_plus_its_median_change_over_the_steps():
    """Three steps: 80 us; 100 (a host gap of 20 before the head); 90 (a gap of 10 inside b). The
    recompute of b adds its forward again: 25, 25 and 35 us (the gap inside b too). Its steps' own
    median (125, from the second or third) is 35 over the recorded median (90, the third); paired
    step by step, the change is 25."""
    ops, events, steps, at = [], [], [], 0.0
    for step, (gap, head_gap) in enumerate([(0, 0), (0, 20), (10, 0)]):
        step_ops, step_events, end = _step_ops(gap, head_gap, step, at)
        ops += step_ops
        events += step_events
        steps.append(Step(step, at, end))
        at = end
    recorded = replace(
        trace(ops, at, memory_events=events, layers=LAYERS, activation_costs={"copy": COPY}), steps=steps
    )
    predictor = Predictor([recorded])
    assert predictor.predict().replayed_step_ms == pytest.approx([0.080, 0.100, 0.090])
    planned = predictor.predict(Plan(activation={"b": "recompute"}))
    assert planned.replayed_step_ms == pytest.approx([0.105, 0.125, 0.125])
    assert planned.step_ms * 1e3 == pytest.approx(90 + 25)


def test_offload_frees_after_the_copy_and_waits_only_for_a_late_copy_back(predictor):
    planned = predictor.predict(Plan(activation={"b": "offload"}))
    assert planned.peak_bytes == 300 * KIB  # as recompute: A gone at 20 us (copy done at 12), B at 25 (23)
    # asked back when the block's own backward starts (50 us; no offloaded module after it): A takes
    # 1 + 1 us, B 1 + 2 us on the one lane, so the add's backward waits until 55 us
    assert planned.step_ms * 1e3 == pytest.approx(85.0)


def test_a_single_layer_keeps_its_output_so_neither_policy_frees_it(predictor):
    planned = predictor.predict(Plan(activation={"b.l1": "offload"}))
    assert planned.peak_bytes == 360 * KIB
    assert planned.step_ms * 1e3 == pytest.approx(82.0)  # A is still copied out and back


@pytest.mark.parametrize(
    "activation, message",
    [
        ({"c": "recompute"}, "not in the model"),
        ({"b": "recompute", "b.l1": "offload"}, "'b.l1' is inside 'b'"),
    ],
)
def test_plans_that_cannot_be_priced_are_refused(predictor, activation, message):
    with pytest.raises(QSyncInputError, match=message):
        predictor.predict(Plan(activation=activation))


def test_offload_without_a_fitted_copy_cost_is_refused_and_not_offered():
    predictor = Predictor([_step(activation_costs={})])
    with pytest.raises(QSyncInputError, match="no fitted copy cost"):
        predictor.predict(Plan(activation={"b": "offload"}))
    choice = exact_activation(predictor, {}, 300 * KIB)
    assert choice.activation == {"b": "recompute"}
    assert {o.policy for o in choice.options} == {"recompute"}


def test_a_module_the_recorder_refused_is_left_out_with_its_reason():
    predictor = Predictor([_step({"copy": COPY, "refused": {"b": "called twice per step"}})])
    with pytest.raises(QSyncInputError, match="called twice per step"):
        predictor.predict(Plan(activation={"b": "recompute"}))
    choice = exact_activation(predictor, {}, 300 * KIB)
    assert choice.refused["b"] == "called twice per step"
    # nothing else frees: each layer's tensors are its output (B: b.l2's; the add runs in b's
    # forward, not b.l2's) or its input, which its caller may hold
    assert not choice.feasible and choice.activation == {}
    assert choice.prediction.peak_bytes == 360 * KIB


@pytest.mark.parametrize("budget", [360 * KIB, 330 * KIB, 300 * KIB])
def test_the_milp_finds_the_cheapest_plan_that_fits_as_enumeration_does(predictor, budget):
    choice = exact_activation(predictor, {}, budget)
    modules = ["b", "b.l1", "b.l2", "head"]
    best = None
    for policies in itertools.product(["keep", "recompute", "offload"], repeat=len(modules)):
        activation = {m: p for m, p in zip(modules, policies, strict=True) if p != "keep"}
        if nested_pairs(list(activation)):
            continue
        prediction = predictor.predict(Plan(activation=activation))
        if prediction.peak_bytes <= budget and (best is None or prediction.step_ms < best[1]):
            best = (activation, prediction.step_ms)
    assert choice.feasible
    assert choice.prediction.step_ms == pytest.approx(best[1])
    assert choice.prediction.peak_bytes <= budget
    assert choice.method == "milp" and 0 <= choice.solve_s < 60
    greedy = greedy_activation(predictor, {}, budget)
    assert greedy.method == "greedy" and 0 <= greedy.solve_s < 60


def test_a_budget_nothing_meets_returns_the_least_peak_found(predictor):
    for plan in (exact_activation, greedy_activation):
        choice = plan(predictor, {}, 250 * KIB)
        assert not choice.feasible
        assert choice.prediction.peak_bytes == 300 * KIB
    # of the two ways to 300, the cheaper: offload (5 us) rather than recompute (25 us)
    assert exact_activation(predictor, {}, 250 * KIB).activation == {"b": "offload"}
    assert choose_activation(predictor, {}, 250 * KIB).prediction.peak_bytes == 300 * KIB
    refused = exact_activation(predictor, {}, 250 * KIB).refused
    assert refused == {"b.l1": NOTHING_TO_FREE, "b.l2": NOTHING_TO_FREE}  # A, B: their outputs


def test_the_greedy_meets_what_the_milp_meets_here(predictor):
    assert greedy_activation(predictor, {}, 300 * KIB).prediction.peak_bytes <= 300 * KIB


def test_plan_memory_with_the_activation_lever_only_and_its_table(predictor):
    constraints = Constraints.from_arguments(memory_budget=300 * KIB, levers=("activation",))
    choice = plan_memory(predictor.traces, constraints)
    assert choice.feasible
    assert choice.chosen.plan.activation == {"b": "offload"}  # 5 us against recompute's 25
    assert choice.chosen.plan.prediction == {"step_ms": pytest.approx(0.085), "peak_bytes": 300 * KIB}
    assert [c.name for c in choice.candidates] == ["activation"]
    recorded = predictor.predict().figures()
    table = format_memory_plan(choice, recorded)
    assert "meets the constraints; chosen: activation" in table
    assert "b                                                  offload" in table
    assert "2 module(s) left out, as they save nothing either policy could free: b.l1, b.l2" in table


def test_an_offload_moves_no_tensor_under_the_size_the_applier_moves(predictor):
    # the head saved C (its input, 200 KiB) and D (its output, 40 KiB: stays): C goes out after the
    # head's forward op and is asked back at its backward (40 us): 1 + 0.5 us each way
    assert predictor.predict(Plan(activation={"head": "offload"})).step_ms * 1e3 == pytest.approx(81.5)


def test_on_the_disk_tier_the_training_thread_pays_every_copy_and_frees_after_the_consumer():
    disk = {"copy": {**COPY, "tier": "disk"}}
    predictor = Predictor([_step(disk)])
    planned = predictor.predict(Plan(activation={"b": "offload"}))
    # A out (1 + 1 us) after b.l1's op, B out (1 + 2) after b.l2's, both back (2 + 3) before the add's
    # backward: 80 + 2 + 3 + 5 us; freed when their consumers end (20 and 25 us), as recompute does
    assert planned.step_ms * 1e3 == pytest.approx(90.0)
    assert planned.peak_bytes == 300 * KIB


@pytest.mark.parametrize(("in_step", "step_us"), [({"factor": 2.5}, 80 + 2.5 * 10), ({"factor": None}, 90)])
def test_an_offload_trials_factor_scales_every_copy_and_none_leaves_the_fit(in_step, step_us):
    # the copies of the test above (10 us in all) cost what the trial measured the steps paid over
    # the fit's price; a trial that could not tell (factor None) leaves the fit's price
    disk = {"copy": {**COPY, "tier": "disk", "in_step": {"modules": ["b"], **in_step}}}
    planned = Predictor([_step(disk)]).predict(Plan(activation={"b": "offload"}))
    assert planned.step_ms * 1e3 == pytest.approx(step_us)
    assert planned.peak_bytes == 300 * KIB


@pytest.mark.parametrize(
    ("measured", "factor", "step_us"),
    [
        # recomputing b and head (forwards of 25 and 10 us) cost the steps 70 us: twice the price
        ({"change_ms": 0.070, "noise_ms": 0.01}, 2.0, 80 + 2.0 * 25),
        ({"change_ms": 0.0175, "noise_ms": 0.001}, 0.5, 80 + 0.5 * 25),
        # a trial that could not tell leaves the recorded forward's price
        ({"note": "the step's change (+0.01 ms) is within its noise (+-0.02 ms)"}, None, 80 + 25),
        # nor one whose change (45 us +- 10) is within its noise of that price (35 us): at its edge
        ({"change_ms": 0.045, "noise_ms": 0.01}, None, 80 + 25),
    ],
)
def test_a_recompute_trials_factor_is_its_change_over_the_recorded_forward_and_scales_every_recompute(
    measured, factor, step_us
):
    trial = {"modules": ["b", "head"], "rounds": 6, "baseline_ms": 0.08, **measured}
    predictor = Predictor([_step({"copy": COPY, "recompute": {"in_step": trial}})])
    priced = predictor.activation.recompute_trials[0]
    assert priced["factor"] == (None if factor is None else pytest.approx(factor))
    assert priced["priced_ms"] == pytest.approx(0.035)  # the price, whether or not the trial could tell
    if factor is None and "note" not in measured:  # told apart from nothing, not from the price
        note = price_stands(
            measured["change_ms"], measured["noise_ms"], 0.035, "the recorded forward's price"
        )
        assert note is not None and priced["note"] == note
    planned = predictor.predict(Plan(activation={"b": "recompute"}))
    assert planned.step_ms * 1e3 == pytest.approx(step_us)
    assert planned.peak_bytes == 300 * KIB  # the factor prices time, not memory
    assert predictor.predict().step_ms * 1e3 == pytest.approx(80.0)  # nor the recorded configuration


def test_a_trial_calibrates_only_a_change_told_apart_from_its_price():
    assert price_stands(26.5, 2.0, 27.9, "the fit's price") == (
        "the step's change (+26.50 ms) is within its noise (+-2.00 ms) of the fit's price (27.90 ms)"
    )
    assert price_stands(26.0, 2.0, 28.0, "x") is not None  # exactly its noise away: no telling
    assert price_stands(25.75, 2.0, 28.0, "x") is None
    assert price_stands(30.0, 2.0, 28.0, "x") is not None and price_stands(30.25, 2.0, 28.0, "x") is None


def test_a_recompute_trial_of_modules_the_steps_do_not_hold_calibrates_nothing(predictor):
    assert predictor.activation.recompute_trials == [None]  # no trial ran
    trial = {"modules": ["elsewhere"], "rounds": 6, "baseline_ms": 0.08, "change_ms": 0.05, "noise_ms": 0.01}
    priced = Predictor([_step({"copy": COPY, "recompute": {"in_step": trial}})]).activation.recompute_trials[
        0
    ]
    assert priced == {
        **trial,
        "priced_ms": 0.0,
        "factor": None,
        "note": "the trial's modules recompute nothing in the recorded steps",
    }


def test_the_recompute_makes_the_blocks_tensors_again_beside_its_forwards_temporaries():
    predictor = Predictor([_step(temporary=30)])
    assert predictor.activation.spans(0)[(0, "b")].forward_temporaries == 30 * KIB
    assert predictor.predict().peak_bytes == 380 * KIB  # A+B+C+T at 21 us
    # recompute: A+B+T while b.l2's op runs (11.5 us), and again when the forward runs again
    assert predictor.predict(Plan(activation={"b": "recompute"})).peak_bytes == 330 * KIB


def test_a_keep_policy_changes_nothing(predictor):
    recorded, kept = predictor.predict(), predictor.predict(Plan(activation={"b": "keep", "head": "keep"}))
    assert (kept.step_ms, kept.peak_bytes) == (recorded.step_ms, recorded.peak_bytes)


def test_a_budget_the_recording_meets_takes_no_policy(predictor):
    for plan in (exact_activation, greedy_activation, choose_activation):
        choice = plan(predictor, {}, 360 * KIB)
        assert choice.feasible and choice.activation == {}
        assert choice.prediction.step_ms * 1e3 == pytest.approx(80.0)
    assert choose_activation(predictor, {}, 300 * KIB).method == "milp"


def test_copies_wait_on_one_lane_in_request_order():
    lane = _lane([(5.0, 1.0, "c"), (0.0, 2.0, "a"), (1.0, 1.0, "b")])
    assert lane == {"a": (0.0, 2.0), "b": (2.0, 3.0), "c": (5.0, 6.0)}


def test_only_the_cuda_tier_overlaps_the_step():
    assert overlaps({"tier": "pinned"})
    assert not overlaps({"tier": "disk"}) and not overlaps({})


def test_a_layers_span_is_its_own_ops_and_a_blocks_takes_the_ops_of_no_layer_after_it(predictor):
    spans = predictor.activation.spans(0)
    assert [o.id for o in spans[(0, "b.l2")].forward] == [1]  # the add runs in b's forward
    assert [o.id for o in spans[(0, "b.l2")].backward] == [6]
    assert [o.id for o in spans[(0, "b")].forward] == [0, 1, 2]


def _ops(layers):
    return [op(k, "aten::x", "forward", "main", 10 * k, 5, layer=layer) for k, layer in enumerate(layers)]


def test_a_block_takes_the_ops_of_no_layer_up_to_the_next_layers_op_and_no_further():
    ordered = _ops(["a", "b", None, "c"])
    assert [o.id for o in _extend(ordered, 0, 0, True, True)] == [0]  # b follows at once
    assert [o.id for o in _extend(_ops(["a", None]), 0, 0, True, True)] == [0]  # none after: the loss
    assert [o.id for o in _extend(_ops(["a", None, "b"]), 0, 0, True, True)] == [0, 1]
    assert [o.id for o in _extend(_ops(["x", "y", "m"]), 2, 2, False, True)] == [2]
    assert [o.id for o in _extend(_ops(["x", None, "m"]), 2, 2, False, True)] == [1, 2]
    assert [o.id for o in _extend(_ops(["a", None, "b"]), 0, 0, True, False)] == [0]  # a layer: its own


def test_each_layers_first_and_last_position():
    assert _bounds(_ops(["a", "a", None, "b", "a"])) == {"a": (0, 4), "b": (3, 3)}


def test_spans_leave_out_the_update_and_other_threads():
    ops = [
        op(0, "aten::mm", "forward", "main", 0, 10, layer="l"),
        op(1, "aten::mm", "forward", "tid:7", 2, 5, layer="l"),
        op(2, "MmBackward", "backward", "main", 20, 10, layer="l"),
        op(3, "aten::add_", "update", "main", 40, 5),
    ]
    spans = module_spans(trace(ops, 50, layers=[{"name": "l", "type": "X"}]), [], ["l"])
    assert [o.id for o in spans[(0, "l")].forward] == [0] and [o.id for o in spans[(0, "l")].backward] == [2]


def test_a_curves_levels_take_the_extra_tensors_of_their_step(predictor):
    curve = predictor.curves[0]
    extra = {0: (np.array([26.5, 27.0]), np.array([5.0 * KIB, -5.0 * KIB]), np.array([0, 0]))}
    assert curve.levels([extra])[0][1].max() == curve.levels()[0][1].max() + 5 * KIB


def test_a_refused_module_does_not_stop_the_others_and_an_fp32_layer_is_no_lowered_one():
    predictor = Predictor([_step({"copy": COPY, "refused": {"b.l1": "called twice per step"}})])
    choice = exact_activation(predictor, {}, 300 * KIB)
    assert choice.refused == {"b.l1": "called twice per step", "b.l2": NOTHING_TO_FREE}
    assert choice.activation == {"b": "offload"}
    kept = exact_activation(predictor, {"b.l2": "fp32"}, 300 * KIB)  # fp32 is no precision change
    assert kept.activation == {"b": "offload"}
