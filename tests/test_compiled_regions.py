"""The fusion cost model and the region planner on hand-written step graphs (exact figures worked out
by hand from the module docstrings' rules), and the op categories on the names the profiler writes."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan
from qsync_callback.planner.compiled_regions import (
    EXHAUSTIVE_MAX,
    RegionSearch,
    choose_regions,
    format_region_plan,
)
from qsync_callback.predictor.compiled_regions import (
    FUSIBLE_KIND,
    LIBRARY_KIND,
    VIEW_KIND,
    FusionCosts,
    apply_regions,
    calibrate,
    check_region_plan,
    fit_fusion_costs,
    op_category,
    payback_gate,
    price_region,
    region_candidates,
)
from qsync_callback.predictor.graph import build_global_graph
from qsync_callback.predictor.predict import Predictor
from qsync_callback.predictor.replay import replay

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


def model_trace(blocks=("b0",), steps_left=None, slow=1.0):
    forward, backward = [], []
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


def test_two_probes_with_different_kernel_counts_fit_both_constants():
    graph = build_global_graph([model_trace()], 0)
    block, ln = price_region(graph, "b0", COSTS), price_region(graph, "b0.ln", COSTS)
    # measured ratios made by constants kernel 4 us and region 30 us
    truth = FusionCosts(op_us=5.0, bytes_per_us=1000.0, kernel_us=4.0, region_us=30.0)
    probes = {
        name: {
            "eager_us": c.eager_us,
            "compiled_us": price_region(graph, name, truth).compiled_us,
            "compile_s": 1.0,
        }
        for name, c in (("b0", block), ("b0.ln", ln))
    }
    fitted = calibrate(COSTS, [graph], probes)
    assert fitted.kernel_us == pytest.approx(4.0)
    assert fitted.region_us == pytest.approx(30.0)


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


@settings(max_examples=25, deadline=None)
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
    found, mcmc_value, _ = search.mcmc(steps=1500)
    assert search.nested_free(found)
    assert mcmc_value == pytest.approx(value, rel=1e-9, abs=1e-9)


def test_choose_regions_prices_the_chosen_set_by_replay_and_says_so():
    t = model_trace(("b0", "b1"), steps_left=10**6, slow=SLOW)
    predictor = Predictor([t])
    choice = choose_regions(predictor, Plan.empty())
    # the default constants on this graph: every block saves, so both blocks are compiled
    assert choice.plan is not None
    assert sorted(r[0] for r in choice.plan.fused_regions) == ["b0", "b1"]
    assert choice.prediction.step_ms < choice.base.step_ms
    assert choice.plan.prediction["step_ms"] == choice.prediction.step_ms
    table = format_region_plan(choice)
    assert "b0" in table and "compile" in table and "1000000 steps left" in table


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
