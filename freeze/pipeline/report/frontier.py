"""The budget frontier and the iso-accuracy speedup (issue 35).

A user who wants to finish sooner can train fewer steps instead of freezing (budgeted training: Li,
Yumer and Ramanan, ICLR 2020). Full fine-tuning at several fractions of the budget, each with its
LR schedule over its own length, traces accuracy against training time: the frontier. An arm is
worth running only if it lies beyond it, so every arm gets

    iso-accuracy speedup = T_frontier(acc_arm) / T_arm,

the time full fine-tuning needs to reach the arm's accuracy (read off the frontier) over the
arm's own time. Above 1.00 the arm beats training less; at or below, a shorter schedule does as well.

The frontier is the mean over seeds of each budget's (time, accuracy), made monotone (a longer
budget is never read as reaching less than a shorter one: a dip is seed noise), and interpolated
linearly in time. The interval is a paired percentile bootstrap over seeds: each resample draws
seeds with replacement and recomputes both the frontier and the arm from the same seeds, since the
frontier and the arm share each seed's data order and initialisation.

Off the frontier's ends the speedup is a bound, and says so: an arm more accurate than the full
budget needs more than the full time (a lower bound, T_full / T_arm); an arm less accurate than
the shortest budget needs less than its time (an upper bound, which never supports "beyond").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Bound = Literal["exact", "lower", "upper"]

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0  # fixed: the same runs give the same interval, byte for byte, every time
# The share of resamples in each tail the 95 % interval leaves out: past a frontier's end in more than
# this share of resamples, that end of the interval is a cap, not an estimate.
TAIL_SHARE = 0.025
# A percentile bootstrap over n paired seeds has few distinct resamples (n = 2: 3, n = 3: 10,
# n = 5: 126): below this many seeds its percentiles are no 95 % interval, so no verdict is drawn.
MIN_VERDICT_SEEDS = 5


@dataclass(frozen=True)
class Point:
    """One run's result: its training time and its final-epoch accuracy."""

    time_s: float
    accuracy_pct: float


@dataclass(frozen=True)
class IsoSpeedup:
    """T_frontier(acc_arm) / T_arm with its paired bootstrap interval over seeds."""

    speedup: float
    ci_low: float
    ci_high: float
    bound: Bound  # "lower" / "upper": the arm's mean accuracy lies past the frontier's end / start
    seeds: int
    # Shares of the bootstrap resamples whose arm fell below the frontier's start / past its end:
    # there the ratio is capped at the end's time, so an interval end that rests on more than 2.5 %
    # of such resamples is a cap, not an estimate.
    below_start_share: float = 0.0
    past_end_share: float = 0.0

    @property
    def low_is_capped(self) -> bool:
        """The interval's low end rests on resamples below the frontier's start: it is no lower bound."""
        return self.below_start_share > TAIL_SHARE

    @property
    def beyond_frontier(self) -> bool:
        """The arm beats training less: the whole interval above 1.00, with a low end that is a real
        estimate (never an upper bound, never capped at the frontier's start)."""
        return (
            self.seeds >= MIN_VERDICT_SEEDS and self.bound != "upper" and not self.low_is_capped and self.ci_low > 1.0
        )

    def label(self) -> str:
        """``1.52x [1.31, 1.77]``, with ``>= `` / ``<= `` for a bound past the frontier's ends."""
        mark = {"exact": "", "lower": ">= ", "upper": "<= "}[self.bound]
        low = ("<=" if self.low_is_capped else "") + f"{self.ci_low:.2f}"
        high = (">=" if self.past_end_share > TAIL_SHARE else "") + f"{self.ci_high:.2f}"
        interval = f" [{low}, {high}]" if np.isfinite(self.ci_low) else ""
        return f"{mark}{self.speedup:.2f}x{interval}"

    def verdict(self) -> str:
        """Whether the arm lies beyond the frontier: yes, no, undecided (the interval holds 1.00, or
        fewer than MIN_VERDICT_SEEDS seeds), or n/a (one seed: no interval)."""
        if self.beyond_frontier:
            return "yes"
        if 2 <= self.seeds < MIN_VERDICT_SEEDS:
            return f"undecided ({self.seeds} paired seeds; the bootstrap interval needs at least {MIN_VERDICT_SEEDS})"
        if self.bound == "upper":
            return "no (less accurate than the shortest budget)"
        if not np.isfinite(self.ci_low):
            return "n/a"
        if self.low_is_capped:
            return "undecided (its accuracy interval reaches below the shortest budget)"
        return "no" if self.ci_high < 1.0 and self.past_end_share <= TAIL_SHARE else "undecided"


