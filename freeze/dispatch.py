"""``freezer.module``: the one module a training script calls, stable across boundary changes.

The Freezer builds a new DistributedDataParallel wrapper whenever the frozen set changes (DDP fixes
the parameters it reduces at construction). A script that kept an old wrapper would run a forward
whose backward DDP never reduces, and DDP's error then points at the wrong fix
(``find_unused_parameters=True``). So scripts hold this module instead, which always dispatches to
the current wrapper, and a replaced wrapper refuses to run (:func:`retire`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from freeze.freezer import Freezer

STALE_WRAPPER_FIX = "call freezer.module, which always runs the current wrapper"


class StaleWrapperError(RuntimeError):
    """A DDP wrapper the Freezer has replaced was called."""


class FreezerModule(nn.Module):
    """Call it for the forward pass, as you would call a DDP wrapper.

    Under a process group it runs the Freezer's current DDP wrapper, without one the model itself.
    ``.module`` is the bare model (as DDP's), so ``state_dict()`` keys carry DDP's ``module.``
    prefix and scripts reading ``model.module`` keep working; ``freezer.model`` is the same bare
    model (torchvision's ``model_without_ddp``)."""

    def __init__(self, freezer: Freezer):
        super().__init__()
        self.module = freezer.model
        self._freezer = freezer  # a plain attribute: the Freezer is not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._freezer._forward(*args, **kwargs)

    def train(self, mode: bool = True) -> FreezerModule:
        """``freezer.train(mode)``: frozen norm layers with running statistics stay in eval."""
        self.training = mode
        self._freezer.train(mode)
        return self

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync()`` on the current wrapper (gradient accumulation: backward passes inside
        it are not all-reduced); without a process group it does nothing."""
        if self._freezer.ddp_kwargs.get("static_graph"):
            # DDP asserts (reducer.cpp, expect_autograd_hooks_) when the first iteration of a
            # static-graph wrapper runs under no_sync, and the Freezer builds a new wrapper at every
            # boundary change, so accumulation would crash after each one (reproduced on 2 gloo ranks).
            raise ValueError(
                "freezer.module.no_sync(): gradient accumulation is not supported with "
                "ddp_kwargs static_graph=True (DDP fails at the first backward of every new wrapper); "
                "drop static_graph=True or accumulate without no_sync()"
            )
        ddp = self._freezer._ddp
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


def _refuse_stale_call(module: nn.Module, args: tuple) -> None:
    raise StaleWrapperError(
        "Freezer: this DDP wrapper was replaced when the freeze boundary moved and no longer "
        f"reduces the right gradients; {STALE_WRAPPER_FIX}"
    )


def retire(ddp: nn.Module) -> None:
    """Make a replaced wrapper refuse to run, with an error naming the fix."""
    ddp.register_forward_pre_hook(_refuse_stale_call)
