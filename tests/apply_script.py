"""Run by the tests as its own program: mode "apply" under DDP on 2 CPU processes, with the plan
cache in the directory given as the second argument (none without one, or when it is empty), for
the number of steps given as the third (30 without one); with "activation" as the fourth, the
residual model and activation-only callback of `test_activation_lightning` instead of a precision
plan's; with "regions", `test_regions_lightning`'s model of pointwise chains and a regions-only
callback.

Each rank writes ``rank<k>.json`` with the precisions its model ends with, the modules whose forward
a policy wraps, the modules compiled in place as regions, whether every loss was finite, and how
many steps it ran. The tests start it with `run_two_ranks`."""

import json
import subprocess
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from program_run import run_program  # noqa: E402
from test_activation_lightning import ResidualMLP, _callback, residual_loader  # noqa: E402
from test_precision_apply import GeluNet, _apply_callback, _loader, _lp_precisions  # noqa: E402
from test_regions_lightning import ChainBlock, Net, StopAt, net_loader, regions_callback  # noqa: E402


def run_two_ranks(
    out: Path, cache: Path | None = None, steps: int = 30, kind: str = ""
) -> subprocess.CompletedProcess:
    """This program, run in ``out`` (its output directory too) with the plan cache ``cache``;
    ``kind`` ("activation", "regions", or "" for a precision plan) picks the model and callback."""
    return run_program(__file__, [str(out), str(cache or ""), str(steps), kind], out)


def main() -> None:
    out = Path(sys.argv[1])
    cache = Path(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else False
    kind = sys.argv[4] if len(sys.argv) > 4 else ""
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    pl.seed_everything(0, verbose=False)
    callbacks: list[pl.Callback]
    if kind == "activation":
        model, loader = ResidualMLP(), residual_loader()
        callbacks = [_callback(out, output_dir=out, activation_trial_rounds=1)]
    elif kind == "regions":  # a long nominal run, so that compiles pay, stopped after ``steps``
        model, loader = Net(width=128, block=ChainBlock), net_loader(2 * steps)  # each rank half
        callbacks, steps = [regions_callback(out), StopAt(steps)], 10**6
    else:
        model, loader = GeluNet(), _loader()
        callbacks = [_apply_callback(out, plan_cache=cache)]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    result = {
        "precisions": _lp_precisions(model),
        "wrapped": sorted(n for n, module in model.named_modules() if n and "forward" in module.__dict__),
        "compiled": sorted(n for n, m in model.named_modules() if "_compiled_call_impl" in m.__dict__),
        "losses_finite": all(torch.isfinite(torch.tensor(model.losses)).tolist()),
        "steps": trainer.global_step,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():  # else gloo's threads can abort the exit (pytorch#190489)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
