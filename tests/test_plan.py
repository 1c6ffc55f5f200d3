"""Tests for qsync_callback.plan: round trips, strict validation, fingerprints."""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import (
    ACTIVATION_POLICIES,
    PLAN_FORMAT,
    PLAN_VERSION,
    PRECISIONS,
    Constraints,
    Plan,
    buckets_around_regions,
    fingerprint_key,
    fingerprint_mismatches,
    regions_split_by_buckets,
)

FINGERPRINT = {
    "model": "abc123",
    "layers": ["embed", "fc1", "fc2", "head"],
    "batch_shapes": [[8, 128]],
    "device": "cuda",
    "world_size": 2,
    "versions": {"torch": "2.13.0", "qsync_callback": "0.1.0"},
}


def make_plan() -> Plan:
    return Plan(
        fingerprint=dict(FINGERPRINT),
        precision={"fc1": "bf16", "fc2": "fp16", "head": "fp32"},
        op_precision={"MatMul": "bf16", "Softmax": "fp32"},
        buckets=[["fc1.weight", "fc1.bias"], ["fc2.weight"]],
        fused_regions=[["fc1", "fc2"]],
        activation={"fc1": "recompute", "fc2": "offload", "head": "keep"},
        communication={"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 2.5},
        malloc_thresholds={"mmap_threshold_bytes": 1 << 22, "trim_threshold_bytes": 1 << 24},
        prediction={"step_ms": 12.5, "peak_bytes": 1_000_000},
        constraints=Constraints.from_arguments(memory_budget="90%", precisions=("fp32", "bf16")).to_dict(),
    )


def valid_dict() -> dict:
    return make_plan().to_dict()


def write(tmp_path, text: str, name: str = "plan.json") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# --- constants and empty plan --------------------------------------------------------------


def test_constants() -> None:
    assert PLAN_FORMAT == "qsync-plan"
    assert PLAN_VERSION == 1
    assert PRECISIONS == ("fp32", "tf32", "bf16", "fp16", "int8")
    assert ACTIVATION_POLICIES == ("keep", "offload", "recompute")


def test_empty_plan() -> None:
    plan = Plan.empty({"model": "m", "world_size": 1})
    assert plan.is_empty
    assert plan.fingerprint == {"model": "m", "world_size": 1}
    assert plan.precision == {}
    assert plan.buckets == []
    assert plan.fused_regions == []
    assert plan.activation == {}
    assert plan.prediction is None
    assert plan.version == PLAN_VERSION
    assert Plan.empty().fingerprint == {}
    assert Plan().is_empty


def test_empty_ignores_fingerprint_and_prediction_but_not_decisions() -> None:
    assert Plan(fingerprint={"model": "m"}, prediction={"step_ms": 1.0}).is_empty
    assert not Plan(precision={"fc1": "bf16"}).is_empty
    assert not Plan(buckets=[["a"]]).is_empty
    assert not Plan(fused_regions=[["a", "b"]]).is_empty
    assert not Plan(activation={"a": "offload"}).is_empty
    assert not make_plan().is_empty


def test_empty_copies_fingerprint() -> None:
    fp = {"layers": ("a", "b")}
    plan = Plan.empty(fp)
    fp["layers"] = ("c",)
    assert plan.fingerprint == {"layers": ["a", "b"]}


# --- round trips ---------------------------------------------------------------------------


def test_to_dict_shape() -> None:
    data = make_plan().to_dict()
    assert data == {
        "format": "qsync-plan",
        "version": 1,
        "fingerprint": FINGERPRINT,
        "precision": {"fc1": "bf16", "fc2": "fp16", "head": "fp32"},
        "op_precision": {"MatMul": "bf16", "Softmax": "fp32"},
        "buckets": [["fc1.weight", "fc1.bias"], ["fc2.weight"]],
        "fused_regions": [["fc1", "fc2"]],
        "activation": {"fc1": "recompute", "fc2": "offload", "head": "keep"},
        "communication": {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 2.5},
        "malloc_thresholds": {"mmap_threshold_bytes": 1 << 22, "trim_threshold_bytes": 1 << 24},
        "prediction": {"step_ms": 12.5, "peak_bytes": 1_000_000},
        "constraints": {
            "memory_budget": None,
            "memory_budget_share": 0.9,
            "max_step_ms": None,
            "precisions": ["fp32", "bf16"],
            "levers": ["precision", "activation", "regions", "buckets", "allocator"],
            "best_effort": False,
        },
    }


def test_to_dict_is_a_copy() -> None:
    plan = make_plan()
    data = plan.to_dict()
    data["precision"]["fc1"] = "int8"
    data["buckets"][0].append("x")
    data["fingerprint"]["versions"]["torch"] = "0"
    assert plan.precision["fc1"] == "bf16"
    assert plan.buckets[0] == ["fc1.weight", "fc1.bias"]
    assert plan.fingerprint["versions"]["torch"] == "2.13.0"


def test_without_takes_out_entries_of_list_fields_and_keys_of_dict_fields() -> None:
    plan = make_plan()
    less = plan.without(
        {"fused_regions": [["fc1", "fc2"]], "precision": ["fc2"], "buckets": [["fc2.weight"]]}
    )
    assert less.fused_regions == [] and less.buckets == [["fc1.weight", "fc1.bias"]]
    assert less.precision == {"fc1": "bf16", "head": "fp32"}
    assert less.activation == plan.activation and less.constraints == plan.constraints
    assert less.prediction is None  # the prediction was made with what was taken out
    assert plan.precision["fc2"] == "fp16" and plan.fused_regions == [["fc1", "fc2"]]  # a copy
    assert plan.without({}).to_dict() == {**plan.to_dict(), "prediction": None}


def test_json_round_trip() -> None:
    plan = make_plan()
    text = plan.to_json()
    assert json.loads(text)["format"] == "qsync-plan"
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True)
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text


