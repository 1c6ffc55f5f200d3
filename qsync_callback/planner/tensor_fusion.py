"""Choose Horovod's tensor-fusion settings and gradient groups by the predictor's figures.

Every candidate is priced by the predictor (the recorded all-reduces regrouped and replayed,
`predictor/tensor_fusion.py`), never by a formula of its own, and the best predicted one is kept:

- ``choose_settings``: fusion thresholds `THRESHOLDS_MIB` (whole MiB, so that ``horovodrun
  --fusion-threshold-mb`` can say them) crossed with cycle times `CYCLES_MS`, the recorded
  settings among them, with the plan's buckets (or the recorded grouping). Horovod reads them at
  ``hvd.init()``: they apply at the next launch (`next_launch` says how to launch with them).
- ``choose_groups``: gradient groups, with the recorded settings: everything in one group, one
  group per layer, and 2 or 3 groups of about equal bytes in the order the gradients become ready
  (the first to be ready launch first). These can be applied to the live run. The recorded
  grouping is the reference, never a candidate: the best of the others is returned even when it
  is predicted slower (the verification then measures it), with both figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qsync_callback.plan import Plan
from qsync_callback.predictor.predict import Prediction, Predictor
from qsync_callback.predictor.tensor_fusion import collective_tensors

THRESHOLD_ENV = "HOROVOD_FUSION_THRESHOLD"  # Horovod's names for the settings
CYCLE_ENV = "HOROVOD_CYCLE_TIME"
THRESHOLDS_MIB = (0, 1, 4, 16, 64, 128)
CYCLES_MS = (0.5, 1.0, 2.0, 5.0)
BALANCED_GROUPS = (2, 3)


@dataclass
class FusionChoice:
    """The chosen plan, its prediction, the recorded configuration's, and every candidate priced."""

    plan: Plan
    prediction: Prediction
    baseline: Prediction
    candidates: list[dict[str, Any]] = field(default_factory=list)

    @property
    def gain(self) -> float:
        """Predicted fraction of the step saved against the recorded configuration."""
        return 1 - self.prediction.step_ms / self.baseline.step_ms


def _choose(predictor: Predictor, plans: Sequence[Plan], what: str) -> FusionChoice:
    baseline = predictor.predict()
    priced = [(plan, predictor.predict(plan)) for plan in plans]
    best, prediction = min(priced, key=lambda p: p[1].step_ms)
    candidates = [{what: getattr(p, what), "step_ms": pred.step_ms} for p, pred in priced]
    plan = Plan.from_dict(best.to_dict())
    plan.prediction = {"step_ms": prediction.step_ms, "source": "predicted"}
    return FusionChoice(plan, prediction, baseline, candidates)


def choose_settings(predictor: Predictor, plan: Plan | None = None) -> FusionChoice:
    """The fastest predicted fusion threshold and cycle time (see the module docstring)."""
    base = plan or Plan(fingerprint=predictor.traces[0].fingerprint)
    recorded = predictor.traces[0].communication
    pairs = {(t * 2**20, c) for t in THRESHOLDS_MIB for c in CYCLES_MS}
    pairs.add((int(recorded["fusion_threshold_bytes"]), float(recorded["cycle_time_ms"])))
    plans = []
    for threshold, cycle in sorted(pairs):
        candidate = Plan.from_dict(base.to_dict())
        candidate.communication = {"fusion_threshold_bytes": threshold, "cycle_time_ms": cycle}
        plans.append(candidate)
    return _choose(predictor, plans, "communication")


def group_candidates(predictor: Predictor) -> list[list[list[str]]]:
    """Gradient groupings to try (variable names where every gradient has one), each different
    from the others: one group, per layer, and `BALANCED_GROUPS` groups of about equal bytes in
    order of readiness."""
    tensors = collective_tensors(predictor.graphs[0], predictor.recorded_ends(0))
    by_variable = all(t.variable for t in tensors)
    names = [t.variable if by_variable else t.name for t in tensors]
    out: list[list[list[str]]] = [[names]]
    if by_variable:
        layers: dict[str, list[str]] = {}
        for t in tensors:
            layers.setdefault(t.variable.rsplit("/", 1)[0], []).append(t.variable)
        out.append(list(layers.values()))
    total = sum(t.bytes for t in tensors)
    for count in BALANCED_GROUPS:
        groups: list[list[str]] = [[]]
        filled = 0
        for t, name in zip(tensors, names, strict=True):
            if groups[-1] and filled >= total * len(groups) / count and len(groups) < count:
                groups.append([])
            groups[-1].append(name)
            filled += t.bytes
        out.append(groups)
    unique: list[list[list[str]]] = []
    for groups in out:
        if len(groups) < len(names) and groups not in unique:
            unique.append(groups)
    return unique


def choose_groups(predictor: Predictor, plan: Plan | None = None) -> FusionChoice | None:
    """The fastest predicted gradient grouping other than the recorded one (see the module
    docstring); None if there is no candidate (a single all-reduced gradient)."""
    base = plan or Plan(fingerprint=predictor.traces[0].fingerprint)
    plans = []
    for groups in group_candidates(predictor):
        candidate = Plan.from_dict(base.to_dict())
        candidate.buckets = groups
        plans.append(candidate)
    return _choose(predictor, plans, "buckets") if plans else None


def next_launch(settings: Mapping[str, Any]) -> str:
    """How to launch with ``settings`` (a plan's ``communication``): horovodrun's flags (only where
    they can say it: the threshold in whole MiB) and the environment variables."""
    flags, env = [], []
    threshold = settings.get("fusion_threshold_bytes")
    cycle = settings.get("cycle_time_ms")
    if threshold is not None:
        if threshold % 2**20 == 0:
            flags.append(f"--fusion-threshold-mb {threshold // 2**20}")
        env.append(f"{THRESHOLD_ENV}={threshold}")
    if cycle is not None:
        flags.append(f"--cycle-time-ms {cycle:g}")
        env.append(f"{CYCLE_ENV}={cycle:g}")
    return f"horovodrun {' '.join(flags)} ...   (or {' '.join(env)})"
