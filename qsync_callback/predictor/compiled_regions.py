"""Price compiled regions without compiling: what a module's ops would cost as one
``torch.compile`` (inductor) region, from its recorded eager ops (seed 001's operator fusion, on
stock PyTorch).

A region is one module (a layer or a block holding layers). Its ops are the recorded forward ops
attributed to it or to a module inside it (``module`` in the graph; `recorder/kineto.py`) and the
backward ops of those (autograd's nodes; AccumulateGrad stays outside: the compiled backward still
hands each gradient to it). Each direction, forward and backward, is priced apart:

- **library kernels** (`LIBRARY`: matmuls, convolutions, attention, embeddings, recurrent cells),
  which inductor leaves to the same library calls, keep their recorded time, and so do the ops
  drawing random numbers (dropout), which inductor's code draws no faster;
- **views** (`VIEWS`: reshapes, transposes, splits) cost nothing compiled: they become indexing;
- every other op is **fusible** (pointwise and reductions). Each maximal chain of fusible ops between
  two library kernels becomes fused kernels (one per reduction in it, at least one), each costing
  ``kernel_us``; the chain moves its inputs and its output once, at ``bytes_per_us``, where eager
  moved every op's inputs and output;
- the host gaps between the region's ops (the dispatcher, Python) go, and the region pays
  ``region_us`` per direction (the guards and the compiled autograd function's wrapper).

An eager fusible op's time is ``op_us + bytes / bytes_per_us``: both are fitted on the recorded
forward ops with input shapes (`fit_fusion_costs`); a backward op (which the profiler records
without shapes) moves ``(dur - op_us) * bytes_per_us`` bytes, and fused it moves the share of them
its region's forward chains kept. ``kernel_us`` and ``region_us`` come from regions compiled during
the warm-up where there are any (`recorder/region_probes.py`, ``Trace.compiled_regions``), else from
`DEFAULT_KERNEL_US` and `DEFAULT_REGION_US` (and the plan says so).

Measured first: a module with the recorded ops and shapes of one compiled during the warm-up (the
model's repeated block, and every copy of it; where no block repeats alike, its largest block),
alone or inside a larger region, is priced at that one's measured compiled-to-eager ratio, not the
model's (`measured_parts`); the model prices the rest, its constants fitted on the small probes
(`calibrate`). On this CPU the two differ most where inductor's code is slower than
eager's for reasons the model does not see (a transformer layer's dropout: 20% slower compiled).

A region's compile time is ``compile_s_fixed`` plus ``compile_s_per_op`` seconds per op, a line
fitted on the probes' compiles (one probe, or probes of one size: per op only; none:
`DEFAULT_COMPILE_S_PER_OP`); a module of the same class and parameter shapes as one already
compiled in the plan reuses its code (dynamo's cache, measured: a second identical block compiled in
under a second where the first took 35 s) and costs `REUSE_COMPILE_S`.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import holds
from qsync_callback.predictor.graph import build_global_graph
from qsync_callback.recorder.kineto import ACCUMULATE_GRAD, BACKWARD_PREFIX, DTYPE_BYTES
from qsync_callback.recorder.trace import Trace

LIBRARY = frozenset(
    {
        "linear", "addmm", "mm", "bmm", "matmul", "baddbmm", "addbmm", "einsum",
        "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose2d",
        "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
        "scaleddotproductflashattentionforcpu", "scaleddotproductefficientattention",
        "scaleddotproductflashattention", "embedding", "embeddingbag", "embedding_bag",
        "lstm", "gru", "rnn_tanh", "rnn_relu", "mkldnnrnnlayer", "cudnnrnn",
    }
)  # fmt: skip
# forward ops drawing random numbers: inductor's code draws them no faster (a transformer layer with
# dropout ran 17% slower compiled here), so they keep their time (their backward, a multiply by the
# mask, fuses)
RANDOM = frozenset(
    {
        "dropout", "native_dropout", "feature_dropout", "alpha_dropout", "bernoulli", "bernoulli_",
        "rand", "randn", "rand_like", "randn_like",
    }
)  # fmt: skip
VIEWS = frozenset(
    {
        "view", "reshape", "_unsafe_view", "unsafeview", "transpose", "t", "permute", "split",
        "split_with_sizes", "chunk", "slice", "select", "expand", "unsqueeze", "squeeze", "flatten",
        "unflatten", "detach", "alias", "as_strided", "narrow", "unbind", "contiguous", "clone",
    }
)  # fmt: skip
REDUCTIONS = re.compile(r"norm|softmax|sum|mean|var|std|nll|cross_entropy|amax|amin|logsumexp|max_pool")
LIBRARY_KIND, VIEW_KIND, FUSIBLE_KIND = "library", "view", "fusible"

DEFAULT_KERNEL_US = 10.0
DEFAULT_REGION_US = 80.0
DEFAULT_COMPILE_S_PER_OP = 0.5
REUSE_COMPILE_S = 1.0
SMALL_PROBE_KERNELS = 2  # probes of at most this many fused kernels fit the constants (`calibrate`)
_LARGE_OP_BYTES = 64 * 1024  # ops moving at least this much fit the bandwidth; smaller ones op_us


def base_name(name: str) -> str:
    """The op's name without its namespace and, for a backward node, without ``Backward<k>``:
    ``aten::layer_norm`` -> ``layer_norm``; ``...evaluate_function: NativeLayerNormBackward0`` ->
    ``nativelayernorm``."""
    if name.startswith(BACKWARD_PREFIX):
        node = name.rsplit(" ", 1)[-1]
        return re.sub(r"Backward\d*$", "", node).lower()
    return name.rsplit("::", 1)[-1].lower()


def op_category(name: str) -> str:
    """`LIBRARY_KIND`, `VIEW_KIND` or `FUSIBLE_KIND` (see the module docstring)."""
    base = base_name(name)
    if base in RANDOM and not name.startswith(BACKWARD_PREFIX):
        return LIBRARY_KIND
    if base in LIBRARY or base.removeprefix("native") in LIBRARY or base.endswith("convolution"):
        return LIBRARY_KIND
    if base in VIEWS:
        return VIEW_KIND
    return FUSIBLE_KIND


def _is_reduction(name: str) -> bool:
    return bool(REDUCTIONS.search(base_name(name)))


def input_bytes(shapes: Sequence, dtypes: Sequence) -> list[int]:
    """Bytes of each tensor input (a shape of integers; scalars and lists of tensors count 0)."""
    out = []
    for shape, dtype in zip(shapes, dtypes, strict=False):
        if isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape):
            numel = 1
            for d in shape:
                numel *= d
            out.append(numel * DTYPE_BYTES.get(dtype, 4))
        else:
            out.append(0)
    return out


def moved_bytes(shapes: Sequence, dtypes: Sequence) -> int:
    """What an eager op reads and writes: its tensor inputs, and an output the size of the largest."""
    sizes = input_bytes(shapes, dtypes)
    return sum(sizes) + max(sizes, default=0)


@dataclass(frozen=True)
class FusionCosts:
    """The fusion cost model's constants on this machine (see the module docstring)."""

    op_us: float  # an eager fusible op's own cost, beyond its bytes
    bytes_per_us: float  # memory bandwidth of pointwise work
    kernel_us: float = DEFAULT_KERNEL_US  # per fused kernel
    region_us: float = DEFAULT_REGION_US  # per compiled region, per direction
    compile_s_per_op: float = DEFAULT_COMPILE_S_PER_OP
    compile_s_fixed: float = 0.0
    # per module compiled during the warm-up: its measured compiled-to-eager time ratio
    measured_ratio: tuple[tuple[str, float], ...] = ()
    source: str = "defaults"  # where kernel_us, region_us and compile_s_per_op come from

    def to_dict(self) -> dict[str, float | str]:
        return {
            "op_us": self.op_us,
            "bytes_per_us": self.bytes_per_us,
            "kernel_us": self.kernel_us,
            "region_us": self.region_us,
            "compile_s_per_op": self.compile_s_per_op,
            "compile_s_fixed": self.compile_s_fixed,
            "measured_ratio": dict(self.measured_ratio),
            "source": self.source,
        }


