"""The activation planner against enumeration on hand-written steps of several residual blocks of
random sizes: the MILP's plan is the fastest that fits, a budget nothing meets gets the least peak,
the greedy keeps only what lowers the peak, in its order of bytes freed per microsecond; plans on
top of a precision plan (a lowered layer's saved bytes away with its module's, every plan priced at the
precision);
and the planner's small pieces (`_at`, `_chains`, `_solve`, `_moments`: the moments it leaves out
never decide whether a plan fits)."""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_activation_plans import COPY, _step
from test_precision_plans import _layer, _probe

from qsync_callback.plan import Plan
from qsync_callback.planner.activation import (
    Option,
    _at,
    _chains,
    _moments,
    _solve,
    activation_options,
    choose_activation,
    exact_activation,
    greedy_activation,
)
from qsync_callback.predictor.activation import nested_pairs
from qsync_callback.predictor.predict import Predictor

from tracebuilder import op, trace

KIB = 4 * 2**10
DISK = {  # the disk tier: the training thread pays every copy (10 us + 0.01 us per KiB-unit)
    "tier": "disk",
    "to_store": {"alpha_us": 10.0, "us_per_byte": 0.01 / KIB},
    "from_store": {"alpha_us": 10.0, "us_per_byte": 0.01 / KIB},
}


def _blocks_step(sizes, forward_us, offload=False, prefix=""):
    """Blocks ``b0``, ``b1``, ...: each two layers (``l1`` makes A, ``l2`` makes B, each freed by
    its own layer's backward) and a residual add (no layer) making C, the block's output, freed by
    the next block's first layer's backward (the last one's by the head's); then ``head``.
    ``sizes``: (A, B, C) units per block; ``forward_us``: each block's forward op durations;
    ``prefix``: the blocks' names start with it (``"g."``: the blocks are inside a module ``g``)."""
    ops, events, layers = [], [], []
    t, seq = 0.0, 0
    made = {}
    for i, ((a, b, c), dur) in enumerate(zip(sizes, forward_us, strict=True)):
        l1, l2 = f"{prefix}b{i}.l1", f"{prefix}b{i}.l2"
        for layer, name, size, tag in ((l1, "aten::conv", a, "A"), (l2, "aten::bn", b, "B")):
            ops.append(op(len(ops), name, "forward", "main", t, dur, layer=layer, seq=seq))
            made[(i, tag)] = (t + 1, size, len(ops) - 1)
            t, seq = t + dur, seq + 1
            layers.append({"name": layer, "type": "X"})
        ops.append(op(len(ops), "aten::add", "forward", "main", t, 2, seq=seq))
        made[(i, "C")] = (t + 1, c, len(ops) - 1)
        t, seq = t + 2, seq + 1
    ops.append(op(len(ops), "aten::linear", "forward", "main", t, 5, layer="head", seq=seq))
    layers.append({"name": "head", "type": "X"})
    t += 10
    frees = {}  # backward op id of each tensor's freeing op, by tag
    ops.append(op(len(ops), "LinearBackward", "backward", "main", t, 5, layer="head", seq=seq))
    head_backward, t = len(ops) - 1, t + 5
    for i in reversed(range(len(sizes))):
        ops.append(op(len(ops), "AddBackward", "backward", "main", t, 1, seq=3 * i + 2))
        t += 1
        for layer, tag, name in (
            (f"{prefix}b{i}.l2", "B", "BnBackward"),
            (f"{prefix}b{i}.l1", "A", "ConvBackward"),
        ):
            ops.append(op(len(ops), name, "backward", "main", t, 8, layer=layer, seq=3 * i + (tag == "B")))
            frees[(i, tag)] = (t + 7, len(ops) - 1)
            t += 8
        frees[(i - 1, "C")] = frees[(i, "A")]  # the previous block's output: this block's input
    frees[(len(sizes) - 1, "C")] = (ops[head_backward].start_us + 4, head_backward)
    for n, (key, (born, size, birth)) in enumerate(sorted(made.items())):
        died, death = frees[key]
        events += [[born, 0x100 + n, size * KIB, birth], [died, 0x100 + n, -size * KIB, death]]
    events.sort(key=lambda e: e[0])
    costs = {"copy": DISK} if offload else {}
    return trace(ops, t + 10, memory_events=events, layers=layers, activation_costs=costs)


