"""Optimizers and learning-rate schedules, stepped once per optimizer step.

One optimizer over ALL parameters, frozen ones included: optimizers skip parameters whose grad is
None, so param groups never change when the boundary moves and a checkpoint taken at any boundary
loads into a fresh optimizer (a complaint users have about other freezing libraries).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from freeze.blocks import Block, block_param_groups


def build_optimizer(model: nn.Module, cfg, blocks: Sequence[Block] | None = None) -> torch.optim.Optimizer:
    """``cfg``: OptimConfig (name, lr, momentum, nesterov, weight_decay, betas, eps); ``blocks``:
    one parameter group per block (a policy that sets each block's learning rate), else one group."""
    # Weight decay on every parameter, as torch's default and the reference study do.
    params = block_param_groups(blocks) if blocks else list(model.parameters())
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.nesterov and cfg.momentum > 0,
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    raise ValueError(f"optim.name: '{cfg.name}' is not accepted; accepted: sgd, adamw")


def global_batch(train_cfg, world_size: int) -> int:
    """Samples per optimizer step: ``train_cfg`` (TrainConfig)'s batch per worker x workers x accumulation."""
    return train_cfg.batch_size * world_size * train_cfg.accumulate_steps


def run_lr(cfg, global_batch: int) -> float:
    """The LR a run trains at: ``cfg.lr`` (OptimConfig), scaled linearly with the global batch when
    ``cfg.lr_reference_batch`` names the batch it was set for (0: as given)."""
    if not cfg.lr_reference_batch:
        return cfg.lr
    return cfg.lr * global_batch / cfg.lr_reference_batch


def lr_factor(step: int, steps_per_epoch: int, total_steps: int, cfg, base_lr: float) -> float:
    """Multiplier of the base LR after ``step`` optimizer steps.

    ``cfg``: ScheduleConfig (name, warmup_epochs, step_size_epochs, gamma, min_lr). Linear warm-up from
    1/warmup_steps to 1, then the named schedule over the remaining steps; step and exponential decay
    count epochs as fractions so they do not depend on where warm-up ended.
    """
    warmup_steps = int(round(cfg.warmup_epochs * steps_per_epoch))
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    epoch_f = step / max(steps_per_epoch, 1)
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "step":
        return cfg.gamma ** math.floor(epoch_f / cfg.step_size_epochs)
    if cfg.name == "exponential":
        return cfg.gamma**epoch_f
    if cfg.name == "cosine":
        span = max(total_steps - warmup_steps, 1)
        t = min((step - warmup_steps) / span, 1.0)
        floor = cfg.min_lr / base_lr
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))
    raise ValueError(f"schedule.name: '{cfg.name}' is not accepted; accepted: constant, step, cosine, exponential")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, steps_per_epoch: int, total_steps: int, base_lr: float):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, steps_per_epoch, total_steps, cfg, base_lr)
    )
