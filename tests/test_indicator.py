"""LayerStatistics (recorder) and the precision-sensitivity indicator (predictor), on real models."""

import copy
import json
import math

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback.errors import QSyncInputError
from qsync_callback.lp import set_precision, swap_to_lp
from qsync_callback.predictor.indicator import sensitivity
from qsync_callback.recorder.layer_statistics import LayerStatistics

LOW = ("tf32", "bf16", "fp16", "int8")


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(inplace=True), nn.Linear(64, 64), nn.ReLU(inplace=True), nn.Linear(64, 4)
    )


class _Mixed(nn.Module):
    """Conv1d, Conv2d and Linear, called in the reverse order of their registration."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 4)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.conv1 = nn.Conv1d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))  # [B, 4, 16]
        h = torch.relu(self.conv2(h.reshape(-1, 4, 4, 4)))
        return self.head(h.mean(dim=(2, 3)))


def _batches(n: int = 6, features: int = 32, outlier: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randn(64, features, generator=g)
        x[:, 0] *= outlier
        out.append((x, torch.randint(0, 4, (64,), generator=g)))
    return out


def _train(model: nn.Module, batches, stats: LayerStatistics | None = None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if stats is not None:
        stats.start()
    losses = []
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if stats is not None:
        stats.stop()
    return losses


def _gathered(model: nn.Module, batches, loss_scale: float = 1.0) -> dict:
    """Statistics over forward and backward passes of ``batches`` (no optimizer step)."""
    stats = LayerStatistics(model)
    stats.start()
    for x, y in batches:
        (nn.functional.cross_entropy(model(x), y) * loss_scale).backward()
    stats.stop()
    return stats.to_dict()


def _hooks(module: nn.Module) -> int:
    return sum(len(v) for k, v in vars(module).items() if k.endswith("hooks") and isinstance(v, dict)) + len(
        module.weight._backward_hooks or {}
    )


def test_training_is_bit_identical_with_statistics():
    batches = _batches()
    plain, watched = _mlp(), _mlp()
    stats = LayerStatistics(watched)
    assert _train(plain, batches) == _train(watched, batches, stats)
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(layer["calls"] == len(batches) for layer in stats.to_dict()["layers"].values())


def test_hooks_are_removed_by_stop_and_the_layers_can_be_swapped():
    model = _mlp()
    layers = [model[0], model[2], model[4]]
    stats = LayerStatistics(model)
    stats.start()
    assert stats.recording and all(_hooks(m) == 1 for m in layers)
    _train(model, _batches(2))
    assert all(_hooks(m) == 1 for m in layers)
    stats.stop()
    assert not stats.recording and all(_hooks(m) == 0 for m in layers)
    before = stats.to_dict()
    _train(model, _batches(2))
    assert stats.to_dict() == before
    assert set(swap_to_lp(model)) == {"0", "2", "4"}


def test_a_backward_after_stop_is_not_counted():
    model = _mlp()
    stats = LayerStatistics(model)
    stats.start()
    loss = model(torch.randn(8, 32)).sum()
    stats.stop()
    loss.backward()
    layer = stats.to_dict()["layers"]["0"]["tensors"]
    assert layer["input"]["numel"] == 8 * 32
    assert layer["grad_output"]["numel"] == 0 and layer["grad_weight"]["numel"] == 0


def test_recorded_values_are_the_tensors_own():
    model = _mlp()
    x = torch.randn(16, 32)
    x[0, 0] = 1e-6  # below fp16's smallest normal
    stats = LayerStatistics(model, ["0"])
    stats.start()
    model(x).square().sum().backward()  # the in-place ReLU modifies the Linear's output after its hook
    stats.stop()
    y = model[0](x)
    out = model[4](torch.relu(model[2](torch.relu(y))))
    (grad_y,) = torch.autograd.grad(out.square().sum(), y)
    t = stats.to_dict()["layers"]["0"]["tensors"]
    assert t["input"]["numel"] == x.numel()
    assert t["input"]["sumsq"] == pytest.approx(x.square().sum().item(), rel=1e-5)
    assert t["input"]["amax"] == pytest.approx(x.abs().max().item())
    assert t["input"]["amax_sq_numel"] == pytest.approx(x.abs().max().item() ** 2 * x.numel(), rel=1e-5)
    assert t["input"]["under_count"] == 1 and t["input"]["under_sumsq"] == pytest.approx(1e-12, rel=1e-3)
    # the gradient w.r.t. the Linear's output, not w.r.t. the ReLU's in-place result
    assert t["grad_output"]["sumsq"] == pytest.approx(grad_y.square().sum().item(), rel=1e-5)
    assert t["grad_weight"]["sumsq"] == pytest.approx(model[0].weight.grad.square().sum().item(), rel=1e-5)


def test_every_steps_weight_gradient_is_read_once_also_at_a_reused_address():
    """Each step's gradient is a new tensor that the allocator may place where the last one was (a
    loop that sets gradients to None): made certain here by putting every step's gradient into
    one buffer. Every step's gradient is read, once."""
    torch.manual_seed(0)
    model = _mlp()
    weight = model[0].weight
    buffer = torch.empty_like(weight)
    stats = LayerStatistics(model, ["0"])
    stats.start()
    steps, sumsq = 5, 0.0
    for _ in range(steps):
        loss = model(torch.randn(16, 32)).square().sum()  # reads the previous step's gradient
        model.zero_grad(set_to_none=True)
        loss.backward()
        buffer.copy_(weight.grad)
        weight.grad = torch.empty(0).set_(buffer.untyped_storage(), 0, weight.shape, weight.stride())
        sumsq += weight.grad.square().sum().item()
    stats.stop()
    t = stats.to_dict()["layers"]["0"]["tensors"]["grad_weight"]
    assert t["numel"] == steps * weight.numel()
    assert t["sumsq"] == pytest.approx(sumsq, rel=1e-5)


