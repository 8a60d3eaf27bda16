"""Exact activation caching of the frozen prefix (see freeze.cache.cache)."""

from freeze.cache.cache import ActivationCache
from freeze.cache.config import (
    CACHE_MODES,
    CacheConfig,
    CacheCounters,
    CacheEstimate,
    CacheSource,
    LineageStep,
    default_budget_bytes,
    pays,
)
from freeze.cache.graph import CacheError, SplitGraph
from freeze.cache.store import STORAGE_DTYPES

__all__ = [
    "CACHE_MODES",
    "STORAGE_DTYPES",
    "ActivationCache",
    "CacheConfig",
    "CacheCounters",
    "CacheError",
    "CacheEstimate",
    "CacheSource",
    "LineageStep",
    "SplitGraph",
    "default_budget_bytes",
    "pays",
]
