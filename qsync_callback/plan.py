"""The plan: one object that ties the record -> predict -> plan -> enact loop together.

A `Plan` holds every decision the tool makes for a training run: per-layer precision, gradient
buckets, fused (compiled-together) regions and what to do with each layer's activations (keep,
offload, recompute). For frameworks whose mixed precision is a graph rewrite chosen by op type
(TensorFlow's auto-mixed-precision lists) it holds a precision per op type, and for collective
libraries with global knobs (Horovod) their communication settings. The planner proposes plans,
the predictor prices them (the chosen plan keeps the prediction it was chosen on), and the
integrations enact them on the real run. A plan also carries a fingerprint of what it was made for
(model structure, layers, batch shapes, device, world size, library versions), so a run can tell
when a stored plan no longer fits, and the constraints it was chosen under (`Constraints`:
memory budget, step-time target, allowed precisions and levers), so a plan chosen under other
constraints is never taken for this run's.

``prediction`` has one schema, whatever the plan kind (`Prediction.figures`):
``{"step_ms": float, "peak_bytes": int | null}``, the predicted step time and peak memory the plan
was chosen on, which verify compares with the measured ones (``peak_bytes`` null where the
predictor cannot stand behind a peak).

On disk a plan is versioned JSON (`{"format": "qsync-plan", "version": 1, ...}`), validated
strictly when read. It is never pickled and never eval'd: loading a plan cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from qsync_callback.errors import QSyncInputError
from qsync_callback.jsonio import parse_json, read_json, write_text_atomic
from qsync_callback.units import parse_memory_budget, parse_seconds

PLAN_FORMAT = "qsync-plan"
PLAN_VERSION = 1
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "int8")
FULL_PRECISION = "fp32"  # what a layer runs at when a plan says nothing about it
KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"
ACTIVATION_POLICIES = (KEEP, OFFLOAD, RECOMPUTE)
MIN_OFFLOAD_BYTES = 64 * 2**10
"""An offloaded module moves a saved tensor only if its storage holds at least this many bytes (64
KiB: below it a file's open, write and unlink cost more than the memory is worth); the applier
and the pricing both keep to it."""
# communication settings a plan may hold: name -> (type, what it is); both apply to a whole run
COMMUNICATION_SETTINGS = {
    "fusion_threshold_bytes": (int, "the largest fused gradient buffer, bytes (0: no fusion)"),
    "cycle_time_ms": (float, "how long the communication thread waits to fuse tensors, ms"),
}

# glibc malloc's thresholds a plan may fix (`qsync_callback.malloc_thresholds`), bytes, for the process
MALLOC_SETTINGS = {
    "mmap_threshold_bytes": (int, "blocks of this many bytes+ are mapped afresh, unmapped when freed"),
    "trim_threshold_bytes": (int, "the heap's free top beyond this many bytes goes back to the system"),
}
MALLOC_LIMIT = 2**31  # mallopt takes a C int

LEVERS = ("precision", "activation", "regions", "buckets", "allocator")
# the plan fields each lever's decisions live in
LEVER_FIELDS = {
    "precision": ("precision", "op_precision"),
    "activation": ("activation",),
    "regions": ("fused_regions",),
    "buckets": ("buckets", "communication"),
    "allocator": ("malloc_thresholds",),
}
DEFAULT_PRECISIONS = ("fp32", "bf16", "fp16", "int8")


def holds(module: str, name: str) -> bool:
    """Whether ``module`` is the module, layer or parameter ``name`` or holds it (its name is a dotted
    prefix of ``name``)."""
    return name == module or name.startswith(module + ".")


def module_layers(layers: Iterable[str]) -> dict[str, frozenset[str]]:
    """Every module that holds recorded layers, by name (each layer, and each dotted prefix of a
    layer's name): the layers it holds."""
    out: dict[str, set[str]] = {}
    for layer in layers:
        parts = layer.split(".")
        for k in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:k]), set()).add(layer)
    return {name: frozenset(members) for name, members in out.items()}


