"""Does QSync's precision-sensitivity indicator rank the layers as training does?

For each model and seed: one all-fp32 run of ``--steps`` SGD steps on fixed synthetic batches, with
`LayerStatistics` on over its first ``--warmup`` steps; the indicator (``predictor/indicator.py``)
for every (layer, low precision). Then, for every (layer, precision) this CPU runs, the same run from
the same initial weights on the same batches with only that layer swapped to that precision
(``swap_to_lp`` + ``set_precision``). The measured deviation is the mean over the steps of
|loss - fp32 loss| (the loss taken in fp64 from the fp32 logits, so that differences below fp32's
resolution show). A run with the layer swapped at fp32 must reproduce the fp32 losses bit for bit
(checked). The script reports Spearman's rank correlation between indicator and deviation, over all
(layer, precision) pairs and per precision across layers, per seed and for the seed means; and, over
all pairs, the baseline that ranks by the precision alone (fp16 < bf16 < int8), which any indicator
must beat to add anything over "fewer bits, more noise".

Models (small, so that fp16 matmuls, slow on CPU, stay cheap):
- ``mlp``: 5 Linear layers (64 -> 256 -> 256 -> 256 -> 256 -> 10, ReLU), batch 64. Labels from a
  random teacher network. A few input features are scaled by ``--outlier-scale`` (unnormalized
  features), which gives the first layer a wide input range;
- ``mlp_plain``: the same MLP, batches and seeds without the outlier features (scale 1), so that the
  int8 ranking is seen without its easiest case;
- ``cnn``: 3 Conv2d (3 -> 16 -> 32 -> 32, 3x3, ReLU; strides 1, 2, 2) + global pool + Linear, on 3x16x16
  images, batch 64. Convolutions have no int8.

Writes ``<out>/indicator_check.md`` (the report) and ``<out>/indicator_check.json`` (every row,
the gathered statistics, the environment). ``--quick``: a smoke pass, the mlp, one seed of 5 steps.

    python benchmarks/indicator_check.py [--models mlp,mlp_plain,cnn] [--seeds 0,1,2,3,4,5] [--quick]
        [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from runs import bench_environment, write_results
from torch import nn

from qsync_callback.lp import set_precision, swap_to_lp
from qsync_callback.lp.swap import runnable_precisions, swappable_layers
from qsync_callback.predictor.indicator import sensitivity
from qsync_callback.recorder.layer_statistics import LayerStatistics

LOW_PRECISIONS = ("tf32", "bf16", "fp16", "int8")
PRECISION_RANK = {"tf32": 0, "fp16": 1, "bf16": 2, "int8": 3}  # by rounding noise, for the baseline
BATCH = 64
CLASSES = 10
MLP_IN, MLP_WIDTH, OUTLIER_FEATURES = 64, 256, 4
LR, MOMENTUM = 0.02, 0.9

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def build_mlp() -> nn.Module:
    widths = [MLP_IN, MLP_WIDTH, MLP_WIDTH, MLP_WIDTH, MLP_WIDTH]
    layers: list[nn.Module] = []
    for w_in, w_out in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(w_in, w_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(MLP_WIDTH, CLASSES))


def build_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, CLASSES),
    )


def mlp_data(steps: int, gen: torch.Generator, outlier_scale: float) -> Batches:
    teacher = nn.Sequential(nn.Linear(MLP_IN, 64), nn.Tanh(), nn.Linear(64, CLASSES))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    batches = []
    for _ in range(steps):
        x = torch.randn(BATCH, MLP_IN, generator=gen)
        with torch.no_grad():
            y = teacher(x).argmax(1)
        x[:, :OUTLIER_FEATURES] *= outlier_scale
        batches.append((x, y))
    return batches


def cnn_data(steps: int, gen: torch.Generator, outlier_scale: float) -> Batches:
    templates = torch.randn(CLASSES, 3, 16, 16, generator=gen)
    batches = []
    for _ in range(steps):
        y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
        batches.append((templates[y] + torch.randn(BATCH, 3, 16, 16, generator=gen), y))
    return batches


def mlp_plain_data(steps: int, gen: torch.Generator, outlier_scale: float) -> Batches:
    """The mlp's batches without outlier features, whatever ``--outlier-scale`` says."""
    return mlp_data(steps, gen, 1.0)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator, float], Batches]]] = {
    "mlp": (build_mlp, mlp_data),
    "mlp_plain": (build_mlp, mlp_plain_data),
    "cnn": (build_cnn, cnn_data),
}
QUICK = {"models": "mlp", "seeds": "0", "steps": 5, "warmup": 2}


