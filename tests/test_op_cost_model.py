"""The learned per-op cost model (`predictor/op_cost_model.py`) and the per-device data set it
trains on (`recorder/op_dataset.py`), on hand-made op samples; the same from real recorded runs in
`tests/test_op_samples.py`."""

import math
from dataclasses import asdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_callback.predictor.op_cost_model import (
    FEATURES,
    MIN_OPS,
    NOMINAL_BYTES_PER_US,
    NOMINAL_CALL_US,
    NOMINAL_FLOPS_PER_US,
    HostTime,
    OpCostModel,
    device_model,
    fit_host_time,
    nominal_us,
    op_features,
)
from qsync_callback.recorder.op_dataset import (
    MAX_TRACES,
    add_to_dataset,
    dataset_path,
    load_dataset,
    remember_probes,
)
from qsync_callback.recorder.op_samples import OpSample, op_class

from tracebuilder import op_samples


def test_the_model_learns_op_times_it_was_not_shown():
    model = OpCostModel([{"source": "a", "ops": op_samples(150), "steps": []}])
    held_out = op_samples(40, seed=1)
    predicted = model.predict_us(held_out)
    errors = sorted(abs(p / op["us"] - 1) for p, op in zip(predicted, held_out, strict=False))
    assert errors[len(errors) // 2] < 0.15
    # an op type it never saw is priced from its other features, not refused
    unseen = {**held_out[0], "name": "aten::bmm"}
    assert model.predict_us([unseen])[0] > 0 and "aten::bmm" not in model.known_types


def test_too_few_ops_make_no_model_and_the_estimate_says_roofline(tmp_path):
    with pytest.raises(ValueError, match="too few"):
        OpCostModel([{"source": "a", "ops": op_samples(MIN_OPS // 2 - 1), "steps": []}])
    assert device_model("cpu", tmp_path) is None


@settings(max_examples=30, deadline=None)
@given(
    host=st.floats(0, 5e4),
    steps=st.lists(
        st.tuples(st.integers(1, 5000), st.floats(0, 1e6), st.floats(0, 1e4)), min_size=1, max_size=8
    ),
)
def test_the_host_time_is_what_a_step_spends_outside_its_ops_and_its_data_loaders_fetch(host, steps):
    recorded = [
        {"ops": n, "ops_us": ops_us, "data_us": data_us, "step_us": ops_us + data_us + host}
        for n, ops_us, data_us in steps
    ]
    fitted = fit_host_time([{"steps": recorded}])  # one trace: one figure a step
    assert fitted.per_op_us == fitted.per_byte_us == 0.0
    assert fitted.per_step_us == pytest.approx(host, abs=1e-6 * (1 + host + max(o for _, o, _ in steps)))


@settings(max_examples=40, deadline=None)
@given(
    per_step=st.floats(0, 1e4),
    per_op=st.floats(0, 20),
    per_mib=st.floats(0, 50),
    traces=st.lists(
        st.tuples(st.integers(1, 5000), st.integers(0, 2**30), st.floats(0, 1e5)),
        min_size=3,
        max_size=8,
        unique_by=(lambda t: t[0], lambda t: t[1]),
    ),
)
def test_the_host_time_grows_with_the_steps_ops_and_the_bytes_they_allocate(
    per_step, per_op, per_mib, traces
):
    truth = HostTime(per_step, per_op, per_mib / 2**20)
    recorded = [
        {
            "steps": [
                {"ops": n, "out_bytes": nbytes, "ops_us": ops_us, "data_us": 9.0, "step_us": ops_us + 9 + gap}
                for gap in (truth.at(n, nbytes), truth.at(n, nbytes) + 1e5, truth.at(n, nbytes))  # one stall
            ]
        }
        for n, nbytes, ops_us in traces
    ]
    fitted = fit_host_time(recorded)
    for n, nbytes, _ in traces:  # exact data: the fit goes through every trace's median
        assert fitted.at(n, nbytes) == pytest.approx(truth.at(n, nbytes), rel=1e-6, abs=1e-3)
    assert min(fitted.per_step_us, fitted.per_op_us, fitted.per_byte_us) >= 0.0
    # beyond the op counts and bytes fitted on, they count as the nearest fitted
    ops = sorted(n for n, _, _ in traces)
    nbytes = sorted(b for _, b, _ in traces)
    assert fitted.ops_range == (ops[0], ops[-1]) and fitted.bytes_range == (nbytes[0], nbytes[-1])
    assert fitted.at(10 * ops[-1], 10 * nbytes[-1] + 1) == fitted.at(ops[-1], nbytes[-1])
    assert fitted.at(0, -1) == fitted.at(ops[0], nbytes[0])


def test_the_host_time_is_one_figure_a_step_where_too_few_traces_differ_and_the_steps_median():
    gaps = [500.0, 700.0, 600.0, 90_000.0, 650.0]  # one step stalled (a collection, a page fault)
    steps = [{"ops": 10, "ops_us": 1000.0, "step_us": 1000.0 + gap} for gap in gaps]
    assert fit_host_time([{"steps": steps}]) == HostTime(650.0)
    # a step with no ops is not a step
    assert fit_host_time([{"steps": [*steps, {"ops": 0, "ops_us": 0.0, "step_us": 5e6}]}]) == HostTime(650.0)
    assert fit_host_time([{"steps": [{"ops": 1, "ops_us": 10.0, "step_us": 30.0}]}]) == HostTime(20.0)
    assert fit_host_time([]) == HostTime(0.0) == fit_host_time([{"steps": []}])
    # three traces of distinct op counts, recorded before steps kept their bytes: no per-byte term
    # can be fitted, so none is
    old = [{"steps": [{"ops": n, "ops_us": 0.0, "step_us": 100.0 + n}]} for n in (10, 100, 1000)]
    assert fit_host_time(old) == HostTime(200.0)
    # two traces that differ are still too few to fit three figures to
    two = [{"steps": [{"ops": n, "out_bytes": 9 * n, "ops_us": 0, "step_us": 100.0 + n}]} for n in (10, 1000)]
    assert fit_host_time(two) == HostTime(605.0)
    said = HostTime(2000.0, 3.0, 1e-5).describe()
    assert said == "2.00 ms a step + 3.00 us an op + 10.5 us a MiB allocated"


def test_the_data_set_keeps_one_document_per_source_and_the_newest(tmp_path):
    for i in range(MAX_TRACES + 3):
        add_to_dataset({"source": f"model-{i}", "ops": [], "steps": []}, "cpu", tmp_path)
    add_to_dataset(
        {"source": f"model-{MAX_TRACES}", "ops": [{"replaced": True}], "steps": []}, "cpu", tmp_path
    )
    sources = [t["source"] for t in load_dataset("cpu", tmp_path)]
    assert len(sources) == MAX_TRACES and sources[-1] == f"model-{MAX_TRACES}"
    assert sources.count(f"model-{MAX_TRACES}") == 1 and "model-0" not in sources


def test_a_corrupt_data_set_warns_and_starts_afresh(tmp_path):
    path = dataset_path("cpu", tmp_path)
    (tmp_path / path.rsplit("/", 1)[1]).write_text("{not json")
    with pytest.warns(UserWarning, match="starts afresh"):
        assert load_dataset("cpu", tmp_path) == []
    with pytest.warns(UserWarning, match="starts afresh"):
        add_to_dataset({"source": "a", "ops": [], "steps": []}, "cpu", tmp_path)
    assert [t["source"] for t in load_dataset("cpu", tmp_path)] == ["a"]


def test_probes_join_the_data_set_and_a_later_probe_replaces_an_earlier(tmp_path):
    first = OpSample("aten::max_pool2d_with_indices", [[8, 16, 32, 32]], ["float"], 0.0, 1 << 16, 120.0)
    other = OpSample("aten::bernoulli_", [[8, 64]], ["float"], 0.0, 0, 9.0)
    remember_probes([first, other], "cpu", tmp_path)
    remember_probes([OpSample(**{**asdict(first), "us": 80.0})], "cpu", tmp_path)
    (probes,) = [t for t in load_dataset("cpu", tmp_path) if t["source"].startswith("probes")]
    assert sorted((o["name"], o["us"]) for o in probes["ops"]) == [
        ("aten::bernoulli_", 9.0),
        ("aten::max_pool2d_with_indices", 80.0),
    ]


def test_an_op_class_comes_from_torchs_own_tags():
    assert op_class("aten::neg") == op_class("aten::add_") == "pointwise"
    assert op_class("aten::sum") == op_class("aten::mean") == "reduction"
    assert op_class("aten::t") == op_class("aten::view") == "view"
    assert op_class("aten::cat") == op_class("aten::native_layer_norm") == "other"
    assert op_class("aten::mm", 2.0) == "compute" and op_class("aten::mm") == "other"
    assert op_class("aten::no_such_op") == "other"


def test_the_features_of_a_matmul():
    features = dict(
        zip(
            FEATURES, op_features("aten::mm", [[4, 8], [8, 2]], ["float", "float"], 128.0, 32, 3), strict=True
        )
    )
    read = (32 + 16) * 4
    assert features == {
        "type": "aten::mm",
        "class": "compute",
        "dtype": "float",
        "log2 FLOPs": math.log2(129),
        "log2 bytes read": math.log2(1 + read),
        "log2 bytes allocated": math.log2(33),
        "log2 largest input elements": math.log2(33),
        "largest input rank": 2,
        "tensor inputs": 2,
        "log2 FLOPs per byte": math.log2(129 / (1 + read + 32)),
        "in place": 0.0,
        "threads": 3.0,
        "log2 nominal us": math.log2(nominal_us(128.0, read + 32)),
    }
    # without a thread count, this process's
    assert op_features("aten::mm", [[4, 8], [8, 2]], ["float", "float"], 128.0, 32)[
        FEATURES.index("threads")
    ] == float(torch.get_num_threads())
    assert nominal_us(0.0, 0.0) == NOMINAL_CALL_US
    assert nominal_us(2 * NOMINAL_FLOPS_PER_US, NOMINAL_BYTES_PER_US) == NOMINAL_CALL_US + 2
    assert nominal_us(NOMINAL_FLOPS_PER_US, 3 * NOMINAL_BYTES_PER_US) == NOMINAL_CALL_US + 3
    inplace = dict(
        zip(
            FEATURES,
            op_features("aten::add_", [[16], []], ["c10::BFloat16", "long int"], 0.0, 0),
            strict=True,
        )
    )
    assert (
        inplace["in place"] == 1.0
        and inplace["dtype"] == "c10::BFloat16"
        and inplace["largest input rank"] == 1
    )


def test_an_op_type_never_measured_is_priced_as_its_class():
    """A pointwise op never measured (aten::sub) is priced like the measured pointwise adds of its
    size, not like the matmuls of the same bytes."""
    model = OpCostModel([{"source": "a", "ops": op_samples(150), "steps": []}])
    adds = [op for op in op_samples(20, seed=2) if op["name"] == "aten::add"]
    subs = [{**op, "name": "aten::sub"} for op in adds]
    for add, sub, measured in zip(model.predict_us(adds), model.predict_us(subs), adds, strict=True):
        assert sub == pytest.approx(add, rel=0.5) and sub == pytest.approx(measured["us"], rel=0.5)
    assert "aten::sub" not in model.known_types and model.samples == 300


def _mm_samples(sizes):
    """aten::mm samples of n x n by n x n, each with its call, timed as a 1 GFLOP/s machine would."""
    rows = []
    for n in sizes:
        tensor = {"tensor": [[n, n], [n, 1], "float"]}
        call = {"op": "aten::mm.default", "args": [tensor, tensor], "kwargs": {}}
        flops = 2.0 * n**3
        rows.append(
            asdict(
                OpSample(
                    "aten::mm", [[n, n], [n, n]], ["float"] * 2, flops, 4 * n * n, flops / 1e3, call=call
                )
            )
        )
    return rows


def test_with_tvm_the_model_reads_each_calls_kernels_and_leaves_the_rest_missing(tmp_path):
    train = _mm_samples(range(8, 8 + 3 * 24, 3))
    model = OpCostModel([{"source": "mm", "ops": train, "steps": []}], tvm=True, cache_dir=tmp_path)
    assert model.lowered == len(train) and "TVM's features of 24 of them" in model.describe()
    without_call = [{**op, "call": None} for op in _mm_samples([40])]
    with_call = _mm_samples([40])
    both = model.predict_us(without_call + with_call)
    assert all(us > 0 for us in both)  # an op with no call is priced on the framework's features
    plain = OpCostModel([{"source": "mm", "ops": train, "steps": []}])
    assert plain.lowered == 0 and "TVM" not in plain.describe()


def test_one_data_set_holds_every_thread_count_and_the_model_learns_what_threads_change(
    tmp_path, monkeypatch
):
    """The same ops recorded at 1 thread take twice their time at 2: one data set keeps both
    documents, and the model prices each op at the thread count it is asked for. (The process's
    thread count is patched, not set: OpenMP's pool is not to be resized in a forked test.)"""
    paths = []
    for threads, slowdown in ((1, 2.0), (2, 1.0)):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        ops = [{**op, "us": op["us"] * slowdown} for op in op_samples(150)]
        document = {"source": f"at {threads}", "threads": threads, "ops": ops}
        paths.append(add_to_dataset(document, "cpu", tmp_path))
        probed = OpSample("aten::mm", [[8, 8], [8, 8]], ["float", "float"], 1024.0, 256, 3.0)
        remember_probes([probed], "cpu", tmp_path)
    assert paths[0] == paths[1] == dataset_path("cpu", tmp_path)
    documents = load_dataset("cpu", tmp_path)
    assert sorted((t["source"], t["threads"]) for t in documents) == [
        ("at 1", 1), ("at 2", 2), ("probes at 1 thread(s)", 1), ("probes at 2 thread(s)", 2),
    ]  # fmt: skip
    model = device_model("cpu", tmp_path)
    assert model.threads == [1, 2] and "at 1, 2 thread(s)" in model.describe()
    held_out = op_samples(40, seed=1)
    at_one = model.predict_us([{**op, "threads": 1} for op in held_out])
    at_two = model.predict_us([{**op, "threads": 2} for op in held_out])
    ratios = sorted(a / b for a, b in zip(at_one, at_two, strict=True))
    assert 1.7 < ratios[len(ratios) // 2] < 2.3
    # an op with no thread count is priced at this process's
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert model.predict_us(held_out[:4]) == pytest.approx(at_one[:4])
