"""benchmarks/activation_costs.py: the single-module options it measures and their two prices, on
the hand-written step of `test_activation_plans.py` (a block ``b`` of two layers, then a ``head``)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from activation_costs import (  # noqa: E402
    chosen_options,
    markdown,
    trial_options,
    turns_cost_ms,
    without_trials,
)
from test_activation_plans import COPY, _step  # noqa: E402

from qsync_callback.predictor.predict import Predictor  # noqa: E402

DISK = {**COPY, "tier": "disk"}


def _predictor(tried: str) -> Predictor:
    """The step with an offload trial (factor 2.5) and a recompute trial (0.02 ms over the 10 us
    its module's forward prices: factor 2) on the module ``tried``."""
    recompute = {"modules": [tried], "rounds": 6, "baseline_ms": 0.08, "change_ms": 0.02, "noise_ms": 0.001}
    costs = {
        "copy": {**DISK, "in_step": {"modules": [tried], "factor": 2.5}},
        "recompute": {"in_step": recompute},
    }
    return Predictor([_step(costs)])


def test_the_trials_modules_are_left_out_and_the_others_priced_with_and_without_the_trials():
    # the trials ran on the head; the block b is the step's one module with something to free
    predictor = _predictor("head")
    rows = {r["policy"]: r for r in chosen_options(predictor, 3)}
    assert {r["module"] for r in rows.values()} == {"b"}
    # offload on the disk tier: its copies (10 us by the fit) times the trial's factor
    assert rows["offload"]["untried_cost_ms"] * 1e3 == pytest.approx(10.0)
    assert rows["offload"]["predicted_cost_ms"] * 1e3 == pytest.approx(25.0)
    assert rows["offload"]["predicted_change_pct"] == pytest.approx(100 * 25 / 80)
    # recompute: b's recorded forward (25 us) times the head's trial's factor
    assert rows["recompute"]["untried_cost_ms"] * 1e3 == pytest.approx(25.0)
    assert rows["recompute"]["predicted_cost_ms"] * 1e3 == pytest.approx(50.0)
    # trials on b itself leave nothing to measure: b's price would be its trials' own measurement
    assert chosen_options(_predictor("b"), 3) == []
    # without the trials the traces keep everything else (the copy-cost fit); the originals stay
    bare = without_trials(predictor.traces)
    assert "in_step" not in bare[0].activation_costs["copy"]
    assert "in_step" not in bare[0].activation_costs["recompute"]
    assert bare[0].activation_costs["copy"]["to_store"] == DISK["to_store"]
    assert "in_step" in predictor.traces[0].activation_costs["copy"]


def test_each_trials_modules_together_are_priced_with_the_trial_and_without_it():
    predictor = _predictor("head")
    rows = {r["policy"]: r for r in trial_options(predictor)}
    assert set(rows) == {"offload", "recompute"}
    assert all(r["together"] and r["module"] == "head" for r in rows.values())
    assert rows["offload"]["plan"].activation == {"head": "offload"}
    # with the trial its factor prices the head's copies; without it the fit alone does
    assert rows["offload"]["predicted_cost_ms"] == pytest.approx(2.5 * rows["offload"]["untried_cost_ms"])
    assert rows["recompute"]["predicted_cost_ms"] == pytest.approx(2 * rows["recompute"]["untried_cost_ms"])
    assert rows["offload"]["untried_cost_ms"] > 0
    # no trial, no row
    bare = Predictor(without_trials(predictor.traces))
    assert trial_options(bare) == []


def test_the_table_counts_the_costs_within_ten_percent_and_within_the_noise():
    def row(policy, predicted, measured, noise):
        return {
            "module": "m",
            "policy": policy,
            "freed_bytes": 2**20,
            "predicted_cost_ms": predicted,
            "untried_cost_ms": predicted / 2,
            "measured_cost_ms": measured,
            "noise_ms": noise,
            "cost_error_pct": 100 * (predicted / measured - 1),
        }

    together = {
        **row("offload", 40.0, 30.0, 1.5),
        "together": True,
        "untried_cost_ms": 28.0,
        "module": "a, b",
    }
    rows = [
        row("offload", 10.5, 10.0, 0.1),
        row("offload", 13.0, 10.0, 4.0),
        row("recompute", 5.0, 10.0, 1.0),
        together,
    ]
    table = markdown([{"model": "x", "rows": rows, "trials": {}}], rounds=24, repeats=2)
    assert "offload: median |cost error| 18% over 2 modules (mean signed +18%); within 10%: 1 of 2; " in table
    assert "predicted within the measured noise: 1 of 2." in table
    assert "recompute: median |cost error| 50% over 1 modules (mean signed -50%); within 10%: 0 of 1" in table
    assert "| x | m | offload | 1.0 MiB | +10.50 | +10.00 (+-0.10) | +5% | no | +5.25 | 1.90 |" in table
    # the trial's modules together: in the table, out of the single modules' counts, and their price
    # without the trial against the measured cost in a line of its own
    assert (
        "| x | together: a, b | offload | 1.0 MiB | +40.00 | +30.00 (+-1.50) | +33% | no | +28.00 | 1.07 |"
        in table
    )
    line = "- x offload of a, b: +28.00 ms priced without the trial against +30.00 ms (+-1.50, +-5% of it): "
    assert line + "-6.7%, within 10%." in table


def test_the_measured_cost_is_each_processs_change_times_its_own_baseline_step():
    # two processes, one 20% slower than the other: each change is taken at its own baseline
    fast = {"change_pct": 10.0, "noise_pct": 4.0, "baseline_ms": [50.0, 49.0, 51.0]}
    slow = {"change_pct": 10.0, "noise_pct": 4.0, "baseline_ms": [60.0, 61.0, 59.0]}
    untimed = {"change_pct": None, "noise_pct": None, "baseline_ms": []}
    cost, noise = turns_cost_ms([fast, slow, untimed])
    assert cost == pytest.approx((5.0 + 6.0) / 2)
    assert noise == pytest.approx((2.0**2 + 2.4**2) ** 0.5 / 2)