@dataclass(frozen=True)
class RegionCost:
    """One region's recorded (eager) and predicted (compiled) time per step, in microseconds."""

    module: str
    eager_us: float
    compiled_us: float
    ops: int
    library_us: float
    fused_kernels: int
    compile_s: float
    # of compiled_us, the parts priced at the measured ratio of a module of the same ops compiled
    # during the warm-up; the rest is the model's
    measured_us: float = 0.0

    @property
    def measured(self) -> bool:
        return self.measured_us > 0

    @property
    def saving_us(self) -> float:
        return self.eager_us - self.compiled_us

    def saving_beyond_us(self, optimism: float) -> float:
        """The saving should the model's part of the compiled time be ``optimism`` (a share) more than
        it priced: what a region saves beyond the model's error (the planner's `model_optimism`)."""
        return self.saving_us - optimism * (self.compiled_us - self.measured_us)


def region_nodes(graph: nx.DiGraph, module: str) -> dict[int, tuple[list[str], list[str]]]:
    """Per rank: the forward and the backward nodes of ``module``'s region, in recorded order."""
    prefix = module + "."
    found: dict[int, tuple[list[str], list[str]]] = {}
    for node, attrs in graph.nodes(data=True):
        owner = attrs.get("module")
        if owner is None or not (owner == module or owner.startswith(prefix)):
            continue
        if attrs["kind"] not in ("forward", "backward") or ACCUMULATE_GRAD in attrs["name"]:
            continue
        forward, backward = found.setdefault(attrs["rank"], ([], []))
        (forward if attrs["kind"] == "forward" else backward).append(node)
    for forward, backward in found.values():
        forward.sort(key=lambda n: graph.nodes[n]["op_id"])
        backward.sort(key=lambda n: graph.nodes[n]["op_id"])
    return found


