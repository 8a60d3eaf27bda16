"""``freezer.module``: the one module a training script calls, stable across boundary changes.

The Freezer builds a new DistributedDataParallel wrapper whenever the frozen set changes (DDP fixes
the parameters it reduces at construction). A script that kept an old wrapper would run a forward
whose backward DDP never reduces, and DDP's error then points at the wrong fix
(``find_unused_parameters=True``). So scripts hold this module instead, which always dispatches to
the Freezer's forward path (:class:`freeze.freezer.engine.Engine`), and a replaced wrapper refuses to run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from freeze.freezer.engine import Engine


class FreezerModule(nn.Module):
    """Call it for the forward pass, as you would call a DDP wrapper, in training and in evaluation.

    Under a process group it runs the Freezer's current DDP wrapper, without one the model itself;
    a training forward given ``sample_ids=keys`` runs from the activation cache when it holds them.
    ``.module`` is the bare model (as DDP's), so ``state_dict()`` keys carry DDP's ``module.``
    prefix and scripts reading ``model.module`` keep working; ``freezer.model`` is the same bare
    model (torchvision's ``model_without_ddp``)."""

    def __init__(self, model: nn.Module, engine: Engine, *, train: Callable[[bool], object]):
        super().__init__()
        self.module = model
        self._engine = engine  # plain attributes: not a submodule
        self._train = train  # the Freezer's train(mode): it knows which blocks are frozen

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine.forward(*args, **kwargs)

    def train(self, mode: bool = True) -> FreezerModule:
        """``freezer.train(mode)``: frozen norm layers with running statistics stay in eval."""
        self.training = mode
        self._train(mode)
        return self

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync()`` on the current wrapper (gradient accumulation: backward passes inside
        it are not all-reduced); without a process group it does nothing."""
        if self._engine.ddp_kwargs.get("static_graph"):
            # DDP asserts (reducer.cpp, expect_autograd_hooks_) when the first iteration of a
            # static-graph wrapper runs under no_sync, and the Freezer builds a new wrapper at every
            # boundary change, so accumulation would crash after each one (reproduced on 2 gloo ranks).
            raise ValueError(
                "freezer.module.no_sync(): gradient accumulation is not supported with "
                "ddp_kwargs static_graph=True (DDP fails at the first backward of every new wrapper); "
                "drop static_graph=True or accumulate without no_sync()"
            )
        ddp = self._engine.wrapper
        if ddp is None:
            yield
            return
        with ddp.no_sync():
            yield

    def __deepcopy__(self, memo: dict) -> None:
        raise TypeError(
            "freezer.module cannot be deep-copied (it dispatches to the Freezer's DDP wrapper); "
            "copy freezer.model, the bare model, instead"
        )
