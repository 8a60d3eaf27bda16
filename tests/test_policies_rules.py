"""freeze.policies.rules: each policy rule (as its paper or library defines it) checked on hand-made
monitor histories and schedules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freeze import Freezer, split_blocks
from freeze.policies import POLICIES, PolicyError, Progress, make_policy
from freeze.policies.rules import (
    AutoFreeze,
    ClockFreeze,
    CS744Freeze,
    FreezeOut,
    GeometricFreeze,
    GradualUnfreeze,
    LinearFreeze,
    StaticFreeze,
)
from tests.policy_histories import PROGRESS, after_epochs, at_fraction, eta_history, interval, one_line_error, sizes


# ------------------------------------------------------------------------------------ autofreeze
def test_autofreeze_freezes_leading_run_below_median_and_stops_at_first_above():
    # Freezable etas sorted: 0.05 0.1 0.2 0.3 0.4 0.5 -> median 0.25 (the head's 0.9 is not in the
    # population). Blocks 0, 1 freeze; block 2 (0.5) stops the run, so block 3 stays active
    # although its eta (0.05) is the smallest.
    history = eta_history([0.1, 0.2, 0.5, 0.05, 0.4, 0.3, 0.9])
    assert AutoFreeze().decide(0, history, PROGRESS, 7) == 2


def test_autofreeze_other_percentile_and_active_blocks_only():
    history = eta_history([0.1, 0.2, 0.5, 0.05, 0.4, 0.3, 0.9])
    # 25th percentile of 6 values: 0.1 + 0.25 * (0.2 - 0.1) = 0.125 -> only block 0 (0.1) freezes.
    assert AutoFreeze(percentile=25).decide(0, history, PROGRESS, 7) == 1
    # Boundary 1: block 0 is frozen (not observed); freezable etas 0.05 0.2 0.3 0.4 0.5 -> median
    # 0.3, block 1 (0.2) freezes, block 2 (0.5) stops.
    frozen0 = eta_history([None, 0.2, 0.5, 0.05, 0.4, 0.3, 0.9], boundary=1)
    assert AutoFreeze().decide(1, frozen0, PROGRESS, 7) == 2
    # A block below the boundary must not enter the percentile even if its eta is in the history:
    # freezable etas 0.3 0.4 0.6 -> p25 = 0.35, block 1 (0.3) freezes; counting block 0's 0.0
    # would give p25 = 0.225 and block 1 would stay.
    decisive = eta_history([0.0, 0.3, 0.6, 0.4, 0.5], boundary=1)
    assert AutoFreeze(percentile=25).decide(1, decisive, PROGRESS, 5) == 2


def test_autofreeze_percentile_leaves_the_head_out():
    # Freezable etas 0.1 0.2 0.3 -> median 0.2: only block 0 freezes. With the head's 0.9 in the
    # population the median would be 0.25 and block 1 would freeze too.
    assert AutoFreeze().decide(0, eta_history([0.1, 0.2, 0.3, 0.9]), PROGRESS, 4) == 1


def test_autofreeze_compares_l1_norms_by_default():
    # L1 etas 0.5 0.1 0.2 -> median 0.2, block 0 (0.5) stays; L2 etas 0.1 0.5 0.2 -> block 0 freezes.
    prev = interval(0, [10.0, 10.0, 10.0, 10.0])
    cur = dataclasses.replace(interval(1, [9.0, 5.0, 8.0, 1.0]), summed_grad_l1_norm=(5.0, 9.0, 8.0, 1.0))
    assert AutoFreeze().decide(0, [prev, cur], PROGRESS, 4) == 0
    assert AutoFreeze(norm="l2").decide(0, [prev, cur], PROGRESS, 4) == 1
    assert AutoFreeze().spec() == "autofreeze:percentile=50.0,min_intervals=2,norm=l1"


def test_autofreeze_percentile_edges():
    history = eta_history([0.1, 0.2, 0.3, 0.4, 0.5])
    # p = 0: threshold is the minimum, nothing is strictly below it.
    assert AutoFreeze(percentile=0).decide(0, history, PROGRESS, 5) == 0
    assert AutoFreeze(percentile=0).decide(0, eta_history([0.05, 0.2, 0.3, 0.4, 0.5]), PROGRESS, 5) == 0
    # p = 100: threshold is the largest freezable eta (block 3's 0.4): blocks 0-2 freeze.
    assert AutoFreeze(percentile=100).decide(0, history, PROGRESS, 5) == 3
    # p = 100 with the maximum in the middle: the run stops there.
    assert AutoFreeze(percentile=100).decide(0, eta_history([0.1, 0.2, 0.9, 0.4, 0.5]), PROGRESS, 5) == 2


def test_autofreeze_never_freezes_head_and_stops_at_undefined_eta():
    # Head undefined (G_prev = 0): the threshold is block 2's eta 0.9 (p = 100), blocks 0, 1 freeze.
    history = [interval(0, [10.0, 10.0, 10.0, 0.0]), interval(1, [9.0, 8.0, 1.0, 5.0])]
    assert AutoFreeze(percentile=100).decide(0, history, PROGRESS, 4) == 2
    assert AutoFreeze().decide(3, eta_history([None, None, None, 0.0]), PROGRESS, 4) == 3
    # Block 1 undefined stops the run even though block 2 is far below the threshold (0.45).
    gap = [interval(0, [10.0, 0.0, 10.0, 10.0, 10.0, 10.0]), interval(1, [9.0, 3.0, 9.5, 1.0, 2.0, 5.0])]
    assert AutoFreeze().decide(0, gap, PROGRESS, 6) == 1


def test_autofreeze_waits_for_min_intervals_and_uses_last_two():
    two = eta_history([0.1, 0.2, 0.5, 0.4, 0.3])
    assert AutoFreeze().decide(0, two[:1], PROGRESS, 5) == 0
    assert AutoFreeze(min_intervals=3).decide(0, two, PROGRESS, 5) == 0
    # An older first interval must be ignored: G 1 -> 10 would give eta 9 for every block.
    three = [interval(0, [1.0] * 5), two[0], interval(2, list(two[1].summed_grad_norm))]
    # Last two intervals: G 10 -> 9, 8, 5, 6: freezable etas 0.1 0.2 0.5 0.4 -> median 0.3 -> k = 2.
    assert AutoFreeze(min_intervals=3).decide(0, three, PROGRESS, 5) == 2


def test_gradient_policies_reject_history_of_wrong_width():
    message = one_line_error(AutoFreeze().decide, 0, eta_history([0.1, 0.2, 0.3]), PROGRESS, 4)
    assert "num_blocks = 4" in message
    one_line_error(CS744Freeze().decide, 0, eta_history([0.1, 0.2, 0.3]), PROGRESS, 4)


# ------------------------------------------------------------------------------------ cs744
def test_cs744_freezes_first_block_only_when_it_has_the_smallest_eta():
    policy = CS744Freeze()
    assert policy.decide(0, eta_history([0.1, 0.3, 0.2, 0.4]), PROGRESS, 4) == 1
    # Block 0 is not the minimum (block 2 is): nothing freezes, and block 2 is not frozen either.
    assert policy.decide(0, eta_history([0.3, 0.4, 0.1, 0.5]), PROGRESS, 4) == 0
    # Tie with the minimum freezes.
    assert policy.decide(0, eta_history([0.1, 0.3, 0.1, 0.4]), PROGRESS, 4) == 1
    # At most one block even when every leading block is smaller than the rest.
    assert policy.decide(0, eta_history([0.1, 0.1, 0.1, 0.9]), PROGRESS, 4) == 1
    # Only active blocks compete: block 0 (frozen, eta 0.0 left in history) does not count.
    assert policy.decide(1, eta_history([0.0, 0.2, 0.3, 0.4], boundary=1), PROGRESS, 4) == 2


def test_cs744_never_freezes_head_and_needs_two_intervals():
    policy = CS744Freeze()
    assert policy.decide(3, eta_history([None, None, None, 0.1]), PROGRESS, 4) == 3
    assert policy.decide(0, eta_history([0.1, 0.3, 0.2, 0.4])[:1], PROGRESS, 4) == 0
    # First active block undefined: no freeze.
    undefined = [interval(0, [0.0, 10.0, 10.0]), interval(1, [1.0, 9.0, 8.0])]
    assert policy.decide(0, undefined, PROGRESS, 3) == 0


# ------------------------------------------------------------------------------------ freezeout
@pytest.mark.parametrize(
    "scale, expected",
    [
        ("linear", [0.8, 0.85, 0.9, 0.95, 1.0]),
        ("squared", [0.64, 0.7225, 0.81, 0.9025, 1.0]),
        ("cubic", [0.512, 0.614125, 0.729, 0.857375, 1.0]),
    ],
)
def test_freezeout_fractions_per_scaling(scale, expected):
    assert FreezeOut(t0=0.8, scale=scale).freeze_fractions(5) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "fraction, k",
    [(0.0, 0), (0.5, 0), (0.512, 1), (0.6, 1), (0.7, 2), (0.8, 3), (0.9, 4), (1.0, 4)],
)
def test_freezeout_cubic_boundary_at_fraction(fraction, k):
    assert FreezeOut().decide(0, [], at_fraction(fraction), 5) == k


def test_freezeout_linear_exact_thresholds_and_monotone():
    policy = FreezeOut(scale="linear")
    # 0.85 is block 1's t exactly (computed as 0.8500000000000001): it must freeze on time.
    assert policy.decide(0, [], at_fraction(0.85), 5) == 2
    assert policy.decide(0, [], at_fraction(0.849), 5) == 1
    assert policy.decide(3, [], at_fraction(0.1), 5) == 3
    assert FreezeOut().freeze_fractions(1) == [1.0]
    assert FreezeOut().decide(0, [], at_fraction(1.0), 1) == 0


# ------------------------------------------------------------------------------------ linear
@pytest.mark.parametrize(
    "fraction, level, k",
    [
        (0.3, 1.0, 0),
        (0.5, 1.0, 0),
        (0.6, 1.0, 1),  # int(0.2 * 9): a fraction of the 9 freezable blocks, as Composer
        (0.75, 1.0, 4),
        (0.95, 1.0, 8),
        (1.0, 1.0, 9),
        (0.8, 0.5, 2),
        (1.0, 0.5, 4),
    ],
)
def test_linear_schedule(fraction, level, k):
    assert LinearFreeze(freeze_start=0.5, freeze_level=level).decide(0, [], at_fraction(fraction), 10) == k


def test_linear_never_decreases_and_uses_epochs_without_step_total():
    assert LinearFreeze().decide(7, [], at_fraction(0.6), 10) == 7
    # 8 of 10 epochs done -> fraction 0.8 -> (0.8 - 0.5) / 0.5 = 0.6 of the 9 freezable blocks.
    assert LinearFreeze().decide(0, [], after_epochs(8, epochs_total=10), 10) == 5


# ------------------------------------------------------------------------------------ geometric
def test_geometric_count_per_epoch_alpha_third():
    # floor(10 * (1 - (2/3)^e)): 3.33 5.56 7.04 8.02 8.68 9.12 -> capped at the head (9).
    counts = [GeometricFreeze().decide(0, [], after_epochs(e), 10) for e in range(1, 9)]
    assert counts == [3, 5, 7, 8, 8, 9, 9, 9]
    assert GeometricFreeze(alpha=0.5).decide(0, [], after_epochs(1), 4) == 2
    assert GeometricFreeze().decide(6, [], after_epochs(1), 10) == 6


def test_epoch_schedules_do_not_count_the_running_epoch():
    """Evaluated every N steps, a policy is asked during the first epoch: nothing may move yet."""
    mid_first_epoch = Progress(epochs_completed=0, epochs_total=10, steps_completed=2, steps_total=100)
    assert GeometricFreeze(alpha=0.5).decide(0, [], mid_first_epoch, 4) == 0
    assert GradualUnfreeze().decide(4, [], mid_first_epoch, 5) == 4


# ------------------------------------------------------------------- gradual-unfreeze, static, none
def test_gradual_unfreeze_schedule():
    policy = GradualUnfreeze(every_epochs=2)
    boundary = policy.initial_boundary(5)
    assert boundary == 4
    seen = []
    for epoch in range(12):
        boundary = policy.decide(boundary, [], after_epochs(epoch + 1), 5)
        seen.append(boundary)
    assert seen == [4, 3, 3, 2, 2, 1, 1, 0, 0, 0, 0, 0]
    assert [GradualUnfreeze().decide(4, [], after_epochs(n), 5) for n in range(1, 6)] == [3, 2, 1, 0, 0]
    # A block already unfrozen is not frozen again when the schedule lags behind the boundary.
    assert GradualUnfreeze().decide(1, [], after_epochs(1), 5) == 1
    assert GradualUnfreeze.may_unfreeze and not AutoFreeze.may_unfreeze


def test_static_and_none():
    assert StaticFreeze(k=4).initial_boundary(10) == 4
    assert StaticFreeze(k=4).decide(4, [], PROGRESS, 10) == 4
    assert StaticFreeze(k=4).initial_boundary(5) == 4  # the largest k: every block but the head
    assert make_policy("none").initial_boundary(5) == 0
    assert [make_policy("none").decide(0, [], after_epochs(e), 5) for e in range(3)] == [0, 0, 0]
    message = one_line_error(make_policy, "static", k=-1)
    assert "'k'" in message and "int >= 0" in message


# ------------------------------------------------------------------------------------ at (the clock)
@pytest.mark.parametrize("t", [0.4, 0.5, 0.6, 0.7, 0.8])
def test_clock_freezes_k_blocks_at_the_first_evaluation_at_or_after_t(t):
    # 5 epochs of 10 steps, evaluated every step: k blocks freeze at step ceil(t * 50), not one before.
    policy = ClockFreeze(k=8, t=t)
    boundaries = [policy.decide(0, [], Progress(s // 10, 5, s, 50), 10) for s in range(51)]
    first = boundaries.index(8)
    assert first == round(t * 50) and set(boundaries[:first]) == {0} and set(boundaries[first:]) == {8}


def test_clock_epoch_n_reads_as_t_n_over_epochs_and_never_moves_back():
    # "freeze at epoch 2 of 5" with per-epoch evaluation: at:t=0.4 freezes at end_epoch(1), so epoch 2 trains frozen.
    assert [ClockFreeze(k=3, t=0.4).decide(0, [], after_epochs(e, 5), 10) for e in range(1, 6)] == [0, 3, 3, 3, 3]
    assert ClockFreeze(k=3, t=0.4).decide(5, [], after_epochs(3, 5), 10) == 5  # a later boundary is kept


@pytest.mark.parametrize("spec", ["at:t=0", "at:t=1", "at:t=1.5", "at:t=-0.1", "at:k=-1"])
def test_clock_refuses_t_outside_the_open_unit_interval_and_negative_k_in_one_line(spec):
    message = one_line_error(make_policy, spec)
    assert ("float in (0, 1)" in message) if "t=" in spec else ("int >= 0" in message)


def test_clock_k_its_model_cannot_take_is_refused_at_construction_not_at_t():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(PolicyError, match="k = 3 with 3 blocks"):
        Freezer(model, split_blocks(model), make_policy("at:k=3,t=0.5"), epochs=2)


# ------------------------------------------------------------------------------------ every policy
def test_every_policy_stays_in_range_and_forward_only():
    history = eta_history([0.1, 0.1, 0.1, 0.1, 0.1])
    for name, cls in POLICIES.items():
        policy = cls()
        for boundary in range(5):
            for f in (0.0, 0.5, 1.0):
                k = policy.decide(boundary, history, at_fraction(f), 5, **sizes(policy, 5))
                assert 0 <= k <= 4, name
                assert k >= boundary or cls.may_unfreeze, name


def test_flags():
    assert {n for n, c in POLICIES.items() if c.uses_gradients} == {"autofreeze", "cs744", "payoff", "horizon"}
    assert {n for n, c in POLICIES.items() if c.uses_pricing} == {"horizon"}
    assert {n for n, c in POLICIES.items() if c.uses_block_bytes} == {"payoff"}
    assert {n for n, c in POLICIES.items() if c.needs_run_length} == {"freezeout", "linear", "at", "horizon"}
    assert {n for n, c in POLICIES.items() if c.may_unfreeze} == {"gradual-unfreeze", "horizon"}
    assert set(POLICIES) == {
        "none",
        "static",
        "freezeout",
        "linear",
        "geometric",
        "autofreeze",
        "cs744",
        "gradual-unfreeze",
        "payoff",
        "at",
        "horizon",
    }


# ------------------------------------------------------------------------------------ purity / state
def test_decisions_are_pure():
    history = eta_history([0.1, 0.2, 0.5, 0.05, 0.4, 0.3])
    snapshot = [s.to_dict() for s in history]
    for name in POLICIES:
        policy = make_policy(name)
        extra = sizes(policy, 6)
        first = policy.decide(1, history, PROGRESS, 6, **extra)
        assert policy.decide(1, history, PROGRESS, 6, **extra) == first
        assert make_policy(name).decide(1, history, PROGRESS, 6, **extra) == first
    assert [s.to_dict() for s in history] == snapshot


# ------------------------------------------------------------------------- static:k beyond the model
def test_static_k_beyond_the_last_freezable_block_is_refused_not_clamped():
    policy = make_policy("static", k=99)
    with pytest.raises(PolicyError) as err:
        policy.initial_boundary(10)  # was 9: a run that said k=99 froze 9 blocks
    message = str(err.value)
    assert "\n" not in message and "k = 99 with 10 blocks" in message and "accepted: 0..9" in message
    with pytest.raises(PolicyError):
        policy.decide(0, [], None, 10)
    assert make_policy("static", k=9).initial_boundary(10) == 9  # every block but the head: accepted


def test_a_freezer_refuses_a_static_k_its_model_cannot_take():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(PolicyError, match="k = 5 with 3 blocks"):
        Freezer(model, split_blocks(model), make_policy("static", k=5))