def fit_fusion_costs(
    graphs: Iterable[nx.DiGraph], probes: Mapping[str, Mapping] | None = None
) -> FusionCosts:
    """``op_us`` and ``bytes_per_us`` from the recorded forward fusible ops with input shapes (the
    median time of the small ones; the bytes over the time beyond ``op_us`` of the large ones), and
    the compiled constants from ``probes`` (`calibrate`) where given."""
    graphs = list(graphs)
    small, large = [], []
    for graph in graphs:
        for _, attrs in graph.nodes(data=True):
            if attrs["kind"] != "forward" or op_category(attrs["name"]) != FUSIBLE_KIND:
                continue
            moved = moved_bytes(attrs.get("shapes") or [], attrs.get("dtypes") or [])
            if moved == 0:
                continue
            (large if moved >= _LARGE_OP_BYTES else small).append((moved, attrs["dur"]))
    op_us = statistics.median([dur for _, dur in small]) if small else DEFAULT_KERNEL_US
    moved = sum(b for b, _ in large)
    busy = sum(max(dur - op_us, 0.0) for _, dur in large)
    bytes_per_us = moved / busy if large and busy > 0 else 1e4  # 10 GB/s when nothing says
    costs = FusionCosts(op_us=op_us, bytes_per_us=bytes_per_us)
    return calibrate(costs, graphs if probes else [], probes or {})


def region_signature(graph: nx.DiGraph, module: str) -> tuple:
    """What the compiled code of ``module`` depends on: its forward ops' names and input shapes
    (two identical blocks have the same)."""
    per_rank = region_nodes(graph, module)
    if not per_rank:
        return ()
    forward, _ = per_rank[min(per_rank)]
    return tuple((graph.nodes[n]["name"], repr(graph.nodes[n].get("shapes"))) for n in forward)


def measured_ratios(graph: nx.DiGraph, costs: FusionCosts) -> dict[tuple, float]:
    """The measured compiled-to-eager ratio of each module compiled during the warm-up, by its
    signature on ``graph`` (`region_signature`): what a module of the same ops is priced at."""
    found = {region_signature(graph, module): ratio for module, ratio in costs.measured_ratio}
    found.pop((), None)
    return found


def price_region(
    graph: nx.DiGraph, module: str, costs: FusionCosts, measured: Mapping[tuple, float] | None = None
) -> RegionCost | None:
    """``module``'s region on ``graph``'s slowest rank (the recorded eager time of its ops and the
    gaps between them, against the compiled prediction), or None if it recorded no ops. The parts of
    it with the ops of a module compiled during the warm-up (itself, or blocks inside it: the
    outermost such; ``measured``, by signature, default `measured_ratios`) are priced at that one's
    measured ratio, the rest by the model."""
    per_rank = region_nodes(graph, module)
    if not per_rank:
        return None
    measured = measured_ratios(graph, costs) if measured is None else measured
    priced = [
        _price_rank(graph, module, forward, backward, costs, measured)
        for forward, backward in per_rank.values()
    ]
    return max(priced, key=lambda c: c.eager_us)


