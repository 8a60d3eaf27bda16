"""The ``horizon`` rule (freeze.policies.horizon) on hand-made traces whose answer is known, its
descent estimate on gradients whose true value is known, and its refusals."""

import math

import pytest
import torch
from torch import nn

from freeze import Freezer, split_blocks
from freeze.monitor import IntervalStats
from freeze.policies import PolicyError, Pricing, Progress, make_policy
from tests.tiny_models import TinyNet, global_batch

L = 4  # blocks; the head (3) is never frozen
STEPS = 100
INTERVAL = 10


def stats(index, boundary, descent, held_out=None):
    """Interval ``index`` (INTERVAL steps ending at (index + 1) * INTERVAL) with a descent per block."""
    return IntervalStats(
        index=index,
        epoch=0,
        end_step=(index + 1) * INTERVAL,
        steps=INTERVAL,
        skipped_steps=0,
        boundary=boundary,
        summed_grad_norm=(1.0,) * L,
        summed_grad_l1_norm=(1.0,) * L,
        mean_step_grad_norm=(1.0,) * L,
        descent=tuple(descent),
        held_out_loss=held_out,
    )


def trace(descents, boundaries=None, held_out=None):
    n = len(descents)
    boundaries = boundaries or [0] * n
    held_out = held_out or [None] * n
    return [stats(i, boundaries[i], descents[i], held_out[i]) for i in range(n)]


def progress(history, steps_total=STEPS):
    return Progress(epochs_completed=0, epochs_total=1, steps_completed=history[-1].end_step, steps_total=steps_total)


# step time 1.0 s at k=0, 0.1 s less per frozen block; a constant LR of 0.01 (0.1 per interval)
PRICING = Pricing(step_time_s=(1.0, 0.9, 0.8, 0.7), lr_per_step=(0.01,) * STEPS)


def decide(policy, history, boundary=None, pricing=PRICING):
    boundary = history[-1].boundary if boundary is None else boundary
    return policy.decide(boundary, history, progress(history, len(pricing.lr_per_step)), L, pricing=pricing)


def test_a_block_that_no_longer_learns_is_frozen_when_the_time_it_saves_pays():
    policy = make_policy("horizon:span=1,exchange=1,probation=0")
    history = trace([(None,) * L, (0.0, 0.0, 0.0, 0.5), (0.0, 0.0, 0.0, 0.5)])
    # rates 0 below the head: every prefix costs nothing; the largest saving is k = 3
    assert decide(policy, history) == 3


def test_the_prefix_stops_below_the_block_that_still_learns():
    policy = make_policy("horizon:span=1,exchange=1,probation=0")
    # block 2 removes 0.01 nats per interval = 0.1 nats per unit LR; 0.7 LR left at step 30:
    # freezing it costs 0.07 nats (0.07 of the run at exchange 1) and saves 0.1 s x 70 steps / 100 s = 0.07
    # ... so at exchange 2 it does not pay, and the best prefix is 2.
    history = trace([(None,) * L, (0.0, 0.0, 0.01, 0.5), (0.0, 0.0, 0.01, 0.5)])
    assert (
        make_policy("horizon:span=1,exchange=2,probation=0").decide(0, history, progress(history), L, pricing=PRICING)
        == 2
    )
    scores = dict(policy.scores(0, history, progress(history), L, PRICING))
    assert scores[2] == pytest.approx(0.2 * 70 / 100)  # two blocks: 0.2 s a step for 70 steps
    assert scores[3] == pytest.approx(0.3 * 70 / 100 - 1.0 * 0.1 * 0.7)


def test_the_same_learning_is_worth_freezing_late_in_a_decaying_schedule_and_not_early():
    # cosine LR: the LR still to spend falls faster than the steps left
    lr = tuple(0.01 * 0.5 * (1 + math.cos(math.pi * s / STEPS)) for s in range(STEPS))
    pricing = Pricing(step_time_s=(1.0, 0.9, 0.8, 0.7), lr_per_step=lr)
    policy = make_policy("horizon:span=1,exchange=20,probation=0")
    learning = (0.002, 0.002, 0.002, 0.5)  # per interval; the rate divides by the interval's LR
    early = trace([(None,) * L, learning, learning])
    late = [stats(i, 0, learning if i else (None,) * L) for i in range(9)]
    assert decide(policy, early, pricing=pricing) == 0
    assert decide(policy, late, pricing=pricing) == 3


