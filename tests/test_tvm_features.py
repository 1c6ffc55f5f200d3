"""Compiler-level features of op calls from TVM's lowering (`predictor/tvm_features.py`), with the
real TVM and real child processes."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qsync_callback.predictor.tvm_features import (
    CRASH_ON_ENV,
    TVM_FEATURES,
    call_features,
    features_of,
    features_path,
)
from qsync_callback.recorder.op_samples import call_json

F = {name: i for i, name in enumerate(TVM_FEATURES)}


def tensor(*shape, dtype="float"):
    stride = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    return {"tensor": [list(shape), stride, dtype]}


def call(op, *args, **kwargs):
    return {"op": op, "args": list(args), "kwargs": kwargs}


def addmm(m, k, n):
    return call("aten::addmm.default", tensor(n), tensor(m, k), tensor(k, n))


def mm(m, k, n):
    return call("aten::mm.default", tensor(m, k), tensor(k, n))


def unlog(x):
    return 2**x - 1


def test_addmm_is_a_matmul_and_an_add_of_its_flops_and_bytes():
    m, k, n = 32, 48, 64
    f = call_features(addmm(m, k, n))
    assert f is not None and len(f) == len(TVM_FEATURES)
    assert f[F["kernels"]] == 2 and f[F["blocks"]] == 2
    assert unlog(f[F["log2 TIR FLOPs"]]) == pytest.approx(2 * m * n * k + m * n)
    assert unlog(f[F["log2 iterations"]]) == pytest.approx(m * n * k + m * n)
    assert unlog(f[F["log2 largest kernel iterations"]]) == pytest.approx(m * n * k)
    assert unlog(f[F["log2 reduction iterations"]]) == pytest.approx(m * n * k)
    assert f[F["reduction axes"]] == 1 and f[F["deepest loop nest"]] == 3
    # the inputs, and the matmul's result that the add reads; written: the matmul's and the add's
    assert unlog(f[F["log2 bytes read"]]) == pytest.approx(4 * (n + m * k + k * n + m * n))
    assert unlog(f[F["log2 bytes written"]]) == pytest.approx(4 * 2 * m * n)
    assert f[F["log2 bytes allocated inside"]] == 0


def test_a_larger_matmul_has_more_of_everything_and_only_a_reduction_reduces():
    small, large = call_features(mm(32, 48, 64)), call_features(mm(64, 96, 64))
    for name in ("log2 TIR FLOPs", "log2 iterations", "log2 bytes read", "log2 bytes written"):
        assert large[F[name]] > small[F[name]], name
    assert unlog(small[F["log2 bytes read"]]) == pytest.approx(4 * (32 * 48 + 48 * 64))

    add = call_features(call("aten::mul.Tensor", tensor(16, 32), tensor(16, 32)))
    assert add[F["kernels"]] == 1 and add[F["reduction axes"]] == 0
    assert add[F["log2 reduction iterations"]] == 0
    assert unlog(add[F["log2 iterations"]]) == pytest.approx(16 * 32)
    total = call_features(call("aten::sum.dim_IntList", tensor(16, 32), [1], False))
    assert total[F["reduction axes"]] == 1
    assert unlog(total[F["log2 reduction iterations"]]) == pytest.approx(16 * 32)


def test_what_cannot_be_lowered_is_none_not_an_error():
    unsupported = [
        call("aten::no_such_op.default"),
        call("aten::cumsum.default", tensor(4, 4), 1),  # left a Relax operator by LegalizeOps
        call(  # TVM's importer lacks it, torch's core decompositions leave it
            "aten::max_pool2d_with_indices_backward.default",
            tensor(2, 3, 4, 4),
            tensor(2, 3, 8, 8),
            [2, 2],
            [2, 2],
            [0, 0],
            [1, 1],
            False,
            tensor(2, 3, 4, 4, dtype="long int"),
        ),  # fmt: skip
        call("aten::mm.default", tensor(4, 4)),  # wrong arguments
    ]
    assert [call_features(c) for c in unsupported] == [None] * len(unsupported)


def test_calls_recorded_from_a_real_step_lower_and_a_convolutions_backward_costs_twice_its_forward():
    calls = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            try:
                made = call_json(func, args, kwargs or {})
                calls.setdefault(made["op"], made)
            except ValueError:  # an argument JSON cannot hold
                pass
            return func(*args, **(kwargs or {}))

    conv = torch.nn.Conv2d(8, 16, 3, padding=1)
    x = torch.randn(4, 8, 16, 16, requires_grad=True)  # both gradients: the input's and the weight's
    with Record():
        conv(x).relu().sum().backward()
    forward = call_features(calls["aten::convolution.default"])
    backward = call_features(calls["aten::convolution_backward.default"])
    assert forward is not None and backward is not None
    flops = 2 * 4 * 16 * 16 * 16 * 8 * 9  # the forward's multiply-adds; the backward's: twice
    assert unlog(forward[F["log2 TIR FLOPs"]]) == pytest.approx(flops, rel=0.02)
    assert unlog(backward[F["log2 TIR FLOPs"]]) == pytest.approx(2 * flops, rel=0.02)
    assert call_features(calls["aten::threshold_backward.default"]) is not None


def test_calls_are_lowered_in_children_that_a_crash_does_not_take_down_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(CRASH_ON_ENV, "aten::gelu.default")
    crashing = call("aten::gelu.default", tensor(8, 8))
    failing = call("aten::no_such_op.default", tensor(8, 8))
    lowered = [addmm(8, 16, 8), *(mm(8, k, 8) for k in (8, 16, 24, 32, 40))]
    calls = [lowered[0], failing, crashing, *lowered[1:], lowered[0]]  # 8 distinct: two children
    start = time.monotonic()
    got = features_of(calls, cache_dir=tmp_path, seconds=120)
    assert time.monotonic() - start < 40
    assert got[1] is None and got[2] is None  # failed; the child died on it
    expected = [call_features(c) for c in lowered]
    assert [got[0], *got[3:8]] == expected and got[8] == got[0]  # JSON keeps floats exactly

    path = features_path(tmp_path)
    document = json.loads(open(path).read())
    assert document["key"]["tvm"] and document["key"]["torch"] == torch.__version__
    cached = document["calls"]
    assert len(cached) == 8 and cached[json.dumps(crashing, sort_keys=True)] is None
    assert cached[json.dumps(failing, sort_keys=True)] is None

    monkeypatch.delenv(CRASH_ON_ENV)
    start = time.monotonic()
    assert features_of(calls, cache_dir=tmp_path, seconds=0) == got  # no child: all cached
    assert time.monotonic() - start < 1

    with open(path, "w") as handle:
        handle.write('{"format": "qsync-tvm-feat')
    with pytest.warns(UserWarning, match="starts afresh"):
        assert features_of(calls[:2], cache_dir=tmp_path, seconds=0) == [None, None]
    assert json.loads(open(path).read())["calls"] == {}  # replaced: warned once
    assert features_of(calls[:1], cache_dir=tmp_path, seconds=60) == [got[0]]
    assert list(json.loads(open(path).read())["calls"]) == [json.dumps(calls[0], sort_keys=True)]
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_without_tvm_there_are_no_features():
    code = (
        "import sys; sys.modules['tvm'] = None\n"
        "from qsync_callback.predictor import tvm_features as t\n"
        "print(t.tvm_available(), t.features_of([{'op': 'aten::mm.default', 'args': [], 'kwargs': {}}]),"
        " t.call_features({'op': 'aten::mm.default', 'args': [], 'kwargs': {}}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "[None]", "None"]
