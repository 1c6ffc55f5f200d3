"""The fusion cost model and the region planner on hand-written step graphs (exact figures worked out
by hand from the module docstrings' rules), and the op categories on the names the profiler writes."""

import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.planner import compiled_regions as planner_module
from qsync_callback.planner.compiled_regions import (
    EXHAUSTIVE_MAX,
    MCMC_STEPS,
    UNKNOWN_STEPS_LEFT,
    RegionChoice,
    RegionSearch,
    _heat,
    choose_regions,
    format_region_plan,
    model_optimism,
    probe_errors,
)
from qsync_callback.predictor.compiled_regions import (
    DEFAULT_KERNEL_US,
    FUSIBLE_KIND,
    LIBRARY_KIND,
    REUSE_COMPILE_S,
    VIEW_KIND,
    FusionCosts,
    RegionCost,
    _fit_line,
    _solve_constants,
    apply_regions,
    calibrate,
    check_region_plan,
    fit_fusion_costs,
    input_bytes,
    moved_bytes,
    op_category,
    payback_gate,
    price_region,
    region_candidates,
    region_nodes,
)
from qsync_callback.predictor.graph import build_global_graph
from qsync_callback.predictor.predict import Prediction, Predictor
from qsync_callback.predictor.replay import replay
from qsync_callback.predictor.tensor_fusion import collective_tensors

from tracebuilder import op, trace

BWD = "autograd::engine::evaluate_function: "
COSTS = FusionCosts(op_us=5.0, bytes_per_us=1000.0, kernel_us=10.0, region_us=50.0)
X = [[1000]]  # a float tensor of 4000 bytes
XX = [[1000], [1000]]


def _ops(specs, start_id=0, start=0.0, step=0):
    """Main-thread ops from (name, kind, dur, gap before, module, shapes), one after another."""
    ops, t = [], start
    for i, (name, kind, dur, gap, module, shapes) in enumerate(specs):
        t += gap
        dtypes = ["float"] * len(shapes)
        ops.append(
            op(
                start_id + i,
                name,
                kind,
                "main",
                t,
                dur,
                step=step,
                module=module,
                input_shapes=shapes,
                input_dtypes=dtypes,
            )
        )
        t += dur
    return ops, t


def block_specs(name: str, slow: float = 1.0):
    """One block's forward and backward: layer_norm, linear, view, gelu, add; and their backward
    (the pointwise ops ``slow`` times slower)."""
    forward = [
        ("aten::layer_norm", "forward", 20.0 * slow, 7.0, f"{name}.ln", X),
        ("aten::linear", "forward", 300.0, 6.0, f"{name}.fc", X),
        ("aten::view", "forward", 2.0, 3.0, name, X),
        ("aten::gelu", "forward", 15.0 * slow, 5.0, name, X),
        ("aten::add", "forward", 12.0 * slow, 4.0, name, XX),
    ]
    backward = [
        (BWD + "AddBackward0", "backward", 3.0, 2.0, name, []),
        (BWD + "GeluBackward0", "backward", 25.0 * slow, 2.0, name, []),
        (BWD + "ViewBackward0", "backward", 1.0, 2.0, name, []),
        (BWD + "AddmmBackward0", "backward", 600.0, 2.0, f"{name}.fc", []),
        (BWD + "torch::autograd::AccumulateGrad", "backward", 4.0, 2.0, f"{name}.fc", []),
        (BWD + "NativeLayerNormBackward0", "backward", 45.0 * slow, 2.0, f"{name}.ln", []),
    ]
    return forward, backward


SLOW = 10.0  # pointwise ops slow enough that compiling a block saves time at the default constants


def model_trace(blocks=("b0",), steps_left=None, slow=1.0, pad_us=0.0):
    """The blocks' forwards, then their backwards in reverse; ``pad_us``: a matmul outside every
    module first (a step that regions cannot speed up much)."""
    forward, backward = [], []
    if pad_us:
        forward.append(("aten::mm", "forward", pad_us, 1.0, None, X))
    for name in blocks:
        f, b = block_specs(name, slow)
        forward += f
        backward = b + backward
    ops, end = _ops([*forward, *backward])
    extra = {"compiled_regions": {"steps_left": steps_left}} if steps_left is not None else {}
    return trace(ops, end + 10.0, **extra)


def test_op_categories_on_profiler_names():
    assert op_category("aten::linear") == LIBRARY_KIND
    assert op_category("aten::conv2d") == LIBRARY_KIND
    assert op_category("aten::scaled_dot_product_attention") == LIBRARY_KIND
    assert op_category(BWD + "AddmmBackward0") == LIBRARY_KIND
    assert op_category(BWD + "ConvolutionBackward0") == LIBRARY_KIND
    assert op_category(BWD + "ScaledDotProductFlashAttentionForCpuBackward0") == LIBRARY_KIND
    assert op_category("aten::view") == VIEW_KIND
    assert op_category(BWD + "TransposeBackward0") == VIEW_KIND
    assert op_category(BWD + "UnsafeViewBackward0") == VIEW_KIND
    assert op_category("aten::dropout") == LIBRARY_KIND  # random numbers keep their time
    assert op_category(BWD + "NativeDropoutBackward0") == FUSIBLE_KIND  # a multiply by the mask
    assert op_category("aten::gelu") == FUSIBLE_KIND
    assert op_category(BWD + "NativeLayerNormBackward0") == FUSIBLE_KIND
    assert op_category("aten::layer_norm") == FUSIBLE_KIND


def test_a_region_is_priced_by_the_rules_worked_by_hand():
    graph = build_global_graph([model_trace()], 0)
    cost = price_region(graph, "b0", COSTS)
    # forward: eager 349 us of ops and 18 us of gaps between them (not the one before the first);
    # chains [layer_norm] (10 + 8000 B / 1000) and [gelu, add] (10 + 12000 B / 1000), views free
    forward_eager, forward_compiled = 349 + 18, 300 + 18 + 22 + 50
    # backward (AccumulateGrad stays outside): the fused chains keep 20000 / 28000 of the bytes
    kept = 20000 / 28000
    backward_eager = 3 + 25 + 1 + 600 + 45 + 4 * 2  # AccumulateGrad and the gap before it stay outside
    backward_compiled = 600 + (10 + kept * 20) + (10 + kept * 40) + 50
    assert cost.eager_us == pytest.approx(forward_eager + backward_eager)
    assert cost.compiled_us == pytest.approx(forward_compiled + backward_compiled)
    assert cost.library_us == pytest.approx(900)
    assert cost.fused_kernels == 4
    assert cost.ops == 10
    assert cost.compile_s == pytest.approx(10 * COSTS.compile_s_per_op)


def test_a_leaf_region_holds_only_its_own_ops():
    graph = build_global_graph([model_trace()], 0)
    ln = price_region(graph, "b0.ln", COSTS)
    assert ln.ops == 2 and ln.library_us == 0
    # forward: 10 + 8 + 50; backward: 10 + (8000 / 8000 kept) * 40 + 50
    assert ln.compiled_us == pytest.approx(68 + 100)
    assert ln.eager_us == pytest.approx(20 + 45)
    assert price_region(graph, "nowhere", COSTS) is None


def test_compiling_a_region_in_the_graph_saves_what_the_region_is_priced_to_save():
    t = model_trace(("b0", "b1"))
    graph = build_global_graph([t], 0)
    before = replay(graph).step_us
    cost = price_region(graph, "b1", COSTS)
    after = replay(apply_regions(graph, ["b1"], COSTS)).step_us
    assert before - after == pytest.approx(cost.saving_us)
    both = replay(apply_regions(graph, ["b0", "b1"], COSTS)).step_us
    assert before - both == pytest.approx(2 * cost.saving_us)
    assert replay(graph).step_us == before  # the recorded graph is left alone


