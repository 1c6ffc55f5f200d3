"""LP modules on CPU: numerics against the fp32 stock op, parameter sharing, swapping, refusals.

Tolerances are on the relative Frobenius error ||lp - ref|| / ||ref|| of the output and of the
input, weight and bias gradients. Worst cases measured over 200 seeds on the shapes below:
bf16 4.8e-3 (one bf16 rounding is 2^-8 = 3.9e-3), fp16 6.3e-4 (2^-11 = 4.9e-4), int8 1.35e-2
(per-tensor 127-level quantization of input and weight). The bounds leave about 2x margin.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qsync_callback.lp import (
    LPConv1d,
    LPConv2d,
    LPLinear,
    restore,
    set_precision,
    supported_precisions,
    swap_to_lp,
)
from qsync_callback.lp.modules import _Tf32Op

TOLERANCE = {"bf16": 1e-2, "fp16": 1.5e-3, "int8": 3e-2}
CASES = {
    "linear": (lambda: nn.Linear(64, 48), LPLinear, (4, 9, 64)),
    "conv1d": (lambda: nn.Conv1d(8, 16, 3, padding=1), LPConv1d, (4, 8, 32)),
    "conv2d": (lambda: nn.Conv2d(6, 12, 3, padding=1, padding_mode="reflect"), LPConv2d, (2, 6, 12, 12)),
}
CPU_PRECISIONS = ("fp32", "bf16", "fp16", "int8")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _run(module: nn.Module, x: torch.Tensor, grad: torch.Tensor | None = None):
    """Output, and input/weight/bias gradients of one forward + backward."""
    x = x.clone().requires_grad_()
    module.zero_grad()
    out = module(x)
    out.backward(torch.ones_like(out) if grad is None else grad)
    return out.detach(), x.grad, module.weight.grad.clone(), module.bias.grad.clone()


def _pair(kind: str, seed: int = 0):
    make, lp_cls, shape = CASES[kind]
    torch.manual_seed(seed)
    stock = make()
    return stock, lp_cls.from_module(stock), torch.randn(shape)


def test_cpu_supported_precisions():
    assert supported_precisions("cpu") == CPU_PRECISIONS


@pytest.mark.parametrize(
    ("kind", "precision"),
    [(k, p) for k in CASES for p in CPU_PRECISIONS if p != "int8" or k == "linear"],
)
def test_forward_backward_against_fp32(kind, precision):
    for seed in range(3):
        torch.manual_seed(seed)
        make, lp_cls, shape = CASES[kind]
        reference, other = make(), make()
        other.load_state_dict(reference.state_dict())
        lp = lp_cls.from_module(other, precision)
        x = torch.randn(shape)
        grad = torch.randn_like(reference(x))
        expected, got = _run(reference, x, grad), _run(lp, x, grad)
        assert got[0].dtype == torch.float32 and got[0].shape == expected[0].shape
        assert all(g.dtype == torch.float32 for g in got[1:])
        for e, g in zip(expected, got, strict=True):
            if precision == "fp32":
                assert torch.equal(e, g)
            else:
                assert _rel(g, e) < TOLERANCE[precision]


def test_parameters_are_shared_not_copied():
    for kind in CASES:
        stock, lp, _ = _pair(kind)
        assert lp.weight is stock.weight and lp.bias is stock.bias
        back = lp.to_stock()
        assert type(back) is type(stock) and back.weight is stock.weight and back.bias is stock.bias
        assert lp.state_dict().keys() == stock.state_dict().keys()
    no_bias = nn.Linear(4, 3, bias=False)
    assert LPLinear.from_module(no_bias).bias is None


@pytest.mark.parametrize("kind", CASES)
def test_switching_precisions_leaves_parameters_and_fp32_output_identical(kind):
    stock, lp, x = _pair(kind)
    before = [p.detach().clone() for p in stock.parameters()]
    for precision in ("bf16", "int8", "fp16", "fp32", "bf16", "fp32"):
        if precision in lp.allowed_precisions("cpu"):
            lp.precision = precision
            _run(lp, x)
    assert all(torch.equal(p, b) for p, b in zip(stock.parameters(), before, strict=True))
    assert torch.equal(lp(x), stock(x))


def test_precision_is_validated():
    _, lp, _ = _pair("linear")
    with pytest.raises(ValueError, match="fp32, tf32, bf16, fp16, int8"):
        lp.precision = "fp8"
    with pytest.raises(ValueError, match="tf32 needs a CUDA device of compute capability 8.0"):
        lp.precision = "tf32"
    assert lp.precision == "fp32"
    for kind in ("conv1d", "conv2d"):
        stock, conv, _ = _pair(kind)
        with pytest.raises(ValueError, match="no int8 convolution kernel in stock PyTorch on cpu"):
            conv.precision = "int8"
        with pytest.raises(ValueError, match="no int8 convolution kernel"):
            type(conv).from_module(stock, "int8")


def test_from_module_refuses_what_it_cannot_carry_over():
    class Custom(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(TypeError, match="overrides forward"):
        LPLinear.from_module(Custom(4, 3))
    with pytest.raises(TypeError, match="needs a Linear"):
        LPLinear.from_module(nn.Conv1d(2, 2, 1))
    hooked = nn.Linear(4, 3)
    hooked.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="_forward_hooks"):
        LPLinear.from_module(hooked)


def test_tf32_mechanics_match_the_stock_op():
    """On CPU the TF32 flags change nothing, so the tf32 autograd path must give the stock result."""
    for kind in CASES:
        stock, lp, x = _pair(kind)
        grad = torch.randn_like(stock(x))
        xs, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        stock(xs).backward(grad)
        expected = stock.weight.grad.clone(), stock.bias.grad.clone()
        stock.zero_grad()
        out = _Tf32Op.apply(lp._stock_op, xt, lp.weight, lp.bias)
        out.backward(grad)
        assert torch.equal(out, stock(x)) and torch.equal(xt.grad, xs.grad)
        assert torch.equal(stock.weight.grad, expected[0]) and torch.equal(stock.bias.grad, expected[1])


def test_int8_linear_saves_int8_for_backward():
    _, lp, x = _pair("linear")
    lp.precision = "int8"
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x.requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = lp(x)
    out.sum().backward()
    big = [t for t in saved if t.numel() > 1]
    assert big and all(t.dtype == torch.int8 for t in big)
    fp32_bytes = x.nbytes + lp.weight.nbytes
    assert sum(t.nbytes for t in saved) <= 0.26 * fp32_bytes
    assert lp.int8_fallbacks == 0


def test_int8_shapes_on_cpu():
    """CPU's _int_mm takes any non-empty shape (few rows, odd features); empty input runs fp32."""
    torch.manual_seed(0)
    stock = nn.Linear(13, 7)
    lp = LPLinear.from_module(stock, "int8")
    x = torch.randn(3, 13)
    assert _rel(lp(x), stock(x)) < TOLERANCE["int8"] and lp.int8_fallbacks == 0
    empty = torch.randn(0, 13)
    assert torch.equal(lp(empty), stock(empty)) and lp.int8_fallbacks == 1


