"""Drop-in Linear/Conv1d/Conv2d whose compute precision is an attribute.

An LP module shares its Parameter objects with the stock module it was built from, so DDP, the
optimizer and checkpoints see no change; only the arithmetic of the forward (and its backward)
changes with ``precision``:

- ``fp32``: the stock forward itself (bit-identical to the stock module, whatever the global
  matmul/cuDNN settings are; on CUDA, cuDNN convolutions use TF32 by default).
- ``tf32``: the stock op with ``torch.backends.cuda.matmul.fp32_precision`` and
  ``torch.backends.cudnn.conv.fp32_precision`` set to ``"tf32"`` around the forward op and around
  its backward (restored after; process-wide flags, so not thread-safe). CUDA sm80+ only.
- ``bf16``/``fp16``: input, weight and bias cast to the dtype, the stock op in that dtype, the
  output cast back to the input's dtype; the fp32 Parameters get fp32 gradients. For backward it
  keeps the cast input and the fp32 weight itself (a Parameter, no new memory) and casts the weight
  again in the backward, so no low-precision weight copy is held from forward to backward (for a
  conv with a string padding or a non-zero padding mode, autograd of the stock op keeps it).
  ``output_dtype``, when set, is the dtype the output is cast to instead of the input's: the
  compute dtype itself for a layer that passes its low-precision output on to a neighbour at the
  same precision, fp32 for one that takes such a tensor (`precision_links`, set by
  `swap.apply_precision_plan`); an input already in the compute dtype is not cast again.
- ``int8`` (Linear only): symmetric per-tensor int8 quantization of input and weight, an int8 x int8
  -> int32 ``torch._int_mm``, dequantized output plus the fp32 bias. Backward uses the saved int8
  tensors (a quarter of the fp32 bytes) dequantized, and returns fp32 gradients. Shapes that
  ``_int_mm`` cannot take on the device run the stock fp32 op instead and count in
  ``int8_fallbacks``. There is no int8 convolution: stock PyTorch has no trainable int8 conv
  kernel (``quantized::conv2d`` is inference-only with a requantized output), so the LP convs
  refuse ``int8``.

A precision the module's device cannot run is refused when it is set (``ValueError``) and, if the
module moved since, when the forward runs (``RuntimeError``). Under ``torch.autocast`` the LP ops
other than fp32 run with autocast off, so the chosen precision is the one that runs.

Each LP op other than fp32 is labelled for the profiler (``qsync::linear_int8``,
``qsync::conv2d_fp16``, casts as ``qsync::cast_fp32_fp16`` nested in it, int8 shape fallbacks as
``qsync::linear_fp32_fallback``); the labels are opened only while a profiler runs, so an
unprofiled forward pays nothing for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from qsync_callback.plan import PRECISIONS

CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the precisions computed in a float dtype
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_INT8_MAX = 127
_NOTHING = contextlib.nullcontext()
_supported: dict[torch.device, tuple[str, ...]] = {}


def _normalize(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _runs(probe: Callable[[], object]) -> bool:
    """Whether a tiny op runs here: a missing kernel raises RuntimeError or NotImplementedError."""
    try:
        probe()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _float_ops_run(device: torch.device, dtype: torch.dtype) -> bool:
    x = torch.ones(2, 4, 8, device=device, dtype=dtype)
    return _runs(
        lambda: (
            F.linear(x, torch.ones(8, 8, device=device, dtype=dtype)),
            F.conv1d(x, torch.ones(4, 4, 3, device=device, dtype=dtype)),
            F.conv2d(x[None], torch.ones(4, 2, 3, 3, device=device, dtype=dtype)),
        )
    )


def supported_precisions(device: torch.device | str) -> tuple[str, ...]:
    """The precisions this device really runs, in ``PRECISIONS`` order.

    Measured once per device and cached: bf16/fp16 count when a tiny linear, conv1d and conv2d in
    that dtype run, int8 when ``torch._int_mm`` runs; tf32 needs CUDA compute capability 8.0+.
    """
    device = _normalize(device)
    if device not in _supported:
        found = {"fp32"}
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
            found.add("tf32")
        found.update(name for name, dtype in CAST_DTYPES.items() if _float_ops_run(device, dtype))
        q = torch.ones(17, 16, device=device, dtype=torch.int8)
        if _runs(lambda: torch._int_mm(q, q.t())):
            found.add("int8")
        _supported[device] = tuple(p for p in PRECISIONS if p in found)
    return _supported[device]


def _int_mm_takes(device: torch.device, m: int, k: int, n: int) -> bool:
    """Whether ``_int_mm`` takes an [m, k] x [k, n] product on this device: on CPU any non-empty
    shape (measured); elsewhere the cuBLAS checks in ATen (m > 16, k and n multiples of 8)."""
    if m == 0 or k == 0 or n == 0:
        return False
    return device.type == "cpu" or (m > 16 and k % 8 == 0 and n % 8 == 0)


def _label(name: str) -> contextlib.AbstractContextManager:
    """A profiler range, opened only while a profiler runs (record_function costs microseconds), and
    not inside a compiled region (dynamo cannot trace the profiler's state)."""
    if not torch.compiler.is_compiling() and torch._C._autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return _NOTHING


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _cast_output(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` in ``dtype``, the cast labelled; as it is when it already has that dtype."""
    if out.dtype == dtype:
        return out
    with _label(f"qsync::cast_{_dtype_name(out.dtype)}_{_dtype_name(dtype)}"):
        return out.to(dtype)


@contextlib.contextmanager
def _tf32_math() -> Iterator[None]:
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = matmul.fp32_precision, conv.fp32_precision
    matmul.fp32_precision = conv.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved


class _Tf32Op(torch.autograd.Function):
    """The stock op with TF32 math in its forward and in its backward.

    The forward records the stock op's own graph on detached inputs, the backward differentiates
    that graph under the same flags, so the gradients are the stock op's. Backpropagating through
    it a second time (``retain_graph=True``) is not supported.
    """

    @staticmethod
    def forward(ctx, op: Callable, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        leaves = tuple(
            None if t is None else t.detach().requires_grad_(need)
            for t, need in zip((x, weight, bias), ctx.needs_input_grad[1:], strict=True)
        )
        with torch.enable_grad(), _tf32_math():
            out = op(*leaves)
        ctx.graph = out, leaves
        return out.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        out, leaves = ctx.graph
        del ctx.graph
        wanted = [t is not None and t.requires_grad for t in leaves]
        inputs = [t for t in leaves if t is not None and t.requires_grad]
        with _tf32_math():
            grads = iter(torch.autograd.grad(out, inputs, grad_out))
        return None, *(next(grads) if w else None for w in wanted)


class _CastOp(torch.autograd.Function):
    """The module's stock op on input, weight and bias cast to ``dtype``, the output cast to the
    module's ``output_dtype`` (default: the input's). Saves the cast input and the fp32 weight (see
    the module docstring); the gradients come from the module's ``_low_backward`` in ``dtype``,
    cast to the input's and the Parameters' dtypes."""

    @staticmethod
    def forward(ctx, lp: LPModule, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype):
        src, dst = _dtype_name(weight.dtype), _dtype_name(dtype)
        with _label(f"qsync::cast_{src}_{dst}"):
            x_low, w_low = x.to(dtype), weight.to(dtype)
            b_low = None if bias is None else bias.to(dtype)
        out = lp._stock_op(x_low, w_low, b_low)
        ctx.save_for_backward(x_low, weight)
        ctx.lp, ctx.has_bias, ctx.x_dtype = lp, bias is not None, x.dtype
        return _cast_output(out, lp.output_dtype or x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        x_low, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[1:4]
        grads = ctx.lp._low_backward(
            grad_out.to(x_low.dtype), x_low, weight.to(x_low.dtype), (need_x, need_w, need_b and ctx.has_bias)
        )
        dtypes = (ctx.x_dtype, weight.dtype, weight.dtype)
        return None, *(None if g is None else g.to(d) for g, d in zip(grads, dtypes, strict=True)), None


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-tensor int8: scale = max|t| / 127 (at least the dtype's tiny), q in [-127, 127]."""
    scale = (t.abs().amax() / _INT8_MAX).clamp_min(torch.finfo(t.dtype).tiny)
    return torch.round(t / scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8), scale


class _Int8Linear(torch.autograd.Function):
    """y = deq(q(x) @ q(W)^T) + b with ``torch._int_mm``; saves only the int8 tensors and scales.

    Backward is the straight-through estimate through the quantizers: grad_x = g @ deq(q(W)),
    grad_W = g^T @ deq(q(x)), grad_b = sum of g, all in the weight's dtype (fp32).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qx, scale_x = _quantize(x.to(weight.dtype))
        qw, scale_w = _quantize(weight)
        out = torch._int_mm(qx, qw.t()).to(weight.dtype) * (scale_x * scale_w)
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(qx, qw, scale_x, scale_w)
        ctx.x_dtype = x.dtype
        return out.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        qx, qw, scale_x, scale_w = ctx.saved_tensors
        grad_out = grad_out.to(scale_w.dtype)
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = (grad_out @ (qw.to(grad_out.dtype) * scale_w)).to(ctx.x_dtype) if need_x else None
        grad_w = grad_out.t() @ (qx.to(grad_out.dtype) * scale_x) if need_w else None
        grad_b = grad_out.sum(0) if need_b else None
        return grad_x, grad_w, grad_b


def _rebuild(cls: type[nn.Module], module: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
    """A fresh ``cls`` instance holding ``module``'s configuration and its very Parameter objects."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    fresh = set(vars(new))
    for key, value in vars(module).items():
        if key not in fresh and key not in skip:
            new.__dict__[key] = value
    new.training = module.training
    new._parameters.update(module._parameters)
    new._buffers.update(module._buffers)
    new._non_persistent_buffers_set.update(module._non_persistent_buffers_set)
    return new


class LPModule(nn.Module):
    """Base of the LP modules: the ``precision`` attribute and the precision dispatch of the forward."""

    _stock: type[nn.Module]
    _op: str
    _stock_op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    _int8_forward: Callable[[torch.Tensor], torch.Tensor]  # Linear only: the convs refuse int8
    _precision = "fp32"
    output_dtype: torch.dtype | None = None  # bf16/fp16 only: see the module docstring
    int8_fallbacks = 0  # forwards at int8 whose shape _int_mm cannot take on the device, run in fp32

    @classmethod
    def from_module(cls, module: nn.Module, precision: str = "fp32") -> LPModule:
        """The LP version of a stock module, sharing its Parameter (and buffer) objects.

        Refuses subclasses that override the forward, modules with children (parametrizations) and
        modules with hooks (they would not follow: remove them, swap, add them to the LP module).
        """
        if not isinstance(module, cls._stock):
            raise TypeError(f"{cls.__name__}.from_module needs a {cls._stock.__name__}, not {type(module)}")
        overridden = [
            name
            for name in ("forward", "_conv_forward")
            if hasattr(cls._stock, name) and getattr(type(module), name) is not getattr(cls._stock, name)
        ]
        if overridden:
            raise TypeError(
                f"{type(module).__name__} overrides {', '.join(overridden)}; it cannot be swapped"
            )
        if next(module.children(), None) is not None:
            raise ValueError(f"the {type(module).__name__} has child modules (a parametrization?)")
        hooks = sorted(k for k, v in vars(module).items() if k.endswith("hooks") and v)
        if hooks:
            raise ValueError(
                f"the {type(module).__name__} has hooks ({', '.join(hooks)}), which an LP module "
                "would not carry over: remove them, swap, then add them to the LP module"
            )
        new = _rebuild(cls, module)
        new._stock_cls = type(module)
        new.precision = precision
        return new

    def to_stock(self) -> nn.Module:
        """The stock module again (the class it was built from), sharing the same Parameters."""
        return _rebuild(
            getattr(self, "_stock_cls", self._stock),
            self,
            skip=("_precision", "output_dtype", "int8_fallbacks", "_stock_cls"),
        )

    @property
    def precision(self) -> str:
        """One of ``PRECISIONS``; set it at any time, validated against the weight's device."""
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        """Set the precision; any link to a neighbour (``output_dtype``) is undone."""
        self.check_precision(value)
        self._precision = value
        self.output_dtype = None

    @classmethod
    def allowed_precisions(cls, device: torch.device | str) -> tuple[str, ...]:
        """The precisions this kind of module can run on ``device``."""
        return supported_precisions(device)

    def check_precision(self, precision: str) -> None:
        """Raise ValueError if this module cannot run ``precision`` on its weight's device."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        device = self.weight.device
        if precision not in self.allowed_precisions(device):
            raise ValueError(self._refusal(precision, device))

    def _refusal(self, precision: str, device: torch.device) -> str:
        if precision == "tf32":
            return (
                f"tf32 needs a CUDA device of compute capability 8.0+; {type(self).__name__} is on {device}"
            )
        allowed = ", ".join(self.allowed_precisions(device))
        return f"{precision} does not run on {device} (it runs {allowed})"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        precision = self._precision
        if precision == "fp32":
            return self._stock.forward(self, input)
        if precision not in self.allowed_precisions(input.device):
            raise RuntimeError(self._refusal(precision, input.device))
        autocast_off = (
            torch.autocast(input.device.type, enabled=False)
            if torch.is_autocast_enabled(input.device.type)
            else _NOTHING
        )
        with autocast_off:
            if precision == "tf32":
                with _label(f"qsync::{self._op}_tf32"):
                    if torch.is_grad_enabled():
                        return _Tf32Op.apply(self._stock_op, input, self.weight, self.bias)
                    with _tf32_math():
                        return self._stock_op(input, self.weight, self.bias)
            if precision == "int8":
                return self._int8_forward(input)
            return self._cast_forward(input, precision)

    def _cast_forward(self, input: torch.Tensor, precision: str) -> torch.Tensor:
        dtype, src = CAST_DTYPES[precision], _dtype_name(self.weight.dtype)
        with _label(f"qsync::{self._op}_{precision}"):
            if torch.is_grad_enabled() and self._has_low_backward(input):
                return _CastOp.apply(self, input, self.weight, self.bias, dtype)
            with _label(f"qsync::cast_{src}_{precision}"):
                x, weight = input.to(dtype), self.weight.to(dtype)
                bias = None if self.bias is None else self.bias.to(dtype)
            return _cast_output(self._stock_op(x, weight, bias), self.output_dtype or input.dtype)


class LPLinear(LPModule, nn.Linear):
    """``nn.Linear`` with a ``precision``: fp32, tf32 (CUDA sm80+), bf16, fp16, int8 (``_int_mm``)."""

    _stock = nn.Linear
    _op = "linear"

    def _stock_op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def _has_low_backward(self, input: torch.Tensor) -> bool:
        """Whether `_low_backward` differentiates this forward (else autograd of the stock op)."""
        return True

    def _low_backward(
        self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, bool, bool]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Gradients of ``F.linear(x, weight, bias)`` for ``grad``, in their dtype (see `_CastOp`)."""
        g2, x2 = grad.reshape(-1, self.out_features), x.reshape(-1, self.in_features)
        grad_x = (g2 @ weight).reshape(x.shape) if needs[0] else None
        grad_w = g2.t() @ x2 if needs[1] else None
        return grad_x, grad_w, g2.sum(0) if needs[2] else None

    def _int8_forward(self, input: torch.Tensor) -> torch.Tensor:
        lead, k = input.shape[:-1], input.shape[-1]
        m = input.numel() // k if k else 0
        if not _int_mm_takes(input.device, m, k, self.out_features):
            self.int8_fallbacks += 1
            with _label("qsync::linear_fp32_fallback"):
                return F.linear(input, self.weight, self.bias)
        with _label("qsync::linear_int8"):
            out = _Int8Linear.apply(input.reshape(m, k), self.weight, self.bias)
        return out.reshape(*lead, self.out_features)


class _LPConv(LPModule):
    @classmethod
    def allowed_precisions(cls, device: torch.device | str) -> tuple[str, ...]:
        return tuple(p for p in supported_precisions(device) if p != "int8")

    def _refusal(self, precision: str, device: torch.device) -> str:
        if precision == "int8":
            return f"no int8 convolution kernel in stock PyTorch on {device}"
        return super()._refusal(precision, device)

    def _stock_op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._conv_forward(x, weight, bias)

    def _has_low_backward(self, input: torch.Tensor) -> bool:
        return self.padding_mode == "zeros" and not isinstance(self.padding, str)

    def _low_backward(
        self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, bool, bool]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Gradients of the convolution for ``grad`` (ATen's ``convolution_backward``), in their dtype."""
        unbatched = x.dim() < weight.dim()
        if unbatched:  # convolution_backward takes batched tensors only
            grad, x = grad.unsqueeze(0), x.unsqueeze(0)
        grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad,
            x,
            weight,
            [self.out_channels] if needs[2] else None,
            list(self.stride),
            list(self.padding),
            list(self.dilation),
            False,
            [0] * len(self.stride),
            self.groups,
            list(needs),
        )
        return grad_x.squeeze(0) if unbatched and grad_x is not None else grad_x, grad_w, grad_b


class LPConv1d(_LPConv, nn.Conv1d):
    """``nn.Conv1d`` with a ``precision``: fp32, tf32 (CUDA sm80+), bf16, fp16; no int8."""

    _stock = nn.Conv1d
    _op = "conv1d"


class LPConv2d(_LPConv, nn.Conv2d):
    """``nn.Conv2d`` with a ``precision``: fp32, tf32 (CUDA sm80+), bf16, fp16; no int8."""

    _stock = nn.Conv2d
    _op = "conv2d"


LP_CLASSES: dict[type[nn.Module], type[LPModule]] = {
    nn.Linear: LPLinear,
    nn.Conv1d: LPConv1d,
    nn.Conv2d: LPConv2d,
}


def lp_class_for(module: nn.Module) -> type[LPModule] | None:
    """The LP class for a stock Linear/Conv1d/Conv2d (or a subclass); None for anything else,
    LP modules included."""
    if isinstance(module, LPModule):
        return None
    return next((lp for stock, lp in LP_CLASSES.items() if isinstance(module, stock)), None)
