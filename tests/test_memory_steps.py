"""Tensor liveness over several recorded steps: the peak is the largest step's, each step starts from
the resident state alone, events at one time free before they allocate, a reused address ends the
tensor that held it, and last step's unseen gradient frees are restored per step, before the backward
only."""

import numpy as np

from qsync_callback.predictor.memory import (
    MemoryCurve,
    lifetime_events,
    predict_memory,
    tensor_lifetimes,
)
from qsync_callback.recorder.trace import Op, Step, Trace

STEP_US = 100  # step k is [100 k, 100 k + 100); its forward, backward and update at +0, +20, +40
RESIDENT = {"parameters": 1000}
# op ids: 10 k + 0 forward, 10 k + 1 backward, 10 k + 2 update
FWD, BWD, UPD = 0, 1, 2


def _ops(steps: int) -> list[Op]:
    ops = []
    for k in range(steps):
        base = k * STEP_US
        for offset, (kind, start) in enumerate((("forward", 0), ("backward", 20), ("update", 40))):
            ops.append(Op(10 * k + offset, f"{kind}{k}", kind, "main", base + start, 10, step=k, layer="fc"))
    return ops


def _trace(steps: int, events: list[list], resident: dict[str, int] | None = None) -> Trace:
    """``events``: [time within its step, addr, bytes, step, FWD/BWD/UPD]."""
    memory_events = [[k * STEP_US + t, addr, nbytes, 10 * k + phase] for t, addr, nbytes, k, phase in events]
    return Trace(
        rank=0,
        world_size=1,
        device="cpu",
        steps=[Step(k, k * STEP_US, (k + 1) * STEP_US) for k in range(steps)],
        ops=_ops(steps),
        memory_events=memory_events,
        resident_bytes=dict(RESIDENT if resident is None else resident),
    )


def test_peak_is_the_largest_step_not_the_last():
    """Three steps with peaks of 400, 900 and 300 above the resident bytes: the middle one is the
    prediction, and each step's own peak is kept."""
    events = [
        [1, 0xA, 400, 0, FWD],
        [25, 0xA, -400, 0, BWD],
        [1, 0xA, 500, 1, FWD],
        [2, 0xB, 400, 1, FWD],
        [25, 0xB, -400, 1, BWD],
        [26, 0xA, -500, 1, BWD],
        [1, 0xC, 300, 2, FWD],
        [25, 0xC, -300, 2, BWD],
    ]
    memory = predict_memory(_trace(3, events))
    assert memory.step_peaks == {0: 1400, 1: 1900, 2: 1300}
    assert memory.peak_bytes == 1900 and memory.peak_step == 1
    assert memory.breakdown["activations"] == 900
    assert sum(memory.breakdown.values()) == memory.peak_bytes


def test_first_of_equal_step_peaks_is_named():
    events = [[1, 0xA, 400, k, FWD] for k in range(3)] + [[25, 0xA, -400, k, BWD] for k in range(3)]
    memory = predict_memory(_trace(3, events))
    assert memory.step_peaks == {0: 1400, 1: 1400, 2: 1400}
    assert memory.peak_bytes == 1400 and memory.peak_step == 0


def test_a_step_below_the_resident_bytes_leaves_the_peak_at_the_resident_bytes():
    """A step that only frees resident tensors never rises above its start."""
    memory = predict_memory(_trace(2, [[5, 0x1, -300, 0, FWD], [5, 0x2, -100, 1, FWD]]))
    assert memory.step_peaks == {0: 1000, 1: 1000}
    assert memory.peak_bytes == 1000 and memory.peak_step is None
    assert memory.breakdown["parameters"] == 1000 and memory.breakdown["freed_resident"] == 0


def test_no_events_predicts_the_resident_bytes():
    memory = predict_memory(_trace(2, [], resident={"parameters": 700, "buffers": 300}))
    assert memory.peak_bytes == 1000 and memory.peak_step is None and memory.step_peaks == {}
    assert memory.breakdown["parameters"] == 700 and memory.breakdown["buffers"] == 300


