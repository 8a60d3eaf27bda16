"""freeze.intervals: the interval record policies read, and AutoFreeze's eta, torch-free."""

import pytest

from freeze.intervals import IntervalStats, relative_change, summed_norms


def test_relative_change():
    a = IntervalStats(0, 0, 1, 1, 0, 0, (2.0, None, 0.0, 4.0), (4.0, 1.0, 1.0, 1.0), (0, 0, 0, 0))
    b = IntervalStats(1, 1, 2, 1, 0, 0, (1.0, 1.0, 1.0, 5.0), (1.0, 1.0, 1.0, 1.0), (0, 0, 0, 0))
    assert relative_change(a, b) == [0.5, None, None, 0.25]
    assert relative_change(a, b, norm="l1") == [0.75, 0.0, 0.0, 0.0]


def test_a_record_round_trips_and_an_older_one_without_descent_or_probe_still_loads():
    stats = IntervalStats(3, 1, 40, 10, 2, 1, (1.0, None), (2.0, None), (0.5, None), (0.1, None), 0.25)
    assert IntervalStats.from_dict(stats.to_dict()) == stats and stats.finite_steps == 8
    older = {k: v for k, v in stats.to_dict().items() if k not in ("descent", "held_out_loss")}
    assert IntervalStats.from_dict(older).descent == () and IntervalStats.from_dict(older).held_out_loss is None


def test_an_unknown_norm_is_refused_naming_the_accepted():
    stats = IntervalStats(0, 0, 1, 1, 0, 0, (1.0,), (1.0,), (1.0,))
    with pytest.raises(ValueError, match="norm: 'l3' is not accepted; accepted: l1, l2"):
        summed_norms(stats, "l3")