def test_an_unmeasured_block_is_never_frozen_and_negative_learning_counts_as_none():
    policy = make_policy("horizon:span=1,exchange=1,probation=0")
    history = trace([(None,) * L, (0.0, None, 0.0, 0.5), (0.0, None, 0.0, 0.5)])
    assert decide(policy, history) == 1
    noisy = trace([(None,) * L, (-0.5, -0.5, -0.5, 0.5), (-0.5, -0.5, -0.5, 0.5)])
    assert policy.rates(noisy, PRICING, L)[:3] == [-5.0, -5.0, -5.0]
    assert decide(policy, noisy) == 3  # priced as no learning


def test_no_decision_before_a_full_window_of_rates():
    policy = make_policy("horizon:span=1,exchange=1,probation=0,window=3")
    history = trace([(None,) * L, (0.0, 0.0, 0.0, 0.5), (0.0, 0.0, 0.0, 0.5)])
    assert decide(policy, history) == 0
    history.append(stats(3, 0, (0.0, 0.0, 0.0, 0.5)))
    assert decide(policy, history) == 3


def test_a_freeze_on_probation_is_undone_when_every_held_out_check_rises_past_the_tolerance():
    policy = make_policy("horizon:span=1,exchange=1,probation=2,tolerance=0.05,hold_off=2")
    settled = (0.0, 0.0, 0.0, 0.5)
    frozen = (None, None, None, 0.5)
    # freeze proposed at interval 2 (held-out 1.00), in force from interval 3
    history = trace([(None,) * L, settled, settled], held_out=[None, None, 1.0])
    assert policy.wants_probe(0, history, progress(history), L, pricing=PRICING)
    assert decide(policy, history) == 3
    bump = history + [stats(3, 3, frozen, 1.06)]
    assert policy.wants_probe(3, bump, progress(bump), L, pricing=PRICING)
    assert decide(policy, bump) == 3  # one check: the probation is not over
    assert decide(policy, bump + [stats(4, 3, frozen, 1.04)]) == 3  # a bump, not a persistent rise
    assert decide(policy, bump + [stats(4, 3, frozen, 1.07)]) == 0  # both checks above: undone
    # after the probation (2 intervals), a rise is no longer checked, nor measured
    later = bump + [stats(4, 3, frozen, 1.04), stats(5, 3, frozen)]
    assert not policy.wants_probe(3, later, progress(later), L, pricing=PRICING)
    assert decide(policy, later + [stats(6, 3, frozen, 9.0)]) == 3


def test_a_diverging_held_out_loss_neither_proposes_a_freeze_nor_keeps_one():
    """Reliability.md case 13: at lr 1000 the held-out loss went nan, freezes were proposed on it and
    probation never undid them (`nan > limit` is false)."""
    policy = make_policy("horizon:span=1,exchange=1,probation=2,tolerance=0.05,hold_off=2")
    settled = (0.0, 0.0, 0.0, 0.5)
    frozen = (None, None, None, 0.5)
    diverged = trace([(None,) * L, settled, settled], held_out=[None, None, math.nan])
    assert decide(policy, diverged) == 0  # proposed on nan: no freeze
    history = trace([(None,) * L, settled, settled], held_out=[None, None, 1.0])
    assert decide(policy, history) == 3
    after = history + [stats(3, 3, frozen, math.nan), stats(4, 3, frozen, math.inf)]
    assert decide(policy, after) == 0  # every check diverged: undone
    mixed = history + [stats(3, 3, frozen, math.nan), stats(4, 3, frozen, 1.01)]
    assert decide(policy, mixed) == 3  # one check back within the tolerance: kept, as a bump


def test_after_an_undo_no_freeze_for_the_hold_off_doubled_at_every_further_undo():
    policy = make_policy("horizon:span=1,exchange=1,probation=1,tolerance=0.02,hold_off=2")
    s = (0.0, 0.0, 0.0, 0.5)
    # freeze at 2, undone at 3 (boundary back to 0 from interval 4 on)
    history = trace(
        [(None,) * L, s, s, s, s, s], boundaries=[0, 0, 0, 3, 0, 0], held_out=[None, None, 1.0, 2.0, None, 1.0]
    )
    assert decide(policy, history[:5]) == 0  # 1 interval after the undo: held off
    assert decide(policy, history) == 3  # 2 intervals after: free again
    # a second undo doubles the hold-off to 4 intervals
    twice = history + [stats(6, 3, s, 2.0), stats(7, 0, s, 1.0), stats(8, 0, s, 1.0), stats(9, 0, s, 1.0)]
    longer = Pricing(PRICING.step_time_s, (0.01,) * 2 * STEPS)  # room left after interval 10
    assert decide(policy, twice, pricing=longer) == 0
    assert decide(policy, twice + [stats(10, 0, s, 1.0)], pricing=longer) == 3