def test_at_equal_times_frees_come_before_allocations():
    """An allocator reuses a freed block at once: a free and an allocation reported at the same time
    (in either order in the trace) never hold both tensors."""
    events = [
        # step 0: the allocation is listed before the free of the same time
        [1, 0xA, 400, 0, FWD],
        [10, 0xB, 600, 0, FWD],
        [10, 0xA, -400, 0, FWD],
        [30, 0xB, -600, 0, BWD],
        # step 1: the free first, and a resident tensor freed at the same time as well
        [1, 0xA, 400, 1, FWD],
        [10, 0xA, -400, 1, FWD],
        [10, 0x1, -100, 1, FWD],
        [10, 0xB, 600, 1, FWD],
        [30, 0xB, -600, 1, BWD],
    ]
    memory = predict_memory(_trace(2, events))
    assert memory.step_peaks == {0: 1000 + 600, 1: 1000 - 100 + 600}
    assert memory.peak_bytes == 1600 and memory.peak_step == 0


def test_equal_times_in_the_events_are_sorted_frees_first():
    lives = tensor_lifetimes(
        _trace(1, [[1, 0xA, 400, 0, FWD], [10, 0xB, 600, 0, FWD], [10, 0xA, -400, 0, FWD]])
    )
    times, deltas, _ = lifetime_events(lives)[0]
    assert times.tolist() == [1, 10, 10] and deltas.tolist() == [400, -400, 600]


def test_extra_tensors_merge_frees_first_at_equal_times():
    """A plan's extra tensors (`MemoryCurve.predict`'s ``extra``) are sorted with the step's own:
    an extra free at the time of a recorded allocation comes first, and the other way round."""
    events = [[1, 0xA, 400, 0, FWD], [10, 0xB, 600, 0, FWD], [30, 0xB, -600, 0, BWD], [30, 0xA, -400, 0, BWD]]
    t = _trace(2, events)
    curve = MemoryCurve(t, tensor_lifetimes(t))
    assert curve.predict().peak_bytes == 2000
    cat = np.array([0])
    # an extra 500 from 0 to 10 (freed when B is born) and an extra 50 born at 30 (when both die)
    extra = {0: (np.array([0.0, 10.0, 30.0]), np.array([500.0, -500.0, 50.0]), np.array([0, 0, 0]))}
    memory = curve.predict([extra])
    assert memory.peak_bytes == 2000 and memory.step_peaks == {0: 2000}
    # an extra step of its own, with no recorded tensors
    memory = curve.predict([{1: (np.array([5.0]), np.array([3000.0]), cat)}])
    assert memory.step_peaks == {0: 2000, 1: 4000} and memory.peak_step == 1
    assert memory.breakdown["activations"] == 3000


def test_a_freed_address_reused_is_a_new_tensor():
    events = [
        [1, 0xA, 400, 0, FWD],
        [5, 0xA, -400, 0, FWD],
        [6, 0xA, 300, 0, FWD],
        [25, 0xA, -300, 0, BWD],
    ]
    lives = tensor_lifetimes(_trace(1, events))
    assert [(life.birth_us, life.death_us, life.bytes, life.category) for life in lives] == [
        (1, 5, 400, "temporaries"),
        (6, 25, 300, "activations"),
    ]
    assert predict_memory(_trace(1, events)).peak_bytes == 1400


def test_an_address_allocated_again_without_a_free_ends_the_old_tensor():
    """The profiler missed the free: the block was freed by the time it was handed out again."""
    events = [
        [1, 0xA, 1000, 0, FWD],
        [2, 0xB, 100, 0, FWD],
        [5, 0xA, 200, 0, FWD],  # A reallocated: the old 1000 ended at 5
        [25, 0xA, -200, 0, BWD],
        [26, 0xB, -100, 0, BWD],
    ]
    lives = tensor_lifetimes(_trace(1, events))
    a = sorted((life.birth_us, life.death_us, life.bytes) for life in lives if life.addr == 0xA)
    assert a == [(1, 5, 1000), (5, 25, 200)]
    memory = predict_memory(_trace(1, events))
    assert memory.peak_bytes == 1000 + 1000 + 100