def test_the_bandwidth_and_op_cost_are_fitted_on_the_recorded_pointwise_ops():
    small = [("aten::mul", "forward", 6.0, 1.0, "m", [[10]]), ("aten::mul", "forward", 8.0, 1.0, "m", [[10]])]
    large = [("aten::gelu", "forward", 7.0 + 131.072, 1.0, "m", [[16384]])]  # 131072 B moved
    ops, end = _ops([*small, *large])
    costs = fit_fusion_costs([build_global_graph([trace(ops, end + 1)], 0)])
    assert costs.op_us == pytest.approx(7.0)
    assert costs.bytes_per_us == pytest.approx(1000.0)
    assert costs.source == "defaults"


def test_calibration_makes_the_model_match_the_compiled_probe():
    graph = build_global_graph([model_trace()], 0)
    before = price_region(graph, "b0", COSTS)
    probes = {"b0": {"eager_us": 1000.0, "compiled_us": 1000.0, "compile_s": 12.0, "graphs": 1}}
    fitted = calibrate(COSTS, [graph], probes)
    after = price_region(graph, "b0", fitted)
    assert after.compiled_us / after.eager_us == pytest.approx(1.0)
    assert fitted.kernel_us == COSTS.kernel_us  # one probe: the per-region cost takes the rest
    assert fitted.region_us != COSTS.region_us
    assert fitted.compile_s_per_op == pytest.approx(12.0 / before.ops)
    assert "b0" in fitted.source
    broken = {"b0": {**probes["b0"], "graphs": 2}}
    assert calibrate(COSTS, [graph], broken) == COSTS  # a graph break calibrates nothing


def test_the_constants_come_from_the_small_probes_and_the_block_is_priced_as_measured():
    graph = build_global_graph([model_trace(("b0", "b1"))], 0)
    block, ln = price_region(graph, "b0", COSTS), price_region(graph, "b0.ln", COSTS)
    assert (block.fused_kernels, ln.fused_kernels) == (4, 2)
    # the LayerNorm's ratio made by region 30 us (kernel 10 us as the default); the block measured
    # slower than any constants would say (what the model does not see)
    truth = FusionCosts(op_us=5.0, bytes_per_us=1000.0, kernel_us=10.0, region_us=30.0)
    probes = {
        "b0": {"eager_us": block.eager_us, "compiled_us": 1.5 * block.eager_us, "compile_s": 1.0},
        "b0.ln": {"eager_us": ln.eager_us, "compiled_us": price_region(graph, "b0.ln", truth).compiled_us},
    }
    fitted = calibrate(COSTS, [graph], probes)
    assert fitted.kernel_us == COSTS.kernel_us  # one small probe: the kernel cost is kept
    assert fitted.region_us == pytest.approx(30.0)  # the block left out of the fit
    assert dict(fitted.measured_ratio) == pytest.approx(
        {"b0": 1.5, "b0.ln": probes["b0.ln"]["compiled_us"] / ln.eager_us}
    )
    # the block, and its twin, are priced at the block's measured ratio; the model alone is not
    for name in ("b0", "b1"):
        priced = price_region(graph, name, fitted)
        assert priced.measured and priced.compiled_us == pytest.approx(1.5 * priced.eager_us)
        assert not price_region(graph, name, fitted, {}).measured
    # and a plan compiling it replays at that ratio
    before = replay(graph).step_us
    after = replay(apply_regions(graph, ["b1"], fitted)).step_us
    assert after - before == pytest.approx(0.5 * price_region(graph, "b1", fitted).eager_us)


def test_candidates_are_every_module_and_block_that_ran_forward_ops():
    assert region_candidates(["a.b.c", None, "a.d"]) == ["a", "a.b", "a.b.c", "a.d"]
    # "a" never ran a forward of its own (an nn.ModuleList): no region
    assert region_candidates(["a.b.c", None, "a.d"], called_blocks=["a.b"]) == ["a.b", "a.b.c", "a.d"]


def test_the_search_counts_a_repeated_block_compile_once():
    graph = build_global_graph([model_trace(("b0", "b1"), slow=SLOW)], 0)
    search = RegionSearch(graph, COSTS, steps_left=10**6)
    assert search.signature["b0"] == search.signature["b1"]
    first = search.regions["b0"].compile_s
    assert search.compile_s(["b0", "b1"]) == pytest.approx(first + 1.0)
    chosen, value, _ = search.exhaustive()
    assert sorted(chosen) == ["b0", "b1"]
    assert value == pytest.approx(search.value(["b0", "b1"]))


def test_nothing_is_worth_compiling_in_too_few_steps():
    graph = build_global_graph([model_trace(("b0", "b1"), slow=SLOW)], 0)
    search = RegionSearch(graph, COSTS, steps_left=1)
    assert search.exhaustive()[0] == []
    assert search.mcmc(steps=300)[0] == []


@settings(max_examples=10, deadline=None)
@given(st.lists(st.floats(0.0, 400.0), min_size=3, max_size=3), st.integers(1, 10**6))
def test_the_mcmc_finds_what_the_exhaustive_search_finds_on_small_graphs(extra, steps_left):
    specs = []
    for name, more in zip(("b0", "b1", "b2"), extra, strict=True):
        f, b = block_specs(name, SLOW)
        f[3] = (*f[3][:2], 15.0 + more, *f[3][3:])  # a slower gelu: a different saving per block
        specs += f + b
    ops, end = _ops(specs)
    graph = build_global_graph([trace(ops, end + 1)], 0)
    search = RegionSearch(graph, COSTS, steps_left)
    assert len(search.names) <= EXHAUSTIVE_MAX
    best, value, _ = search.exhaustive()
    found, mcmc_value, _ = search.mcmc(steps=600)
    assert search.nested_free(found)
    assert mcmc_value == pytest.approx(value, rel=1e-9, abs=1e-9)


def test_no_region_is_chosen_when_the_compile_does_not_pay_back():
    predictor = Predictor([model_trace(("b0", "b1"), steps_left=3, slow=SLOW)])
    choice = choose_regions(predictor, Plan.empty())
    assert choice.plan is None
    assert "nothing is compiled" in format_region_plan(choice)


def test_the_gate_says_why_nothing_is_worth_compiling():
    t = model_trace(("b0",), slow=SLOW)
    assert payback_gate(t, 10**6) is None
    assert "3 steps left" in payback_gate(t, 3)


def test_a_region_plan_the_trace_cannot_price_is_refused():
    t = model_trace()
    with pytest.raises(QSyncInputError, match="one module"):
        check_region_plan([t], [["b0", "b0.ln"]], "p")
    with pytest.raises(QSyncInputError, match="'nowhere'"):
        check_region_plan([t], [["nowhere"]], "p")
    with pytest.raises(QSyncInputError, match="activation policies cannot be priced together"):
        Predictor([t]).predict(Plan(fused_regions=[["b0"]], activation={"b0": "recompute"}))
    for o in t.ops:
        o.module = None
    with pytest.raises(QSyncInputError, match="names no op's module"):
        check_region_plan([t], [["b0"]], "p")
    t.framework = "tensorflow"
    with pytest.raises(QSyncInputError, match="torch traces only"):
        check_region_plan([t], [["b0"]], "p")


def test_a_region_plan_is_priced_by_the_predictor():
    t = model_trace(("b0", "b1"), slow=SLOW)
    predictor = Predictor([t])
    base = predictor.predict()
    plan = Plan(fused_regions=[["b0"]])
    priced = predictor.predict(plan)
    saving = price_region(predictor.graphs[0], "b0", predictor.fusion_costs).saving_us
    assert base.step_ms - priced.step_ms == pytest.approx(saving / 1e3)
    assert math.isfinite(priced.step_ms)


def test_a_probe_without_fused_kernels_gives_the_region_cost_and_the_others_the_kernel_cost():
    graph = build_global_graph([model_trace()], 0)
    truth = FusionCosts(op_us=5.0, bytes_per_us=1000.0, kernel_us=4.0, region_us=30.0)
    probes = {
        name: {
            "eager_us": price_region(graph, name, COSTS).eager_us,
            "compiled_us": price_region(graph, name, truth).compiled_us,
            "compile_s": 2.0,
            "graphs": 1,
        }
        for name in ("b0", "b0.fc", "b0.ln")
    }
    assert price_region(graph, "b0.fc", COSTS).fused_kernels == 0
    probes["b0"]["compile_s"] = 2.0 + 0.5 * (10 - 2)  # a line: 1 s fixed, 0.5 s per op (b0.fc: 2 ops)
    fitted = calibrate(COSTS, [graph], probes)
    assert fitted.region_us == pytest.approx(30.0)
    assert fitted.kernel_us == pytest.approx(4.0)
    assert fitted.compile_s_per_op == pytest.approx(0.5)
    assert fitted.compile_s_fixed == pytest.approx(1.0)


