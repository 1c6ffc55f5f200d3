"""Property test of the liveness peak: random allocation/free streams (addresses reused, equal times,
several steps, events between steps) against a plain sweep written here."""

from collections import Counter, defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_callback.predictor.memory import predict_memory, tensor_lifetimes
from qsync_callback.recorder.trace import Op, Step, Trace

KINDS = ("forward", "backward", "update", "other")
STEP_US = 20  # step k is [30 k, 30 k + 20): the 10 us after each are outside every step
STRIDE_US = 30


def _trace(steps: int, events: list[tuple[int, int, int, int]], resident: dict[str, int]) -> Trace:
    ops = [
        Op(10 * k + j, kind, kind, "main", STRIDE_US * k + 5 * j, 5, step=k)
        for k in range(steps)
        for j, kind in enumerate(KINDS)
    ]
    return Trace(
        rank=0,
        world_size=1,
        device="cpu",
        steps=[Step(k, STRIDE_US * k, STRIDE_US * k + STEP_US) for k in range(steps)],
        ops=ops,
        memory_events=[list(e) for e in events],
        resident_bytes=resident,
    )


def _reference_peaks(steps: int, events, resident: int) -> dict[int, int]:
    """Each step on its own: the tensors alive start empty; an allocation at an address still held
    ends the tensor that held it; a free of an address not held is a resident block's. At one time,
    every free comes before every allocation; the step's peak is the highest level after a time, or
    the resident bytes."""
    peaks = {}
    for k in range(steps):
        mine = [e for e in events if STRIDE_US * k <= e[0] < STRIDE_US * k + STEP_US]
        if not mine:
            continue
        change = defaultdict(int)  # time -> net bytes
        held: dict[int, int] = {}
        for ts, addr, nbytes, _ in sorted(mine, key=lambda e: e[0]):
            if nbytes > 0:
                change[ts] -= held.pop(addr, 0)
                held[addr] = nbytes
                change[ts] += nbytes
            else:
                change[ts] -= held.pop(addr, -nbytes)
        level = peak = resident
        for ts in sorted(change):
            level += change[ts]
            peak = max(peak, level)
        peaks[k] = peak
    return peaks


@st.composite
def streams(draw):
    steps = draw(st.integers(1, 4))
    n = draw(st.integers(0, 40))
    events = []
    for _ in range(n):
        ts = draw(st.integers(0, STRIDE_US * steps - 1))  # few times: many equal ones
        addr = draw(st.integers(1, 6))  # few addresses: reused
        nbytes = draw(st.integers(1, 1000)) * draw(st.sampled_from((1, -1)))
        op_id = draw(st.sampled_from((-1, 10 * (ts // STRIDE_US) + draw(st.integers(0, len(KINDS) - 1)))))
        events.append((ts, addr, nbytes, op_id))
    resident = draw(
        st.fixed_dictionaries(
            {"parameters": st.integers(0, 3000)},
            optional={"buffers": st.integers(0, 500), "gradient_buckets": st.integers(0, 500)},
        )
    )
    return steps, events, resident


@settings(max_examples=300, deadline=None)
@given(streams())
def test_liveness_peak_matches_a_plain_sweep(stream):
    steps, events, resident_bytes = stream
    memory = predict_memory(_trace(steps, events, resident_bytes))
    resident = sum(resident_bytes.values())
    expected = _reference_peaks(steps, events, resident)
    assert memory.step_peaks == expected
    assert memory.peak_bytes == max([resident, *expected.values()])
    if memory.peak_step is None:
        assert memory.peak_bytes == resident
    else:  # the first step that reaches the peak, and everything alive then is in the breakdown
        assert memory.peak_step == min(k for k, p in expected.items() if p == memory.peak_bytes)
        assert memory.peak_bytes > resident
    assert sum(memory.breakdown.values()) == memory.peak_bytes


@settings(max_examples=100, deadline=None)
@given(streams())
def test_every_event_in_a_step_is_a_birth_or_a_death_in_its_step(stream):
    """Each allocation in a step is one life's birth, with its bytes; each free is one life's death
    (an allocation at a held address is one more); nothing outside the steps is a life."""
    steps, events, resident_bytes = stream
    lives = tensor_lifetimes(_trace(steps, events, resident_bytes))
    inside = [e for e in events if e[0] % STRIDE_US < STEP_US]
    births = sorted((life.birth_us, life.bytes) for life in lives if life.birth_us is not None)
    assert births == sorted((ts, nbytes) for ts, _, nbytes, _ in inside if nbytes > 0)
    deaths = Counter(life.death_us for life in lives if life.death_us is not None)
    frees = Counter(ts for ts, _, nbytes, _ in inside if nbytes < 0)
    assert not frees - deaths
    assert not deaths - frees - Counter(ts for ts, _, nbytes, _ in inside if nbytes > 0)
    for life in lives:
        ts = life.birth_us if life.birth_us is not None else life.death_us
        assert life.step == ts // STRIDE_US
        assert life.death_us is None or life.birth_us is None or life.birth_us <= life.death_us