def test_each_step_starts_from_the_resident_state_alone():
    """A tensor still alive at its step's end (this step's gradient) belongs to that step only: the
    next step does not start with it, and a free of its address there is a resident block's."""
    events = [
        [1, 0xA, 400, 0, FWD],
        [22, 0x9, 800, 0, BWD],  # step 0's gradient, kept
        [25, 0xA, -400, 0, BWD],
        [5, 0x9, -800, 1, FWD],  # freed in step 1: a resident block to step 1
        [22, 0xB, 100, 1, BWD],
        [25, 0xB, -100, 1, BWD],
    ]
    t = _trace(2, events)
    lives = tensor_lifetimes(t)
    g = [(life.step, life.birth_us, life.death_us, life.category) for life in lives if life.addr == 0x9]
    assert g == [(0, 22, None, "gradients"), (1, None, 105, "resident")]
    memory = predict_memory(t)
    # step 1 falls below its start (the free) and never rises above it again
    assert memory.step_peaks == {0: 1000 + 400 + 800, 1: 1000}
    assert memory.peak_bytes == 2200 and memory.peak_step == 0
    assert memory.breakdown["gradients"] == 800 and memory.breakdown["activations"] == 400


def test_a_tensor_kept_in_an_early_step_is_not_counted_in_a_later_one():
    """Nothing touches step 0's kept tensor again: it is alive to step 0's end and no further."""
    events = [[1, 0xA, 5000, 0, UPD], [1, 0xB, 100, 1, FWD], [1, 0xC, 200, 2, FWD]]
    memory = predict_memory(_trace(3, events))
    assert memory.step_peaks == {0: 6000, 1: 1100, 2: 1200}
    assert memory.peak_step == 0 and memory.breakdown["optimizer_state"] == 5000


def test_events_outside_every_step_are_ignored():
    t = _trace(2, [[1, 0xA, 400, 0, FWD], [25, 0xA, -400, 0, BWD]])
    t.steps = [t.steps[0], Step(1, 150, 200)]  # a gap from 100 to 150
    t.memory_events += [[120, 0xC, 9000, 11], [160, 0xD, 50, 11]]
    lives = tensor_lifetimes(t)
    assert sorted((life.step, life.addr) for life in lives) == [(0, 0xA), (1, 0xD)]
    assert predict_memory(t).step_peaks == {0: 1400, 1: 1050}


def test_unseen_gradient_frees_are_restored_per_step():
    """Each step that keeps new gradients replaced last step's: step 0's free of the old gradient
    was reported (before its backward), step 1's was not and is restored at step 1's backward."""
    events = [
        [1, 0xA, 400, 0, FWD],
        [5, 0xE, -800, 0, FWD],  # reported: last step's gradient, zeroed before the backward
        [22, 0x9, 800, 0, BWD],
        [23, 0x7, 200, 0, BWD],  # a temporary of the backward: step 0's peak, after the free
        [24, 0x7, -200, 0, BWD],
        [25, 0xA, -400, 0, BWD],
        [1, 0xA, 400, 1, FWD],
        [22, 0x9, 800, 1, BWD],
        [25, 0xA, -400, 1, BWD],
    ]
    t = _trace(2, events, resident={"parameters": 800, "gradients": 800})
    resident = sorted(
        (life.step, life.death_us, life.bytes, life.addr)
        for life in tensor_lifetimes(t)
        if life.category == "resident"
    )
    assert resident == [(0, 5, 800, 0xE), (1, 120, 800, -1)]
    memory = predict_memory(t)
    # without step 1's restored free, its old and new gradients would both count: 1600 + 400 + 800
    assert memory.step_peaks == {0: 1600 + 400 - 800 + 800 + 200, 1: 1600 + 400}
    assert memory.peak_step == 0 and memory.breakdown["freed_resident"] == -800
    assert memory.breakdown["temporaries"] == 200 and memory.breakdown["gradients"] == 800 + 800


