"""TF profiler XSpace conversion on profiles recorded here: a Keras model's train step in this process,
and a 2-process Horovod (Gloo) run whose gradients are all-reduced; the profiler's calibrated cost
per event, charged to the ops it delays."""

import json
import textwrap

import pytest
import tensorflow as tf

from qsync_callback.errors import QSyncInputError
from qsync_callback.recorder.kineto import CALIBRATION_LOOP_PREFIX, CLOCK_SYNC
from qsync_callback.recorder.tf_recorder import ProfilerCalibration, overhead_per_event
from qsync_callback.recorder.trace import Trace
from qsync_callback.recorder.xspace import (
    ASYNC_DONE,
    EVENT_KINDS,
    STEP_NAME,
    calibration_event_counts,
    convert_xspace,
    event_kind,
    find_xspace,
    keras_layers,
    load_xspace,
)

from tf_launch import run_horovod

STEPS = (5, 6, 7)


def _model():
    block = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu", name="inner")], name="block")
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Dense(32, activation="relu", name="dense_a"),
            block,
            tf.keras.layers.Dense(4, name="head"),
        ],
        name="net",
    )
    model.build((None, 16))
    return model


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A real Keras train step, profiled for three steps; returns (model, logdir)."""
    model = _model()
    optimizer = tf.keras.optimizers.Adam()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = tf.random.normal((8, 16)), tf.zeros((8,), tf.int32)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    for _ in range(2):
        train_step(x, y)
    logdir = tmp_path_factory.mktemp("tf_profile")
    tf.profiler.experimental.start(str(logdir))
    try:
        with tf.profiler.experimental.Trace(CLOCK_SYNC):
            pass
        for k in STEPS:
            with tf.profiler.experimental.Trace(STEP_NAME, step_num=k, _r=1):
                train_step(x, y)
    finally:
        tf.profiler.experimental.stop()
    return model, logdir


def test_keras_layers_are_leaf_paths_with_their_scopes_and_weight_bytes(profiled):
    model, _ = profiled
    table = {t["name"]: t for t in keras_layers(model)}
    assert set(table) == {"dense_a", "block/inner", "head"}
    assert table["block/inner"]["scope"] == "net/block/inner"
    assert table["dense_a"] == {
        "name": "dense_a",
        "type": "Dense",
        "param_bytes": (16 * 32 + 32) * 4,
        "scope": "net/dense_a",
    }


def test_train_step_converts_into_steps_and_kinded_layered_ops(profiled, tmp_path):
    model, logdir = profiled
    layers = keras_layers(model)
    converted = convert_xspace(load_xspace(find_xspace(logdir)), layers=layers)
    steps, ops = converted["steps"], converted["ops"]
    assert [s.index for s in steps] == list(STEPS)
    assert converted["clock_sync_us"] is not None and converted["clock_sync_us"] <= steps[0].start_us
    assert all(s.start_us < o.start_us < s.end_us for s in steps for o in ops if o.step == s.index)
    assert all(op.dur_us > 0 for op in ops)
    for step in STEPS:
        kinds = {op.kind for op in ops if op.step == step}
        assert kinds == {"forward", "backward", "update"}, kinds
    by_kind = {kind: [op for op in ops if op.kind == kind] for kind in ("forward", "backward", "update")}
    assert all("gradient_tape/" in op.name for op in by_kind["backward"])
    assert all(op.name.startswith("Adam/") for op in by_kind["update"])
    names = {layer["name"] for layer in layers}
    assert {op.layer for op in by_kind["forward"]} - {None} == names
    assert {op.layer for op in by_kind["backward"]} - {None} == names
    # a layer's matmul is attributed to that layer, forward and backward
    assert any(op.layer == "block/inner" and "MatMul" in op.name for op in by_kind["backward"])

    trace = Trace(
        0, 1, "cpu", steps, ops, framework="tensorflow", framework_version=tf.__version__, layers=layers
    )
    trace.save(tmp_path / "rank0" / "trace.json")
    loaded = Trace.load(tmp_path / "rank0" / "trace.json")
    assert loaded.to_dict() == json.loads(json.dumps(trace.to_dict()))


def _charged(ops):
    return sum(op.overhead_us + op.gap_overhead_us for op in ops)


def test_each_recorded_event_is_charged_its_kinds_cost_to_the_op_it_delays(profiled):
    _, logdir = profiled
    space = load_xspace(find_xspace(logdir))
    assert _charged(convert_xspace(space)["ops"]) == 0  # not calibrated: nothing charged
    by_kind = {kind: convert_xspace(space, overhead_us={kind: 1.0})["ops"] for kind in EVENT_KINDS}
    # an op's own event goes into the idle time before it, once
    assert all(op.gap_overhead_us >= 1.0 and op.overhead_us >= 0 for op in by_kind["op"])
    # every charge is whole events, and no event is charged twice: at most the step's events
    converted = convert_xspace(space)
    inside = [
        e for e in _host_events(space) if any(s.start_us <= e[1] < s.end_us for s in converted["steps"])
    ]
    for kind, ops in by_kind.items():
        total = _charged(ops)
        assert total == int(total) and 0 < total <= sum(k == kind for k, _ in inside)
    assert _charged(by_kind["op"]) >= len(by_kind["op"])
    # costs add up linearly, by kind
    costs = {"op": 0.5, "executor": 0.25, "other": 2.0}
    every = convert_xspace(space, overhead_us=costs)["ops"]
    assert _charged(every) == pytest.approx(sum(c * _charged(by_kind[k]) for k, c in costs.items()))
    # qsync's own marks cost nothing: the step mark is not charged
    assert event_kind(STEP_NAME) is None and event_kind(CALIBRATION_LOOP_PREFIX + "ops") is None


def _host_events(space):
    """(kind, start in us) of each event on the host plane, qsync's marks left out."""
    host = next(p for p in space.planes if p.name == "/host:CPU")
    out = []
    for line in host.lines:
        for e in line.events:
            kind = event_kind(host.event_metadata[e.metadata_id].name)
            if kind is not None:
                out.append((kind, (line.timestamp_ns * 1000 + e.offset_ps) / 1e6))
    return out


