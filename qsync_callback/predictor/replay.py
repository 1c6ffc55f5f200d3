"""Replay a step's data-flow graph: a discrete-event simulation over its queues.

Each queue (a rank's training thread, a communication thread, a CUDA stream) runs its ops one at
a time in recorded order (the graph's order edges). An op starts once everything it waits for has
ended and its queue's host gap has passed: ``start = max(end of predecessors) + gap``;
``end = start + dur``. With a fixed order per queue this event simulation reduces to one pass in
topological order. A collective waits for every rank's launch, so a slow rank delays the others,
and an all-reduce overlaps backward exactly as far as its launch and wait edges allow.

The critical path is found by walking back from the last rank's end through the predecessor that
made each op wait; its time splits into compute, communication and host gaps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

_COMPUTE_KINDS = ("forward", "backward", "update", "cast", "copy", "other")


@dataclass
class ReplayResult:
    """Replayed times (microseconds from the step's start) of one step."""

    step_us: float
    start: dict[str, float]
    end: dict[str, float]
    critical_path: list[str]
    critical_share: dict[str, float] = field(default_factory=dict)

    def timeline(self, graph: nx.DiGraph) -> list[dict]:
        """One row per op: node, name, kind, queue, layer, start and end in microseconds."""
        rows = []
        for node, start in sorted(self.start.items(), key=lambda kv: kv[1]):
            attrs = graph.nodes[node]
            if attrs["kind"] == "sentinel":
                continue
            rows.append(
                {
                    "node": node,
                    "name": attrs["name"],
                    "kind": attrs["kind"],
                    "queue": attrs["queue"],
                    "layer": attrs["layer"],
                    "start_us": start,
                    "end_us": self.end[node],
                }
            )
        return rows


def replay(graph: nx.DiGraph) -> ReplayResult:
    """Simulate ``graph`` (see `qsync_callback.predictor.graph`); times are relative to step start."""
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    waited_on: dict[str, str | None] = {}
    for node in nx.topological_sort(graph):
        attrs = graph.nodes[node]
        ready, blocker = 0.0, None
        for pred in graph.predecessors(node):
            if blocker is None or end[pred] > ready:
                ready, blocker = end[pred], pred
        start[node] = ready + attrs["gap"]
        end[node] = start[node] + attrs["dur"]
        waited_on[node] = blocker
    ends = [n for n, a in graph.nodes(data=True) if a["kind"] == "sentinel" and graph.out_degree(n) == 0]
    last = max(ends, key=lambda n: end[n])
    path = []
    node: str | None = last
    while node is not None:
        path.append(node)
        node = waited_on[node]
    path.reverse()
    return ReplayResult(
        step_us=end[last],
        start=start,
        end=end,
        critical_path=path,
        critical_share=_critical_share(graph, path),
    )


def _critical_share(graph: nx.DiGraph, path: list[str]) -> dict[str, float]:
    """Fractions of the critical path spent in compute, communication and host gaps."""
    totals = {"compute": 0.0, "communication": 0.0, "host": 0.0}
    for node in path:
        attrs = graph.nodes[node]
        totals["host"] += attrs["gap"]
        if attrs["kind"] == "comm":
            totals["communication"] += attrs["dur"]
        elif attrs["kind"] in _COMPUTE_KINDS:
            totals["compute"] += attrs["dur"]
    whole = sum(totals.values()) or 1.0
    return {k: v / whole for k, v in totals.items()}