def _plans(modules, policies=("recompute", "offload")):
    """Every plan of ``policies`` over ``modules`` with no two nested modules both acting."""
    for chosen in itertools.product(["keep", *policies], repeat=len(modules)):
        activation = {m: p for m, p in zip(modules, chosen, strict=True) if p != "keep"}
        if not nested_pairs(list(activation)):
            yield activation


blocks = st.lists(
    st.tuples(st.integers(20, 300), st.integers(20, 300), st.integers(10, 200)), min_size=2, max_size=3
)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=blocks, durations=st.lists(st.integers(5, 40), min_size=3, max_size=3), share=st.floats(0.5, 1.0)
)
def test_recompute_plans_the_milp_and_enumeration_agree(sizes, durations, share):
    """Recompute alone adds up exactly (no copy lane), so the MILP's plan must be the fastest plan
    that fits by the full predictor, and where none fits, the least peak any plan reaches."""
    predictor = Predictor([_blocks_step(sizes, durations[: len(sizes)])])
    recorded = predictor.predict().peak_bytes
    budget = int(share * recorded)
    options, _ = activation_options(predictor, {})
    modules = sorted({o.module for o in options})
    priced = [(a, predictor.predict(Plan(activation=a))) for a in _plans(modules, ("recompute",))]
    fitting = [p.step_ms for _, p in priced if p.peak_bytes <= budget]
    choice = exact_activation(predictor, {}, budget)
    assert choice.feasible == bool(fitting)
    assert set(choice.activation.values()) <= {"recompute"}  # no offload without a copy cost
    if fitting:
        assert choice.prediction.peak_bytes <= budget
        assert choice.prediction.step_ms == pytest.approx(min(fitting))
    else:
        assert choice.prediction.peak_bytes == min(p.peak_bytes for _, p in priced)
    greedy = greedy_activation(predictor, {}, budget)
    assert greedy.feasible == (greedy.prediction.peak_bytes <= budget)
    assert greedy.prediction.peak_bytes <= recorded
    if choice.feasible:
        assert greedy.prediction.step_ms >= choice.prediction.step_ms - 1e-9  # never faster than exact
    both = choose_activation(predictor, {}, budget)
    assert both.feasible == (choice.feasible or greedy.feasible)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=blocks, durations=st.lists(st.integers(5, 80), min_size=3, max_size=3), share=st.floats(0.4, 0.95)
)
def test_with_offload_on_the_disk_tier_the_milp_plan_fits_where_it_says_so(sizes, durations, share):
    predictor = Predictor([_blocks_step(sizes, durations[: len(sizes)], offload=True)])
    budget = int(share * predictor.predict().peak_bytes)
    choice = exact_activation(predictor, {}, budget)
    options, _ = activation_options(predictor, {})
    assert {o.policy for o in options} == {"recompute", "offload"}
    modules = sorted({o.module for o in options})
    peaks = {}
    for activation in _plans(modules):
        prediction = predictor.predict(Plan(activation=activation))
        peaks[frozenset(activation.items())] = prediction
    least = min(p.peak_bytes for p in peaks.values())
    fitting = [p.step_ms for p in peaks.values() if p.peak_bytes <= budget]
    assert choice.prediction == peaks[frozenset(choice.activation.items())]
    assert choice.prediction.peak_bytes >= least
    if choice.feasible:
        assert choice.prediction.peak_bytes <= budget
        # the MILP prices options alone; the plan it returns may cost more than the best together,
        # never less
        assert choice.prediction.step_ms >= min(fitting) - 1e-9
    else:
        assert not fitting or choose_activation(predictor, {}, budget).feasible


def test_each_options_cost_is_its_plan_alone_against_the_recording():
    predictor = Predictor([_blocks_step([(100, 200, 50), (150, 100, 80)], [10, 30], offload=True)])
    base = predictor.estimate({}).step_ms
    options, refused = activation_options(predictor, {})
    assert options
    for option in options:
        alone = predictor.estimate({}, {option.module: option.policy}).step_ms
        assert option.cost_us == pytest.approx(max(0.0, (alone - base) * 1e3))
        assert option.freed_bytes > 0
    # a block's recompute costs its forward again: two layers and the add
    recompute = {o.module: o.cost_us for o in options if o.policy == "recompute"}
    assert recompute["b1"] > recompute["b0"]  # b1's ops take 30 us each, b0's 10
    assert all(module not in refused for module in recompute)


