"""Replay a step's data-flow graph: a discrete-event simulation over its queues.

Each queue (a rank's training thread, a communication thread, a CUDA stream) runs its ops one at
a time in recorded order (the graph's order edges). An op starts once everything it waits for has
ended and its queue's host gap has passed: ``start = max(end of predecessors) + gap``;
``end = start + dur``. With a fixed order per queue this event simulation reduces to one pass in
topological order. A collective waits for every rank's launch, so a slow rank delays the others,
and an all-reduce overlaps backward exactly as far as its launch and wait edges allow.

The critical path is found by walking back from the last rank's end through the predecessor that
made each op wait (the first of its predecessors to end last); its time splits into compute,
communication and host gaps.

`CompiledGraph` prepares a graph once for many replays with other durations (a planner pricing
plans): its ops in topological order as arrays, cut into chains (runs of ops whose only
predecessor is the op before them), each replayed by one cumulative sum of its gaps and durations.
Only a chain's head (an op waiting for several, or for none, or the second child of a fork) is
resolved one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from qsync_callback.predictor.graph import is_all_reduce

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


@dataclass
class Timing:
    """One replay of a `CompiledGraph`: start and end of each op (by index), the step's end, the
    rank end sentinel that ended last, and what each chain's head waited for (-1: nothing)."""

    start: np.ndarray
    end: np.ndarray
    step_us: float
    last: int
    head_blocker: list[int]


