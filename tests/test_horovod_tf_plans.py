"""Mode "apply" of the Horovod + TensorFlow Recorder on real training: candidates (XLA, bfloat16
mixed precision uniform and per op type) measured on the live run, kept only if more than 2%
faster, otherwise rolled back; a candidate that fails or stops being finite is rolled back with
training going on; two processes under ``horovodrun --gloo`` end with the same decision."""

import json
import math
import os
import re
import sys
import warnings
from pathlib import Path

import horovod.tensorflow as hvd
import pytest
import tensorflow as tf

from qsync_callback.integrations.horovod_tf import Recorder, profile
from qsync_callback.integrations.horovod_tf.apply import (
    AMP_OPTION,
    CANDIDATE_WARMUP,
    MEASURED,
    NO_REWRITE,
    PREDICTED,
    trial_calls,
)
from qsync_callback.integrations.horovod_tf.mixed_precision import ENV_PREFIX, PROBE_CALLS
from qsync_callback.plan import Plan
from qsync_callback.verify import SLOWER_TOLERANCE

from keras_steps import mlp_and_step
from tf_launch import EXAMPLE, run_horovod, run_python

WINDOW = {"warmup_steps": 2, "profile_steps": 2, "measure_steps": 2, "verify_steps": 3}
LAYERS = ["hidden", "head"]


def _mlp_step(inf_under_bf16: bool = False, py_function: bool = False):
    """A Keras MLP's train step (a ``tf.function``) and its model. ``py_function`` puts an op in it
    that XLA cannot compile; ``inf_under_bf16`` makes it return an infinite loss when traced
    with the bfloat16 rewrite on (the mixed-precision candidate)."""

    def finish(loss: tf.Tensor) -> tf.Tensor:
        if py_function:
            loss = tf.py_function(lambda v: v, [loss], tf.float32)
        if inf_under_bf16 and tf.config.optimizer.get_experimental_options().get(AMP_OPTION):
            loss = loss + math.inf
        return loss

    return mlp_and_step(64, 32, finish=finish)


def _apply(output_dir: Path, **step_options) -> dict:
    """Run a recorder in mode "apply" to its end and 3 calls beyond; return what the tests check, as
    JSON data (see `_run_in_a_child`)."""
    hvd.init()
    model, optimizer, train_step = _mlp_step(**step_options)
    recorder = Recorder(
        model=model, batch_size=16, output_dir=output_dir, mode="apply", optimizer=optimizer, **WINDOW
    )
    step = profile(recorder)(train_step)
    batch = (tf.random.normal((16, 32), seed=1), tf.zeros((16,), tf.int32))
    results, active = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(recorder.total_calls + 3):
            loss = step(*batch)
            results.append([loss.dtype.name, loss.shape.as_list(), float(loss)])
            active.append(recorder.active)
    return {
        "results": results,
        "active": active,
        "warned": [str(w.message) for w in caught if "qsync Recorder" in str(w.message)],
        "failure": recorder.failure,
        "total_calls": recorder.total_calls,
        "verification": recorder.verification,
        "amp_on": bool(tf.config.optimizer.get_experimental_options().get(AMP_OPTION, False)),
        "amp_env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)},
    }


def _run_in_a_child(tmp_path: Path, **step_options) -> dict:
    """`_apply` in a child process: once XLA has compiled in a process, TF's later profiles there
    carry an extra "/host:metadata" plane that the XSpace conversion mistakes for the host plane, so
    the XLA candidate must not run in the process that runs the other tests."""
    run_python([__file__, str(tmp_path), json.dumps(step_options)])
    return json.loads((tmp_path / "child.json").read_text())


def _check_results(results: list) -> None:
    """Every call returned a finite scalar float32 loss, as the original step does."""
    assert all(dtype == "float32" and shape == [] and math.isfinite(v) for dtype, shape, v in results)


def _trial_calls(total: int, name: str) -> range:
    """Indices (among all calls) of the calls of trial ``name``."""
    v = WINDOW["verify_steps"]
    warm = CANDIDATE_WARMUP
    turns = [("baseline", v), ("xla", warm + v), ("amp_bf16", PROBE_CALLS + v), ("amp_op_types", warm + v)]
    start = total - trial_calls(v)
    for trial, calls in turns:
        if trial == name:
            return range(start, start + calls)
        start += calls
    raise KeyError(name)