def test_the_greedy_keeps_an_option_only_where_the_peak_went_down():
    predictor = Predictor([_blocks_step([(100, 200, 50), (150, 100, 80)], [10, 30])])
    recorded = predictor.predict().peak_bytes
    choice = greedy_activation(predictor, {}, recorded - 1)
    taken = dict(choice.activation)
    assert taken and choice.feasible
    for module in taken:  # each taken policy lowered the estimate when it joined
        rest = {m: p for m, p in taken.items() if m != module}
        assert predictor.estimate({}, taken).peak_bytes < predictor.estimate({}, rest).peak_bytes or rest
    # a budget the recording meets takes nothing
    assert greedy_activation(predictor, {}, recorded).activation == {}


def test_at_reads_the_change_after_every_event_at_or_before_each_time():
    change = (np.array([1.0, 3.0, 3.0, 7.0]), np.array([5.0, 2.0, -4.0, 0.0]))
    times = np.array([0.0, 1.0, 2.0, 3.0, 6.9, 7.0, 100.0])
    assert _at(change, times).tolist() == [0.0, 5.0, 5.0, -4.0, -4.0, 0.0, 0.0]
    assert _at(None, times).tolist() == [0.0] * len(times)
    assert _at((np.array([]), np.array([])), times).tolist() == [0.0] * len(times)


def test_chains_allow_one_policy_along_nested_modules():
    def option(module, policy):
        return Option(module, policy, 1.0, [], [], 1)

    options = [
        option("a", "recompute"),
        option("a", "offload"),
        option("a.x", "recompute"),
        option("ab", "offload"),
    ]
    rows = _chains(options)
    names = ["a", "a.x", "ab"]  # one row per module, in order
    assert rows.shape == (3, 4)
    assert rows[names.index("a")].tolist() == [1, 1, 0, 0]
    assert rows[names.index("a.x")].tolist() == [1, 1, 1, 0]  # a.x and what holds it
    assert rows[names.index("ab")].tolist() == [0, 0, 0, 1]  # "ab" is not inside "a"


def _three_blocks(offload=False):
    return Predictor([_blocks_step([(100, 200, 50), (150, 100, 80), (60, 90, 40)], [10, 30, 20], offload)])


def test_a_budget_at_a_plans_own_peak_is_met_by_the_fastest_plan_within_it():
    predictor = _three_blocks()
    options, _ = activation_options(predictor, {})
    modules = sorted({o.module for o in options})
    priced = [predictor.predict(Plan(activation=a)) for a in _plans(modules, ("recompute",))]
    for budget in sorted({p.peak_bytes for p in priced}):
        choice = exact_activation(predictor, {}, budget)
        assert choice.feasible and choice.prediction.peak_bytes <= budget
        assert choice.prediction.step_ms == pytest.approx(
            min(p.step_ms for p in priced if p.peak_bytes <= budget)
        )


@pytest.mark.parametrize("offload", [False, True])
def test_a_budget_nothing_meets_gets_the_least_peak_and_says_how_it_was_chosen(offload):
    predictor = _three_blocks(offload)
    options, refused = activation_options(predictor, {})
    modules = sorted({o.module for o in options})
    policies = ("recompute", "offload") if offload else ("recompute",)
    least = min(predictor.predict(Plan(activation=a)).peak_bytes for a in _plans(modules, policies))
    choice = exact_activation(predictor, {}, 1)
    assert not choice.feasible and choice.method == "milp"
    assert choice.prediction.peak_bytes == least  # the linear model is exact on this step
    assert [(o.module, o.policy) for o in choice.options] == [(o.module, o.policy) for o in options]
    assert choice.refused == refused and 0 <= choice.solve_s < 60
    assert choice.prediction == predictor.predict(Plan(activation=choice.activation))
    greedy = greedy_activation(predictor, {}, 1)
    assert not greedy.feasible and greedy.method == "greedy" and greedy.prediction.peak_bytes >= least
    either = choose_activation(predictor, {}, 1)
    assert either.prediction.peak_bytes == min(choice.prediction.peak_bytes, greedy.prediction.peak_bytes)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=blocks, durations=st.lists(st.integers(5, 80), min_size=3, max_size=3), share=st.floats(0.3, 1.0)
)
def test_nested_modules_take_one_policy_and_the_milp_is_still_the_fastest_that_fits(sizes, durations, share):
    """Blocks inside a group ``g``: ``g`` and each ``g.b<i>`` free memory, and at most one of a
    nested pair may act (a policy covers what is inside it)."""
    predictor = Predictor([_blocks_step(sizes, durations[: len(sizes)], prefix="g.")])
    options, _ = activation_options(predictor, {})
    modules = sorted({o.module for o in options})
    assert "g" in modules and "g.b0" in modules
    budget = int(share * predictor.predict().peak_bytes)
    priced = [(a, predictor.predict(Plan(activation=a))) for a in _plans(modules, ("recompute",))]
    fitting = [p.step_ms for _, p in priced if p.peak_bytes <= budget]
    choice = exact_activation(predictor, {}, budget)
    assert not nested_pairs(list(choice.activation))
    assert choice.feasible == bool(fitting)
    if fitting:
        assert choice.prediction.step_ms == pytest.approx(min(fitting))
    else:
        assert choice.prediction.peak_bytes == min(p.peak_bytes for _, p in priced)
    greedy = greedy_activation(predictor, {}, budget)
    assert not nested_pairs(list(greedy.activation))