class CompiledGraph:
    """A step graph (see `qsync_callback.predictor.graph`) prepared for replays with other op
    durations: ops indexed in topological order, with their recorded ``gap``, ``dur``, ``kind``
    and ``layer``."""

    def __init__(self, graph: nx.DiGraph):
        self.nodes: list[str] = list(nx.topological_sort(graph))
        self.index = {node: i for i, node in enumerate(self.nodes)}
        attrs = [graph.nodes[node] for node in self.nodes]
        self.gap = np.array([a["gap"] for a in attrs], dtype=float)
        self.dur = np.array([a["dur"] for a in attrs], dtype=float)
        self.kinds: list[str] = [a["kind"] for a in attrs]
        self.layers: list[str | None] = [a["layer"] for a in attrs]
        self._preds = [[self.index[p] for p in graph.predecessors(node)] for node in self.nodes]
        self._ends = [
            self.index[n]
            for n, a in graph.nodes(data=True)
            if a["kind"] == "sentinel" and graph.out_degree(n) == 0
        ]
        self._comm = np.array([k == "comm" for k in self.kinds])
        self._all_reduces = [i for i, a in enumerate(attrs) if is_all_reduce(a)]
        self._backward = [i for i, k in enumerate(self.kinds) if k == "backward"]
        self._compute = np.array([k in _COMPUTE_KINDS for k in self.kinds])
        self._graph_order = [self.index[node] for node in graph.nodes]
        self._layer_groups: dict[tuple[str, ...], tuple[list[str], np.ndarray, np.ndarray]] = {}
        self._chains()

    def _chains(self) -> None:
        """Cut the ops into chains; lay each out as [base, gap, dur, gap, dur, ...] in one array."""
        chains: list[list[int]] = []
        chain_of = np.empty(len(self.nodes), dtype=np.int64)
        tail_of: dict[int, int] = {}  # chain -> its last op, while it can still grow
        self._parent: list[int] = []  # per chain: the fork op its head continues, or -1 (a join)
        for i, preds in enumerate(self._preds):
            grown = len(preds) == 1 and tail_of.get(int(chain_of[preds[0]])) == preds[0]
            if grown:
                c = int(chain_of[preds[0]])
                chains[c].append(i)
            else:
                c = len(chains)
                chains.append([i])
                self._parent.append(preds[0] if len(preds) == 1 else -1)
            chain_of[i] = c
            tail_of[c] = i
        self._chain_of = chain_of
        self._chain_nodes = [np.array(c, dtype=np.int64) for c in chains]
        self._position = np.empty(len(self.nodes), dtype=np.int64)
        self._bounds: list[tuple[int, int]] = []
        gap_pos = np.empty(len(self.nodes), dtype=np.int64)
        offset = 0
        for chain in chains:
            self._position[chain] = np.arange(len(chain))
            gap_pos[chain] = offset + 1 + 2 * np.arange(len(chain))
            self._bounds.append((offset, offset + 1 + 2 * len(chain)))
            offset += 1 + 2 * len(chain)
        self._dur_pos = gap_pos + 1
        self._template = np.zeros(offset)
        self._template[gap_pos] = self.gap
        self.feeds_join = {p for preds in self._preds if len(preds) > 1 for p in preds}

    def run(self, dur: np.ndarray | None = None, moved: frozenset[int] = frozenset()) -> Timing:
        """Replay with op durations ``dur`` (default: the recorded ones). A predecessor in
        ``moved`` is consulted last where several end at the same time (an op inserted after it
        took its place in its successors' lists)."""
        seq = self._template.copy()
        seq[self._dur_pos] = self.dur if dur is None else dur
        start = np.empty(len(self.nodes))
        end = np.empty(len(self.nodes))
        head_blocker = []
        for c, nodes in enumerate(self._chain_nodes):
            head, parent = int(nodes[0]), self._parent[c]
            preds = self._preds[head]
            if parent >= 0:
                blocker = parent
            elif preds:
                if moved and not moved.isdisjoint(preds):
                    preds = [p for p in preds if p not in moved] + [p for p in preds if p in moved]
                blocker = max(preds, key=end.__getitem__)
            else:
                blocker = -1
            head_blocker.append(blocker)
            lo, hi = self._bounds[c]
            seq[lo] = end[blocker] if blocker >= 0 else 0.0
            acc = np.add.accumulate(seq[lo:hi])
            start[nodes] = acc[1::2]
            end[nodes] = acc[2::2]
        last = max(self._ends, key=end.__getitem__)
        return Timing(start, end, float(end[last]), last, head_blocker)

    def end_times(self, timing: Timing) -> dict[str, float]:
        """Each op's end in ``timing``, by node."""
        return dict(zip(self.nodes, timing.end.tolist(), strict=True))

    def exposed_comm_us(self, timing: Timing) -> float:
        """How long the all-reduces run past the last backward op in ``timing``: the gradient
        communication backward did not hide."""
        if not self._all_reduces or not self._backward:
            return 0.0
        return max(0.0, float(timing.end[self._all_reduces].max() - timing.end[self._backward].max()))

    def layer_totals(self, values: np.ndarray, kinds: tuple[str, ...]) -> dict[str, float]:
        """``values`` (one per op) summed per layer over its ops of ``kinds``, in graph order."""
        if kinds not in self._layer_groups:
            ops = [i for i in self._graph_order if self.layers[i] is not None and self.kinds[i] in kinds]
            names = list(dict.fromkeys(self.layers[i] for i in ops))
            slot = {name: k for k, name in enumerate(names)}
            group = np.array([slot[self.layers[i]] for i in ops], dtype=np.int64)
            self._layer_groups[kinds] = (names, np.array(ops, dtype=np.int64), group)
        names, ops, group = self._layer_groups[kinds]
        sums = np.bincount(group, weights=values[ops], minlength=len(names))
        return dict(zip(names, sums.tolist(), strict=True))

    def critical_path(self, timing: Timing) -> np.ndarray:
        """The ops (indices, in order) from the step's start to its last end, each the one that
        made the next wait."""
        parts = []
        node = timing.last
        while node >= 0:
            c = int(self._chain_of[node])
            parts.append(self._chain_nodes[c][: self._position[node] + 1])
            node = timing.head_blocker[c]
        return np.concatenate(parts[::-1])

    def critical_share(self, path: np.ndarray, dur: np.ndarray | None = None) -> dict[str, float]:
        """Fractions of the critical ``path`` spent in compute, communication and host gaps."""
        dur = self.dur if dur is None else dur
        totals = {
            "compute": float(dur[path][self._compute[path]].sum()),
            "communication": float(dur[path][self._comm[path]].sum()),
            "host": float(self.gap[path].sum()),
        }
        whole = sum(totals.values()) or 1.0
        return {k: v / whole for k, v in totals.items()}


def replay(graph: nx.DiGraph) -> ReplayResult:
    """Simulate ``graph`` (see `qsync_callback.predictor.graph`); times are relative to step start."""
    compiled = CompiledGraph(graph)
    timing = compiled.run()
    path = compiled.critical_path(timing)
    return ReplayResult(
        step_us=timing.step_us,
        start=dict(zip(compiled.nodes, timing.start.tolist(), strict=True)),
        end=dict(zip(compiled.nodes, timing.end.tolist(), strict=True)),
        critical_path=[compiled.nodes[i] for i in path],
        critical_share=compiled.critical_share(path),
    )
