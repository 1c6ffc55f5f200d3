"""Imports point one way: recorder -> predictor -> planner -> appliers -> integrations, and the core
imports no training framework but torch (read from the source, lazy imports included). The turns'
schedule and their paired change (`alternation.py`) stand below all of them: the loop, the
activation trial and the TF probe run turns, and the predictor prices a change measured in them."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "qsync_callback"
# a module of the first part must not import any of the second
ABOVE_RECORDER = ("predictor", "planner", "appliers", "tuning_loop", "report", "verify", "integrations")
FORBIDDEN = {
    "recorder": ABOVE_RECORDER,
    "predictor": ("planner", "appliers", "tuning_loop", "verify", "integrations"),
    "planner": ("appliers", "tuning_loop", "verify", "integrations"),
    "appliers": ("tuning_loop", "integrations"),
    "alternation": ("recorder", *ABOVE_RECORDER),
    "lp": ("recorder", "predictor", "planner", "appliers", "tuning_loop", "integrations"),
}
FRAMEWORKS = ("pytorch_lightning", "lightning", "tensorflow", "horovod", "keras")
# the TF capture modules (recorder/tf_*.py, imported by the Horovod integration only), and the reader
# of TF's own trace format (its protobuf module, imported when a TF trace is read)
TF_CAPTURE = "recorder/tf_"
XSPACE_READER = "recorder/xspace.py"


def _may_import_frameworks(path: Path) -> bool:
    name = str(path.relative_to(PACKAGE))
    return name.startswith(TF_CAPTURE) or name == XSPACE_READER


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _modules(part: str) -> list[Path]:
    where = PACKAGE / part
    return sorted(where.rglob("*.py")) if where.is_dir() else [where.with_suffix(".py")]


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_imports_point_one_way(part):
    bad = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in _modules(part)
        for name in sorted(_imports(path))
        for later in FORBIDDEN[part]
        if name == f"qsync_callback.{later}" or name.startswith(f"qsync_callback.{later}.")
    ]
    assert not bad, bad


def test_the_core_imports_no_training_framework_but_torch():
    bad = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not _may_import_frameworks(path)
        for name in sorted(_imports(path))
        if name.split(".")[0] in FRAMEWORKS
    ]
    assert not bad, bad
    users = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if not _may_import_frameworks(path)
        and any(name.startswith("qsync_callback.recorder.tf_") for name in _imports(path))
    ]
    assert not users, f"core modules import the TF capture modules: {users}"


def test_the_rules_see_real_imports():
    """The reader finds the imports these rules are about (a parser that found none would pass)."""
    assert "qsync_callback.lp.costs" in _imports(PACKAGE / "recorder" / "precision_probes.py")
    assert "qsync_callback.recorder.trace" in _imports(PACKAGE / "predictor" / "predict.py")
