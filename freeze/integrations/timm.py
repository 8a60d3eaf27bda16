"""timm: blocks from timm's own ``group_matcher``, and BatchNorm syncing that leaves frozen blocks alone.

    from freeze.integrations.timm import blocks_from_timm, distribute_bn
    freezer = Freezer(model, blocks_from_timm(model), make_policy("autofreeze"), optimizer=optimizer)

``model.group_matcher(coarse)`` maps every parameter of a timm model to an ordinal in forward order
(stem, each block or stage, the final norm with the last block, the head last); timm maintains it
per model for layer-wise learning-rate decay. :func:`blocks_from_timm` turns its groups into the
Freezer's blocks. The Freezer still checks the order on the first forward after each change.

timm's ``train.py`` averages every BatchNorm's running statistics across ranks after each epoch
(``--dist-bn reduce``, the default): frozen statistics included, and summing W copies then dividing
by W changes float32 bits for W >= 3. :func:`distribute_bn` is the same call skipping frozen blocks
(DDP's buffer broadcast already keeps the trainable ones in sync); or pass ``--dist-bn ''``.
"""

from __future__ import annotations

import torch
from timm.models import group_parameters
from torch import nn

from freeze import comm
from freeze.blocks import Block, split_blocks
from freeze.freezer import Freezer


def blocks_from_timm(model: nn.Module, coarse: bool = False) -> list[Block]:
    """The Freezer's blocks of a timm model, one per group of ``model.group_matcher(coarse)``.

    Args:
        model: a timm model (bare, not wrapped) whose class defines ``group_matcher``.
        coarse: timm's coarse grouping (stages instead of blocks, where the model has both).
    """
    matcher = getattr(model, "group_matcher", None)
    if matcher is None:
        raise ValueError(
            f"blocks_from_timm: {type(model).__name__} defines no group_matcher; split it with "
            "freeze.split_blocks(model) or name the blocks: split_blocks(model, names=[...])"
        )
    groups = group_parameters(model, matcher(coarse=coarse))
    return split_blocks(model, [_as_modules(model, groups[k]) for k in sorted(groups)])


def _as_modules(model: nn.Module, param_names: list[str]) -> list[str]:
    """A group's parameter names as the largest submodules lying wholly inside the group (so that a
    BatchNorm's running statistics belong to the block of its weights), and as parameter names
    where no such submodule exists (``cls_token`` owned by the model itself)."""
    group = set(param_names)
    modules = dict(model.named_modules())
    inside: dict[str, bool] = {}

    def wholly_inside(name: str) -> bool:
        if name not in inside:
            owned = [f"{name}.{n}" for n, _ in modules[name].named_parameters()]
            inside[name] = bool(owned) and all(n in group for n in owned)
        return inside[name]

    entries: list[str] = []
    for pname in param_names:
        parts = pname.split(".")
        entry = next((".".join(parts[:i]) for i in range(1, len(parts)) if wholly_inside(".".join(parts[:i]))), pname)
        if entry not in entries:
            entries.append(entry)
    return entries


@torch.no_grad()
def distribute_bn(freezer: Freezer, world_size: int, reduce: bool = False) -> None:
    """timm's ``utils.distribute_bn`` for a model under a Freezer: the running statistics of
    trainable blocks are averaged (``reduce``) or broadcast from rank 0; frozen ones are untouched
    (equal on every rank already, and averaging would change their bits beyond 2 ranks).
    Collective: call it on every rank.

    Args:
        freezer: the Freezer training the model.
        world_size: the number of ranks (timm's ``args.world_size``).
        reduce: average (timm's ``--dist-bn reduce``) instead of broadcasting (``broadcast``).
    """
    frozen = {id(getattr(mod, name)) for b in freezer.blocks[: freezer.boundary] for _, mod, name in b.buffers()}
    stats = [
        buf
        for name, buf in freezer.model.named_buffers()
        if id(buf) not in frozen and ("running_mean" in name or "running_var" in name)
    ]
    if not reduce:
        comm.broadcast_from_rank0(stats, freezer.process_group)
        return
    for buf in stats:
        comm.sum_over_ranks(buf, freezer.process_group)
        buf /= float(world_size)
