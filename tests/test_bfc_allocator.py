"""TensorFlow's BFC allocator simulated (`predictor/bfc_allocator.py`): against TF's own allocator,
its rules one by one, and the predicted peaks built on it (`memory.allocator_peaks`, op-type plans'
tensors, the TF planner under a memory budget) on hand-made traces with known answers. The same on
real recorded windows: `tests/test_tf_memory.py`."""

import random
import re
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Constraints, Plan
from qsync_callback.planner.tf_plans import choose_tf_plan
from qsync_callback.predictor import memory
from qsync_callback.predictor.bfc_allocator import (
    FIRST_REGION,
    SMALL_ALLOCATION,
    BFCAllocator,
    for_allocator,
    rounded,
    simulate,
)
from qsync_callback.predictor.memory import (
    TensorLife,
    allocator_offset,
    allocator_peaks,
    tensor_lifetimes,
    unpredictable_peak,
)
from qsync_callback.predictor.op_precision import rewrite_reading
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.trace import Step, Trace

from tf_launch import run_python
from tracebuilder import op, trace

MiB = 1 << 20

# ----------------------------------------------------------------------------- the simulation

CHECK_AGAINST_TF = textwrap.dedent(
    """
    import random, sys
    import tensorflow as tf
    from qsync_callback.predictor.bfc_allocator import for_allocator
    rng, sim, live, wrong = random.Random(int(sys.argv[1])), for_allocator("mklcpu"), {}, 0
    for i in range(200):
        if live and rng.random() < 0.45:
            key = rng.choice(list(live))
            del live[key]
            sim.free(key)
        else:
            n = rng.choice([rng.randint(1, 500), rng.randint(500, 75_000), rng.randint(75_000, 1_500_000)])
            live[i] = tf.random.uniform([n])
            sim.allocate(i, 4 * n)
        got = tf.config.experimental.get_memory_info("CPU:0")
        wrong += (got["current"], got["peak"]) != (sim.bytes_in_use, sim.peak_bytes_in_use)
    print("mismatches", wrong)
    """
)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_simulation_reads_what_tensorflows_cpu_allocator_reads(tmp_path, seed):
    script = tmp_path / "check.py"
    script.write_text(CHECK_AGAINST_TF)
    run = run_python([str(script), str(seed)])
    assert "mismatches 0" in run.stdout, run.stdout


def test_a_chunk_is_split_only_when_twice_the_request():
    sim = for_allocator("mklcpu")
    sim.allocate("a", 5 * MiB)  # regions double from 2 MiB until 5 MiB fits: one 8 MiB region
    assert sim.region_bytes == 8 * MiB and sim.bytes_in_use == 8 * MiB  # not split: 8 < 2 * 5
    sim.free("a")
    sim.allocate("b", 3 * MiB)  # 8 >= 2 * 3: split
    assert sim.bytes_in_use == 3 * MiB
    sim.allocate("c", 1000)  # another allocator's: not counted
    assert sim.bytes_in_use == 3 * MiB and rounded(1000) == 1024


def test_regions_grow_and_freed_neighbours_merge():
    sim = for_allocator("mklcpu")
    for key in "abcd":
        sim.allocate(key, 1 * MiB)  # the first 2 MiB region holds two; the next (4 MiB) the rest
    assert sim.region_bytes == FIRST_REGION + 2 * FIRST_REGION
    sim.free("c")
    sim.free("d")
    sim.allocate("e", 4 * MiB)  # c, d and the rest of the 4 MiB region merged into one chunk
    assert sim.region_bytes == 6 * MiB and sim.bytes_in_use == 6 * MiB
    sim.free("a")
    sim.free("b")
    sim.allocate("f", 2 * MiB)  # the two regions' free chunks do not merge across them
    assert sim.region_bytes == 6 * MiB and sim.peak_bytes_in_use == 6 * MiB


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12 * MiB)), max_size=60), st.randoms())
def test_chunks_tile_the_regions_and_the_count_is_theirs(moves, rng):
    sim, held = BFCAllocator(small_bytes=SMALL_ALLOCATION), []
    for k, (free, nbytes) in enumerate(moves):
        if free and held:
            sim.free(held.pop(rng.randrange(len(held))))
        else:
            sim.allocate(k, nbytes)
            held.append(k)
        chunks = sim._chunks
        assert sum(c.size for c in chunks) == sim.region_bytes
        assert all(a.address + a.size == b.address for a, b in zip(chunks, chunks[1:], strict=False))
        assert sim.bytes_in_use == sum(c.size for c in chunks if c.in_use) <= sim.peak_bytes_in_use
        assert not any(  # a free chunk never beside another free chunk of its region
            not a.in_use and not b.in_use and a.region == b.region
            for a, b in zip(chunks, chunks[1:], strict=False)
        )


