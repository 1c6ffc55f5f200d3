"""A learned per-op cost model (CDMPP's idea, on framework-level features): what an op costs on
this device, for ops and models never profiled, trained on the ops this device has recorded.

Features of an op (`op_features`): its type and its first float input's dtype (categories), its
FLOPs, the bytes its tensor inputs read and the bytes it allocates, the largest input's element
count and rank, the number of tensor inputs, its arithmetic intensity (FLOPs per byte moved), and
whether it writes in place. A gradient-boosted tree ensemble (scikit-learn's
``HistGradientBoostingRegressor``) predicts the log of its time, each distinct op of a trace
weighted by how often it ran.

The host's time between ops (Python, autograd's bookkeeping, the optimizer's loop) is fitted apart,
from the recorded steps: a step's length less its ops' time is ``per_step_us + per_op_us * ops``,
by non-negative least squares (`HostCost`).

Training data is this device's data set (`recorder/op_dataset.py`): no extra runs. The model is
refitted from it when asked (a second or less), never stored: the data set is JSON, the model is
not pickled.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qsync_callback.recorder.kineto import DTYPE_BYTES, FLOAT_DTYPES
from qsync_callback.recorder.op_dataset import load_dataset

FEATURES = (
    "type", "dtype", "log2 FLOPs", "log2 bytes read", "log2 bytes allocated", "log2 largest input elements",
    "largest input rank", "tensor inputs", "log2 FLOPs per byte", "in place",
)  # fmt: skip
CATEGORICAL = (0, 1)
MIN_OPS = 20  # distinct measured ops below which no model is fitted (the roofline prices instead)
MIN_US = 0.1  # an op measured shorter (the profiler's cost taken off can leave 0) counts as this


def op_features(
    name: str, shapes: Sequence[Sequence[int]], dtypes: Sequence[str], flops: float, out_bytes: int
) -> list[Any]:
    """The features of one op (see the module docstring), the two categories as strings."""
    sizes = [math.prod(s) for s in shapes]
    read = sum(n * DTYPE_BYTES.get(d, 4) for n, d in zip(sizes, dtypes, strict=False))
    largest = max(range(len(sizes)), key=sizes.__getitem__) if sizes else None
    dtype = next((d for d in dtypes if d in FLOAT_DTYPES), dtypes[0] if dtypes else "none")
    return [
        name,
        dtype,
        math.log2(1 + flops),
        math.log2(1 + read),
        math.log2(1 + out_bytes),
        math.log2(1 + (sizes[largest] if largest is not None else 0)),
        len(shapes[largest]) if largest is not None else 0,
        len(shapes),
        math.log2((1 + flops) / (1 + read + out_bytes)),
        float(name.endswith("_")),
    ]


@dataclass(frozen=True)
class HostCost:
    """The host's time in a step outside its ops: ``per_step_us + per_op_us * ops``."""

    per_step_us: float
    per_op_us: float


def fit_host_cost(steps: Iterable[Mapping[str, float]]) -> HostCost:
    """`HostCost` fitted on recorded steps (``step_us``, ``ops_us``, ``ops``) by non-negative least
    squares; one op count alone gives a per-op cost only."""
    rows = [(s["ops"], s["step_us"] - s["ops_us"]) for s in steps if s["ops"] > 0]
    if not rows:
        return HostCost(0.0, 0.0)
    if len({n for n, _ in rows}) < 2:
        return HostCost(0.0, max(statistics.median(gap / n for n, gap in rows), 0.0))
    from scipy.optimize import nnls

    a = np.array([[1.0, n] for n, _ in rows])
    b = np.array([max(gap, 0.0) for _, gap in rows])
    (per_step, per_op), _ = nnls(a, b)
    return HostCost(float(per_step), float(per_op))


class OpCostModel:
    """The learned model of one device (see the module docstring). ``sources`` names the traces it
    was trained on; ``known_types`` the op types among its samples."""

    def __init__(self, traces: Sequence[Mapping[str, Any]]):
        from sklearn.ensemble import HistGradientBoostingRegressor

        samples = [op for trace in traces for op in trace["ops"]]
        if len(samples) < MIN_OPS:
            raise ValueError(f"{len(samples)} measured ops: too few to learn from (at least {MIN_OPS})")
        self.sources = [str(t.get("source", "")) for t in traces]
        self.samples = len(samples)
        self.known_types = {op["name"] for op in samples}
        self._codes: list[dict[str, int]] = [{}, {}]
        rows = [self._encode(self._features(op), grow=True) for op in samples]
        self._regressor = HistGradientBoostingRegressor(
            max_iter=300,
            learning_rate=0.08,
            min_samples_leaf=3,
            categorical_features=list(CATEGORICAL),
            random_state=0,
        )
        self._regressor.fit(
            np.array(rows, dtype=float),
            np.log([max(op["us"], MIN_US) for op in samples]),
            sample_weight=np.array([op.get("count", 1) for op in samples], dtype=float),
        )
        self.host = fit_host_cost(step for trace in traces for step in trace.get("steps", []))

    @staticmethod
    def _features(op: Mapping[str, Any]) -> list[Any]:
        return op_features(op["name"], op["shapes"], op["dtypes"], op["flops"], op["out_bytes"])

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
        (``name``, ``shapes``, ``dtypes``, ``flops``, ``out_bytes``)."""
        if not ops:
            return []
        rows = np.array([self._encode(self._features(op)) for op in ops], dtype=float)
        return [float(v) for v in np.exp(self._regressor.predict(rows))]

    def describe(self) -> str:
        """What the model was trained on, for a prediction to say."""
        return (
            f"learned per-op model (predictor/op_cost_model.py): {self.samples} distinct measured ops "
            f"of {len(self.sources)} recorded trace(s) on this device; host time "
            f"{self.host.per_op_us:.1f} us per op + {self.host.per_step_us / 1e3:.2f} ms per step"
        )


def device_model(device: str, cache_dir: str | os.PathLike[str] | None = None) -> OpCostModel | None:
    """The learned model of ``device``'s data set, or None where it holds too few ops yet."""
    traces = load_dataset(device, cache_dir)
    try:
        return OpCostModel(traces)
    except ValueError:
        return None
