"""The budget frontier and the iso-accuracy speedup (issue 35).

A user who wants to finish sooner can train fewer steps instead of freezing (budgeted training: Li,
Yumer and Ramanan, ICLR 2020). Full fine-tuning at several fractions of the budget, each with its
LR schedule over its own length, traces accuracy against training time: the frontier. An arm is
worth running only if it lies beyond it, so every arm gets

    iso-accuracy speedup = T_frontier(acc_arm) / T_arm,

the time full fine-tuning needs to reach the arm's accuracy (read off the frontier) over the
arm's own time. Above 1.00 the arm beats training less; at or below, a shorter schedule does as well.

Each seed is one paired replicate of the whole comparison (the budgets and the arm share its data
order and initial weights), so each seed gives its own frontier (its budgets sorted by time,
accuracy made non-decreasing: a longer budget is never read as reaching less, a dip is seed noise,
and the running maximum only raises the frontier, against the arm) and its own ratio r_s. The
speedup is their geometric mean, and its 95 % interval a t interval on the seeds' log r_s: a mean
of independent replicates, which covers what it says (tests/pipeline/test_frontier.py simulates
it: about 95 %; the percentile bootstrap over 5 seeds used before covered about 83 %).

"Beyond the frontier" needs the interval's low end above a practical margin, 1.05x (per-seed timing
noise on loopback is 6.5-7.3 %: a "yes" at 1.00-1.05 is not a finding); "no" needs its high end
below it. Off a seed's frontier ends its ratio is a bound, and says so: an arm more accurate than
that seed's full budget needs more than the full time (r_s a lower bound: the interval's high end is
then no estimate), one less accurate than its shortest budget needs less than that budget's time
(r_s an upper bound: the low end is no estimate, so never "beyond").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats

Bound = Literal["exact", "lower", "upper"]

# The least iso-accuracy speedup that counts as beyond the frontier: below it a "yes" would rest on
# per-seed timing noise (6.5-7.3 % on loopback, report/horizon-study.md) and buy a user nothing.
BEYOND_MARGIN = 1.05
# With two seeds the interval's spread is one difference, and nothing checks that it is roughly
# normal; from three on the t interval is read.
MIN_VERDICT_SEEDS = 3


@dataclass(frozen=True)
class Point:
    """One run's result: its training time and its final-epoch accuracy."""

    time_s: float
    accuracy_pct: float


@dataclass(frozen=True)
class IsoSpeedup:
    """T_frontier(acc_arm) / T_arm: the geometric mean over seeds of each seed's ratio, with a 95 %
    t interval on the logs."""

    speedup: float
    ci_low: float
    ci_high: float
    bound: Bound  # "lower" / "upper": every seed's arm lies past its frontier's end / before its start
    seeds: int
    # Seeds whose arm fell before their frontier's start / past its end: their ratio is a bound (capped
    # at that end's time), so the interval's low / high end rests on a cap, not an estimate.
    seeds_below_start: int = 0
    seeds_past_end: int = 0
    # The verdict the report settled on for the arm, when more than this interval decides it (the same
    # arm read with measured time fractions; a control's false reading, which voids every verdict):
    # what every table then says. None: this interval's own (interval_verdict).
    settled: str | None = None

    @property
    def low_is_capped(self) -> bool:
        """The interval's low end rests on a seed before its frontier's start: no lower bound."""
        return self.seeds_below_start > 0

    @property
    def high_is_capped(self) -> bool:
        """The interval's high end rests on a seed past its frontier's end: no upper bound."""
        return self.seeds_past_end > 0

    @property
    def beyond_frontier(self) -> bool:
        """The arm beats training less by the margin: the whole interval above BEYOND_MARGIN, with a low
        end that is a real estimate."""
        return self.verdict() == "yes"

    def label(self) -> str:
        """``1.52x [1.31, 1.77]``, with ``>= `` / ``<= `` for a bound past the frontier's ends."""
        mark = {"exact": "", "lower": ">= ", "upper": "<= "}[self.bound]
        low = ("<=" if self.low_is_capped else "") + f"{self.ci_low:.2f}"
        high = (">=" if self.high_is_capped else "") + f"{self.ci_high:.2f}"
        interval = f" [{low}, {high}]" if np.isfinite(self.ci_low) else ""
        return f"{mark}{self.speedup:.2f}x{interval}"

    def verdict(self) -> str:
        """The settled verdict if the report settled one, else :meth:`interval_verdict`."""
        return self.interval_verdict() if self.settled is None else self.settled

    def interval_verdict(self) -> str:
        """Whether the arm lies beyond the frontier by the margin: yes, no, undecided (the interval
        holds the margin, an end that decides rests on a bound, or too few seeds), n/a (one seed)."""
        if self.seeds < 2 or not np.isfinite(self.ci_low):
            return "n/a"
        if self.seeds < MIN_VERDICT_SEEDS:
            return f"undecided ({self.seeds} paired seeds; the verdict needs at least {MIN_VERDICT_SEEDS})"
        if self.bound == "upper":
            return "no (less accurate than the shortest budget)"
        if self.ci_low > BEYOND_MARGIN:
            return "undecided (its accuracy reaches below the shortest budget)" if self.low_is_capped else "yes"
        if self.ci_high < BEYOND_MARGIN and not self.high_is_capped:
            return BELOW_FRONTIER if self.ci_high < 1.0 else f"no (not by {BEYOND_MARGIN:.2f}x)"
        return "undecided"


