"""What every trainer adapter checks and does the same way (imports no trainer)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from freeze.blocks import Block, split_blocks
from freeze.policies import Policy, parse_policy

_DDP_PARAMS = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}


def resolve_policy(policy: str | Policy | None) -> Policy:
    """A policy spec (``"autofreeze:percentile=50"``) or a Policy -> a Policy."""
    return parse_policy(policy) if isinstance(policy, str) else (policy or parse_policy("none"))


def resolve_blocks(model: nn.Module, blocks: Sequence[Block] | Sequence | None) -> list[Block]:
    """``None``: the default split; names as ``split_blocks`` takes them; or ready Blocks."""
    if blocks is not None and len(blocks) and all(isinstance(b, Block) for b in blocks):
        return list(blocks)
    return split_blocks(model, blocks)


def ddp_kwargs_of(trainer: str, kwargs: dict) -> dict:
    """The DDP keyword arguments a trainer would have used, minus what the Freezer owns; refuses a
    communication hook (DDP takes one, and the Freezer's counts the bytes)."""
    kwargs = dict(kwargs)
    hook = kwargs.pop("comm_hook", None)
    if hook is not None and str(getattr(hook, "value", hook)).lower() not in ("no", "none"):
        refuse_comm_hook(trainer, hook)
    kwargs.pop("init_sync", None)  # the Freezer builds every wrapper with init_sync=False
    return {k: v for k, v in kwargs.items() if k in _DDP_PARAMS}


def refuse_comm_hook(trainer: str, hook: object) -> None:
    name = getattr(hook, "value", None) or getattr(hook, "__name__", None) or type(hook).__name__
    raise ValueError(
        f"{trainer}: a DDP communication hook ({name}) is registered, but DDP takes one hook and the Freezer's counts "
        "the bytes; drop it and pass comm_hook='bf16' to the Freezer for bfloat16 compression"
    )
