"""Gradient (activation) checkpointing of individual modules.

Always the non-reentrant variant: with ``use_reentrant=True`` the first trainable block after a
frozen prefix gets no gradient at all, because its input does not require grad (torch.utils.checkpoint
documents this: the reentrant variant needs at least one input with requires_grad=True, else its
gradients are None).

Recomputation re-runs the forward in train mode, which would apply the BatchNorm running-statistics
update a second time per step; during the recomputation we set BN momentum to 0 (running stats
unchanged, batch statistics - and therefore the output - identical) and restore the batch counter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_ORIGINAL = "_freeze_original_forward"


class _NoStatsUpdate:
    def __init__(self, module: nn.Module):
        self.bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

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


def _checkpointed(module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        calls = {"n": 0}

        def body(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 1:
                return forward(*a, **kw)
            with _NoStatsUpdate(module):  # recomputation during backward
                return forward(*a, **kw)

        return checkpoint(body, *args, use_reentrant=False, **kwargs)

    return run


def enable_checkpointing(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of storing them (idempotent)."""
    if _ORIGINAL in module.__dict__:
        return
    original = module.forward
    module.__dict__[_ORIGINAL] = original
    # An instance attribute shadows the class's forward; nn.Module.__call__ looks up self.forward,
    # so hooks, DDP and state_dict keys are untouched.
    module.__dict__["forward"] = _checkpointed(module, original)


def disable_checkpointing(module: nn.Module) -> None:
    if _ORIGINAL in module.__dict__:
        del module.__dict__["forward"]
        del module.__dict__[_ORIGINAL]


def is_checkpointed(module: nn.Module) -> bool:
    return _ORIGINAL in module.__dict__
