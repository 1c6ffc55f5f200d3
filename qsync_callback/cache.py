"""The per-user cache: where measured cast costs and kept plans live between launches.

Plans are kept one per job, in ``<cache dir>/plans/<model>.json``, where ``<model>`` is the
fingerprint's digest of the model's structure: the next launch of the same model finds its plan
there, applies it if the rest of the fingerprint (batch shapes, device, world size, versions)
matches, and otherwise says which of them changed and plans afresh.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qsync_callback.errors import QSyncInputError
from qsync_callback.plan import Plan, fingerprint_key

PLANS_DIR = "plans"


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/qsync_callback`` (an absolute XDG_CACHE_HOME only, as the XDG spec says),
    else ``~/.cache/qsync_callback``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "qsync_callback")


def plan_cache_path(fingerprint: Mapping[str, Any], cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache file for the job ``fingerprint`` describes (keyed by its model digest)."""
    model = str(fingerprint.get("model") or fingerprint_key(fingerprint))
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", model)
    return Path(default_cache_dir() if cache_dir is None else cache_dir) / PLANS_DIR / f"{safe}.json"


def store_plan(plan: Plan, cache_dir: str | os.PathLike | None = None) -> Path:
    """Keep ``plan`` for the next launch of its job; returns the file written."""
    path = plan_cache_path(plan.fingerprint, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    plan.save(path)
    return path


def cached_plan(
    fingerprint: Mapping[str, Any], cache_dir: str | os.PathLike | None = None
) -> tuple[Plan | None, str | None]:
    """The kept plan for this run, or None and why not (None and None: there is none).

    A kept plan that cannot be read, or was made for a run that differs from ``fingerprint``, is
    not returned; the reason says which file and what differs."""
    path = plan_cache_path(fingerprint, cache_dir)
    if not path.exists():
        return None, None
    try:
        plan = Plan.load(path)
    except QSyncInputError as error:
        return None, f"the kept plan cannot be read ({error})"
    try:
        plan.check_for(fingerprint, source=f"the kept plan {path}")
    except QSyncInputError as error:
        return None, str(error)
    return plan, None