def _amp_ran(amp: dict) -> bool:
    """The bf16 candidate either ran with bfloat16 ops in its optimized graph, or was left out because
    the rewrite changed nothing (a CPU without bfloat16 support); returns whether it ran."""
    if amp["evidence"]:
        assert amp["evidence"].get("MatMul", 0) > 0 and amp["evidence"].get("Cast", 0) > 0
        return True
    assert amp["error"] == NO_REWRITE and amp["excluded"]
    return False


def test_apply_measures_candidates_keeps_only_a_real_gain_and_writes_plan(tmp_path):
    child = _run_in_a_child(tmp_path)
    assert child["failure"] is None
    _check_results(child["results"])
    verification = json.loads((tmp_path / "verification.json").read_text())
    assert verification == child["verification"]
    base = verification["baseline"]
    assert base["step_ms"] > 0 and len(base["samples_ms"]) == WINDOW["verify_steps"]
    by_name = {c["name"]: c for c in verification["candidates"]}
    assert sorted(by_name) == ["amp_bf16", "amp_op_types", "xla"]
    amp_ran = _amp_ran(by_name["amp_bf16"])
    ran = [c for c in by_name.values() if c["error"] is None]
    assert by_name["xla"] in ran and (by_name["amp_bf16"] in ran) == amp_ran
    failed = [name for name, c in by_name.items() if c["error"] is not None]
    assert len(child["warned"]) == len(failed) and all(
        f"candidate {n}" in " ".join(child["warned"]) for n in failed
    )
    for c in ran:
        assert c["error"] is None and c["finite"] and c["source"] == MEASURED
        assert len(c["samples_ms"]) == WINDOW["verify_steps"] and c["step_ms"] > 0
    # the baseline and both bf16 candidates are priced by the predictor (from the measured uniform
    # candidate), XLA is not
    assert by_name["xla"]["prediction"] is None
    for entry in (base, by_name["amp_bf16"], by_name["amp_op_types"]):
        if amp_ran:
            assert entry["prediction"]["source"] == PREDICTED and entry["prediction"]["step_ms"] > 0
        else:
            assert entry["prediction"] is None
    # the decision follows the measured figures: the fastest, if more than 2% faster than the baseline
    best = min(ran, key=lambda c: c["all_ranks_step_ms"])
    keep = best["all_ranks_step_ms"] < base["all_ranks_step_ms"] * (1 - SLOWER_TOLERANCE)
    assert verification["decision"] == ("keep" if keep else "roll back")
    chosen = best["name"] if keep else "baseline"
    assert verification["chosen"] == chosen
    # the switch comes after the last trial call (counted from the first trial call)
    assert verification["switch_call"] == trial_calls(WINDOW["verify_steps"])
    before = child["total_calls"] - 1
    assert child["active"] == ["baseline"] * before + [chosen] * 4
    # the rewrite stays on, and its env lists set, only when kept
    assert child["amp_on"] == (chosen in ("amp_bf16", "amp_op_types"))
    assert bool(child["amp_env"]) == (chosen == "amp_op_types")
    plan = Plan.load(tmp_path / "plan.json")
    if chosen == "xla":
        assert plan.fused_regions == [LAYERS] and not plan.precision
    elif chosen == "amp_bf16":
        assert plan.precision == dict.fromkeys(LAYERS, "bf16") and not plan.fused_regions
    elif chosen == "amp_op_types":
        assert "bf16" in plan.op_precision.values() and not plan.precision
    else:
        assert plan.is_empty
    if keep:
        assert plan.prediction["measured_step_ms"] == best["all_ranks_step_ms"]
        assert plan.prediction["measured_source"] == MEASURED
        assert plan.prediction["step_ms"] == (best["prediction"] or {}).get("step_ms")
    xla = Plan.from_dict(by_name["xla"]["plan"])
    assert xla.fused_regions == [LAYERS] and xla.fingerprint["layers"] == LAYERS
    assert Plan.from_dict(by_name["amp_bf16"]["plan"]).precision == dict.fromkeys(LAYERS, "bf16")


