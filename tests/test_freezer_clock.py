"""freeze.freezer.clock: the run clock (epochs, steps per epoch, evaluation interval) and the run-length
checks of the policy it asks."""

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, make_policy, split_blocks
from freeze.freezer.clock import RunClock
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


def test_a_loop_resumed_without_the_freezer_s_state_is_told_the_fix_not_the_epoch_rule():
    """Issue 48: restoring only the model and optimizer, then end_epoch(2), was refused with a message
    about 0-based epoch numbers."""
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model), make_policy("autofreeze"))
    x, y = global_batch(0, 4)
    F.cross_entropy(freezer.module(x), y).backward()
    freezer.after_backward()
    with pytest.raises(
        ValueError, match=r"end_epoch\(2\): this Freezer has ended no epoch yet.*load_training_state_dict"
    ):
        freezer.end_epoch(2)


# ------------------------------------------------------------------------------ RunClock on its own
def test_a_negative_interval_is_refused_naming_the_field_and_what_0_means():
    with pytest.raises(ValueError, match=r"interval_steps must be >= 0 \(0 = once per epoch\), got -1"):
        RunClock(epochs=None, steps_per_epoch=None, interval_steps=-1)
    assert RunClock(epochs=None, steps_per_epoch=None, interval_steps=0).interval_steps == 0


def test_check_policy_asks_for_what_the_run_length_policy_lacks():
    freezeout = make_policy("freezeout")
    with pytest.raises(ValueError, match="policy 'freezeout' needs the run length: pass epochs=N"):
        RunClock(epochs=None, steps_per_epoch=None, interval_steps=0).check_needs(freezeout.needs(), freezeout.spec())
    with pytest.raises(ValueError, match="policy 'freezeout' needs the run length"):
        RunClock(epochs=0, steps_per_epoch=5, interval_steps=0).check_needs(
            freezeout.needs(), freezeout.spec()
        )  # 0 epochs: not given
    RunClock(epochs=3, steps_per_epoch=None, interval_steps=0).check_needs(
        freezeout.needs(), freezeout.spec()
    )  # per epoch: epochs suffice
    for name in ("none", "autofreeze", "geometric"):  # no run length needed, whatever the clock lacks
        RunClock(epochs=None, steps_per_epoch=None, interval_steps=7).check_needs(make_policy(name).needs(), name)


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


# ------------------------------------------------------------------------------ integer-like inputs (issue 33, D4)
def _trained_freezer(policy="geometric:alpha=0.5", **kwargs):
    torch.manual_seed(0)
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model), make_policy(policy), epochs=3, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _step(freezer, opt, 0)
    return freezer


def _reloads_weights_only(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # the README's resume


@pytest.mark.parametrize("epoch", [np.int64(0), np.int32(0), torch.tensor(0), np.array(0)])
def test_an_integer_like_epoch_is_taken_as_an_int_and_the_checkpoint_loads_weights_only(epoch):
    freezer = _trained_freezer()
    assert freezer.end_epoch(epoch)  # geometric:alpha=0.5 freezes after the first epoch
    state = freezer.training_state_dict()
    assert type(state["freezer"]["epochs_completed"]) is int
    assert type(freezer.decisions[0].epoch) is int and type(freezer.history[0].epoch) is int
    loaded = _reloads_weights_only(state)
    assert loaded["freezer"]["decisions"] == state["freezer"]["decisions"]


@pytest.mark.parametrize("epoch", [0.0, torch.tensor(0.0), True, np.float64(0), torch.tensor([0]), "0", None])
def test_an_epoch_that_is_no_integer_is_refused_in_one_line_before_the_clock_moves(epoch):
    freezer = _trained_freezer()
    before = (freezer.clock.epochs_completed, freezer.clock.epoch_start_step, freezer.monitor.intervals_closed)
    with pytest.raises(ValueError, match=r"Freezer.end_epoch: epoch = .*; accepted: an integer") as err:
        freezer.end_epoch(epoch)
    assert "\n" not in str(err.value)
    assert (freezer.clock.epochs_completed, freezer.clock.epoch_start_step, freezer.monitor.intervals_closed) == before
    assert freezer.end_epoch(0)  # the right call still goes through, once


def test_set_boundary_takes_integer_like_values_as_ints_and_refuses_floats_and_bools():
    freezer = _trained_freezer("none")
    freezer.set_boundary(np.int64(2))
    assert type(freezer.boundary) is int and freezer.boundary == 2
    freezer.set_boundary(torch.tensor(1))
    assert type(freezer.boundary) is int and freezer.boundary == 1
    for bad in (1.5, 2.0, True, torch.tensor(1.0)):
        with pytest.raises(ValueError, match=r"Freezer.set_boundary: k = .*; accepted: an integer"):
            freezer.set_boundary(bad)
        assert freezer.boundary == 1  # unchanged (int(1.5) used to freeze 1 block)


def test_a_numpy_run_length_is_kept_as_python_ints():
    clock = RunClock(epochs=np.int64(4), steps_per_epoch=np.int64(10), interval_steps=np.int64(2))
    assert (type(clock.epochs), type(clock.steps_per_epoch), type(clock.interval_steps)) == (int, int, int)