def test_a_module_that_broke_its_graph_its_twins_and_the_blocks_holding_them_are_left_out():
    graph = build_global_graph([model_trace(("b0", "b1"), slow=SLOW)], 0)
    whole = RegionSearch(graph, COSTS, steps_left=10**6)
    assert {"b0", "b1", "b0.ln", "b1.ln"} <= set(whole.names)
    search = RegionSearch(graph, COSTS, steps_left=10**6, broken=["b0.ln"])
    assert not {"b0", "b1", "b0.ln", "b1.ln"} & set(search.names)
    assert "b0.fc" in search.names or "b0.fc" not in whole.names


def test_a_partial_last_batch_counts_each_regions_compile_twice():
    graph = build_global_graph([model_trace(("b0", "b1"), slow=SLOW)], 0)
    once = RegionSearch(graph, COSTS, steps_left=10**6)
    twice = RegionSearch(graph, COSTS, steps_left=10**6, compiles=2)
    assert twice.compile_s(["b0", "b1"]) == pytest.approx(2 * once.compile_s(["b0", "b1"]))
    saving = once.value(["b0", "b1"]) + once.compile_s(["b0", "b1"])
    assert twice.value(["b0", "b1"]) == pytest.approx(saving - 2 * once.compile_s(["b0", "b1"]))


# --- the region search on two SLOW blocks, worked by hand -------------------------------------------
# A SLOW block (`block_specs`, COSTS): 2102 us eager (790 forward, 1312 backward) against 10870 / 7
# compiled (390 forward; backward 600 + 185 + (10 + 2225 / 7) + 50), 10 ops: 5 s to compile. Its layer
# norm alone: 650 us eager against 68 + 505 compiled, 2 ops: 1 s. Its linear alone saves nothing.
BLOCK_SAVING_US = 3844 / 7
LN_SAVING_US = 77.0


def two_block_search(steps_left):
    graph = build_global_graph([model_trace(("b0", "b1"), slow=SLOW)], 0)
    return RegionSearch(graph, COSTS, steps_left)


def _listed(moves):
    return [(kind, module, sorted(result), weight) for kind, module, result, weight in moves]


def test_the_search_knows_each_regions_saving_children_and_twins():
    search = two_block_search(10**6)
    assert search.names == ["b0", "b0.ln", "b1", "b1.ln"]
    assert search.regions["b0"].saving_us == pytest.approx(BLOCK_SAVING_US)
    assert search.regions["b0.ln"].saving_us == pytest.approx(LN_SAVING_US)
    assert search.regions["b0"].compile_s == pytest.approx(5.0)
    assert search.children == {"b0": ["b0.ln"], "b0.ln": [], "b1": ["b1.ln"], "b1.ln": []}
    assert search.twins["b1"] == {"b0", "b1"} and search.twins["b0.ln"] == {"b0.ln", "b1.ln"}
    assert search.value(["b0", "b1"]) == pytest.approx(2 * BLOCK_SAVING_US - 5.0 - REUSE_COMPILE_S)
    assert search.nested_free([]) and search.nested_free(["b0", "b1.ln"])
    assert not search.nested_free(["b0", "b0.ln"])
    assert not search.nested_free(["b0.ln", "b0"])


def test_from_no_region_each_module_is_compiled_alone_or_with_its_twins():
    assert _listed(two_block_search(10**6)._moves(set(), {})) == [
        ("compile", "b0", ["b0"], 1.0),
        ("compile", "b0", ["b0", "b1"], 1.0),
        ("compile", "b0.ln", ["b0.ln"], 1.0),
        ("compile", "b0.ln", ["b0.ln", "b1.ln"], 1.0),
        ("compile", "b1", ["b1"], 1.0),
        ("compile", "b1", ["b0", "b1"], 1.0),
        ("compile", "b1.ln", ["b1.ln"], 1.0),
        ("compile", "b1.ln", ["b0.ln", "b1.ln"], 1.0),
    ]


def test_fusion_and_partition_moves_are_weighted_by_the_modules_heat():
    search = two_block_search(10**6)
    heat = {"b0": [0.0, math.log(3.0)], "b1": [math.log(5.0)]}  # heats (0 + 2 / 2) / 2 and 4 / 2
    assert _listed(search._moves({"b0.ln", "b1"}, heat)) == [
        ("fuse", "b0", ["b0", "b1"], pytest.approx(1 + 0.5)),
        ("drop", "b0.ln", ["b1"], 1.0),
        ("drop", "b1", ["b0.ln"], 1.0),
        ("partition", "b1", ["b0.ln", "b1.ln"], pytest.approx(1 / (1 + 2.0))),
    ]  # b1.ln sits inside b1, which is compiled: no move
    moves = _listed(search._moves({"b0.ln"}, {}))
    assert [move for move in moves if move[1] != "b1.ln"] == [
        ("fuse", "b0", ["b0"], 1.0),  # no heat yet: weight 1
        ("drop", "b0.ln", [], 1.0),
        ("compile", "b1", ["b0.ln", "b1"], 1.0),  # its twin b0 holds b0.ln: no twins move
    ]


def test_the_heat_is_the_mean_normalized_exponential_value_change():
    assert _heat([]) == 0.0
    assert _heat([0.0, math.log(3.0)]) == pytest.approx(0.5)
    assert _heat([math.log(5.0)]) == pytest.approx(2.0)
    assert _heat([-50.0]) == pytest.approx(-0.5)
    assert _heat([100.0]) == pytest.approx((math.exp(20.0) - 1) / 2)  # a change is clipped at 20


class ScriptedRandom:
    """Stands in for `random.Random` in the planner: proposes the scripted moves (kind, module, the set
    it leads to) and draws the scripted numbers; records the seeds and whether each proposal was
    weighted by its moves' weights."""

    def __init__(self, picks, draws):
        self.picks, self.draws = list(picks), list(draws)
        self.seeds, self.weighted = [], []

    def __call__(self, seed):
        self.seeds.append(seed)
        return self

    def choices(self, moves, weights=None):
        self.weighted.append(weights == [weight for *_, weight in moves])
        kind, module, result = self.picks.pop(0)
        for move in moves:
            if move[:3] == (kind, module, set(result)):
                return [move]
        raise AssertionError(f"no move {kind} {module} -> {result} among {_listed(moves)}")

    def random(self):
        return self.draws.pop(0)


def scripted_walk(monkeypatch, search, steps, picks, draws):
    """``search.mcmc(steps)`` on scripted proposals and draws: its result, the fake generator, the set
    at each step and the heat kept."""
    rng = ScriptedRandom(picks, draws)
    monkeypatch.setattr(planner_module, "random", SimpleNamespace(Random=rng))
    visited, heats = [], []
    real = search._moves

    def moves(current, heat):
        visited.append(sorted(current))
        heats.append(heat)
        return real(current, heat)

    monkeypatch.setattr(search, "_moves", moves)
    return search.mcmc(steps), rng, visited, heats[-1]


