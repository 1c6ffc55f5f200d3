"""Planning time for a deep model: the allocator on a recorded run of ``--layers`` Linear layers.

One real Lightning run of a deep, narrow MLP (``--layers`` Linear layers of width ``--width``: a
stem, residual blocks of two Linears with a GELU between, a head; batch 64) with
``QSyncCallback(mode="apply")`` records the run and probes every layer at every precision (its
time target unbounded, so nothing is applied). Then, in this
process, the planner runs on the saved traces, timed with ``time.perf_counter``: building the
predictor (graphs and tensor lifetimes of the recorded steps), the indicator, and the greedy
allocation for speed (the default target) and for a memory budget halfway between the recorded
peak and the least any plan reaches; then, for the same budget, the activation planner (issue 13:
recompute and offload per module, every layer and block a candidate) by its MILP and by its greedy,
with the gap between their predicted step times, and all levers together (`plan_memory`); and
the compiled-regions planner (issue 14) for a run of `REGIONS_RUN_STEPS` steps, every module a
candidate, at the cost model's uncalibrated constants (nothing is compiled during this short run).
Then the same model is recorded again under DDP on 2 CPU processes (gloo; in a subprocess of this
script, ``--record-ddp``) and DDP's bucket planner (issue 14) is timed on its traces. Issues 3, 13
and 14's target: planning, after the probes, under 2 s for 200 layers.

``--quick``: a smoke pass on 20 layers. Writes ``<out>/planning_time.md`` and ``.json``.

    python benchmarks/planning_time.py [--layers 200] [--width 64] [--quick] [--out benchmarks/results]
    python benchmarks/planning_time.py --record-ddp DIR [--layers 200] [--width 64]   (one rank's part)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from runs import bench_environment, launch, stderr_tail, write_results
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback.integrations.lightning import QSyncCallback
from qsync_callback.plan import Constraints, Plan
from qsync_callback.planner.activation import exact_activation, greedy_activation
from qsync_callback.planner.compiled_regions import choose_regions
from qsync_callback.planner.ddp_buckets import choose_buckets
from qsync_callback.planner.memory_plan import plan_memory
from qsync_callback.planner.precision import allocate_precision, least_memory_plan
from qsync_callback.predictor.indicator import sensitivity
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.trace import load_trace_dir

PRECISIONS = ["fp32", "bf16", "int8"]
BATCH = 64
STEPS = 40
TARGET_S = 2.0
ACTIVATION_BUDGET = 0.85  # the activation planner's budget, a share of the recorded peak
TARGET_LAYERS = 200
ESTIMATE_TARGET_S = 10.0  # `qsync estimate` on a 200-layer model (issue 15)
REGIONS_RUN_STEPS = 20_000
QUICK_LAYERS = 20
DDP_STEPS = 30
DDP_TIMEOUT_S = 900


class ResidualPair(nn.Module):
    """``x + fc2(gelu(fc1(x)))``: what its two Linears and GELU save is the block's to drop."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class DeepMLP(pl.LightningModule):
    """``layers`` Linear layers of ``width``: a stem, residual pairs (`ResidualPair`), a head; SGD.
    Every pair is a block the activation planner may recompute or offload."""

    def __init__(self, layers: int, width: int):
        super().__init__()
        pairs = [ResidualPair(width) for _ in range((layers - 2) // 2)]
        self.net = nn.Sequential(nn.Linear(width, width), *pairs, nn.Linear(width, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def record(layers: int, width: int, out: Path) -> Path:
    """Train with the callback in mode "apply" (unbounded time target); the trace directory."""
    callback = QSyncCallback(
        mode="apply", output_dir=out, max_step_time=1e6, precisions=PRECISIONS, plan_cache=False
    )
    fit(DeepMLP(layers, width), width, callback, devices=1, steps=STEPS)
    return out / "trace"


def record_ddp(layers: int, width: int, out: Path) -> Path:
    """The same model recorded under DDP on 2 CPU processes (a subprocess of this script); the
    trace directory."""
    args = ["--record-ddp", str(out / "run"), "--layers", str(layers), "--width", str(width)]
    rc, _ = launch(Path(__file__).resolve(), args, out, DDP_TIMEOUT_S)
    if rc != 0:
        raise SystemExit(f"the DDP recording failed (exit {rc}):\n{stderr_tail(out)}")
    return out / "run" / "trace"


def fit(model: pl.LightningModule, width: int, callback: QSyncCallback, devices: int, steps: int) -> None:
    """Train ``model`` on random data with ``callback`` on ``devices`` CPU processes (DDP when 2)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(BATCH * steps, width), torch.randint(0, 10, (BATCH * steps,)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[callback],
    )
    trainer.fit(model, DataLoader(data, batch_size=BATCH))


def time_estimate(layers: int, width: int) -> dict[str, Any]:
    """``estimate`` (what ``qsync estimate`` runs) of the same model on one batch, timed: the
    symbolic trace, its ops priced (the learned model of this device, which the recording above fed,
    and the op types it never saw timed alone), the predictor."""
    from qsync_callback.estimate import estimate

    batch = torch.randn(BATCH, width), torch.randint(0, 10, (BATCH,))
    start = time.perf_counter()
    report = estimate(DeepMLP(layers, width), batch)
    return {
        "estimate_s": time.perf_counter() - start,
        "estimate_ops": report["symbolic"]["ops"],
        "estimate_durations": report["symbolic"]["durations"],
    }


def time_bucket_planning(trace_dir: Path) -> dict[str, Any]:
    """Seconds to build the predictor on the DDP traces and to choose the buckets."""
    traces = load_trace_dir(trace_dir)
    start = time.perf_counter()
    predictor = Predictor(traces)
    built = time.perf_counter()
    choice = choose_buckets(predictor)
    return {
        "ddp_predictor_s": built - start,
        "ddp_buckets_s": time.perf_counter() - built,
        "ddp_candidates": len(choice.candidates),
        "ddp_gradients": sum(len(b) for b in traces[0].communication["buckets"]),
    }


def time_planning(trace_dir: Path) -> dict[str, Any]:
    """Seconds for each planning stage on the saved traces, and plans priced."""
    traces = load_trace_dir(trace_dir)
    start = time.perf_counter()
    predictor = Predictor(traces)
    built = time.perf_counter()
    indicator = sensitivity(traces[0].layer_statistics, PRECISIONS)
    indicated = time.perf_counter()
    speed = allocate_precision(predictor, indicator, PRECISIONS)
    speed_done = time.perf_counter()
    recorded = predictor.predict().peak_bytes
    least = least_memory_plan(predictor, PRECISIONS)[1].peak_bytes
    budget_start = time.perf_counter()
    memory = allocate_precision(predictor, indicator, PRECISIONS, memory_budget=(least + recorded) // 2)
    memory_done = time.perf_counter()
    budget = int(ACTIVATION_BUDGET * recorded)
    exact = exact_activation(predictor, {}, budget)
    exact_done = time.perf_counter()
    greedy = greedy_activation(predictor, {}, budget)
    greedy_done = time.perf_counter()
    together = plan_memory(
        traces, Constraints(memory_budget=budget, precisions=tuple(PRECISIONS), best_effort=True)
    )
    together_done = time.perf_counter()
    # compiled regions for a long run (the recording was too short for any compile to pay back)
    traces[0].compiled_regions = {**traces[0].compiled_regions, "steps_left": REGIONS_RUN_STEPS}
    regions = choose_regions(predictor, Plan.empty(traces[0].fingerprint))
    regions_done = time.perf_counter()
    return {
        "regions_s": regions_done - together_done,
        "regions_candidates": regions.search.get("candidates"),
        "regions_method": regions.search.get("method"),
        "regions_chosen": len(regions.chosen) if regions.plan is not None else 0,
        "activation_budget_bytes": budget,
        "activation_options": len(exact.options),
        "activation_milp_s": exact_done - memory_done,
        "activation_milp_ms_step": exact.prediction.step_ms,
        "activation_milp_feasible": exact.feasible,
        "activation_greedy_s": greedy_done - exact_done,
        "activation_greedy_ms_step": greedy.prediction.step_ms,
        "activation_greedy_feasible": greedy.feasible,
        "memory_plan_all_levers_s": together_done - greedy_done,
        "memory_plan_all_levers_feasible": together.feasible,
        "layers_probed": len(traces[0].precision_costs.get("layers", {})),
        "ops_per_step": len(traces[0].ops) // max(len(traces[0].steps), 1),
        "predictor_s": built - start,
        "indicator_s": indicated - built,
        "speed_plan_s": speed_done - indicated,
        "speed_plans_priced": speed.plans_priced,
        "speed_layers_moved": sum(p != PRECISIONS[0] for p in speed.plan.precision.values()),
        "memory_plan_s": memory_done - budget_start,
        "memory_plans_priced": memory.plans_priced,
        "memory_feasible": memory.feasible,
        "memory_layers_moved": sum(p != PRECISIONS[0] for p in memory.plan.precision.values()),
        "recorded_peak_bytes": recorded,
        "least_peak_bytes": least,
        "one_plan_ms": 1e3 * (speed_done - indicated) / max(speed.plans_priced, 1),
        "probe_s": traces[0].precision_costs.get("probe_s"),
    }


def markdown(result: dict[str, Any]) -> str:
    planning = result["indicator_s"] + result["speed_plan_s"]
    lines = [
        "| quantity | value |",
        "|---|---:|",
        f"| Linear layers probed | {result['layers_probed']} |",
        f"| recorded ops per step | {result['ops_per_step']} |",
        f"| probes (during the run, before planning) | {result['probe_s']:.1f} s |",
        f"| predictor built (graphs, lifetimes) | {result['predictor_s']:.2f} s |",
        f"| indicator | {result['indicator_s']:.3f} s |",
        f"| greedy, speed target | {result['speed_plan_s']:.2f} s |",
        f"| plans priced for it | {result['speed_plans_priced']} |",
        f"| layers it moves off fp32 | {result['speed_layers_moved']} |",
        f"| greedy, memory budget | {result['memory_plan_s']:.2f} s |",
        f"| plans priced for it | {result['memory_plans_priced']} |",
        f"| layers it moves off fp32 | {result['memory_layers_moved']} |",
        f"| one plan priced | {result['one_plan_ms']:.1f} ms |",
        f"| activation options (module, policy) at {ACTIVATION_BUDGET:.0%} of the peak | "
        f"{result['activation_options']} |",
        f"| activation MILP | {result['activation_milp_s']:.2f} s (predicted step "
        f"{result['activation_milp_ms_step']:.2f} ms, fits: {result['activation_milp_feasible']}) |",
        f"| activation greedy | {result['activation_greedy_s']:.2f} s (predicted step "
        f"{result['activation_greedy_ms_step']:.2f} ms, fits: {result['activation_greedy_feasible']}) |",
        f"| all levers together (`plan_memory`) | {result['memory_plan_all_levers_s']:.2f} s "
        f"(fits: {result['memory_plan_all_levers_feasible']}) |",
        f"| compiled regions for a {REGIONS_RUN_STEPS}-step run ({result['regions_candidates']} candidates, "
        f"{result['regions_method']}, {result['regions_chosen']} chosen) | {result['regions_s']:.2f} s |",
        f"| DDP on 2 processes: predictor built | {result['ddp_predictor_s']:.2f} s |",
        f"| DDP buckets ({result['ddp_gradients']} gradients, {result['ddp_candidates']} candidates "
        f"priced) | {result['ddp_buckets_s']:.2f} s |",
        f"| `qsync estimate` of the same model ({result['estimate_ops']} ops traced on fake tensors, "
        f"priced, predicted) | {result['estimate_s']:.2f} s (target {ESTIMATE_TARGET_S:g} s) |",
        "",
        f"Planning for speed (predictor built, indicator, greedy): "
        f"{result['predictor_s'] + planning:.2f} s; target {TARGET_S:.0f} s for {TARGET_LAYERS} layers"
        + ("." if result["layers"] == TARGET_LAYERS else f" (this run: {result['layers']} layers)."),
    ]
    if result["least_peak_bytes"] >= result["recorded_peak_bytes"]:
        lines.append(
            "No plan lowers this model's predicted peak: the memory budget is the recorded peak "
            "itself, which the all-fp32 plan already meets."
        )
    if result["speed_layers_moved"] == 0:
        lines.append(
            "The speed plan keeps every layer at fp32: the greedy priced its moves and kept none, so "
            "this does not time a planning that moves many layers."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help=f"smoke pass: {QUICK_LAYERS} layers")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--record-ddp", type=Path, help="one DDP rank's recording into this directory")
    args = parser.parse_args(argv)
    if args.record_ddp:
        callback = QSyncCallback(mode="record", output_dir=args.record_ddp, plan_cache=False)
        fit(DeepMLP(args.layers, args.width), args.width, callback, devices=2, steps=DDP_STEPS)
        return 0
    if args.quick:
        args.layers = QUICK_LAYERS
    env = bench_environment(precisions=PRECISIONS, steps=STEPS, batch=BATCH, quick=args.quick)
    run_dir = args.out / "planning_time"
    result = {
        "layers": args.layers,
        "width": args.width,
        **time_planning(record(args.layers, args.width, run_dir)),
        **time_estimate(args.layers, args.width),
        **time_bucket_planning(record_ddp(args.layers, args.width, run_dir / "ddp")),
    }
    write_results(args.out, "planning_time", markdown(result), {"environment": env, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
