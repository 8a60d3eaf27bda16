"""Does an activation cache at boundary k pay off? The cost model's prediction of the one rule the
cache itself applies (``cache = "auto"``: :func:`freeze.cache.config.pays`), on numbers predicted
from a profile instead of measured on the first chunk of a build::

    reads_remaining_per_rank * saved_s_per_read  >  forwards_per_rank * compute_s_per_row + exchange_s

where, for a cache of ``samples`` keys built from the inputs at boundary k on N nodes:

    forwards_per_rank   = ceil(samples / N)                        (the build is sharded)
    compute_s_per_row   = sum of forward_frozen_ms of blocks 0..k-1 / batch_size
    exchange_s          = an all-gather of samples x activation_bytes_per_sample(k) over the link
    reads_remaining     = remaining_steps x batch_size             (per rank)
    saved_s_per_read    = (step(k, cache off) - step(k, cache on)) / batch_size     (predict_step)

and the store must fit ``memory_budget_bytes`` when given. ``saved_s_per_read`` is the whole step's
predicted saving: the read's own cost and, on a communication-bound cluster, what the overlap with
the all-reduce leaves of the saving (:func:`~freeze.pipeline.costmodel.model.predict_step`). The
boundary is taken to stay at k for ``remaining_steps`` (a later advance, which reuses the store,
is not credited: the prediction errs towards "does not pay").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from freeze.cache.config import CacheEstimate, pays
from freeze.checks import is_int
from freeze.pipeline.costmodel.link import allgather_s
from freeze.pipeline.costmodel.model import ClusterModel, predict_step
from freeze.pipeline.costmodel.profile import Profile


@dataclass(frozen=True)
class CacheVerdict:
    """The answer of :func:`cache_pays`, with the numbers behind it (ms are per step)."""

    pays: bool
    k: int
    step_ms_without: float
    step_ms_with: float
    saved_ms_per_step: float
    build_ms: float  # forwards of this rank's share plus the exchange
    break_even_steps: float | None  # steps at k after which the cache has paid for its build; None: never
    store_bytes: int  # samples x activation bytes at k
    reason: str
    estimate: CacheEstimate | None  # what the rule was given (None: k = 0 or no cache_read_ms)


def cache_pays(
    profile: Profile,
    cluster: ClusterModel,
    k: int,
    remaining_steps: int,
    *,
    samples: int,
    memory_budget_bytes: int | None = None,
) -> CacheVerdict:
    """Whether caching the frozen prefix's output at boundary ``k`` shortens the rest of training.

    Args:
        profile: the measured per-block costs (``cache_read_ms`` of block k is needed).
        cluster: node count, link and bucket limits the run uses.
        k: the boundary the cache would serve (blocks 0..k-1 frozen); 0 never pays.
        remaining_steps: optimizer steps left at this boundary.
        samples: keys the cache holds (the training set, times its fixed views).
        memory_budget_bytes: host memory the store may use; None: no check.
    """
    if not is_int(k) or not 0 <= k < profile.num_blocks:
        raise ValueError(f"cache_pays: k={k!r} is not accepted; accepted: 0..{profile.num_blocks - 1}")
    for name, value in (("remaining_steps", remaining_steps), ("samples", samples)):
        if not is_int(value) or value < 0:
            raise ValueError(f"cache_pays: {name}={value!r} is not accepted; accepted: an integer >= 0")
    without = predict_step(profile, cluster, k, cache=False).step_ms
    store = samples * profile.blocks[k].activation_bytes_per_sample

    def verdict(ok, with_ms, build_ms, even, reason, estimate=None) -> CacheVerdict:
        return CacheVerdict(ok, k, without, with_ms, without - with_ms, build_ms, even, store, reason, estimate)

    if k == 0:
        return verdict(False, without, 0.0, None, "k = 0: nothing is frozen, nothing to cache")
    if profile.blocks[k].cache_read_ms is None:
        return verdict(False, without, 0.0, None, f"the profile has no cache_read_ms for block {k}")
    with_ms = predict_step(profile, cluster, k, cache=True).step_ms
    batch = profile.batch_size
    estimate = CacheEstimate(
        boundary=k,
        level=k,
        from_level=None,
        keys=samples,
        store_bytes=store,
        forwards_per_rank=math.ceil(samples / cluster.workers),
        reads_remaining_per_rank=float(remaining_steps * batch),
        compute_s_per_row=sum(b.forward_frozen_ms or 0.0 for b in profile.blocks[:k]) / batch / 1e3,
        exchange_s=allgather_s(store, cluster.workers, cluster.link),
        saved_s_per_read=(without - with_ms) / batch / 1e3,
    )
    build_ms = (estimate.forwards_per_rank * estimate.compute_s_per_row + estimate.exchange_s) * 1e3
    saved = without - with_ms
    even = build_ms / saved if saved > 0 else None
    if memory_budget_bytes is not None and store > memory_budget_bytes:
        return verdict(
            False, with_ms, build_ms, even, f"needs {store} bytes, over the budget {memory_budget_bytes}", estimate
        )
    if saved <= 0:
        return verdict(False, with_ms, build_ms, None, "reading the cache is not faster than the prefix", estimate)
    if not pays(estimate):
        return verdict(
            False, with_ms, build_ms, even, f"pays after {even:.0f} steps, {remaining_steps} remain", estimate
        )
    gain = remaining_steps * saved - build_ms
    return verdict(True, with_ms, build_ms, even, f"saves {gain:.0f} ms over {remaining_steps} steps", estimate)
