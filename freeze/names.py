"""The names a setting accepts, owned here once for the library and the application's configs.

Imports nothing heavy (no torch): ``freeze.pipeline.config`` validates a TOML file against these
without loading the library.
"""

from __future__ import annotations

from typing import Literal, get_args

# Gradient all-reduce: full precision, buckets sent as bfloat16 (half the bytes), or PowerSGD of
# rank 1 or 4 (low-rank factors of each weight matrix; freeze.powersgd). freeze.comm.
CommHook = Literal["allreduce", "bf16", "powersgd1", "powersgd4"]
# The activation cache: off | memory (in RAM; over budget: error) | disk (spills to a node-local
# file over budget) | auto (only where it pays). freeze.cache.
CacheMode = Literal["off", "memory", "disk", "auto"]
# How a cache stores activations: fp32 (exact), bf16 or fp16 (half the bytes, cast back on read).
StorageDtype = Literal["fp32", "bf16", "fp16"]
# How frozen blocks run: like inference ("eval": dropout off, as AutoFreeze and PipeTransformer run
# frozen layers; a frozen block then has one output per input) or with dropout on ("train"). Norm
# layers with running statistics are in eval either way.
FrozenMode = Literal["eval", "train"]

COMM_HOOKS: tuple[str, ...] = get_args(CommHook)
POWERSGD_RANKS: dict[str, int] = {"powersgd1": 1, "powersgd4": 4}  # hook name -> rank of the approximation
CACHE_MODES: tuple[str, ...] = get_args(CacheMode)
STORAGE_DTYPE_NAMES: tuple[str, ...] = get_args(StorageDtype)
FROZEN_MODES: tuple[str, ...] = get_args(FrozenMode)


def split_policy_spec(spec: str) -> tuple[str, list[tuple[str, str | None]]]:
    """The grammar of a policy spec, ``"name"`` or ``"name:param=value,param=value"``:
    ``(name, [(param, value), ...])``, stripped, with value None for an item without '='. Checking
    names and values is :func:`freeze.policies.parse_policy`'s; the report reads specs with this
    alone, without torch."""
    name, colon, rest = spec.strip().partition(":")
    items: list[tuple[str, str | None]] = []
    if colon:
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            items.append((key.strip(), value if eq else None))
    return name.strip(), items
