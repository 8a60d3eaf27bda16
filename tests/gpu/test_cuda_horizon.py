"""The ``horizon`` rule on the device: its descent (two parameter copies and their dot products), the
summed gradient it reads and the held-out check all run where the model is, the check's evaluation
under the Freezer's eval mode and no_grad; the run freezes, is undone on probation, decides as the
same run on the CPU does, and a run resumed on probation ends bit for bit as the uninterrupted one
(cuDNN's deterministic kernels)."""

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.devices import DEVICES, deterministic
from tests.test_horizon_undo import EPOCHS, STEPS_PER_EPOCH, make_run, train_steps
from tests.tiny_models import global_batch

TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH
HELD_OUT = global_batch(10**6, 16)  # a fixed batch no training step draws


def held_out_loss(model: torch.nn.Module) -> float:
    """The model's loss on the held-out batch, where the model is; the check must run it in eval
    mode without building a graph."""
    if model.training or torch.is_grad_enabled():
        raise AssertionError(f"held-out check with training={model.training}, grad={torch.is_grad_enabled()}")
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in HELD_OUT)
    return F.cross_entropy(model(x), y).item()


def decisions(freezer) -> list[tuple[int, int, int]]:
    return [(d.step, d.boundary_before, d.boundary_after) for d in freezer.decisions]


def whole_run(device: str):
    model, optimizer, freezer = make_run(device=device, measured_loss=held_out_loss)
    train_steps(model, optimizer, freezer, range(TOTAL_STEPS))
    return model, freezer


@pytest.mark.parametrize("device", DEVICES)
def test_horizon_freezes_undoes_and_resumes_bit_for_bit_on_the_device(device, monkeypatch):
    deterministic(monkeypatch)
    model, freezer = whole_run(device)
    made = decisions(freezer)
    frozen = [d for d in made if d[2] > d[1]]
    undone = [d for d in made if d[2] < d[1]]
    assert frozen and undone, made
    descents = [v for stats in freezer.history for v in stats.descent if v is not None]
    assert descents and all(torch.isfinite(torch.tensor(descents))), descents
    assert model.training and torch.is_grad_enabled()  # the checks left the run as they found it

    if device != "cpu":  # the device decides as the CPU does: the rates differ in rounding, not in sign
        _, cpu_freezer = whole_run("cpu")
        assert decisions(cpu_freezer) == made

    first_freeze = frozen[0][0]
    interrupted, optimizer, freezer = make_run(device=device, measured_loss=held_out_loss)
    train_steps(interrupted, optimizer, freezer, range(first_freeze + 1))  # one step into the probation
    saved = freezer.training_state_dict()
    resumed_model, optimizer, freezer = make_run(device=device, measured_loss=held_out_loss)
    freezer.load_training_state_dict(saved)
    train_steps(resumed_model, optimizer, freezer, range(first_freeze + 1, TOTAL_STEPS))
    assert decisions(freezer) == made
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))
