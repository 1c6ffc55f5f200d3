"""The report: measured against predicted step time and peak memory, and per-op statistics.

Built from a trace directory's traces (rank 0 of a live run builds it the same way), written as
``report.json`` and printed as a summary. Measured step time is the median wall-clock time of the
unprofiled steps (the slowest rank's median); measured peak is each rank's allocator figure (see
the trace's ``measured.peak_source``), largest rank.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qsync_callback.alternation import MEDIAN_SAID
from qsync_callback.jsonio import write_text_atomic
from qsync_callback.mean_band import change_pct, median_noise_pct
from qsync_callback.plan import FULL_PRECISION, OFFLOAD, RECOMPUTE, Plan
from qsync_callback.planner.activation import NOTHING_TO_FREE
from qsync_callback.planner.memory_plan import MemoryChoice
from qsync_callback.planner.precision import PrecisionChoice
from qsync_callback.precision_links import precision_links
from qsync_callback.predictor.memory import unpredictable_peak
from qsync_callback.predictor.predict import predict
from qsync_callback.predictor.statistics import layer_statistics, op_statistics
from qsync_callback.recorder.trace import Trace
from qsync_callback.units import format_bytes

REPORT_FILE = "report.json"
NOISY_REPORT_FILE = "report-too-noisy.json"  # a recording the loop recorded again (`too_noisy_to_plan`)
RECORD_AGAIN_NOISE_PCT = 25.0
"""The most noise (`median_noise_pct`, in % of the step) a recording is planned on. Over it, the
machine was busy while the window ran: on this project's 2-core VM (session 45) twelve two-process
Horovod launches of the example's MLP measured +-4.1% to +-11.5%, and the suite's recordings of 8
steps or more at most +-13.9%; a launch whose steps the machine slowed planned otherwise than its
twins (issue 11's notes). A recording over it is recorded again, once (`qsync_callback.tuning_loop`)."""
RECORD_AGAIN_MIN_STEPS = 8
"""The fewest measured steps whose noise says the machine was busy: the band of 3 steps' median is
1.07 times their interquartile range over it, of 8 steps' 0.66, of 10 (the default) 0.59, so under
8 the band says more about how few they were than about the machine."""
NOISY_PAGE_FAULTS = 256  # per step: 1 MiB of fresh 4 KiB pages
PEAK_CALIBRATION = (
    "the predicted peak is TF's allocator simulated on the recorded tensors and calibrated on what "
    "the allocator read in the recorded steps ({read}; the simulation alone: {simulated}), so for the "
    "configuration recorded it is that reading, not a prediction; a plan's peak is its tensors "
    "simulated and moved by as much"
)


def _spread_pct(samples: Sequence[float]) -> float | None:
    """Run-to-run spread of step time: (90th - 10th percentile) / median, in percent."""
    if len(samples) < 3:
        return None
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return 100.0 * (deciles[-1] - deciles[0]) / statistics.median(samples)


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return 100.0 * abs(predicted - measured) / measured


def slowest_rank(traces: Sequence[Trace]) -> int | None:
    """The index of the rank whose unprofiled steps have the largest median (the measured step time
    is its median); None if no rank measured any."""
    medians = {
        i: statistics.median(t.measured["step_ms"]) for i, t in enumerate(traces) if t.measured.get("step_ms")
    }
    return max(medians, key=medians.__getitem__) if medians else None


def offload_traffic(trace: Trace) -> dict[str, dict[str, Any]] | None:
    """What the offload stores of ``trace``'s rank moved per measured step, by device (the stores'
    own counts and clocks over the unprofiled steps after the window, ``measured["offload"]``):
    bytes each way, the bandwidth each way, the ms the training thread waited on the store and the
    reads that were late; None where nothing was offloaded."""
    offload = trace.measured.get("offload")
    if not offload or not offload.get("steps"):
        return None
    steps = offload["steps"]
    return {
        device: {
            "tier": stats["tier"],
            "to_store_bytes": stats["to_store"]["bytes"] / steps,
            "from_store_bytes": stats["from_store"]["bytes"] / steps,
            "to_store_bytes_per_s": stats["to_store"]["bytes_per_s"],
            "from_store_bytes_per_s": stats["from_store"]["bytes_per_s"],
            "waited_ms": 1e3 * stats["waited_s"] / steps,
            "late": stats["late"] / steps,
        }
        for device, stats in offload["stores"].items()
    }


def build_report(traces: Sequence[Trace], plan: Plan | None = None, top: int = 15) -> dict[str, Any]:
    """Measured and predicted figures, their errors, and the top ops, as a JSON-ready dict."""
    prediction = predict(traces, plan)
    slowest = slowest_rank(traces)
    samples = traces[slowest].measured["step_ms"] if slowest is not None else []
    peaks = [t.measured.get("peak_bytes") for t in traces if t.measured.get("peak_bytes") is not None]
    measured_step = statistics.median(samples) if samples else None
    faults = traces[slowest].measured.get("page_faults") if slowest is not None else None
    measured_peak = max(peaks) if peaks else None
    largest = max(traces, key=lambda t: t.measured.get("peak_bytes") or 0)
    step_peaks = largest.measured.get("step_peak_bytes") or []
    predicted = prediction.to_dict()
    why_not = next((why for why in map(unpredictable_peak, traces) if why), None)
    if why_not is not None:
        predicted["peak_bytes"], predicted["peak_note"] = None, why_not
    elif traces[0].allocator.get("in_use_bytes") is not None:
        predicted["peak_allocator"] = traces[0].allocator["name"]
        if plan is None or plan.is_empty:
            predicted.update(_peak_calibration(traces, predicted["peak_bytes_simulated"]))
    return {
        "world_size": traces[0].world_size,
        "device": traces[0].device,
        "framework": f"{traces[0].framework} {traces[0].framework_version}".strip(),
        "recorded_steps": [s.index for s in traces[0].steps],
        "measured": {
            "step_ms": measured_step,
            "step_ms_samples": len(samples),
            "step_ms_spread_pct": _spread_pct(samples),
            "step_ms_noise_pct": median_noise_pct(samples),
            "peak_bytes": measured_peak,
            "peak_source": traces[0].measured.get("peak_source"),
            "peak_steps": len(step_peaks),
            "peak_bytes_median": statistics.median(step_peaks) if step_peaks else None,
            "peak_bytes_min": min(step_peaks) if step_peaks else None,
            "page_faults_per_step": statistics.median(faults) if faults else None,
            "page_size": traces[0].measured.get("page_size"),
            "offload": offload_traffic(traces[slowest if slowest is not None else 0]),
        },
        "predicted": predicted,
        "error_pct": {
            "step_ms": error_pct(prediction.step_ms, measured_step),
            "peak_bytes": error_pct(predicted["peak_bytes"], measured_peak),
        },
        "profiler_overhead_us": traces[0].profiler_overhead_us,
        "profiler_share": traces[slowest if slowest is not None else 0].measured.get("profiler_share"),
        "ops": op_statistics(traces)[:top],
        "layers": layer_statistics(traces),
        "plan": plan.to_dict() if plan is not None else None,
    }


def too_noisy_to_plan(report: Mapping[str, Any]) -> str | None:
    """Why ``report``'s recording is too noisy to plan on (its measured step's noise over
    `RECORD_AGAIN_NOISE_PCT`), as a clause; None where it is not (or has no noise figure)."""
    measured = report["measured"]
    noise = measured.get("step_ms_noise_pct")
    if noise is None or noise <= RECORD_AGAIN_NOISE_PCT:
        return None
    if measured["step_ms_samples"] < RECORD_AGAIN_MIN_STEPS:
        return None
    return (
        f"the measured step time {_ms(measured['step_ms'])} is known only to +-{noise:.1f}% (median of "
        f"{measured['step_ms_samples']} steps, spread {_pct(measured['step_ms_spread_pct'])}), over the "
        f"+-{RECORD_AGAIN_NOISE_PCT:.0f}% a recording is planned on: the machine was busy while it ran"
    )


def write_report(report: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``report`` as JSON (atomically) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(report, indent=2), what="report")
    return path


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} ms"


