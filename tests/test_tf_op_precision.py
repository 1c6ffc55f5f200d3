"""Mixed precision per op type (TF's auto-mixed-precision lists): pricing on a hand-written trace with
a known answer, the plan's translation into TF's env lists and their effect on TF's rewrite, the env
put back, a kept plan applied at the first call from the plan cache (one for another run, or with an
op type TF does not know, refused with nothing applied), and the example's planning window
measuring TF's bf16 rewrite per op type."""

import copy
import json
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence

import horovod.tensorflow as hvd
import pytest
import tensorflow as tf

from qsync_callback.cache import plan_cache_path, store_plan
from qsync_callback.integrations.horovod_tf import Recorder, profile
from qsync_callback.integrations.horovod_tf.horovod_run import batch_shapes_of, job_name, tf_fingerprint
from qsync_callback.integrations.horovod_tf.mixed_precision import (
    AMP_OPTION,
    ENV_PREFIX,
    PRIORLIST_FILE,
    PRIORLIST_FILE_VAR,
    env_lists,
    rewrite_on,
)
from qsync_callback.plan import Constraints, Plan
from qsync_callback.planner.op_precision import measured_op_types
from qsync_callback.predictor.op_precision import rewrite_change
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.tf_op_types import READING_BLOCK_CALLS, READING_ROUNDS, allocated_per_step
from qsync_callback.recorder.trace import load_trace_dir
from qsync_callback.recorder.xspace import keras_layers

from keras_steps import NO_BF16_CPU, cpu_runs_bf16, mlp_and_step
from tf_launch import EXAMPLE, SHORT_TURNS, run_python
from tracebuilder import op


def test_an_op_type_plan_becomes_tf_env_lists_and_a_priorlist(tmp_path):
    env = env_lists({"MatMul": "bf16", "ReluGrad": "bf16", "BiasAddGrad": "fp32"}, tmp_path / PRIORLIST_FILE)
    p = ENV_PREFIX
    assert env == {
        p + "ALLOWLIST_ADD": "ReluGrad",  # MatMul is on TF's allow list already
        p + "ALLOWLIST_REMOVE": "BiasAddGrad",
        p + "INFERLIST_REMOVE": "MatMul,ReluGrad,BiasAddGrad",
        p + "CLEARLIST_REMOVE": "MatMul,ReluGrad,BiasAddGrad",
        p + "DENYLIST_REMOVE": "MatMul,ReluGrad",
        p + "DENYLIST_ADD": "BiasAddGrad",
        p + "PRIORLIST_ADD": "MatMul,ReluGrad",
        PRIORLIST_FILE_VAR: str(tmp_path / PRIORLIST_FILE),
    }
    assert (tmp_path / PRIORLIST_FILE).read_text() == "MatMul\nReluGrad\n"
    with pytest.raises(ValueError, match="bf16 or fp32 only, not fp16"):
        env_lists({"MatMul": "fp16"})
    # a batch norm at bf16 stays on TF's infer list (on the allow list TF aborts), not denied
    norm = env_lists({"Conv2D": "bf16", "FusedBatchNormV3": "bf16"})
    assert p + "ALLOWLIST_ADD" not in norm and norm[p + "INFERLIST_REMOVE"] == "Conv2D"
    assert norm[p + "DENYLIST_REMOVE"] == "Conv2D,FusedBatchNormV3"


BATCH_NORM_UNDER_THE_REWRITE = """
import tensorflow as tf
from qsync_callback.integrations.horovod_tf.mixed_precision import env_lists, rewrite_on
rewrite_on(env_lists({"Conv2D": "bf16", "FusedBatchNormV3": "bf16", "FusedBatchNormGradV3": "bf16"}))
layers = tf.keras.layers
model = tf.keras.Sequential([
    layers.Conv2D(8, 3, use_bias=False), layers.BatchNormalization(), layers.ReLU(), layers.Flatten(),
    layers.Dense(2),
])
optimizer = tf.keras.optimizers.SGD(0.01)

@tf.function
def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x, training=True) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

print("loss", float(step(tf.random.normal((4, 8, 8, 3)))))
"""


@pytest.mark.skipif(not cpu_runs_bf16(), reason=NO_BF16_CPU)
def test_a_plan_with_a_batch_norm_at_bf16_trains_instead_of_aborting_tf(tmp_path):
    """TF 2.15 aborts the process (mkl_layout_pass.cc, SIGABRT) on a training BatchNormalization
    whose FusedBatchNormV3 is on the bf16 allow list; a plan's lists leave it on the infer list."""
    script = tmp_path / "bn.py"
    script.write_text(BATCH_NORM_UNDER_THE_REWRITE)
    assert "loss" in run_python([str(script)]).stdout