def train(
    model: nn.Module, batches: Batches, stats: LayerStatistics | None = None, warmup: int = 0
) -> list[float]:
    """SGD with momentum over ``batches``; the per-step losses (fp64). ``stats`` records the first
    ``warmup`` steps."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step, (x, y) in enumerate(batches):
        if stats is not None and step == 0:
            stats.start()
        if stats is not None and step == warmup:
            stats.stop()
        loss = nn.functional.cross_entropy(model(x).double(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if stats is not None:
        stats.stop()
    return losses


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rho: Pearson correlation of the ranks (ties get their mean rank); None if undefined."""

    def ranks(values: Sequence[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(a) < 3:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)
    return cov / var**0.5 if var > 0 else None


def run_seed(
    name: str, seed: int, steps: int, warmup: int, outlier_scale: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One model and seed: the fp32 run with statistics, then one run per (layer, precision); the
    rows and the statistics."""
    build, make_data = MODELS[name]
    torch.manual_seed(seed)
    initial = build()
    batches = make_data(steps, torch.Generator().manual_seed(seed), outlier_scale)
    model = copy.deepcopy(initial)
    stats = LayerStatistics(model)
    base = train(model, batches, stats, warmup)
    gathered = stats.to_dict()
    indicator = sensitivity(gathered, LOW_PRECISIONS)
    rows = []
    for layer, module in swappable_layers(initial).items():
        for precision in ("fp32", *(p for p in runnable_precisions(module, "cpu") if p in LOW_PRECISIONS)):
            model = copy.deepcopy(initial)
            set_precision(swap_to_lp(model, [layer]), {layer: precision})
            start = time.perf_counter()
            losses = train(model, batches)
            deviation = statistics.fmean(abs(a - b) for a, b in zip(losses, base, strict=True))
            if precision == "fp32":
                if losses != base:
                    raise AssertionError(f"{name} seed {seed}: {layer} swapped at fp32 changed the losses")
                continue
            rows.append(
                {
                    "model": name,
                    "seed": seed,
                    "layer": layer,
                    "kind": type(module).__name__,
                    "depth": gathered["layers"][layer]["depth"],
                    "precision": precision,
                    "indicator": indicator[layer][precision],
                    "loss_deviation": deviation,
                    "final_loss_deviation": abs(losses[-1] - base[-1]),
                    "run_s": time.perf_counter() - start,
                }
            )
    return rows, gathered


def correlations(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Spearman per (model, seed or 'mean', precision or 'all'), for groups of 3 or more rows; with
    'all', also the baseline that ranks by the precision alone (fp16 < bf16 < int8, by rounding noise)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        groups: dict[Any, list[dict[str, Any]]] = {}
        for r in mine:
            groups.setdefault(r["seed"], []).append(r)
        keys = list(dict.fromkeys((r["layer"], r["precision"]) for r in mine))
        groups["mean"] = [
            {
                "layer": layer,
                "precision": precision,
                **{
                    field: statistics.fmean(
                        r[field] for r in mine if (r["layer"], r["precision"]) == (layer, precision)
                    )
                    for field in ("indicator", "loss_deviation")
                },
            }
            for layer, precision in keys
        ]
        for seed, group in groups.items():
            for precision in ("all", *dict.fromkeys(r["precision"] for r in group)):
                sel = [r for r in group if precision in ("all", r["precision"])]
                if len(sel) < 3:
                    continue
                deviation = [r["loss_deviation"] for r in sel]
                baseline = spearman([PRECISION_RANK[r["precision"]] for r in sel], deviation)
                out.append(
                    {
                        "model": model,
                        "seed": seed,
                        "precision": precision,
                        "n": len(sel),
                        "spearman": spearman([r["indicator"] for r in sel], deviation),
                        "precision_only": baseline if precision == "all" else None,
                    }
                )
    return out


def _rho(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}"


def markdown(rows: list[dict[str, Any]], corr: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Steps {args.steps}, statistics over the first {args.warmup}, seeds {args.seeds}, "
        f"batch {BATCH}, SGD lr {LR} momentum {MOMENTUM}, mlp outlier scale {args.outlier_scale}.",
        "",
        "Spearman rank correlation, indicator vs measured mean |loss - fp32 loss| over the steps. "
        "Per seed: median [min, max] over the seeds; seed means: of the seed-averaged indicator and "
        "deviation; precision only: the baseline that ranks by the precision alone.",
        "",
        "| model | precisions | n | per seed | seed means | precision only |",
        "| --- | --- | ---: | --- | ---: | ---: |",
    ]
    for model in dict.fromkeys(c["model"] for c in corr):
        for precision in dict.fromkeys(c["precision"] for c in corr if c["model"] == model):
            cells = [c for c in corr if (c["model"], c["precision"]) == (model, precision)]
            mean = next(c for c in cells if c["seed"] == "mean")
            per_seed = [c["spearman"] for c in cells if c["seed"] != "mean" and c["spearman"] is not None]
            spread = (
                f"{_rho(statistics.median(per_seed))} [{_rho(min(per_seed))}, {_rho(max(per_seed))}]"
                if per_seed
                else "n/a"
            )
            baseline = _rho(mean["precision_only"]) if precision == "all" else ""
            lines.append(
                f"| {model} | {precision} | {mean['n']} | {spread} | {_rho(mean['spearman'])} | {baseline} |"
            )
    lines += ["", "Per layer, seed mean: indicator / measured deviation", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        precisions = list(dict.fromkeys(r["precision"] for r in mine))
        lines += [
            f"| {model} layer | kind | depth | " + " | ".join(precisions) + " |",
            "| --- | --- | ---: | " + " | ".join("---" for _ in precisions) + " |",
        ]
        for layer in dict.fromkeys(r["layer"] for r in mine):
            first = next(r for r in mine if r["layer"] == layer)
            cells = []
            for precision in precisions:
                sel = [r for r in mine if (r["layer"], r["precision"]) == (layer, precision)]
                cells.append(
                    "-"
                    if not sel
                    else f"{statistics.fmean(r['indicator'] for r in sel):.2e} / "
                    f"{statistics.fmean(r['loss_deviation'] for r in sel):.2e}"
                )
            lines.append(f"| {layer} | {first['kind']} | {first['depth']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--seeds", default="0,1,2,3,4,5", help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps the statistics are gathered over")
    parser.add_argument(
        "--outlier-scale", type=float, default=10.0, help="scale of the mlp's outlier features"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke pass: mlp (unless --models), seed 0, 5 steps, warm-up 2"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.models = args.models or QUICK["models"]
        args.seeds, args.steps, args.warmup = QUICK["seeds"], QUICK["steps"], QUICK["warmup"]
    args.models = args.models or ",".join(MODELS)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    env = bench_environment(threads=torch.get_num_threads(), quick=args.quick)
    start = time.perf_counter()
    rows, gathered = [], []
    for model in models:
        for seed in args.seeds:
            seed_rows, stats = run_seed(model, seed, args.steps, args.warmup, args.outlier_scale)
            rows += seed_rows
            gathered.append({"model": model, "seed": seed, "statistics": stats})
    corr = correlations(rows)
    env["wall_s"] = time.perf_counter() - start
    raw = {
        "args": {**vars(args), "out": str(args.out)},
        "environment": env,
        "correlations": corr,
        "rows": rows,
        "statistics": gathered,
    }
    write_results(args.out, "indicator_check", markdown(rows, corr, args), raw)
    print(f"({env['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