def _noise(noise_pct: float | None) -> str:
    """ "+-1.2% " after a measured median (the 95% band of the median, `median_noise_pct`)."""
    return "" if noise_pct is None else f"+-{noise_pct:.1f}% "


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}%"


def _rate(bytes_per_s: float | None) -> str:
    return "n/a" if bytes_per_s is None else f"{format_bytes(bytes_per_s)}/s"


def _breakdown(breakdown: Mapping[str, int]) -> str:
    """The bytes alive at the peak by kind; resident bytes freed before it said as such."""
    parts = [f"{k} {format_bytes(v)}" for k, v in breakdown.items() if v > 0 and k != "freed_resident"]
    if breakdown.get("freed_resident", 0) < 0:
        parts.append(f"resident bytes freed before it {format_bytes(-breakdown['freed_resident'])}")
    return ", ".join(parts)


def _peak_calibration(traces: Sequence[Trace], simulated: int | None) -> dict[str, Any]:
    """For a recorded configuration on TF's allocator with its readings in the recorded steps: what
    the calibration of the simulation's own peak (``simulated``, the largest rank's) on them means
    (`memory.allocator_offset`)."""
    read = [t.allocator.get("recorded_peak_bytes") for t in traces]
    read = [reading for reading in read if reading is not None]
    if not read or simulated is None:
        return {}
    return {
        "peak_calibration": PEAK_CALIBRATION.format(
            read=format_bytes(max(read)), simulated=format_bytes(simulated)
        )
    }


