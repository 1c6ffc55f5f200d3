"""benchmarks/runs.py's busy machine: another job beside a benchmark's launches, taking a share of
one core in bursts while the block runs, and gone after it."""

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from runs import busy_machine  # noqa: E402


def _cpu_seconds(pid: int) -> float:
    """A process's user and system time so far (Linux's /proc/PID/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_busy_job_takes_cpu_time_while_the_block_runs_and_ends_with_it():
    with busy_machine(0.5, seed=1) as job:
        assert job is not None and job.is_alive()
        time.sleep(2.0)
        taken = _cpu_seconds(job.pid)
    # half a core over 2 s is about 1 s of CPU time, in bursts of 0.05-0.6 s each followed by an idle
    # time of the same length (0.5-1.5 times); two cores, so it is not starved by this test
    assert 0.2 < taken < 1.9
    assert not job.is_alive()


def test_no_busy_job_at_share_0_and_none_over_one_core():
    with busy_machine(0.0) as job:
        assert job is None
    with pytest.raises(ValueError, match="over one core"), busy_machine(1.5):
        pass
