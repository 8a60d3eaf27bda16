"""Predicted step and run time of data-parallel training with a frozen prefix: a pure function of a
measured :class:`~freeze.pipeline.costmodel.profile.Profile` and a :class:`~freeze.pipeline.costmodel.link.Link`,
for any node count N, link, boundary k and cache setting. No torch, no timing.

One step at boundary k (blocks 0..k-1 frozen), as the Freezer runs it under DDP:

1. **Forward**: DDP first broadcasts the trainable blocks' buffers from rank 0 (blocking; the
   Freezer keeps frozen buffers out) -- :func:`~freeze.pipeline.costmodel.link.broadcast_s`. Then
   ``forward_overhead_ms`` + the frozen blocks' no-grad forward + the trainable blocks' forward.
   With the cache on (k >= 1) the frozen prefix is not run: reading the batch's cached
   activations at block k (``cache_read_ms``) replaces it. At k = 0 the cache changes nothing.
2. **Backward** runs blocks L-1 down to k. Block k, the first trainable block, computes no input
   gradient (``backward_first_ms``); the others do (``backward_ms``).
3. **Buckets**: gradients are bucketed as DDP's reducer rebuilds them after the first step: in the
   order they become ready, which is taken as reverse registration order (an assumption: a
   sequential block split's backward visits parameters in that order), a bucket closing once it holds >= its limit, the first limit
   ``first_bucket_bytes`` (1 MiB, DDP's default when ``bucket_cap_mb`` is not given) and every later
   one ``bucket_cap_bytes`` (25 MiB). The first step after every DDP construction (each boundary
   change) has one bucket of everything (torch 2.x ``compute_bucket_size_limits``: ``[sys.maxsize]``
   without find_unused_parameters): ``first_after_rewrap=True``. Only trainable parameters are
   bucketed (the Freezer re-wraps DDP over them).
4. **Ready times**: a parameter's gradient is ready once the share of its block's backward given by
   the bytes of that block's parameters at or after it (registration order) has run, i.e. linear in
   bytes inside a block, and all of a block's gradients by the end of its backward.
5. **Communication**: buckets are all-reduced one at a time in bucket order, each starting when it
   is ready and the previous one is done (gloo's two worker threads could run two at once; on one
   link that changes which finishes first, not when the last does). Each takes
   :func:`~freeze.pipeline.costmodel.link.ring_allreduce_s` alone.
6. **CPU interference**: a bucket in flight needs the CPU for a share u = reduce_cpu_s / its time
   (u = 1 when the CPU, not the wire, sets the rate). While the backward also runs, the two share
   the node's CPU: communication takes min(u, ``comm_cpu_share``) and runs at that over u of its
   speed; the backward keeps the rest (1 - min(u, comm_cpu_share)). ``comm_cpu_share`` is the one
   fitted factor (:func:`fit_comm_cpu_share`, fitted at one measured step and validated at the
   others; 0.5 is an even split between the backward thread and gloo's thread). It is the only
   place where computation and communication interact; after the backward, communication has the
   CPU to itself.
7. **After the backward**: once the last gradient is computed and the last bucket is done, DDP
   copies the reduced buckets back into .grad, then the Freezer's monitor and the optimizer step
   run: ``after_backward_ms[k]``, measured at k from the last gradient to the end of the step.
   Data loading is not modelled (the validation feeds pre-built batches).

Parts: ``compute_ms`` = forward + backward alone, ``optimizer_ms`` = after_backward_ms[k],
``exposed_comm_ms`` = step - compute - optimizer: the buffer broadcast, the backward's slow-down
while it shares the CPU, and the all-reduce tail after the backward.

Compute times are the profile's: measured at the node's batch size and thread count with as many
processes per core as the cluster puts there (``Profile.nodes_per_core``), so when emulated nodes
share a core the slow-down is measured, not assumed. A run is a sequence of (steps, k) segments
(:func:`predict_run`): each boundary change costs one first-after-rewrap step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from freeze.checks import is_int
from freeze.pipeline.costmodel.link import Link, broadcast_s, reduce_cpu_s, ring_allreduce_s
from freeze.pipeline.costmodel.profile import Profile

MIB = 1 << 20
DEFAULT_BUCKET_CAP_BYTES = 25 * MIB  # DDP's bucket_cap_mb default
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
_EPS = 1e-12


@dataclass(frozen=True)
class ClusterModel:
    """N nodes joined by ``link``, ``workers_per_node`` workers on each; DDP's bucket limits; the
    fitted CPU share.

    The all-reduce is one ring over all nodes x workers_per_node workers (as NCCL's and gloo's rings
    run), paced by ``link``: with several nodes, the link between nodes, whose every hop carries the
    ring's whole chunk stream (hops inside a node are taken to be no slower: NVLink or PCIe against
    Ethernet or InfiniBand); on one node, the link between its workers. Each worker's compute is the
    profile's, measured at its batch size and threads (on a GPU node, a profile made on that GPU)."""

    nodes: int
    link: Link
    comm_cpu_share: float = 0.5
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES
    workers_per_node: int = 1

    def __post_init__(self) -> None:
        if not is_int(self.nodes) or self.nodes < 1:
            raise ValueError(f"ClusterModel nodes: expected an integer >= 1, got {self.nodes!r}")
        if not is_int(self.workers_per_node) or self.workers_per_node < 1:
            raise ValueError(f"ClusterModel workers_per_node: expected an integer >= 1, got {self.workers_per_node!r}")
        if not 0.0 <= self.comm_cpu_share <= 1.0:
            raise ValueError(f"ClusterModel comm_cpu_share: expected a number in [0, 1], got {self.comm_cpu_share!r}")
        if self.bucket_cap_bytes < 1 or self.first_bucket_bytes < 1:
            raise ValueError("ClusterModel bucket_cap_bytes and first_bucket_bytes: expected integers >= 1")

    @property
    def workers(self) -> int:
        """The data-parallel workers: the ring's size."""
        return self.nodes * self.workers_per_node