def test_simulate_runs_a_sequence():
    # a: regions double from 2 MiB to 4 MiB, taken whole (4 < 2 * 3); b: a second 4 MiB region,
    # whole; c: a's freed chunk, split (4 >= 2 * 1)
    sim = simulate([("a", 3 * MiB), ("b", 3 * MiB), ("a", -1), ("c", 1 * MiB)], for_allocator("mklcpu"))
    assert (sim.region_bytes, sim.peak_bytes_in_use, sim.bytes_in_use) == (8 * MiB, 8 * MiB, 5 * MiB)


def test_random_sequences_give_one_peak_from_one_start():
    """Two identical simulations agree (no hidden state between them)."""
    rng = random.Random(3)
    moves = [(k, rng.randint(1, 4 * MiB)) for k in range(30)] + [(k, -1) for k in range(0, 30, 2)]
    runs = [simulate(moves, for_allocator("mklcpu")) for _ in range(2)]
    assert len({(r.bytes_in_use, r.peak_bytes_in_use, r.region_bytes) for r in runs}) == 1


# ----------------------------------------------------------------------------- hand-made traces


def _two_op_trace(allocator=None, made=4 * MiB, weight=8 * MiB, extra_events=()):
    """fc/MatMul (0-100 us) makes ``made`` bytes freed when fc/Relu (105-125) ends; fc/Relu makes as
    many, freed when loss (125-135) ends; the MatMul's inputs x (4 MiB) and w (``weight``) are no
    recorded ops; ``extra_events`` are more of the trace's memory events."""
    ops = [
        op(0, "fc/MatMul", "forward", "main", 0.0, 100.0),
        op(1, "fc/Relu", "forward", "main", 105.0, 20.0),
        op(2, "loss", "forward", "main", 125.0, 10.0),
    ]
    table = {
        "ops": {"fc/MatMul": "MatMul", "fc/Relu": "Relu", "loss": "Sum"},
        "edges": [["x", "fc/MatMul", 4 * MiB], ["w", "fc/MatMul", weight], ["fc/MatMul", "fc/Relu", 4 * MiB]]
        + [["fc/Relu", "loss", 4 * MiB]],
        "costs": {
            "MatMul": {"ops": 1, "measured_ops": 1, "fp32_us": 100.0, "bf16_us": 25.0},
            "Relu": {"ops": 1, "measured_ops": 1, "fp32_us": 20.0, "bf16_us": 10.0},
        },
        "casts": {"fp32->bf16": {"us_per_byte": 0.0}, "bf16->fp32": {"us_per_byte": 0.0}},
    }
    events = [[1.0, 1, made, 0], [106.0, 2, made, 1], [125.0, 1, -made, 1], [134.0, 2, -made, 2]]
    events = sorted([*events, *extra_events])
    return trace(
        ops, 135.0, precision_costs={"op_types": table}, memory_events=events, allocator=allocator or {}
    )


