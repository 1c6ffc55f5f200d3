"""Compiled regions: the planner's region plan against eager training and the whole model under
``torch.compile``, and the fusion cost model's error on regions it was not calibrated on.

For each model (the transformer-like ones by default):

1. **record**: one run with ``QSyncCallback(mode="apply", levers=("regions",))`` for a nominal
   ``--run-steps``-step run (stopped once the window closed): the traces, with the modules compiled
   during the warm-up to calibrate on (`recorder/region_probes.py`). From them, offline,
   `planner.compiled_regions.choose_regions` picks the regions (timed: the planning seconds), and
   both searches run on the same candidates where the exhaustive one can (the MCMC's gap to it).
   Beside the chosen plan (which may be none), a plan the planner did not choose is priced too:
   every copy of the repeated block compiled ("blocks"; where no block repeats alike, the largest
   block, which the warm-up compiled instead; not run where it is the chosen plan), so that the
   predictor's error on a region plan is measured whatever the planner decides. And the chosen
   plan with glibc malloc's thresholds fixed on top ("allocator": the thresholds
   `planner.malloc_thresholds` prices, run whether or not it would fix them; the table says which),
   since the whole model compiled can owe its speed to the page faults it no longer takes.
2. **timing**, in fresh processes, in turns, ``--repeats`` times each, with a fresh inductor cache
   each (a cold compile): eager; the chosen region plan and the blocks plan
   (`appliers/torch_regions.py`, applied before the fit); the whole model
   (``trainer.fit(torch.compile(model))``, Lightning's way). The step time
   is the median of the steps after the first ``SKIP_STEPS``; the compile time, the first two steps'
   time beyond two median steps. Then the region plan once more on the cache of its last run: the
   next launch of a kept plan (inductor's FX graph cache).
3. **in turns**, in ``--turn-repeats`` fresh processes (`plan_turns.py`, as the other plan
   benchmarks measure their plans): the chosen plan, the blocks plan, the allocator plan (undone to
   the thresholds the recording's steps ran under, as the loop's undo does) and the whole model compiled
   (Lightning's ``from_compiled``, the anchor), each applied and undone in turns with eager at step
   boundaries, ``--turn-rounds`` rounds (a region, or the whole model, compiled in its first block,
   in a step not timed). A plan's measured change is the mean over the processes of
   its rounds' mean change, with its noise (`alternation.paired_change`'s 95% band, combined over
   the processes); its error in turns sets the predicted change (the plan's predicted step over
   eager's) against the measured one; the chosen plan against the whole model is the ratio of their
   steps, each referred to eager's in the same rounds (`against_whole_model`), and so is the
   allocator plan. Separate processes
   differ by more than many plans change; in turns the drift between processes and over minutes
   cancels, as in the loop's verify.
4. **cost model**: the chosen regions and the best other candidates that were not compiled during
   the warm-up (the planner's left-out ones among them: saving within the model's error on the
   warm-up's probes), each compiled alone (as the warm-up compiles, on the arguments of its first call):
   measured compiled/eager ratio against the model's.

With ``--procs 2`` (in the default ``1,2``), each model is also recorded under Lightning DDP on two
processes (gloo), planned on both ranks' traces, and its plans run in turns under DDP (each rank
applies and undoes them at the same steps; rank 0's clock, which DDP's all-reduces keep in step
with rank 1's): steps 1, 3 and the planner's figures, not the fresh-process timings or the cost
model's check, which are the machine's, not DDP's.

The table gives per model: each configuration's step time (runs, spread), its page faults a step
(each run's median over the steps timed: glibc's malloc gives fresh pages to a process whose
thresholds let it hand memory back, and the step pays for each), compile time, the region plan's
predicted step time and its error, and the cost model's per-region errors; in turns, each
configuration's page faults a step in its blocks beside the change.

    python benchmarks/compiled_regions.py [--models attention,transformer] [--repeats 2] [--procs 1,2]
        [--turn-rounds 12] [--turn-repeats 2] [--quick] [--out benchmarks/results] [--resume]
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
from plan_turns import (
    WHOLE_MODEL,
    in_turns_change,
    measure_in_turns,
    page_faults_cell,
    turns_cell,
    turns_worker,
)
from runs import bench_environment, launch, na, range_noise_pct, say_allocator, stderr_tail, write_results

from qsync_callback.malloc_thresholds import recorded_thresholds
from qsync_callback.mean_band import combined_noise_pct
from qsync_callback.plan import Plan
from qsync_callback.planner.compiled_regions import RegionSearch, choose_regions
from qsync_callback.planner.malloc_thresholds import choose_malloc_thresholds
from qsync_callback.predictor.compiled_regions import (
    forward_owners,
    price_region,
    region_candidates,
    region_signature,
)
from qsync_callback.predictor.malloc_thresholds import faults_per_step, malloc_problem
from qsync_callback.predictor.predict import Predictor
from qsync_callback.recorder.torch_recorder import window_close_step
from qsync_callback.recorder.trace import load_trace_dir

WARMUP_STEPS, PROFILE_STEPS, MEASURE_STEPS = 10, 5, 10
RUN_STEPS = 20_000  # the nominal length of the run the plan is made for
TIME_STEPS, SKIP_STEPS = 40, 8
MAX_CHECKED = 4  # regions compiled alone to check the cost model on, per model
CONFIGS = ("eager", "regions", "blocks", WHOLE_MODEL)
TURN_ROUNDS, TURN_REPEATS = 12, 2


class StopAt(pl.Callback):
    """Ends the fit after ``steps``; the trainer's ``max_steps`` stays the nominal run length."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def record_worker(model: str, run_dir: Path, procs: int = 1) -> None:
    """The recording (step 1 of the module docstring), under DDP on ``procs`` > 1 processes."""
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
        devices=procs,
        strategy="ddp" if procs > 1 else "auto",
        max_steps=RUN_STEPS,
        callbacks=[callback, StopAt(stop)],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(spec.build(), spec.dataloader((stop + 2) * procs))