def test_empty_plan_round_trip() -> None:
    plan = Plan.empty({"model": "m"})
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.is_empty
    assert again.prediction is None


def test_from_dict_defaults_missing_fields() -> None:
    plan = Plan.from_dict({"format": "qsync-plan", "version": 1, "precision": {"a": "int8"}})
    assert plan.precision == {"a": "int8"}
    assert plan.fingerprint == {}
    assert plan.buckets == []
    assert plan.activation == {}
    assert plan.prediction is None


def test_save_load_round_trip(tmp_path) -> None:
    plan = make_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert Plan.load(str(path)) == plan
    assert json.loads(path.read_text(encoding="utf-8")) == plan.to_dict()
    # no temp files left behind
    assert os.listdir(tmp_path) == ["plan.json"]


def test_save_overwrites(tmp_path) -> None:
    path = tmp_path / "plan.json"
    make_plan().save(path)
    Plan.empty().save(path)
    assert Plan.load(path).is_empty
    assert os.listdir(tmp_path) == ["plan.json"]


def test_save_refuses_invalid_plan(tmp_path) -> None:
    path = tmp_path / "plan.json"
    with pytest.raises(QSyncInputError, match=r"plan\.json: precision of layer 'fc1' is 'fp8'"):
        Plan(precision={"fc1": "fp8"}).save(path)
    assert not path.exists()
    assert os.listdir(tmp_path) == []


def test_save_into_missing_directory(tmp_path) -> None:
    path = tmp_path / "nope" / "plan.json"
    with pytest.raises(QSyncInputError, match="plan.json: cannot write plan"):
        make_plan().save(path)


# --- bad files -----------------------------------------------------------------------------


def test_bad_json_names_file_line_and_column(tmp_path) -> None:
    path = write(tmp_path, '{\n  "format": "qsync-plan",\n  "version": 1,,\n}')
    with pytest.raises(QSyncInputError) as info:
        Plan.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: invalid JSON at line 3, column ")
    assert "\n" not in message


def test_bad_json_from_text_uses_source() -> None:
    with pytest.raises(QSyncInputError, match=r"^mine\.json: invalid JSON at line 1, column 2"):
        Plan.from_json("{oops}", source="mine.json")


def test_not_an_object(tmp_path) -> None:
    path = write(tmp_path, "[1, 2, 3]")
    with pytest.raises(QSyncInputError, match=r"plan\.json: a plan must be a JSON object, got a list"):
        Plan.load(path)


def test_wrong_format(tmp_path) -> None:
    data = valid_dict()
    data["format"] = "qsync-trace"
    path = write(tmp_path, json.dumps(data))
    with pytest.raises(QSyncInputError, match=r"plan\.json: format is 'qsync-trace'; expected 'qsync-plan'"):
        Plan.load(path)


