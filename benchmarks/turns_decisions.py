"""How often the loop's turns decide, and decide alike: its own rule on simulated block times.

The loop keeps or rolls back a plan on the rounds it runs in turns with the recorded configuration
(`qsync_callback/alternation.py`): at each look it asks `verify.can_tell` of `paired_change`'s change
and noise, and goes on while it cannot tell, up to ``looks`` times the first rounds. This benchmark
feeds that code block times drawn at random, with a known change, and counts the outcomes: faster
(kept), slower (rolled back) or could not tell at the last look, and how many rounds it took.
"Two launches agree" is the chance that two identical launches reach the same outcome (the sum of
the outcomes' squared shares), what issue 11 asks of identical launches.

A simulated round: a drift of the machine shared by both blocks (uniform 0.8-1.2, which the pairing
cancels), the plan's block slower by ``change`` times a factor drawn normal with the round spread
(the disagreement of real rounds: the Horovod MLP's two 12-round launches on two processes in
session 21's run of `horovod_tf_plans.py`, at `faeb1c5`, spread 14.3% and 10.6%, standard
deviations); in the cases with rounds far off, that share of the rounds has the plan's block `FAR_OFF`
slower still (the two-process Horovod MLP's rounds in session 43: most near -15%, the rest near 0 to
+10%, a few past +30%); each step's time jittered by ``STEP_JITTER``. The loop decides on the rounds'
mean or their median, whichever is the less noisy (`alternation.less_noisy_change`), and so does this
simulation. The rules, each handed to `paired_change` as its band:
"sequential", the loop's (Student's t at the level that holds all the looks together to 5%,
`Alternation.band`); "student", a 95% band on Student's t at every look (`mean_band.band_factor`,
the loop's rule before); "normal", 2 standard errors whatever the rounds. A plan is kept only for a
gain past the least kept (`verify.LEAST_KEPT_GAIN`, 1%); the quiet cases (rounds spreading 3%,
about what leaves a one-process Lightning launch's turns at +-1.0-1.4% after 46 rounds, as the
benchmarks' ResNet's did in `decision_repeatability.py`'s table) run the loop's rule with it and
without it (0%), to show what it does to gains near it.

    python benchmarks/turns_decisions.py [--runs 2000] [--quick] [--out benchmarks/results]

``--quick``: 200 launches a row.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runs import bench_environment, write_results

from qsync_callback.alternation import (
    BASELINE,
    BLOCK_STEPS,
    LOOKS,
    PLAN,
    ROUNDS,
    Alternation,
    less_noisy_change,
    paired_change,
)
from qsync_callback.mean_band import band_factor
from qsync_callback.verify import LEAST_KEPT_GAIN, can_tell

STEP_JITTER = 0.03
CASES = (  # true change %, round spread %, share of the rounds far off (`FAR_OFF`)
    (0.0, 12.5, 0.0),
    (-3.0, 12.5, 0.0),
    (-5.0, 12.5, 0.0),
    (-10.0, 12.5, 0.0),
    (-20.0, 12.5, 0.0),
    (10.0, 12.5, 0.0),
    (-10.0, 20.0, 0.0),
    (0.0, 12.5, 0.1),
    (-5.0, 12.5, 0.1),
)
QUIET_CASES = tuple((change, 3.0, 0.0) for change in (0.0, -0.5, -1.0, -1.5, -2.0, -3.0))
RULES = (("normal", 8), ("student", 8), ("sequential", 8), ("sequential", LOOKS))  # the last: the loop's
LEAST_GAINS_PCT = (100 * LEAST_KEPT_GAIN, 0.0)  # the quiet cases': the loop's, and none
BANDS: dict[str, Callable[[Alternation, int], float]] = {
    "sequential": Alternation.band,
    "student": lambda schedule, rounds: band_factor(rounds),
    "normal": lambda schedule, rounds: 2.0,
}
OUTCOMES = ("faster", "slower", "could not tell")
FAR_OFF = 40.0  # %: a round far off the rest, as the two-process Horovod MLP's turns have a few


def simulated_round(
    rng: random.Random, change_pct: float, spread_pct: float, far_share: float = 0.0
) -> tuple[list[float], list[float]]:
    """One round's baseline and plan blocks of `BLOCK_STEPS` step times (ms); in ``far_share`` of
    the rounds the plan's block is `FAR_OFF` slower still."""
    drift = 100.0 * rng.uniform(0.8, 1.2)
    plan_factor = (1 + change_pct / 100) * (1 + rng.gauss(0.0, spread_pct / 100))
    if far_share and rng.random() < far_share:
        plan_factor *= 1 + FAR_OFF / 100
    baseline = [drift * (1 + rng.gauss(0.0, STEP_JITTER)) for _ in range(BLOCK_STEPS)]
    plan = [drift * plan_factor * (1 + rng.gauss(0.0, STEP_JITTER)) for _ in range(BLOCK_STEPS)]
    return baseline, plan