@dataclass(frozen=True)
class Constraints:
    """What a plan is chosen under; it travels with the plan (`Plan.constraints`) and keys the cache.

    ``memory_budget`` is in bytes; a budget given as a share of the recorded configuration's
    predicted peak is ``memory_budget_share`` until the report turns it into bytes (`resolved`).
    """

    memory_budget: int | None = None
    memory_budget_share: float | None = None
    max_step_ms: float | None = None
    precisions: tuple[str, ...] = DEFAULT_PRECISIONS
    levers: tuple[str, ...] = LEVERS
    best_effort: bool = False

    @classmethod
    def from_arguments(
        cls,
        memory_budget: str | int | float | None = None,
        max_step_time: float | None = None,
        precisions: Iterable[str] = DEFAULT_PRECISIONS,
        levers: Iterable[str] = LEVERS,
        best_effort: bool = False,
    ) -> Constraints:
        """Check a user's arguments (ValueError naming the bad one) and build the constraints."""
        try:
            budget, share = parse_memory_budget(memory_budget) if memory_budget is not None else (None, None)
        except ValueError as error:
            raise ValueError(f"memory_budget: {error}") from None
        max_ms = parse_seconds(max_step_time, "max_step_time") * 1e3 if max_step_time is not None else None
        for name, names in (("precisions", precisions), ("levers", levers)):
            if isinstance(names, str):
                raise ValueError(f"{name}: a list of names, such as ({names!r},), not the string {names!r}")
        wanted = ("fp32", *(p for p in dict.fromkeys(precisions) if p != "fp32"))
        unknown = [p for p in wanted if p not in PRECISIONS]
        if unknown:
            listed = ", ".join(map(str, unknown))
            raise ValueError(f"precisions: unknown {listed}; choose from {', '.join(PRECISIONS)}")
        levers = tuple(dict.fromkeys(levers))
        unknown = [lever for lever in levers if lever not in LEVERS]
        if unknown or not levers:
            raise ValueError(f"levers: must be some of {', '.join(LEVERS)}, not {levers!r}")
        if not isinstance(best_effort, bool):
            raise ValueError(f"best_effort: must be True or False, not {best_effort!r}")
        return cls(budget, share, max_ms, wanted, levers, best_effort)

    @property
    def budgeted(self) -> bool:
        """A memory budget is given, in bytes or as a share."""
        return self.memory_budget is not None or self.memory_budget_share is not None

    def resolved(self, recorded_peak_bytes: int | None) -> Constraints:
        """The same constraints with a budget share turned into bytes of ``recorded_peak_bytes``."""
        if self.memory_budget_share is None or recorded_peak_bytes is None:
            return self
        budget = max(int(self.memory_budget_share * recorded_peak_bytes), 1)
        return Constraints(budget, None, self.max_step_ms, self.precisions, self.levers, self.best_effort)

    def to_dict(self) -> dict[str, Any]:
        return {key: list(v) if isinstance(v, tuple) else v for key, v in asdict(self).items()}


_FIELDS = (
    "fingerprint",
    "precision",
    "op_precision",
    "buckets",
    "fused_regions",
    "activation",
    "communication",
    "malloc_thresholds",
    "prediction",
    "constraints",
)
_TOP_LEVEL_KEYS = ("format", "version", *_FIELDS)
_MAX_LISTED = 5


