"""Tensor liveness on a hand-written step: categories, inactive periods and the peak."""

from qsync_callback.predictor.memory import predict_memory, tensor_lifetimes

from tracebuilder import op, trace


def _step():
    ops = [
        op(0, "linear", "forward", "main", 0, 10, layer="fc"),
        op(1, "relu", "forward", "main", 10, 10, layer="act"),
        op(2, "ReluBackward0", "backward", "main", 30, 10, layer="act"),
        op(3, "AddmmBackward0", "backward", "main", 40, 10, layer="fc"),
        op(4, "adam", "update", "main", 60, 10),
    ]
    events = [
        [1, 0xA, 400, 0],  # fc output, saved for backward (freed in fc's backward)
        [11, 0xB, 400, 1],  # relu output, saved, freed in relu's backward
        [12, 0xC, 100, 1],  # a temporary of relu, freed in forward
        [15, 0xC, -100, 1],
        [32, 0xD, 300, 2],  # gradient of the input, a temporary of backward
        [35, 0xB, -400, 2],
        [42, 0xE, 800, 3],  # weight gradient, kept past backward
        [45, 0xA, -400, 3],
        [46, 0xD, -300, 3],
        [61, 0xF, 1600, 4],  # optimizer state, kept
        [62, 0x1, -50, 4],  # a tensor from before the window, freed here
    ]
    return trace(
        ops,
        step_end=80,
        memory_events=events,
        resident_bytes={"parameters": 1000, "optimizer_state": 0, "gradients": 0, "buffers": 0},
    )


def test_lifetimes_are_categorized_by_the_phases_of_birth_and_death():
    lives = {life.addr: life for life in tensor_lifetimes(_step())}
    assert lives[0xA].category == "activations" and lives[0xA].layer == "fc"
    assert lives[0xB].category == "activations" and lives[0xB].layer == "act"
    assert lives[0xC].category == "temporaries"
    assert lives[0xD].category == "temporaries"
    assert lives[0xE].category == "gradients" and lives[0xE].death_us is None
    assert lives[0xF].category == "optimizer_state"
    assert lives[0x1].category == "resident" and lives[0x1].birth_us is None
    # inactive period: from the end of fc's forward (10) to the start of its backward (40)
    assert lives[0xA].inactive_us == 30


def test_peak_is_the_largest_live_sum_and_says_what_is_alive():
    memory = predict_memory(_step())
    # after the optimizer state is born at 61: 1000 resident + 800 gradient + 1600 state
    assert memory.peak_bytes == 1000 + 800 + 1600
    assert memory.breakdown["parameters"] == 1000
    assert memory.breakdown["gradients"] == 800
    assert memory.breakdown["optimizer_state"] == 1600
    assert memory.breakdown["activations"] == 0


def test_other_resident_tensors_are_part_of_every_step():
    """A tensor the step starts from that no other category counts (one kept as a plain attribute,
    the batch, the data set) is resident like the parameters, at the peak and in its breakdown."""
    t = _step()
    t.resident_bytes = {**t.resident_bytes, "other": 5000}
    memory = predict_memory(t)
    assert memory.peak_bytes == 1000 + 5000 + 800 + 1600
    assert memory.breakdown["other"] == 5000
    assert sum(memory.breakdown.values()) == memory.peak_bytes


def test_peak_in_backward_holds_activations_and_the_input_gradient():
    t = _step()
    t.memory_events = [e for e in t.memory_events if e[1] not in (0xE, 0xF)]
    memory = predict_memory(t)
    # at 32: resident 1000 + both saved activations (800) + the input gradient being made (300)
    assert memory.peak_bytes == 2100
    assert memory.breakdown["activations"] == 800
    assert memory.breakdown["temporaries"] == 300


def test_gradients_replaced_in_the_step_free_the_old_ones_even_when_unreported():
    """The profiler misses frees of blocks allocated before its session: last step's gradients,
    replaced by this step's (zero_grad with set_to_none), are freed at the backward's start."""
    ops = [
        op(0, "linear", "forward", "main", 0, 10, layer="fc"),
        op(1, "AddmmBackward0", "backward", "main", 20, 10, layer="fc"),
        op(2, "sgd", "update", "main", 40, 10),
    ]
    events = [
        [1, 0xA, 400, 0],  # saved activation
        [22, 0xB, 800, 1],  # this step's gradient, kept
        [25, 0xA, -400, 1],
        [42, 0xC, 100, 2],  # an update temporary
        [45, 0xC, -100, 2],
    ]
    step = trace(ops, step_end=60, memory_events=events, resident_bytes={"parameters": 800, "gradients": 800})
    lives = tensor_lifetimes(step)
    (unseen,) = [life for life in lives if life.category == "resident"]
    assert unseen.bytes == 800 and unseen.death_us == 20
    # without the restored free the old and new gradients would both count: 800 + 800 + 800 + 100
    assert predict_memory(step).peak_bytes == 800 + 800 + 400
    # a reported free of another size (last step's batch, say) is not the gradient's...
    other = trace(
        ops, step_end=60, memory_events=[[5, 0xD, -300, 0], *events], resident_bytes=step.resident_bytes
    )
    assert sorted(life.bytes for life in tensor_lifetimes(other) if life.category == "resident") == [300, 800]
    # ...one of its size before the backward is, and nothing is added
    seen = trace(
        ops, step_end=60, memory_events=[[5, 0xE, -800, 0], *events], resident_bytes=step.resident_bytes
    )
    assert [life.bytes for life in tensor_lifetimes(seen) if life.category == "resident"] == [800]
