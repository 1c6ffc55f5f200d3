"""Reading and writing the project's JSON files (plans, traces, reports).

One place for what a user sees when a file is missing, unreadable, empty or not JSON (one line
naming the file, as a `QSyncInputError`), and for atomic writes: a reader never sees half a file.
Never pickle: these files may come from elsewhere, and loading one must not run code.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from qsync_callback.errors import QSyncInputError


def parse_json(text: str, source: str, what: str = "file") -> Any:
    """``text`` parsed; an empty text or bad JSON raises QSyncInputError naming ``source``."""
    if not text.strip():
        raise QSyncInputError(f"{source}: {what} is empty")
    try:
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