def test_missing_format(tmp_path) -> None:
    data = valid_dict()
    del data["format"]
    path = write(tmp_path, json.dumps(data))
    with pytest.raises(QSyncInputError, match=r"plan\.json: missing 'format'"):
        Plan.load(path)


@pytest.mark.parametrize(
    ("version", "word"),
    [(PLAN_VERSION + 1, "newer"), (PLAN_VERSION + 5, "newer"), (PLAN_VERSION - 1, "older")],
)
def test_wrong_version(tmp_path, version: int, word: str) -> None:
    data = valid_dict()
    data["version"] = version
    path = write(tmp_path, json.dumps(data))
    with pytest.raises(QSyncInputError) as info:
        Plan.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: plan version {version} is {word} than this tool reads")
    assert f"(version {PLAN_VERSION})" in message


@pytest.mark.parametrize("version", ["1", 1.0, True, None])
def test_version_not_an_integer(version) -> None:
    data = valid_dict()
    data["version"] = version
    with pytest.raises(QSyncInputError, match=r"^p\.json: version is .*; expected the integer 1"):
        Plan.from_dict(data, source="p.json")


def test_missing_version() -> None:
    data = valid_dict()
    del data["version"]
    with pytest.raises(QSyncInputError, match=r"^p\.json: missing 'version'"):
        Plan.from_dict(data, source="p.json")


@pytest.mark.parametrize(
    "field, layer, value, expected",
    [
        (
            "precision",
            "fc1",
            "fp8",
            "precision of layer 'fc1' is 'fp8'; expected one of fp32, tf32, bf16, fp16, int8",
        ),
        (
            "activation",
            "fc2",
            "discard",
            "activation policy of layer 'fc2' is 'discard'; expected one of keep, offload, recompute",
        ),
    ],
)
def test_unknown_decision_value(tmp_path, field, layer, value, expected) -> None:
    data = valid_dict()
    data[field][layer] = value
    path = write(tmp_path, json.dumps(data))
    with pytest.raises(QSyncInputError) as info:
        Plan.load(path)
    assert str(info.value) == f"{path}: {expected}"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("fingerprint", [], "fingerprint is a list; expected an object"),
        ("precision", ["fc1", "bf16"], "precision is a list; expected an object"),
        ("precision", {"fc1": 16}, "precision of layer 'fc1' is a number"),
        ("activation", "keep", "activation is a string; expected an object"),
        ("activation", {"fc1": None}, "activation policy of layer 'fc1' is null"),
        ("buckets", {"a": ["b"]}, "buckets is an object; expected a list of lists"),
        ("buckets", ["fc1.weight"], r"buckets\[0\] is a string; expected a list of names"),
        ("buckets", [["a"], ["b", 3]], r"buckets\[1\]\[1\] is a number; expected a string"),
        ("buckets", [[]], r"buckets\[0\] is empty"),
        ("fused_regions", "fc1,fc2", "fused_regions is a string; expected a list of lists"),
        ("fused_regions", [["fc1", None]], r"fused_regions\[0\]\[1\] is null; expected a string"),
        ("op_precision", {"MatMul": "fp8"}, "precision of op type 'MatMul' is 'fp8'; expected one of"),
        ("communication", [1], "communication is a list; expected an object"),
        ("communication", {"threshold": 1}, "unknown communication setting 'threshold'; expected"),
        ("communication", {"fusion_threshold_bytes": 1.5}, "communication fusion_threshold_bytes .* is 1.5"),
        ("communication", {"cycle_time_ms": -1}, r"communication cycle_time_ms .* is -1; expected a non-neg"),
        ("communication", {"cycle_time_ms": True}, "communication cycle_time_ms .* is True"),
        ("prediction", 12.5, "prediction is a number; expected an object"),
        ("prediction", [1, 2], "prediction is a list; expected an object"),
    ],
)
def test_wrong_field_types(tmp_path, key: str, value, expected: str) -> None:
    data = valid_dict()
    data[key] = value
    path = write(tmp_path, json.dumps(data))
    with pytest.raises(QSyncInputError, match="^" + re.escape(f"{path}: ") + expected):
        Plan.load(path)


def test_non_string_keys_rejected_in_from_dict() -> None:
    data = valid_dict()
    data["precision"] = {1: "bf16"}
    with pytest.raises(QSyncInputError, match=r"^p\.json: precision has a non-string key 1"):
        Plan.from_dict(data, source="p.json")


