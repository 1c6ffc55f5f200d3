"""Compiled regions: the planner's region plan against eager training and the whole model under
``torch.compile``, and the fusion cost model's error on regions it was not calibrated on.

For each model (the transformer-like ones by default):

1. **record**: one run with ``QSyncCallback(mode="apply", levers=("regions",))`` for a nominal
   ``--run-steps``-step run (stopped once the window closed): the traces, with the modules compiled
   during the warm-up to calibrate on (`recorder/region_probes.py`). From them, offline,
   `planner.compiled_regions.choose_regions` picks the regions (timed: the planning seconds), and
   both searches run on the same candidates where the exhaustive one can (the MCMC's gap to it).
2. **timing**, in fresh processes, in turns, ``--repeats`` times each, with a fresh inductor cache
   each (a cold compile): eager; the region plan (`appliers/torch_regions.py`, applied before the
   fit); the whole model (``trainer.fit(torch.compile(model))``, Lightning's way). The step time
   is the median of the steps after the first ``SKIP_STEPS``; the compile time, the first two steps'
   time beyond two median steps. Then the region plan once more on the cache of its last run: the
   next launch of a kept plan (inductor's FX graph cache).
3. **cost model**: the chosen regions and the best other candidates that were not compiled during
   the warm-up, each compiled alone (as the warm-up compiles, on the arguments of its first call):
   measured compiled/eager ratio against the model's.

The table gives per model: each configuration's step time (runs, spread), compile time, the region
plan's predicted step time and its error, and the cost model's per-region errors.

    python benchmarks/compiled_regions.py [--models attention,transformer] [--repeats 2] [--quick]
        [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from models import get_model, timed_fit
from runs import bench_environment, launch, na, range_noise_pct, say_allocator, stderr_tail, write_results

from qsync_callback.plan import Plan
from qsync_callback.planner.compiled_regions import RegionSearch, choose_regions
from qsync_callback.predictor.compiled_regions import price_region
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.torch_recorder import window_close_step
from qsync_callback.recorder.trace import load_trace_dir

WARMUP_STEPS, PROFILE_STEPS, MEASURE_STEPS = 10, 5, 10
RUN_STEPS = 20_000  # the nominal length of the run the plan is made for
TIME_STEPS, SKIP_STEPS = 40, 8
MAX_CHECKED = 4  # regions compiled alone to check the cost model on, per model
CONFIGS = ("eager", "regions", "whole model")


class StopAt(pl.Callback):
    """Ends the fit after ``steps``; the trainer's ``max_steps`` stays the nominal run length."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def record_worker(model: str, run_dir: Path) -> None:
    from qsync_callback.integrations.lightning import QSyncCallback

    callback = QSyncCallback(
        mode="apply",
        warmup_steps=WARMUP_STEPS,
        profile_steps=PROFILE_STEPS,
        measure_steps=MEASURE_STEPS,
        output_dir=run_dir,
        levers=("regions",),
        plan_cache=False,
    )
    stop = window_close_step(WARMUP_STEPS, PROFILE_STEPS) + MEASURE_STEPS + 1
    spec = get_model(model)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=RUN_STEPS,
        callbacks=[callback, StopAt(stop)],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(spec.build(), spec.dataloader(stop + 2))


def time_worker(model: str, config: str, plan: Path | None, run_dir: Path) -> None:
    """One timed fit of ``config``; writes the step times (ms) and what the regions compiled."""
    from qsync_callback.appliers.torch_regions import RegionApplier

    applier: RegionApplier | None = None

    def prepare(module: pl.LightningModule) -> pl.LightningModule:
        nonlocal applier
        if config == "regions":
            applier = RegionApplier(module)
            applier(Plan.load(plan))
        return torch.compile(module) if config == "whole model" else module

    _, timer, _, _ = timed_fit(get_model(model), TIME_STEPS + 1, prepare=prepare)
    stats = applier.region_stats() if applier is not None else {}
    (run_dir / "steps.json").write_text(json.dumps({"step_ms": timer.step_ms, "regions": stats}))