def measured_parts(
    graph: nx.DiGraph, module: str, forward: list[str], measured: Mapping[tuple, float]
) -> list[tuple[str, float]]:
    """The outermost modules in ``module``'s region (itself included) whose forward ops (on this
    rank: ``forward``) have the signature of a module compiled during the warm-up, with its ratio."""
    if not measured:
        return []
    inner: dict[str, list[str]] = {}
    for n in forward:
        owner = graph.nodes[n]["module"]
        parts = owner.split(".")
        top = len(module.split("."))
        for k in range(top, len(parts) + 1):
            inner.setdefault(".".join(parts[:k]), []).append(n)
    found: list[tuple[str, float]] = []
    for name in sorted(inner, key=lambda m: m.count(".")):
        if any(holds(p, name) for p, _ in found):
            continue
        signature = tuple((graph.nodes[n]["name"], repr(graph.nodes[n].get("shapes"))) for n in inner[name])
        if signature in measured:
            found.append((name, measured[signature]))
    return found


def _split_measured(
    graph: nx.DiGraph, parts: list[tuple[str, float]], nodes: list[str]
) -> tuple[list[tuple[list[str], float]], list[str]]:
    """``nodes`` split into each measured part's (with its ratio) and the rest."""
    owned: list[tuple[list[str], float]] = [([], ratio) for _, ratio in parts]
    rest = []
    for n in nodes:
        owner = graph.nodes[n]["module"]
        k = next((i for i, (p, _) in enumerate(parts) if holds(p, owner)), None)
        (owned[k][0] if k is not None else rest).append(n)
    return owned, rest


def _price_rank(
    graph: nx.DiGraph,
    module: str,
    forward: list[str],
    backward: list[str],
    costs: FusionCosts,
    measured: Mapping[tuple, float],
) -> RegionCost:
    parts = measured_parts(graph, module, forward, measured)
    measured_fwd, rest_fwd = _split_measured(graph, parts, forward)
    measured_bwd, rest_bwd = _split_measured(graph, parts, backward)
    kept_share = _kept_share(graph, rest_fwd)
    priced = [
        _price_direction(graph, rest_fwd, costs, kept_share, is_forward=True),
        _price_direction(graph, rest_bwd, costs, kept_share, is_forward=False),
    ]
    scaled = sum(ratio * _eager_us(graph, nodes) for nodes, ratio in [*measured_fwd, *measured_bwd])
    ops = len(forward) + len(backward)
    return RegionCost(
        module=module,
        eager_us=_eager_us(graph, forward) + _eager_us(graph, backward),
        compiled_us=sum(p[1] for p in priced) + scaled,
        ops=ops,
        library_us=sum(p[2] for p in priced),
        fused_kernels=sum(p[3] for p in priced),
        compile_s=costs.compile_s_fixed + costs.compile_s_per_op * ops,
        measured_us=scaled,
    )


def _eager_us(graph: nx.DiGraph, nodes: list[str]) -> float:
    """The ops' recorded time and the host gaps between them (not the one before the first)."""
    return sum(graph.nodes[n]["dur"] for n in nodes) + sum(graph.nodes[n]["gap"] for n in nodes[1:])


def _price_direction(
    graph: nx.DiGraph, nodes: list[str], costs: FusionCosts, kept_share: float, is_forward: bool
) -> tuple[float, float, float, int]:
    """One direction's eager time (its ops and the gaps between them), compiled time, library time
    and fused kernels."""
    if not nodes:
        return 0.0, 0.0, 0.0, 0
    library = sum(graph.nodes[n]["dur"] for n in nodes if op_category(graph.nodes[n]["name"]) == LIBRARY_KIND)
    chains = _chains(graph, nodes)
    fused = sum(_chain_us(graph, chain, costs, kept_share, is_forward) for chain in chains)
    return (
        _eager_us(graph, nodes),
        library + fused + costs.region_us,
        library,
        sum(_kernels(graph, c) for c in chains),
    )


def _chains(graph: nx.DiGraph, nodes: list[str]) -> list[list[str]]:
    """The maximal runs of fusible ops between library kernels (views neither start nor end one)."""
    chains: list[list[str]] = [[]]
    for n in nodes:
        kind = op_category(graph.nodes[n]["name"])
        if kind == LIBRARY_KIND and chains[-1]:
            chains.append([])
        elif kind == FUSIBLE_KIND:
            chains[-1].append(n)
    return [chain for chain in chains if chain]


