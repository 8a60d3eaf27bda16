"""freeze.clock: the run clock (epochs, steps per epoch, evaluation interval) and the run-length
checks of the policy it asks."""

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, make_policy, split_blocks
from freeze.clock import RunClock
from freeze.policies import Progress
from tests.tiny_models import TinyNet, global_batch
from tests.tiny_models import freezer_step as _step


def test_run_length_policies_require_epochs():
    model = TinyNet()
    with pytest.raises(ValueError, match="needs the run length"):
        Freezer(model, split_blocks(model), make_policy("freezeout"))


def test_run_length_policy_evaluated_per_step_needs_the_run_length_in_steps():
    model = TinyNet()
    with pytest.raises(ValueError, match="interval_steps=2 steps needs the run length in steps: pass steps_per_epoch"):
        Freezer(model, split_blocks(model), make_policy("freezeout"), epochs=10, interval_steps=2)
    freezer = Freezer(
        model, split_blocks(model), make_policy("freezeout", t0=0.5), epochs=10, steps_per_epoch=10, interval_steps=2
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for s in range(2):
        _step(freezer, opt, s)
        freezer.after_step()
    assert freezer.boundary == 0  # 2 of 100 steps done: block 0 is due at half of the run


def test_end_epoch_called_twice_or_with_a_skipped_epoch_is_refused_in_one_line():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model), make_policy("autofreeze"))
    x, y = global_batch(0, 4)
    F.cross_entropy(freezer.module(x), y).backward()
    freezer.after_backward()
    freezer.end_epoch(0)
    for wrong in (0, 2):  # a second call for epoch 0, or a skipped epoch 1
        with pytest.raises(ValueError, match=f"end_epoch\\({wrong}\\): the epoch that just ended is 1") as err:
            freezer.end_epoch(wrong)
        assert "\n" not in str(err.value)
    with pytest.warns(RuntimeWarning, match="epoch 1 ended without a training step"):
        freezer.end_epoch(1)


# ------------------------------------------------------------------------------ RunClock on its own
def test_a_negative_interval_is_refused_naming_the_field_and_what_0_means():
    with pytest.raises(ValueError, match=r"interval_steps must be >= 0 \(0 = once per epoch\), got -1"):
        RunClock(epochs=None, steps_per_epoch=None, interval_steps=-1)
    assert RunClock(epochs=None, steps_per_epoch=None, interval_steps=0).interval_steps == 0


def test_check_policy_asks_for_what_the_run_length_policy_lacks():
    freezeout = make_policy("freezeout")
    with pytest.raises(ValueError, match="policy 'freezeout' needs the run length: pass epochs=N"):
        RunClock(epochs=None, steps_per_epoch=None, interval_steps=0).check_policy(freezeout)
    with pytest.raises(ValueError, match="policy 'freezeout' needs the run length"):
        RunClock(epochs=0, steps_per_epoch=5, interval_steps=0).check_policy(freezeout)  # 0 epochs: not given
    RunClock(epochs=3, steps_per_epoch=None, interval_steps=0).check_policy(freezeout)  # per epoch: epochs suffice
    for name in ("none", "autofreeze", "geometric"):  # no run length needed, whatever the clock lacks
        RunClock(epochs=None, steps_per_epoch=None, interval_steps=7).check_policy(make_policy(name))


def test_end_epoch_returns_the_steps_each_epoch_took_and_refuses_the_wrong_epoch():
    clock = RunClock(epochs=3, steps_per_epoch=None, interval_steps=0)
    assert clock.end_epoch(0, steps=4) == 4
    assert clock.end_epoch(1, steps=4) == 0  # an epoch without a step took none
    assert clock.end_epoch(2, steps=9) == 5
    assert (clock.epochs_completed, clock.epoch_start_step) == (3, 9)
    with pytest.raises(ValueError, match=r"end_epoch\(1\): the epoch that just ended is 3") as err:
        clock.end_epoch(1, steps=12)
    assert "\n" not in str(err.value) and (clock.epochs_completed, clock.epoch_start_step) == (3, 9)  # unchanged


def test_progress_counts_completed_work_and_knows_the_step_total_only_from_both_lengths():
    clock = RunClock(epochs=4, steps_per_epoch=10, interval_steps=2)
    assert clock.progress(6) == Progress(epochs_completed=0, epochs_total=4, steps_completed=6, steps_total=40)
    clock.end_epoch(0, steps=10)
    assert clock.progress(13) == Progress(epochs_completed=1, epochs_total=4, steps_completed=13, steps_total=40)
    only_epochs = RunClock(epochs=4, steps_per_epoch=None, interval_steps=0)
    assert only_epochs.progress(13).steps_total == 0  # unknown
    unplanned = RunClock(epochs=None, steps_per_epoch=10, interval_steps=0)
    assert unplanned.progress(0).epochs_total == 1 and unplanned.progress(0).steps_total == 0
    for epoch in range(3):
        unplanned.end_epoch(epoch, steps=10 * (epoch + 1))
    assert unplanned.progress(30).epochs_total == 3  # the epochs run so far: a fraction of at most 1
    assert unplanned.progress(30).fraction == 1.0


def test_epoch_done_fraction_is_the_share_of_the_running_epoch_and_0_when_its_length_is_unknown():
    clock = RunClock(epochs=2, steps_per_epoch=8, interval_steps=2)
    assert clock.epoch_done_fraction(0) == 0.0 and clock.epoch_done_fraction(2) == 0.25
    clock.end_epoch(0, steps=8)
    assert clock.epoch_done_fraction(14) == 0.75  # counted from the epoch's first step
    assert RunClock(epochs=2, steps_per_epoch=None, interval_steps=2).epoch_done_fraction(5) == 0.0