def time_worker(model: str, config: str, plan: Path | None, run_dir: Path) -> None:
    """One timed fit of ``config``; writes the step times (ms) and what the regions compiled."""
    from qsync_callback.appliers.torch_regions import RegionApplier

    applier: RegionApplier | None = None

    def prepare(module: pl.LightningModule) -> pl.LightningModule:
        nonlocal applier
        if config in ("regions", "blocks"):
            applier = RegionApplier(module)
            applier(Plan.load(plan))
        return torch.compile(module) if config == WHOLE_MODEL else module

    _, timer, _, _ = timed_fit(get_model(model), TIME_STEPS + 1, prepare=prepare)
    stats = applier.region_stats() if applier is not None else {}
    steps = {"step_ms": timer.step_ms, "page_faults": timer.page_faults, "regions": stats}
    (run_dir / "steps.json").write_text(json.dumps(steps))


def probe_worker(model: str, modules: list[str], run_dir: Path) -> None:
    """Each module compiled alone on the arguments of its first call, as the warm-up compiles."""
    from qsync_callback.recorder.region_probes import RegionInputs, probe_regions

    spec = get_model(model)
    module = spec.build()
    inputs = RegionInputs(module, [[name] for name in modules])
    batch = next(iter(spec.dataloader(1)))
    module.training_step(batch, 0).backward()
    inputs.remove()
    (run_dir / "probes.json").write_text(json.dumps(probe_regions(module, inputs.inputs)))


RESUME = False  # `--resume`: a run whose directory holds its output already is not run again
OUTPUTS = ("trace", "steps.json", "probes.json")  # what a worker leaves


def run_worker(script: Path, args: list[str], run_dir: Path, timeout: float, cache: Path) -> Path | None:
    """A worker run with ``cache`` as inductor's cache directory; its directory, or None if it failed."""
    if RESUME and any((run_dir / name).exists() for name in OUTPUTS):
        return run_dir
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    rc, _ = launch(script, [*args, "--worker-dir", str(run_dir)], run_dir, timeout)
    if rc != 0:
        print(f"[benchmark] {run_dir.name} FAILED (exit {rc}):\n{stderr_tail(run_dir)}", file=sys.stderr)
        return None
    return run_dir


def repeated_blocks(trace: Any, graph: Any) -> list[str]:
    """Every module with the recorded ops and shapes of the first one compiled during the warm-up
    (the model's most repeated block; where none repeats alike, its largest block), or none."""
    probes = list(trace.compiled_regions.get("probes", {}))
    if not probes:
        return []
    owners = region_candidates(forward_owners(graph), trace.compiled_regions.get("called_blocks"))
    first = region_signature(graph, probes[0])
    return [m for m in owners if region_signature(graph, m) == first]


