"""planner/tf_plans.py's choice among priced TF plans: a plan with decisions no recorded step ran is
chosen only when it is predicted faster by more than the prediction's error for each of them, beyond
the noise of that difference over the recorded steps."""

import statistics

from hypothesis import given
from hypothesis import strategies as st

from qsync_callback.plan import Plan
from qsync_callback.planner import NO_DECISION_GAIN
from qsync_callback.planner.tf_plans import (
    UNSEEN_MARGIN,
    beats,
    preferred,
    rewrite_to_try,
    to_try_note,
    unseen,
    untold_gain,
)
from qsync_callback.predictor.predict import Prediction

UNIFORM = ["Conv2D", "MatMul", "ReluGrad"]  # what TF's uniform rewrite ran at bf16 (the probe's)
SUBSET = {"Conv2D": "bf16", "MatMul": "bf16"}
GROUPS = [["w1", "w2"], ["w3"]]


def _priced(name, plan, *steps_ms):
    """A priced candidate whose replayed steps took ``steps_ms`` (its figure: their median)."""
    steps = list(steps_ms)
    prediction = Prediction(
        step_ms=statistics.median(steps), peak_bytes=0, replayed_step_ms=steps, per_rank_peak_bytes=[0]
    )
    return name, plan, prediction


PLANS = {
    "uniform": Plan(op_precision=dict.fromkeys(UNIFORM, "bf16")),
    "op types": Plan(op_precision=SUBSET),
    "groups": Plan(buckets=GROUPS),
    "uniform + groups": Plan(op_precision=dict.fromkeys(UNIFORM, "bf16"), buckets=GROUPS),
    "op types + groups": Plan(op_precision=SUBSET, buckets=GROUPS),
}


def test_unseen_counts_an_op_type_set_the_probe_did_not_run_and_gradient_groups():
    assert {name: unseen(plan, UNIFORM) for name, plan in PLANS.items()} == {
        "uniform": 0,
        "op types": 1,
        "groups": 1,
        "uniform + groups": 1,
        "op types + groups": 2,
    }
    assert unseen(Plan(), UNIFORM) == 0
    assert unseen(Plan(op_precision={"Conv2D": "bf16", "MatMul": "bf16", "ReluGrad": "fp32"}), UNIFORM) == 1


def test_each_unseen_decision_must_be_paid_for_by_the_margin():
    # the launch that measured 29% slower: op types + groups predicted 30.63 ms, uniform 32.48: 5.7%
    # faster with two decisions no recorded step ran, where each must be paid for by 5%
    close = [
        _priced("uniform", PLANS["uniform"], 32.48),
        _priced("op types", PLANS["op types"], 34.08),
        _priced("op types + groups", PLANS["op types + groups"], 30.63),
    ]
    assert preferred(close, UNIFORM)[0] == "uniform"
    close[2] = _priced(
        "op types + groups", PLANS["op types + groups"], 32.48 * (1 - 2 * UNSEEN_MARGIN) - 0.01
    )
    assert preferred(close, UNIFORM)[0] == "op types + groups"
    close[2] = _priced(
        "op types + groups", PLANS["op types + groups"], 32.48 * (1 - 2 * UNSEEN_MARGIN) + 0.01
    )
    assert preferred(close, UNIFORM)[0] == "uniform"
    # one unseen decision, 5.7% faster: paid for
    close[1] = _priced("op types", PLANS["op types"], 30.63)
    assert preferred(close, UNIFORM)[0] == "op types"
    # level by level: op types + groups against op types, its one more decision
    close[2] = _priced("op types + groups", PLANS["op types + groups"], 30.63 * (1 - UNSEEN_MARGIN) - 0.01)
    assert preferred(close, UNIFORM)[0] == "op types + groups"
    # equal unseen decisions: the fastest of them
    tied = [_priced("groups", PLANS["groups"], 30.0), _priced("op types", PLANS["op types"], 29.5)]
    assert preferred(tied, UNIFORM)[0] == "op types"