def probe_worker(model: str, modules: list[str], run_dir: Path) -> None:
    """Each module compiled alone on the arguments of its first call, as the warm-up compiles."""
    from qsync_callback.recorder.region_probes import RegionInputs, probe_regions

    spec = get_model(model)
    module = spec.build()
    inputs = RegionInputs(module, modules)
    batch = next(iter(spec.dataloader(1)))
    module.training_step(batch, 0).backward()
    inputs.remove()
    (run_dir / "probes.json").write_text(json.dumps(probe_regions(module, inputs.inputs)))


def run_worker(script: Path, args: list[str], run_dir: Path, timeout: float, cache: Path) -> Path | None:
    """A worker run with ``cache`` as inductor's cache directory; its directory, or None if it failed."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    rc, _ = launch(script, [*args, "--worker-dir", str(run_dir)], run_dir, timeout)
    if rc != 0:
        print(f"[benchmark] {run_dir.name} FAILED (exit {rc}):\n{stderr_tail(run_dir)}", file=sys.stderr)
        return None
    return run_dir


def step_figures(step_ms: list[float]) -> tuple[float, float]:
    """The median step after `SKIP_STEPS`, and the first two steps' time beyond two median steps (s)."""
    median = statistics.median(step_ms[SKIP_STEPS:])
    return median, max(sum(step_ms[:2]) - 2 * median, 0.0) / 1e3


