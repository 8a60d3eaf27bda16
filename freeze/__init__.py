"""freeze: adaptive layer freezing for data-parallel fine-tuning.

from freeze import Freezer, split_blocks, make_policy
freezer = Freezer(model, split_blocks(model), make_policy("autofreeze", percentile=50))
"""

from freeze.blocks import Block, BlockError, split_blocks
from freeze.cache import CacheConfig, CacheError, CacheSource
from freeze.freezer import Freezer
from freeze.monitor import GradNormMonitor, IntervalStats
from freeze.policies import POLICIES, Policy, PolicyError, Progress, make_policy, parse_policy
from freeze.records import FreezerCounters

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
]