def test_the_walk_accepts_a_worse_set_by_the_metropolis_rule_and_keeps_each_modules_heat(monkeypatch):
    # 8000 steps: a block alone saves 4.39 s and takes 5 to compile, a layer norm 0.62 s and 1; the two
    # blocks save 8.79 s and take 6: only the twins move reaches the best set without a loss
    search = two_block_search(8000)
    value = search.value
    scale = 5.0 - 8000 * BLOCK_SAVING_US / 1e6  # the largest loss or gain of one region: a block's
    assert max(abs(value([m])) for m in search.names) == pytest.approx(scale)

    def temperature(step):  # 0.1 of the scale, falling to 0 over the 5 steps
        return 0.1 * scale * (1 - step / 5)

    fuse = value(["b0"]) - value(["b0.ln"])
    partition = value(["b0.ln", "b1"]) - value(["b0", "b1"])
    picks = [
        ("compile", "b0.ln", ["b0.ln"]),  # a loss: accepted, the draw just under its probability
        ("fuse", "b0", ["b0"]),  # a loss: refused, the draw just over
        ("drop", "b0.ln", []),  # a gain: accepted without a draw
        ("compile", "b0", ["b0", "b1"]),  # the twins: the best set
        ("partition", "b0", ["b0.ln", "b1"]),  # a large loss: refused
    ]
    draws = [
        0.99 * math.exp(value(["b0.ln"]) / temperature(0)),
        1.01 * math.exp(fuse / temperature(1)),
        0.5,
    ]
    (best, best_value, steps), rng, visited, heat = scripted_walk(monkeypatch, search, 5, picks, draws)
    assert rng.seeds == [0] and rng.weighted == [True] * 5
    assert visited == [[], ["b0.ln"], ["b0.ln"], [], ["b0", "b1"]]
    assert rng.picks == [] and rng.draws == []
    assert (best, steps) == (["b0", "b1"], 5)
    assert best_value == pytest.approx(2 * 8000 * BLOCK_SAVING_US / 1e6 - 6.0)
    # proposed fusions and partitions heat their module, accepted or not: a fusion by its value
    # change, a partition by its change negated, over the scale
    assert heat == {"b0": [pytest.approx(fuse / scale), pytest.approx(-partition / scale)]}


def test_the_walk_keeps_the_first_of_two_equally_good_sets(monkeypatch):
    search = two_block_search(10**6)
    picks = [("compile", "b0", ["b0"]), ("drop", "b0", []), ("compile", "b1", ["b1"])]
    # dropping b0 loses the scale at 2/3 of the first temperature: probability exp(-15), over a draw of 0
    (best, best_value, steps), rng, visited, _ = scripted_walk(monkeypatch, search, 3, picks, [0.0])
    assert visited == [[], ["b0"], []] and rng.draws == []
    assert (best, steps) == (["b0"], 3)
    assert best_value == pytest.approx(BLOCK_SAVING_US - 5.0)


def test_the_mcmc_finds_a_best_set_only_the_twins_move_reaches():
    search = two_block_search(8000)
    assert all(search.value(s) < 0 for s in (["b0"], ["b1"], ["b0.ln"], ["b0.ln", "b1.ln"], ["b0", "b1.ln"]))
    assert search.exhaustive()[0] == ["b0", "b1"]
    best, value, steps = search.mcmc(steps=200)
    assert (best, steps) == (["b0", "b1"], 200)
    assert value == pytest.approx(2 * 8000 * BLOCK_SAVING_US / 1e6 - 6.0)
    assert search.mcmc() == search.mcmc(MCMC_STEPS, seed=0)
    assert search.mcmc()[2] == MCMC_STEPS


def test_a_search_with_nothing_that_saves_chooses_nothing():
    search = RegionSearch(build_global_graph([model_trace()], 0), COSTS, 10**6)  # not SLOW
    assert search.names == []
    assert search.exhaustive() == ([], 0.0, 1)
    assert search.mcmc(steps=50)[:2] == ([], 0.0)


# --- choose_regions ----------------------------------------------------------------------------------
# The predictor fits its own constants on these traces (`fit_fusion_costs`): op_us 150 (the median
# forward pointwise op at SLOW: layer_norm 200, gelu 150, add 120), 1e4 B/us (no op moves 64 KiB) and
# the default kernel and region costs. A SLOW block then compiles to 402 us forward (300 + 10.8 + 11.2
# + 80) and 6900 / 7 backward (600 + (10 + 100 * 5/7) + (10 + 300 * 5/7) + 80): it saves 5000 / 7 us.
FITTED = FusionCosts(op_us=150.0, bytes_per_us=1e4)
FITTED_BLOCK_SAVING_US = 5000 / 7


def region_trace(blocks=("b0", "b1"), slow=SLOW, pad_us=0.0, **recorded):
    """`model_trace` with ``recorded`` as its ``compiled_regions``."""
    t = model_trace(blocks, slow=slow, pad_us=pad_us)
    t.compiled_regions = dict(recorded)
    return t


@pytest.fixture
def short_walks(monkeypatch):
    """The MCMC walks 200 steps, not `MCMC_STEPS`, where a test is not about the walk (200 steps find
    the best of these few sets; the full walk is slow on a busy machine)."""
    mcmc = RegionSearch.mcmc
    monkeypatch.setattr(RegionSearch, "mcmc", lambda self, steps=200, seed=0: mcmc(self, steps, seed))


def test_choose_regions_prices_the_best_set_by_replay_and_says_how_it_searched(short_walks):
    # a 53 ms matmul outside the blocks: compiling both saves 1.43 ms of 57.2, 2.5%
    probes = {"b0.fc": {}, "b1.fc": {"graphs": 1}}  # no graph broke: nothing is left out
    predictor = Predictor([region_trace(pad_us=53000.0, steps_left=10**6, probes=probes)])
    assert predictor.fusion_costs == FITTED
    choice = choose_regions(predictor, Plan.empty())
    best = 2 * FITTED_BLOCK_SAVING_US - (5.0 + REUSE_COMPILE_S)  # over 10**6 steps: s = us per step
    assert choice.search == {
        "method": "exhaustive",
        "sets": 9,  # per block: nothing, the block, or its layer norm
        "value_s": pytest.approx(best),
        "mcmc_value_s": pytest.approx(best),
        "candidates": 4,
    }
    assert [region.module for region in choice.chosen] == ["b0", "b1"]
    assert choice.compile_s == pytest.approx(5.0 + REUSE_COMPILE_S)
    assert choice.steps_left == 10**6 and choice.probe_errors == {}
    assert choice.costs == FITTED
    saved_ms = 2 * FITTED_BLOCK_SAVING_US / 1e3
    assert choice.prediction.step_ms == pytest.approx(choice.base.step_ms - saved_ms)
    assert 0.02 < saved_ms / choice.base.step_ms < 0.026
    assert choice.plan.fused_regions == [["b0"], ["b1"]]
    assert choice.plan.prediction == choice.prediction.figures()
    table = format_region_plan(choice)
    assert "(4 candidates, exhaustive search; 1000000 steps left; costs: defaults)" in table
    assert "nothing is compiled" not in table


def test_a_region_set_predicted_less_than_two_percent_faster_is_not_chosen(short_walks):
    # a 91 ms matmul outside the blocks: compiling both saves 1.43 ms of 95.2, 1.5%
    choice = choose_regions(Predictor([region_trace(pad_us=91000.0, steps_left=10**6)]), Plan.empty())
    saved_ms = 2 * FITTED_BLOCK_SAVING_US / 1e3
    assert choice.prediction.step_ms == pytest.approx(choice.base.step_ms - saved_ms)
    assert 0.014 < saved_ms / choice.base.step_ms < 0.016
    assert [region.module for region in choice.chosen] == ["b0", "b1"]  # the best set, priced
    assert choice.compile_s == pytest.approx(5.0 + REUSE_COMPILE_S)
    assert choice.plan is None
    table = format_region_plan(choice)
    assert "\n  predicted " in table and table.endswith("nothing is compiled")


def test_the_chosen_regions_go_on_top_of_the_base_plan_and_compile_twice_for_a_smaller_batch(short_walks):
    predictor = Predictor([region_trace(steps_left=10**6, partial_last_batch=True)])
    base = Plan(fused_regions=[["b0"]], constraints={"memory_bytes": 123})
    choice = choose_regions(predictor, base)
    assert choice.base.step_ms == predictor.predict(base).step_ms
    assert choice.base.step_ms == pytest.approx(predictor.predict().step_ms - FITTED_BLOCK_SAVING_US / 1e3)
    # an epoch ends with a smaller batch: every region compiles twice
    assert choice.compile_s == pytest.approx(2 * (5.0 + REUSE_COMPILE_S))
    assert choice.search["value_s"] == pytest.approx(2 * FITTED_BLOCK_SAVING_US - 12.0)
    assert choice.plan.constraints == {"memory_bytes": 123}
    assert choice.plan.fused_regions == [["b0"], ["b1"]]
    assert base.fused_regions == [["b0"]] and base.prediction is None  # the base is left alone


