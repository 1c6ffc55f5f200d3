"""Three small LightningModules on synthetic data, for the qsync benchmarks.

Each model has a name ("mlp", "cnn", "transformer") and a DataLoader factory whose data is drawn
from a fixed seed (nothing is downloaded). Sizes are chosen so that one training step takes
roughly 30-300 ms on a 2-core CPU with one process (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SEED = 1234
NUM_CLASSES = 10


class Classifier(pl.LightningModule):
    """Cross-entropy classification on ``(inputs, labels)`` batches; subclasses build ``self.net``."""

    net: nn.Module

    def __init__(self, lr: float = 1e-3):
        super().__init__()
        self.lr = lr
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self(x), y)


class MLP(Classifier):
    """Three hidden Linear/ReLU layers on flat 1024-feature inputs; Adam."""

    def __init__(self, in_features: int = 1024, hidden: int = 2048, lr: float = 1e-3):
        super().__init__(lr)
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class CNN(Classifier):
    """Three Conv2d/BatchNorm/ReLU/MaxPool blocks on 3x32x32 images, 10 classes; SGD with momentum."""

    def __init__(self, width: int = 32, lr: float = 0.05):
        super().__init__(lr)

        def block(c_in: int, c_out: int) -> list[nn.Module]:
            return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

        self.net = nn.Sequential(
            *block(3, width),
            nn.MaxPool2d(2),  # 16x16
            *block(width, 2 * width),
            nn.MaxPool2d(2),  # 8x8
            *block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4 * width, NUM_CLASSES),
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class _MeanPoolHead(nn.Module):
    """Mean over the sequence, then a linear classifier."""

    def __init__(self, d_model: int, num_classes: int):
        super().__init__()
        self.linear = nn.Linear(d_model, num_classes)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h.mean(dim=1))


class Transformer(Classifier):
    """Sequence classification: Embedding -> batch-first TransformerEncoder -> mean pool -> Linear; Adam."""

    def __init__(
        self,
        vocab: int = 2000,
        d_model: int = 128,
        nhead: int = 4,
        layers: int = 2,
        dim_feedforward: int = 512,
        seq_len: int = 64,
        lr: float = 1e-3,
    ):
        super().__init__(lr)
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward=dim_feedforward, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = _MeanPoolHead(d_model, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        return self.head(self.encoder(h))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: how to build it and its synthetic data."""

    name: str
    build: Callable[[], pl.LightningModule]
    batch_size: int
    make_data: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]

    def dataloader(self, num_batches: int) -> DataLoader:
        """``num_batches`` batches of synthetic data drawn from a fixed seed (the same on every rank;
        under DDP Lightning's distributed sampler gives each rank its share)."""
        gen = torch.Generator().manual_seed(SEED)
        x, y = self.make_data(num_batches * self.batch_size, gen)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False, drop_last=True)


def _labels(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, NUM_CLASSES, (n,), generator=gen)


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", MLP, 128, lambda n, g: (torch.randn(n, 1024, generator=g), _labels(n, g))),
    "cnn": ModelSpec("cnn", CNN, 128, lambda n, g: (torch.randn(n, 3, 32, 32, generator=g), _labels(n, g))),
    "transformer": ModelSpec(
        "transformer",
        Transformer,
        32,
        lambda n, g: (torch.randint(0, 2000, (n, 64), generator=g), _labels(n, g)),
    ),
}


def get_model(name: str) -> ModelSpec:
    """The spec named ``name`` (one of ``MODELS``)."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}") from None


class StepTimer(pl.Callback):
    """Wall-clock time between consecutive ``on_train_batch_start`` calls, in ms."""

    def __init__(self) -> None:
        self.step_ms: list[float] = []
        self._last: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int):
        now = time.perf_counter()
        if self._last is not None:
            self.step_ms.append((now - self._last) * 1e3)
        self._last = now


def timed_fit(
    spec: ModelSpec, max_steps: int, callbacks: Sequence[pl.Callback] = (), procs: int = 1
) -> tuple[pl.Trainer, StepTimer, pl.LightningModule, DataLoader]:
    """Fit ``spec``'s model for ``max_steps`` on CPU (DDP over gloo when ``procs`` > 1) with
    ``callbacks`` and a `StepTimer` after them: work a callback does at the start of step b is then
    timed in step b - 1. No logger, progress bar or checkpoints."""
    pl.seed_everything(SEED, verbose=False)
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=procs,
        strategy="ddp" if procs > 1 else "auto",
        max_steps=max_steps,
        callbacks=[*callbacks, timer],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
    )
    module, loader = spec.build(), spec.dataloader(max_steps * procs)
    trainer.fit(module, loader)
    return trainer, timer, module, loader


def time_steps(name: str, steps: int = 30, skip: int = 5) -> list[float]:
    """Per-step wall-clock times (ms) of a plain one-process ``Trainer.fit`` of model ``name``,
    without the first ``skip`` steps."""
    _, timer, _, _ = timed_fit(get_model(name), steps + 1)
    return timer.step_ms[skip:]


def main() -> None:
    """Print each model's median step time (used to choose the sizes above)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    for name in args.models.split(","):
        ms = time_steps(name, args.steps)
        params = sum(p.numel() for p in get_model(name).build().parameters())
        print(
            f"{name:<12} batch {get_model(name).batch_size:4d}  params {params / 1e6:6.2f} M  "
            f"step median {statistics.median(ms):7.1f} ms  min {min(ms):7.1f}  max {max(ms):7.1f}  "
            f"({len(ms)} steps, {torch.get_num_threads()} threads)"
        )


if __name__ == "__main__":
    main()