def test_with_nothing_to_free_a_budget_is_met_only_by_the_recording():
    ops = [
        op(0, "aten::linear", "forward", "main", 0, 10, layer="head", seq=0),
        op(1, "LinearBackward", "backward", "main", 20, 10, layer="head", seq=0),
    ]
    events = [[1, 0x1, 100 * KIB, 0], [25, 0x1, -100 * KIB, 1]]
    step = trace(ops, 40, memory_events=events, layers=[{"name": "head", "type": "X"}], activation_costs={})
    predictor = Predictor([step])
    peak = predictor.predict().peak_bytes
    options, refused = activation_options(predictor, {})
    assert options == [] and set(refused) == {"head"}
    for plan in (exact_activation, greedy_activation, choose_activation):
        assert plan(predictor, {}, peak).feasible and plan(predictor, {}, peak).activation == {}
        below = plan(predictor, {}, peak - 1)
        assert not below.feasible and below.activation == {} and below.prediction.peak_bytes == peak


def _option(module, cost_us):
    return Option(module, "recompute", cost_us, [], [], 1)


def test_solve_takes_each_option_at_most_once_and_one_along_a_chain():
    # one moment that needs 20 freed: "a" twice would do it for 2 us, but an option is taken once
    options = [_option("a", 1.0), _option("b", 5.0)]
    assert _solve(options, np.array([[-10.0, -30.0]]), np.array([-20.0])) == [1]
    # "m" and "m.x" would do it together for 2 us, but they nest: "z" (10 us) alone
    options = [_option("m", 1.0), _option("m.x", 1.0), _option("z", 10.0)]
    assert _solve(options, np.array([[-10.0, -10.0, -20.0]]), np.array([-20.0])) == [2]
    # without a way to free enough there is no plan
    assert _solve(options, np.array([[-10.0, -10.0, -5.0]]), np.array([-20.0])) is None


def test_solve_breaks_a_tie_towards_fewer_changes_and_needs_no_option_where_there_is_room():
    options = [_option("a", 0.0), _option("b", 0.0)]  # b frees nothing: taking it changes nothing
    assert _solve(options, np.array([[-20.0, 0.0]]), np.array([-10.0])) == [0]
    assert _solve(options, np.zeros((0, 2)), np.zeros(0)) == []
    # no options: a plan (of nothing) only where every moment has room, none left included
    assert _solve([], np.zeros((2, 0)), np.array([0.0, 0.5])) == []
    assert _solve([], np.zeros((2, 0)), np.array([0.0, -0.5])) is None


def test_a_single_option_is_the_least_peak_where_no_budget_is_met():
    predictor = Predictor([_blocks_step([(100, 200, 50)], [10])])
    options, _ = activation_options(predictor, {})
    assert [(o.module, o.policy) for o in options] == [("b0", "recompute")]
    choice = exact_activation(predictor, {}, 1)
    assert not choice.feasible and choice.activation == {"b0": "recompute"}
    assert choice.prediction.peak_bytes < predictor.predict().peak_bytes


def _single_peaks(predictor):
    """The predicted peak of each option's plan taken alone, by (module, policy)."""
    options, _ = activation_options(predictor, {})
    return {
        (o.module, o.policy): predictor.predict(Plan(activation={o.module: o.policy})).peak_bytes
        for o in options
    }