def step_figures(step_ms: list[float]) -> tuple[float, float]:
    """The median step after `SKIP_STEPS`, and the first two steps' time beyond two median steps (s)."""
    median = statistics.median(step_ms[SKIP_STEPS:])
    return median, max(sum(step_ms[:2]) - 2 * median, 0.0) / 1e3


def bench_model(
    model: str, repeats: int, out: Path, timeout: float, turn_rounds: int, turn_repeats: int, procs: int = 1
) -> dict[str, Any]:
    """Steps 1-4 of the module docstring for ``model`` on one process; on ``procs`` > 1 (DDP), the
    recording, the plans and their turns only (steps 2 and 4 are the machine's, not DDP's)."""
    script = Path(__file__).resolve()
    runs = out / "runs"
    label = model if procs == 1 else f"{model}-p{procs}"
    caches = Path(tempfile.mkdtemp(prefix="qsync-inductor-"))
    record_args = ["--worker", model, "--worker-mode", "record", "--worker-procs", str(procs)]
    record = run_worker(script, record_args, runs / f"{label}-record", timeout, caches / "record")
    if record is None:
        return {"model": model, "procs": procs, "failed": "the recording"}
    traces = load_trace_dir(record / "trace")
    predictor = Predictor(traces)
    start = time.perf_counter()
    choice = choose_regions(predictor, Plan.empty(traces[0].fingerprint))
    planning_s = time.perf_counter() - start
    graph = predictor.graphs[predictor.typical_step]
    search = RegionSearch(
        graph, predictor.fusion_costs, choice.steps_left or RUN_STEPS, optimism=choice.optimism
    )
    plan = choice.plan or Plan(fingerprint=traces[0].fingerprint)
    blocks = Plan(
        fingerprint=traces[0].fingerprint, fused_regions=[[m] for m in repeated_blocks(traces[0], graph)]
    )
    if blocks.fused_regions == plan.fused_regions:  # the chosen plan: not run twice
        blocks = Plan(fingerprint=traces[0].fingerprint)
    plans = {"regions": plan, "blocks": blocks}
    malloc = choose_malloc_thresholds(predictor, plan) if malloc_problem(traces) is None else None
    if malloc is not None:
        plans["allocator"] = Plan.from_dict({**plan.to_dict(), "malloc_thresholds": malloc.thresholds})
    paths = {name: runs / f"{label}-{name}.json" for name in plans}
    for name, path in paths.items():
        path.write_text(json.dumps(plans[name].to_dict()))
    predicted = {
        "eager": choice.base.step_ms,
        "regions": choice.prediction.step_ms if choice.plan is not None else choice.base.step_ms,
        "blocks": predictor.predict(blocks).step_ms if blocks.fused_regions else None,
        "allocator": malloc.prediction.step_ms if malloc is not None else None,
    }
    measured: dict[str, list[float]] = {c: [] for c in CONFIGS}
    # per run: its median page faults a step (None: a run of an --out from before they were counted)
    faults: dict[str, list[float | None]] = {c: [] for c in CONFIGS}
    compile_s: dict[str, list[float]] = {c: [] for c in CONFIGS}
    last_cache: Path | None = None
    for r in range(repeats if procs == 1 else 0):
        for config in CONFIGS:
            if config in plans and not plans[config].fused_regions:
                continue
            cache = caches / f"{config.replace(' ', '-')}-{r}"
            args = ["--worker", model, "--worker-mode", "time", "--config", config]
            args += ["--plan", str(paths.get(config, ""))]
            done = run_worker(script, args, runs / f"{model}-{config.replace(' ', '-')}-{r}", timeout, cache)
            if done is not None:
                steps = json.loads((done / "steps.json").read_text())
                median, compiled = step_figures(steps["step_ms"])
                measured[config].append(median)
                counted = steps.get("page_faults")
                faults[config].append(statistics.median(counted[SKIP_STEPS:]) if counted else None)
                compile_s[config].append(compiled)
                if config == "regions":
                    last_cache = cache
    turned: dict[str, Path | str] = {name: paths[name] for name in plans if not plans[name].is_empty}
    turns: dict[str, Any] = {
        name: {"predicted_change_pct": 100 * (predicted[name] / predicted["eager"] - 1), "in_turns": []}
        for name in turned
    }
    turned[WHOLE_MODEL] = WHOLE_MODEL  # the anchor, in the same rounds: not priced by the predictor
    turns[WHOLE_MODEL] = {"predicted_change_pct": None, "in_turns": []}
    for k in range(turn_repeats):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(caches / f"turns-{k}")
        measured_turns = measure_in_turns(
            script,
            model,
            turned,
            runs / f"{label}-turns-r{k}",
            timeout,
            turn_rounds,
            procs,
            [recorded_thresholds(trace) for trace in traces],
        )
        for name, change in measured_turns.items():
            turns[name]["in_turns"].append(change)
    warm_compile_s = None
    if last_cache is not None:
        args = [
            "--worker",
            model,
            "--worker-mode",
            "time",
            "--config",
            "regions",
            "--plan",
            str(paths["regions"]),
        ]
        done = run_worker(script, args, runs / f"{model}-regions-next-launch", timeout, last_cache)
        if done is not None:
            warm_compile_s = step_figures(json.loads((done / "steps.json").read_text())["step_ms"])[1]
    probed = set(traces[0].compiled_regions.get("probes", {}))
    chosen = [r.module for r in choice.chosen] if choice.plan is not None else []
    others = sorted([*search.regions.values(), *search.doubtful], key=lambda c: -c.saving_us)
    check = [m for m in [*chosen, *(c.module for c in others)] if m not in probed]
    check = list(dict.fromkeys(check))[:MAX_CHECKED] if procs == 1 else []
    model_errors: dict[str, float] = {}
    if check:
        args = ["--worker", model, "--worker-mode", "probe", "--modules", ",".join(check)]
        done = run_worker(script, args, runs / f"{model}-probe", timeout, caches / "probe")
        if done is not None:
            for module, probe in json.loads((done / "probes.json").read_text()).items():
                cost = price_region(graph, module, predictor.fusion_costs, {})  # the model alone
                if cost is not None and probe.get("compiled_us") and probe.get("graphs") == 1:
                    ratio = cost.compiled_us / cost.eager_us
                    model_errors[module] = 100 * (ratio / (probe["compiled_us"] / probe["eager_us"]) - 1)
    exhaustive = search.exhaustive() if len(search.names) <= 14 else None
    mcmc = search.mcmc()
    medians = {c: statistics.median(v) if v else None for c, v in measured.items()}
    if not plan.fused_regions:
        medians["regions"] = medians["eager"]
    errors = {
        c: 100 * (predicted[c] / medians[c] - 1) if predicted.get(c) and medians.get(c) else None
        for c in ("eager", "regions", "blocks")
    }
    return {
        "model": model,
        "procs": procs,
        "chosen": chosen,
        "blocks": [r[0] for r in blocks.fused_regions],
        "allocator": {
            "chosen": malloc is not None and malloc.plan is not None,
            "thresholds": malloc.thresholds if malloc is not None else None,
            "faults_per_step": [faults_per_step(t) for t in traces] if malloc is not None else None,
            "fresh_page_us": [t.measured["malloc"]["fresh_page_us"] for t in traces] if malloc else None,
        },
        "predicted_ms": predicted,
        "error_pct": errors,
        "predicted_compile_s": choice.compile_s,
        "measured_ms": measured,
        "median_ms": medians,
        "noise_pct": {c: range_noise_pct(v) for c, v in measured.items()},
        "page_faults": faults,
        "turns": turns,
        "turn_rounds": turn_rounds,
        "compile_s": {c: statistics.median(v) if v else None for c, v in compile_s.items()},
        "next_launch_compile_s": warm_compile_s,
        "planning_s": planning_s,
        "candidates": len(search.names),
        "search": choice.search,
        "exhaustive_value_s": exhaustive[1] if exhaustive else None,
        "mcmc_value_s": mcmc[1],
        "calibration": predictor.fusion_costs.to_dict(),
        "calibration_errors_pct": choice.probe_errors,
        "optimism": choice.optimism,
        "left_out": [r.module for r in choice.doubtful],
        "uncalibrated_errors_pct": model_errors,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """Per model and configuration: measured step time (runs), spread, compile time, predicted step
    time and its error (predicted less measured); and per model the planner's figures."""
    lines = [
        "| model | configuration | measured ms (runs) | noise | page faults a step (runs) "
        "| compile s (predicted) | predicted ms | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for row in rows:
        if "failed" in row:
            lines.append(f"| {_label(row)} | failed: {row['failed']} | | | | | | |")
            continue
        for config in CONFIGS if row["procs"] == 1 else ():  # DDP's plans: in turns only
            runs = row["measured_ms"][config]
            if not runs and config != "regions":
                continue
            label = {
                "regions": f"chosen regions: {', '.join(row['chosen'][:4]) or 'none (eager)'}",
                "blocks": f"blocks: {', '.join(row['blocks'][:2])}"
                + (", ..." if len(row["blocks"]) > 2 else ""),
            }.get(config, config)
            predicted = row["predicted_ms"].get(config)
            compiled = row["compile_s"][config]
            if config == "regions" and row["chosen"]:
                compiled_text = f"{na(compiled, '.1f')} ({row['predicted_compile_s']:.1f})"
            else:
                compiled_text = na(compiled, ".1f")
            listed = ", ".join(f"{m:.1f}" for m in runs) or "as eager"
            counted = ", ".join(na(f, ".0f") for f in row.get("page_faults", {}).get(config, [])) or "-"
            lines.append(
                f"| {row['model']} | {label} | {na(row['median_ms'][config], '.1f')} ({listed}) | "
                f"{na(row['noise_pct'][config], '.1f')}% | {counted} | {compiled_text} | "
                f"{na(predicted, '.1f')} | {na(row['error_pct'].get(config), '+.1f')}% |"
            )
        gap = (
            f"MCMC {row['mcmc_value_s']:.1f} s against exhaustive {row['exhaustive_value_s']:.1f} s"
            if row["exhaustive_value_s"] is not None
            else f"MCMC only ({row['candidates']} candidates)"
        )
        calibrated = ", ".join(f"{m} {e:+.0f}%" for m, e in row["calibration_errors_pct"].items()) or "-"
        uncalibrated = ", ".join(f"{m} {e:+.0f}%" for m, e in row["uncalibrated_errors_pct"].items()) or "-"
        left_out = row.get("left_out") or []
        doubted = (
            f"; left out, their saving within the model's error (a probe {100 * row['optimism']:.0f}% over "
            f"its price): {', '.join(left_out[:4])}" + (", ..." if len(left_out) > 4 else "")
            if left_out
            else ""
        )
        notes.append(
            f"- {_label(row)}: planning {row['planning_s']:.2f} s over {row['candidates']} candidates "
            f"({gap}); chose {', '.join(row['chosen'][:4]) or 'none (eager)'}; next launch of the plan "
            f"compiles in {na(row['next_launch_compile_s'], '.1f')} s{doubted}; "
            f"cost model error on the modules compiled during the warm-up: {calibrated}; on others: "
            f"{uncalibrated}."
        )
    turns = [
        "| model | plan | processes x rounds | change in turns (predicted / measured +- noise) | "
        "error in turns | within noise | page faults a step in turns (eager / plan) |",
        "|---|---|---:|---|---:|---|---:|",
    ]
    errors, within, anchors = [], 0, []
    for row in rows:
        for name in ("regions", "blocks", "allocator", WHOLE_MODEL):
            figures = row.get("turns", {}).get(name)
            if figures is None:
                continue
            label = allocator_label(row) if name == "allocator" else name
            cell, error = turns_cell(figures)
            measured = in_turns_change(figures)
            told = "n/a"
            if error is not None and measured is not None:
                errors.append(abs(error))
                told = "yes" if abs(figures["predicted_change_pct"] - measured[0]) <= measured[1] else "no"
                within += told == "yes"
            turns.append(
                f"| {_label(row)} | {label} | {len(figures['in_turns'])} x {row['turn_rounds']} | {cell} | "
                f"{na(error, '+.1f')}% | {told} | {page_faults_cell(figures)} |"
            )
        for name in ("regions", "allocator"):
            anchor = against_whole_model(row, name)
            if anchor is not None:
                anchors.append(f"- {_label(row)}: {anchor}")
    if errors:
        turns.append(
            f"\nMedian |error in turns| over the plans: {statistics.median(errors):.1f}%; predicted change "
            f"within the measured one's noise: {within} of {len(errors)}."
        )
    if anchors:
        turns += ["", "The chosen plan against the whole model compiled, in the same rounds:", *anchors]
    return "\n".join([*lines, "", *notes, "", *turns])


def allocator_label(row: dict[str, Any]) -> str:
    """The allocator plan's name in the tables: what it fixes on top of the chosen regions, and
    whether the planner would fix it."""
    allocator = row.get("allocator") or {}
    regions = ", ".join(row["chosen"][:2]) or "eager"
    faults = ", ".join(f"{f:,.0f}" for f in allocator.get("faults_per_step") or [])
    chosen = "chosen" if allocator.get("chosen") else "not chosen"
    return f"{regions} + malloc thresholds fixed ({chosen}; recorded {faults} faults a step)"


def against_whole_model(row: dict[str, Any], name: str = "regions") -> str | None:
    """Plan ``name``'s step ("regions": the chosen plan; "allocator": it with malloc's thresholds
    fixed) against the whole model compiled, both measured in turns with eager in the same rounds:
    the ratio of their steps, each referred to eager's (the chosen plan is eager itself where it
    compiles nothing), with their noises combined; and their compile times from the fresh runs where
    those ran. None where the turns did not time both."""
    turns = row.get("turns", {})
    whole = in_turns_change(turns.get(WHOLE_MODEL, {}))
    if whole is None or (name == "allocator" and name not in turns):
        return None
    chosen = in_turns_change(turns[name]) if name in turns else (0.0, 0.0)
    if chosen is None:
        return None
    change = 100 * ((100 + chosen[0]) / (100 + whole[0]) - 1)
    what = ", ".join(row["chosen"][:4]) or "none (eager)"
    if name == "allocator":
        what = allocator_label(row)
    compiled = row["compile_s"]
    compile_text = (
        f"; compile {na(compiled['regions'] if row['chosen'] else 0.0, '.1f')} s against "
        f"{na(compiled[WHOLE_MODEL], '.1f')} s (fresh runs)"
        if row["procs"] == 1
        else ""
    )
    return (
        f"chosen {what}: {change:+.1f}% (+-{combined_noise_pct(chosen[1], whole[1]):.1f}) against the whole "
        f"model compiled ({whole[0]:+.1f}% against eager){compile_text}"
    )


def _label(row: dict[str, Any]) -> str:
    """A row's model, and its processes where it ran under DDP."""
    return row["model"] if row["procs"] == 1 else f"{row['model']} (DDP, {row['procs']} processes)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="attention,transformer")
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration")
    parser.add_argument("--procs", default="1,2", help="process counts (2: DDP, in turns only)")
    parser.add_argument("--turn-rounds", type=int, default=TURN_ROUNDS, help="rounds in turns per process")
    parser.add_argument("--turn-repeats", type=int, default=TURN_REPEATS, help="processes in turns")
    parser.add_argument("--quick", action="store_true", help="smoke run: attention, 1 run each")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--resume", action="store_true", help="reuse the runs already done in --out")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-mode", help=argparse.SUPPRESS)
    parser.add_argument("--worker-plan", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-procs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--plan", type=Path, nargs=1, help=argparse.SUPPRESS)
    parser.add_argument("--modules", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        model, kind = args.worker, args.worker_mode
        if kind == "record":
            record_worker(model, args.worker_dir, args.worker_procs)
        elif kind == "time":
            time_worker(model, args.config, args.plan[0] if args.plan else None, args.worker_dir)
        elif kind == "turns":
            turns_worker(model, args.worker_dir, args.worker_plan)
        else:
            probe_worker(model, args.modules.split(","), args.worker_dir)
        return 0
    global RESUME
    RESUME = args.resume
    say_allocator()
    models, repeats = (["attention"], 1) if args.quick else (args.models.split(","), args.repeats)
    rounds, turn_repeats = (2, 1) if args.quick else (args.turn_rounds, args.turn_repeats)
    procs_list = [int(p) for p in args.procs.split(",")]
    environment = bench_environment(
        repeats=repeats, run_steps=RUN_STEPS, turn_rounds=rounds, turn_repeats=turn_repeats, procs=procs_list
    )
    rows = [
        bench_model(model, repeats, args.out, args.timeout, rounds, turn_repeats, procs)
        for procs in procs_list
        for model in models
    ]
    write_results(args.out, "compiled_regions", table(rows), {"environment": environment, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
