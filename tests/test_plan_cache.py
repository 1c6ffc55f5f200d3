"""The plan cache (`qsync_callback.cache`): where a kept plan is filed, and why a kept plan is not
taken. Plain fingerprints here; the same cache in real Lightning runs: `test_tuning_loop.py`."""

from pathlib import Path

import pytest

from qsync_callback.cache import (
    PLANS_DIR,
    cached_plan,
    default_cache_dir,
    drop_cached_plan,
    plan_cache_path,
    store_plan,
)
from qsync_callback.plan import Plan

BF16_CPU = "cpu: AMD EPYC (avx2 fma f16c avx512f avx512_bf16 avx512_vnni)"
PLAIN_CPU = "cpu: AMD EPYC (avx2 fma f16c; no AVX-512)"
FINGERPRINT = {"model": "abc123", "batch_shapes": [[32, 8]], "device": PLAIN_CPU, "world_size": 1}
BUDGET = {"memory_budget_share": 0.9}


def _kept(tmp_path, fingerprint=FINGERPRINT, constraints=BUDGET, precision=None, job="train.Net") -> Path:
    plan = Plan(fingerprint=fingerprint, precision=precision or {"fc1": "bf16"}, constraints=constraints)
    return store_plan(plan, job, tmp_path)


def test_the_cache_dir_follows_xdg_for_an_absolute_path_only(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == str(tmp_path / "xdg" / "qsync_callback")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "qsync_callback")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "qsync_callback")


def test_a_plan_is_filed_by_job_device_and_constraints(tmp_path):
    path = plan_cache_path("train.Net", BUDGET, PLAIN_CPU, tmp_path)
    assert (
        path.parent == tmp_path / PLANS_DIR and path.name.startswith("train.Net-") and path.suffix == ".json"
    )
    assert path == plan_cache_path("train.Net", dict(BUDGET), PLAIN_CPU, tmp_path)
    others = {
        plan_cache_path("train.Net", {"memory_budget_share": 0.8}, PLAIN_CPU, tmp_path),
        plan_cache_path("train.Net", BUDGET, BF16_CPU, tmp_path),
        plan_cache_path("other.Net", BUDGET, PLAIN_CPU, tmp_path),
    }
    assert len(others) == 3 and path not in others


def test_a_job_name_becomes_a_safe_short_file_name(tmp_path, monkeypatch):
    name = plan_cache_path("my model/v2:Net", BUDGET, PLAIN_CPU, tmp_path).name
    assert name.startswith("my_model_v2_Net-")
    long = plan_cache_path("x" * 200, BUDGET, PLAIN_CPU, tmp_path).name
    assert long.startswith("x" * 80 + "-")
    assert plan_cache_path("", BUDGET, PLAIN_CPU, tmp_path).name.startswith("job-")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert (
        plan_cache_path("train.Net", BUDGET, PLAIN_CPU).parent
        == tmp_path / "xdg" / "qsync_callback" / PLANS_DIR
    )


def test_plan_cache_keeps_one_plan_per_job_and_constraints_and_says_why_it_does_not_fit(tmp_path):
    path = _kept(tmp_path)
    assert path == plan_cache_path("train.Net", BUDGET, PLAIN_CPU, tmp_path) and path.exists()
    found, why = cached_plan("train.Net", FINGERPRINT, BUDGET, tmp_path)
    assert found.precision == {"fc1": "bf16"} and why is None
    found, why = cached_plan("train.Net", {**FINGERPRINT, "batch_shapes": [[64, 8]]}, BUDGET, tmp_path)
    assert found is None and "batch_shapes" in why
    found, why = cached_plan("train.Net", {**FINGERPRINT, "model": "def456"}, BUDGET, tmp_path)
    assert found is None and "model: plan made for 'abc123'" in why and str(path) in why
    assert cached_plan("other.Net", FINGERPRINT, BUDGET, tmp_path) == (None, None)
    assert cached_plan("train.Net", FINGERPRINT, {"memory_budget_share": 0.8}, tmp_path) == (None, None)
    path.write_text("{not json")
    found, why = cached_plan("train.Net", FINGERPRINT, BUDGET, tmp_path)
    assert found is None and why.startswith("the kept plan cannot be read (") and str(path) in why


def test_machines_of_two_kinds_sharing_a_cache_keep_a_plan_each(tmp_path):
    """A home on NFS, two CPUs of one model name, one with AVX512-BF16: each finds its own plan."""
    bf16_machine = {**FINGERPRINT, "device": BF16_CPU}
    plain = _kept(tmp_path, precision={"fc1": "fp32"})
    fast = _kept(tmp_path, fingerprint=bf16_machine, precision={"fc1": "bf16"})
    assert plain != fast and plain.exists() and fast.exists()
    assert cached_plan("train.Net", FINGERPRINT, BUDGET, tmp_path)[0].precision == {"fc1": "fp32"}
    assert cached_plan("train.Net", bf16_machine, BUDGET, tmp_path)[0].precision == {"fc1": "bf16"}
    drop_cached_plan("train.Net", BUDGET, BF16_CPU, tmp_path)
    assert plain.exists() and not fast.exists()
    drop_cached_plan("train.Net", BUDGET, BF16_CPU, tmp_path)  # nothing left to drop: no error
    assert cached_plan("train.Net", bf16_machine, BUDGET, tmp_path) == (None, None)


@pytest.mark.parametrize(
    ("kept_fingerprint", "kept_constraints", "reason"),
    [
        ({**FINGERPRINT, "device": BF16_CPU}, BUDGET, "device: plan made for"),
        (FINGERPRINT, {"memory_budget_share": 0.5}, "was chosen under other constraints"),
    ],
)
def test_a_plan_copied_into_this_runs_file_is_checked_all_the_same(
    tmp_path, kept_fingerprint, kept_constraints, reason
):
    """A file copied by hand from another machine or another budget is refused, with the file."""
    path = plan_cache_path("train.Net", BUDGET, PLAIN_CPU, tmp_path)
    path.parent.mkdir(parents=True)
    Plan(fingerprint=kept_fingerprint, precision={"fc1": "bf16"}, constraints=kept_constraints).save(path)
    found, why = cached_plan("train.Net", FINGERPRINT, BUDGET, tmp_path)
    assert found is None and reason in why and str(path) in why


def test_a_plan_without_a_device_is_found_by_a_run_without_one_in_a_new_cache_dir(tmp_path):
    """A fingerprint that names no device (a plan written by hand, say) files and finds alike; the
    cache directory is made with its parents."""
    deviceless = {key: value for key, value in FINGERPRINT.items() if key != "device"}
    cache_dir = tmp_path / "not" / "yet" / "made"
    path = _kept(cache_dir, fingerprint=deviceless)
    assert path == plan_cache_path("train.Net", BUDGET, "", cache_dir)
    found, why = cached_plan("train.Net", deviceless, BUDGET, cache_dir)
    assert found is not None and found.precision == {"fc1": "bf16"} and why is None
