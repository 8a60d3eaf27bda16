"""What the activation cache is told (config, data source) and what it reports (estimates,
counters, lineage)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from freeze.cache.cuts import CacheError
from freeze.cache.store import STORAGE_DTYPES
from freeze.checks import is_int
from freeze.names import CACHE_MODES


@dataclass(frozen=True)
class CacheSource:
    """What the cache needs from the data: ``inputs(keys) -> model inputs`` (one row per key),
    ``num_keys`` (keys are 0..num_keys-1), and optionally ``epoch_keys(epoch) -> keys read in that
    epoch`` (all ranks together), which lets the cache compute only the entries still to be read."""

    inputs: Callable[[torch.Tensor], torch.Tensor]
    num_keys: int
    epoch_keys: Callable[[int], torch.Tensor] | None = None


@dataclass(frozen=True)
class CacheEstimate:
    """What a build or an advance would cost and save, on this rank: measured on its first chunk by
    the cache, or predicted from a profile by the application's cost model (``cache_pays``)."""

    boundary: int
    level: int  # the cut the cache would hold
    from_level: int | None  # None: computed from the inputs; else advanced from the cut at this level
    keys: int  # entries to compute
    store_bytes: int
    forwards_per_rank: int  # rows this rank computes (padding included)
    reads_remaining_per_rank: float  # activations this rank would read from the cache until the end
    compute_s_per_row: float  # the segment's forward per row
    exchange_s: float  # moving the computed rows to the ranks that read them
    saved_s_per_read: float  # what one read saves the training step


def pays(e: CacheEstimate) -> bool:
    """THE rule of ``cache = "auto"``: cache iff the time the reads save exceeds the time the
    build costs,

        reads_remaining_per_rank * saved_s_per_read  >  forwards_per_rank * compute_s_per_row + exchange_s

    The cache measures ``compute_s_per_row`` on the first chunk and takes ``saved_s_per_read`` to be
    the same forward (a read is a copy of the row, next to nothing beside the segment's forward, and
    the rest of the step does not change); the cost model predicts both from a profile instead,
    where ``saved_s_per_read`` is the whole step's predicted saving per sample (reads, and what
    overlap with communication leaves of the saving). Building from the inputs saves the prefix
    forward of every later read; advancing saves the forward of the newly frozen blocks, which the
    tail would otherwise recompute at every read. With V fixed views and E epochs left, a build
    computes at most min(V, E) views per sample while E epochs read one each, so it pays from the
    second epoch on whenever views repeat; with one epoch left it never does."""
    return e.reads_remaining_per_rank * e.saved_s_per_read > e.forwards_per_rank * e.compute_s_per_row + e.exchange_s


def default_budget_bytes() -> int:
    """A quarter of the node's physical memory, for all its ranks together (PipeTransformer's
    AutoCache stops caching above 65 % of host memory for all its processes)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30


@dataclass(frozen=True)
class CacheConfig:
    """``mode``: off | memory (in RAM; over budget: error) | disk (in RAM up to the budget, else a
    node-local memory-mapped file under ``directory``) | auto (like disk, and only where
    ``rule(CacheEstimate)`` says it pays; default :func:`pays`).
    ``budget_bytes``: of one NODE: a store every local rank keeps privately (no room in /dev/shm,
    ``node_shared=False``) counts once per local rank, and an advance counts the store it advances
    from too; 0 = :func:`default_budget_bytes`.
    ``storage_dtype``: fp32 (exact), bf16 or fp16 (half the bytes; cast back on read).
    ``chunk_samples``: rows per build chunk. ``node_shared``: a node's ranks share one in-memory
    store through /dev/shm when it has room (one copy per node, and no row travels within a node);
    False, or no room: one private copy per rank, rows exchanged by all_gather."""

    mode: str = "off"
    budget_bytes: int = 0
    storage_dtype: str = "fp32"
    directory: str | Path | None = None
    chunk_samples: int = 256
    rule: Callable[[CacheEstimate], bool] | None = None
    node_shared: bool = True

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            raise CacheError(f"cache: mode '{self.mode}' is not accepted; accepted: {', '.join(CACHE_MODES)}")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise CacheError(
                f"cache: storage_dtype '{self.storage_dtype}' is not accepted; accepted: {', '.join(STORAGE_DTYPES)}"
            )
        if not is_int(self.budget_bytes) or self.budget_bytes < 0:
            raise CacheError(
                f"cache: budget_bytes must be an integer >= 0 (0 = a quarter of RAM), got {self.budget_bytes!r}"
            )
        if not is_int(self.chunk_samples) or self.chunk_samples < 2:
            raise CacheError(f"cache: chunk_samples must be an integer >= 2, got {self.chunk_samples!r}")

    @property
    def budget(self) -> int:
        return self.budget_bytes or default_budget_bytes()


@dataclass
class CacheCounters:
    builds: int = 0
    advances: int = 0
    drops: int = 0
    build_s_total: float = 0.0
    advance_s_total: float = 0.0
    forwards_total: int = 0  # rows computed by this rank for builds and advances
    exchanged_bytes_total: int = 0  # received by this rank
    hit_keys: int = 0  # keys served from the cache
    miss_keys: int = 0  # keys whose batch had to be computed while the cache was active


@dataclass(frozen=True)
class LineageStep:
    op: str  # "build" or "advance"
    level: int
    epoch: int  # the keys computed were those read from this epoch on