def test_failed_and_non_finite_candidates_roll_back_to_the_original_step(tmp_path):
    """XLA cannot compile the step (a ``tf.py_function``): it warns once and that call runs the
    original; the bf16 candidate returns infinite losses: it is out. The run rolls back."""
    child = _run_in_a_child(tmp_path, inf_under_bf16=True, py_function=True)
    results, warned, total = child["results"], child["warned"], child["total_calls"]
    xla_warned = [w for w in warned if "candidate xla" in w]
    assert len(xla_warned) == 1, warned
    assert re.search(r"candidate xla failed \(InvalidArgumentError: .*XLA_CPU_JIT", xla_warned[0])
    assert child["failure"] is None and not child["amp_on"]  # back to TF's options as they were
    assert child["amp_env"] == {}  # and to the env as it was
    amp_calls = _trial_calls(total, "amp_bf16")
    ops_calls = _trial_calls(total, "amp_op_types")
    by_name = {c["name"]: c for c in child["verification"]["candidates"]}
    if by_name["amp_op_types"]["error"] is None:  # it ran: infinite, as the uniform one
        amp_calls = [*amp_calls, *ops_calls]
    _check_results([r for k, r in enumerate(results) if k not in amp_calls])
    assert all(math.isinf(results[k][2]) for k in amp_calls)  # returned unchanged, as they came
    # the original step runs again after the switch: its losses are finite
    assert child["active"] == ["baseline"] * len(results) and len(results) == total + 3
    verification = child["verification"]
    assert verification["decision"] == "roll back" and verification["chosen"] == "baseline"
    assert by_name["xla"]["error"].startswith("InvalidArgumentError") and by_name["xla"]["step_ms"] is None
    if _amp_ran(by_name["amp_bf16"]):
        assert not by_name["amp_bf16"]["finite"] and by_name["amp_bf16"]["excluded"]
    assert Plan.load(tmp_path / "plan.json").is_empty


def test_bad_verify_steps_and_modes_are_refused():
    with pytest.raises(ValueError, match="mode must be one of record, report, apply, not 'replay'"):
        Recorder(mode="replay")
    with pytest.raises(ValueError, match="need verify_steps >= 1"):
        Recorder(mode="apply", verify_steps=0)
    with pytest.raises(TypeError, match="plan must be a plan file's path, None or False, not True"):
        Recorder(mode="apply", plan=True)


def test_two_processes_under_horovodrun_end_with_the_same_decision(tmp_path):
    out = tmp_path / "qsync"
    example = [
        str(EXAMPLE),
        "--mode",
        "apply",
        "--batch-size",
        "16",
        "--output-dir",
        str(out),
    ]
    example += ["--warmup-steps", "2", "--profile-steps", "2", "--measure-steps", "2", "--verify-steps", "3"]
    run = run_horovod(example)
    verification = json.loads((out / "verification.json").read_text())
    assert verification["world_size"] == 2
    applied = dict(re.findall(r"rank (\d): qsync applied (\w+)", run.stdout))
    assert applied == {"0": verification["chosen"], "1": verification["chosen"]}
    assert "qsync apply: baseline" in run.stdout and "decision:" in run.stdout
    by_name = {c["name"]: c for c in verification["candidates"]}
    # Horovod's all-reduce has no XLA kernel on CPU: the XLA candidate fails on both ranks, and says so
    assert "HorovodAllreduce" in by_name["xla"]["error"] and by_name["xla"]["excluded"]
    if _amp_ran(by_name["amp_bf16"]):
        assert by_name["amp_bf16"]["error"] is None and by_name["amp_bf16"]["all_ranks_step_ms"] > 0
    assert Plan.load(out / "plan.json").fingerprint["world_size"] == 2


if __name__ == "__main__":
    out = Path(sys.argv[1])
    (out / "child.json").write_text(json.dumps(_apply(out, **json.loads(sys.argv[2]))))
