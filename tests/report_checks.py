"""Checks of a report against the traces it was made from, shared by the integrations' tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from qsync_callback.recorder.trace import Trace


def assert_prediction_replays_the_recorded_steps(report: Mapping[str, Any], traces: Sequence[Trace]) -> None:
    """The replay reproduces each recorded step less the profiler's own share, so the predicted step
    lies between the shortest recorded step (less a fifth, far more than that share) and the longest.
    The measured steps are not involved: the machine's speed does not move this, a broken graph or
    replay does. Also: the step-time error is what the two figures say."""
    walls = [(step.end_us - step.start_us) / 1e3 for trace in traces for step in trace.steps]
    predicted, measured = report["predicted"]["step_ms"], report["measured"]["step_ms"]
    assert 0.8 * min(walls) <= predicted <= 1.01 * max(walls), (predicted, walls)
    assert report["error_pct"]["step_ms"] == pytest.approx(100 * abs(predicted - measured) / measured)