@dataclass(frozen=True)
class BucketTiming:
    """One bucket's all-reduce, ms from the start of the backward."""

    nbytes: int
    ready_ms: float
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class StepPrediction:
    k: int
    nodes: int
    cache: bool
    forward_ms: float  # compute only (broadcast excluded)
    backward_ms: float  # compute alone, as profiled
    optimizer_ms: float  # monitor + optimizer step
    exposed_comm_ms: float
    step_ms: float
    broadcast_ms: float
    allreduce_ms: float  # sum of the buckets' all-reduce times alone
    allreduce_bytes: int
    buckets: tuple[BucketTiming, ...]

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms


def bucket_sizes(param_bytes_ready_order: Sequence[int], first_bucket_bytes: int, bucket_cap_bytes: int) -> list[int]:
    """Parameter counts per bucket, DDP's rule: add parameters in ready order, close a bucket once
    it holds >= its limit; the first limit is ``first_bucket_bytes``, every later one
    ``bucket_cap_bytes``. Returns the number of parameters in each bucket.

    Args:
        param_bytes_ready_order: each gradient's bytes in the order gradients become ready.
        first_bucket_bytes: the first bucket's limit.
        bucket_cap_bytes: every later bucket's limit.
    """
    counts, count, size, limit = [], 0, 0, first_bucket_bytes
    for nbytes in param_bytes_ready_order:
        count += 1
        size += nbytes
        if size >= limit:
            counts.append(count)
            count, size, limit = 0, 0, bucket_cap_bytes
    if count:
        counts.append(count)
    return counts


def _backward_schedule(profile: Profile, k: int) -> tuple[list[float], list[int], float]:
    """Per trainable parameter in ready order: (ready point in ms of backward work, bytes); and the
    total backward work (ms)."""
    ready, sizes, done = [], [], 0.0
    for j in range(profile.num_blocks - 1, k - 1, -1):
        block = profile.blocks[j]
        duration = block.backward_first_ms if j == k else block.backward_ms
        total = block.grad_bytes
        seen = 0
        for nbytes in reversed(block.param_bytes):
            seen += nbytes
            ready.append(done + (duration * seen / total if total else duration))
            sizes.append(nbytes)
        done += duration
    return ready, sizes, done


