"""The optimizer a Freezer drops state from: unwrapping a trainer's wrapper, checking it steps
this model, and dropping the state of parameters as they freeze.

A frozen parameter's momentum and Adam moments must go: kept, they would move it again the moment
it unfroze, with statistics of gradients it stopped receiving long ago."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` a trainer's wrapper drives (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``), or ``optimizer`` itself."""
    inner = optimizer
    for _ in range(4):  # wrappers nest at most a couple of levels
        unwrapped = getattr(inner, "_optimizer", None)  # LightningOptimizer
        if unwrapped is None and type(inner).__name__ == "AcceleratedOptimizer":
            unwrapped = inner.optimizer
        if unwrapped is None:
            break
        inner = unwrapped
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"Freezer.attach_optimizer: got a {type(optimizer).__name__}, not a torch.optim.Optimizer nor a "
            "trainer's wrapper of one; pass the optimizer that steps this model's parameters"
        )
    return inner


def check_steps_model(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Refuse an optimizer that steps parameters other than ``model``'s: the Freezer could not
    keep them frozen nor drop their state."""
    mine = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in mine)
    if foreign:
        raise ValueError(
            f"Freezer.attach_optimizer: the optimizer steps {foreign} parameters that are not the model's; "
            "build it over freezer.model.parameters()"
        )


def drop_state(optimizer: torch.optim.Optimizer | None, params: Iterable[nn.Parameter]) -> None:
    """Forget ``optimizer``'s state (momentum, moments, step counts) of ``params``."""
    if optimizer is None:
        return
    for p in params:
        optimizer.state.pop(p, None)


def check_saved_optimizer(saved: dict, optimizer: torch.optim.Optimizer) -> None:
    """Refuse, before anything is loaded, an optimizer state whose parameter groups differ in
    number or size from ``optimizer``'s (torch refuses it too, but only after the model and the
    Freezer state were loaded)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or "state" not in saved:
        raise ValueError(
            "Freezer.load_training_state_dict: 'optimizer' lacks 'state' or 'param_groups'; "
            "accepted: what optimizer.state_dict() returns"
        )
    sizes_saved = [len(g.get("params", ())) for g in groups]
    sizes_mine = [len(g["params"]) for g in optimizer.param_groups]
    if sizes_saved != sizes_mine:
        raise ValueError(
            f"Freezer.load_training_state_dict: the checkpoint's optimizer has parameter groups of {sizes_saved} "
            f"parameters, this one {sizes_mine}; accepted: an optimizer built over the same parameters as the saving run's"
        )