def test_an_op_type_plan_halves_what_its_ops_make_and_adds_its_casts():
    predictor = Predictor([_two_op_trace()])
    assert predictor.predict().peak_bytes == 8 * MiB  # both outputs, 105-125 us
    # MatMul at bf16: its output 2 MiB; x and w cast to bf16 (2 + 4 MiB) over the MatMul (0-100);
    # its output cast back to fp32 for the Relu (4 MiB, 100-125); the Relu's 4 MiB from 105
    plan = Plan(op_precision={"MatMul": "bf16"})
    assert predictor.predict(plan).peak_bytes == 2 * MiB + 4 * MiB + 4 * MiB
    both = Plan(op_precision={"MatMul": "bf16", "Relu": "bf16"})  # one cast back, at the loss
    assert predictor.predict(both).peak_bytes == max(2 + 2 + 4, 2 + 2 + 4) * MiB


def test_an_op_at_bf16_takes_the_rewrites_scratch_in_place_of_its_recorded_one():
    """fc/MatMul's fp32 run took 1 MiB of scratch (10-50 us, within it); under the rewrite it took
    6 MiB. At bf16 its recorded scratch is gone and the rewrite's is alive from its start to its end,
    over its output (2 MiB) and the casts of x and w (2 + 4 MiB): 14 MiB. A trace recorded before
    scratch was measured (no ``scratch`` in its table) scales the recorded scratch as it scales what
    the op makes: the peak is then after the MatMul (10 MiB, as without the scratch)."""
    scratch_events = [[10.0, 9, MiB, 0], [50.0, 9, -MiB, 0]]
    trace_ = _two_op_trace(extra_events=scratch_events)
    plan = Plan(op_precision={"MatMul": "bf16"})
    predictor = Predictor([trace_])
    assert predictor.predict().peak_bytes == 8 * MiB  # the recorded scratch under the MatMul's 4 MiB
    assert predictor.predict(plan).peak_bytes == 10 * MiB
    trace_.precision_costs["op_types"]["scratch"] = {"fc/MatMul": [MiB, 6 * MiB]}
    assert Predictor([trace_]).predict(plan).peak_bytes == (2 + 2 + 4 + 6) * MiB
    # an op the plan leaves at fp32 keeps its recorded scratch, whatever the rewrite took
    trace_.precision_costs["op_types"]["scratch"] = {"fc/Relu": [0, 64 * MiB]}
    assert Predictor([trace_]).predict(plan).peak_bytes == 10 * MiB


def test_a_trace_of_tensorflows_allocator_is_priced_as_that_allocator_counts():
    in_use, allocator = 10 * MiB, {"name": "mklcpu", "in_use_bytes": 10 * MiB}
    trace_ = _two_op_trace(allocator, made=3 * MiB)
    # each 3 MiB request takes a new 4 MiB region whole (4 < 2 * 3): 8 MiB counted for 6 asked
    assert Predictor([trace_]).predict().peak_bytes == in_use + 8 * MiB
    assert allocator_peaks(tensor_lifetimes(trace_), "mklcpu", in_use) == {0: in_use + 8 * MiB}
    # on a GPU's allocator (one region) the chunks are the requests
    assert allocator_peaks(tensor_lifetimes(trace_), "GPU_0_bfc", in_use) == {0: in_use + 6 * MiB}
    # the tensors' own bytes, without the allocator: the requests
    assert Predictor([_two_op_trace(made=3 * MiB)]).predict().peak_bytes == 6 * MiB