@pytest.mark.parametrize(
    ("sizes", "durations", "first"),
    [
        # b0 frees 200 units for 82 us, b1 60 for 12 us: b1 frees more per microsecond
        ([(100, 100, 50), (30, 30, 20)], [40, 5], "b1"),
        # 50 units for 12 us against 160 for 42 us: b0 by bytes / (us + 1), b1 by bytes / (us + 2)
        ([(25, 25, 10), (80, 80, 10)], [5, 20], "b0"),
        # 50 units for 12 us against 175 for 42 us: b1 by bytes / (us + 1), b0 by bytes / (us - 1)
        ([(25, 25, 10), (87, 88, 10)], [5, 20], "b1"),
    ],
)
def test_the_greedy_takes_first_the_option_freeing_most_bytes_per_microsecond_of_cost(
    sizes, durations, first
):
    """A budget either block's recompute meets alone: the greedy takes the one first in its order
    (bytes freed over one microsecond more than the cost, so that a free option still ranks) and
    stops there."""
    predictor = Predictor([_blocks_step(sizes, durations)])
    options, _ = activation_options(predictor, {})
    ranked = sorted(options, key=lambda o: o.freed_bytes / (o.cost_us + 1.0), reverse=True)
    assert ranked[0].module == first  # the order the parameters were worked out by
    budget = max(_single_peaks(predictor).values())
    assert budget < predictor.predict().peak_bytes
    choice = greedy_activation(predictor, {}, budget)
    assert choice.feasible and choice.activation == {first: "recompute"}


def test_the_greedy_passes_over_an_option_that_leaves_the_peak_where_it_is():
    """b0's recompute (first: 400 units for 12 us) makes its tensors again at its backward, and that
    is the peak after it; b1's recompute lowers the recorded peak alone, not that one: not taken."""
    predictor = Predictor([_blocks_step([(200, 200, 10), (30, 30, 20)], [5, 5])])
    recorded = predictor.predict().peak_bytes
    peaks = _single_peaks(predictor)
    assert peaks[("b1", "recompute")] < recorded and peaks[("b0", "recompute")] == 400 * KIB
    choice = greedy_activation(predictor, {}, 1)
    assert choice.activation == {"b0": "recompute"} and choice.prediction.peak_bytes == 400 * KIB
    assert predictor.predict(Plan(activation={"b0": "recompute", "b1": "recompute"})).peak_bytes == 400 * KIB


def test_the_greedy_passes_over_a_modules_second_policy_and_goes_on_to_the_next_module():
    """On the disk tier b0's recompute and offload are first and second in the greedy's order: with
    b0's recompute taken its offload is passed over, and b1 still gets a policy."""
    predictor = Predictor([_blocks_step([(100, 200, 50), (150, 100, 80)], [10, 30], offload=True)])
    options, refused = activation_options(predictor, {})
    ranked = sorted(options, key=lambda o: o.freed_bytes / (o.cost_us + 1.0), reverse=True)
    assert [(o.module, o.policy) for o in ranked[:2]] == [("b0", "recompute"), ("b0", "offload")]
    choice = greedy_activation(predictor, {}, 1)
    assert choice.activation == {"b0": "recompute", "b1": "recompute"} and not choice.feasible
    assert choice.prediction.peak_bytes < min(_single_peaks(predictor).values())
    assert choice.refused == refused and choice.method == "greedy"
    assert [(o.module, o.policy) for o in choice.options] == [(o.module, o.policy) for o in options]


def _probed_blocks(lowered, offload=False):
    """Two blocks whose ``lowered`` layers have a bf16 probe (faster, saving 75 units: 25 more than
    the 50 the recording freed in their backward)."""
    step = _blocks_step([(100, 200, 50), (150, 100, 80)], [10, 30], offload=offload)
    probe = _layer({"fp32": _probe(30, 8, 150 * KIB), "bf16": _probe(10, 4, 75 * KIB)})
    step.precision_costs = {"casts": {}, "layers": dict.fromkeys(lowered, probe)}
    return Predictor([step])


def _alive(predictor, precision, activation, at_us):
    """Units alive right after ``at_us`` in the plan's memory curve."""
    times, level = predictor.curves[0].levels(predictor.extra_lives(precision, activation)[0])[0]
    return _at((times, level), np.array([at_us]))[0] / KIB


