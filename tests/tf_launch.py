"""Fresh processes for the TensorFlow tests: the Horovod + TF example (or another script) under
Python or ``horovodrun -np 2 --gloo``, with this checkout importable, TF's logs quiet, and a plan
cache of their own (never the user's)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_horovod_tf.py"
HOROVODRUN = Path(sys.executable).with_name("horovodrun")
_CACHES = tempfile.TemporaryDirectory(prefix="qsync-test-caches-")  # removed when the tests end
# the example's turns in mode "apply" where a test does not test their length: 2 looks (6 rounds),
# not 32 (96), which a plan the tests' small steps cannot tell from the baseline would run
SHORT_TURNS = ["--alternate-looks", "2"]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the checkout on PYTHONPATH, TF's C++ logs at warnings, a new
    empty plan cache (``XDG_CACHE_HOME``), and ``extra`` on top (a test that launches twice with one
    cache gives its own)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    cache = tempfile.mkdtemp(dir=_CACHES.name)
    env = {"PYTHONPATH": path, "TF_CPP_MIN_LOG_LEVEL": "2", "XDG_CACHE_HOME": cache}
    return {**os.environ, **env, **(extra or {})}


def run_python(args: list[str], env: Mapping[str, str] | None = None, timeout: float = 120):
    """``python *args`` in one process; asserts it exited 0 and returns the finished process."""
    run = subprocess.run(
        [sys.executable, *args], env=child_env(env), capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def run_horovod(args: list[str], env: Mapping[str, str] | None = None, timeout: float = 240):
    """``horovodrun -np 2 -H localhost:2 --gloo python *args``; asserts it exited 0 and that no
    qsync Recorder stepped aside, and returns the finished process."""
    cmd = [str(HOROVODRUN), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, *args]
    run = subprocess.run(cmd, env=child_env(env), capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "qsync Recorder steps aside" not in run.stdout + run.stderr
    return run