def _overlap(
    bucket_ready: list[float], bucket_ms: list[float], bucket_cpu: list[float], work_ms: float, share: float
) -> tuple[float, list[tuple[float, float]]]:
    """Run the backward (``work_ms`` of CPU work) and the buckets' all-reduces together under the
    CPU sharing rule of the module docstring (item 6). Returns the time the backward ends and each
    bucket's (start, end), all in ms from the start of the backward."""
    t = w = 0.0
    spans: list[tuple[float, float]] = []
    nxt, current, remaining, started = 0, None, 0.0, 0.0
    backward_end = work_ms if not bucket_ready else None
    while nxt < len(bucket_ready) or current is not None:
        if current is None:
            if bucket_ready[nxt] <= w + _EPS:  # ready and the link is free: start it
                current, remaining, started, nxt = nxt, 1.0, t, nxt + 1
                continue
            t, w = t + bucket_ready[nxt] - w, bucket_ready[nxt]  # the backward alone, at full speed
            if w >= work_ms - _EPS and backward_end is None:
                backward_end = t
            continue
        busy = w < work_ms - _EPS
        duration = bucket_ms[current]
        u = bucket_cpu[current] / duration if duration > 0 else 0.0
        if busy:
            comm_rate = 1.0 if u <= share else share / u  # share of the bucket's speed alone
            backward_rate = 1.0 - min(u, share)
        else:
            comm_rate, backward_rate = 1.0, 0.0
        dt_comm = remaining * duration / comm_rate if comm_rate > 0 else float("inf")
        dt_backward = (work_ms - w) / backward_rate if busy and backward_rate > 0 else float("inf")
        dt = min(dt_comm, dt_backward)
        t += dt
        if busy:
            w = min(work_ms, w + dt * backward_rate)
            if w >= work_ms - _EPS and backward_end is None:
                backward_end = t
        if duration > 0:
            remaining -= dt * comm_rate / duration
        if dt_comm <= dt_backward or remaining <= _EPS:
            spans.append((started, t))
            current = None
    if backward_end is None:  # every bucket finished while the backward was still running
        backward_end = t + (work_ms - w)
    return backward_end, spans


def predict_step(
    profile: Profile, cluster: ClusterModel, k: int, cache: bool = False, first_after_rewrap: bool = False
) -> StepPrediction:
    """Predicted time of one training step at boundary ``k`` (module docstring: every assumption).

    Args:
        profile: the measured per-block costs (at the node's batch size, threads and core sharing).
        cluster: node count, link, DDP bucket limits and the fitted CPU share.
        k: the boundary: blocks 0..k-1 frozen, 0 <= k < number of blocks.
        cache: the frozen prefix's output is read from the activation cache (k >= 1).
        first_after_rewrap: the first step after a DDP construction (one bucket of everything).
    """
    if not is_int(k) or not 0 <= k < profile.num_blocks:
        raise ValueError(f"predict_step: k={k!r} is not accepted; accepted: 0..{profile.num_blocks - 1}")
    blocks = profile.blocks
    use_cache = cache and k >= 1
    if use_cache and blocks[k].cache_read_ms is None:
        raise ValueError(f"predict_step: the profile has no cache_read_ms for block {k} ({blocks[k].name})")
    prefix_ms = blocks[k].cache_read_ms if use_cache else sum(b.forward_frozen_ms for b in blocks[:k])
    forward_ms = profile.forward_overhead_ms + prefix_ms + sum(b.forward_ms for b in blocks[k:])
    ready, sizes, work_ms = _backward_schedule(profile, k)
    n, link = cluster.workers, cluster.link
    counts = (
        [len(sizes)]
        if first_after_rewrap
        else bucket_sizes(sizes, cluster.first_bucket_bytes, cluster.bucket_cap_bytes)
    )
    bucket_bytes, bucket_ready, last = [], [], 0
    for c in counts:
        bucket_bytes.append(sum(sizes[last : last + c]))
        bucket_ready.append(ready[last + c - 1])
        last += c
    bucket_ms = [ring_allreduce_s(b, n, link) * 1e3 for b in bucket_bytes]
    bucket_cpu = [min(reduce_cpu_s(b, n, link) * 1e3, ms) for b, ms in zip(bucket_bytes, bucket_ms)]
    if n < 2:
        backward_end, spans = work_ms, [(r, r) for r in bucket_ready]
    else:
        backward_end, spans = _overlap(bucket_ready, bucket_ms, bucket_cpu, work_ms, cluster.comm_cpu_share)
    comm_end = max((end for _, end in spans), default=0.0)
    buffers = sum(b.buffer_bytes for b in blocks[k:])
    bcast_ms = broadcast_s(buffers, n, link) * 1e3
    optimizer_ms = profile.after_backward_ms[k]
    step_ms = bcast_ms + forward_ms + max(backward_end, comm_end) + optimizer_ms
    return StepPrediction(
        k=k,
        nodes=n,  # the ring's workers (nodes x workers_per_node)
        cache=use_cache,
        forward_ms=forward_ms,
        backward_ms=work_ms,
        optimizer_ms=optimizer_ms,
        exposed_comm_ms=step_ms - forward_ms - work_ms - optimizer_ms,
        step_ms=step_ms,
        broadcast_ms=bcast_ms,
        allreduce_ms=sum(bucket_ms) if n >= 2 else 0.0,
        allreduce_bytes=sum(bucket_bytes) if n >= 2 else 0,
        buckets=tuple(BucketTiming(b, r, s, e) for b, r, (s, e) in zip(bucket_bytes, bucket_ready, spans)),
    )