def test_a_resident_free_at_or_after_the_backward_start_is_not_the_gradient():
    """Only a free before the first backward op's start (where the loop has zeroed the gradients at
    the latest) stands for the old gradient; one at its very start, or in it, is something else."""
    for at in (20, 25, 45):
        events = [
            [1, 0xA, 400, 0, FWD],
            [at, 0xE, -800, 0, BWD],
            [22, 0x9, 800, 0, BWD],
            [24, 0xA, -400, 0, BWD],
        ]
        t = _trace(1, events, resident={"parameters": 800, "gradients": 800})
        resident = sorted(
            (life.death_us, life.addr) for life in tensor_lifetimes(t) if life.category == "resident"
        )
        assert resident == sorted([(at, 0xE), (20, -1)]), at
    # just before the start, it does stand for it
    t = _trace(
        1,
        [[1, 0xA, 400, 0, FWD], [19.5, 0xE, -800, 0, FWD], [22, 0x9, 800, 0, BWD]],
        resident={"parameters": 800, "gradients": 800},
    )
    assert [life.addr for life in tensor_lifetimes(t) if life.category == "resident"] == [0xE]


def test_restored_gradient_frees_are_capped_at_the_resident_gradients():
    events = [[22, 0x9, 800, 0, BWD], [23, 0x8, 800, 0, BWD]]
    t = _trace(1, events, resident={"parameters": 800, "gradients": 1000})
    (unseen,) = [life for life in tensor_lifetimes(t) if life.category == "resident"]
    assert unseen.bytes == 1000 and unseen.death_us == 20
    assert predict_memory(t).peak_bytes == 1800 - 1000 + 1600


def test_categories_follow_the_phases_of_birth_and_death():
    """Every pair of phases, ``None``: still alive at the step's end."""
    kinds = ("forward", "backward", "update", "cast", "comm")
    ops = [Op(j, kind, kind, "main", 20 * j, 10, step=0) for j, kind in enumerate(kinds)]
    expected = {
        ("forward", "backward"): "activations",
        ("forward", "forward"): "temporaries",
        ("forward", "update"): "other",
        ("forward", None): "other",
        ("backward", "backward"): "temporaries",
        ("backward", "update"): "gradients",
        ("backward", None): "gradients",
        ("update", "update"): "temporaries",
        ("update", "cast"): "optimizer_state",
        ("update", None): "optimizer_state",
        ("cast", "cast"): "temporaries",
        ("cast", "comm"): "other",
        ("cast", None): "other",
    }
    events = []
    for addr, (born, died) in enumerate(expected, start=1):
        j = kinds.index(born)
        events.append([20 * j + 1, addr, 100, j])
        if died is not None:
            k = kinds.index(died)
            events.append([20 * k + 2, addr, -100, k])
    t = Trace(0, 1, "cpu", [Step(0, 0, 100)], ops, memory_events=events, resident_bytes=dict(RESIDENT))
    lives = {life.addr: life for life in tensor_lifetimes(t)}
    assert {pair: lives[addr].category for addr, pair in enumerate(expected, start=1)} == expected
    for addr, (born, died) in enumerate(expected, start=1):
        assert lives[addr].birth_op.kind == born
        assert (lives[addr].death_op and lives[addr].death_op.kind) == died


def test_a_tensor_born_outside_every_op_is_not_resident():
    """An allocation before the step's first op (op id -1: none) was born in the step: it is not a
    resident block, and not last step's gradient, whether it is freed or kept."""
    events = [
        [1, 0x1, 800, 0, FWD],  # kept: not freed by the step's end
        [2, 0x2, 800, 0, FWD],  # freed before the backward, the size of a gradient
        [5, 0x2, -800, 0, FWD],
        [22, 0x9, 800, 0, BWD],
    ]
    t = _trace(1, events, resident={"parameters": 800, "gradients": 800})
    t.memory_events[0][3] = t.memory_events[1][3] = -1  # no op
    lives = tensor_lifetimes(t)
    assert sorted(life.category for life in lives if life.addr in (0x1, 0x2)) == ["other", "other"]
    (unseen,) = [life for life in lives if life.category == "resident"]
    assert unseen.bytes == 800 and unseen.death_us == 20
    memory = predict_memory(t)
    assert memory.peak_bytes == 1600 + 800 + 800  # at 2, both alive
    assert memory.breakdown["freed_resident"] == 0 and memory.breakdown["other"] == 1600