def test_eval_and_no_grad_forwards_are_not_counted():
    model = _mlp()
    stats = LayerStatistics(model)
    stats.start()
    with torch.no_grad():
        model(torch.randn(4, 32))
    model.eval()
    model(torch.randn(4, 32)).sum().backward()
    stats.stop()
    assert all(layer["calls"] == 0 and layer["depth"] is None for layer in stats.to_dict()["layers"].values())
    assert sensitivity(stats.to_dict(), LOW) == {}


def test_depth_is_the_forward_order_and_convs_get_no_int8():
    model = _Mixed()
    stats = LayerStatistics(model)
    x = torch.randn(16, 3, 16)
    stats.start()
    nn.functional.cross_entropy(model(x), torch.randint(0, 4, (16,))).backward()
    stats.stop()
    data = stats.to_dict()
    assert list(data["layers"]) == ["conv1", "conv2", "head"]
    assert [data["layers"][n]["depth"] for n in data["layers"]] == [1, 2, 3]
    assert [data["layers"][n]["kind"] for n in data["layers"]] == ["conv1d", "conv2d", "linear"]
    assert [data["layers"][n]["fan_in"] for n in data["layers"]] == [3 * 3, 4 * 9, 8]
    result = sensitivity(data, ["fp32", "bf16", "int8"])
    assert set(result["conv1"]) == set(result["conv2"]) == {"fp32", "bf16"}
    assert set(result["head"]) == {"fp32", "bf16", "int8"}
    # the LP convolutions refuse int8 as well
    lp = swap_to_lp(model, ["conv2"])
    with pytest.raises(ValueError, match="int8"):
        set_precision(lp, {"conv2": "int8"})


def test_ordering_on_a_layer_with_a_wide_input_range():
    model = _mlp()
    result = sensitivity(_gathered(model, _batches(outlier=100.0)), ("fp32", *LOW))
    first = result["0"]
    assert first["fp32"] == 0.0
    assert 0 < first["tf32"] < first["fp16"] < first["bf16"] < first["int8"]
    # the outlier column makes int8 much worse on the layer that reads it than on the next one
    assert first["int8"] > 5 * result["2"]["int8"]
    # floats are relative: the input's range does not change them much
    plain = sensitivity(_gathered(_mlp(), _batches()), ("fp32", *LOW))["0"]
    assert first["bf16"] == pytest.approx(plain["bf16"], rel=0.5)
    assert first["int8"] > 5 * plain["int8"]


def test_int8_grows_with_the_quantization_step():
    """One large input element sets the int8 step (amax / 127) of the whole input."""

    def batches(scale: float):
        out = _batches(2)
        for x, _ in out:
            x[0, 0] = scale
        return out

    values = [
        sensitivity(_gathered(_mlp(), batches(scale)), ["int8"])["0"]["int8"]
        for scale in (1.0, 10.0, 30.0, 100.0)
    ]
    assert all(a < b for a, b in zip(values, values[1:], strict=False))
    # with everything else equal, the int8 indicator is affine in the squared step
    data = _gathered(_mlp(), _batches(2))
    steps = []
    for factor in (1.0, 2.0, 3.0):
        layer = copy.deepcopy(data)
        for role in ("input", "weight"):
            layer["layers"]["2"]["tensors"][role]["amax_sq_numel"] *= factor
        steps.append(sensitivity(layer, ["int8"])["2"]["int8"])
    assert steps[0] < steps[1] < steps[2]
    assert steps[2] - steps[1] == pytest.approx(steps[1] - steps[0], rel=1e-9)


def test_fp16_range_limits():
    tiny = sensitivity(_gathered(_mlp(), _batches(2), loss_scale=1e-7), ["bf16", "fp16"])
    normal = sensitivity(_gathered(_mlp(), _batches(2)), ["bf16", "fp16"])
    # gradients below fp16's normal range lose precision in fp16, not in bf16
    assert tiny["0"]["fp16"] > 10 * normal["0"]["fp16"]
    assert tiny["0"]["bf16"] == pytest.approx(normal["0"]["bf16"], rel=0.2)
    huge = sensitivity(_gathered(_mlp(), _batches(1, outlier=1e5)), ["bf16", "fp16"])
    assert huge["0"]["fp16"] == math.inf and math.isfinite(huge["0"]["bf16"])


