"""The host CPU as ``/proc/cpuinfo`` names it: its model name and the vector extensions that decide
which precisions it runs fast; and its largest cache, as sysfs gives it.

A VM's model name alone does not say that: this project's VMs are all named "AMD EPYC", some with
AVX512-BF16 (bf16 faster than fp32) and some with no AVX-512 at all (bf16 slower than fp32). So what
is kept per machine (the cast-cost, roofline, copy-cost and op data caches: `lp.costs.cache_key`),
the fingerprint a kept plan must match (`lp.costs.device_name`, the TF side's `tf_device_name`) and
every benchmark's provenance name the extensions beside the model.
"""

from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}

# the extensions that decide low-precision speed on x86 (fp16/bf16/int8 arithmetic and conversions)
PRECISION_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx_vnni",
    "avx_ne_convert",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
)


def _first_field(name: str, cpuinfo: Path | None) -> str | None:
    """The value of the first ``name : value`` line of ``cpuinfo`` (default `CPUINFO`); None where
    there is none."""
    try:
        with open(cpuinfo or CPUINFO, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name and value.strip():
                    return value.strip()
    except OSError:
        return None
    return None


def cpu_name(cpuinfo: Path | None = None) -> str:
    """The CPU's model name (``platform.processor()`` or the machine type where cpuinfo has none)."""
    return _first_field("model name", cpuinfo) or platform.processor() or platform.machine() or "unknown cpu"


def precision_flags(cpuinfo: Path | None = None) -> tuple[str, ...]:
    """Which of `PRECISION_FLAGS` the CPU has, in that order (empty where cpuinfo lists no flags)."""
    flags = set((_first_field("flags", cpuinfo) or "").split())
    return tuple(flag for flag in PRECISION_FLAGS if flag in flags)


def cpu_description(cpuinfo: Path | None = None) -> str:
    """The model name and its precision extensions, as ``AMD EPYC (avx2 fma f16c; no AVX-512)``."""
    flags = precision_flags(cpuinfo)
    listed = " ".join(flags) or "no vector extensions listed"
    if flags and "avx512f" not in flags:
        listed += "; no AVX-512"
    return f"{cpu_name(cpuinfo)} ({listed})"


def largest_cache_bytes(caches: Path | None = None) -> int | None:
    """The size of the largest cache of CPU 0 (the last level), from sysfs's ``index*/size`` files
    under ``caches`` (default `CPU_CACHES`, where Linux writes sizes as ``32768K``); None where
    there is none to read."""
    sizes = []
    for path in sorted((caches or CPU_CACHES).glob("index*/size")):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        unit = _SIZE_UNITS.get(text[-1:].upper())
        digits = text[:-1] if unit else text
        if digits.isdigit():
            sizes.append(int(digits) * (unit or 1))
    return max(sizes, default=None)