def test_a_freeze_on_probation_without_a_held_out_loss_is_refused():
    history = trace([(None,) * L, (0.0,) * 3 + (0.5,), (0.0,) * 3 + (0.5,)])
    with pytest.raises(PolicyError, match="probe="):
        decide(make_policy("horizon:span=1,exchange=1"), history)


def test_pricing_for_another_model_or_run_is_refused_in_one_line():
    history = trace([(None,) * L, (0.0,) * L, (0.0,) * L])
    with pytest.raises(PolicyError, match="step_time_s has 3 entries for 4 blocks"):
        decide(make_policy("horizon:span=1,probation=0"), history, pricing=Pricing((1.0, 0.9, 0.8), (0.01,) * STEPS))
    with pytest.raises(PolicyError, match="lr_per_step has 50 entries for a run of 100 steps"):
        make_policy("horizon:span=1,probation=0").decide(
            0, history, progress(history), L, pricing=Pricing((1.0, 0.9, 0.8, 0.7), (0.01,) * 50)
        )
    with pytest.raises(ValueError, match="step_time_s"):
        Pricing((1.0, 0.0), (0.01,))


REFUSALS_PRICING = Pricing((1.0, 0.9, 0.8, 0.7), (0.01,) * 20)


@pytest.mark.parametrize(
    ("policy", "epochs", "pricing", "message"),
    [
        ("horizon:span=1,probation=0", 2, None, "pass pricing=Pricing"),
        ("horizon:window=1,span=1", 2, REFUSALS_PRICING, "pass probe="),
        (
            "horizon:probation=0",
            2,
            REFUSALS_PRICING,
            "needs 9 evaluations before its first decision and this run has 4",
        ),
        ("horizon:span=1,probation=0", 3, REFUSALS_PRICING, "lr_per_step has 20 entries for a run of 30 steps"),
    ],
)
def test_the_freezer_refuses_horizon_without_pricing_or_probe_when_built(policy, epochs, pricing, message):
    model = TinyNet()
    with pytest.raises(ValueError, match=message):
        Freezer(
            model,
            split_blocks(model),
            make_policy(policy),
            epochs=epochs,
            steps_per_epoch=10,
            interval_steps=5,
            pricing=pricing,
        )


def test_no_freeze_is_stacked_on_one_still_on_probation():
    policy = make_policy("horizon:span=1,exchange=1,probation=2,tolerance=0.05")
    # block 2 learns a little: at interval 2 only the prefix 2 pays; by interval 3 its learning is gone
    learning = (0.0, 0.0, 0.02, 0.5)
    history = trace([(None,) * L, learning, learning], held_out=[None, None, 1.0])
    assert decide(policy, history) == 2
    settled = history + [stats(3, 2, (None, None, 0.0, 0.5), 0.99), stats(4, 2, (None, None, 0.0, 0.5), 0.98)]
    assert decide(policy, settled[:4]) == 2  # on probation: judged before anything more freezes
    assert decide(policy, settled) == 2  # the last check of the probation: still judged first
    after = settled + [stats(5, 2, (None, None, 0.0, 0.5), 0.97)]
    assert decide(policy, after) == 3  # the probation passed: the next prefix may freeze


def test_the_probe_runs_in_eval_mode_without_gradients_and_training_resumes_after():
    seen = []

    def probe() -> float:
        seen.append((model.training, torch.is_grad_enabled()))
        return 1.0

    model = TinyNet()
    blocks = split_blocks(model)
    pricing = Pricing((1.0, 0.6, 0.3, 0.1), (0.01,) * 24)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    freezer = Freezer(
        model,
        blocks,
        make_policy("horizon:exchange=0.01,span=1,window=1"),
        optimizer=optimizer,
        epochs=2,
        steps_per_epoch=12,
        interval_steps=2,
        pricing=pricing,
        probe=probe,
    )
    for step in range(12):
        x, y = global_batch(step, 8)
        optimizer.zero_grad()
        freezer.train()
        nn.functional.cross_entropy(freezer.module(x), y).backward()
        freezer.after_backward()
        optimizer.step()
        freezer.after_step()
        assert model.head.training  # the training mode is back after every evaluation
    assert seen and set(seen) == {(False, False)}