def bf16_op_counts(fn: Callable, args: Sequence, kwargs: Mapping) -> dict[str, int]:
    """Ops of the step's graph, after TF's graph optimizations with the oneDNN bfloat16 rewrite on,
    that compute in bfloat16, by op type; empty where the rewrite does nothing (a CPU without
    bfloat16 support). Runs TF's graph optimizer (Grappler) on the traced graph: internal API."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.grappler import tf_optimizer
    from tensorflow.python.training import saver

    concrete = fn.get_concrete_function(*args, **kwargs)
    graph = concrete.graph
    meta = saver.export_meta_graph(graph_def=graph.as_graph_def(), graph=graph)
    meta.collection_def["train_op"].node_list.value.extend(t.name for t in concrete.outputs)
    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.auto_mixed_precision_onednn_bfloat16 = (
        rewriter_config_pb2.RewriterConfig.ON
    )
    optimized = tf_optimizer.OptimizeGraph(config, meta)
    nodes = [*optimized.node, *(n for f in optimized.library.function for n in f.node_def)]
    counts: dict[str, int] = {}
    for node in nodes:
        if any(node.attr[k].type == tf.bfloat16.as_datatype_enum for k in ("T", "DstT") if k in node.attr):
            counts[node.op] = counts.get(node.op, 0) + 1
    return counts


def _relu_mlp_step():
    model, _, step = mlp_and_step(32, 16, momentum=0.0)
    args = (tf.random.normal((8, 16)), tf.zeros((8,), tf.int32))
    step(*args)
    return model, step, args


def test_the_env_lists_steer_tfs_rewrite_and_are_put_back(tmp_path, monkeypatch):
    """TF's own rewrite (Grappler, as the step's next trace would run it) follows the env: ReluGrad
    kept at fp32, MatMul at bf16; afterwards the env and the option are as they were, a variable the
    user had set included."""
    if not cpu_runs_bf16():
        pytest.skip(NO_BF16_CPU)
    _, step, args = _relu_mlp_step()
    default = bf16_op_counts(step, args, {})
    assert default.get("ReluGrad", 0) > 0 and default.get("MatMul", 0) > 0
    monkeypatch.setenv(ENV_PREFIX + "CLEARLIST_REMOVE", "Snapshot")  # the user's own setting
    before = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    option_before = tf.config.optimizer.get_experimental_options().get(AMP_OPTION, False)
    undo = rewrite_on(env_lists({"MatMul": "bf16", "ReluGrad": "fp32"}, tmp_path / PRIORLIST_FILE))
    planned = bf16_op_counts(step, args, {})
    assert planned.get("MatMul") == default["MatMul"] and "ReluGrad" not in planned
    assert tf.config.optimizer.get_experimental_options()[AMP_OPTION] is True
    undo()
    assert {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)} == before
    assert tf.config.optimizer.get_experimental_options().get(AMP_OPTION, False) == option_before
    assert bf16_op_counts(step, args, {}) == default


def _amp_state() -> tuple[dict, bool]:
    """TF's AMP env variables and whether its bf16 rewrite option is on."""
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    return env, bool(tf.config.optimizer.get_experimental_options().get(AMP_OPTION, False))


@pytest.fixture
def amp_state():
    """TF's AMP env variables and rewrite option as before the test, put back after it (a plan the
    recorder applied stays in force)."""
    env, option = _amp_state()
    yield env, option
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        del os.environ[key]
    os.environ.update(env)
    tf.config.optimizer.set_experimental_options({AMP_OPTION: option})


def _qsync_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "qsync Recorder" in str(w.message)]