def test_choose_regions_counts_unknown_steps_left_as_unknown_steps_left_steps(short_walks):
    predictor = Predictor([region_trace(slow=100.0)])  # no steps_left recorded
    choice = choose_regions(predictor, Plan.empty())
    saving = price_region(predictor.graphs[0], "b0", predictor.fusion_costs).saving_us
    assert choice.steps_left is None
    assert choice.search["value_s"] == pytest.approx(2 * saving * UNKNOWN_STEPS_LEFT / 1e6 - 6.0)
    assert "; unknown steps left;" in format_region_plan(choice)


def test_choose_regions_leaves_out_what_broke_its_graph_in_the_warm_up():
    predictor = Predictor([region_trace(steps_left=10**6, probes={"b0.ln": {"graphs": 2}})])
    choice = choose_regions(predictor, Plan.empty())
    # b0.ln broke: its twin b1.ln and the blocks holding either would break too
    assert choice.search == {
        "method": "exhaustive",
        "sets": 1,
        "value_s": 0.0,
        "mcmc_value_s": 0.0,
        "candidates": 0,
    }
    assert (choice.plan, choice.chosen, choice.prediction, choice.compile_s) == (None, [], None, 0.0)
    assert choice.probe_errors == {} and choice.steps_left == 10**6


def test_choose_regions_compiles_a_block_only_if_its_forward_ran(short_walks):
    blocks = ("net.0", "net.1")
    predictor = Predictor([region_trace(blocks, steps_left=10**6, called_blocks=list(blocks))])
    every = RegionSearch(predictor.graphs[0], predictor.fusion_costs, 10**6)
    assert "net" in every.names  # holding both blocks, it would save
    choice = choose_regions(predictor, Plan.empty())
    assert choice.search["candidates"] == 4  # net (a ModuleList) never ran a forward
    assert [region.module for region in choice.chosen] == ["net.0", "net.1"]


def test_choose_regions_searches_exhaustively_up_to_the_limit_then_by_mcmc():
    def blocks(n):
        return tuple(f"b{i}" for i in range(n))

    at_limit = choose_regions(Predictor([region_trace(blocks(7), steps_left=10**6)]), Plan.empty())
    assert EXHAUSTIVE_MAX == 14
    assert (at_limit.search["method"], at_limit.search["candidates"]) == ("exhaustive", 14)
    assert at_limit.search["sets"] == 3**7
    predictor = Predictor([region_trace(blocks(8), steps_left=10**6)])
    over = choose_regions(predictor, Plan.empty())
    assert set(over.search) == {"method", "steps", "value_s", "candidates"}
    assert over.search["method"] == "mcmc"
    assert (over.search["steps"], over.search["candidates"]) == (MCMC_STEPS, 16)
    search = RegionSearch(predictor.graphs[0], predictor.fusion_costs, 10**6)
    assert over.search["value_s"] == pytest.approx(search.value([region.module for region in over.chosen]))
    assert over.search["value_s"] > 0 and over.plan is not None


# Two DDP ranks of `model_trace`'s two blocks after a 53 ms matmul: each block's fc gradients go in a
# bucket of their own, all-reduced (100 us) once its AccumulateGrad is done; the optimizer waits for
# both. The op ids: 0 the matmul, 1-10 the forwards, 11-16 b1's backward (15 its fc's AccumulateGrad,
# 16 its layer norm's backward, the block's last), 17-22 b0's (21 and 22).
DDP_REGION_GRADIENTS = {"b1.fc.weight": 4000, "b1.fc.bias": 400, "b0.fc.weight": 4000, "b0.fc.bias": 400}


def _ddp_region_rank(rank: int):
    forward, backward = [], []
    for name in ("b0", "b1"):
        f, b = block_specs(name, SLOW)
        forward += f
        backward = b + backward
    ops, end = _ops([("aten::mm", "forward", 53000.0, 1.0, None, X), *forward, *backward])
    for o in ops:
        o.layer = o.module if o.module and o.module.count(".") == 1 else None  # b0.fc, b0.ln: layers

    def bucket(names):
        tensors = [
            {"name": n, "variable": n, "bytes": DDP_REGION_GRADIENTS[n], "dtype": "float32", "layer": n[:5]}
            for n in names
        ]
        return {"op": "all_reduce", "bytes": sum(t["bytes"] for t in tensors), "tensors": tensors}

    buckets = [["b1.fc.weight", "b1.fc.bias"], ["b0.fc.weight", "b0.fc.bias"]]
    launches = [15, 21]
    for k, (names, launch) in enumerate(zip(buckets, launches, strict=True)):
        start = ops[launch].start_us + ops[launch].dur_us
        ops.append(
            op(
                23 + k,
                "gloo:all_reduce",
                "comm",
                f"comm:{k}",
                start,
                100.0,
                deps=[launch],
                collective=bucket(names),
            )
        )
    ops.append(op(25, "Optimizer.step", "update", "main", end + 110.0, 40.0, deps=[23, 24]))
    communication = {
        "library": "ddp",
        "buckets": [bucket(names)["tensors"] for names in buckets],
        "allreduce_us": {"bytes": [0, 1000], "us": [50.0, 150.0]},
    }
    recorded = {"compiled_regions": {"steps_left": 10**6}} if rank == 0 else {}
    return trace(ops, end + 160.0, rank=rank, world_size=2, host="h", communication=communication, **recorded)


def test_a_compiled_regions_gradients_are_ready_when_its_backward_ends():
    graph = build_global_graph([_ddp_region_rank(0), _ddp_region_rank(1)], 0)

    def launches(g):
        return {t.name: t.launch for t in collective_tensors(g, replay(g).end)}

    eager = launches(graph)
    assert eager["b1.fc.weight"] == eager["b1.fc.bias"] == ("r0/15", "r1/15")  # fc's AccumulateGrad
    assert eager["b0.fc.weight"] == ("r0/21", "r1/21")
    compiled = launches(apply_regions(graph, ["b1"], FITTED))
    # b1's region: its backward ends with its layer norm's (16), after its fc's AccumulateGrad
    assert compiled["b1.fc.weight"] == compiled["b1.fc.bias"] == ("r0/16", "r1/16")
    assert compiled["b0.fc.weight"] == compiled["b0.fc.bias"] == ("r0/21", "r1/21")  # not compiled
    both = launches(apply_regions(graph, ["b1", "b0"], FITTED))
    assert both["b0.fc.weight"] == ("r0/22", "r1/22") and both["b1.fc.bias"] == ("r0/16", "r1/16")


def test_regions_on_a_bucket_plan_merge_the_buckets_they_would_split(short_walks):
    predictor = Predictor([_ddp_region_rank(0), _ddp_region_rank(1)])
    base = Plan(buckets=[["b1.fc.weight"], ["b1.fc.bias", "b0.fc.weight", "b0.fc.bias"]])
    choice = choose_regions(predictor, base)
    assert [region.module for region in choice.chosen] == ["b0", "b1"]
    # b1's gradients come out of its compiled backward together: one bucket from b1's to b0's
    assert choice.plan.buckets == [["b1.fc.weight", "b1.fc.bias", "b0.fc.weight", "b0.fc.bias"]]
    assert choice.plan.fused_regions == [["b0"], ["b1"]]
    assert choice.prediction == predictor.predict(choice.plan)
    assert base.buckets == [["b1.fc.weight"], ["b1.fc.bias", "b0.fc.weight", "b0.fc.bias"]]  # left alone
    # on the recorded buckets, which split no block, the plan keeps them
    recorded = Plan(buckets=[["b1.fc.weight", "b1.fc.bias"], ["b0.fc.weight", "b0.fc.bias"]])
    assert choose_regions(predictor, recorded).plan.buckets == recorded.buckets


