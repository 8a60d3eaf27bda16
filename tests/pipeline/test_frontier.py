"""freeze.pipeline.report.frontier: the budget frontier and the iso-accuracy speedup, on hand-made
runs whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from freeze.pipeline.report.frontier import Point, frontier_curve, frontier_time, iso_accuracy_speedup

FRACTIONS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def linear_frontier(seeds=(0, 1, 2, 3, 4), offsets=None):
    """Budget f takes 100 f seconds and reaches 70 + 20 f percent (80 % at half, 90 % at full),
    shifted per seed by ``offsets[seed]`` points."""
    offsets = offsets or {}
    return {f: {s: Point(100 * f, 70 + 20 * f + offsets.get(s, 0.0)) for s in seeds} for f in FRACTIONS}


def arm(time_s, accuracy_pct, seeds=(0, 1, 2, 3, 4), offsets=None):
    offsets = offsets or {}
    return {s: Point(time_s, accuracy_pct + offsets.get(s, 0.0)) for s in seeds}


def test_an_arm_that_reaches_88_percent_in_60_s_is_1_5x_beyond_a_frontier_that_needs_90_s():
    result = iso_accuracy_speedup(linear_frontier(), arm(60.0, 88.0), resamples=200)
    assert result.speedup == pytest.approx(1.5) and result.bound == "exact" and result.seeds == 5
    assert result.ci_low == pytest.approx(1.5) and result.ci_high == pytest.approx(1.5)
    assert result.beyond_frontier


def test_an_arm_on_the_frontier_is_1_00x_and_not_beyond_it():
    result = iso_accuracy_speedup(linear_frontier(), arm(70.0, 84.0), resamples=200)
    assert result.speedup == pytest.approx(1.0) and not result.beyond_frontier


def test_past_the_frontier_s_ends_the_speedup_is_a_bound_and_an_upper_bound_never_counts_as_beyond():
    above = iso_accuracy_speedup(linear_frontier(), arm(80.0, 95.0), resamples=200)
    assert (above.speedup, above.bound) == (pytest.approx(100 / 80), "lower") and above.beyond_frontier
    below = iso_accuracy_speedup(linear_frontier(), arm(40.0, 70.0), resamples=200)
    assert (below.speedup, below.bound) == (pytest.approx(50 / 40), "upper") and not below.beyond_frontier


def test_a_dip_in_the_frontier_is_read_as_noise_not_as_a_longer_budget_reaching_less():
    times, accuracies = frontier_curve({0.5: [Point(50, 85)], 0.75: [Point(75, 83)], 1.0: [Point(100, 90)]})
    assert list(accuracies) == [85, 85, 90]
    assert frontier_time(85.0, times, accuracies) == (50.0, "exact")  # the first time it is reached
    assert frontier_time(87.5, times, accuracies) == (87.5, "exact")


def test_the_bootstrap_is_paired_a_seed_that_shifts_frontier_and_arm_alike_adds_no_width():
    offsets = {0: -2.0, 1: 1.5, 2: 0.0, 3: 2.5, 4: -1.0}  # seed-to-seed spread of 4.5 points
    paired = iso_accuracy_speedup(linear_frontier(offsets=offsets), arm(60.0, 88.0, offsets=offsets), resamples=500)
    assert paired.ci_high - paired.ci_low < 1e-9 and paired.speedup == pytest.approx(1.5)
    # The same spread in the arm alone (not shared with the frontier) widens the interval.
    unpaired = iso_accuracy_speedup(linear_frontier(), arm(60.0, 88.0, offsets=offsets), resamples=500)
    assert unpaired.ci_high - unpaired.ci_low > 0.1 and unpaired.ci_low < 1.5 < unpaired.ci_high


def test_only_seeds_the_arm_and_every_budget_share_are_used_and_none_is_refused():
    frontier = linear_frontier(seeds=(0, 1, 2))
    assert iso_accuracy_speedup(frontier, arm(60.0, 88.0, seeds=(1, 2, 7)), resamples=50).seeds == 2
    one = iso_accuracy_speedup(frontier, arm(60.0, 88.0, seeds=(2,)), resamples=50)
    assert one.seeds == 1 and np.isnan(one.ci_low) and not one.beyond_frontier
    with pytest.raises(ValueError, match="no seed has both"):
        iso_accuracy_speedup(frontier, arm(60.0, 88.0, seeds=(9,)))
    with pytest.raises(ValueError, match="at least 2"):
        frontier_curve({1.0: [Point(100, 90)]})


def test_an_arm_whose_resamples_fall_below_the_shortest_budget_is_undecided_not_beyond():
    """Its ratio is capped at the shortest budget's time in those resamples: the interval's low end
    is then a cap, not an estimate (an arm at 45 s near the 50 s budget's 80 % read 'beyond' before)."""
    noise = {0: -1.5, 1: 1.5, 2: -1.2, 3: 1.2, 4: 0.0}  # the arm's own seed spread, not the frontier's
    result = iso_accuracy_speedup(linear_frontier(), arm(45.0, 80.2, offsets=noise), resamples=2000)
    assert result.bound == "exact" and result.below_start_share > 0.025 and result.low_is_capped
    assert not result.beyond_frontier and result.verdict().startswith("undecided")
    assert result.label().startswith("1.1") and "[<=" in result.label()
    # the same arm well inside the frontier's span reads as before
    inside = iso_accuracy_speedup(linear_frontier(), arm(60.0, 88.0), resamples=200)
    assert inside.below_start_share == 0.0 and inside.beyond_frontier and inside.verdict() == "yes"


def test_fewer_than_five_paired_seeds_decide_nothing():
    """Two seeds of the frontier study gave "beyond the frontier" at 1.05x [1.01, 1.05]: a bootstrap
    over 2 seeds has 3 distinct resamples, no 95 % interval. Below 5 seeds the verdict is undecided."""
    seeds = (0, 1, 2, 3, 4)
    offsets = {0: -0.4, 1: 0.3, 2: -0.1, 3: 0.2, 4: 0.0}
    five = iso_accuracy_speedup(linear_frontier(seeds, offsets), arm(40.0, 88.0, seeds, offsets), resamples=200)
    assert five.beyond_frontier and five.verdict() == "yes"
    two = iso_accuracy_speedup(linear_frontier(seeds[:2], offsets), arm(40.0, 88.0, seeds[:2], offsets), resamples=200)
    assert two.ci_low > 1.0 and not two.beyond_frontier
    assert two.verdict() == "undecided (2 paired seeds; the bootstrap interval needs at least 5)"
