"""Run by `test_ddp_buckets_apply` as its own program: Lightning DDP on 2 CPU processes (gloo), with
a callback that applies `PLAN_BUCKETS` through the run's own appliers (`LightningRun`) at step
`APPLY_AT` and undoes it at `UNDO_AT` (with "apply" as the second argument; without it, the same run
untouched, for the losses to compare with). With "manual" as the third, the module optimizes by hand
under a static graph, whose first iteration Lightning flushes itself (`DDPStrategy.post_backward`):
the plan's wrapper has a first iteration of its own.

Each rank writes ``rank<k>.json`` to the directory given as the first argument: its losses, a digest
of its final parameters, the buckets (parameter names, launch order) before the apply, after the
plan's wrapper rebuilt them and after the undo's did, the all-reduces of one step before and one
after, whether the old wrapper and its reducer were freed, and what the plan's wrapper carried
over."""

import gc
import hashlib
import json
import os
import subprocess
import sys
import weakref
from itertools import pairwise
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback.appliers.torch_ddp_buckets import bucket_names
from qsync_callback.integrations.lightning.lightning_run import LightningRun
from qsync_callback.plan import Plan
from qsync_callback.tuning_loop import apply_plan

WIDTHS = (96, 320, 256, 384, 192, 448, 10)  # unequal layers, over 1 MiB in all: DDP's default makes 2 buckets
APPLY_AT, UNDO_AT, STEPS = 2, 5, 9
PROFILED = {1: "before", 4: "after"}  # step -> its all-reduces' name in the results
CHECKS = {2: "before", 5: "after", 8: "undone"}  # step whose boundary reads the buckets -> name
# launch order: the last layer's gradients are ready first; Linear layers at 0, 2, 4, ... (ReLUs between)
PLAN_LAYERS = [[10], [8, 6], [4], [2, 0]]
PLAN_BUCKETS = [[f"net.{i}.{kind}" for i in layers for kind in ("weight", "bias")] for layers in PLAN_LAYERS]


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        layers: list[torch.nn.Module] = []
        for n_in, n_out in pairwise(WIDTHS):
            layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers[:-1])
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = 16 * 2 * STEPS
    return DataLoader(
        TensorDataset(
            torch.randn(n, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (n,), generator=g)
        ),
        batch_size=16,
    )


class ManualNet(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.losses.append(loss.item())


class Rewrap(pl.Callback):
    def __init__(self, apply: bool):
        self.apply = apply
        self.results: dict = {}
        self._undo = None
        self._profiler: torch.profiler.profile | None = None

    def on_train_start(self, trainer, pl_module):
        # a comm hook for the plan's wrapper to carry over (Lightning registers its own only on CUDA)
        trainer.strategy.model.register_comm_hook(None, default_hooks.allreduce_hook)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step, strategy = trainer.global_step, trainer.strategy
        if step in CHECKS:
            self.results[CHECKS[step]] = bucket_names(strategy.model)
        if step == APPLY_AT and self.apply:
            old = weakref.ref(strategy.model)
            reducer = weakref.ref(strategy.model.reducer)
            run = LightningRun(trainer, pl_module, batch, ())
            self._undo = apply_plan(Plan(buckets=PLAN_BUCKETS), run.appliers())
            gc.collect()
            new = strategy.model
            self.results["freed"] = {"wrapper": old() is None, "reducer": reducer() is None}
            self.results["carried"] = {
                "gradient_as_bucket_view": new.gradient_as_bucket_view,
                "comm_hooks": [hook.__qualname__ for hook, _ in new._comm_hooks],
                "caps_mb": new.bucket_bytes_cap_list and [c / 2**20 for c in new.bucket_bytes_cap_list],
            }
        if step == UNDO_AT and self._undo is not None:
            self._undo()
            self.results["undone_caps"] = {
                "list": strategy.model.bucket_bytes_cap_list,
                "default": strategy.model.bucket_bytes_cap_default,
            }
        if step in PROFILED:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._profiler is not None:
            self._profiler.stop()
            events = [e.name for e in self._profiler.events() if e.name == "gloo:all_reduce"]
            self.results[f"all_reduces_{PROFILED[trainer.global_step - 1]}"] = len(events)
            self._profiler = None


def run_two_ranks(out: Path, apply: bool, manual: bool = False) -> subprocess.Popen:
    """This program on 2 ranks, writing to ``out``; started, not waited for."""
    return subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            str(out),
            "apply" if apply else "",
            "manual" if manual else "",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        cwd=out,
    )


def main() -> None:
    out, apply, manual = Path(sys.argv[1]), sys.argv[2] == "apply", sys.argv[3] == "manual"
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = ManualNet() if manual else Net()
    callback = Rewrap(apply)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(gradient_as_bucket_view=True, static_graph=manual),
        max_steps=STEPS,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader())
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    result = {"losses": model.losses, "digest": digest, **callback.results}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():  # else gloo's threads can abort the exit (pytorch#190489)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
