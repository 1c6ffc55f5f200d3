"""Which neighbouring layers of a precision plan pass a low-precision tensor between them.

An LP layer at bf16 or fp16 casts its input to that dtype and, on its own, its output back to fp32.
Where its output goes straight to another LP layer at the same precision, both casts are wasted
(QSync's fused casts between equal neighbours). We link such neighbours: the first keeps its output
at the low precision, the second takes it as it comes, and the parameter-free layers in between
(activations, dropout, pooling, flatten) run on the low-precision tensor.

"Straight to" is decided from the model's structure, never guessed from a trace: only children of
an ``nn.Sequential`` are linked, since a Sequential feeds each child's output to the next child and
to nothing else. The layer table of a trace records, for each layer, the next child of its
Sequential (``"next"``); the live model gives the same (`recorder.layer_ranges.layer_table`), so
the run and the prediction link the same layers. This module is pure: it reads names, types and
the plan.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

LINKED_PRECISIONS = ("bf16", "fp16")
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # of a float tensor at each precision a link passes
# parameter-free layers that compute in whatever float dtype they are given, element by element or
# over windows, so a low-precision tensor passes through them unchanged in dtype
PASS_THROUGH_TYPES = frozenset(
    {
        "ReLU",
        "ReLU6",
        "LeakyReLU",
        "GELU",
        "SiLU",
        "ELU",
        "Tanh",
        "Sigmoid",
        "Hardswish",
        "Identity",
        "Dropout",
        "Dropout1d",
        "Dropout2d",
        "Flatten",
        "MaxPool1d",
        "MaxPool2d",
        "AvgPool1d",
        "AvgPool2d",
        "AdaptiveAvgPool1d",
        "AdaptiveAvgPool2d",
    }
)


class Link(NamedTuple):
    """``source``'s output reaches ``target`` through the pass-through layers ``between``, all at
    ``precision``."""

    source: str
    between: tuple[str, ...]
    target: str
    precision: str


def _downstream(rows: Mapping[str, Mapping], name: str) -> tuple[tuple[str, ...], str | None]:
    """The pass-through layers right after ``name`` in its Sequential, and the layer after them
    (None where the Sequential ends or the next child is not a layer of the table)."""
    between: list[str] = []
    following = rows[name].get("next")
    while following in rows and rows[following]["type"] in PASS_THROUGH_TYPES:
        between.append(following)
        following = rows[following].get("next")
    return tuple(between), following if following in rows else None


def precision_links(layers: Iterable[Mapping], precision: Mapping[str, str]) -> list[Link]:
    """The links of ``precision`` (layer -> precision) in a model whose layer table is ``layers``
    (rows with ``name``, ``type`` and ``next``: the next child of the layer's ``nn.Sequential``, or
    None): every layer at bf16/fp16 whose next layers are pass-through ones, then a layer at the
    same precision. Rows without ``next`` (traces recorded before it was kept) link nothing."""
    rows = {row["name"]: row for row in layers}
    links = []
    for name, p in precision.items():
        if p not in LINKED_PRECISIONS or name not in rows:
            continue
        between, following = _downstream(rows, name)
        if following is not None and precision.get(following) == p:
            links.append(Link(name, between, following, p))
    return links


def pass_through_candidates(layers: Iterable[Mapping], lp_layers: Collection[str]) -> list[str]:
    """The pass-through layers some plan could link across: those right after one of ``lp_layers``
    (the layers a plan can set a precision for) and followed, past pass-through layers only, by
    another. Their low-precision costs are what the probes measure besides the LP layers'."""
    rows = {row["name"]: row for row in layers}
    found: list[str] = []
    for name in lp_layers:
        if name not in rows:
            continue
        between, following = _downstream(rows, name)
        if between and following in lp_layers:
            found.extend(between)
    return list(dict.fromkeys(found))


def link_partners(layers: Iterable[Mapping], lp_layers: Collection[str]) -> dict[str, tuple[str, ...]]:
    """For each of ``lp_layers``, the others it could link with: the one before it and the one
    after it in its Sequential, past pass-through layers only. A planner prices a layer's move with
    these at their current precisions, since a link changes what the move is worth."""
    rows = {row["name"]: row for row in layers}
    partners: dict[str, list[str]] = {name: [] for name in lp_layers}
    for name in lp_layers:
        if name not in rows:
            continue
        _, following = _downstream(rows, name)
        if following in partners:
            partners[name].append(following)
            partners[following].append(name)
    return {name: tuple(found) for name, found in partners.items()}