def test_probe_errors_compare_the_model_with_each_probe_that_measured_both_times(short_walks):
    probes = {
        "b0.ln": {"eager_us": 100.0},  # no compiled time: skipped
        "b0.fc": {"compiled_us": 5.0},  # no eager time: skipped
        "nowhere": {"eager_us": 10.0, "compiled_us": 5.0},  # ran no recorded op: skipped
        "b0": {"eager_us": 1000.0, "compiled_us": 800.0, "compile_s": 12.0, "graphs": 1},
    }
    predictor = Predictor([region_trace(("b0",), probes=probes)])
    # at COSTS the block is predicted 10870 / 7 us compiled against 2102 eager; measured: 0.8
    assert probe_errors(predictor, COSTS) == {"b0": pytest.approx(100 * (10870 / 7 / 2102 / 0.8 - 1))}
    # calibrated on that probe, the model matches it
    assert probe_errors(predictor, predictor.fusion_costs) == {"b0": pytest.approx(0.0, abs=1e-9)}
    choice = choose_regions(predictor, Plan.empty())
    assert choice.probe_errors == probe_errors(predictor, predictor.fusion_costs)


def test_the_models_optimism_is_its_worst_under_pricing_of_a_probe():
    # priced at 0.69 of a probe's measured time: that probe took 1/0.69 of the price
    assert model_optimism({"block": -31.0, "norm": 62.0, "linear": -2.0}) == pytest.approx(100 / 69 - 1)
    assert model_optimism({"norm": 62.0, "linear": 0.0}) == 0.0  # over-priced: no optimism
    assert model_optimism({}) == 0.0  # no probe: the model is taken at its price


def test_a_regions_saving_beyond_the_models_optimism_counts_only_the_models_part():
    # 1000 us eager, 800 compiled of which 300 at a probe's measured ratio: the model priced 500
    region = RegionCost("m", 1000.0, 800.0, 2, 0.0, 1, 1.0, measured_us=300.0)
    assert region.measured and region.saving_us == 200.0
    assert region.saving_beyond_us(0.0) == 200.0
    assert region.saving_beyond_us(0.5) == pytest.approx(200.0 - 0.5 * 500.0)
    measured = RegionCost("m", 1000.0, 800.0, 2, 0.0, 1, 1.0, measured_us=800.0)
    assert measured.saving_beyond_us(10.0) == 200.0  # priced at a probe alone: nothing to doubt
    assert not RegionCost("m", 1000.0, 800.0, 2, 0.0, 1, 1.0).measured


def test_regions_whose_saving_the_models_error_could_undo_are_left_out_and_named(short_walks):
    linear = {"eager_us": 1000.0, "compiled_us": 1000.0, "graphs": 1}
    # the block measured 1.5 times slower compiled: the model, fitted on the Linear, priced it far
    # below that (-61%); the block and its twin are priced at that measured ratio and save nothing
    block = {"eager_us": 1000.0, "compiled_us": 1500.0, "graphs": 1}
    predictor = Predictor([region_trace(steps_left=10**6, probes={"b0.fc": linear, "b0": block})])
    choice = choose_regions(predictor, Plan.empty())
    assert choice.probe_errors["b0"] < -50 and choice.probe_errors["b0.fc"] == pytest.approx(0.0, abs=1e-9)
    # the block priced at 0.389 of its measured compiled time: measured 2.568 times its price
    assert choice.optimism == pytest.approx(1.5682, abs=1e-4)
    # the layer norms are priced by the model alone to save, but not by more than its optimism
    assert [region.module for region in choice.doubtful] == ["b0.ln", "b1.ln"]
    for region in choice.doubtful:
        assert region.saving_us > 0 >= region.saving_beyond_us(choice.optimism)
        assert region.saving_beyond_us(0.0) == region.saving_us
    assert choice.chosen == [] and choice.plan is None and choice.search["candidates"] == 0
    table = format_region_plan(choice)
    saving = choice.doubtful[0].saving_us / 1e3
    assert (
        f"\n  left out: b0.ln: priced to save {saving:.3f} ms/step, not beyond the model's error "
        f"(a probe measured {100 * choice.optimism:.0f}% over its price)\n"
    ) in table
    # without the block's probe the model is not shown wrong: the blocks are compiled
    trusted = choose_regions(
        Predictor([region_trace(steps_left=10**6, probes={"b0.fc": linear})]), Plan.empty()
    )
    assert trusted.optimism == 0.0 and trusted.doubtful == []
    assert [region.module for region in trusted.chosen] == ["b0", "b1"] and trusted.plan is not None


def test_the_search_counts_each_regions_saving_beyond_the_models_optimism():
    graph = build_global_graph([model_trace(("b0", "b1"), slow=SLOW)], 0)
    trusting = RegionSearch(graph, COSTS, steps_left=10**6)
    saving = trusting.regions["b0"].saving_beyond_us(0.3)
    assert saving > 0
    doubting = RegionSearch(graph, COSTS, steps_left=10**6, optimism=0.3)
    assert doubting.saving["b0"] == pytest.approx(saving)
    assert doubting.value(["b0"]) == pytest.approx(
        trusting.value(["b0"]) - trusting.regions["b0"].saving_us + saving
    )
    # the layer norms save 77 us each against 573 compiled, all priced by the model: 0.3 of it undoes them
    assert [r.module for r in doubting.doubtful] == ["b0.ln", "b1.ln"]
    assert doubting.names == ["b0", "b1"] and trusting.names == ["b0", "b0.ln", "b1", "b1.ln"]
    assert all(doubting.saving[m] > 0 for m in doubting.names)


def test_a_region_saving_anything_beyond_the_optimism_is_searched_and_not_doubted():
    graph = build_global_graph([model_trace(("b0", "b1"), slow=SLOW)], 0)
    norm = RegionSearch(graph, COSTS, steps_left=10**6).regions["b0.ln"]
    model_us = norm.compiled_us - norm.measured_us
    # half a microsecond left beyond the optimism: searched; none left: doubted
    barely = RegionSearch(graph, COSTS, steps_left=10**6, optimism=(norm.saving_us - 0.5) / model_us)
    assert barely.saving["b0.ln"] == pytest.approx(0.5)
    assert "b0.ln" in barely.names and "b0.ln" not in [r.module for r in barely.doubtful]
    undone = RegionSearch(graph, COSTS, steps_left=10**6, optimism=(norm.saving_us + 0.5) / model_us)
    assert "b0.ln" not in undone.names and "b0.ln" in [r.module for r in undone.doubtful]


@settings(max_examples=20, deadline=None)
@given(st.floats(0.0, 2.0), st.floats(0.0, 2.0), st.floats(1.0, 20.0))
def test_more_optimism_never_adds_a_region_nor_a_second_of_value(low, high, slow):
    low, high = sorted((low, high))
    graph = build_global_graph([model_trace(("b0", "b1"), slow=slow)], 0)
    trusting, doubting = (RegionSearch(graph, COSTS, steps_left=10**6, optimism=o) for o in (low, high))
    assert set(doubting.names) <= set(trusting.names)
    assert {r.module for r in doubting.doubtful} == {r.module for r in trusting.doubtful} | (
        set(trusting.names) - set(doubting.names)
    )
    for names in (doubting.names, [n for n in doubting.names if n.endswith("ln")]):
        assert doubting.value(names) <= trusting.value(names) + 1e-9


# --- format_region_plan --------------------------------------------------------------------------------


def _prediction(step_ms):
    return Prediction(step_ms=step_ms, peak_bytes=0, replayed_step_ms=[step_ms], per_rank_peak_bytes=[0])


