"""Cost inputs of the precision planner: the linear fit, the cast-cost fit and cache, layer probes."""

from __future__ import annotations

import gc
import json
import math
import weakref

import pytest
import torch
from torch import nn

from qsync_callback import cache
from qsync_callback.lp import LPLinear, costs
from qsync_callback.lp.costs import (
    cache_key,
    cache_path,
    cast_costs,
    cast_pairs,
    fit_cast_costs,
    fit_linear_cost,
    probe_layer_costs,
)

CPU_PAIRS = {
    "fp32->bf16",
    "bf16->fp32",
    "fp32->fp16",
    "fp16->fp32",
    "bf16->fp16",
    "fp16->bf16",
    "fp32->int8",
    "int8->fp32",
}
COST_FIELDS = {"alpha_us_per_element", "beta_us", "r2"}


# --- fit_linear_cost ---------------------------------------------------------------------------


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_a_perfect_line(relative):
    sizes = [1000, 2000, 4000, 8000, 16000]
    fit = fit_linear_cost(sizes, [0.5 * s + 3 for s in sizes], relative=relative)
    assert fit["alpha_us_per_element"] == pytest.approx(0.5, rel=1e-12)
    assert fit["beta_us"] == pytest.approx(3.0, rel=1e-9)
    assert fit["r2"] == 1.0


def test_fit_recovers_a_noisy_line_over_decades():
    sizes = list(costs.CAST_SIZES)
    alpha, beta = 2e-4, 5.0
    noise = [1.02, 0.98, 1.01, 0.99, 1.02, 0.985]  # +-2% multiplicative, as timings are
    fit = fit_linear_cost(sizes, [(alpha * s + beta) * n for s, n in zip(sizes, noise, strict=True)])
    assert fit["alpha_us_per_element"] == pytest.approx(alpha, rel=0.05)
    assert fit["beta_us"] == pytest.approx(beta, rel=0.1)
    assert 0.99 < fit["r2"] < 1.0


def test_fit_never_returns_negative_costs():
    sizes = [1000, 2000, 4000, 8000]
    through_origin = fit_linear_cost(sizes, [0.5 * s - 100 for s in sizes])
    assert through_origin["beta_us"] == 0.0 and through_origin["alpha_us_per_element"] > 0
    flat = fit_linear_cost(sizes, [10.0, 9.0, 8.0, 7.0])
    assert flat["alpha_us_per_element"] == 0.0 and 7.0 < flat["beta_us"] < 10.0
    constant = fit_linear_cost(sizes, [4.0] * 4)
    assert constant == {"alpha_us_per_element": 0.0, "beta_us": 4.0, "r2": 1.0}


def test_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_linear_cost([100, 100], [1.0, 2.0])
    with pytest.raises(ValueError, match="3 sizes but 2 times"):
        fit_linear_cost([1, 2, 3], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        fit_linear_cost([1, 2], [0.0, 2.0])


# --- fit_cast_costs ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_costs():
    return fit_cast_costs("cpu")


def test_real_fit_covers_every_cpu_cast(cpu_costs):
    assert set(cpu_costs) == CPU_PAIRS == set(cast_pairs("cpu"))
    assert cpu_costs["fp32->bf16"]["alpha_us_per_element"] > 0
    for fit in cpu_costs.values():
        assert set(fit) == COST_FIELDS
        assert all(math.isfinite(v) for v in fit.values())
        assert fit["alpha_us_per_element"] >= 0 and fit["beta_us"] >= 0


def test_fit_takes_a_subset_of_precisions_and_refuses_tf32_on_cpu():
    assert cast_pairs("cpu", ["fp32", "bf16"]) == ["fp32->bf16", "bf16->fp32"]
    with pytest.raises(ValueError, match="tf32"):
        cast_pairs("cpu", ["fp32", "tf32"])
    with pytest.raises(ValueError, match="unknown"):
        fit_cast_costs("cpu", ["fp8"])
    assert set(fit_cast_costs("cpu", ["fp32", "int8"])) == {"fp32->int8", "int8->fp32"}


def test_tf32_has_no_casts(monkeypatch):
    monkeypatch.setattr(costs, "supported_precisions", lambda device: ("fp32", "tf32", "bf16"))
    assert cast_pairs("cpu") == cast_pairs("cpu", ["fp32", "tf32", "bf16"]) == ["fp32->bf16", "bf16->fp32"]


# --- the cache ---------------------------------------------------------------------------------


def _fake_fit(device, precisions=None):
    return {pair: {"alpha_us_per_element": 1e-4, "beta_us": 2.0, "r2": 0.99} for pair in cast_pairs(device)}


def _failing_fit(device, precisions=None):
    raise AssertionError("fit_cast_costs must not run: the cache holds the fit")


def test_cache_second_call_reads_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "fit_cast_costs", _fake_fit)
    first = cast_costs("cpu", tmp_path)
    path = cache_path("cpu", tmp_path)
    document = json.loads(open(path, encoding="utf-8").read())
    assert document["format"] == "qsync-cast-costs" and document["key"] == cache_key("cpu")
    monkeypatch.setattr(costs, "fit_cast_costs", _failing_fit)
    assert cast_costs("cpu", tmp_path) == first == _fake_fit("cpu")


