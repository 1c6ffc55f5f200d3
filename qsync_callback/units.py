"""Sizes as people write them: ``"2GB"``, ``"512 MiB"``, ``1_000_000``."""

from __future__ import annotations

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
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(size: str | int | float) -> int:
    """Bytes in ``size``: a number of bytes, or a string with a decimal (KB, MB, GB, TB) or binary
    (KiB, MiB, GiB, TiB) unit, case-insensitive. Raises ValueError for anything else or a size <= 0."""
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
    if value <= 0:
        raise ValueError(f"a size must be positive, not {size!r}")
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
    if not share > 0:
        raise ValueError(f"a percentage must be positive, not {text!r}")
    return share


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