@pytest.mark.parametrize("policy", ["recompute", "offload"])
def test_a_policy_on_a_module_with_a_lowered_layer_prices_what_it_saves_at_the_precision(policy):
    """b1.l1 at bf16 saves 25 units more than recorded, from its forward's end (52) until its
    backward lets them go (115). With a policy on b1 what it saves is away from b1's forward start
    (22) until b1's backward begins (99): the 25 go with it and come back then. b1's own A (150)
    and B (100) are gone after their consumers (82, 84) and back at 99; C0 (50, b1's input) stays."""
    predictor = _probed_blocks(["b1.l1"], offload=policy == "offload")
    precision = {"b1.l1": "bf16"}
    # offloading b1.l1 alone writes out what it saves at bf16: the 25 over the recording
    single = {"b1.l1"} if policy == "offload" else set()
    assert {o.module for o in activation_options(predictor, precision)[0]} == {"b0", "b1"} | single
    both = {"b1": policy}
    # 40: b1's forward has begun, b1.l1's has not ended: nothing of the bf16 change yet, either way
    assert _alive(predictor, precision, both, 40) == 500 == _alive(predictor, precision, {}, 40)
    # 60: the recording's 600 (A0 100, B0 200, C0 50, A1 150, B1 100), +25 at bf16 without a policy
    assert _alive(predictor, precision, {}, 60) == 625 and _alive(predictor, precision, both, 60) == 600
    # 90: C1 (80) made, A1 and B1 gone with the policy: 680 - 250, the 25 away too
    assert _alive(predictor, precision, {}, 90) == 705 and _alive(predictor, precision, both, 90) == 430
    # 100: C1 freed (98), A1 and B1 back, and the 25 with them
    assert _alive(predictor, precision, both, 100) == 625 == _alive(predictor, {}, both, 100) + 25
    assert predictor.predict(Plan(precision=precision, activation=both)).peak_bytes == 625 * KIB
    assert predictor.predict(Plan(precision=precision)).peak_bytes == 705 * KIB


def test_a_lowered_layers_change_is_away_until_its_modules_tensors_are_asked_back():
    """b0.l1 at bf16 saves 75 units over the recording (10 to 133), b1.l1 25 (52 to 115). Offloaded,
    b1's tensors are asked back when the backward reaches b1 (99, its AddBackward's start); as an
    option in any plan it joins (the module after it offloaded too: the head, whose backward starts
    at 94), then; b0's, with b1 offloaded too, when the backward reaches b1, not b0 (116)."""
    predictor = _probed_blocks(["b0.l1", "b1.l1"], offload=True)
    precision = {"b0.l1": "bf16", "b1.l1": "bf16"}

    def taken(activation, joined=False):
        """The lowered layers' change taken away: (time, units) of its events."""
        times, deltas, _ = predictor.activation_lives(precision, activation, joined)[0][-1][0]
        return [(float(t), float(d) / KIB) for t, d in zip(times, deltas, strict=True)]

    assert taken({"b1": "offload"}) == [(52, -25), (99, 25)]
    assert taken({"b1": "offload"}, joined=True) == [(52, -25), (94, 25)]
    assert taken({"b0": "offload", "b1": "offload"}) == [(10, -75), (52, -25), (99, 25), (99, 75)]
    assert taken({"b0": "recompute"}) == [(10, -75), (pytest.approx(116 - 1e-3), 75)]  # made again


def test_on_a_precision_plan_the_milp_sees_each_option_as_the_predictor_prices_it():
    """Every block lowered: each option's memory rows on top of the precision plan peak where the
    predictor's estimate of the plan with that option does, and the MILP's plan meets a budget
    below the precision plan's peak, priced at its precision."""
    predictor = _probed_blocks(["b0.l1", "b1.l1"], offload=True)
    precision = {"b0.l1": "bf16", "b1.l1": "bf16"}
    options, _ = activation_options(predictor, precision)
    blocks = {(m, p) for m in ("b0", "b1") for p in ("recompute", "offload")}
    assert {(o.module, o.policy) for o in options} == blocks | {("b1.l1", "offload")}  # b0.l1 holds nothing
    for option in options:
        rows, room = _moments(predictor, precision, [option], 0)
        alone = predictor.estimate(precision, {option.module: option.policy})
        assert (rows[:, 0] - room).max() == alone.peak_bytes
    lowered = predictor.predict(Plan(precision=precision))
    choice = exact_activation(predictor, precision, lowered.peak_bytes - 100 * KIB)
    assert choice.feasible and choice.activation
    assert choice.prediction == predictor.predict(Plan(precision=precision, activation=choice.activation))
    assert choice.prediction.peak_bytes <= lowered.peak_bytes - 100 * KIB