def test_the_region_table_lists_the_search_the_probes_and_each_chosen_region():
    block = RegionCost("blocks.0", 4000.0, 1500.0, ops=10, library_us=900.0, fused_kernels=4, compile_s=12.34)
    long = RegionCost("encoder.layers.0.self_attention.out_projection", 600.0, 500.0, 2, 0.0, 1, 1.0)
    stack = RegionCost("net", 9000.0, 6000.0, 40, 3000.0, 2, 20.0, measured_us=6000.0)
    head = RegionCost("head", 3000.0, 2000.0, 8, 900.0, 3, 5.0, measured_us=1500.0)
    choice = RegionChoice(
        plan=Plan(fused_regions=[[block.module], [long.module], ["net"], ["head"]]),
        base=_prediction(10.0),
        chosen=[block, long, stack, head],
        prediction=_prediction(9.0),
        costs=FusionCosts(op_us=5.0, bytes_per_us=1e3, source="calibrated on 1 compiled region(s): blocks.0"),
        steps_left=500,
        compile_s=13.34,
        search={"method": "exhaustive", "sets": 9, "candidates": 3},
        probe_errors={"blocks.0": -7.66, "blocks.1": 12.0},
    )
    assert format_region_plan(choice).split("\n") == [
        "qsync compiled regions (3 candidates, exhaustive search; 500 steps left; "
        "costs: calibrated on 1 compiled region(s): blocks.0)",
        "  compiled during the warm-up: blocks.0: model -7.7% against measured",
        "  compiled during the warm-up: blocks.1: model +12.0% against measured",
        "  blocks.0" + " " * 32 + " saves   2.500 ms/step  compile ~ 12.3 s  (10 ops, 4 fused kernels)",
        "  encoder.layers.0.self_attention.out_proj saves   0.100 ms/step  compile ~  1.0 s  "
        "(2 ops, 1 fused kernels)",
        "  net"
        + " " * 37
        + " saves   3.000 ms/step  compile ~ 20.0 s  (40 ops, priced as the one compiled in "
        "the warm-up)",
        "  head" + " " * 36 + " saves   1.000 ms/step  compile ~  5.0 s  (8 ops, 75% of its compiled time "
        "priced as compiled in the warm-up, the rest 3 fused kernels)",
        "  predicted 9.00 ms/step against 10.00 (-10.0%), compile ~13 s",
    ]


def test_the_region_table_says_when_nothing_is_compiled():
    costs = FusionCosts(op_us=5.0, bytes_per_us=1e3)
    choice = RegionChoice(None, _prediction(10.0), [], None, costs, None, 0.0)
    assert format_region_plan(choice) == (
        "qsync compiled regions (0 candidates, None search; unknown steps left; costs: defaults)\n"
        "  no region set is predicted more than 2% faster and to pay for its compile in the steps left: "
        "nothing is compiled"
    )


# --- the fusion cost model's fits ----------------------------------------------------------------------


def _fitted(specs):
    ops, end = _ops(specs)
    return fit_fusion_costs([build_global_graph([trace(ops, end + 1)], 0)])


SMALL = [("aten::mul", "forward", 6.0, 1.0, "m", [[10]]), ("aten::mul", "forward", 8.0, 1.0, "m", [[10]])]


def test_the_fit_ignores_backward_library_view_and_shapeless_ops():
    ignored = [
        ("aten::mul", "forward", 100.0, 1.0, "m", []),  # moves no bytes it knows of
        ("aten::linear", "forward", 5000.0, 1.0, "m", [[16384]]),
        ("aten::view", "forward", 50.0, 1.0, "m", [[10]]),
        (BWD + "GeluBackward0", "backward", 1000.0, 1.0, "m", [[16384]]),
    ]
    large = [("aten::gelu", "forward", 7.0 + 131.072, 1.0, "m", [[16384]])]  # 131072 B moved
    costs = _fitted([*ignored, *SMALL, *large])
    assert (costs.op_us, costs.bytes_per_us) == (pytest.approx(7.0), pytest.approx(1000.0))


def test_an_op_moving_64_kib_fits_the_bandwidth():
    large = [("aten::gelu", "forward", 7.0 + 65.536, 1.0, "m", [[8192]])]  # 32 KiB in, 32 KiB out
    costs = _fitted([*SMALL, *large])
    assert (costs.op_us, costs.bytes_per_us) == (pytest.approx(7.0), pytest.approx(1000.0))


def test_the_fit_defaults_what_the_recorded_ops_do_not_tell():
    only_large = _fitted([("aten::gelu", "forward", 10.0 + 131.072, 1.0, "m", [[16384]])])
    assert only_large.op_us == DEFAULT_KERNEL_US
    assert only_large.bytes_per_us == pytest.approx(1000.0)
    only_small = _fitted(SMALL)
    assert (only_small.op_us, only_small.bytes_per_us) == (pytest.approx(7.0), 1e4)
    # large ops no slower than op_us: 0.5 us beyond it for 131072 B, then none
    barely = _fitted([*SMALL, ("aten::gelu", "forward", 7.5, 1.0, "m", [[16384]])])
    assert barely.bytes_per_us == pytest.approx(131072 / 0.5)
    never = _fitted([*SMALL, ("aten::gelu", "forward", 5.0, 1.0, "m", [[16384]])])
    assert never.bytes_per_us == 1e4


def test_the_fit_is_calibrated_on_the_probes_given():
    graph = build_global_graph([model_trace()], 0)
    probes = {"b0": {"eager_us": 1000.0, "compiled_us": 900.0, "compile_s": 8.0, "graphs": 1}}
    fitted = fit_fusion_costs([graph], probes)
    assert fitted == calibrate(fit_fusion_costs([graph]), [graph], probes)
    assert fitted.source == "calibrated on 1 compiled region(s): b0"
    assert fit_fusion_costs([graph]).source == "defaults"


def test_calibration_skips_probes_it_cannot_use():
    graph = build_global_graph([model_trace()], 0)
    full = {"eager_us": 1000.0, "compiled_us": 900.0, "compile_s": 8.0}
    unusable = {
        "b0": {"eager_us": 1000.0},
        "b0.ln": {"compiled_us": 900.0},
        "nowhere": full,  # ran no recorded op
        "b0.fc": {**full, "graphs": 2},
    }
    assert calibrate(COSTS, [graph], unusable) == COSTS
    assert calibrate(COSTS, [], {"b0": full}) == COSTS
    # the unusable ones before a usable one leave it calibrating
    fitted = calibrate(COSTS, [graph], {**unusable, "b0.ln": full})
    assert fitted.source == "calibrated on 1 compiled region(s): b0.ln"
    both = calibrate(COSTS, [graph], {"b0": full, "b0.ln": full})
    assert both.source == "calibrated on 2 compiled region(s): b0, b0.ln"


def test_calibration_carries_the_measured_ratio_to_the_fastest_recorded_step():
    fast = build_global_graph([model_trace()], 0)
    slow = build_global_graph([model_trace(slow=SLOW)], 0)
    probes = {"b0": {"eager_us": 1000.0, "compiled_us": 900.0}}  # no compile time measured
    costs = FusionCosts(op_us=5.0, bytes_per_us=1000.0, compile_s_per_op=0.7, compile_s_fixed=2.0)
    fitted = calibrate(costs, [slow, fast], probes)
    assert fitted == calibrate(costs, [fast], probes) != calibrate(costs, [slow], probes)
    assert (fitted.compile_s_per_op, fitted.compile_s_fixed) == (0.7, 2.0)  # kept


@pytest.mark.parametrize(
    ("points", "line"),
    [
        ([(2, 2.0), (10, 6.0)], (1.0, 0.5)),
        ([(1, 3.0), (2, 4.0)], (2.0, 1.0)),  # x spread below 1
        ([(2, 1.5), (4, 2.5)], (0.5, 0.5)),  # intercept below 1
        ([(2, 3.0), (10, 3.0)], (3.0, 0.0)),  # flat
        ([(2, 6.0), (10, 2.0)], (0.0, 8 / 12)),  # falling: through 0
        ([(2, 1.0), (10, 9.0)], (0.0, 10 / 12)),  # below 0 at no op: through 0
        ([(4, 2.0), (4, 4.0)], (0.0, 6 / 8)),  # one size: through 0
        ([(10, 5.0)], (0.0, 0.5)),
    ],
)
def test_the_compile_line_is_fitted_through_zero_when_it_cannot_be_told(points, line):
    assert _fit_line(points) == pytest.approx(line)


def _row(kernels, rest):
    return (RegionCost("m", 0.0, 0.0, 1, 0.0, kernels, 0.0), rest, None, 1)