@dataclass(frozen=True)
class RunPrediction:
    wall_s: float
    steps: int
    segments: tuple[tuple[int, int, float], ...]  # (steps, k, seconds)


def predict_run(
    profile: Profile, cluster: ClusterModel, segments: Sequence[tuple[int, int]], cache: bool = False
) -> RunPrediction:
    """Predicted training time of a boundary trajectory: ``segments`` = (steps, k) in run order.
    The first step of the run and of every segment whose k differs from the previous one is a
    first-after-rewrap step (the Freezer builds a new DDP wrapper there).

    Args:
        profile: the measured per-block costs.
        cluster: the cluster to predict for.
        segments: (optimizer steps, boundary) pairs.
        cache: whether the activation cache serves the frozen prefix.
    """
    out, total_s, steps, previous = [], 0.0, 0, None
    memo: dict[tuple[int, bool], float] = {}

    def step_ms(k: int, first: bool) -> float:
        if (k, first) not in memo:
            memo[(k, first)] = predict_step(profile, cluster, k, cache, first_after_rewrap=first).step_ms
        return memo[(k, first)]

    for n_steps, k in segments:
        if n_steps < 0:
            raise ValueError(f"predict_run: a segment has {n_steps} steps; expected >= 0")
        if n_steps == 0:
            continue
        rewraps = 1 if k != previous else 0
        seconds = (rewraps * step_ms(k, True) + (n_steps - rewraps) * step_ms(k, False)) / 1e3
        out.append((n_steps, k, seconds))
        total_s += seconds
        steps += n_steps
        previous = k
    return RunPrediction(total_s, steps, tuple(out))


def fit_comm_cpu_share(
    profile: Profile, cluster: ClusterModel, k: int, measured_step_ms: float, cache: bool = False
) -> float:
    """The ``comm_cpu_share`` in [0, 1] (steps of 0.01) whose predicted step at ``k`` is closest
    to ``measured_step_ms``; ties go to the share nearest 0.5.

    Args:
        profile: the measured per-block costs.
        cluster: the cluster the step was measured on (its comm_cpu_share is ignored).
        k: the boundary of the measured step.
        measured_step_ms: the measured median step.
        cache: whether the measured step used the activation cache.
    """
    best = None
    for i in range(101):
        share = i / 100
        trial = dataclasses.replace(cluster, comm_cpu_share=share)
        error = abs(predict_step(profile, trial, k, cache).step_ms - measured_step_ms)
        key = (round(error, 9), abs(share - 0.5))
        if best is None or key < best[0]:
            best = (key, share)
    return best[1]