def _breakdown_note(predicted: Mapping[str, Any]) -> str:
    allocator = predicted.get("peak_allocator")
    if not allocator:
        return ""
    return f" (the tensors' own bytes; TF's {allocator} allocator counts its chunks, up to twice a request)"


def _peak_spread(measured: dict[str, Any]) -> str:
    """ "(largest of 21 steps, median 37.5 MiB) " where each step's peak was measured."""
    if not measured.get("peak_steps"):
        return ""
    median = format_bytes(measured["peak_bytes_median"])
    return f"(largest of {measured['peak_steps']} steps, median {median}) "


def _signed_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}%"


def format_summary(report: dict[str, Any], top: int = 10) -> str:
    """The human-readable summary printed by the callback (rank 0) and by ``qsync report``."""
    measured, predicted, error = report["measured"], report["predicted"], report["error_pct"]
    share = predicted.get("critical_path_share", {})
    lines = [
        f"qsync report: {report['framework']} on {report['device']}, world size {report['world_size']}, "
        f"recorded steps {report['recorded_steps']}",
        f"  step time   measured {_ms(measured['step_ms'])} {_noise(measured.get('step_ms_noise_pct'))}"
        f"(median of {measured['step_ms_samples']}, spread {_pct(measured['step_ms_spread_pct'])})   "
        f"predicted {_ms(predicted['step_ms'])}   error {_pct(error['step_ms'])}",
        f"  peak memory measured {format_bytes(measured['peak_bytes'])} {_peak_spread(measured)}  "
        f"predicted {format_bytes(predicted['peak_bytes'])}   error {_pct(error['peak_bytes'])}",
        "  critical path: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in share.items()),
        f"  memory at peak{_breakdown_note(predicted)}: " + _breakdown(predicted.get("memory_breakdown", {})),
        "  top ops (ms per step, profiler overhead removed):",
    ]
    for row in report["ops"][:top]:
        lines.append(
            f"    {row['ms_per_step']:8.3f}  {100 * row['share']:5.1f}%  {row['calls_per_step']:6.1f}x  "
            f"{row['kind']:<8} {row['name'][:70]}"
        )
    profiler = report.get("profiler_share")
    if profiler and profiler.get("in_step_ms") is not None:
        added = profiler["in_step_ms"]
        what = (
            f"recording added {added:.2f} ms to a step (against its unprofiled neighbours; "
            f"{profiler['loops_share_ms']:.2f} ms of it per recorded event): the prediction removes that much"
            if added >= 0
            else f"the recorded steps ran {-added:.2f} ms faster than their unprofiled neighbours: the "
            "prediction adds that much"
        )
        lines.append(
            f"  note: {what}, so for the configuration recorded it is calibrated on this run and its "
            "error checks the replay; a plan's prediction re-costs the ops it changes"
        )
    if predicted.get("peak_note"):
        lines.append(f"  note: {predicted['peak_note']}")
    if predicted.get("peak_calibration"):
        lines.append(f"  note: {predicted['peak_calibration']}")
    low, high = measured.get("peak_bytes_min"), measured["peak_bytes"]
    if low is not None and predicted["peak_bytes"] is not None and low <= predicted["peak_bytes"] <= high:
        lines.append(
            f"  note: the measured peak varies from step to step ({format_bytes(low)} to "
            f"{format_bytes(high)}: TF runs independent ops in parallel, in another order each step) "
            "and the predicted peak lies within that range"
        )
    noise = measured.get("step_ms_noise_pct")
    if noise is not None and error["step_ms"] is not None and error["step_ms"] <= noise:
        lines.append(
            f"  note: the step-time error ({_pct(error['step_ms'])}) is within the noise of the measured "
            f"median (+-{noise:.1f}%): this run cannot tell the prediction from the measurement"
        )
    for device, moved in (measured.get("offload") or {}).items():
        lines.append(
            f"  offload ({device}, {moved['tier']}): per step {format_bytes(moved['to_store_bytes'])} out at "
            f"{_rate(moved['to_store_bytes_per_s'])} and {format_bytes(moved['from_store_bytes'])} back at "
            f"{_rate(moved['from_store_bytes_per_s'])}; the step waited {moved['waited_ms']:.2f} ms on the "
            f"store, {moved['late']:.1f} reads late"
        )
    faults = measured.get("page_faults_per_step")
    if faults and faults >= NOISY_PAGE_FAULTS:
        fresh = format_bytes(faults * (measured.get("page_size") or 4096))
        lines.append(
            f"  note: {faults:.0f} page faults per step ({fresh} of fresh pages): the memory allocator hands "
            "memory back to the system between steps, which slows steps and makes their time vary on "
            'virtual machines; the allocator lever (mode="apply") fixes glibc malloc\'s thresholds so '
            "that it keeps it (or preload an allocator that keeps it, LD_PRELOAD=libtcmalloc_minimal.so.4)"
        )
    return "\n".join(lines)