def _kernels(graph: nx.DiGraph, chain: list[str]) -> int:
    return max(1, sum(_is_reduction(graph.nodes[n]["name"]) for n in chain))


def _forward_chain_bytes(graph: nx.DiGraph, chain: list[str]) -> tuple[int, int]:
    """What a forward chain moves fused (its first op's inputs, the others' further inputs, one
    output: never more than eager) and eager (every op's inputs and output)."""
    inputs = [
        input_bytes(graph.nodes[n].get("shapes") or [], graph.nodes[n].get("dtypes") or []) for n in chain
    ]
    eager = sum(sum(i) + max(i, default=0) for i in inputs)
    fused = sum(inputs[0]) + sum(sum(i[1:]) for i in inputs[1:]) + max(inputs[-1], default=0)
    return min(fused, eager), eager


def _kept_share(graph: nx.DiGraph, forward: list[str]) -> float:
    """The share of its fusible ops' bytes a region's forward chains still move fused (1 where
    nothing recorded their shapes): what its backward chains are taken to keep too."""
    moved = [_forward_chain_bytes(graph, chain) for chain in _chains(graph, forward)]
    eager = sum(e for _, e in moved)
    return sum(f for f, _ in moved) / eager if eager else 1.0


def _chain_us(
    graph: nx.DiGraph, chain: list[str], costs: FusionCosts, kept_share: float, is_forward: bool
) -> float:
    """One fused chain's predicted time: its kernels, and its bytes at ``bytes_per_us`` (a forward
    chain's from its shapes; a backward chain's from its eager time, times ``kept_share``)."""
    launch = _kernels(graph, chain) * costs.kernel_us
    if is_forward:
        return launch + _forward_chain_bytes(graph, chain)[0] / costs.bytes_per_us
    eager_bytes = sum(max(graph.nodes[n]["dur"] - costs.op_us, 0.0) for n in chain) * costs.bytes_per_us
    return launch + kept_share * eager_bytes / costs.bytes_per_us


def calibrate(costs: FusionCosts, graphs: Sequence[nx.DiGraph], probes: Mapping[str, Mapping]) -> FusionCosts:
    """``costs`` with ``kernel_us``, ``region_us`` and ``compile_s_per_op`` fitted on regions compiled
    during the warm-up: each probe (`recorder/region_probes.py`) measured a module's eager and
    compiled forward+backward and its compile time. ``region_us`` and ``kernel_us`` are solved so that
    the model's compiled time matches the measured one, the eager-to-compiled time ratio carried
    over to the recorded ops (the probe ran the module alone, outside the step), on the probes of at
    most `SMALL_PROBE_KERNELS` fused kernels where there are any (a Linear, a LayerNorm: the block
    probed beside them mixes in what the model does not see, such as dropout's random numbers,
    which inductor makes slower here); with one probe, ``kernel_us`` keeps its default and
    ``region_us`` takes the rest. Each probe's measured ratio is kept (``measured_ratio``): a module
    with its ops is priced at it (`price_region`). Returns ``costs`` unchanged when no probe
    measured a compiled time."""
    rows = []
    ratios: list[tuple[str, float]] = []
    for module, probe in probes.items():
        if (
            not probe.get("compiled_us")
            or not probe.get("eager_us")
            or probe.get("graphs", 1) != 1
            or not graphs
        ):
            continue
        recorded = [c for g in graphs if (c := price_region(g, module, costs, {})) is not None]
        if not recorded:
            continue
        cost = min(recorded, key=lambda c: c.eager_us)
        measured_compiled = cost.eager_us * probe["compiled_us"] / probe["eager_us"]
        base = cost.compiled_us - cost.fused_kernels * costs.kernel_us - 2 * costs.region_us
        rows.append((cost, measured_compiled - base, probe.get("compile_s"), cost.ops))
        ratios.append((module, probe["compiled_us"] / probe["eager_us"]))
    if not rows:
        return costs
    small = [row for row in rows if row[0].fused_kernels <= SMALL_PROBE_KERNELS]
    kernel_us, region_us = _solve_constants(small or rows, costs.kernel_us)
    compiles = [(ops, s) for _, _, s, ops in rows if s]
    fixed, per_op = _fit_line(compiles) if compiles else (costs.compile_s_fixed, costs.compile_s_per_op)
    return FusionCosts(
        op_us=costs.op_us,
        bytes_per_us=costs.bytes_per_us,
        kernel_us=kernel_us,
        region_us=region_us,
        compile_s_per_op=per_op,
        compile_s_fixed=fixed,
        measured_ratio=tuple(ratios),
        source=f"calibrated on {len(rows)} compiled region(s): {', '.join(c.module for c, *_ in rows)}",
    )


