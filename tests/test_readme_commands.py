"""The README's two commands in its order: ``make example`` prints Lightning's output and the
callback's, and no profiler chatter; ``make test`` after it still passes its lint."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """The example run as ``make example`` runs it (in a copy of the repository's layout: it writes
    ``runs/`` where it is started), shortened to a few recorded steps."""
    root = tmp_path_factory.mktemp("clone")
    for name in ("pyproject.toml", "benchmarks", "examples"):
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, root / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            shutil.copy(source, root / name)
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}  # the user chose none
    result = subprocess.run(
        [sys.executable, "examples/train_lightning.py", "--max-steps", "16", "--mode", "record"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return root, result


def test_the_example_prints_no_profiler_start_and_stop_lines(example_run):
    _, result = example_run
    output = result.stdout + result.stderr
    assert "Trainer.fit" in output  # Lightning's output is there
    assert "USDT" not in output and "profiler_start" not in output


def test_lint_after_the_example_does_not_take_its_runs_folder_for_a_package(example_run):
    """``benchmarks/runs.py`` is imported as ``runs``; the example's ``runs/`` must not make that
    import first-party (ruff's classification, without its cache, as on a fresh clone)."""
    root, _ = example_run
    assert (root / "runs").is_dir()
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "benchmarks"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-2000:]
