"""The tuning loop (`qsync_callback.tuning_loop`) in real Lightning training: what a plan is chosen
under, what survives a rollback or a failure, what a step is, and argument checks."""

import json
import logging
import math
import statistics
import time
import warnings

import pytest
import pytorch_lightning as pl
from test_precision_apply import GeluNet, _apply_callback, _fit, _loader, _lp_precisions

from qsync_callback import QSyncCallback, host_cpu
from qsync_callback.alternation import MOST_BLOCK_STEPS, ROUNDS, Alternation
from qsync_callback.cache import cached_plan, plan_cache_path, store_plan
from qsync_callback.host_cpu import cpu_name, precision_flags
from qsync_callback.plan import Constraints, Plan
from qsync_callback.recorder.torch_recorder import batch_shapes_of, torch_fingerprint
from qsync_callback.recorder.trace import load_trace_dir
from qsync_callback.report import (
    NOISY_REPORT_FILE,
    RECORD_AGAIN_MIN_STEPS,
    RECORD_AGAIN_NOISE_PCT,
    REPORT_FILE,
    too_noisy_to_plan,
)
from qsync_callback.tuning_loop import apply_plan

from apply_script import run_two_ranks

JOB = f"{GeluNet.__module__}.GeluNet"


def _fingerprint(batch_size=512):
    return torch_fingerprint(GeluNet(), batch_shapes_of(next(iter(_loader(batch_size)))), 1, "cpu")


# ----------------------------------------------------------------- what a kept plan was chosen under


def test_a_kept_plan_is_found_only_under_the_constraints_it_was_chosen_under(tmp_path):
    fp32_only = Constraints.from_arguments(precisions=("fp32",)).to_dict()
    budget = Constraints.from_arguments(memory_budget="90%").to_dict()
    fingerprint = _fingerprint()
    store_plan(Plan(fingerprint=fingerprint, constraints=fp32_only), JOB, tmp_path)
    assert cached_plan(JOB, fingerprint, budget, tmp_path) == (None, None)
    found, why = cached_plan(JOB, fingerprint, fp32_only, tmp_path)
    assert found is not None and found.is_empty and why is None


def test_a_plan_kept_under_fp32_only_is_not_applied_under_a_memory_budget(tmp_path, caplog):
    _fit(_apply_callback(tmp_path, precisions=("fp32",), memory_budget=None), max_steps=20)
    assert Plan.load(tmp_path / "q" / "plan.json").is_empty  # nothing but fp32 was allowed
    with caplog.at_level(logging.INFO):
        model = _fit(_apply_callback(tmp_path, out="q2"))
    assert "no kept plan for this job under these constraints" in caplog.text
    assert (tmp_path / "q2" / "trace").exists()  # it recorded and planned
    kept = Plan.load(tmp_path / "q2" / "plan.json")
    assert kept.precision and _lp_precisions(model) == kept.precision
    assert kept.constraints["memory_budget_share"] == pytest.approx(0.9)


def test_a_cached_plan_that_cannot_be_applied_is_dropped_and_the_run_plans_afresh(tmp_path, caplog):
    constraints = Constraints.from_arguments(
        memory_budget="90%", max_step_time=60.0, precisions=("fp32", "bf16", "int8")
    ).to_dict()
    # net.1 is a GELU: it parses and names a layer of the model, but has no LP version
    path = store_plan(
        Plan(fingerprint=_fingerprint(), precision={"net.1": "bf16"}, constraints=constraints),
        JOB,
        tmp_path / "cache",
    )
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _fit(_apply_callback(tmp_path))
    assert not [w for w in caught if "steps aside" in str(w.message)]
    assert "the kept plan cannot be applied here" in caplog.text and "dropped" in caplog.text
    kept = Plan.load(path)  # replaced by the plan this run chose and verified
    assert "net.1" not in kept.precision and _lp_precisions(model) == kept.precision