def test_a_trace_with_the_allocators_own_reading_is_calibrated_on_it():
    """TF read 16 MiB in the recorded steps where the simulation, from empty regions, reads 18 (each
    3 MiB request in a 4 MiB region of its own): the recorded configuration is predicted at TF's
    reading, and a plan at its own simulated peak moved by as much (-2 MiB)."""
    in_use = 10 * MiB
    simulated_only = _two_op_trace({"name": "mklcpu", "in_use_bytes": in_use}, made=3 * MiB)
    calibrated = _two_op_trace(
        {"name": "mklcpu", "in_use_bytes": in_use, "recorded_peak_bytes": in_use + 6 * MiB}, made=3 * MiB
    )
    assert allocator_offset(simulated_only) == 0 and allocator_offset(calibrated) == -2 * MiB
    assert Predictor([simulated_only]).predict().peak_bytes == in_use + 8 * MiB
    recorded = Predictor([calibrated]).predict()
    assert recorded.peak_bytes == in_use + 6 * MiB and recorded.peak_bytes_simulated == in_use + 8 * MiB
    assert memory.predict_memory(calibrated).step_peaks == {0: in_use + 6 * MiB}  # each step moved
    plan = Plan(op_precision={"MatMul": "bf16", "Relu": "bf16"})
    uncalibrated = Predictor([simulated_only]).predict(plan).peak_bytes
    planned = Predictor([calibrated]).predict(plan)
    assert planned.peak_bytes == uncalibrated - 2 * MiB and planned.peak_bytes_simulated == uncalibrated
    # the tensors' own bytes (a torch trace): nothing simulated
    assert Predictor([_two_op_trace(made=3 * MiB)]).predict().peak_bytes_simulated is None
    # TF read more than the simulation: the offset raises it
    higher = _two_op_trace(
        {"name": "mklcpu", "in_use_bytes": in_use, "recorded_peak_bytes": in_use + 9 * MiB}, made=3 * MiB
    )
    assert (
        allocator_offset(higher) == MiB and Predictor([higher]).predict(plan).peak_bytes == uncalibrated + MiB
    )


def test_the_uniform_rewrites_plan_is_calibrated_on_what_the_allocator_read_under_the_rewrite():
    """The bf16 probe's profiled steps ran TF's uniform rewrite (MatMul and Relu at bf16 here) and the
    allocator read 13 MiB in them: the plan that is that rewrite is calibrated on its own reading,
    not on the recorded configuration's; a plan of other op types keeps the recorded one's offset."""
    in_use = 10 * MiB
    recorded = {"name": "mklcpu", "in_use_bytes": in_use, "recorded_peak_bytes": in_use + 6 * MiB}
    trace_ = _two_op_trace(recorded, made=3 * MiB)
    uniform, matmul = (
        Plan(op_precision={"MatMul": "bf16", "Relu": "bf16"}),
        Plan(op_precision={"MatMul": "bf16"}),
    )
    before = [Predictor([trace_]).predict(p) for p in (uniform, matmul)]
    trace_.precision_costs["op_types"]["recorded_peak_bytes"] = in_use + 3 * MiB
    after = [Predictor([trace_]).predict(p) for p in (uniform, matmul)]
    assert after[0].peak_bytes == in_use + 3 * MiB != before[0].peak_bytes
    assert after[0].peak_bytes_simulated == before[0].peak_bytes_simulated
    assert after[1].peak_bytes == before[1].peak_bytes == after[1].peak_bytes_simulated - 2 * MiB
    # the reading belongs to one precision's rewrite: a plan of the same types at fp16 is not it
    assert rewrite_reading(trace_.precision_costs["op_types"], uniform.op_precision) == in_use + 3 * MiB
    assert rewrite_reading(trace_.precision_costs["op_types"], {"MatMul": "fp16", "Relu": "fp16"}) is None
    assert rewrite_reading(trace_.precision_costs["op_types"], {"MatMul": "bf16", "Relu": "fp16"}) is None
    # the probe's unprofiled reading calls count too: the largest of all its readings
    trace_.precision_costs["op_types"]["step_peak_bytes"] = [in_use + 2 * MiB, in_use + 5 * MiB]
    assert rewrite_reading(trace_.precision_costs["op_types"], uniform.op_precision) == in_use + 5 * MiB
    assert Predictor([trace_]).predict(uniform).peak_bytes == in_use + 5 * MiB
    trace_.precision_costs["op_types"]["step_peak_bytes"] = [in_use + 2 * MiB]
    assert rewrite_reading(trace_.precision_costs["op_types"], uniform.op_precision) == in_use + 3 * MiB
    del trace_.precision_costs["op_types"]["recorded_peak_bytes"]
    assert rewrite_reading(trace_.precision_costs["op_types"], uniform.op_precision) == in_use + 2 * MiB