def frontier_curve(runs: Mapping[float, Sequence[Point]]) -> tuple[np.ndarray, np.ndarray]:
    """The mean frontier: per budget fraction, the mean time and mean accuracy over its runs,
    sorted by time, with accuracy made non-decreasing (running maximum).

    Args:
        runs: budget fraction -> that budget's runs (one per seed).

    Returns:
        (times_s, accuracies_pct), both increasing in time, accuracy non-decreasing.
    """
    if len(runs) < 2:
        raise ValueError(f"frontier: {len(runs)} budget fraction(s); accepted: at least 2 to interpolate between")
    times = np.array([np.mean([p.time_s for p in points]) for points in runs.values()])
    accuracies = np.array([np.mean([p.accuracy_pct for p in points]) for points in runs.values()])
    return monotone_curve(times, accuracies)


def monotone_curve(times_s: np.ndarray, accuracies_pct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Budget points sorted by time, accuracy made non-decreasing (running maximum): a longer budget
    is never read as reaching less than a shorter one (a dip is seed noise)."""
    order = np.argsort(times_s, kind="stable")
    return times_s[order], np.maximum.accumulate(accuracies_pct[order])


def frontier_time(accuracy_pct: float, times_s: np.ndarray, accuracies_pct: np.ndarray) -> tuple[float, Bound]:
    """The time the frontier needs to reach ``accuracy_pct``: the first time the piecewise linear
    curve reaches it. Past the curve's ends: its last (a lower bound) or first time (an upper bound).

    Args:
        accuracy_pct: the accuracy to reach.
        times_s: the frontier's times, increasing.
        accuracies_pct: its accuracies, non-decreasing.
    """
    if accuracy_pct > accuracies_pct[-1]:
        return float(times_s[-1]), "lower"
    if accuracy_pct < accuracies_pct[0]:
        return float(times_s[0]), "upper"
    i = int(np.searchsorted(accuracies_pct, accuracy_pct, side="left"))
    if i == 0 or accuracies_pct[i] == accuracy_pct:
        return float(times_s[i]), "exact"
    a0, a1 = accuracies_pct[i - 1], accuracies_pct[i]
    t0, t1 = times_s[i - 1], times_s[i]
    return float(t0 + (t1 - t0) * (accuracy_pct - a0) / (a1 - a0)), "exact"


def iso_accuracy_speedup(
    frontier: Mapping[float, Mapping[int, Point]],
    arm: Mapping[int, Point],
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> IsoSpeedup:
    """The arm's iso-accuracy speedup over the seeds every budget and the arm share.

    Args:
        frontier: budget fraction -> seed -> full fine-tuning's result at that budget.
        arm: seed -> the arm's result.
        resamples: bootstrap resamples for the 95 % interval.
    """
    seeds = sorted(set(arm).intersection(*(set(by_seed) for by_seed in frontier.values())))
    if not seeds:
        raise ValueError("iso-accuracy speedup: no seed has both the arm and every budget of the frontier")

    fractions = sorted(frontier)
    times = np.array([[frontier[f][s].time_s for s in seeds] for f in fractions])  # fractions x seeds
    accuracies = np.array([[frontier[f][s].accuracy_pct for s in seeds] for f in fractions])
    arm_times = np.array([arm[s].time_s for s in seeds])
    arm_accuracies = np.array([arm[s].accuracy_pct for s in seeds])

    def estimate(mean_times: np.ndarray, mean_accuracies: np.ndarray, arm_time: float, arm_acc: float):
        needed, bound = frontier_time(float(arm_acc), *monotone_curve(mean_times, mean_accuracies))
        return needed / float(arm_time), bound

    speedup, bound = estimate(times.mean(axis=1), accuracies.mean(axis=1), arm_times.mean(), arm_accuracies.mean())
    if len(seeds) < 2:
        return IsoSpeedup(speedup, float("nan"), float("nan"), bound, len(seeds))
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    draws = rng.integers(0, len(seeds), size=(resamples, len(seeds)))
    # Every resample's means at once (fractions x resamples); the same seeds for frontier and arm.
    sample_times, sample_accuracies = times[:, draws].mean(axis=2), accuracies[:, draws].mean(axis=2)
    sample_arm_times, sample_arm_accuracies = arm_times[draws].mean(axis=1), arm_accuracies[draws].mean(axis=1)
    found = [
        estimate(sample_times[:, i], sample_accuracies[:, i], sample_arm_times[i], sample_arm_accuracies[i])
        for i in range(resamples)
    ]
    low, high = np.percentile([ratio for ratio, _ in found], [2.5, 97.5])
    below = sum(b == "upper" for _, b in found) / resamples
    past = sum(b == "lower" for _, b in found) / resamples
    return IsoSpeedup(speedup, float(low), float(high), bound, len(seeds), below, past)
