"""Run by the tests as its own program: a deep MLP (widths of 1 MiB and more per layer, so that
DDP's default buckets leave most of the gradients for after backward) trained under DDP on 2 CPU
processes with ``QSyncCallback(mode=<mode>, levers=<levers>)``; arguments: the output directory,
the mode, the number of steps, and optionally a plan file to apply from step 0, a rank on which
the user registers a comm hook of their own before the first step (`UserHook`: the bucket applier
refuses to re-wrap a module with a hook it does not know, on that rank only), and the levers
(comma-separated; "buckets" without them).

Each rank writes ``rank<k>.json`` with DDP's bucket sizes after the last step (its logging data),
the modules that ran compiled then, and the losses. The tests start it with `run_two_ranks`."""

import json
import subprocess
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from program_run import run_program
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback import QSyncCallback

WIDTH, DEPTH = 512, 6


class DeepMLP(pl.LightningModule):
    def __init__(self):
        super().__init__()
        blocks = [m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
        self.net = nn.Sequential(*blocks, nn.Linear(WIDTH, 10))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LastBuckets(pl.Callback):
    """DDP's bucket sizes after each step (Lightning unwraps the model when training ends), and the
    modules running compiled then."""

    sizes: list[int] = []
    compiled: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sizes = trainer.strategy.model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
        self.sizes = [int(s) for s in str(sizes).replace(",", " ").split()]
        self.compiled = [
            name for name, m in pl_module.named_modules() if m.__dict__.get("_compiled_call_impl") is not None
        ]


class UserHook(pl.Callback):
    """On rank ``rank``: a comm hook of the user's own on the DDP wrapper, all-reducing as DDP does."""

    def __init__(self, rank: int):
        self.rank = rank

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == self.rank:
            trainer.strategy.model.register_comm_hook(None, users_allreduce)


def users_allreduce(state, bucket):
    return default_hooks.allreduce_hook(state, bucket)


def run_two_ranks(
    out: Path,
    mode: str,
    steps: int,
    plan: Path | None = None,
    user_hook_on: int | None = None,
    levers: tuple[str, ...] = ("buckets",),
) -> subprocess.CompletedProcess:
    """This program, run in ``out`` (its output directory too)."""
    hook = "" if user_hook_on is None else str(user_hook_on)
    arguments = [str(out), mode, str(steps), str(plan or ""), hook, ",".join(levers)]
    return run_program(__file__, arguments, out)


def main() -> None:
    out, mode, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    plan = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
    hooks = [UserHook(int(sys.argv[5]))] if len(sys.argv) > 5 and sys.argv[5] else []
    levers = tuple(sys.argv[6].split(",")) if len(sys.argv) > 6 else ("buckets",)
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(4096, WIDTH), torch.randint(0, 10, (4096,)))
    model = DeepMLP()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=steps,
        callbacks=[
            QSyncCallback(mode=mode, output_dir=out, levers=levers, plan_cache=False, plan=plan),
            last := LastBuckets(),
            *hooks,
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=32))
    result = {"bucket_sizes": last.sizes, "compiled": last.compiled, "losses": model.losses}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():  # else gloo's threads can abort the exit (pytorch#190489)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