def test_a_reading_that_is_no_amount_of_bytes_is_refused():
    data = _two_op_trace({"name": "mklcpu", "in_use_bytes": MiB}).to_dict()
    data["allocator"]["recorded_peak_bytes"] = -1
    with pytest.raises(QSyncInputError, match="recorded_peak_bytes"):
        Trace.from_dict(data, source="t.json")


def test_a_step_that_frees_what_the_step_before_kept_meets_it_held():
    """A step keeps 3 MiB (its loss, say) and frees the 3 MiB the step before kept: the simulation
    holds that one from the start and frees it, without counting it twice."""
    ops = [op(0, "a", "forward", "main", 0.0, 10.0), op(1, "b", "forward", "main", 20.0, 10.0)]
    events = [[1.0, 7, -3 * MiB, 0], [21.0, 8, 3 * MiB, 1]]  # addr 7: made before the step
    trace_ = trace(ops, 40.0, memory_events=events, allocator={"name": "mklcpu", "in_use_bytes": 5 * MiB})
    assert allocator_peaks(tensor_lifetimes(trace_), "mklcpu", 5 * MiB) == {0: 5 * MiB}


def _life(step, mib, birth, death):
    return TensorLife(0, int(mib * MiB), step, birth, death, None, None, "other")


def test_a_steps_peak_is_its_highest_run_as_the_measured_one_is_the_largest_step(monkeypatch):
    """The chunks a run gets depend on what the runs before left: this step's runs cycle through
    different peaks, and the prediction is the highest, not the second run's."""
    lives = [
        _life(0, 3, None, 34.0),
        _life(0, 5, 11.0, 17.0),
        _life(0, 1.5, 16.0, 17.0),
        _life(0, 3, 12.0, None),
    ]
    assert allocator_peaks(lives, "mklcpu", MiB) == {0: MiB + int(12.5 * MiB)}
    monkeypatch.setattr(memory, "ALLOCATOR_STEPS", 2)  # the first run and one more
    assert allocator_peaks(lives, "mklcpu", MiB) == {0: MiB + int(10.5 * MiB)}


def test_steps_run_after_one_another_and_each_starts_holding_what_it_frees():
    """Step 0 keeps a 3 MiB tensor past its end and frees a 1 MiB one the step before kept; step 1
    frees a 1 MiB one and keeps a 1 MiB one. After step 0 the simulated step 1 meets no 1 MiB tensor
    kept: it starts holding one all the same (else its rise would count 1 MiB it never freed: 3 MiB),
    and step 0's 3 MiB is freed as it starts. Step 0 after step 1 meets the chunks step 1 left and
    reads more than after itself."""
    step0 = [_life(0, 1, None, 2.0), _life(0, 5, 3.0, 23.0), _life(0, 3, 3.0, None), _life(0, 3, 28.0, 32.0)]
    step1 = [
        _life(1, 1, None, 25.0),
        _life(1, 2, 36.0, 53.0),
        _life(1, 1, 16.0, 26.0),
        _life(1, 1, 1.0, None),
    ]
    assert allocator_peaks(step0, "mklcpu", 0) == {0: 10 * MiB}
    assert allocator_peaks(step1, "mklcpu", 0) == {1: 2 * MiB}
    assert allocator_peaks(step0 + step1, "mklcpu", 0) == {0: 11 * MiB, 1: 2 * MiB}