def test_calibration_counts_the_events_in_its_loops_and_solves_their_costs(tmp_path):
    calibration = ProfilerCalibration()
    calibration.time_plain()
    tf.profiler.experimental.start(str(tmp_path))
    try:
        calibration.time_profiled()
        with tf.profiler.experimental.Trace("outside"):  # outside the calibration ranges: not counted
            calibration._loops["ops"]()
    finally:
        tf.profiler.experimental.stop()
    calibration.time_plain()
    counts = calibration_event_counts(load_xspace(find_xspace(tmp_path)))
    assert set(counts) == {"ops", "calls", "executor"}
    assert all(set(c) == set(EVENT_KINDS) for c in counts.values())
    repeats = ProfilerCalibration.REPEATS
    # the MatMul chain records an op event per MatMul, the cheap function hardly any
    assert counts["ops"]["op"] >= repeats * ProfilerCalibration.CHAIN > counts["calls"]["op"]
    assert counts["calls"]["other"] >= repeats  # a function call's own events
    # the while loop: the executor's events, at least one per iteration, and more than of any kind
    assert counts["executor"]["executor"] >= repeats * ProfilerCalibration.ITERATIONS
    assert counts["executor"]["executor"] > max(counts["executor"]["op"], counts["executor"]["other"])
    assert counts["executor"]["executor"] > 10 * (counts["ops"]["executor"] + counts["calls"]["executor"])
    costs = calibration.costs(tmp_path)
    assert set(costs) == set(EVENT_KINDS) and all(0 <= c < 100 for c in costs.values())
    assert all(calibration.profiled[k] > 0 and calibration.plain[k] > 0 for k in counts)


def test_overhead_per_event_solves_the_loops_equations_with_no_cost_negative():
    events = {"ops": {"op": 40, "other": 10}, "calls": {"op": 2, "other": 12}}
    plain = {"ops": 400e-6, "calls": 100e-6}
    exact = {
        "ops": plain["ops"] + (40 * 0.5 + 10 * 1.5) * 1e-6,
        "calls": plain["calls"] + (2 * 0.5 + 12 * 1.5) * 1e-6,
    }
    # no loop recorded an executor event: its cost is 0
    assert overhead_per_event(plain, exact, events) == {"op": 0.5, "executor": 0.0, "other": 1.5}
    # noise that makes the op cost negative: 0, and the other cost fitted to both loops alone
    noisy = {"ops": plain["ops"] + 10e-6, "calls": plain["calls"] + 24e-6}
    costs = overhead_per_event(plain, noisy, events)
    assert costs["op"] == 0 and costs["other"] == pytest.approx(
        (10 * 10 + 12 * 24) / (10**2 + 12**2), abs=1e-3
    )
    # a kind no loop recorded, or no loops at all: 0
    assert overhead_per_event(plain, exact, {"ops": {"op": 40}, "calls": {"op": 2}})["other"] == 0
    assert overhead_per_event({}, {}, {}) == {"op": 0.0, "executor": 0.0, "other": 0.0}


