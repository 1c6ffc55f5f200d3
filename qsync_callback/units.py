"""Sizes as people write them: ``"2GB"``, ``"512 MiB"``, ``1_000_000``."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(size: str | int | float) -> int:
    """Bytes in ``size``: a number of bytes, or a string with a decimal (KB, MB, GB, TB) or binary
    (KiB, MiB, GiB, TiB) unit, case-insensitive ("1e9" and "1.5e3MB" too). Raises ValueError for
    anything else, a size that is not finite, or one under a byte."""
    if isinstance(size, bool):
        raise ValueError(f"not a size: {size!r}")
    if isinstance(size, (int, float)):
        value = float(size)
    else:
        match = _SIZE.match(str(size))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"not a size: {size!r} (write e.g. 2GB, 512MiB or a number of bytes)")
        value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"a size must be a finite number of bytes, at least 1, not {size!r}")
    return int(value)


def parse_share(text: str | int | float) -> float | None:
    """The fraction in a percentage such as ``"90%"`` (0.9); None if ``text`` is not one. Raises
    ValueError for a percentage that is not positive."""
    if not isinstance(text, str) or not text.strip().endswith("%"):
        return None
    try:
        share = float(text.strip()[:-1]) / 100
    except ValueError:
        raise ValueError(f"not a percentage: {text!r}") from None
    if not (math.isfinite(share) and share > 0):
        raise ValueError(f"a percentage must be a positive finite number, not {text!r}")
    return share


def parse_memory_budget(budget: str | int | float) -> tuple[int | None, float | None]:
    """A memory budget as people write it: ``(bytes, None)`` for a size ("2GB", "1e9", 6_000_000),
    ``(None, share)`` for a share of the recorded peak ("90%"). Raises ValueError, naming what to
    write instead, for anything else (a number under one byte such as 0.5 is taken for a share
    written wrong)."""
    share = parse_share(budget)
    if share is not None:
        return None, share
    if isinstance(budget, (int, float)) and not isinstance(budget, bool) and 0 < budget < 1:
        raise ValueError(
            f"{budget!r} would be less than a byte; write a share as a percentage "
            f"({budget * 100:g}%) or a size (2GB, 512MiB)"
        )
    try:
        return parse_bytes(budget), None
    except ValueError as error:
        raise ValueError(f"{error}; or write a share of the recorded peak (90%)") from None


def parse_seconds(value: object, name: str) -> float:
    """A positive, finite number of seconds (an int or float, not text); ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number of seconds, such as 0.12, not {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: must be a positive, finite number of seconds, not {value!r}")
    return float(value)


def check_count(value: object, name: str, least: int) -> int:
    """An integer (not a bool or float) at least ``least``; ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: must be an integer of at least {least}, not {value!r}")
    return value


def format_bytes(nbytes: float | None) -> str:
    """``nbytes`` in binary units: "812 B", "21.0 KiB", "9.2 MiB", "1.50 GiB"; "n/a" for None."""
    if nbytes is None:
        return "n/a"
    if abs(nbytes) < 2**10:
        return f"{nbytes:.0f} B"
    if abs(nbytes) < 2**20:
        return f"{nbytes / 2**10:.1f} KiB"
    if abs(nbytes) < 2**30:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**30:.2f} GiB"