def format_precision_plan(
    choice: PrecisionChoice,
    indicator: Mapping[str, Mapping[str, float]],
    baseline: Mapping[str, Any],
    layers: Sequence[Mapping] = (),
    noise_pct: float | None = None,
) -> str:
    """The chosen per-layer plan as a table: layer, precision, predicted time share, indicator, and
    the layer it passes its low-precision output to (`precision_links`, from the trace's layer
    table ``layers``); ``baseline`` is the recorded configuration's ``predicted`` figures
    (report["predicted"]); ``noise_pct``, the noise of the measured step time
    (`median_noise_pct`): a predicted change within it is one verify may not be able to tell."""
    prediction = choice.prediction
    target = "n/a" if choice.target_step_ms is None else _ms(choice.target_step_ms)
    budget = "none" if choice.memory_budget is None else format_bytes(choice.memory_budget)
    lines = [
        *_plan_head(
            f"precision plan ({'meets' if choice.feasible else 'DOES NOT meet'} the constraints; "
            f"{choice.plans_priced} plans priced)",
            prediction,
            baseline,
            f"target {target}",
            budget,
            noise_pct,
        ),
        f"  summed indicator {choice.indicator:.3g}",
        f"  {'layer':<40} {'precision':<9} {'time share':>10} {'indicator':>10}  passes its output uncast to",
    ]
    precision = choice.plan.precision
    passes_to = {link.source: link.target for link in precision_links(layers, precision)}
    for layer in indicator:
        p = precision.get(layer, FULL_PRECISION)
        share = prediction.layer_ms.get(layer, 0.0) / prediction.step_ms if prediction.step_ms else 0.0
        damage = 0.0 if p == FULL_PRECISION else indicator[layer].get(p, 0.0)
        row = f"  {layer[:40]:<40} {p:<9} {100 * share:9.1f}% {damage:10.3g}  {passes_to.get(layer, '')}"
        lines.append(row.rstrip())
    return "\n".join(lines)


