"""Choose DDP's gradient buckets by the predictor's figures.

The gradients are taken in the order DDP's rebuilt buckets hold them (the order they became ready
in the recorded run, `recorder/ddp_buckets.py`); a bucket plan is a partition of that order into
consecutive buckets, which DDP can be given as per-bucket caps (``bucket_cap_mb_list``). A cut
falls only between layers: a layer's gradients are ready together, and their order inside it is
DDP's to choose.

Candidates, each priced by the predictor (the recorded all-reduces regrouped and replayed,
`predictor/tensor_fusion.py`):

- the partition that ends the last all-reduce soonest under the fitted cost, found by dynamic
  programming over the layers in order of readiness (`best_partition`: with the layers' ready
  times from the recorded step's replay and a serial communication lane, the finish time of a
  prefix only grows with the finish time of the prefix before it, so the best partition of every
  prefix extends to the best of the next);
- DDP's own assignment at the caps `CAPS_MIB`, its default among them (25 MiB, with a first bucket
  of 1 MiB: `ddp_assignment`), and everything in one bucket.

The recorded buckets are the reference. Every candidate and the reference are priced on the
typical recorded step (`Predictor.typical_step`, the one whose replay is the recorded steps'
median: one regrouped graph each, not one per recorded step; a bucket plan changes no compute op,
so the steps differ only in what they recorded). The fastest is chosen if it is predicted more than
`NO_DECISION_GAIN` faster than the recorded buckets; otherwise none (a smaller predicted
difference is no decision). The chosen plan's figure (``Plan.prediction``, what verify compares
with) is priced on every recorded step. Each candidate's exposed communication
(`Prediction.exposed_comm_ms`: the replay's last all-reduce end less its last backward op's end)
is shown with it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from qsync_callback.plan import Plan
from qsync_callback.planner import NO_DECISION_GAIN
from qsync_callback.predictor.predict import Prediction, Predictor
from qsync_callback.predictor.tensor_fusion import AllreduceCost, collective_tensors
from qsync_callback.recorder.ddp_buckets import fill_buckets

CAPS_MIB = (1, 4, 16, 25, 64)
DEFAULT_CAP_MIB = 25  # DDP's default bucket_cap_mb
FIRST_BUCKET_MIB = 1  # and its first bucket under the default (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
RECORDED = "recorded buckets"


@dataclass
class Layer:
    """The gradients of one layer (in DDP's order), their bytes, and when they are ready (us)."""

    names: list[str]
    bytes: int
    ready_us: float


@dataclass
class BucketCandidate:
    name: str
    buckets: list[list[str]]
    bucket_bytes: list[int]
    prediction: Prediction  # on the typical recorded step (`Predictor.typical_step`)


@dataclass
class BucketChoice:
    """The chosen plan (None: keep the recorded buckets), the reference and every candidate."""

    plan: Plan | None
    recorded: BucketCandidate
    candidates: list[BucketCandidate] = field(default_factory=list)
    chosen: BucketCandidate | None = None


def gradient_layers(predictor: Predictor) -> list[Layer]:
    """The recorded gradients in DDP's bucket order, grouped into runs of one layer, each with its
    ready time in the replay of the typical recorded step (`Predictor.typical_step`: the latest
    of its gradients)."""
    at = predictor.typical_step
    graph = predictor.graphs[at]
    ends = predictor.recorded_ends(at)
    ready = {t.name: max((ends[n] for n in t.launch), default=0.0) for t in collective_tensors(graph, ends)}
    layers: list[Layer] = []
    owner_of_last = None
    for bucket in predictor.traces[0].communication["buckets"]:
        for tensor in bucket:
            owner = tensor.get("layer") or tensor["name"]
            if layers and owner == owner_of_last:
                layers[-1].names.append(tensor["name"])
                layers[-1].bytes += tensor["bytes"]
                layers[-1].ready_us = max(layers[-1].ready_us, ready.get(tensor["name"], 0.0))
            else:
                layers.append(Layer([tensor["name"]], tensor["bytes"], ready.get(tensor["name"], 0.0)))
            owner_of_last = owner
    return layers


def best_partition(layers: Sequence[Layer], cost: AllreduceCost) -> list[int]:
    """The ends (exclusive layer indices) of the buckets that finish the last all-reduce soonest:
    bucket k all-reduces once its last layer is ready and bucket k-1 is done, for ``cost``."""
    n = len(layers)
    finish = [-math.inf] + [math.inf] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        size = 0
        for i in range(j - 1, -1, -1):
            size += layers[i].bytes
            done = max(layers[j - 1].ready_us, finish[i]) + cost.us(size)
            if done < finish[j]:
                finish[j], cut[j] = done, i
    ends, j = [], n
    while j > 0:
        ends.append(j)
        j = cut[j]
    return ends[::-1]


def ddp_assignment(layers: Sequence[Layer], first_cap_bytes: int, cap_bytes: int) -> list[int]:
    """The bucket ends DDP's rebuild makes with these caps (`fill_buckets`: the first bucket's cap,
    then the others'), here at layer granularity."""
    counts = fill_buckets([layer.bytes for layer in layers], [first_cap_bytes, cap_bytes])
    return list(itertools.accumulate(counts))


def _buckets(layers: Sequence[Layer], ends: Sequence[int]) -> list[list[str]]:
    starts = [0, *ends[:-1]]
    return [[n for layer in layers[a:b] for n in layer.names] for a, b in zip(starts, ends, strict=True)]


def choose_buckets(predictor: Predictor, base: Plan | None = None) -> BucketChoice:
    """Price the candidates on top of ``base`` (another lever's plan, or none) and choose (see the
    module docstring)."""
    base = base or Plan(fingerprint=predictor.traces[0].fingerprint)
    layers = gradient_layers(predictor)
    cost = predictor.fusion_cost()
    settings = predictor.traces[0].communication
    sizes = {t["name"]: t["bytes"] for bucket in settings["buckets"] for t in bucket}
    typical = [predictor.typical_step]

    def plan_of(buckets: list[list[str]]) -> Plan:
        return Plan.from_dict({**base.to_dict(), "buckets": buckets})

    def ranked(name: str, buckets: list[list[str]]) -> BucketCandidate:
        bucket_bytes = [sum(sizes[n] for n in bucket) for bucket in buckets]
        prediction = predictor.predict(plan_of(buckets), steps=typical)
        return BucketCandidate(name, buckets, bucket_bytes, prediction)

    recorded = ranked(RECORDED, [[t["name"] for t in bucket] for bucket in settings["buckets"]])
    proposals = [("fastest finish (dynamic programming)", best_partition(layers, cost))]
    for cap in CAPS_MIB:
        first = FIRST_BUCKET_MIB if cap == DEFAULT_CAP_MIB else cap
        label = f"DDP's default ({DEFAULT_CAP_MIB} MiB)" if cap == DEFAULT_CAP_MIB else f"DDP at {cap} MiB"
        proposals.append((label, ddp_assignment(layers, first * 2**20, cap * 2**20)))
    proposals.append(("one bucket", [len(layers)]))
    candidates, seen = [], [recorded.buckets]
    for name, ends in proposals:
        buckets = _buckets(layers, ends)
        if buckets not in seen:
            seen.append(buckets)
            candidates.append(ranked(name, buckets))
    best = min(candidates, key=lambda c: c.prediction.step_ms, default=None)
    if best is None or best.prediction.step_ms > (1 - NO_DECISION_GAIN) * recorded.prediction.step_ms:
        return BucketChoice(None, recorded, candidates)
    plan = plan_of(best.buckets)
    plan.prediction = predictor.predict(plan).figures()
    return BucketChoice(plan, recorded, candidates, best)


def format_bucket_plan(choice: BucketChoice) -> str:
    """The candidates as a table, the recorded buckets first."""
    lines = [f"qsync DDP buckets ({len(choice.candidates)} candidates priced against the recorded buckets)"]
    for c in [choice.recorded, *choice.candidates]:
        sizes = ", ".join(f"{b / 2**20:.2f}" for b in c.bucket_bytes[:6]) + (
            ", ..." if len(c.bucket_bytes) > 6 else ""
        )
        change = 100 * (c.prediction.step_ms / choice.recorded.prediction.step_ms - 1)
        mark = "   <- chosen" if c is choice.chosen else ""
        lines.append(
            f"  {c.name[:38]:<38} {len(c.buckets):3d} buckets [{sizes}] MiB  {c.prediction.step_ms:8.2f} ms "
            f"{change:+6.1f}%  exposed {c.prediction.exposed_comm_ms:6.2f} ms{mark}"
        )
    if choice.chosen is None:
        lines.append(
            f"  no candidate is predicted more than {100 * NO_DECISION_GAIN:g}% faster than the recorded "
            "buckets: they stay"
        )
    return "\n".join(lines)
