"""A learned per-op cost model (CDMPP's idea, on framework-level features): what an op costs on
this device, for ops and models never profiled, trained on the ops this device has recorded.

Features of an op (`op_features`): its type and its first float input's dtype (categories), its
FLOPs, the bytes its tensor inputs read and the bytes it allocates, the largest input's element
count and rank, the number of tensor inputs, its arithmetic intensity (FLOPs per byte moved), and
whether it writes in place, the intra-op threads it ran on (a data set holds every thread count
its device was recorded at, `recorder/op_dataset.py`: what threads change is learned where it
holds more than one), and its time on a nominal machine (`nominal_us`). A gradient-boosted
tree ensemble (scikit-learn's ``HistGradientBoostingRegressor``, absolute error: a median) predicts the
log of its time over the nominal one, each distinct op of a trace weighted by how often it ran.
(Its loss and leaf size were chosen by holding each benchmark family out in turn,
`benchmarks/op_cost_model.py`: among five settings, the one with the least held-out step error.)

With ``tvm=True`` each op's features also hold TVM's (`tvm_features.py`: its call lowered to TIR
kernels, their loop iterations, TIR FLOPs, bytes read and written; CDMPP's compiler-level
features), missing (NaN, which the trees route on their own) for an op without a recorded call or
one TVM cannot lower. Their worth is measured, not assumed: `benchmarks/op_cost_model.py` holds
each family out with and without them.

The host's time between ops (Python, autograd's bookkeeping, freeing what the ops allocated, the
optimizer's and Lightning's loops) is taken apart from the recorded steps: a step's length less its
ops' time and its data loader's fetch (timed apart by an estimate, `recorder/data_loading.py`).
It grows with the step's ops and with the bytes they allocate (`HostTime`, fitted over the
recorded traces by `fit_host_time`; a single figure a step where too few traces differ to fit
more): the 13 benchmark families' recorded steps spent 3.1-3.2 ms outside their ops (an LSTM's,
an embedding model's: 175 ops allocating 33-38 MB) to 8.8-9.3 ms (a MobileNet's 320 ops allocating
470 MB, a GRU's 2600 ops, an MLP-Mixer's 880). Against each family's own steps, held out of the fit,
the fitted host time's median error was 0.6-1.5 ms a step, one figure a step's 0.9-2.3 ms
(`benchmarks/op_cost_model.py`).

Training data is this device's data set (`recorder/op_dataset.py`): no extra runs. The model is
refitted from it when asked (a second or less), never stored: the data set is JSON, the model is
not pickled.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qsync_callback.predictor.compiled_regions import input_bytes
from qsync_callback.predictor.tvm_features import TVM_FEATURES, features_of
from qsync_callback.recorder.kineto import float_dtype
from qsync_callback.recorder.op_dataset import load_dataset
from qsync_callback.recorder.op_samples import op_class

FEATURES = (
    "type", "class", "dtype", "log2 FLOPs", "log2 bytes read", "log2 bytes allocated",
    "log2 largest input elements", "largest input rank", "tensor inputs", "log2 FLOPs per byte",
    "in place", "threads", "log2 nominal us",
)  # fmt: skip
# the nominal machine an op's time is learned against (its target is the log of the measured time
# over the nominal one): 1 us a call, 100 GFLOP/s, 20 GB/s. Trees do not extrapolate: learned as a
# ratio to this, an op larger than any measured one keeps the ratio of the largest.
NOMINAL_CALL_US, NOMINAL_FLOPS_PER_US, NOMINAL_BYTES_PER_US = 1.0, 1e5, 2e4
CATEGORICAL = (0, 1, 2)
NOMINAL = len(FEATURES) - 1
UNKNOWN_TYPE = "?"  # the type of an op whose type was never measured: its class speaks for it
UNKNOWN_WEIGHT = 0.5
MIN_OPS = 20  # distinct measured ops below which no model is fitted (the roofline prices instead)
MIN_HOST_TRACES = 3  # traces of distinct op counts and bytes below which the host time is one figure
MIN_US = 0.1  # an op measured shorter (the profiler's cost taken off can leave 0) counts as this
TVM_SECONDS = 600.0  # at most this long lowering calls not cached yet (about 0.3 s each)


def op_features(
    name: str,
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[str],
    flops: float,
    out_bytes: int,
    threads: int | None = None,
) -> list[Any]:
    """The features of one op (see the module docstring), the two categories as strings;
    ``threads``: torch's intra-op threads it ran on (None: this process's)."""
    sizes = [math.prod(s) for s in shapes]
    read = sum(input_bytes(shapes, dtypes))
    largest = max(range(len(sizes)), key=sizes.__getitem__) if sizes else None
    dtype = float_dtype(dtypes) or (dtypes[0] if dtypes else "none")
    return [
        name,
        op_class(name, flops),
        dtype,
        math.log2(1 + flops),
        math.log2(1 + read),
        math.log2(1 + out_bytes),
        math.log2(1 + (sizes[largest] if largest is not None else 0)),
        len(shapes[largest]) if largest is not None else 0,
        len(shapes),
        math.log2((1 + flops) / (1 + read + out_bytes)),
        float(name.endswith("_")),
        float(threads or torch.get_num_threads()),
        math.log2(nominal_us(flops, read + out_bytes)),
    ]


def nominal_us(flops: float, moved_bytes: float) -> float:
    """An op's time on the nominal machine (`NOMINAL_CALL_US`...): a call, then the larger of its
    FLOPs and its bytes moved at the nominal rates."""
    return NOMINAL_CALL_US + max(flops / NOMINAL_FLOPS_PER_US, moved_bytes / NOMINAL_BYTES_PER_US)


@dataclass(frozen=True)
class HostTime:
    """The host's time in a step outside its ops (see the module docstring): ``per_step_us``, plus
    ``per_op_us`` for each of its ops and ``per_byte_us`` for each byte they allocate, both counted
    within the ranges the figures were fitted on (``ops_range``, ``bytes_range``): a fitted line
    is not trusted beyond its data (counted as they were, a GRU's 3106 ops against training steps
    of 100-750 priced its host time at 1.6-1.8 times what its steps measured)."""

    per_step_us: float
    per_op_us: float = 0.0
    per_byte_us: float = 0.0
    ops_range: tuple[float, float] = (0.0, math.inf)
    bytes_range: tuple[float, float] = (0.0, math.inf)

    def at(self, ops: int, out_bytes: float) -> float:
        """The host's time in a step of ``ops`` ops that allocate ``out_bytes`` bytes."""
        ops = min(max(ops, self.ops_range[0]), self.ops_range[1])
        out_bytes = min(max(out_bytes, self.bytes_range[0]), self.bytes_range[1])
        return self.per_step_us + self.per_op_us * ops + self.per_byte_us * out_bytes

    def describe(self) -> str:
        return (
            f"{self.per_step_us / 1e3:.2f} ms a step + {self.per_op_us:.2f} us an op + "
            f"{self.per_byte_us * 2**20:.1f} us a MiB allocated"
        )


