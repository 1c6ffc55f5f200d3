"""Train a small classifier with PyTorch Lightning and let QSyncCallback record and report on it.

    python examples/train_lightning.py                      # 1 process on CPU
    python examples/train_lightning.py --devices 2          # 2 processes, DDP over gloo

The data is generated (Gaussian clusters, fixed seed): nothing is downloaded. After the warm-up
the callback prints measured against predicted step time and peak memory and writes
``<output_dir>/report.json`` and the traces under ``<output_dir>/trace/rank<k>/``.
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback import QSyncCallback
from qsync_callback.alternation import LOOKS, ROUNDS


class Classifier(pl.LightningModule):
    """An MLP over feature vectors."""

    def __init__(self, features: int = 128, hidden: int = 1024, classes: int = 10):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, classes),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def cluster_data(samples: int = 8192, features: int = 128, classes: int = 10, seed: int = 0) -> TensorDataset:
    """Gaussian clusters, one per class: a learnable task generated on the spot."""
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=generator) * 2
    labels = torch.randint(0, classes, (samples,), generator=generator)
    points = centers[labels] + torch.randn(samples, features, generator=generator)
    return TensorDataset(points, labels)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1, help="CPU processes (2 or more: DDP over gloo)")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--mode", choices=("record", "report", "apply"), default="report")
    parser.add_argument("--memory-budget", default=None, help="mode apply: e.g. 2GB (default: none)")
    parser.add_argument("--max-step-time", type=float, default=None, help="mode apply: seconds per step")
    parser.add_argument("--precisions", default="fp32,bf16,fp16,int8", help="mode apply: allowed precisions")
    parser.add_argument(
        "--levers",
        default="precision,activation,regions,buckets,allocator",
        help="mode apply: what a plan may change",
    )
    parser.add_argument("--accumulate-grad-batches", type=int, default=1, help="micro-batches per step")
    parser.add_argument(
        "--best-effort", action="store_true", help="mode apply: take the closest plan if none fits"
    )
    parser.add_argument(
        "--alternate-rounds",
        type=int,
        default=ROUNDS,
        help="mode apply: rounds of the recorded configuration and the plan in turns after verify (0: none)",
    )
    parser.add_argument(
        "--alternate-looks",
        type=int,
        default=LOOKS,
        help="mode apply: while the turns cannot tell the plan from the baseline, as many more rounds,"
        f" up to this many times as many (default: {LOOKS})",
    )
    parser.add_argument("--plan", default=None, help="a plan file to apply from step 0")
    parser.add_argument("--no-plan-cache", action="store_true", help="neither use nor keep cached plans")
    parser.add_argument("--output-dir", default=None, help="default: <log_dir>/qsync")
    parser.add_argument("--root-dir", default="runs", help="Lightning's default_root_dir")
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.max_steps,
        default_root_dir=args.root_dir,
        enable_checkpointing=False,
        enable_progress_bar=False,
        log_every_n_steps=10,
        accumulate_grad_batches=args.accumulate_grad_batches,
        callbacks=[
            QSyncCallback(
                mode=args.mode,
                output_dir=args.output_dir,
                memory_budget=args.memory_budget,
                max_step_time=args.max_step_time,
                precisions=args.precisions.split(","),
                levers=args.levers.split(","),
                best_effort=args.best_effort,
                plan=args.plan,
                plan_cache=not args.no_plan_cache,
                alternate_rounds=args.alternate_rounds,
                alternate_looks=args.alternate_looks,
            )
        ],
    )
    loader = DataLoader(cluster_data(), batch_size=args.batch_size, shuffle=True)
    trainer.fit(Classifier(), loader)
    if torch.distributed.is_initialized():  # else gloo's threads can abort the exit (pytorch#190489)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