def test_a_difference_the_recorded_steps_disagree_on_decides_nothing():
    """Five recorded steps: a plan 8% faster on each beats the 5% margin; one 8% faster on average
    but from -20% to +4% step by step does not (its mean's 95% band on Student's t, 4 degrees of
    freedom: 2.78 x 10.2 / sqrt(5) = 12.7%)."""
    uniform = _priced("uniform", PLANS["uniform"], 20.0, 22.0, 18.0, 21.0, 19.0)
    steady = _priced("uniform + groups", PLANS["uniform + groups"], 18.4, 20.24, 16.56, 19.32, 17.48)
    assert beats(steady[2], uniform[2], 100 * UNSEEN_MARGIN)
    assert preferred([uniform, steady], UNIFORM)[0] == "uniform + groups"
    changes = [-20.0, 4.0, -16.0, 0.0, -8.0]
    scattered = [b * (1 + c / 100) for b, c in zip(uniform[2].replayed_step_ms, changes, strict=True)]
    noisy = _priced("uniform + groups", PLANS["uniform + groups"], *scattered)
    assert not beats(noisy[2], uniform[2], 100 * UNSEEN_MARGIN)
    assert beats(noisy[2], uniform[2], -5.0)  # -8% +- 12.7%: faster than 5% slower
    assert preferred([uniform, noisy], UNIFORM)[0] == "uniform"
    # exactly the margin is not beyond it
    quarter_off = _priced("uniform + groups", PLANS["uniform + groups"], 75.0)
    assert not beats(quarter_off[2], _priced("uniform", PLANS["uniform"], 100.0)[2], 25.0)


@given(
    st.lists(
        st.tuples(st.sampled_from(sorted(PLANS)), st.lists(st.floats(1.0, 100.0), min_size=3, max_size=3)),
        min_size=1,
        max_size=8,
    )
)
def test_the_choice_has_the_fewest_unseen_decisions_or_beats_a_plan_with_fewer(drawn):
    priced = [_priced(name, PLANS[name], *steps) for name, steps in drawn]
    name, plan, prediction = preferred(priced, UNIFORM)
    level = unseen(plan, UNIFORM)
    fewest = min(unseen(c[1], UNIFORM) for c in priced)
    if level == fewest:
        assert all(prediction.step_ms <= c[2].step_ms for c in priced if unseen(c[1], UNIFORM) == fewest)
    else:
        assert any(
            beats(prediction, c[2], 100 * UNSEEN_MARGIN * (level - unseen(c[1], UNIFORM)))
            for c in priced
            if unseen(c[1], UNIFORM) < level
        )


def test_an_untold_gain_is_a_gain_whose_band_reaches_past_the_deciding_gain():
    edge = -100 * NO_DECISION_GAIN
    assert untold_gain({"change_pct": -0.5, "noise_pct": -edge - 0.5 + 0.01})
    assert not untold_gain({"change_pct": -0.5, "noise_pct": -edge - 0.5})  # reaches it, not past
    assert not untold_gain({"change_pct": -0.5, "noise_pct": 1.0})
    # a band that wide says nothing of the change's sign: a loss within it is untold too
    assert untold_gain({"change_pct": 0.0, "noise_pct": -edge + 0.01})
    assert untold_gain({"change_pct": 9.3, "noise_pct": 19.8})
    assert not untold_gain({"change_pct": 9.3, "noise_pct": 11.0})  # a loss told from a gain of 2%
    assert not untold_gain(None)


def test_the_rewrite_to_try_is_the_uniform_rewrite_alone_among_the_candidates_that_meet_the_constraints():
    """Only TF's uniform rewrite without groups is tried; none where it does not meet the
    constraints (absent from the candidates given) or the probe's change is no untold gain."""
    untold = {"change_pct": -5.0, "noise_pct": 8.7}
    rewrite = _priced("uniform", PLANS["uniform"], 99.0)
    others = [_priced(name, PLANS[name], 97.0) for name in ("op types", "groups", "uniform + groups")]
    assert rewrite_to_try([*others, rewrite], UNIFORM, untold) is rewrite
    assert rewrite_to_try(others, UNIFORM, untold) is None
    assert rewrite_to_try([*others, rewrite], UNIFORM, {"change_pct": -1.0, "noise_pct": 0.5}) is None
    assert rewrite_to_try([*others, rewrite], UNIFORM, None) is None
    # one the replay prices slower is tried too: the probe measured it, the replay is a model
    slower = _priced("uniform", PLANS["uniform"], 110.0)
    assert to_try_note(slower, _priced("recorded", Plan(), 100.0)[2], untold).startswith(
        "to try: uniform is predicted +10.0%, under the 2% that decides, but the bf16 probe measured it "
        "-5.0% +- 8.7 in turns"
    )
