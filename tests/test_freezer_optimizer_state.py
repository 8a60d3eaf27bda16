"""freeze.freezer.optimizer_state: the optimizer under a trainer's wrapper, the check that it steps this model,
and the state dropped as parameters freeze. (The Freezer's attach_optimizer over real trainer
wrappers: tests/test_integration_core.py.)"""

import pytest
import torch
from torch import nn

from freeze.freezer.optimizer_state import check_steps_model, drop_state, unwrap_optimizer


class LightningOptimizer:  # the attribute Lightning's wrapper keeps the optimizer under
    def __init__(self, optimizer):
        self._optimizer = optimizer


class AcceleratedOptimizer:  # accelerate's wrapper is known by its class name
    def __init__(self, optimizer):
        self.optimizer = optimizer


def _sgd(model: nn.Module, **kwargs) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, **kwargs)


def test_unwrap_returns_the_optimizer_itself_or_the_one_under_nested_wrappers():
    opt = _sgd(nn.Linear(2, 2))
    assert unwrap_optimizer(opt) is opt
    assert unwrap_optimizer(LightningOptimizer(opt)) is opt
    assert unwrap_optimizer(AcceleratedOptimizer(opt)) is opt
    assert unwrap_optimizer(LightningOptimizer(AcceleratedOptimizer(opt))) is opt


def test_unwrap_refuses_what_is_no_optimizer_naming_what_it_got():
    for thing in (None, [torch.zeros(1)], LightningOptimizer("not an optimizer")):
        with pytest.raises(TypeError, match="not a torch.optim.Optimizer nor a trainer's wrapper of one") as e:
            unwrap_optimizer(thing)
        assert f"got a {type(thing).__name__}," in str(e.value) and "\n" not in str(e.value)


def test_unwrap_gives_up_on_wrappers_nested_deeper_than_four_levels():
    opt = _sgd(nn.Linear(2, 2))
    wrapped = opt
    for _ in range(4):
        wrapped = LightningOptimizer(wrapped)
    assert unwrap_optimizer(wrapped) is opt
    with pytest.raises(TypeError, match="got a LightningOptimizer"):
        unwrap_optimizer(LightningOptimizer(wrapped))  # so a wrapper that wraps itself cannot loop forever


def test_an_optimizer_stepping_parameters_of_another_model_is_refused_with_their_count():
    model, other = nn.Linear(2, 2), nn.Linear(2, 3)
    check_steps_model(_sgd(model), model)
    check_steps_model(torch.optim.SGD([model.weight], lr=0.1), model)  # a subset is fine
    mixed = torch.optim.SGD([{"params": model.parameters()}, {"params": [other.bias], "lr": 0.01}], lr=0.1)
    with pytest.raises(ValueError, match="the optimizer steps 1 parameters that are not the model's") as e:
        check_steps_model(mixed, model)
    assert "freezer.model.parameters()" in str(e.value)
    with pytest.raises(ValueError, match="steps 2 parameters"):
        check_steps_model(_sgd(other), model)


def test_drop_state_forgets_only_the_given_parameters():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
    assert len(opt.state) == 4
    drop_state(opt, model[0].parameters())
    assert set(opt.state) == set(model[1].parameters())
    drop_state(opt, model[0].parameters())  # again: nothing left to drop, no error
    drop_state(None, model.parameters())  # a Freezer without an optimizer
    assert set(opt.state) == set(model[1].parameters())
    opt.step()  # the remaining state still steps