def test_an_offload_whose_copies_have_time_to_move_costs_under_a_microsecond_unrounded():
    step = _blocks_step([(100, 200, 50), (150, 100, 80)], [10, 30])
    fast = {"to_store": {"alpha_us": 0.0, "us_per_byte": 0.001 / KIB}}  # pinned, 1 ns per unit
    step.activation_costs = {"copy": {**COPY, **fast, "from_store": fast["to_store"]}}
    predictor = Predictor([step])
    base = predictor.estimate({}).step_ms
    offloads = [o for o in activation_options(predictor, {})[0] if o.policy == "offload"]
    assert {o.module for o in offloads} == {"b0", "b1"}
    for option in offloads:
        alone = predictor.estimate({}, {option.module: option.policy}).step_ms
        assert 0 < (alone - base) * 1e3 < 1
        assert option.cost_us == pytest.approx((alone - base) * 1e3)


def test_moments_of_a_step_with_no_recorded_memory_are_none():
    ops = [
        op(0, "aten::linear", "forward", "main", 0, 10, layer="head", seq=0),
        op(1, "LinearBackward", "backward", "main", 20, 10, layer="head", seq=0),
    ]
    step = trace(ops, 40, memory_events=[], layers=[{"name": "head", "type": "X"}], activation_costs={})
    rows, room = _moments(Predictor([step]), {}, [], 100)
    assert rows.shape == (0, 0) and room.shape == (0,)


def _regrown_step():
    """`test_activation_plans`' block with a forward temporary of 100 units, and 200 more made by the
    head's backward and freed by the block's last: the recompute, making the block's tensors and
    its temporary again while those 200 are alive, comes 100 above the recording there."""
    step = _step(temporary=100)
    step.memory_events = sorted(
        [*step.memory_events, [41, 0xF, 200 * KIB, 4], [71, 0xF, -200 * KIB, 7]], key=lambda e: e[0]
    )
    return Predictor([step])


@pytest.mark.parametrize(
    ("predictor", "regrows"),
    [(lambda: _three_blocks(False), False), (lambda: _three_blocks(True), False), (_regrown_step, True)],
    ids=["recompute", "offload", "regrown"],
)
def test_the_moments_left_out_never_decide_whether_a_plan_fits(predictor, regrows):
    """The rows at every moment (a budget of -1 keeps all) against those kept for a budget: every
    set of options fits both or neither; and taken alone, an option's row on top of the recording
    peaks where the predictor prices it alone (joined, an offload frees no more than alone)."""
    predictor = predictor()
    options, _ = activation_options(predictor, {})
    every, room = _moments(predictor, {}, options, -1)
    base = -1 - room
    assert (every.max() > 0) == regrows  # an option adds bytes at some moment: only the regrown step
    alone = _single_peaks(predictor)
    joined, joined_room = _moments(predictor, {}, options, -1, joined=True)
    for i, o in enumerate(options):
        assert (base + every[:, i]).max() == alone[(o.module, o.policy)]
        assert (-1 - joined_room + joined[:, i]).max() >= alone[(o.module, o.policy)]
    for budget in np.unique(base)[1:-1]:  # each level of the recording between its least and its peak
        rows, room = _moments(predictor, {}, options, budget)
        assert 0 < len(room) < len(every)
        for x in itertools.product([0, 1], repeat=len(options)):
            assert (base + every @ x <= budget).all() == (rows @ x <= room).all()


def test_solve_parts_only_plans_of_equal_cost_by_their_number_of_changes():
    # "a" frees the 20 needed for 0.5 us; "b" and "c" 10 each for nothing: two free changes are
    # cheaper than one of half a microsecond (the tie-break only parts plans of equal cost)
    options = [_option("a", 0.5), _option("b", 0.0), _option("c", 0.0)]
    assert _solve(options, np.array([[-20.0, -10.0, -10.0]]), np.array([-20.0])) == [1, 2]