def _host_gap_us(step: Mapping[str, float]) -> float:
    """A recorded step's length less its ops' time and its data loader's fetch (not the host's)."""
    return step["step_us"] - step["ops_us"] - step.get("data_us", 0.0)


def fit_host_time(traces: Sequence[Mapping[str, Any]]) -> HostTime:
    """The host's time fitted to recorded traces' steps (``step_us``, ``ops_us``, ``ops``,
    ``data_us`` and ``out_bytes``): each trace's medians of its steps' host time (`_host_gap_us`),
    op count and bytes, fitted by non-negative least squares where at least `MIN_HOST_TRACES`
    traces differ in both op count and bytes; else the median host time of all their steps, one
    figure a step (0 with none)."""
    traced = [[s for s in trace.get("steps", []) if s["ops"] > 0] for trace in traces]
    traced = [steps for steps in traced if steps]
    gaps = [[_host_gap_us(s) for s in steps] for steps in traced]
    if not gaps:
        return HostTime(0.0)
    rows = np.array(
        [
            [
                1.0,
                statistics.median(s["ops"] for s in steps),
                statistics.median(s.get("out_bytes", 0) for s in steps),
            ]
            for steps in traced
        ]
    )
    if len(traced) < MIN_HOST_TRACES or any(len(set(rows[:, k])) < MIN_HOST_TRACES for k in (1, 2)):
        return HostTime(max(statistics.median(g for trace_gaps in gaps for g in trace_gaps), 0.0))
    from scipy.optimize import nnls

    hosts = np.array([statistics.median(trace_gaps) for trace_gaps in gaps])
    scale = rows.max(axis=0)
    coefficients, _ = nnls(rows / scale, hosts)
    per_step, per_op, per_byte = (float(c) for c in coefficients / scale)
    spans = [(float(rows[:, k].min()), float(rows[:, k].max())) for k in (1, 2)]
    return HostTime(per_step, per_op, per_byte, *spans)