def bench_model(model: str, repeats: int, out: Path, timeout: float) -> dict[str, Any]:
    script = Path(__file__).resolve()
    runs = out / "runs"
    caches = Path(tempfile.mkdtemp(prefix="qsync-inductor-"))
    record_args = ["--worker", "record", model]
    record = run_worker(script, record_args, runs / f"{model}-record", timeout, caches / "record")
    if record is None:
        return {"model": model, "failed": "the recording"}
    traces = load_trace_dir(record / "trace")
    predictor = Predictor(traces)
    start = time.perf_counter()
    choice = choose_regions(predictor, Plan.empty(traces[0].fingerprint))
    planning_s = time.perf_counter() - start
    graph = predictor.graphs[predictor.typical_step]
    search = RegionSearch(graph, predictor.fusion_costs, choice.steps_left or RUN_STEPS)
    plan = choice.plan or Plan(fingerprint=traces[0].fingerprint)
    plan_path = runs / f"{model}-plan.json"
    plan_path.write_text(json.dumps(plan.to_dict()))
    measured: dict[str, list[float]] = {c: [] for c in CONFIGS}
    compile_s: dict[str, list[float]] = {c: [] for c in CONFIGS}
    last_cache: Path | None = None
    for r in range(repeats):
        for config in CONFIGS:
            if config == "regions" and not plan.fused_regions:
                continue
            cache = caches / f"{config.replace(' ', '-')}-{r}"
            args = ["--worker", "time", model, "--config", config, "--plan", str(plan_path)]
            done = run_worker(script, args, runs / f"{model}-{config.replace(' ', '-')}-{r}", timeout, cache)
            if done is not None:
                median, compiled = step_figures(json.loads((done / "steps.json").read_text())["step_ms"])
                measured[config].append(median)
                compile_s[config].append(compiled)
                if config == "regions":
                    last_cache = cache
    warm_compile_s = None
    if last_cache is not None:
        args = ["--worker", "time", model, "--config", "regions", "--plan", str(plan_path)]
        done = run_worker(script, args, runs / f"{model}-regions-next-launch", timeout, last_cache)
        if done is not None:
            warm_compile_s = step_figures(json.loads((done / "steps.json").read_text())["step_ms"])[1]
    probed = set(traces[0].compiled_regions.get("probes", {}))
    chosen = [r.module for r in choice.chosen] if choice.plan is not None else []
    others = sorted(search.regions.values(), key=lambda c: -c.saving_us)
    check = [m for m in [*chosen, *(c.module for c in others)] if m not in probed]
    check = list(dict.fromkeys(check))[:MAX_CHECKED]
    model_errors: dict[str, float] = {}
    if check:
        args = ["--worker", "probe", model, "--modules", ",".join(check)]
        done = run_worker(script, args, runs / f"{model}-probe", timeout, caches / "probe")
        if done is not None:
            for module, probe in json.loads((done / "probes.json").read_text()).items():
                cost = price_region(graph, module, predictor.fusion_costs)
                if cost is not None and probe.get("compiled_us") and probe.get("graphs") == 1:
                    predicted = cost.compiled_us / cost.eager_us
                    model_errors[module] = 100 * (predicted / (probe["compiled_us"] / probe["eager_us"]) - 1)
    exhaustive = search.exhaustive() if len(search.names) <= 14 else None
    mcmc = search.mcmc()
    medians = {c: statistics.median(v) if v else None for c, v in measured.items()}
    predicted = choice.prediction.step_ms if choice.plan is not None else choice.base.step_ms
    regions_ms = medians["regions"] if plan.fused_regions else medians["eager"]
    return {
        "model": model,
        "chosen": chosen,
        "predicted_ms": predicted,
        "predicted_base_ms": choice.base.step_ms,
        "predicted_compile_s": choice.compile_s,
        "measured_ms": measured,
        "median_ms": medians,
        "noise_pct": {c: range_noise_pct(v) for c, v in measured.items()},
        "compile_s": {c: statistics.median(v) if v else None for c, v in compile_s.items()},
        "next_launch_compile_s": warm_compile_s,
        "error_pct": 100 * (predicted / regions_ms - 1) if regions_ms else None,
        "planning_s": planning_s,
        "candidates": len(search.names),
        "search": choice.search,
        "exhaustive_value_s": exhaustive[1] if exhaustive else None,
        "mcmc_value_s": mcmc[1],
        "calibration": predictor.fusion_costs.to_dict(),
        "calibration_errors_pct": choice.probe_errors,
        "uncalibrated_errors_pct": model_errors,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | regions chosen | eager ms | regions ms (predicted, error) | whole-model ms | "
        "compile s: regions (predicted) / next launch / whole model | noise | planning s | "
        "MCMC vs exhaustive | cost model error: calibrated on / not |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        if "failed" in row:
            lines.append(f"| {row['model']} | failed: {row['failed']} | | | | | | | | |")
            continue
        med, comp, noise = row["median_ms"], row["compile_s"], row["noise_pct"]
        chosen = ", ".join(row["chosen"][:4]) + (" ..." if len(row["chosen"]) > 4 else "") or "none"
        gap = (
            f"{row['mcmc_value_s']:.1f} / {row['exhaustive_value_s']:.1f} s"
            if row["exhaustive_value_s"] is not None
            else f"MCMC only ({row['candidates']} candidates)"
        )
        noises = "/".join(na(noise[c], ".1f") for c in CONFIGS)
        calibrated = ", ".join(f"{m}: {e:+.0f}%" for m, e in row["calibration_errors_pct"].items())
        uncalibrated = ", ".join(f"{m}: {e:+.0f}%" for m, e in row["uncalibrated_errors_pct"].items())
        lines.append(
            f"| {row['model']} | {chosen} | {na(med['eager'], '.1f')} | {na(med['regions'], '.1f')} "
            f"({row['predicted_ms']:.1f}, {na(row['error_pct'], '+.1f')}%) | "
            f"{na(med['whole model'], '.1f')} | "
            f"{na(comp['regions'], '.1f')} ({row['predicted_compile_s']:.1f}) / "
            f"{na(row['next_launch_compile_s'], '.1f')} / {na(comp['whole model'], '.1f')} | {noises}% | "
            f"{row['planning_s']:.2f} | {gap} | {calibrated or '-'} / {uncalibrated or '-'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="attention,transformer")
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration")
    parser.add_argument("--quick", action="store_true", help="smoke run: attention, 1 run each")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--modules", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, model = args.worker
        if kind == "record":
            record_worker(model, args.worker_dir)
        elif kind == "time":
            time_worker(model, args.config, args.plan, args.worker_dir)
        else:
            probe_worker(model, args.modules.split(","), args.worker_dir)
        return 0
    say_allocator()
    models, repeats = (["attention"], 1) if args.quick else (args.models.split(","), args.repeats)
    environment = bench_environment(repeats=repeats, run_steps=RUN_STEPS)
    rows = [bench_model(model, repeats, args.out, args.timeout) for model in models]
    write_results(args.out, "compiled_regions", table(rows), {"environment": environment, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