def test_the_ops_that_end_a_tensor_are_kept():
    """The op that reallocated an address ended the old tensor there; a resident block's free names
    its op; a restored gradient free names the first backward op, earliest by time, not by listing."""
    events = [
        [1, 0xA, 1000, 0, FWD],
        [22, 0xA, 200, 0, BWD],  # reallocated in the backward: the old one was saved for it
        [23, 0x1, -300, 0, BWD],
        [24, 0x9, 800, 0, BWD],
    ]
    t = _trace(1, events, resident={"parameters": 800, "gradients": 800})
    backward = t.ops[1]
    # more backward ops starting later, listed before and after the first
    t.ops.insert(0, Op(3, "backward_late", "backward", "main", 30, 5, step=0))
    t.ops.append(Op(4, "backward_later", "backward", "main", 35, 5, step=0))
    lives = tensor_lifetimes(t)
    old = next(life for life in lives if life.addr == 0xA and life.birth_us == 1)
    assert old.death_op is backward and old.category == "activations" and old.inactive_us == 10
    freed = next(life for life in lives if life.addr == 0x1)
    assert freed.death_op is backward and freed.bytes == 300
    (unseen,) = [life for life in lives if life.addr == -1]
    assert unseen.death_op is backward and unseen.death_us == 20 and unseen.bytes == 800


def test_a_single_missing_byte_is_restored():
    t = _trace(1, [[22, 0x9, 1, 0, BWD]], resident={"parameters": 10, "gradients": 1})
    assert [(life.bytes, life.death_us) for life in tensor_lifetimes(t) if life.addr == -1] == [(1, 20)]
    assert predict_memory(t).peak_bytes == 11


def test_every_resident_category_is_in_the_breakdown():
    resident = {
        "parameters": 1000,
        "buffers": 10,
        "gradient_buckets": 300,
        "optimizer_state": 2000,
        "other": 7,
    }
    memory = predict_memory(_trace(1, [[1, 0xA, 400, 0, FWD], [25, 0xA, -400, 0, BWD]], resident=resident))
    assert memory.peak_bytes == sum(resident.values()) + 400
    for category, nbytes in resident.items():
        assert memory.breakdown[category] == nbytes
    assert sum(memory.breakdown.values()) == memory.peak_bytes


def test_extra_tensors_are_priced_with_the_step():
    """Extra tensors of a plan add to the recorded step's curve where they overlap it."""
    t = _trace(1, [[1, 0xA, 400, 0, FWD], [25, 0xA, -400, 0, BWD]])
    curve = MemoryCurve(t, tensor_lifetimes(t))
    extra = {0: (np.array([2.0, 24.0]), np.array([300.0, -300.0]), np.array([1, 1]))}
    memory = curve.predict([extra])
    assert memory.peak_bytes == 1700 and memory.breakdown["temporaries"] == 300
    assert memory.breakdown["activations"] == 400
    # two plans' extras at once
    memory = curve.predict([extra, extra])
    assert memory.peak_bytes == 2000 and memory.breakdown["temporaries"] == 600
    # and the curve itself is unchanged
    assert curve.predict().peak_bytes == 1400


def test_given_lives_are_used_as_they_are():
    t = _trace(1, [[1, 0xA, 400, 0, FWD], [2, 0xB, 300, 0, FWD]])
    lives = [life for life in tensor_lifetimes(t) if life.addr == 0xB]
    assert predict_memory(t).peak_bytes == 1700
    assert predict_memory(t, lives).peak_bytes == 1300
    assert predict_memory(t, []).peak_bytes == 1000