@pytest.mark.parametrize(
    "content",
    ["{not json", "", json.dumps({"format": "qsync-cast-costs", "version": 1, "key": {}, "costs": {}})],
)
def test_corrupt_cache_is_refitted_with_a_warning(tmp_path, monkeypatch, content):
    path = cache_path("cpu", tmp_path)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(content)
    monkeypatch.setattr(costs, "fit_cast_costs", _fake_fit)
    with pytest.warns(UserWarning, match="refitting"):
        assert cast_costs("cpu", tmp_path) == _fake_fit("cpu")
    monkeypatch.setattr(costs, "fit_cast_costs", _failing_fit)
    assert cast_costs("cpu", tmp_path) == _fake_fit("cpu")  # overwritten with a valid fit


def test_cache_with_bad_numbers_is_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "fit_cast_costs", _fake_fit)
    cast_costs("cpu", tmp_path)
    path = cache_path("cpu", tmp_path)
    document = json.loads(open(path, encoding="utf-8").read())
    document["costs"]["fp32->bf16"]["beta_us"] = "2"
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle)
    with pytest.warns(UserWarning, match="bad numbers for fp32->bf16"):
        cast_costs("cpu", tmp_path)


def test_cache_key_names_device_software_and_threads(monkeypatch):
    key = cache_key("cpu")
    assert key["device"].startswith("cpu: ") and key["torch"] == torch.__version__
    assert key["threads"] == torch.get_num_threads()
    path = cache_path("cpu", "/somewhere")
    monkeypatch.setattr(torch, "get_num_threads", lambda: key["threads"] + 1)
    assert cache_key("cpu")["threads"] == key["threads"] + 1
    assert cache_path("cpu", "/somewhere") != path


def test_default_cache_dir_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.default_cache_dir() == str(tmp_path / "qsync_callback")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.default_cache_dir() == str(tmp_path / ".cache" / "qsync_callback")
    monkeypatch.setattr(costs, "fit_cast_costs", _fake_fit)
    cast_costs("cpu")  # creates the missing directories
    assert (tmp_path / ".cache" / "qsync_callback").is_dir()


# --- probe_layer_costs -------------------------------------------------------------------------


def test_probe_linear_at_every_precision_leaves_the_module_alone():
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    calls = []
    layer.register_forward_hook(lambda *args: calls.append(1))
    rng = torch.get_rng_state()
    result = probe_layer_costs(layer, (512, 64), repeats=3)
    assert list(result) == ["fp32", "bf16", "fp16", "int8"]
    for entry in result.values():
        assert entry["forward_us"] > 0 and entry["backward_us"] > 0
        assert entry["saved_bytes"] == entry["saved_activation_bytes"] + entry["saved_weight_bytes"]
    assert result["int8"]["saved_bytes"] < result["fp32"]["saved_bytes"]
    activation = {p: result[p]["saved_activation_bytes"] for p in result}
    assert activation == {"fp32": 512 * 64 * 4, "bf16": 512 * 64 * 2, "fp16": 512 * 64 * 2, "int8": 512 * 64}
    assert result["fp32"]["saved_weight_bytes"] == 0  # the fp32 weight is the parameter itself
    assert result["bf16"]["saved_weight_bytes"] == 0  # the backward casts the fp32 weight again
    assert result["int8"]["fp32_fallback"] == 0.0
    for name, p in layer.named_parameters():
        assert torch.equal(p, before[name]) and p.grad is None
    assert not calls  # the real module's hooks did not fire
    assert torch.equal(torch.get_rng_state(), rng)


def test_probe_keeps_existing_gradients_and_takes_an_lp_module():
    layer = nn.Linear(16, 8)
    layer(torch.randn(4, 16)).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    lp = LPLinear.from_module(layer, "bf16")
    result = probe_layer_costs(lp, (4, 16), precisions=["int8", "fp32"], repeats=1)
    assert list(result) == ["fp32", "int8"]
    assert lp.precision == "bf16"
    for name, p in layer.named_parameters():
        assert torch.equal(p.grad, grads[name])


@pytest.mark.parametrize(
    ("layer", "shape"),
    [
        (nn.Conv1d(8, 16, 3), (4, 8, 64)),
        (nn.Conv2d(4, 8, 3), (2, 4, 16, 16)),
        (nn.Conv2d(4, 8, 3), (4, 16, 16)),
    ],
)
def test_probe_convolutions(layer, shape):
    result = probe_layer_costs(layer, shape, repeats=2)
    assert list(result) == ["fp32", "bf16", "fp16"]  # no int8 convolution
    assert all(entry["forward_us"] > 0 and entry["backward_us"] > 0 for entry in result.values())
    numel = math.prod(shape)
    assert result["fp32"]["saved_activation_bytes"] == numel * 4
    assert result["bf16"]["saved_activation_bytes"] == numel * 2
    assert all(p.grad is None for p in layer.parameters())


def test_probe_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="int8"):
        probe_layer_costs(nn.Conv1d(2, 2, 3), (1, 2, 8), precisions=["int8"])
    with pytest.raises(ValueError, match="tf32"):
        probe_layer_costs(nn.Linear(4, 4), (2, 4), precisions=["tf32"])
    with pytest.raises(TypeError, match="Linear, Conv1d or Conv2d"):
        probe_layer_costs(nn.ReLU(), (2, 4))


def test_counting_saved_bytes_keeps_nothing_alive():
    """A ReLU saves its own output: a graph that kept it would be a cycle nobody frees."""
    relu = nn.ReLU()
    outputs = []

    def forward(x):
        out = relu(x)
        outputs.append(weakref.ref(out))
        return out

    x = torch.randn(256, 256, requires_grad=True)
    assert costs._saved_bytes(relu, x, forward) == 256 * 256 * 4
    gc.collect()
    assert outputs and outputs[0]() is None