def format_memory_plan(
    choice: MemoryChoice,
    baseline: Mapping[str, Any],
    noise_pct: float | None = None,
) -> str:
    """The plan chosen to meet a memory budget with every lever allowed, as a table: each layer or
    module it changes, with its precision, its activation policy (keep / recompute / offload), the
    bytes that policy frees at once and the time it costs (each priced alone on the plan's precision:
    `planner.activation.Option`); then every candidate priced, the modules left out, why, and what
    the activation trials measured (`activation_trial`), where they ran."""
    chosen, prediction = choice.chosen, choice.chosen.prediction
    limit = "none" if choice.max_step_ms is None else _ms(choice.max_step_ms)
    lines = [
        *_plan_head(
            f"memory plan ({'meets' if choice.feasible else 'DOES NOT meet'} the constraints; "
            f"chosen: {chosen.name})",
            prediction,
            baseline,
            f"limit {limit}",
            format_bytes(choice.memory_budget),
            noise_pct,
        ),
        f"  {'layer or module':<40} {'precision':<9} {'activation':<10} {'frees':>10} {'costs':>9}",
    ]
    options = {(o.module, o.policy): o for o in (chosen.activation.options if chosen.activation else [])}
    plan = chosen.plan
    for name in sorted({*plan.precision, *plan.activation}):
        policy = plan.activation.get(name, "keep")
        option = options.get((name, policy))
        frees = format_bytes(option.freed_bytes) if option else ""
        costs = f"{option.cost_us / 1e3:.2f} ms" if option else ""
        precision = plan.precision.get(name, FULL_PRECISION if name in plan.precision else "")
        lines.append(f"  {name[:40]:<40} {precision:<9} {policy:<10} {frees:>10} {costs:>9}".rstrip())
    if not (plan.precision or plan.activation):
        lines.append("  (none: the recorded configuration)")
    lines.append("  candidates priced:")
    for candidate in choice.candidates:
        p = candidate.prediction
        lines.append(
            f"    {candidate.name:<24} step {_ms(p.step_ms)}, peak {format_bytes(p.peak_bytes)}, "
            f"{len(candidate.plan.precision)} layer(s) lowered, {len(candidate.plan.activation)} "
            "activation polic(ies)"
        )
    refused = chosen.activation.refused if chosen.activation else {}
    idle = sorted(name for name, why in refused.items() if why == NOTHING_TO_FREE)
    if idle:
        lines.append(
            f"  {len(idle)} module(s) left out, as they {NOTHING_TO_FREE.replace('saves', 'save')}: "
            f"{', '.join(idle[:4])}{', ...' * (len(idle) > 4)}"
        )
    lines.extend(
        f"  left out: {name}: {why}" for name, why in sorted(refused.items()) if why != NOTHING_TO_FREE
    )
    lines.extend(format_activation_trial(policy, trial) for policy, trial in choice.trials.items())
    return "\n".join(lines)


_TRIAL_PRICE = {  # per policy: what its trial's factor multiplies, and what it is measured against
    OFFLOAD: ("the copy-cost fit", "the fit prices its copies at"),
    RECOMPUTE: ("the recorded forward", "the recorded forward prices it at"),
}


_ESTIMATES = {"mean": "", "median": f"; {MEDIAN_SAID}"}


def format_activation_trial(policy: str, trial: Mapping[str, Any]) -> str:
    """One line: what the ``policy`` trial's modules cost the step (`activation_trial`), against its
    price, and the factor the policy is priced at; or why its price stands alone."""
    price, priced_at = _TRIAL_PRICE[policy]
    modules = ", ".join(trial["modules"][:4]) + ", ..." * (len(trial["modules"]) > 4)
    if trial["factor"] is None:
        return (
            f"  {policy} priced by {price} alone: the {policy} trial ({modules or 'no module'}): "
            + trial["note"]
        )
    return (
        f"  {policy} priced at {trial['factor']:.2f} x {price}: {policy} of {modules} in "
        f"{trial['rounds']} rounds of turns cost the step {trial['change_ms']:+.2f} ms "
        f"(+-{trial['noise_ms']:.2f}{_ESTIMATES[trial.get('estimate', 'mean')]}) where {priced_at} "
        f"{trial['priced_ms']:.2f} ms"
    )


