"""freeze: adaptive layer freezing for data-parallel fine-tuning.

from freeze import Freezer, split_blocks, make_policy
freezer = Freezer(model, split_blocks(model), make_policy("autofreeze", percentile=50))

The names below load on first use (PEP 562), so that importing a torch-free part of the package
(``freeze.pipeline.schema``, the report) does not import torch and the whole library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_OWNER = {
    "Block": "freeze.blocks",
    "BlockError": "freeze.blocks",
    "split_blocks": "freeze.blocks",
    "CacheConfig": "freeze.cache",
    "CacheError": "freeze.cache",
    "CacheSource": "freeze.cache",
    "Freezer": "freeze.freezer",
    "FreezerCounters": "freeze.freezer.records",
    "GradNormMonitor": "freeze.monitor",
    "IntervalStats": "freeze.monitor",
    "POLICIES": "freeze.policies",
    "Policy": "freeze.policies",
    "PolicyError": "freeze.policies",
    "Progress": "freeze.policies",
    "make_policy": "freeze.policies",
    "parse_policy": "freeze.policies",
}

__all__ = [
    "Block",
    "BlockError",
    "CacheConfig",
    "CacheError",
    "CacheSource",
    "Freezer",
    "FreezerCounters",
    "GradNormMonitor",
    "IntervalStats",
    "POLICIES",
    "Policy",
    "PolicyError",
    "Progress",
    "make_policy",
    "parse_policy",
    "split_blocks",
]  # the names of _OWNER

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from freeze.blocks import Block, BlockError, split_blocks
    from freeze.cache import CacheConfig, CacheError, CacheSource
    from freeze.freezer import Freezer
    from freeze.freezer.records import FreezerCounters
    from freeze.monitor import GradNormMonitor, IntervalStats
    from freeze.policies import POLICIES, Policy, PolicyError, Progress, make_policy, parse_policy


def __getattr__(name: str) -> Any:
    if name not in _OWNER:
        raise AttributeError(f"module 'freeze' has no attribute '{name}'")
    value = getattr(importlib.import_module(_OWNER[name]), name)
    globals()[name] = value  # once loaded, an ordinary module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_OWNER))