def test_profile_without_step_events_is_refused(profiled):
    _, logdir = profiled
    with pytest.raises(ValueError, match="no 'no-such-step' step events"):
        convert_xspace(load_xspace(find_xspace(logdir)), step_name="no-such-step")


def test_missing_or_foreign_profile_names_the_file(tmp_path):
    with pytest.raises(QSyncInputError, match="no \\*.xplane.pb profile"):
        find_xspace(tmp_path)
    bad = tmp_path / "vm.xplane.pb"
    bad.write_bytes(b"\xff\xff\xff not a profile")
    with pytest.raises(QSyncInputError, match="vm.xplane.pb"):
        load_xspace(bad)


_HOROVOD_SCRIPT = """
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
import horovod.tensorflow as hvd
from qsync_callback.recorder.xspace import STEP_NAME

hvd.init()
model = tf.keras.Sequential(
    [tf.keras.layers.Dense(32, activation="relu", name="dense_a"), tf.keras.layers.Dense(4, name="head")],
    name="net",
)
model.build((None, 16))
optimizer = tf.keras.optimizers.SGD(0.01)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
x, y = tf.random.normal((8, 16)), tf.zeros((8,), tf.int32)

@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

for _ in range(2):
    train_step(x, y)
tf.profiler.experimental.start(os.path.join(sys.argv[1], f"rank{hvd.rank()}"))
for k in range(2):
    with tf.profiler.experimental.Trace(STEP_NAME, step_num=k, _r=1):
        train_step(x, y)
# Horovod's thread may still be inside the last completion's event when the step returns: one more
# (unmarked) step lets it finish before the profiler stops, as the recorder does.
train_step(x, y)
tf.profiler.experimental.stop()
"""


def test_horovod_allreduces_become_comm_ops_on_horovods_thread(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_HOROVOD_SCRIPT))
    run_horovod([str(script), str(tmp_path)])

    layers = [{"name": n, "scope": f"net/{n}"} for n in ("dense_a", "head")]
    for rank in range(2):
        converted = convert_xspace(load_xspace(find_xspace(tmp_path / f"rank{rank}")), layers=layers)
        ops = converted["ops"]
        ids = {op.id: op for op in ops}
        for step in (0, 1):
            comms = sorted(
                (op for op in ops if op.step == step and op.kind == "comm"), key=lambda o: o.start_us
            )
            # one all-reduce per gradient: kernel and bias of each layer
            assert len(comms) == 4
            assert sorted(op.layer for op in comms) == ["dense_a", "dense_a", "head", "head"]
            assert all(op.collective == {"op": "all_reduce"} and op.dur_us > 0 for op in comms)
            assert len({op.thread for op in comms}) == 1 and comms[0].thread.startswith("comm:")
            assert all(a.end_us <= b.start_us + 1e-6 for a, b in zip(comms, comms[1:], strict=False))
            for op in comms:
                assert [ids[d].step for d in op.deps] == [step]
                assert not ids[op.deps[0]].thread.startswith("comm:")
            kinds = {op.kind for op in ops if op.step == step}
            assert kinds == {"forward", "backward", "update", "comm"}

    # a completion the profile lost (its event ended after the profiler stopped): the step's end
    space = load_xspace(find_xspace(tmp_path / "rank0"))
    host = space.planes[0]
    done_id = next(k for k, m in host.event_metadata.items() if m.name == ASYNC_DONE)
    line = next(ln for ln in host.lines if any(e.metadata_id == done_id for e in ln.events))
    step_end_ps = convert_xspace(space)["steps"][-1].end_us * 1e6 - line.timestamp_ns * 1000
    last = max(
        (e.offset_ps, i)
        for i, e in enumerate(line.events)
        if e.metadata_id == done_id and e.offset_ps < step_end_ps
    )[1]
    del line.events[last]
    converted = convert_xspace(space, layers=layers)
    comms = sorted((op for op in converted["ops"] if op.kind == "comm"), key=lambda o: o.end_us)
    assert len(comms) == 8 and len({op.thread for op in comms}) == 1
    assert comms[-1].end_us == converted["steps"][-1].end_us