def test_indicator_of_one_layer_against_its_measured_rounding_error():
    """A single Linear (input needs no gradient): the indicator is r_y + r_gW, which the measured
    relative errors of the output and of the weight gradient at that precision should match (they do
    within 25% here: bf16 0.78, fp16 1.17, int8 1.01 times the measured)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    x = torch.randn(256, 64)
    x[:, :2] *= 20
    g = torch.randn(256, 32)
    stats = LayerStatistics(model)
    stats.start()
    ref_y = model(x)
    ref_y.backward(g)
    stats.stop()
    ref_y, ref_gw = ref_y.detach(), model[0].weight.grad.clone()
    predicted = sensitivity(stats.to_dict(), ["bf16", "fp16", "int8"])["0"]
    lp = swap_to_lp(model)
    for precision, value in predicted.items():
        set_precision(lp, {"0": precision})
        model.zero_grad()
        y = model(x)
        y.backward(g)
        measured = ((y.detach() - ref_y).square().sum() / ref_y.square().sum()).item() + (
            (model[0].weight.grad - ref_gw).square().sum() / ref_gw.square().sum()
        ).item()
        assert measured / 2 < value < measured * 2, (precision, value, measured)


def test_json_round_trip_and_resumed_recording():
    model = _mlp()
    batches = _batches(3)
    stats = LayerStatistics(model)
    _train(model, batches, stats)
    data = stats.to_dict()
    text = json.dumps(data, allow_nan=False)
    restored = LayerStatistics.from_dict(json.loads(text), model)
    assert restored.to_dict() == data
    assert sensitivity(json.loads(text), LOW) == sensitivity(data, LOW)
    _train(model, batches[:1], restored)
    assert all(layer["calls"] == 4 for layer in restored.to_dict()["layers"].values())
    assert restored.to_dict()["layers"]["0"]["depth"] == 1


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda d: d.update(version=99), "version"),
        (lambda d: d["layers"]["0"].update(kind="lstm"), "kind"),
        (lambda d: d["layers"]["0"]["tensors"]["input"].update(sumsq=float("nan")), "sumsq"),
        (lambda d: d["layers"]["0"]["tensors"]["input"].update(numel=-1), "numel"),
        (lambda d: d["layers"]["0"]["tensors"].pop("grad_weight"), "tensors"),
        (lambda d: d["layers"]["0"].update(depth=True), "depth"),
    ],
)
def test_malformed_statistics_are_refused(corrupt, match):
    data = _gathered(_mlp(), _batches(1))
    corrupt(data)
    with pytest.raises(QSyncInputError, match=match):
        sensitivity(data, ["bf16"])
    with pytest.raises(QSyncInputError, match=match):
        LayerStatistics.from_dict(data, _mlp())


def test_refusals():
    data = _gathered(_mlp(), _batches(1))
    with pytest.raises(ValueError, match="fp8"):
        sensitivity(data, ["bf16", "fp8"])
    with pytest.raises(ValueError, match="not a swappable layer"):
        LayerStatistics(_mlp(), ["1"])  # a ReLU
    other = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    with pytest.raises(ValueError, match="fan-in"):
        LayerStatistics.from_dict(data, other)


class _Gather(pl.Callback):
    """Statistics over the first ``steps`` training steps of a real fit."""

    def __init__(self, steps: int):
        self.steps = steps
        self.stats: LayerStatistics | None = None

    def on_train_start(self, trainer, pl_module):
        self.stats = LayerStatistics(pl_module)
        self.stats.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx + 1 == self.steps:
            self.stats.stop()


class _Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_fit_with_statistics(tmp_path):
    x, y = torch.randn(512, 32), torch.randint(0, 4, (512,))
    loader = DataLoader(TensorDataset(x, y), batch_size=64)
    gather = _Gather(steps=3)
    module = _Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        limit_val_batches=2,
        val_check_interval=2,
        callbacks=[gather],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, loader, loader)
    data = gather.stats.to_dict()
    assert not gather.stats.recording and all(_hooks(m) == 0 for m in (module.net[0], module.net[4]))
    assert list(data["layers"]) == ["net.0", "net.2", "net.4"]
    for layer in data["layers"].values():
        # 3 training steps; the validation forwards in between are not counted
        assert layer["calls"] == 3 and layer["tensors"]["grad_output"]["numel"] > 0
    result = sensitivity(data, ("fp32", *LOW))
    assert all(0 < r["fp16"] < r["bf16"] and r["fp32"] == 0 for r in result.values())
    # the same steps without the statistics end at the same weights
    plain = _Module()
    pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        limit_val_batches=2,
        val_check_interval=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    ).fit(plain, loader, loader)
    for a, b in zip(plain.parameters(), module.parameters(), strict=True):
        assert torch.equal(a, b)