def test_two_ranks_drop_a_cached_plan_that_cannot_be_applied_together(tmp_path):
    """DDP over gloo: only rank 0 reads the cache; both ranks learn the plan came from it, fail to
    apply it alike, and plan afresh together (a rank that stepped aside alone would hang the other)."""
    constraints = Constraints.from_arguments(
        memory_budget="90%", max_step_time=60.0, precisions=("fp32", "bf16", "int8")
    ).to_dict()
    fingerprint = {**_fingerprint(), "world_size": 2}
    path = store_plan(
        Plan(fingerprint=fingerprint, precision={"net.1": "bf16"}, constraints=constraints),
        JOB,
        tmp_path / "cache",
    )
    result = run_two_ranks(tmp_path, tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the kept plan cannot be applied here" in result.stdout + result.stderr
    assert "steps aside" not in result.stdout + result.stderr
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert per_rank[0]["steps"] == per_rank[1]["steps"] == 30
    assert per_rank[0]["precisions"] == per_rank[1]["precisions"]
    assert "net.1" not in Plan.load(path).precision  # replaced by the plan this run kept


def test_a_stale_kept_plan_says_what_changed(tmp_path, caplog):
    constraints = Constraints.from_arguments(
        memory_budget="90%", max_step_time=60.0, precisions=("fp32", "bf16", "int8")
    ).to_dict()
    other_model = {**_fingerprint(), "model": "0123456789abcdef"}
    store_plan(
        Plan(fingerprint=other_model, precision={"net.2": "bf16"}, constraints=constraints),
        JOB,
        tmp_path / "cache",
    )
    with caplog.at_level(logging.INFO):
        _fit(_apply_callback(tmp_path), max_steps=12)
    assert "not applying the kept plan" in caplog.text and "model: plan made for" in caplog.text


def _fingerprint_on_another_cpu(tmp_path, monkeypatch):
    """This run's fingerprint as a machine of this CPU model name would make it, with AVX512-BF16
    where this one has none, or without it where this one has it."""
    other_flags = "avx2 fma avx512f avx512_bf16" if "avx512_bf16" not in precision_flags() else "avx2 fma"
    other_cpu = tmp_path / "cpuinfo"
    other_cpu.write_text(f"processor\t: 0\nmodel name\t: {cpu_name()}\nflags\t\t: {other_flags}\n")
    monkeypatch.setattr(host_cpu, "CPUINFO", other_cpu)
    other = _fingerprint()
    monkeypatch.undo()
    return other


def test_a_plan_kept_on_a_cpu_of_another_kind_is_neither_applied_nor_replaced(tmp_path, caplog, monkeypatch):
    """A cache shared by two machines of one CPU model name (a home on NFS), one with AVX512-BF16 and
    one without: the plan the first kept (a bf16 layer) is not applied on the second, and the plan
    the second keeps is filed beside it, not over it."""
    constraints = Constraints.from_arguments(
        memory_budget="90%", max_step_time=60.0, precisions=("fp32", "bf16", "int8")
    ).to_dict()
    here, other = _fingerprint(), _fingerprint_on_another_cpu(tmp_path, monkeypatch)
    assert other["device"] != here["device"] and {**other, "device": here["device"]} == here
    other_path = store_plan(
        Plan(fingerprint=other, precision={"net.2": "bf16"}, constraints=constraints), JOB, tmp_path / "cache"
    )
    other_json = other_path.read_text()
    with caplog.at_level(logging.INFO):
        _fit(_apply_callback(tmp_path))
    assert "no kept plan for this job under these constraints" in caplog.text
    here_path = plan_cache_path(JOB, constraints, here["device"], tmp_path / "cache")
    assert here_path != other_path and Plan.load(here_path).fingerprint["device"] == here["device"]
    assert other_path.read_text() == other_json


# ----------------------------------------------------------------- only a kept plan is state


class StateWatcher(pl.Callback):
    """Records QSyncCallback's state_dict at every step, as a checkpoint taken there would."""

    def __init__(self, qsync):
        self.qsync = qsync
        self.states = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.states.append((self.qsync._loop.verifying, self.qsync.state_dict()))


class FailingGeluNet(GeluNet):
    def __init__(self, fail_at_step):
        super().__init__()
        self.fail_at_step = fail_at_step

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at_step:
            raise RuntimeError("the user's model failed")
        return super().training_step(batch, batch_idx)


def test_a_checkpoint_during_verification_holds_no_candidate_plan(tmp_path):
    qsync = _apply_callback(tmp_path, plan_cache=False)
    watcher = StateWatcher(qsync)
    # the windows end by step 30, then the turns' first look: 3 rounds of blocks as long as they may be
    first_look = Alternation(ROUNDS, block_steps=MOST_BLOCK_STEPS).first_look_step
    _fit([qsync, watcher], max_steps=30 + first_look + 5)
    verifying = [state for during, state in watcher.states if during]
    assert verifying, "the run never verified a plan"
    assert all(state["plan"] is None and not state["finished"] for state in verifying)
    assert qsync.plan is not None and watcher.states[-1][1]["plan"]["precision"] == qsync.plan.precision


def test_a_failure_during_verification_restores_the_recorded_configuration(tmp_path):
    qsync = _apply_callback(tmp_path, plan_cache=False)
    watcher = StateWatcher(qsync)
    # the window: 3 warm-up + 2 recorded (every other step) + 3 measured steps; verification from ~13
    model = FailingGeluNet(fail_at_step=18)
    with pytest.raises(RuntimeError, match="the user's model failed"):
        _fit([qsync, watcher], model=model, max_steps=30)
    assert any(during for during, _ in watcher.states), "the failure did not land in verification"
    assert _lp_precisions(model) == {}
    assert qsync.plan is None and qsync.state_dict()["plan"] is None


class InfiniteUnderLowPrecision(GeluNet):
    """Its loss stops being finite as soon as any layer runs below fp32."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        low = any(precision != "fp32" for precision in _lp_precisions(self).values())
        return loss * float("inf") if low else loss


def test_a_plan_whose_loss_stops_being_finite_is_rolled_back_on_every_count(tmp_path):
    qsync = _apply_callback(tmp_path, plan_cache=tmp_path / "cache")
    model = InfiniteUnderLowPrecision()
    _fit(qsync, model=model, max_steps=30)
    verification = json.loads((tmp_path / "q" / "verification.json").read_text())
    assert verification["plan"]["precision"], "the 90% budget needs a layer below fp32"
    assert verification["decision"] == "roll back"
    assert verification["reason"] == "the loss stopped being finite"
    assert _lp_precisions(model) == {} and qsync.plan is None and qsync.state_dict()["plan"] is None
    assert Plan.load(tmp_path / "q" / "plan.json").is_empty  # the recorded configuration is kept


# ----------------------------------------------------------------- a recording too noisy to plan on


class BusyMachine(pl.Callback):
    """Another load on the machine while the loop records its baseline: each step waits 4 to 64 ms
    more, by its number (4 * 2 ** (step % 5)), so the measured steps spread far over their median."""

    def __init__(self, qsync):
        self.qsync = qsync

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.qsync._loop._phase == "baseline":
            time.sleep(0.004 * 2 ** (trainer.global_step % 5))


def test_a_recording_too_noisy_to_plan_on_is_recorded_again_once_then_planned_on(tmp_path, caplog):
    qsync = _apply_callback(tmp_path, measure_steps=RECORD_AGAIN_MIN_STEPS, alternate_rounds=0)
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit([qsync, BusyMachine(qsync)], max_steps=60)
    assert not [w for w in caught if "steps aside" in str(w.message)]
    assert caplog.text.count("recording the window again before planning (once)") == 1
    out = tmp_path / "q"
    noisy = json.loads((out / NOISY_REPORT_FILE).read_text())
    again = json.loads((out / REPORT_FILE).read_text())
    for report in (noisy, again):  # busy through both windows: the second is planned on all the same
        assert report["measured"]["step_ms_noise_pct"] > RECORD_AGAIN_NOISE_PCT
        assert report["measured"]["step_ms_samples"] >= RECORD_AGAIN_MIN_STEPS
    assert again["recorded_again"] == too_noisy_to_plan(noisy)
    # the trace kept is the second window's, which the plan was made on
    (trace,) = load_trace_dir(out / "trace")
    assert statistics.median(trace.measured["step_ms"]) == again["measured"]["step_ms"]
    assert again["measured"]["step_ms"] != noisy["measured"]["step_ms"]
    verification = json.loads((out / "verification.json").read_text())
    assert verification["decision"] in ("keep", "roll back")


def test_training_that_ends_while_the_window_is_recorded_again_says_so(tmp_path):
    qsync = _apply_callback(tmp_path, measure_steps=RECORD_AGAIN_MIN_STEPS)
    with pytest.warns(RuntimeWarning, match="training ended while the window was recorded again"):
        _fit([qsync, BusyMachine(qsync)], max_steps=22)
    assert (tmp_path / "q" / NOISY_REPORT_FILE).exists() and qsync.plan is None


# ----------------------------------------------------------------- a step is an optimizer step


def test_with_gradient_accumulation_a_recorded_step_holds_all_its_micro_batches(tmp_path):
    out = tmp_path / "q"
    callback = QSyncCallback(warmup_steps=3, profile_steps=2, measure_steps=2, output_dir=out)
    _fit(callback, max_steps=12, batch_size=256, accumulate_grad_batches=2)
    trace = load_trace_dir(out / "trace")[0]
    report = json.loads((out / "report.json").read_text())
    assert len(trace.steps) == 2
    for step in trace.steps:
        ops = [op for op in trace.ops if op.step == step.index]
        assert any(op.kind == "update" for op in ops), f"step {step.index} has no optimizer step"
        forwards = [op for op in ops if op.kind == "forward" and op.layer == "net.0"]
        assert len(forwards) >= 2, f"step {step.index} holds one micro-batch"
    # the gradients of the first micro-batch are alive through the second one's backward
    assert report["predicted"]["memory_breakdown"]["gradients"] > 0


# ----------------------------------------------------------------- appliers: all or none


def test_a_plan_with_decisions_no_applier_carries_out_is_refused_before_anything_changes():
    applied = []

    def precision(plan):
        applied.append(plan)
        return lambda: applied.remove(plan)

    plan = Plan(precision={"net.0": "bf16"}, activation={"net.0": "recompute"})
    with pytest.raises(Exception, match="activation") as error:
        apply_plan(plan, {"precision": precision})
    assert "nothing was applied" in str(error.value) and applied == []
    undo = apply_plan(Plan(precision={"net.0": "bf16"}), {"precision": precision})
    assert len(applied) == 1
    undo()
    assert applied == []


def test_a_given_plan_with_a_decision_the_run_cannot_carry_out_warns_once_and_applies_nothing(tmp_path):
    plan_file = tmp_path / "mixed.json"
    # Horovod's communication settings: no applier of a torch run carries them out
    Plan(precision={"net.2": "bf16"}, communication={"fusion_threshold_bytes": 0}).save(plan_file)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _fit(QSyncCallback(mode="apply", plan=plan_file, plan_cache=False), max_steps=5)
    ours = [str(w.message) for w in caught if "QSyncCallback steps aside" in str(w.message)]
    assert len(ours) == 1 and "communication" in ours[0] and "nothing was applied" in ours[0]
    assert _lp_precisions(model) == {} and len(model.losses) == 5


def test_an_alias_of_a_module_registered_twice_names_the_same_layer(tmp_path):
    model = GeluNet()
    model.head = model.net[14]  # the last Linear, registered twice
    plan_file = tmp_path / "alias.json"
    Plan(precision={"head": "bf16"}).save(plan_file)
    _fit(QSyncCallback(mode="apply", plan=plan_file, plan_cache=False), model=model, max_steps=3)
    assert _lp_precisions(model) == {"net.14": "bf16"} and model.head is model.net[14]


# ----------------------------------------------------------------- resumed runs


def test_a_resumed_run_in_report_mode_reapplies_the_checkpoint_plan_and_says_so(tmp_path, caplog):
    state = {
        "finished": True,
        "output_dir": str(tmp_path / "q"),
        "plan": Plan(precision={"net.2": "bf16"}).to_dict(),
    }
    callback = QSyncCallback(
        mode="report",
        warmup_steps=3,
        profile_steps=2,
        measure_steps=2,
        output_dir=tmp_path / "q",
        plan_cache=False,
    )
    callback.load_state_dict(state)
    with caplog.at_level(logging.INFO):
        model = _fit(callback, max_steps=12)
    assert "re-applying the checkpoint's kept plan" in caplog.text
    assert _lp_precisions(model) == {"net.2": "bf16"}
    assert load_trace_dir(tmp_path / "q" / "trace")[0].precision == {"net.2": "bf16"}


# ----------------------------------------------------------------- arguments, checked at construction


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"warmup_steps": 2.5}, "warmup_steps: must be an integer"),
        ({"profile_steps": True}, "profile_steps: must be an integer"),
        ({"memory_budget": 0.5}, "50%"),
        ({"memory_budget": "inf%"}, "percentage must be a positive finite"),
        ({"memory_budget": math.nan}, "finite number of bytes"),
        ({"memory_budget": math.inf}, "finite number of bytes"),
        ({"memory_budget": "0GB"}, "at least 1"),
        ({"max_step_time": "0.1"}, "max_step_time: must be a number of seconds"),
        ({"max_step_time": math.inf}, "positive, finite"),
        ({"levers": ("precision", "magic")}, "levers: must be some of"),
        ({"precisions": "bf16"}, "precisions: a list of names"),
        ({"mode": "apply-everything"}, "mode: must be one of"),
        ({"alternate_looks": 0}, "alternate_looks: must be an integer of at least 1"),
    ],
)
def test_bad_arguments_are_refused_at_construction(arguments, message):
    with pytest.raises(ValueError, match=message):
        QSyncCallback(**arguments)


def test_a_budget_in_scientific_notation_is_bytes():
    assert QSyncCallback(mode="apply", memory_budget="1e9").constraints.memory_budget == 10**9
    assert QSyncCallback(mode="apply", memory_budget=2e9).constraints.memory_budget == 2 * 10**9
    assert QSyncCallback(mode="apply", memory_budget="85%").constraints.memory_budget_share == pytest.approx(
        0.85
    )
