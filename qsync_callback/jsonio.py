"""Reading and writing the project's JSON files (plans, traces, reports, the user's caches).

One place for what a user sees when a file is missing, unreadable, empty, not JSON or not of the
expected shape (one line naming the file and the field, as a `QSyncInputError`; shapes are said
with `Fields`, `ListOf`, `MapOf`, ... and checked by `check_shape`), and for atomic writes: a
reader never sees half a file. A cache file is one document ``{"format", "version", "key", ...}``
(`read_cache_document`, `write_cache_document`): read back only when it is of its format and
version and made for the key asked for (the device and software), else refitted or started afresh
by its owner, with a warning.
Never pickle: these files may come from elsewhere, and loading one must not run code.
"""

from __future__ import annotations

import gc
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from qsync_callback.errors import QSyncInputError


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while JSON's many objects are made (a trace's 10^5
    ops: its passes over them took two thirds of the parse); on again after, if it was on."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def parse_json(text: str, source: str, what: str = "file") -> Any:
    """``text`` parsed; an empty text or bad JSON raises QSyncInputError naming ``source``."""
    if not text.strip():
        raise QSyncInputError(f"{source}: {what} is empty")
    try:
        with collector_paused():
            return json.loads(text)
    except json.JSONDecodeError as exc:
        raise QSyncInputError(
            f"{source}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None


def read_json(path: str | os.PathLike[str], what: str = "file") -> Any:
    """The JSON document at ``path``; any problem raises QSyncInputError naming the path."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise QSyncInputError(f"{path}: {what} not found") from None
    except UnicodeDecodeError:
        raise QSyncInputError(f"{path}: {what} is not UTF-8 text") from None
    except OSError as exc:
        raise QSyncInputError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    return parse_json(text, path, what)


def write_text_atomic(path: str | os.PathLike[str], text: str, what: str = "file") -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".qsync-", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise QSyncInputError(f"{path}: cannot write {what}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise QSyncInputError(f"{path}: cannot write {what}: {exc.strerror or exc}") from None


def read_cache_document(
    path: str, document_format: str, version: int, key: Mapping[str, Any] | None, what: str
) -> tuple[dict[str, Any] | None, str | None]:
    """The cache document at ``path`` and None when it is a JSON object of ``document_format`` and
    ``version`` made for ``key`` (None: for any key); else None and why not, in a few words (the
    path not repeated). No file: None and None."""
    if not os.path.exists(path):
        return None, None
    try:
        data = read_json(path, what)
    except QSyncInputError as error:
        return None, str(error).removeprefix(f"{path}: ")
    if not isinstance(data, dict):
        return None, "not a JSON object"
    if data.get("format") != document_format or data.get("version") != version:
        return None, f"not a {document_format} version {version} document"
    if key is not None and data.get("key") != key:
        return None, "made for another device or software"
    return data, None


def write_cache_document(
    path: str,
    document_format: str,
    version: int,
    key: Mapping[str, Any],
    body: Mapping[str, Any],
    what: str,
    indent: int | None = None,
) -> None:
    """Write ``body`` under ``document_format``, ``version`` and ``key`` at ``path``, atomically,
    making its directory; QSyncInputError or OSError when it cannot be written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    document = {"format": document_format, "version": version, "key": dict(key), **body}
    write_text_atomic(path, json.dumps(document, indent=indent, sort_keys=indent is not None) + "\n", what)


# --- the shape of parsed JSON ----------------------------------------------------------------


def describe(value: Any) -> str:
    """``value`` as a message names it: a short scalar as JSON writes it, a container by its kind."""
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def json_path(parts: Sequence[str | int]) -> str:
    """``["ops", 3, "deps"]`` as ``ops[3].deps``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _Mismatch(Exception):
    """A value that is not what a `Shape` expects; containers add their key to ``path`` on the way out."""

    def __init__(self, value: Any, expected: str):
        super().__init__(expected)
        self.value, self.expected, self.path = value, expected, []


class Shape:
    """What a JSON value must be; ``check`` raises `_Mismatch` at the first difference."""

    expected = "anything"

    def check(self, value: Any) -> None:
        return None


class Scalar(Shape):
    """A value that ``test`` accepts."""

    def __init__(self, test: Callable[[Any], bool], expected: str):
        self.test, self.expected = test, expected

    def check(self, value: Any) -> None:
        if not self.test(value):
            raise _Mismatch(value, self.expected)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


ANY = Shape()
STRING = Scalar(lambda v: isinstance(v, str), "a string")
BOOLEAN = Scalar(lambda v: isinstance(v, bool), "true or false")
INTEGER = Scalar(lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
COUNT = Scalar(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0")
NUMBER = Scalar(_is_number, "a number")
FINITE = Scalar(lambda v: _is_number(v) and math.isfinite(v), "a finite number")
AMOUNT = Scalar(lambda v: _is_number(v) and math.isfinite(v) and v >= 0, "a finite number >= 0")


class Nullable(Shape):
    """null, or what ``shape`` accepts."""

    def __init__(self, shape: Shape):
        self.shape, self.expected = shape, f"null or {shape.expected}"

    def check(self, value: Any) -> None:
        if value is not None:
            try:
                self.shape.check(value)
            except _Mismatch as exc:
                if not exc.path:
                    exc.expected = self.expected
                raise


class ListOf(Shape):
    """A list of items ``item`` accepts; ``length``: exactly that many."""

    def __init__(self, item: Shape, length: int | None = None, expected: str | None = None):
        self.item, self.length = item, length
        self.expected = expected or (
            f"a list of {item.expected}" if length is None else f"a list of {length} ({item.expected})"
        )

    def check(self, value: Any) -> None:
        if not isinstance(value, list) or (self.length is not None and len(value) != self.length):
            raise _Mismatch(value, self.expected)
        if self.item is ANY:
            return
        check = self.item.check
        for i, item in enumerate(value):
            try:
                check(item)
            except _Mismatch as exc:
                exc.path.append(i)
                raise


class Row(Shape):
    """A list of exactly ``len(items)`` values, each as its item says: ``[time_us, address, ...]``."""

    def __init__(self, items: Sequence[Shape], expected: str):
        self.items, self.expected = tuple(items), expected

    def check(self, value: Any) -> None:
        if not isinstance(value, list) or len(value) != len(self.items):
            raise _Mismatch(value, self.expected)
        for i, (item, shape) in enumerate(zip(value, self.items, strict=True)):
            try:
                shape.check(item)
            except _Mismatch as exc:
                exc.path.append(i)
                raise


class MapOf(Shape):
    """An object whose every value ``value`` accepts (JSON keys are strings)."""

    def __init__(self, value: Shape, expected: str | None = None):
        self.value, self.expected = value, expected or f"an object of {value.expected}"

    def check(self, value: Any) -> None:
        if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
            raise _Mismatch(value, self.expected)
        if self.value is ANY:
            return
        check = self.value.check
        for key, item in value.items():
            try:
                check(item)
            except _Mismatch as exc:
                exc.path.append(key)
                raise


class Fields(Shape):
    """An object with the ``required`` keys and, where present, the ``optional`` ones, each as its
    shape says; any other key as ``rest`` says (default: anything)."""

    def __init__(
        self,
        required: Mapping[str, Shape] | None = None,
        optional: Mapping[str, Shape] | None = None,
        rest: Shape = ANY,
    ):
        self.required, self.optional, self.rest = dict(required or {}), dict(optional or {}), rest
        keys = ", ".join(self.required)
        self.expected = f"an object with {keys}" if keys else "an object"

    def check(self, value: Any) -> None:
        if not isinstance(value, Mapping):
            raise _Mismatch(value, self.expected)
        missing = [key for key in self.required if key not in value]
        if missing:
            raise _Mismatch(value, f"{self.expected} (no {missing[0]})")
        for key, item in value.items():
            shape = self.required.get(key) or self.optional.get(key) or self.rest
            try:
                shape.check(item)
            except _Mismatch as exc:
                exc.path.append(key)
                raise


def check_shape(value: Any, shape: Shape, source: str, path: Sequence[str | int] = ()) -> None:
    """Raise QSyncInputError naming ``source`` and the path of the first part of ``value`` (found at
    ``path`` in its file) that is not as ``shape`` says: ``trace.json: layers[0] is 3; expected an
    object with name, type``."""
    try:
        shape.check(value)
    except _Mismatch as exc:
        where = json_path([*path, *reversed(exc.path)]) or "the document"
        got = describe(exc.value)
        raise QSyncInputError(f"{source}: {where} is {got}; expected {exc.expected}") from None
