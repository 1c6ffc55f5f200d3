"""TensorFlow's peak memory: the BFC allocator simulation against TF's own allocator, the measured
peak of each timed step, the allocations of the profiled steps in the trace, the predicted peak
(recorded configuration and op-type plans), and no prediction where TF records no allocations."""

import json
import random
import re
import textwrap

import horovod.tensorflow as hvd
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_callback.errors import QSyncInputError
from qsync_callback.integrations.horovod_tf import Recorder, profile
from qsync_callback.plan import Constraints, Plan
from qsync_callback.planner.tf_plans import choose_tf_plan
from qsync_callback.predictor.bfc_allocator import (
    FIRST_REGION,
    SMALL_ALLOCATION,
    BFCAllocator,
    for_allocator,
    rounded,
    simulate,
)
from qsync_callback.predictor.memory import allocator_peaks, tensor_lifetimes
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.trace import load_trace_dir

from keras_steps import mlp_and_step
from tf_launch import EXAMPLE, run_python
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


# ----------------------------------------------------------------------------- hand-made traces


def _two_op_trace(allocator=None, made=4 * MiB, weight=8 * MiB):
    """fc/MatMul (0-100 us) makes ``made`` bytes freed when fc/Relu (105-125) ends; fc/Relu makes as
    many, freed when loss (125-135) ends; the MatMul's inputs x (4 MiB) and w (``weight``) are no
    recorded ops."""
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


def test_a_step_that_frees_what_the_step_before_kept_meets_it_held():
    """A step keeps 3 MiB (its loss, say) and frees the 3 MiB the step before kept: the simulation
    holds that one from the start and frees it, without counting it twice."""
    ops = [op(0, "a", "forward", "main", 0.0, 10.0), op(1, "b", "forward", "main", 20.0, 10.0)]
    events = [[1.0, 7, -3 * MiB, 0], [21.0, 8, 3 * MiB, 1]]  # addr 7: made before the step
    trace_ = trace(ops, 40.0, memory_events=events, allocator={"name": "mklcpu", "in_use_bytes": 5 * MiB})
    assert allocator_peaks(tensor_lifetimes(trace_), "mklcpu", 5 * MiB) == {0: 5 * MiB}


# ----------------------------------------------------------------------------- a real window

WINDOW = {"warmup_steps": 3, "profile_steps": 2, "measure_steps": 6}
CALLS = 3 + 1 + 2 * 2 + 6 + 1


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """An MLP whose activations (128 x 1024 floats, 512 KiB) the CPU allocator counts, recorded."""
    hvd.init()
    model, optimizer, train_step = mlp_and_step(1024, 512)
    batch = (tf.random.normal((128, 512)), tf.zeros((128,), tf.int32))
    out = tmp_path_factory.mktemp("tf_memory") / "qsync"
    recorder = Recorder(model=model, batch_size=128, output_dir=out, optimizer=optimizer, **WINDOW)
    step = profile(recorder)(train_step)
    for _ in range(CALLS):
        step(*batch)
    assert recorder.finished and recorder.failure is None
    return out


def test_each_timed_step_has_its_allocator_peak_and_the_largest_is_measured(recorded):
    (trace_,) = load_trace_dir(recorded / "trace")
    peaks = trace_.measured["step_peak_bytes"]
    assert len(peaks) == len(trace_.measured["step_ms"]) > 0
    assert trace_.measured["peak_bytes"] == max(peaks)
    assert "TensorFlow's allocator (CPU:0" in trace_.measured["peak_source"]
    # the weights (2 MiB of them in one counted tensor) and the step's activations
    assert (
        min(peaks) > trace_.allocator["in_use_bytes"] > trace_.resident_bytes["parameters"] - SMALL_ALLOCATION
    )


def test_the_profiled_steps_allocations_are_the_traces_memory_events(recorded):
    (trace_,) = load_trace_dir(recorded / "trace")
    assert trace_.allocator["name"] == "mklcpu" and trace_.allocator["in_use_bytes"] > 0
    ops = {o.id: o for o in trace_.ops}
    allocations = [e for e in trace_.memory_events if e[2] > 0]
    assert allocations and all(abs(e[2]) >= SMALL_ALLOCATION for e in trace_.memory_events)
    assert all(e[3] in ops and ops[e[3]].step is not None for e in allocations)
    steps = {s.index: s for s in trace_.steps}
    assert all(any(s.start_us <= e[0] <= s.end_us for s in steps.values()) for e in trace_.memory_events)
    frees = [e for e in trace_.memory_events if e[2] < 0]
    assert sum(e[3] >= 0 for e in frees) == len(frees)  # each free put on the op that dropped it


def test_the_predicted_peak_is_the_simulated_allocators_within_the_measured_steps(recorded):
    report = json.loads((recorded / "report.json").read_text())
    measured, predicted = report["measured"], report["predicted"]
    assert measured["peak_steps"] > 0 and measured["peak_bytes_min"] <= measured["peak_bytes_median"]
    assert predicted["peak_bytes"] is not None and "peak_note" not in predicted
    # the allocator's peak moves with the order TF's threads run ops in: within its range, or near it
    assert 0.9 * measured["peak_bytes_min"] <= predicted["peak_bytes"] <= 1.1 * measured["peak_bytes"]


def test_without_onednn_no_peak_is_measured_or_predicted_and_the_report_says_why(tmp_path):
    out = tmp_path / "qsync"
    args = [str(EXAMPLE), "--model", "mlp", "--steps", "14", "--batch-size", "64", "--output-dir", str(out)]
    args += ["--warmup-steps", "2", "--profile-steps", "2", "--measure-steps", "3"]
    run = run_python(args, env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    report = json.loads((out / "report.json").read_text())
    assert report["measured"]["peak_bytes"] is None
    assert "keeps no statistics" in report["measured"]["peak_source"]
    assert (
        report["predicted"]["peak_bytes"] is None and "no peak predicted" in report["predicted"]["peak_note"]
    )
    assert "peak memory measured n/a" in run.stdout and "predicted n/a" in run.stdout
    assert "note: no peak predicted" in run.stdout


def test_random_sequences_give_one_peak_from_one_start():
    """Two identical simulations agree (no hidden state between them)."""
    rng = random.Random(3)
    moves = [(k, rng.randint(1, 4 * MiB)) for k in range(30)] + [(k, -1) for k in range(0, 30, 2)]
    runs = [simulate(moves, for_allocator("mklcpu")) for _ in range(2)]
    assert len({(r.bytes_in_use, r.peak_bytes_in_use, r.region_bytes) for r in runs}) == 1


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
