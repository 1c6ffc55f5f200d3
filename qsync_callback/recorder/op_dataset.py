"""This device's data set of measured ops, kept in the user's cache: every recorded trace adds its
op samples (`op_samples.py`), with no extra runs, and the learned per-op cost model
(`predictor/op_cost_model.py`) trains on them.

One JSON file per device (`lp.costs.cache_path`, kind ``op-samples``: keyed by the CPU or GPU and
the torch version, `dataset_key`), holding one document per recorded trace, by its ``source``
(the model's fingerprint: a relaunch of the same model replaces its own document), each with the
intra-op thread count it ran at (the learned model's feature: a data set recorded at 2 threads
prices a step at 1), the newest `MAX_TRACES` kept; the ops estimates timed alone are one document
per thread count. A file that cannot be read or is not this format is started afresh, with a
warning: a cache is never a reason to stop a run.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from qsync_callback.errors import QSyncInputError
from qsync_callback.jsonio import read_cache_document, write_cache_document
from qsync_callback.lp.costs import cache_key, cache_path
from qsync_callback.recorder.op_samples import OpSample, op_key

CACHE_KIND = "op-samples"
DATASET_FORMAT = "qsync-op-samples"
DATASET_VERSION = 1
MAX_TRACES = 64
PROBES_SOURCE = "probes"  # the document of the ops estimates timed alone (`op_probes.py`)


def dataset_key(device: str) -> dict[str, Any]:
    """What a data set is kept for: ``device`` and the torch version (`lp.costs.cache_key` without
    the thread count, which each document holds)."""
    return {k: v for k, v in cache_key(device).items() if k != "threads"}


def dataset_path(device: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The data set file of ``device`` (``"cpu"``, ``"cuda:0"``)."""
    return cache_path(device, cache_dir, kind=CACHE_KIND, key=dataset_key(device))


def load_dataset(device: str, cache_dir: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """The trace documents of ``device``'s data set, oldest first; [] where there is none yet."""
    path = dataset_path(device, cache_dir)
    document, problem = read_cache_document(path, DATASET_FORMAT, DATASET_VERSION, None, "op samples")
    if document is not None and not isinstance(document.get("traces"), list):
        document, problem = None, "holds no list of traces"
    if problem is not None:
        warnings.warn(f"{path}: {problem}; the op data set starts afresh", stacklevel=2)
    if document is None:
        return []
    return [t for t in document["traces"] if isinstance(t, Mapping) and isinstance(t.get("ops"), list)]


def add_to_dataset(
    trace_document: Mapping[str, Any], device: str, cache_dir: str | os.PathLike[str] | None = None
) -> str:
    """Add one trace's samples (`op_samples.samples_document`) to ``device``'s data set, replacing
    any document of the same source; returns the file's path."""
    traces = [t for t in load_dataset(device, cache_dir) if t.get("source") != trace_document["source"]]
    return _save([*traces, dict(trace_document)], device, cache_dir)


def _save(traces: Sequence[Mapping[str, Any]], device: str, cache_dir: str | os.PathLike[str] | None) -> str:
    """Write ``traces``, the newest `MAX_TRACES` of them, as ``device``'s data set; its path."""
    path = dataset_path(device, cache_dir)
    body = {"traces": list(traces)[-MAX_TRACES:]}
    write_cache_document(path, DATASET_FORMAT, DATASET_VERSION, dataset_key(device), body, "op samples")
    return path


def remember_probes(
    probed: Sequence[OpSample], device: str, cache_dir: str | os.PathLike[str] | None = None
) -> None:
    """Add ops timed alone to ``device``'s data set, in its probes document of this process's
    thread count (a later probe of the same op replaces the earlier); a cache that cannot be
    written warns."""
    threads = torch.get_num_threads()
    source = f"{PROBES_SOURCE} at {threads} thread(s)"
    traces = load_dataset(device, cache_dir)
    kept = next((t for t in traces if t.get("source") == source), {})
    ops = {op_key(o["name"], o["shapes"], o["dtypes"]): o for o in kept.get("ops", [])}
    for sample in probed:
        ops[op_key(sample.name, sample.shapes, sample.dtypes)] = asdict(sample)
    others = [t for t in traces if t.get("source") != source]
    document = {"source": source, "threads": threads, "ops": list(ops.values()), "steps": []}
    try:
        _save([*others, document], device, cache_dir)
    except (OSError, QSyncInputError) as error:
        warnings.warn(f"the ops timed alone were not kept: {error}", stacklevel=2)