def test_every_step_of_a_long_window_runs_after_another_and_each_frees_what_it_did_not_make():
    """41 recorded steps (more than `ALLOCATOR_STEPS`): two rounds, so that the step drawn first runs
    again after another; each frees two tensors no step kept: both held from its start, apart."""
    lives = []
    for step in range(41):
        t = 100.0 * step
        lives += [_life(step, 1, None, t + 5), _life(step, 1, None, t + 6), _life(step, 4, t + 1, t + 4)]
    assert allocator_peaks(lives, "GPU_0_bfc", MiB) == dict.fromkeys(range(41), MiB + 4 * MiB)


def test_two_tensors_a_step_frees_and_no_step_kept_are_held_apart_from_its_start():
    """Step 1 frees a 2 MiB and a 1.5 MiB tensor no step kept: both are allocated as its run starts,
    each under a key of its own; its 1.5 MiB request then reads 2.5 MiB over the start (1.5 MiB when
    both went under one key and the first one's chunk stayed held, out of the step's reach)."""
    lives = [
        _life(0, 3, None, 25.0), _life(0, 3, None, 2.0), _life(0, 3, 17.0, 24.0), _life(0, 2, 30.0, 38.0),
        _life(1, 2, None, 119.0), _life(1, 1.5, None, 117.0), _life(1, 1.5, 110.0, 112.0),
    ]  # fmt: skip
    assert allocator_peaks(lives, "mklcpu", 0) == {0: 0, 1: int(2.5 * MiB)}


# ----------------------------------------------------------------------------- plans under a budget


def test_the_tf_planner_keeps_a_plan_that_fits_the_budget_and_refuses_one_it_cannot_price():
    trace_ = _two_op_trace(weight=1 * MiB)
    trace_.framework = "tensorflow"
    trace_.allocator = {"name": "GPU_0_bfc", "in_use_bytes": 0}  # one region: chunks are the requests

    def choose(budget):
        return choose_tf_plan([trace_], Constraints.from_arguments(budget, None, ("fp32", "bf16")))

    # bf16: x and w cast (2 + 0.5 MiB) beside the MatMul's 2 MiB output, freed at its end; the Relu's
    # 2 MiB output takes the 2.5 MiB chunk they leave, whole (2.5 < 2 * 2); its cast back to fp32 for
    # the loss (4 MiB) beside it: 6.5 MiB counted, against the recorded 8
    free = choose(None)
    assert re.search(r"recorded configuration .*, peak 8\.0 MiB", free.table)
    assert re.search(r"bf16 uniform .*, peak 6\.5 MiB .*<- chosen", free.table)
    fits = choose("7MiB")
    assert fits.feasible and fits.plan.op_precision == {"MatMul": "bf16", "Relu": "bf16"}
    assert not choose("5MiB").feasible  # the closest: the loop keeps the recorded one unless best_effort
    trace_.allocator = {}  # TF recorded no allocations: no peak to plan a budget on
    with pytest.raises(QSyncInputError, match="memory budget cannot be honoured: no peak predicted"):
        choose("7MiB")
    with pytest.raises(QSyncInputError, match="memory budget cannot be honoured"):
        choose("85%")
    assert choose(None).plan.op_precision  # without a budget the time is still planned


def test_the_rules_at_their_edges():
    sim = for_allocator("mklcpu")
    sim.allocate("small", SMALL_ALLOCATION - 1)  # the other allocator's
    sim.allocate("counted", SMALL_ALLOCATION)  # 256 KiB exactly: TF's BFC allocator's, counted
    assert sim.bytes_in_use == SMALL_ALLOCATION
    exact = for_allocator("mklcpu")
    exact.allocate("a", FIRST_REGION)  # exactly the first region's size: that region, not a larger one
    assert exact.region_bytes == FIRST_REGION
    exact.free("a")
    exact.allocate("b", FIRST_REGION)  # the freed chunk of exactly that size, at address 0
    assert exact.region_bytes == FIRST_REGION and exact._held["b"].address == 0