def test_null_prediction_is_allowed() -> None:
    data = valid_dict()
    data["prediction"] = None
    assert Plan.from_dict(data).prediction is None


def test_unknown_key(tmp_path) -> None:
    data = valid_dict()
    data["precisions"] = {"fc1": "bf16"}
    path = write(tmp_path, json.dumps(data))
    with pytest.raises(QSyncInputError) as info:
        Plan.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: unknown plan key(s) 'precisions'")
    assert "precision" in message.split("expected only", 1)[1]


def test_missing_file(tmp_path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(QSyncInputError) as info:
        Plan.load(path)
    assert str(info.value) == f"{path}: plan file not found"


def test_directory_is_unreadable(tmp_path) -> None:
    with pytest.raises(QSyncInputError, match="cannot read plan file") as info:
        Plan.load(tmp_path)
    assert str(info.value).startswith(f"{tmp_path}: ")


def test_empty_file(tmp_path) -> None:
    path = write(tmp_path, "")
    with pytest.raises(QSyncInputError) as info:
        Plan.load(path)
    assert str(info.value) == f"{path}: plan file is empty"
    blank = write(tmp_path, "  \n\n", name="blank.json")
    with pytest.raises(QSyncInputError, match=r"blank\.json: plan file is empty"):
        Plan.load(blank)


def test_not_utf8(tmp_path) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(QSyncInputError, match=r"plan\.json: plan file is not UTF-8 text"):
        Plan.load(path)


def test_default_source_in_messages() -> None:
    with pytest.raises(QSyncInputError, match=r"^<plan>: format is 'x'"):
        Plan.from_dict({"format": "x", "version": 1})


# --- validate_for --------------------------------------------------------------------------


def test_validate_for_accepts_known_layers() -> None:
    plan = make_plan()
    assert plan.validate_for(FINGERPRINT["layers"]) is None
    # buckets may name parameters, which are not layers
    assert plan.validate_for(iter(["fc1", "fc2", "head"])) is None
    Plan.empty().validate_for([])


def test_validate_for_lists_unknown_layers() -> None:
    plan = Plan(
        precision={"fc1": "bf16", "ghost": "fp16"},
        activation={"phantom": "offload", "ghost": "keep"},
        fused_regions=[["fc1", "spirit"]],
    )
    with pytest.raises(QSyncInputError) as info:
        plan.validate_for(["fc1", "fc2"], source="plan.json")
    assert str(info.value) == (
        "plan.json: plan names 3 layer(s) not in the model: 'ghost', 'phantom', 'spirit'"
    )


def test_validate_for_caps_listed_names() -> None:
    plan = Plan(precision={f"l{i}": "bf16" for i in range(8)})
    with pytest.raises(QSyncInputError) as info:
        plan.validate_for(["l0"])
    message = str(info.value)
    assert message == (
        "<plan>: plan names 7 layer(s) not in the model: 'l1', 'l2', 'l3', 'l4', 'l5' and 2 more"
    )


# --- fingerprints --------------------------------------------------------------------------


def test_fingerprint_mismatches_match() -> None:
    assert fingerprint_mismatches(FINGERPRINT, dict(FINGERPRINT)) == []
    # tuples from a live run equal lists from JSON
    live = dict(FINGERPRINT, layers=tuple(FINGERPRINT["layers"]), batch_shapes=[(8, 128)])
    assert fingerprint_mismatches(FINGERPRINT, live) == []


def test_fingerprint_mismatches_reasons() -> None:
    actual = dict(FINGERPRINT, world_size=1, device="cpu")
    assert fingerprint_mismatches(FINGERPRINT, actual) == [
        "device: plan made for 'cuda', run has 'cpu'",
        "world_size: plan made for 2, run has 1",
    ]


def test_fingerprint_mismatches_ignores_missing_keys() -> None:
    assert fingerprint_mismatches({"model": "a", "world_size": 2}, {"world_size": 2, "device": "cpu"}) == []
    assert fingerprint_mismatches({}, FINGERPRINT) == []
    assert fingerprint_mismatches({"model": "a"}, {"model": "b"}) == ["model: plan made for 'a', run has 'b'"]


def test_fingerprint_mismatches_nested_versions() -> None:
    actual = dict(FINGERPRINT, versions={"torch": "2.14.0", "numpy": "2.0"})
    assert fingerprint_mismatches(FINGERPRINT, actual) == [
        "versions.torch: plan made for '2.13.0', run has '2.14.0'"
    ]


def test_fingerprint_mismatches_lists() -> None:
    actual = dict(FINGERPRINT, layers=["embed", "fc1"], batch_shapes=[[4, 128]])
    assert fingerprint_mismatches(FINGERPRINT, actual) == [
        "layers: plan made for ['embed', 'fc1', 'fc2', 'head'], run has ['embed', 'fc1']",
        "batch_shapes: plan made for [[8, 128]], run has [[4, 128]]",
    ]
    many = [f"block.{i}.attention" for i in range(20)]
    changed = many[:7] + ["block.7.mlp"] + many[8:]
    assert fingerprint_mismatches({"layers": many}, {"layers": changed}) == [
        "layers[7]: plan made for 'block.7.attention', run has 'block.7.mlp'"
    ]
    assert fingerprint_mismatches({"layers": many}, {"layers": many[:-1]}) == [
        "layers: plan made for 20 entries, run has 19 entries"
    ]


def test_fingerprint_key_stable() -> None:
    key = fingerprint_key(FINGERPRINT)
    assert len(key) == 16
    assert all(c in "0123456789abcdef" for c in key)
    assert fingerprint_key(FINGERPRINT) == key
    reordered = {k: FINGERPRINT[k] for k in reversed(list(FINGERPRINT))}
    reordered["versions"] = {"qsync_callback": "0.1.0", "torch": "2.13.0"}
    assert list(reordered) != list(FINGERPRINT)
    assert fingerprint_key(reordered) == key
    # survives a JSON round trip of the plan, and tuples hash like lists
    assert fingerprint_key(Plan.from_json(make_plan().to_json()).fingerprint) == key
    assert fingerprint_key(dict(FINGERPRINT, layers=tuple(FINGERPRINT["layers"]))) == key


def test_fingerprint_key_known_value() -> None:
    expected = hashlib.sha256(b'{"model":"m","world_size":1}').hexdigest()[:16]
    assert fingerprint_key({"world_size": 1, "model": "m"}) == expected


def test_fingerprint_key_differs() -> None:
    key = fingerprint_key(FINGERPRINT)
    assert fingerprint_key(dict(FINGERPRINT, world_size=1)) != key
    assert fingerprint_key(dict(FINGERPRINT, versions={"torch": "2.14.0"})) != key
    assert fingerprint_key({}) != key


def test_fingerprint_key_rejects_non_json() -> None:
    with pytest.raises(QSyncInputError, match="fingerprint is not plain JSON data"):
        fingerprint_key({"device": object()})


def test_a_bucket_boundary_inside_a_compiled_region_is_found_and_merged_away() -> None:
    buckets = [["head.bias", "head.weight"], ["net.2.bias", "net.2.weight"], ["net.0.bias"], ["net.0.weight"]]
    # net.2 in one bucket: nothing split; "net" holds net.2 and net.0, over three buckets
    assert regions_split_by_buckets(buckets, [["net.2"]]) == []
    assert regions_split_by_buckets(buckets, [["net.0"], ["head"]]) == ["net.0"]
    assert regions_split_by_buckets(buckets, [["net"]]) == ["net"]
    # a module's name is a prefix at a dot: "net.2" does not hold "net.20.weight"
    assert regions_split_by_buckets([["net.20.weight"], ["net.2.weight"]], [["net.2"]]) == []
    assert buckets_around_regions(buckets, [["net.0"]]) == [
        ["head.bias", "head.weight"],
        ["net.2.bias", "net.2.weight"],
        ["net.0.bias", "net.0.weight"],
    ]
    # merged from the first bucket holding the region to the last, in launch order
    assert buckets_around_regions(buckets, [["net"]]) == [
        ["head.bias", "head.weight"],
        ["net.2.bias", "net.2.weight", "net.0.bias", "net.0.weight"],
    ]
    # two regions whose merges overlap end in one bucket
    assert buckets_around_regions([["a.x"], ["b.x"], ["a.y"], ["b.y"]], [["a"], ["b"]]) == [
        ["a.x", "b.x", "a.y", "b.y"]
    ]
    assert buckets_around_regions(buckets, []) == buckets
    assert buckets_around_regions([], [["net"]]) == []