def _plan_head(
    title: str,
    prediction: Any,
    baseline: Mapping[str, Any],
    time_limit: str,
    budget: str,
    noise_pct: float | None,
) -> list[str]:
    """A plan table's first lines: its title, its predicted step time and peak against the recorded
    configuration's (``baseline``, report["predicted"]) with the limits, and the predicted change
    set against the measured noise."""
    return [
        f"qsync {title}",
        f"  step time   predicted {_ms(prediction.step_ms)} (recorded configuration "
        f"{_ms(baseline['step_ms'])}, {time_limit})",
        f"  peak memory predicted {format_bytes(prediction.peak_bytes)} (recorded configuration "
        f"{format_bytes(baseline['peak_bytes'])}, budget {budget})",
        *_predicted_change(prediction.step_ms, baseline["step_ms"], noise_pct),
    ]


def _predicted_change(plan_ms: float | None, recorded_ms: float | None, noise_pct: float | None) -> list[str]:
    """The plan's predicted step-time change, set against the measured noise (no line without it)."""
    change = change_pct(plan_ms, recorded_ms)
    if noise_pct is None or change is None:
        return []
    if abs(change) <= noise_pct:
        return [
            f"  predicted change {change:+.1f}% is within the measured step time's noise "
            f"(+-{noise_pct:.1f}%): not meaningful here, and verify may not be able to tell it"
        ]
    return [f"  predicted change {change:+.1f}% (measured step time's noise +-{noise_pct:.1f}%)"]


def _turns_schedule(turns: Mapping[str, Any]) -> str:
    steps, most = turns.get("block_steps"), turns.get("most_rounds")
    blocks = f" of {steps} timed steps a block" if steps else ""
    return blocks + (f" (at most {most} rounds)" if most else "")


def format_verification(verification: Mapping[str, Any]) -> str:
    """Measured against predicted for an applied plan, and what was kept."""
    predicted, measured = verification["predicted"], verification["measured"]
    lines = [
        f"qsync plan verified: {verification['decision']} ({verification['reason']})",
        f"  step time   baseline measured {_ms(verification['baseline_step_ms'])}   plan measured "
        f"{_ms(measured['step_ms'])}   predicted {_ms(predicted['step_ms'])}   "
        f"error {_pct(verification['error_pct']['step_ms'])}",
    ]
    turns = verification.get("alternation") or {}
    if turns.get("rounds"):
        pairs = ", ".join(
            f"{b:.1f} -> {p:.1f}" for b, p in zip(turns["baseline_ms"], turns["plan_ms"], strict=True)
        )
        lines.append(
            f"  in turns    {turns['rounds']} rounds{_turns_schedule(turns)}, baseline -> plan ms: {pairs}; "
            f"measured change {turns['change_pct']:+.1f}% +-{turns['noise_pct']:.1f}%, predicted "
            f"{_signed_pct(verification.get('predicted_change_pct'))}"
        )
        faults = turns.get("page_faults_per_step") or {}
        if max(faults.values(), default=0) >= NOISY_PAGE_FAULTS:
            lines.append(
                f"  in turns    page faults a step: baseline {faults['baseline']:.0f}, "
                f"plan {faults['plan']:.0f} (fresh pages the allocator took again; a configuration run "
                "right after another can take thousands more a step than it does alone, and the change "
                "holds their cost)"
            )
    lines.append(
        f"  peak memory plan measured {format_bytes(measured['peak_bytes'])}   predicted "
        f"{format_bytes(predicted['peak_bytes'])}   "
        f"error {_pct(verification['error_pct']['peak_bytes'])}"
    )
    return "\n".join(lines)