def test_a_chunk_larger_by_128_mib_or_more_is_split_even_under_twice_the_request():
    sim = for_allocator("mklcpu")
    sim.allocate("a", 100 * MiB)  # a 128 MiB region: 28 MiB over, under twice: not split
    assert sim.bytes_in_use == 128 * MiB
    big = for_allocator("mklcpu")
    big.allocate("b", 384 * MiB)  # a 512 MiB region: 128 MiB over: split
    assert big.bytes_in_use == 384 * MiB


def test_a_freed_chunk_merges_with_the_free_one_before_it_and_never_across_regions():
    sim = for_allocator("mklcpu")
    for key in "abcd":
        sim.allocate(key, 1 * MiB)  # a, b fill the 2 MiB region; c, d the first half of the 4 MiB one
    sim.free("a")
    sim.free("b")  # merges with a, before it: one free 2 MiB chunk at address 0
    assert sim._held.keys() == {"c", "d"} and (2 * MiB, 0) in sim._free
    sim.allocate("e", 2 * MiB)
    assert sim._held["e"].address == 0 and sim.region_bytes == 6 * MiB
    sim.free("e")
    sim.free("c")  # free beside the first region's end, in the next region: not merged with it
    sim.allocate("f", 3 * MiB)  # does not fit in either, nor in the 2 MiB after d: a new region
    assert sim.region_bytes == 6 * MiB + 8 * MiB


def test_the_peak_is_the_step_whose_simulated_allocator_peaks_highest():
    ops = [
        op(0, "big", "forward", "main", 0.0, 10.0, step=0),
        op(1, "small", "forward", "main", 100.0, 10.0, step=1),
    ]
    events = [[1.0, 1, 8 * MiB, 0], [5.0, 1, -8 * MiB, 0], [101.0, 2, 2 * MiB, 1], [105.0, 2, -2 * MiB, 1]]
    trace_ = Trace(
        rank=0, world_size=1, device="cpu", steps=[Step(0, 0.0, 50.0), Step(1, 100.0, 150.0)], ops=ops,
        memory_events=events, allocator={"name": "GPU_0_bfc", "in_use_bytes": MiB},
    )  # fmt: skip
    prediction = Predictor([trace_]).curves[0].predict()
    assert (prediction.peak_step, prediction.peak_bytes) == (0, 9 * MiB)
    assert prediction.step_peaks == {0: 9 * MiB, 1: 3 * MiB}


def test_an_allocator_that_counted_no_allocation_in_the_step_predicts_its_bytes_in_use():
    trace_ = trace(
        [op(0, "a", "forward", "main", 0.0, 10.0)],
        20.0,
        allocator={"name": "mklcpu", "in_use_bytes": 5 * MiB},
    )
    trace_.framework = "tensorflow"
    assert Predictor([trace_]).predict().peak_bytes == 5 * MiB
    assert unpredictable_peak(trace_) is None
    # a reading without a simulated step (none made here) is over the bytes in use it started from
    trace_.allocator["recorded_peak_bytes"] = 6 * MiB
    assert allocator_offset(trace_) == MiB and Predictor([trace_]).predict().peak_bytes == 6 * MiB
    trace_.allocator["in_use_bytes"] = None  # a reading without the bytes in use: nothing to calibrate
    assert allocator_offset(trace_) == 0


def test_a_tf_trace_without_allocations_says_why_it_predicts_no_peak():
    trace_ = trace([op(0, "a", "forward", "main", 0.0, 10.0)], 20.0)
    assert unpredictable_peak(trace_) is None  # torch's: the tensors' bytes are the figure
    trace_.framework = "tensorflow"
    why = unpredictable_peak(trace_)
    assert why.startswith(
        "no peak predicted: the recorded steps' profile holds no allocations of TF's allocator"
    )
    assert (
        "(on the CPU, TF records and counts them when it runs with oneDNN: TF_ENABLE_ONEDNN_OPTS=1; "
        "unset, TF decides by the CPU and may leave it off)" in why
    )
    assert why.endswith("and the resident weights alone are not a peak")