BEYOND_FRONTIER = "yes"
BELOW_FRONTIER = "no (below the frontier)"
INVALID_PREFIX = "invalid: "  # every arm's verdict when a control reads beyond (invalid_verdict)
# Why a control can read below the frontier it computes, for every place that says so (table note,
# sentence, per-seed script): control_check's "warning".
CONTROL_BELOW_REASONS = (
    "timing drift, or budgets as accurate as full fine-tuning in some seeds, which lift the frontier above it; "
    "'no' readings near 1.00x may be that bias"
)


def control_check(control_verdict: str) -> str:
    """What a control's own verdict (it computes what the full budget computes) says of its table:

    - "failed": it reads beyond the frontier, the statistic's false positive (the running maximum
      only raises the frontier, so timing drift is the cause): no verdict of the table stands;
    - "warning": it reads below: timing drift, or the running maximum lifting the frontier above full
      fine-tuning in seeds where a shorter budget was as accurate (a bias against every arm), so
      "no" readings near 1.00x in the table may be that bias; the verdicts stand, with the warning;
    - "passed": anything else."""
    if control_verdict == BEYOND_FRONTIER:
        return "failed"
    return "warning" if control_verdict == BELOW_FRONTIER else "passed"


def invalid_verdict(failed_controls: list[str]) -> str:
    """The verdict every arm of a table gets when its controls (``setting/group``) read beyond."""
    noun = "control" if len(failed_controls) == 1 else "controls"
    return f"{INVALID_PREFIX}the {noun} {', '.join(failed_controls)} read{'s' if noun == 'control' else ''} beyond"


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


def iso_accuracy_speedup(frontier: Mapping[float, Mapping[int, Point]], arm: Mapping[int, Point]) -> IsoSpeedup:
    """The arm's iso-accuracy speedup over the seeds every budget and the arm share.

    Args:
        frontier: budget fraction -> seed -> full fine-tuning's result at that budget.
        arm: seed -> the arm's result.
    """
    seeds = sorted(set(arm).intersection(*(set(by_seed) for by_seed in frontier.values())))
    if not seeds:
        raise ValueError("iso-accuracy speedup: no seed has both the arm and every budget of the frontier")
    ratios, bounds = seed_ratios(frontier, arm, seeds)
    logs = np.log(ratios)
    speedup = float(np.exp(logs.mean()))
    below, past = bounds.count("upper"), bounds.count("lower")
    bound: Bound = "upper" if below == len(seeds) else "lower" if past == len(seeds) else "exact"
    if len(seeds) < 2:
        return IsoSpeedup(speedup, math.nan, math.nan, bound, len(seeds), below, past)
    half = float(stats.t.ppf(0.975, len(seeds) - 1) * logs.std(ddof=1) / math.sqrt(len(seeds)))
    low, high = float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))
    return IsoSpeedup(speedup, low, high, bound, len(seeds), below, past)


def seed_ratios(
    frontier: Mapping[float, Mapping[int, Point]], arm: Mapping[int, Point], seeds: Sequence[int]
) -> tuple[np.ndarray, list[Bound]]:
    """Each seed's T_frontier(acc_arm) / T_arm on that seed's own frontier, and whether it is a bound."""
    fractions = sorted(frontier)
    ratios, bounds = [], []
    for seed in seeds:
        times = np.array([frontier[f][seed].time_s for f in fractions])
        accuracies = np.array([frontier[f][seed].accuracy_pct for f in fractions])
        needed, bound = frontier_time(arm[seed].accuracy_pct, *monotone_curve(times, accuracies))
        ratios.append(needed / arm[seed].time_s)
        bounds.append(bound)
    return np.array(ratios), bounds