def test_autocast_does_not_override_the_chosen_precision():
    _, lp, x = _pair("linear")
    lp.precision = "fp16"
    plain = lp(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(lp(x), plain)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv2 = nn.Conv2d(3, 4, 3)
        self.conv1 = nn.Conv1d(4, 4, 3)
        self.attn = nn.MultiheadAttention(34, 2, batch_first=True)
        self.head = nn.Linear(136, 5)

    def forward(self, x):
        h = torch.relu(self.conv2(x)).flatten(2)
        h = torch.relu(self.conv1(h))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.flatten(1))


def test_swap_skips_multihead_attention_out_proj():
    model = _Net()
    with pytest.raises(ValueError, match="MultiheadAttention"):
        swap_to_lp(model, ["head", "attn.out_proj"])
    assert type(model.head) is nn.Linear  # nothing half-swapped
    lp = swap_to_lp(model)
    assert sorted(lp) == ["conv1", "conv2", "head"]
    assert type(model.attn.out_proj) is not LPLinear and model.head is lp["head"]
    with pytest.raises(ValueError, match="not a layer"):
        swap_to_lp(_Net(), ["nope"])


def test_set_precision_is_all_or_nothing():
    model = _Net()
    lp = swap_to_lp(model)
    set_precision(lp, {"head": "int8", "conv1": "bf16"})
    bad_batches = (
        {"conv2": "fp16", "missing": "fp16"},
        {"conv2": "fp16", "head": "fp7"},
        {"conv2": "fp16", "head": "tf32"},
        {"head": "fp16", "conv1": "int8"},
    )
    for bad in bad_batches:
        with pytest.raises(ValueError):
            set_precision(lp, bad)
        assert {n: m.precision for n, m in lp.items()} == {"conv2": "fp32", "conv1": "bf16", "head": "int8"}


def test_restore_puts_stock_modules_back():
    model = _Net()
    params = dict(model.named_parameters())
    lp = swap_to_lp(model)
    restore(model, lp)
    assert type(model.head) is nn.Linear and type(model.conv2) is nn.Conv2d
    assert all(p is params[n] for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="not in the model"):
        restore(model, lp)


def test_module_registered_twice_is_swapped_everywhere():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    lp = swap_to_lp(model)
    assert list(lp) == ["0"] and model[0] is model[2] is lp["0"]


def _losses(swap: bool) -> list[float]:
    torch.manual_seed(0)
    model = _Net()
    if swap:
        swap_to_lp(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_training_at_fp32_after_swap_is_bit_identical():
    assert _losses(swap=True) == _losses(swap=False)


def test_profiler_sees_the_labels():
    _, linear, x = _pair("linear")
    _, conv, xc = _pair("conv2d")
    linear.precision, conv.precision = "int8", "fp16"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        linear(x)
        conv(xc)
    names = {e.key for e in prof.key_averages()}
    labels = {"qsync::linear_int8", "qsync::conv2d_fp16", "qsync::cast_fp32_fp16", "qsync::cast_fp16_fp32"}
    assert labels | {"aten::_int_mm"} <= names
