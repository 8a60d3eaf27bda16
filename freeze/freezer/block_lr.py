"""Per-block learning-rate factors a policy asks for (annealing before a freeze), applied to the
optimizer's parameter groups for the length of each ``optimizer.step()``.

The factor goes on in a step pre-hook and comes off in the post-hook, so the run's LR scheduler
(any scheduler, chained ones included) never sees a scaled value, a checkpoint holds the
unscaled learning rates, and the factor is a pure function of the step count: a resumed run scales
as the run that wrote the checkpoint did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from freeze.blocks import Block
from freeze.freezer.clock import RunClock
from freeze.policies import Policy


class BlockLR:
    """Scales each block's parameter group by ``policy.block_lr_scales`` during optimizer steps."""

    def __init__(self, policy: Policy, blocks: Sequence[Block], clock: RunClock, steps_counted: Callable[[], int]):
        """``steps_counted()``: the optimizer steps the Freezer has counted (its after_backward calls)."""
        if not (clock.epochs and clock.steps_per_epoch):
            # The factor moves every step; an epoch count alone would hold it for a whole epoch.
            raise ValueError(
                f"Freezer: policy '{policy.spec()}' sets each block's learning rate per step: pass epochs=N and "
                "steps_per_epoch=N"
            )
        self.policy = policy
        self.clock = clock
        self._block_of = {id(p): i for i, block in enumerate(blocks) for p in block.params}
        self._num_blocks = len(blocks)
        self._group_blocks: list[int | None] = []
        self._handles: list = []
        self._unscaled: list[tuple[dict, object]] | None = None
        self._backward_since_step = False  # after_backward ran since the last optimizer step
        self._backward_first: bool | None = None  # the loop's order, learned at its first step
        self._steps = steps_counted

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook ``optimizer`` (replacing the hooks on an optimizer attached before)."""
        self._group_blocks = [self._group_block(group, index) for index, group in enumerate(optimizer.param_groups)]
        self.detach()
        self._handles = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._scale(opt)),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self._after_step()),
        ]

    def detach(self) -> None:
        self._unscale()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def note_backward(self) -> None:
        self._backward_since_step = True

    def scales_now(self) -> list[float]:
        """The factor per block for the next optimizer step."""
        # Steps done before the one about to be taken. The Freezer counts a step in after_backward,
        # which a loop calls before optimizer.step() or after it; the order is learned at the first
        # step this hook sees (then an after_backward has run or not), because between two steps
        # both orders look alike: one after_backward since the last step.
        counted = self._steps()
        backward_first = self._backward_since_step if self._backward_first is None else self._backward_first
        return self.policy.block_lr_scales(
            self.clock.progress(max(counted - (1 if backward_first else 0), 0)), self._num_blocks
        )

    def _group_block(self, group: dict, index: int) -> int | None:
        owners = {self._block_of.get(id(p)) for p in group["params"]}
        owners.discard(None)  # a parameter outside every block is refused by check_steps_model
        if len(owners) > 1:
            raise ValueError(
                f"Freezer: policy '{self.policy.spec()}' sets each block's learning rate and optimizer group "
                f"{index} holds parameters of blocks {sorted(owners)}; accepted: one group per block, e.g. "
                "torch.optim.SGD(freeze.blocks.block_param_groups(blocks), lr=...)"
            )
        return owners.pop() if owners else None

    def _scale(self, optimizer: torch.optim.Optimizer) -> None:
        self._unscale()  # a step that raised never reached the post-hook
        scales = self.scales_now()
        if self._backward_first is None:
            self._backward_first = self._backward_since_step
        self._unscaled = []
        for group, block in zip(optimizer.param_groups, self._group_blocks):
            if block is None or scales[block] == 1.0:
                continue
            self._unscaled.append((group, group["lr"]))
            group["lr"] = group["lr"] * scales[block]

    def _after_step(self) -> None:
        self._unscale()
        self._backward_since_step = False

    def _unscale(self) -> None:
        for group, lr in self._unscaled or ():
            group["lr"] = lr
        self._unscaled = None
