"""What the activation cache is told (config, data source) and what it reports (estimates,
counters, lineage)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from freeze.cache.cuts import CacheError, outputs_equal, probing
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


# Keys the source is fetched twice for at construction (see check_source).
PROBE_SOURCE_KEYS = 8


def check_source(source: CacheSource, model: torch.nn.Module) -> None:
    """The source's first calls, at construction, so that a source the cache cannot use is
    refused in one line then, not found at the first freeze (80 % into a freezeout run):

    - the same keys fetched twice give bitwise the same inputs. A source that augments randomly
      (a dataset with RandomCrop) has no input a key could stand for, so no row could ever be
      served; before this check the probe compared separate fetches, blamed the model ("batch
      statistics") and the run went on without a cache, silently. Eight keys: a flip with p=0.5
      on each would slip through with probability 1/256. Drawn under a forked random state.
    - ``epoch_keys(0)`` is a 1-D integer tensor of keys in ``0..num_keys-1``.

    Args:
        source: the cache source.
        model: the bare model (its random state and modes are left as they were).
    """
    keys = torch.arange(min(PROBE_SOURCE_KEYS, source.num_keys))
    try:
        with probing(model):
            first, second = source.inputs(keys), source.inputs(keys)
    except Exception as exc:  # the source's own error, named as such, in one line
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CacheError(
            f"cache: cache_source.inputs(keys 0..{keys.numel() - 1}) failed ({type(exc).__name__}: {reason})"
        ) from None
    if not outputs_equal(first, second):
        raise CacheError(
            "cache: cache_source.inputs(keys) returned other inputs when called again with the same keys (random "
            "augmentation inside the source?), so a key names no one input and nothing can be cached; make inputs "
            "deterministic per key (fixed augmented views, each its own key) or turn the cache off"
        )
    if source.epoch_keys is None:
        return
    keys = source.epoch_keys(0)
    if not isinstance(keys, torch.Tensor) or keys.dim() != 1 or keys.is_floating_point() or keys.is_complex():
        raise CacheError("cache: cache_source.epoch_keys(epoch) must return a 1-D integer tensor of keys")
    if keys.numel() and (int(keys.min()) < 0 or int(keys.max()) >= source.num_keys):
        raise CacheError(
            f"cache: cache_source.epoch_keys(0) holds keys outside 0..{source.num_keys - 1} (num_keys={source.num_keys})"
        )


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