def decide(
    rounds: list[tuple[list[float], list[float]]],
    schedule: Alternation,
    band: Callable[[int], float],
    least_gain_pct: float,
) -> tuple[str, int]:
    """The loop's outcome on ``rounds`` (as many as the schedule's most) with the rounds' noise
    ``band`` standard errors wide, a gain kept past ``least_gain_pct``, and the rounds it used."""
    for used in range(schedule.rounds, schedule.most_rounds + 1, schedule.rounds):
        taken = rounds[:used]
        turns = paired_change([{BASELINE: [b for b, _ in taken], PLAN: [p for _, p in taken]}], band)
        decided_on = less_noisy_change(turns)
        change, noise = decided_on["change_pct"], decided_on["noise_pct"]
        if can_tell(change, noise, least_gain_pct):
            return ("faster" if change < 0 else "slower"), used
    return "could not tell", schedule.most_rounds


def simulate(
    rule: str,
    looks: int,
    change_pct: float,
    spread_pct: float,
    runs: int,
    seed: int,
    far_share: float = 0.0,
    least_gain_pct: float = 100 * LEAST_KEPT_GAIN,
) -> dict[str, Any]:
    """``runs`` simulated launches under ``rule`` with up to ``looks`` looks (``far_share``:
    `simulated_round`'s; ``least_gain_pct``: `decide`'s)."""
    rng = random.Random(seed)
    schedule = Alternation(ROUNDS, looks=looks)
    counts = dict.fromkeys(OUTCOMES, 0)
    used = []
    for _ in range(runs):
        rounds = [
            simulated_round(rng, change_pct, spread_pct, far_share) for _ in range(schedule.most_rounds)
        ]
        outcome, n = decide(rounds, schedule, lambda n: BANDS[rule](schedule, n), least_gain_pct)
        counts[outcome] += 1
        used.append(n)
    shares = {outcome: counts[outcome] / runs for outcome in OUTCOMES}
    return {
        "rule": rule,
        "looks": looks,
        "change_pct": change_pct,
        "spread_pct": spread_pct,
        "far_share": far_share,
        "least_gain_pct": least_gain_pct,
        "runs": runs,
        **shares,
        "agree": sum(share**2 for share in shares.values()),
        "mean_rounds": statistics.fmean(used),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| true change | round spread | rounds far off | rule | looks (rounds) | least gain kept | faster"
        " | slower | could not tell | two launches agree | mean rounds |",
        "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['change_pct']:+.1f}% | {row['spread_pct']:.1f}% | {100 * row['far_share']:.0f}%"
            f" | {row['rule']} | {row['looks']}"
            f" ({ROUNDS}-{ROUNDS * row['looks']}) | {row['least_gain_pct']:.0f}% | {100 * row['faster']:.1f}%"
            f" | {100 * row['slower']:.1f}% | {100 * row['could not tell']:.1f}% | {100 * row['agree']:.1f}%"
            f" | {row['mean_rounds']:.1f} |"
        )
    lines += [
        "",
        f"{rows[0]['runs']} simulated launches a row, {ROUNDS} rounds first, blocks of"
        f" {BLOCK_STEPS} timed steps jittered {100 * STEP_JITTER:.0f}%;"
        f" sequential: the loop's rule (the loop looks up to {LOOKS} times); student: 95% at every look;"
        " normal: 2 standard errors.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000, help="simulated launches a row")
    parser.add_argument("--quick", action="store_true", help="smoke pass: 200 launches a row")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    runs = 200 if args.quick else args.runs
    environment = bench_environment(runs=runs)
    rows = [
        simulate(rule, looks, change, spread, runs, seed=k, far_share=far)
        for k, (change, spread, far) in enumerate(CASES)
        for rule, looks in RULES
    ]
    rows += [
        simulate("sequential", LOOKS, change, spread, runs, seed=len(CASES) + k, least_gain_pct=least)
        for k, (change, spread, _) in enumerate(QUIET_CASES)
        for least in LEAST_GAINS_PCT
    ]
    write_results(args.out, "turns_decisions", markdown(rows), {"environment": environment, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