@pytest.mark.parametrize(
    ("rows", "solved"),
    [
        ([(0, 60.0)], (10.0, 30.0)),  # a plain probe: kernel_us kept
        ([(0, 60.0), (0, 80.0)], (10.0, 35.0)),
        ([(0, 60.0), (4, 80.0)], (5.0, 30.0)),
        ([(0, 60.0), (1, 80.0)], (20.0, 30.0)),
        ([(0, -20.0), (4, 48.0)], (12.0, 0.0)),  # region_us clipped at 0
        ([(0, 60.0), (4, 40.0)], (0.0, 30.0)),  # kernel_us clipped at 0
        ([(2, 50.0), (4, 51.0)], (0.5, 24.5)),  # two kernel counts: least squares
        ([(2, 50.0), (4, 50.0)], (0.0, 25.0)),
        ([(2, 10.0), (4, 30.0)], (10.0, 0.0)),  # intercept below 0: clipped
        ([(2, 80.0), (6, 60.0)], (10.0, 15.0)),  # falling: kernel_us kept, region_us the mean rest
        ([(4, 100.0), (4, 120.0)], (10.0, 35.0)),  # one kernel count: kernel_us kept
        ([(4, 20.0)], (10.0, 0.0)),
    ],
)
def test_the_kernel_and_region_costs_are_solved_from_the_probes(rows, solved):
    assert _solve_constants([_row(k, rest) for k, rest in rows], 10.0) == pytest.approx(solved)


def test_bytes_count_tensor_inputs_by_dtype():
    shapes = [[2, 3], 7, [[2], [3]], [], [4], [5]]
    dtypes = ["c10::Half", "Scalar", "TensorList", "float", "long int", "unknown"]
    assert input_bytes(shapes, dtypes) == [12, 0, 0, 0, 32, 20]
    assert moved_bytes(shapes, dtypes) == 64 + 32  # inputs and an output the size of the largest
    assert moved_bytes([], []) == 0
    assert moved_bytes([[2, 3]], ["c10::BFloat16"]) == 24


def test_a_compiled_region_charges_its_chains_and_region_cost_to_the_first_op_of_each():
    graph = build_global_graph([model_trace()], 0)
    out = apply_regions(graph, ["b0"], COSTS)
    forward, backward = region_nodes(graph, "b0")[0]
    kept = 20000 / 28000
    assert [out.nodes[n]["dur"] for n in forward] == pytest.approx([18 + 50, 300, 0, 22, 0])
    assert [out.nodes[n]["gap"] for n in forward] == [7.0, 0.0, 0.0, 0.0, 0.0]
    assert [out.nodes[n]["dur"] for n in backward] == pytest.approx(
        [10 + kept * 20 + 50, 0, 0, 600, 10 + kept * 40]
    )
    assert [out.nodes[n]["gap"] for n in backward] == [2.0, 0.0, 0.0, 0.0, 0.0]
    assert [graph.nodes[n]["dur"] for n in forward] == [20.0, 300.0, 2.0, 15.0, 12.0]  # left alone
    assert [graph.nodes[n]["gap"] for n in backward] == [2.0] * 5


# --- what the plan and the warm-up may compile -----------------------------------------------------------


def test_a_region_plan_names_at_most_three_bad_regions_and_five_missing_modules():
    t = model_trace()
    with pytest.raises(QSyncInputError) as bad:
        check_region_plan([t], [["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"]], "p")
    assert str(bad.value) == "p: a torch region names one module; got [['a', 'b'], ['c', 'd'], ['e', 'f']]"
    with pytest.raises(QSyncInputError) as missing:
        check_region_plan([t], [["b0"], *([f"m{i}"] for i in range(1, 7))], "p")
    assert str(missing.value) == "p: no recorded op ran in module(s) 'm1', 'm2', 'm3', 'm4', 'm5'"
    t.framework = "tensorflow"
    assert check_region_plan([t], [], "p") is None  # nothing to refuse


def test_a_region_plan_may_name_only_modules_whose_forward_ran():
    f, b = block_specs("b0")
    ops, end = _ops([*f, *b, (BWD + "MseLossBackward0", "backward", 5.0, 2.0, "loss", [])])
    with pytest.raises(QSyncInputError, match="'loss'"):  # only a backward ran in it
        check_region_plan([trace(ops, end + 1)], [["loss"]], "p")
    t = model_trace(("net.0",))
    check_region_plan([t], [["net"]], "p")  # the trace does not say which blocks ran
    t.compiled_regions = {"called_blocks": ["net"]}
    check_region_plan([t], [["net"]], "p")
    t.compiled_regions = {"called_blocks": []}
    with pytest.raises(QSyncInputError, match="no recorded op ran in module\\(s\\) 'net'$"):
        check_region_plan([t], [["net"]], "p")


def test_the_gate_considers_only_blocks_whose_forward_ran():
    # uncalibrated costs on this trace, its pointwise ops twice block_specs' own: net saves 226.4 us
    # per step for 10 s of compile (pays back after 44175 steps); net.0 and net.1 6.9 us each, for
    # 5 s the first and 1 s the second (434783 steps); their layers save nothing
    t = model_trace(("net.0", "net.1"), slow=2.0)
    assert payback_gate(t, 45000) is None
    assert payback_gate(t, 45000, called_blocks=["net.0", "net.1"]) == (
        "no region pays for its compile in the 45000 steps left at the uncalibrated costs"
    )


def test_the_gate_counts_identical_blocks_compiled_once():
    # net.0 and net.1 save 714.3 us each: one alone pays for its 5 s compile after 7000 steps, both
    # after 4200 (5 s, and 1 s for the copy reusing the code); their layer norms 169.2 us for 1 s each
    # (5910 steps both); net itself is not called
    t = model_trace(("net.0", "net.1"), slow=SLOW)
    called = ["net.0", "net.1"]
    assert payback_gate(t, 4250, called_blocks=called) is None
    assert payback_gate(t, 4150, called_blocks=called) is not None
    # a module holding one block alone runs its ops, not a second copy of them: net and net.0 pay
    # back after 7000 steps, the layer norm after 5910 (counted as copies, they would after 4200)
    single = model_trace(("net.0",), slow=SLOW)
    assert payback_gate(single, 5800, called_blocks=["net", "net.0"]) is not None
    # two blocks of other shapes are no copies: each compiles on its own (none pays in 4300 steps)
    f0, b0 = block_specs("net.0", SLOW)
    f1, b1 = (
        [(*spec[:5], [[2000]] * len(spec[5])) for spec in specs] for specs in block_specs("net.1", SLOW)
    )
    ops, end = _ops([*f0, *f1, *b1, *b0])
    assert payback_gate(trace(ops, end + 10.0), 4300, called_blocks=called) is not None


def test_the_gate_wants_a_region_to_save_more_than_its_compile():
    # one gelu moving 10000 B at 1e4 B/us: compiled, 10 + 1 + 80 us; 0.5 s to compile
    def gate(dur, steps=1000):
        ops, end = _ops([("aten::gelu", "forward", dur, 1.0, "m", [[1250]])])
        return payback_gate(trace(ops, end + 1), steps)

    assert gate(591.0) is not None  # saves 500 us over 1000 steps: exactly its compile
    assert gate(591.00025) is None  # 0.25 us more over the 1000 steps
    assert gate(91.5, steps=1_000_001) is None  # half a microsecond a step, over a million steps


def test_a_region_holding_copies_of_the_measured_block_prices_them_as_measured():
    graph = build_global_graph([model_trace(("net.b0", "net.b1"), slow=SLOW)], 0)
    eager = {name: price_region(graph, name, COSTS, {}).eager_us for name in ("net.b0", "net.b1")}
    probes = {"net.b0": {"eager_us": 100.0, "compiled_us": 150.0}}
    fitted = calibrate(COSTS, [graph], probes)
    whole = price_region(graph, "net", fitted)
    assert whole.measured and whole.compiled_us == pytest.approx(1.5 * (eager["net.b0"] + eager["net.b1"]))
    modelled = price_region(graph, "net", fitted, {})
    assert not modelled.measured and modelled.compiled_us < whole.compiled_us
    before = replay(graph).step_us
    after = replay(apply_regions(graph, ["net"], fitted)).step_us
    assert after - before == pytest.approx(whole.compiled_us - whole.eager_us)