def _type_name(value: Any) -> str:
    """JSON-ish name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def _check_str_map(
    value: Any, name: str, allowed: tuple[str, ...], what: str, source: str, key_kind: str = "layer"
) -> dict[str, str]:
    """Validate an object of name (a layer, or `key_kind`) -> one of `allowed`; return a copy."""
    if not isinstance(value, Mapping):
        raise QSyncInputError(
            f"{source}: {name} is {_type_name(value)}; expected an object of {key_kind} -> {what}"
        )
    choices = ", ".join(allowed)
    out: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise QSyncInputError(f"{source}: {name} has a non-string key {key!r}")
        if not isinstance(item, str):
            raise QSyncInputError(
                f"{source}: {what} of {key_kind} {key!r} is {_type_name(item)}; expected one of {choices}"
            )
        if item not in allowed:
            raise QSyncInputError(
                f"{source}: {what} of {key_kind} {key!r} is {item!r}; expected one of {choices}"
            )
        out[key] = item
    return out


def _check_groups(value: Any, name: str, source: str) -> list[list[str]]:
    """Validate a list of non-empty lists of names; return a copy."""
    if not isinstance(value, list):
        raise QSyncInputError(f"{source}: {name} is {_type_name(value)}; expected a list of lists of names")
    out: list[list[str]] = []
    for i, group in enumerate(value):
        if not isinstance(group, list):
            raise QSyncInputError(f"{source}: {name}[{i}] is {_type_name(group)}; expected a list of names")
        if not group:
            raise QSyncInputError(f"{source}: {name}[{i}] is empty; expected at least one name")
        for j, item in enumerate(group):
            if not isinstance(item, str):
                raise QSyncInputError(f"{source}: {name}[{i}][{j}] is {_type_name(item)}; expected a string")
        out.append(list(group))
    return out


def _check_settings(
    value: Any, name: str, settings: Mapping[str, tuple[type, str]], source: str, limit: float = float("inf")
) -> dict[str, int | float]:
    """Validate a plan's settings ``name`` (``settings``: name -> (type, what it is)): known names,
    non-negative numbers below ``limit``."""
    if not isinstance(value, Mapping):
        raise QSyncInputError(f"{source}: {name} is {_type_name(value)}; expected an object")
    out: dict[str, int | float] = {}
    for key, item in value.items():
        if key not in settings:
            raise QSyncInputError(f"{source}: unknown {name} setting {key!r}; expected {', '.join(settings)}")
        kind, what = settings[key]
        number = isinstance(item, (int, float)) and not isinstance(item, bool)
        if not number or (kind is int and not isinstance(item, int)) or not 0 <= item < limit:
            expected = "a non-negative integer" if kind is int else "a non-negative number"
            below = f" below {limit}" if limit < float("inf") else ""
            raise QSyncInputError(f"{source}: {name} {key} ({what}) is {item!r}; expected {expected}{below}")
        out[key] = kind(item)
    return out


def _check_object(value: Any, name: str, source: str) -> dict[str, Any]:
    """Validate an object with string keys; return a deep (JSON-level) copy."""
    if not isinstance(value, Mapping):
        raise QSyncInputError(f"{source}: {name} is {_type_name(value)}; expected an object")
    for key in value:
        if not isinstance(key, str):
            raise QSyncInputError(f"{source}: {name} has a non-string key {key!r}")
    return _canonical(value)


def _canonical(value: Any) -> Any:
    """Copy `value` with mappings as dicts and tuples as lists, as it would come back from JSON."""
    if isinstance(value, Mapping):
        return {key: _canonical(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    return value


@dataclass
class Plan:
    """Every decision for one run, plus what it was made for and the prediction it was chosen on."""

    fingerprint: dict[str, Any] = field(default_factory=dict)
    precision: dict[str, str] = field(default_factory=dict)
    op_precision: dict[str, str] = field(default_factory=dict)  # op type -> precision (TF's AMP lists)
    buckets: list[list[str]] = field(default_factory=list)
    fused_regions: list[list[str]] = field(default_factory=list)
    activation: dict[str, str] = field(default_factory=dict)
    communication: dict[str, int | float] = field(default_factory=dict)  # COMMUNICATION_SETTINGS
    malloc_thresholds: dict[str, int] = field(default_factory=dict)  # MALLOC_SETTINGS
    prediction: dict[str, Any] | None = None
    constraints: dict[str, Any] = field(default_factory=dict)  # what it was chosen under (`Constraints`)
    version: int = PLAN_VERSION

    @classmethod
    def empty(cls, fingerprint: Mapping[str, Any] | None = None) -> Plan:
        """The recorded configuration: no decisions, optionally tagged with a fingerprint."""
        return cls(fingerprint=_canonical(fingerprint) if fingerprint is not None else {})

    @property
    def is_empty(self) -> bool:
        """True when the plan changes nothing (fingerprint and prediction are not decisions)."""
        return not (
            self.precision
            or self.op_precision
            or self.buckets
            or self.fused_regions
            or self.activation
            or self.communication
            or self.malloc_thresholds
        )

    def without(self, dropped: Mapping[str, Sequence[Any]]) -> Plan:
        """A copy with decisions taken out: per field, the entries of a list field (a region, a
        bucket) or the keys of a dict field (a layer). Its prediction, made with them, is dropped."""
        data = self.to_dict()
        for name, entries in dropped.items():
            kept = data[name]
            data[name] = (
                {k: v for k, v in kept.items() if k not in entries}
                if isinstance(kept, dict)
                else [e for e in kept if e not in entries]
            )
        data["prediction"] = None
        return Plan.from_dict(data)

    # --- dict / JSON -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (a copy: editing it does not change the plan)."""
        return {
            "format": PLAN_FORMAT,
            "version": self.version,
            "fingerprint": _canonical(self.fingerprint),
            "precision": dict(self.precision),
            "op_precision": dict(self.op_precision),
            "buckets": [list(bucket) for bucket in self.buckets],
            "fused_regions": [list(region) for region in self.fused_regions],
            "activation": dict(self.activation),
            "communication": dict(self.communication),
            "malloc_thresholds": dict(self.malloc_thresholds),
            "prediction": _canonical(self.prediction) if self.prediction is not None else None,
            "constraints": _canonical(self.constraints),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<plan>") -> Plan:
        """Build a plan from `to_dict()` output, validating strictly; raises QSyncInputError.

        `format` and `version` are required; missing decision fields default to empty.
        """
        if not isinstance(data, Mapping):
            raise QSyncInputError(f"{source}: a plan must be a JSON object, got {_type_name(data)}")
        if "format" not in data:
            raise QSyncInputError(f"{source}: missing 'format'; not a {PLAN_FORMAT} file")
        if data["format"] != PLAN_FORMAT:
            raise QSyncInputError(f"{source}: format is {data['format']!r}; expected {PLAN_FORMAT!r}")
        if "version" not in data:
            raise QSyncInputError(f"{source}: missing 'version'; this tool reads plan version {PLAN_VERSION}")
        version = data["version"]
        if isinstance(version, bool) or not isinstance(version, int):
            raise QSyncInputError(f"{source}: version is {version!r}; expected the integer {PLAN_VERSION}")
        if version > PLAN_VERSION:
            raise QSyncInputError(
                f"{source}: plan version {version} is newer than this tool reads (version {PLAN_VERSION});"
                " upgrade qsync-callback or re-plan"
            )
        if version < PLAN_VERSION:
            raise QSyncInputError(
                f"{source}: plan version {version} is older than this tool reads (version {PLAN_VERSION});"
                " re-plan to write a current plan"
            )
        unknown = [key for key in data if key not in _TOP_LEVEL_KEYS]
        if unknown:
            names = ", ".join(repr(key) for key in unknown)
            raise QSyncInputError(
                f"{source}: unknown plan key(s) {names}; expected only {', '.join(_TOP_LEVEL_KEYS)}"
            )
        prediction = data.get("prediction")
        return cls(
            fingerprint=_check_object(data.get("fingerprint", {}), "fingerprint", source),
            precision=_check_str_map(data.get("precision", {}), "precision", PRECISIONS, "precision", source),
            op_precision=_check_str_map(
                data.get("op_precision", {}), "op_precision", PRECISIONS, "precision", source, "op type"
            ),
            buckets=_check_groups(data.get("buckets", []), "buckets", source),
            fused_regions=_check_groups(data.get("fused_regions", []), "fused_regions", source),
            activation=_check_str_map(
                data.get("activation", {}), "activation", ACTIVATION_POLICIES, "activation policy", source
            ),
            communication=_check_settings(
                data.get("communication", {}), "communication", COMMUNICATION_SETTINGS, source
            ),
            malloc_thresholds=_check_settings(
                data.get("malloc_thresholds", {}), "malloc_thresholds", MALLOC_SETTINGS, source, MALLOC_LIMIT
            ),
            prediction=None if prediction is None else _check_object(prediction, "prediction", source),
            constraints=_check_object(data.get("constraints", {}), "constraints", source),
            version=version,
        )

    def to_json(self) -> str:
        """The plan as JSON text (indent=2, sorted keys)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "<plan>") -> Plan:
        """Parse and validate JSON text; bad JSON raises QSyncInputError with line and column."""
        return cls.from_dict(parse_json(text, source, what="plan"), source=source)

    # --- files -------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Validate, then write the plan atomically."""
        path = os.fspath(path)
        try:
            text = self.to_json()
        except (TypeError, ValueError) as exc:
            raise QSyncInputError(f"{path}: plan is not plain JSON data: {exc}") from None
        Plan.from_dict(json.loads(text), source=path)  # never write a plan we could not read back
        write_text_atomic(path, text + "\n", what="plan")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read and validate a plan file; any problem raises QSyncInputError naming the path."""
        return cls.from_dict(read_json(path, what="plan file"), source=os.fspath(path))

    # --- checks ------------------------------------------------------------------------------

    def check_for(
        self, fingerprint: Mapping[str, Any], layers: Iterable[str] | None = None, source: str = "<plan>"
    ) -> None:
        """Raise QSyncInputError if the plan was made for another run than ``fingerprint`` describes
        (`fingerprint_mismatches`) or names layers not in ``layers`` (`validate_for`; None: the
        fingerprint's ``layers``, if it lists them)."""
        mismatches = fingerprint_mismatches(self.fingerprint, fingerprint)
        if mismatches:
            raise QSyncInputError(f"{source}: made for another run ({'; '.join(mismatches[:3])})")
        layers = fingerprint.get("layers") if layers is None else layers
        if layers:
            self.validate_for(layers, source=source)

    def validate_for(self, layers: Iterable[str], source: str = "<plan>") -> None:
        """Raise QSyncInputError if precision names layers not in `layers`, or activation or
        fused_regions a module that holds none of them (a layer, or a dotted prefix of layers' names:
        the block ``net.3`` of ``net.3.conv1``; a torch region names one such module, a TF region
        every layer).

        Buckets are not checked: they may name parameters rather than layers.
        """
        known = set(layers)
        modules = module_layers(known)
        unknown: list[str] = []
        seen: set[str] = set()
        names = [
            *self.precision,
            *(name for name in self.activation if name not in modules),
            *(name for region in self.fused_regions for name in region if name not in modules),
        ]
        for name in names:
            if name not in known and name not in seen:
                seen.add(name)
                unknown.append(name)
        if unknown:
            listed = ", ".join(repr(name) for name in unknown[:_MAX_LISTED])
            more = f" and {len(unknown) - _MAX_LISTED} more" if len(unknown) > _MAX_LISTED else ""
            raise QSyncInputError(
                f"{source}: plan names {len(unknown)} layer(s) not in the model: {listed}{more}"
            )


def _region_of(parameter: str, regions: Sequence[Sequence[str]]) -> str | None:
    """The compiled region (a torch region names one module) that holds ``parameter``, or None."""
    for region in regions:
        for module in region:
            if holds(module, parameter):
                return module
    return None


def regions_split_by_buckets(buckets: Sequence[Sequence[str]], regions: Sequence[Sequence[str]]) -> list[str]:
    """The compiled regions whose parameters ``buckets`` spread over more than one bucket.

    A compiled region's backward is one graph: its parameters' gradients become ready together, at
    its end, in an order of the compiler's (the MLP of `tests/test_ddp_buckets.py` compiled whole
    made them ready weight and bias apart, out of layer order). DDP fills its buckets in ready
    order, so a bucket boundary inside a region cannot be reproduced (`appliers/torch_ddp_buckets.py`)."""
    where: dict[str, set[int]] = {}
    for k, bucket in enumerate(buckets):
        for parameter in bucket:
            region = _region_of(parameter, regions)
            if region is not None:
                where.setdefault(region, set()).add(k)
    return [region for region, found in where.items() if len(found) > 1]


def buckets_around_regions(
    buckets: Sequence[Sequence[str]], regions: Sequence[Sequence[str]]
) -> list[list[str]]:
    """``buckets`` (in launch order) with every run of buckets from the first to the last holding a
    compiled region's parameters merged into one, so that no bucket boundary falls inside a region
    (`regions_split_by_buckets`)."""
    merged = [list(bucket) for bucket in buckets]
    while split := regions_split_by_buckets(merged, regions):
        holding = [k for k, bucket in enumerate(merged) if any(holds(split[0], p) for p in bucket)]
        first, last = holding[0], holding[-1]
        merged[first : last + 1] = [[p for bucket in merged[first : last + 1] for p in bucket]]
    return merged


def _describe(value: Any) -> str:
    """Short text for a fingerprint value in a mismatch message."""
    if isinstance(value, list):
        text = repr(value)
        return text if len(text) <= 60 else f"{len(value)} entries"
    return repr(value) if isinstance(value, str) else str(value)


def _mismatches(key: str, expected: Any, actual: Any, out: list[str]) -> None:
    """Append one reason per differing value under `key` (recursing into objects and equal-length lists)."""
    if expected == actual:
        return
    if isinstance(expected, dict) and isinstance(actual, dict):
        for sub in expected:
            if sub in actual:
                _mismatches(f"{key}.{sub}", expected[sub], actual[sub], out)
        return
    if (
        isinstance(expected, list)
        and isinstance(actual, list)
        and len(expected) == len(actual)
        and len(repr(expected)) > 60
    ):
        for i, (exp, act) in enumerate(zip(expected, actual, strict=True)):
            if exp != act:
                out.append(f"{key}[{i}]: plan made for {_describe(exp)}, run has {_describe(act)}")
                return
    out.append(f"{key}: plan made for {_describe(expected)}, run has {_describe(actual)}")


def fingerprint_mismatches(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """One reason per key present in both fingerprints whose values differ; [] when they match.

    Keys missing on either side are ignored (also inside nested objects such as "versions").
    Tuples and lists compare equal, as they would after a JSON round trip.
    """
    if expected == actual:  # the common case (a plan priced on the run it was made for): no copies
        return []
    exp = _canonical(expected)
    act = _canonical(actual)
    out: list[str] = []
    for key in exp:
        if key in act:
            _mismatches(str(key), exp[key], act[key], out)
    return out


def fingerprint_key(fingerprint: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit key of a fingerprint (sha256 of its canonical JSON), for a plan cache."""
    try:
        text = json.dumps(
            _canonical(fingerprint), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise QSyncInputError(f"fingerprint is not plain JSON data: {exc}") from None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