class OpCostModel:
    """The learned model of one device (see the module docstring). ``sources`` names the traces it
    was trained on; ``known_types`` the op types among its samples."""

    def __init__(
        self,
        traces: Sequence[Mapping[str, Any]],
        tvm: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        tvm_seconds: float = TVM_SECONDS,
    ):
        from sklearn.ensemble import HistGradientBoostingRegressor

        samples = [{**op, "threads": trace.get("threads")} for trace in traces for op in trace["ops"]]
        self.tvm = tvm
        self._cache_dir, self._tvm_seconds = cache_dir, tvm_seconds
        self.lowered = 0  # ops with TVM's features among the samples
        if len(samples) < MIN_OPS:
            raise ValueError(f"{len(samples)} measured ops: too few to learn from (at least {MIN_OPS})")
        self.sources = [str(t.get("source", "")) for t in traces]
        self.threads = sorted({int(t["threads"]) for t in traces if t.get("threads")})
        self.samples = len(samples)
        self.known_types = {op["name"] for op in samples}
        self.float_dtypes = {d for op in samples if (d := float_dtype(op["dtypes"]))}
        self._codes: list[dict[str, int]] = [{} for _ in CATEGORICAL]
        # each op also as an op of its class with no type, what an op type never measured is priced as
        features = self._all_features(samples)
        self.lowered = sum(1 for f in features if len(f) > len(FEATURES) and not math.isnan(f[len(FEATURES)]))
        rows = [self._encode(f, grow=True) for f in features]
        rows += [self._encode([UNKNOWN_TYPE, *f[1:]], grow=True) for f in features]
        weights = [op.get("count", 1) for op in samples]
        weights += [UNKNOWN_WEIGHT * w for w in weights]
        measured_us = [max(op["us"], MIN_US) for op in samples] * 2
        nominal = np.exp2([row[NOMINAL] for row in rows])
        self._regressor = HistGradientBoostingRegressor(
            loss="absolute_error",  # the median ratio: a few ops slowed by a stall do not pull it
            max_iter=300,
            learning_rate=0.08,
            min_samples_leaf=10,
            categorical_features=list(CATEGORICAL),
            random_state=0,
        )
        self._regressor.fit(
            np.array(rows, dtype=float),
            np.log(measured_us / nominal),
            sample_weight=np.array(weights, dtype=float),
        )
        self.host = fit_host_time(traces)

    def _all_features(self, ops: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
        """Each op's features, TVM's after the framework's where the model uses them."""
        features = [
            op_features(
                op["name"], op["shapes"], op["dtypes"], op["flops"], op["out_bytes"], op.get("threads")
            )
            for op in ops
        ]
        if not self.tvm:
            return features
        calls = [op.get("call") for op in ops]
        lowered = iter(features_of([c for c in calls if c], self._cache_dir, self._tvm_seconds))
        missing = [math.nan] * len(TVM_FEATURES)
        for row, call in zip(features, calls, strict=True):
            row += (next(lowered) or missing) if call else missing
        return features

    def _encode(self, features: list[Any], grow: bool = False) -> list[float]:
        encoded = list(features)
        for i in CATEGORICAL:
            codes = self._codes[i]
            if grow and features[i] not in codes:
                codes[features[i]] = len(codes)
            encoded[i] = codes.get(features[i], -1)  # unseen: scikit-learn's missing category
        return [float(v) for v in encoded]

    def predict_us(self, ops: Sequence[Mapping[str, Any]]) -> list[float]:
        """Predicted times (us) of ``ops``, each a mapping with an op sample's fields
        (``name``, ``shapes``, ``dtypes``, ``flops``, ``out_bytes``, ``call`` for TVM's, and
        ``threads``, the intra-op threads it will run on: this process's where it has none)."""
        if not ops:
            return []
        features = self._all_features(ops)
        rows = np.array(
            [self._encode([f[0] if f[0] in self.known_types else UNKNOWN_TYPE, *f[1:]]) for f in features],
            dtype=float,
        )
        return [float(v) for v in np.exp(self._regressor.predict(rows)) * np.exp2(rows[:, NOMINAL])]

    def describe(self) -> str:
        """What the model was trained on, for a prediction to say."""
        lowered = f", TVM's features of {self.lowered} of them" if self.tvm else ""
        at_threads = f" at {', '.join(map(str, self.threads))} thread(s)" if self.threads else ""
        dtypes = ", ".join(sorted(self.float_dtypes)) or "none"
        return (
            f"learned per-op model (predictor/op_cost_model.py): {self.samples} distinct measured ops "
            f"of {len(self.sources)} recorded trace(s) on this device{at_threads}{lowered} (float "
            f"dtypes: {dtypes}); host time "
            f"{self.host.describe()}"
        )


def device_model(
    device: str, cache_dir: str | os.PathLike[str] | None = None, tvm: bool = False
) -> OpCostModel | None:
    """The learned model of ``device``'s data set (with TVM's features: ``tvm``), or None where it
    holds too few ops yet."""
    traces = load_dataset(device, cache_dir)
    try:
        return OpCostModel(traces, tvm=tvm, cache_dir=cache_dir)
    except ValueError:
        return None
