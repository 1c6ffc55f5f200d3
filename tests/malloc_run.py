"""Run by the tests as its own program (a plan it keeps fixes the process's malloc thresholds, which
no test process should keep): a small MLP whose every step also asks for a 40 MiB block and frees
it (larger than glibc's moving mmap threshold ever goes, so under glibc's defaults every step maps
it afresh and faults in its 10,240 pages), trained with ``QSyncCallback(mode="apply",
levers=("allocator",))`` on 1 process or under DDP on 2 (gloo); arguments: the output directory, the
number of processes and of steps.

Each rank writes ``rank<k>.json`` with the minor page faults of every step and whether the
callback had decided on its plan when the step started (`StepFaults`), the plan the callback kept,
and the losses. The tests start it with `run`."""

import json
import subprocess
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from program_run import run_program
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback import QSyncCallback
from qsync_callback.page_faults import minor_page_faults

BLOCK_FLOATS = 10 * 2**20  # 40 MiB of float32


class FaultingMLP(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        block = torch.zeros(BLOCK_FLOATS)  # a scratch buffer of the user's, freed at the step's end
        loss = nn.functional.cross_entropy(self.net(x), y) + 0.0 * block[:1].sum()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class StepFaults(pl.Callback):
    """The minor page faults between consecutive step starts, and for each such step whether
    ``callback`` had decided on its plan (kept or rolled back) when it started."""

    def __init__(self, callback: QSyncCallback):
        self.faults: list[int] = []
        self.decided: list[bool] = []
        self._callback = callback
        self._last: tuple[int, bool] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = minor_page_faults(), bool(self._callback.state_dict()["finished"])  # after its boundary
        if self._last is not None:
            self.faults.append(now[0] - self._last[0])
            self.decided.append(self._last[1])
        self._last = now


def run(out: Path, procs: int, steps: int) -> subprocess.CompletedProcess:
    """This program, run in ``out`` (its output directory too)."""
    return run_program(__file__, [str(out), str(procs), str(steps)], out)


def main() -> None:
    out, procs, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(8192, 64), torch.randint(0, 4, (8192,)))
    model = FaultingMLP()
    callback = QSyncCallback(mode="apply", output_dir=out, levers=("allocator",), plan_cache=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=procs,
        strategy="ddp" if procs > 1 else "auto",
        max_steps=steps,
        callbacks=[callback, faults := StepFaults(callback)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=32))
    kept = callback.plan.to_dict() if callback.plan is not None else None
    result = {"faults": faults.faults, "decided": faults.decided, "plan": kept, "losses": model.losses}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():  # else gloo's threads can abort the exit (pytorch#190489)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
