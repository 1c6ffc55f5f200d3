"""The per-user plan cache: where kept plans live between launches.

A kept plan is filed under its job, the device it was made on and the constraints it was chosen
under: ``<cache dir>/plans/<job>-<key>.json``. The job is what the integration calls the training
script's model (the LightningModule's or Keras model's class); the key is a digest of the
fingerprint's ``device`` (`lp.costs.device_name`: on the CPU its model name and precision
extensions) and `Plan.constraints`. So the next launch of the same job on the same kind of device
under the same constraints finds its plan there, and applies it if the rest of the fingerprint
(model structure, batch shapes, world size, versions) matches; otherwise it says which of them
changed and plans afresh. A launch under other constraints (another memory budget, other
precisions) never takes a plan chosen under these, and machines of two kinds sharing one cache
directory (a home on a network file system) keep a plan each.
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


def plan_cache_path(
    job: str, constraints: Mapping[str, Any], device: str, cache_dir: str | os.PathLike | None = None
) -> Path:
    """The cache file for ``job`` planned on ``device`` (a fingerprint's ``device``) under
    ``constraints``."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:80] or "job"
    name = f"{safe}-{fingerprint_key({'device': device, 'constraints': constraints})}.json"
    return Path(default_cache_dir() if cache_dir is None else cache_dir) / PLANS_DIR / name


def store_plan(plan: Plan, job: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Keep ``plan`` for the next launch of ``job`` on the same kind of device (its fingerprint's)
    under the same constraints; returns the file."""
    path = plan_cache_path(job, plan.constraints, plan.fingerprint.get("device", ""), cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    plan.save(path)
    return path


def cached_plan(
    job: str,
    fingerprint: Mapping[str, Any],
    constraints: Mapping[str, Any],
    cache_dir: str | os.PathLike | None = None,
) -> tuple[Plan | None, str | None]:
    """The kept plan for this run, or None and why not (None and None: there is none).

    A kept plan that cannot be read, was made for a run that differs from ``fingerprint``, or under
    other constraints than ``constraints``, is not returned; the reason says which file and what
    differs."""
    path = plan_cache_path(job, constraints, fingerprint.get("device", ""), cache_dir)
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
    if fingerprint_key(plan.constraints) != fingerprint_key(constraints):
        return None, f"the kept plan {path} was chosen under other constraints"
    return plan, None


def drop_cached_plan(
    job: str, constraints: Mapping[str, Any], device: str, cache_dir: str | os.PathLike | None = None
) -> None:
    """Forget the kept plan of ``job`` on ``device`` under ``constraints`` (one that cannot be
    applied here)."""
    plan_cache_path(job, constraints, device, cache_dir).unlink(missing_ok=True)
