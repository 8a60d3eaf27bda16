"""Does an activation cache at boundary k pay off? The query ``cache = "auto"`` (or any policy) asks.

A cache at boundary k stores each sample's input to block k. As AutoFreeze does it, the cache is
filled during ``fill_steps`` steps that still run the frozen prefix and also write its output, and
read from then on instead of running the prefix. So it pays when what the reads save over the
remaining steps exceeds what the writes cost::

    saved_ms_per_step = step(k, cache off) - step(k, cache on)           (predict_step)
    pays  <=>  (remaining_steps - fill_steps) x saved_ms_per_step > fill_steps x fill_ms_per_step
           and  samples x activation_bytes_per_sample(k) <= memory_budget_bytes   (when both given)

Assumptions: a write of a batch's activations costs what a read of them costs (``cache_read_ms`` of
block k) unless ``fill_ms_per_step`` is given; the boundary stays at k for ``remaining_steps`` (a
boundary move forward can reuse the cache by running the newly frozen blocks on it, which this
query does not credit, so it errs towards "does not pay"); communication is unchanged by the cache
(the same blocks train), so on a communication-bound cluster the saving shrinks to what the
overlap leaves exposed, which :func:`~freeze.costmodel.model.predict_step` accounts for.
"""

from __future__ import annotations

from dataclasses import dataclass

from freeze.costmodel.model import ClusterModel, predict_step
from freeze.costmodel.profile import Profile


@dataclass(frozen=True)
class CacheVerdict:
    """The answer of :func:`cache_pays`, with the numbers behind it (ms are per step)."""

    pays: bool
    k: int
    step_ms_without: float
    step_ms_with: float
    saved_ms_per_step: float
    fill_ms_per_step: float
    break_even_steps: float | None  # steps at k after which the cache has paid for itself; None: never
    store_bytes: int | None  # samples x activation bytes at k (None: samples not given)
    reason: str


def cache_pays(
    profile: Profile,
    cluster: ClusterModel,
    k: int,
    remaining_steps: int,
    fill_steps: int,
    *,
    samples: int | None = None,
    memory_budget_bytes: int | None = None,
    fill_ms_per_step: float | None = None,
) -> CacheVerdict:
    """Whether caching the frozen prefix's output at boundary ``k`` shortens the rest of training.

    Args:
        profile: the measured per-block costs (``cache_read_ms`` of block k is needed).
        cluster: node count, link and bucket limits the run uses.
        k: the boundary the cache would serve (blocks 0..k-1 frozen); 0 never pays.
        remaining_steps: optimizer steps left at this boundary, fill included.
        fill_steps: steps that write the cache before it can be read (one epoch's steps for a
            write-then-read cache).
        samples: samples the cache holds per rank (for the memory check and ``store_bytes``).
        memory_budget_bytes: host memory the cache may use; None: no check.
        fill_ms_per_step: extra ms a filling step pays for its writes; None: ``cache_read_ms``.
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < profile.num_blocks:
        raise ValueError(f"cache_pays: k={k!r} is not accepted; accepted: 0..{profile.num_blocks - 1}")
    if remaining_steps < 0 or fill_steps < 0:
        raise ValueError(
            f"cache_pays: remaining_steps and fill_steps must be >= 0, got {remaining_steps}, {fill_steps}"
        )
    without = predict_step(profile, cluster, k, cache=False).step_ms
    block = profile.blocks[k]
    store = None if samples is None else samples * block.activation_bytes_per_sample

    def verdict(pays, with_ms, saved, fill, even, reason) -> CacheVerdict:
        return CacheVerdict(pays, k, without, with_ms, saved, fill, even, store, reason)

    if k == 0:
        return verdict(False, without, 0.0, 0.0, None, "k = 0: nothing is frozen, nothing to cache")
    if block.cache_read_ms is None:
        return verdict(False, without, 0.0, 0.0, None, f"the profile has no cache_read_ms for block {k}")
    with_ms = predict_step(profile, cluster, k, cache=True).step_ms
    saved = without - with_ms
    fill = block.cache_read_ms if fill_ms_per_step is None else fill_ms_per_step
    even = fill_steps + fill_steps * fill / saved if saved > 0 else None
    if store is not None and memory_budget_bytes is not None and store > memory_budget_bytes:
        return verdict(False, with_ms, saved, fill, even, f"needs {store} bytes, over the budget {memory_budget_bytes}")
    if saved <= 0:
        return verdict(False, with_ms, saved, fill, None, "reading the cache is not faster than the prefix")
    gain = (remaining_steps - fill_steps) * saved - fill_steps * fill
    if gain <= 0:
        return verdict(False, with_ms, saved, fill, even, f"pays after {even:.0f} steps, {remaining_steps} remain")
    return verdict(True, with_ms, saved, fill, even, f"saves {gain:.0f} ms over {remaining_steps} steps")
