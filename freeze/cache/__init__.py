"""Exact activation caching of the frozen prefix (see freeze.cache.cache)."""

from freeze.cache.cache import ActivationCache, CachePlan, make_cache
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
from freeze.cache.cuts import CacheError, Cuts
from freeze.cache.store import STORAGE_DTYPES

__all__ = [
    "CACHE_MODES",
    "STORAGE_DTYPES",
    "ActivationCache",
    "CacheConfig",
    "CacheCounters",
    "CacheError",
    "CacheEstimate",
    "CachePlan",
    "CacheSource",
    "LineageStep",
    "Cuts",
    "default_budget_bytes",
    "make_cache",
    "pays",
]