@pytest.fixture
def first_call(tmp_path, amp_state):
    """A Keras MLP's step (traced once) and a function that runs its first call through a new
    recorder, from the same weights: ``first_call(**recorder_options) -> (recorder, loss, warnings)``;
    also the run's fingerprint and its fp32 loss. Skips on a CPU without bfloat16."""
    if not cpu_runs_bf16():
        pytest.skip(NO_BF16_CPU)
    hvd.init()
    model, step, args = _relu_mlp_step()
    assert bf16_op_counts(step, args, {}), "TF's bf16 rewrite changed nothing on a CPU that runs it"
    fingerprint = tf_fingerprint(keras_layers(model), batch_shapes_of((args, {})), 8, 1)
    weights = model.get_weights()
    fp32 = float(step(*args))

    def call(**options) -> tuple[Recorder, float, list[str]]:
        model.set_weights(weights)
        recorder = Recorder(model, batch_size=8, warmup_steps=2, profile_steps=1, measure_steps=0, **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = float(profile(recorder)(step)(*args))
        return recorder, loss, _qsync_warnings(caught)

    return call, fingerprint, fp32, job_name(model, step.python_function)


def test_a_kept_plan_is_applied_at_the_first_call_and_one_for_another_run_refused(
    tmp_path, first_call, amp_state, capsys
):
    """Mode "apply" with a plan kept in the plan cache: at the first call the plan's op types run at
    bf16 (TF's env lists, the step re-traced) and nothing is recorded. A plan for another run (2
    processes) is refused with nothing applied: given, the recorder steps aside with one warning;
    kept, mode "apply" says why and plans afresh."""
    call, fingerprint, fp32, job = first_call
    constraints = Constraints.from_arguments().to_dict()
    decisions = {"MatMul": "bf16", "ReluGrad": "fp32"}
    plan = Plan(fingerprint=fingerprint, op_precision=decisions, constraints=constraints)
    foreign = Plan.from_dict({**plan.to_dict(), "fingerprint": {**fingerprint, "world_size": 2}})
    foreign.save(tmp_path / "foreign.json")
    recorder, loss, warned = call(output_dir=tmp_path / "given", plan=tmp_path / "foreign.json")
    assert len(warned) == 1 and "made for another run (world_size: plan made for 2, run has 1)" in warned[0]
    assert recorder.finished and recorder.plan is None and loss == fp32
    assert _amp_state() == amp_state  # nothing applied
    store_plan(foreign, job, tmp_path / "stale")
    capsys.readouterr()
    recorder, loss, warned = call(output_dir=tmp_path / "q1", mode="apply", plan_cache=tmp_path / "stale")
    assert warned == [] and not recorder.finished and loss == fp32
    assert "not applying the kept plan" in capsys.readouterr().out and _amp_state() == amp_state
    store_plan(plan, job, tmp_path / "kept")
    recorder, loss, warned = call(output_dir=tmp_path / "q2", mode="apply", plan_cache=tmp_path / "kept")
    assert warned == [] and recorder.finished and recorder.plan.op_precision == plan.op_precision
    assert "applied the plan from the plan cache at step 0" in capsys.readouterr().out
    assert loss != fp32 and math.isclose(loss, fp32, rel_tol=1e-2)  # the MatMuls computed in bf16
    env, option = _amp_state()
    assert option and env[ENV_PREFIX + "DENYLIST_ADD"] == "ReluGrad"
    assert (tmp_path / "q2" / PRIORLIST_FILE).read_text() == "MatMul\n"
    assert not (tmp_path / "q2" / "trace").exists()  # nothing recorded


def test_a_plan_with_an_op_type_tf_does_not_know_is_refused_with_nothing_applied(
    tmp_path, first_call, amp_state, capsys
):
    """Given, the recorder steps aside with one warning naming the op type; kept in the plan cache,
    it is dropped and the run plans afresh. Either way TF's option, its env lists and the step are
    as they were, and no priorlist is written."""
    call, fingerprint, fp32, job = first_call
    constraints = Constraints.from_arguments().to_dict()
    decisions = {"MatMul": "bf16", "NoSuchOp": "bf16"}
    plan = Plan(fingerprint=fingerprint, op_precision=decisions, constraints=constraints)
    plan.save(tmp_path / "unknown.json")
    recorder, loss, warned = call(output_dir=tmp_path / "given", plan=tmp_path / "unknown.json")
    assert len(warned) == 1 and "cannot be applied: op_precision" in warned[0] and "'NoSuchOp'" in warned[0]
    assert recorder.finished and recorder.plan is None and loss == fp32
    assert _amp_state() == amp_state and not (tmp_path / "given").exists()
    path = store_plan(plan, job, tmp_path / "cache")
    capsys.readouterr()
    recorder, loss, warned = call(output_dir=tmp_path / "kept", mode="apply", plan_cache=tmp_path / "cache")
    assert warned == [] and not recorder.finished and loss == fp32
    out = capsys.readouterr().out
    assert "the kept plan cannot be applied here (op_precision:" in out and "dropped, planning afresh" in out
    assert not path.exists()
    assert path == plan_cache_path(job, constraints, plan.fingerprint["device"], tmp_path / "cache")
    assert _amp_state() == amp_state and not (tmp_path / "kept" / PRIORLIST_FILE).exists()


def test_the_examples_planning_window_measures_tfs_bf16_rewrite_per_op_type(tmp_path):
    """One process of the example's MLP in mode "apply": the planning window measures TF's uniform
    bf16 rewrite per op type into the trace; the planner's candidates are priced from it, and the
    chosen plan's prediction is the predictor's figure for it on that trace."""
    if not cpu_runs_bf16():
        pytest.skip(NO_BF16_CPU)
    out = tmp_path / "qsync"
    args = [str(EXAMPLE), "--mode", "apply", "--output-dir", str(out)]
    args += ["--warmup-steps", "2", "--profile-steps", "2", "--measure-steps", "2", "--verify-steps", "2"]
    run = run_python([*args, *SHORT_TURNS], env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    (trace,) = load_trace_dir(out / "trace")
    table = trace.precision_costs["op_types"]
    assert table.get("costs"), f"the probe measured nothing at bf16 on a CPU that runs it: {table}"
    assert table["costs"]["MatMul"]["ops"] > 0 and table["costs"]["MatMul"]["bf16_us"] > 0
    assert set(table["casts"]) == {"fp32->bf16", "bf16->fp32"} and table["low_ops"]
    assert "bf16 uniform (" in run.stdout and "predicted" in run.stdout
    assert "reconstruction: TF's uniform bf16 rewrite, which the bf16 probe profiled" in run.stdout
    # the probe's calls are none of the timed ones: 4, 6 and 7 (recorded 3 and 5), not 8 on
    assert len(trace.measured["step_ms"]) == 3
    assert (out / "trace" / "rank0" / "profile" / "bf16_probe").is_dir()  # a TensorBoard run of its own
    predictor = Predictor([trace])
    # the probe's reading calls: rounds of the recorded step and the rewrite in turns, every call
    # after a block's first timed
    for config in ("baseline", "plan"):
        assert [len(block) for block in table["turns"][config]] == [READING_BLOCK_CALLS] * READING_ROUNDS
    # the allocator's readings in the probe's profiled steps and in the rewrite's timed reading
    # calls: the uniform plan's peak is calibrated on the largest
    readings = [table["recorded_peak_bytes"], *table["step_peak_bytes"]]
    assert len(readings) == 1 + READING_ROUNDS * READING_BLOCK_CALLS
    assert min(readings) > trace.allocator["in_use_bytes"]
    uniform = Plan(
        fingerprint=trace.fingerprint, op_precision=dict.fromkeys(measured_op_types(predictor), "bf16")
    )
    assert predictor.predict(uniform).peak_bytes == max(readings)
    # the uniform plan's step: the change its turns measured, on the recorded configuration's
    # predicted step, or the replay where the two are within their bands of each other
    measured = rewrite_change([trace])
    in_turns = predictor.predict().step_ms * (1 + measured["change_pct"] / 100)
    without_turns = copy.deepcopy(trace)
    del without_turns.precision_costs["op_types"]["turns"]
    replayed = Predictor([without_turns]).predict(uniform).step_ms
    assert predictor.predict(uniform).step_ms in (pytest.approx(in_turns), pytest.approx(replayed))
    verification = out / "verification.json"
    if verification.exists():  # a plan was predicted faster: it was applied and verified
        candidate = Plan.from_dict(json.loads(verification.read_text())["plan"])
        assert predictor.predict(candidate).step_ms == pytest.approx(candidate.prediction["step_ms"])
        low = sorted(t for t, p in candidate.op_precision.items() if p == "bf16")
        assert (out / PRIORLIST_FILE).read_text().split() == low
    else:
        assert Plan.load(out / "plan.json").is_empty
        assert "the recorded configuration is the plan; nothing to apply" in run.stdout


def test_what_an_op_makes_is_told_from_its_scratch_by_when_its_allocations_are_freed():
    """Over two steps: conv (0-10 us) is given 1 MiB (freed at 5) and 2 MiB (freed at 8) of scratch,
    3 MiB alive at once, and makes 4 MiB freed after it; relu (10-20) makes 1 MiB never freed in the
    steps. An address given again after its free is paired with its new allocation."""
    ops = [op(0, "conv", "forward", "main", 0.0, 10.0), op(1, "relu", "forward", "main", 10.0, 10.0)]
    MiB = 1 << 20
    events = [
        [1.0, 0xA, MiB, 0],
        [2.0, 0xB, 2 * MiB, 0],
        [3.0, 0xC, 4 * MiB, 0],
        [5.0, 0xA, -MiB, 0],
        [8.0, 0xB, -2 * MiB, 0],
        [9.0, 0xA, MiB, 0],  # 0xA again: scratch of 1 MiB, alive beside nothing else of conv's
        [9.5, 0xA, -MiB, 0],
        [12.0, 0xD, MiB, 1],
        [15.0, 0xC, -4 * MiB, 1],
    ]
    made, scratch = allocated_per_step(ops, events, steps=2)
    assert made == {"conv": 2 * MiB, "relu": MiB // 2}  # per step, over the two
    assert scratch == {"conv": 3 * MiB}
