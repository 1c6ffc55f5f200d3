"""Training quality under a memory budget: the allocator's plan against fp32 and uniform precisions.

On scikit-learn's digits (1797 8x8 images, shipped with the package; a fixed stratified 75/25
split, features standardized on the training part), an MLP (64 -> 256 x3 -> 10, ReLU, dropout,
SGD with momentum, batch 256) is trained for ``--epochs`` epochs per seed, and its test accuracy
is measured at the end, with the precision the run ended in:

1. **Recording.** One run with ``QSyncCallback(mode="apply")`` and no constraint: it probes every
   layer at every precision and gathers the indicator's statistics (nothing is applied). From its
   traces the predictor gives the recorded peak and the least any plan reaches; the budget is
   halfway between them, as in `precision_plans.py`.
2. **fp32**: the same training without the callback.
3. **allocator**: ``QSyncCallback(mode="apply", memory_budget=<budget>)``, the whole loop on the live
   run (record, plan, switch after the warm-up, verify, keep or roll back), then training goes on
   in whatever it kept.
4. **uniform p**: for each low precision p, every layer that runs p at p from step 0
   (``QSyncCallback(plan=...)``), when that plan's predicted peak meets the budget.

The targets (issue 3): the allocator's plan ends within 0.5 accuracy points of fp32 (mean over
the seeds) and no worse than the uniform lowest precision that meets the same budget.

``--quick``: a smoke pass, one seed of ``QUICK_EPOCHS`` epochs (enough for the allocator's loop to
switch and verify, not for the accuracy targets to mean anything). Writes
``<out>/training_quality.md`` and ``.json``.

    python benchmarks/training_quality.py [--seeds 3] [--epochs 60] [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from models import Classifier
from runs import bench_environment, write_results
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback.integrations.lightning import QSyncCallback
from qsync_callback.plan import FULL_PRECISION, Plan
from qsync_callback.planner.precision import candidate_precisions, least_memory_plan
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.trace import load_trace_dir

PRECISIONS = ("fp32", "bf16", "fp16", "int8")
LOWEST_FIRST = ("int8", "fp16", "bf16")  # by significand bits: the lowest precision first
BATCH_SIZE = 256
HIDDEN = 256
DROPOUT = 0.1
TARGET_POINTS = 0.5
RECORD_EPOCHS = 8  # 48 steps: the callback's window closes after about 30
CALLBACK_SCHEDULE = {"warmup_steps": 10, "profile_steps": 5, "measure_steps": 10, "verify_steps": 3}
QUICK_EPOCHS = 8  # 48 steps: past the allocator's switch (about 30) and its verify steps


class DigitsMLP(Classifier):
    """64 -> 256 -> 256 -> 256 -> 10 with ReLU and dropout; SGD (lr 0.05, momentum 0.9).

    With this batch, saved activations outweigh weights, gradients and momentum, so the peak is in
    the backward pass, where a layer's precision changes what it saves."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.net = nn.Sequential(
            nn.Linear(64, HIDDEN),
            nn.ReLU(),
            nn.Dropout(DROPOUT),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Dropout(DROPOUT),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Dropout(DROPOUT),
            nn.Linear(HIDDEN, 10),
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def digits_split() -> tuple[TensorDataset, TensorDataset]:
    """The fixed train/test split, standardized with the training part's mean and deviation (1 for
    the border pixels that are always 0 in training: a tiny deviation would blow their rare test
    values up a million times, which int8's per-tensor scale cannot hold)."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=0.25, random_state=0, stratify=digits.target
    )
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[std == 0] = 1.0

    def dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.tensor((x - mean) / std, dtype=torch.float32), torch.tensor(y))

    return dataset(x_train, y_train), dataset(x_test, y_test)


def train(seed: int, epochs: int, callback: QSyncCallback | None) -> float:
    """Train one seed (``callback`` attached if given); the test accuracy in percent at the end."""
    train_set, test_set = digits_split()
    pl.seed_everything(seed, verbose=False)
    model = DigitsMLP()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[callback] if callback is not None else [],
    )
    trainer.fit(model, DataLoader(train_set, batch_size=BATCH_SIZE, shuffle=True))
    model.eval()
    x, y = test_set.tensors
    with torch.no_grad():
        predicted = model(x).argmax(dim=1)
    return 100.0 * float((predicted == y).float().mean())


def budget_and_uniform_plans(trace_dir: Path) -> tuple[int, int, list[dict[str, Any]]]:
    """From the recording: the budget (halfway between the recorded peak and the least any plan
    reaches), the recorded peak, and each uniform low precision with its predicted peak."""
    traces = load_trace_dir(trace_dir)
    predictor = Predictor(traces)
    recorded = predictor.predict().peak_bytes
    least = least_memory_plan(predictor, PRECISIONS)[1].peak_bytes
    if least >= recorded:
        raise RuntimeError("no plan lowers the predicted peak of this model: no budget to plan for")
    budget = (least + recorded) // 2
    candidates = candidate_precisions(predictor, PRECISIONS)
    uniform = []
    for p in LOWEST_FIRST:
        precision = {name: p for name, options in candidates.items() if p in options}
        if not precision:
            continue
        plan = Plan(fingerprint=traces[0].fingerprint, precision=precision)
        peak = predictor.predict(plan).peak_bytes
        uniform.append({"precision": p, "plan": plan, "peak_bytes": peak, "meets_budget": peak <= budget})
    return budget, recorded, uniform


def measure(seeds: int, epochs: int, out: Path) -> dict[str, Any]:
    record_dir = out / "training_quality" / "record"
    train(
        0,
        RECORD_EPOCHS,
        QSyncCallback(
            mode="apply",
            output_dir=record_dir,
            max_step_time=1e6,
            plan_cache=False,
            precisions=PRECISIONS,
            **CALLBACK_SCHEDULE,
        ),
    )
    budget, recorded, uniform = budget_and_uniform_plans(record_dir / "trace")
    accuracy: dict[str, list[float]] = {"fp32": [], "allocator": []}
    kept: list[dict[str, Any]] = []
    for seed in range(seeds):
        print(f"[benchmark] seed {seed}", file=sys.stderr, flush=True)
        accuracy["fp32"].append(train(seed, epochs, None))
        run_dir = out / "training_quality" / f"allocator-s{seed}"
        callback = QSyncCallback(
            mode="apply",
            output_dir=run_dir,
            memory_budget=budget,
            plan_cache=False,
            precisions=PRECISIONS,
            **CALLBACK_SCHEDULE,
        )
        accuracy["allocator"].append(train(seed, epochs, callback))
        verification = callback.verification or {}
        kept.append(
            {
                "seed": seed,
                "plan": callback.plan.precision if callback.plan is not None else {},
                "decision": verification.get("decision"),
                "predicted_peak_bytes": (verification.get("predicted") or {}).get("peak_bytes"),
                "measured_peak_bytes": (verification.get("measured") or {}).get("peak_bytes"),
            }
        )
        for entry in uniform:
            if entry["meets_budget"]:
                plan_file = out / "training_quality" / f"uniform-{entry['precision']}.json"
                entry["plan"].save(plan_file)
                name = f"uniform {entry['precision']}"
                callback = QSyncCallback(
                    mode="apply",
                    plan=plan_file,
                    plan_cache=False,
                    output_dir=out / "training_quality" / f"{name}-s{seed}".replace(" ", "-"),
                )
                accuracy.setdefault(name, []).append(train(seed, epochs, callback))
    return {
        "budget_bytes": budget,
        "recorded_peak_bytes": recorded,
        "uniform": [{k: v for k, v in e.items() if k != "plan"} for e in uniform],
        "accuracy_pct": accuracy,
        "allocator_runs": kept,
        "epochs": epochs,
    }


def _mix(precision: dict[str, str]) -> str:
    moved = [f"{name} {p}" for name, p in sorted(precision.items()) if p != FULL_PRECISION]
    return ", ".join(moved) or "all fp32 (rolled back or nothing needed)"


def markdown(result: dict[str, Any]) -> str:
    acc = result["accuracy_pct"]
    fp32 = statistics.mean(acc["fp32"])
    lines = [
        f"Budget: {result['budget_bytes'] / 2**20:.2f} MiB (recorded configuration: "
        f"{result['recorded_peak_bytes'] / 2**20:.2f} MiB predicted); {result['epochs']} epochs, "
        f"{len(acc['fp32'])} seeds.",
        "",
        "| run | test accuracy % per seed | mean | vs fp32 (points) |",
        "|---|---|---:|---:|",
    ]
    for name, values in acc.items():
        mean = statistics.mean(values)
        lines.append(
            f"| {name} | {', '.join(f'{v:.2f}' for v in values)} | {mean:.2f} | {mean - fp32:+.2f} |"
        )
    lines += ["", "| uniform precision | predicted peak MiB | meets the budget |", "|---|---:|---|"]
    for entry in result["uniform"]:
        lines.append(
            f"| {entry['precision']} | {entry['peak_bytes'] / 2**20:.2f} | "
            f"{'yes' if entry['meets_budget'] else 'no'} |"
        )
    lines += [
        "",
        "| seed | allocator's plan (kept) | decision | predicted peak MiB | measured peak MiB |",
        "|---:|---|---|---:|---:|",
    ]
    for run in result["allocator_runs"]:
        pred, meas = run["predicted_peak_bytes"], run["measured_peak_bytes"]
        lines.append(
            f"| {run['seed']} | {_mix(run['plan'])} | {run['decision']} | "
            f"{'n/a' if pred is None else f'{pred / 2**20:.2f}'} | "
            f"{'n/a' if meas is None else f'{meas / 2**20:.2f}'} |"
        )
    allocator = statistics.mean(acc["allocator"])
    fitting = [e["precision"] for e in result["uniform"] if e["meets_budget"]]
    lines.append("")
    lines.append(
        f"allocator within {TARGET_POINTS} points of fp32: "
        f"{'yes' if abs(allocator - fp32) <= TARGET_POINTS else 'no'} ({allocator - fp32:+.2f})"
    )
    if fitting:
        lowest = f"uniform {fitting[0]}"
        gap = allocator - statistics.mean(acc[lowest])
        lines.append(
            f"allocator no worse than {lowest} (the lowest uniform precision meeting the budget): "
            f"{'yes' if gap >= 0 else 'no'} ({gap:+.2f} points)"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help=f"smoke pass: 1 seed, {QUICK_EPOCHS} epochs")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs = 1, QUICK_EPOCHS
    args.out.mkdir(parents=True, exist_ok=True)
    env = bench_environment(precisions=list(PRECISIONS), quick=args.quick)
    result = measure(args.seeds, args.epochs, args.out)
    write_results(args.out, "training_quality", markdown(result), {"environment": env, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