def _fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Intercept and slope (both at least 0) of seconds against ops; through 0 where the points do
    not tell them apart (one size) or the line would fall below it."""
    n = len(points)
    mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread > 0:
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
        if slope >= 0 and mean_y - slope * mean_x >= 0:
            return mean_y - slope * mean_x, slope
    return 0.0, sum(y for _, y in points) / sum(x for x, _ in points)


def _solve_constants(
    rows: list[tuple[RegionCost, float, float | None, int]], kernel_us: float
) -> tuple[float, float]:
    """``kernel_us`` and ``region_us`` such that ``kernels * kernel_us + 2 * region_us = rest`` for the
    probes (both at least 0): ``region_us`` from the probes with no fused kernel (a Linear alone),
    then ``kernel_us`` from the others; without a probe of no fused kernel, by least squares over
    probes of different kernel counts, else with ``kernel_us`` kept."""
    plain = [rest for cost, rest, *_ in rows if cost.fused_kernels == 0]
    fused = [(cost.fused_kernels, rest) for cost, rest, *_ in rows if cost.fused_kernels > 0]
    if plain:
        region_us = max(sum(plain) / len(plain) / 2, 0.0)
        if fused:
            kernel_us = max(sum(rest - 2 * region_us for _, rest in fused) / sum(k for k, _ in fused), 0.0)
        return kernel_us, region_us
    if len({k for k, _ in fused}) >= 2:
        n = len(fused)
        mean_k, mean_rest = sum(k for k, _ in fused) / n, sum(r for _, r in fused) / n
        slope = sum((k - mean_k) * (r - mean_rest) for k, r in fused) / sum(
            (k - mean_k) ** 2 for k, _ in fused
        )
        if slope >= 0:
            return slope, max((mean_rest - slope * mean_k) / 2, 0.0)
    rest = sum(r for _, r in fused) / len(fused)
    kernels = sum(k for k, _ in fused) / len(fused)
    return kernel_us, max((rest - kernels * kernel_us) / 2, 0.0)


def apply_regions(graph: nx.DiGraph, regions: Sequence[str], costs: FusionCosts) -> nx.DiGraph:
    """A copy of ``graph`` with each region's ops as compiled: library ops keep their time, view ops
    take none, each fused chain's time goes to its first op (the rest take none), the gaps between the
    region's ops go, and the region's own cost goes to its first op in each direction; the parts of
    a region with the ops of a module compiled during the warm-up (`measured_parts`) have their ops
    and gaps scaled by that one's measured ratio instead. Each backward op of a region is marked with
    its ``region`` (its gradients are ready when the region's backward ends: `tensor_fusion.py`)."""
    out = graph.copy()
    measured = measured_ratios(graph, costs)
    for module in regions:
        for forward, backward in region_nodes(graph, module).values():
            for n in backward:
                out.nodes[n]["region"] = module
            parts = measured_parts(graph, module, forward, measured)
            measured_fwd, rest_fwd = _split_measured(graph, parts, forward)
            measured_bwd, rest_bwd = _split_measured(graph, parts, backward)
            for nodes, ratio in [*measured_fwd, *measured_bwd]:
                _scale_nodes(out, nodes, ratio)
            kept_share = _kept_share(graph, rest_fwd)
            _compile_nodes(out, graph, rest_fwd, costs, kept_share, is_forward=True)
            _compile_nodes(out, graph, rest_bwd, costs, kept_share, is_forward=False)
            # inside the region no host gap is left between its parts (as `_price_rank` prices it)
            heads = {nodes[0] for nodes, _ in [*measured_fwd, *measured_bwd] if nodes}
            heads |= {nodes[0] for nodes in (rest_fwd, rest_bwd) if nodes}
            for n in heads - {nodes[0] for nodes in (forward, backward) if nodes}:
                out.nodes[n]["gap"] = 0.0
    return out


def _scale_nodes(out: nx.DiGraph, nodes: list[str], ratio: float) -> None:
    """The ops and the gaps between them ``ratio`` times as long (a measured region's time)."""
    for i, n in enumerate(nodes):
        out.nodes[n]["dur"] *= ratio
        if i:
            out.nodes[n]["gap"] *= ratio


def _compile_nodes(
    out: nx.DiGraph,
    graph: nx.DiGraph,
    nodes: list[str],
    costs: FusionCosts,
    kept_share: float,
    is_forward: bool,
) -> None:
    if not nodes:
        return
    first_of = {chain[0]: chain for chain in _chains(graph, nodes)}
    for i, n in enumerate(nodes):
        attrs = out.nodes[n]
        if i:
            attrs["gap"] = 0.0
        if op_category(attrs["name"]) == LIBRARY_KIND:
            continue
        chain = first_of.get(n)
        attrs["dur"] = _chain_us(graph, chain, costs, kept_share, is_forward) if chain else 0.0
    out.nodes[nodes[0]]["dur"] += costs.region_us


def region_candidates(owners: Iterable[str | None], called_blocks: Iterable[str] | None = None) -> list[str]:
    """Every module among ``owners`` (the modules that ran recorded forward ops: `forward_owners`) and
    every block holding one (each dotted prefix of its name) whose forward ran (``called_blocks``,
    `Trace.compiled_regions`; None: every block, for traces that do not say), sorted."""
    owned = {owner for owner in owners if owner is not None}
    found: set[str] = set(owned)
    for owner in owned:
        parts = owner.split(".")
        found.update(".".join(parts[:k]) for k in range(1, len(parts)))
    if called_blocks is not None:
        found &= owned | set(called_blocks)
    return sorted(found)


def forward_owners(graph: nx.DiGraph) -> list[str | None]:
    """The module of each forward node of ``graph``."""
    return [attrs.get("module") for _, attrs in graph.nodes(data=True) if attrs["kind"] == "forward"]


def payback_gate(trace: Trace, steps_left: int, called_blocks: Iterable[str] | None = None) -> str | None:
    """Why no module is worth compiling during the warm-up to calibrate on, or None: whether any one
    region, or every copy of one (identical modules, none holding another, compile once and reuse
    the code: `REUSE_COMPILE_S` each after the first, as the planner counts them), at the
    uncalibrated costs on the trace's first recorded step, saves more over ``steps_left`` steps
    than its compile takes (`recorder/region_probes.py`'s gate)."""
    graph = build_global_graph([trace], 0)
    costs = fit_fusion_costs([graph])
    copies: dict[tuple, list[RegionCost]] = {}
    for module in region_candidates(forward_owners(graph), called_blocks):
        cost = price_region(graph, module, costs)
        if cost is not None and cost.saving_us > 0:
            copies.setdefault(region_signature(graph, module), []).append(cost)
    for alike in copies.values():
        apart = [c for c in alike if not any(holds(o.module, c.module) for o in alike if o is not c)]
        saving_us = 0.0
        for reused, cost in enumerate(apart):
            saving_us += cost.saving_us
            if saving_us * steps_left / 1e6 > apart[0].compile_s + REUSE_COMPILE_S * reused:
                return None
    return f"no region pays for its compile in the {steps_left} steps left at the uncalibrated costs"


def check_region_plan(traces: Sequence[Trace], regions: Sequence[Sequence[str]], source: str) -> None:
    """Refuse regions this model cannot price: on a trace not from torch, a region that is not one
    module name, or a module that ran no recorded op or whose forward never ran (QSyncInputError,
    naming them)."""
    if not regions:
        return
    if traces[0].framework != "torch":
        raise QSyncInputError(f"{source}: compiled regions are priced on torch traces only")
    bad = [region for region in regions if len(region) != 1]
    if bad:
        raise QSyncInputError(f"{source}: a torch region names one module; got {bad[:3]}")
    if all(op.module is None for op in traces[0].ops):
        raise QSyncInputError(
            f"{source}: the trace names no op's module (recorded before modules were recorded): "
            "record it again to price compiled regions"
        )
    called = traces[0].compiled_regions.get("called_blocks")
    known = set(region_candidates((op.module for op in traces[0].ops if op.kind == "forward"), called))
    missing = [region[0] for region in regions if region[0] not in known]
    if missing:
        raise QSyncInputError(
            f"{source}: no recorded op ran in module(s) {', '.join(map(repr, missing[:5]))}"
        )
