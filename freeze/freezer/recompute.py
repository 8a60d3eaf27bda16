"""Activation recompute (gradient checkpointing) of individual modules: a trainable block keeps no
activations in forward and recomputes them in backward.

Always the non-reentrant variant: with ``use_reentrant=True`` the first trainable block after a
frozen prefix gets no gradient at all, because its input does not require grad (torch.utils.checkpoint
documents this: the reentrant variant needs at least one input with requires_grad=True, else its
gradients are None).

Recomputation re-runs the forward in train mode, which would apply the running-statistics update of
BatchNorm (and of any norm layer tracking running statistics) a second time per step; during the
recomputation we set their momentum to 0 (running stats unchanged, batch statistics - and therefore
the output - identical) and restore the batch counter.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from freeze.blocks import tracks_running_stats


class _NoStatsUpdate:
    def __init__(self, module: nn.Module):
        self.bns = [m for m in module.modules() if tracks_running_stats(m)]

    def __enter__(self):
        self.saved = [
            (bn.momentum, None if bn.num_batches_tracked is None else bn.num_batches_tracked.clone()) for bn in self.bns
        ]
        for bn in self.bns:
            bn.momentum = 0.0
        return self

    def __exit__(self, *exc):
        for bn, (momentum, tracked) in zip(self.bns, self.saved):
            bn.momentum = momentum
            if tracked is not None:
                bn.num_batches_tracked.copy_(tracked)
        return False


class _CheckpointedForward:
    """The instance ``forward`` of a checkpointed module."""

    def __init__(self, module: nn.Module, original: Callable[..., Any]):
        self.module = module
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        calls = {"n": 0}

        def body(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 1:
                return self.original(*a, **kw)
            with _NoStatsUpdate(self.module):  # recomputation during backward
                return self.original(*a, **kw)

        return checkpoint(body, *args, use_reentrant=False, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable[..., Any]:
        # A deepcopy of the model (an EMA copy) gets its own plain forward: sharing this object
        # would run the ORIGINAL module, with the original's weights, from the copy.
        return copy.deepcopy(self.original, memo)


def enable_checkpointing(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of storing them (idempotent)."""
    if is_checkpointed(module):
        return
    # An instance attribute shadows the class's forward; nn.Module.__call__ looks up self.forward,
    # so hooks, DDP and state_dict keys are untouched.
    module.__dict__["forward"] = _CheckpointedForward(module, module.forward)


def disable_checkpointing(module: nn.Module) -> None:
    if is_checkpointed(module):
        del module.__dict__["forward"]


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)
