"""Measure a :class:`~freeze.pipeline.costmodel.profile.Profile`: per-block forward and backward ms at every
boundary, what runs after the backward, and cache read ms, on this machine.

Each profiled process runs the real training step the cost model predicts: the Freezer at boundary
k over DDP in a one-process gloo group (so DDP's per-gradient bucket copies and its copy-back are in
the measured backward, while nothing crosses a network), the run's optimizer (SGD with momentum or
AdamW), fresh random data every step outside the clock. Hooks time the step without changing it:

- forward: a forward pre-hook on each block's modules stamps the moment the block starts; a block's
  forward runs until the next block starts (the last block's until the loss is computed), so glue
  between blocks (ResNet's max-pool, average pool, flatten) counts with the block before it;
- backward: a hook on each trainable block's input tensor stamps the moment its gradient is
  complete, which is where the block's backward ends and the previous block's begins; the first
  trainable block's input needs no gradient, so its backward ends when the step's last parameter
  gradient is accumulated (a post-accumulate-grad hook on every parameter);
- after the backward: from that moment to the end of the step: DDP's wait for its (here local)
  all-reduces and its copy of the buckets back into .grad, the Freezer's monitor, the optimizer.

``layout`` runs several such processes at once, each pinned to its cores with its thread count, as
an emulated cluster pins its nodes: where nodes share a core the measured times include that
sharing. The processes are independent (no collective between them); per block the slowest
process's median is kept, since a data-parallel step waits for its slowest node.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from freeze.checks import is_int
from freeze.pipeline.config import OPTIMIZER_NAMES, OptimConfig
from freeze.pipeline.costmodel.profile import BlockCost, Profile, median
from freeze.pipeline.runs import cpu_name


@dataclass(frozen=True)
class NodeCores:
    """A profiled process's cores (pinned) and torch thread count."""

    cores: tuple[int, ...]
    threads: int


@dataclass(frozen=True)
class ProfileSpec:
    """What to profile. ``make_model`` must be picklable (a module-level function or a
    functools.partial of one): the processes are spawned. ``input_shape`` is one sample's."""

    model_name: str
    make_model: Callable
    input_shape: tuple[int, ...]
    num_classes: int
    batch_size: int
    steps: int = 5  # timed steps per boundary
    warmup: int = 2  # untimed steps per boundary (the first after a DDP construction has one bucket)
    cache_keys: int = 4096  # rows of the activation store a cache read gathers from
    cache_reads: int = 20
    lr: float = 0.01
    momentum: float = 0.9  # SGD's
    optimizer: str = "sgd"  # "sgd" (with momentum) or "adamw": the step the run takes, timed per boundary
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "steps", "warmup", "cache_keys", "cache_reads", "num_classes"):
            value = getattr(self, name)
            minimum = 0 if name == "warmup" else 1
            if not is_int(value) or value < minimum:
                raise ValueError(f"ProfileSpec {name}: expected an integer >= {minimum}, got {value!r}")
        if self.optimizer not in OPTIMIZER_NAMES:
            raise ValueError(f"ProfileSpec optimizer: '{self.optimizer}'; accepted: {', '.join(OPTIMIZER_NAMES)}")

    def make_optimizer(self, model):
        """The optimizer the profiled steps take (each boundary's after-backward time is its step),
        built as a run builds its own."""
        from freeze.pipeline.optim import build_optimizer

        optim = OptimConfig(name=self.optimizer, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return build_optimizer(model, optim)

    def optimizer_label(self) -> str:
        """As the profile records it, e.g. "sgd(momentum=0.9)" or "adamw(weight_decay=0.01)"."""
        if self.optimizer == "adamw":
            return f"adamw(weight_decay={self.weight_decay:g})"
        return f"sgd(momentum={self.momentum:g})"


def nodes_per_core(layout: Sequence[NodeCores]) -> int:
    """The most processes that share one core in ``layout``."""
    counts = Counter(c for node in layout for c in node.cores)
    return max(counts.values()) if counts else 1


# ------------------------------------------------------------------------------------- in a process
class _Stamps:
    """Per-step timestamps written by the hooks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.reset()

    def reset(self) -> None:
        self.start = [None] * self.num_blocks
        self.grad_done = [None] * self.num_blocks
        self.act_bytes = [None] * self.num_blocks
        self.act_shape = [None] * self.num_blocks
        self.last_grad = None  # when the last parameter gradient of the step was accumulated

    def pre_hook(self, i: int):
        def hook(module, args):
            if self.start[i] is not None or not args:
                return
            self.start[i] = time.perf_counter()
            x = args[0]
            if hasattr(x, "requires_grad"):
                self.act_bytes[i] = x[0].numel() * x.element_size()
                self.act_shape[i] = tuple(x.shape[1:])
                if x.requires_grad:
                    x.register_hook(lambda grad: self._grad_done(i))

        return hook

    def _grad_done(self, i: int) -> None:
        if self.grad_done[i] is None:
            self.grad_done[i] = time.perf_counter()

    def param_hook(self, param) -> None:
        self.last_grad = time.perf_counter()


def _timed_step(freezer, optimizer, stamps: _Stamps, x, y) -> dict:
    import torch.nn.functional as F

    stamps.reset()
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(freezer.module(x), y)
    t_loss = time.perf_counter()
    loss.backward()
    freezer.after_backward()
    optimizer.step()
    t_end = time.perf_counter()
    k, L = freezer.boundary, stamps.num_blocks
    starts = stamps.start
    if any(s is None for s in starts):
        missing = [i for i, s in enumerate(starts) if s is None]
        raise RuntimeError(f"profile: blocks {missing} never ran in the forward (is the block split sequential?)")
    ms = 1e3
    forward = [((starts[i + 1] if i + 1 < L else t_loss) - starts[i]) * ms for i in range(L)]
    backward = {}
    for j in range(L - 1, k - 1, -1):
        begin = t_loss if j == L - 1 else stamps.grad_done[j + 1]
        end = stamps.grad_done[j] if j > k else stamps.last_grad
        if begin is None or end is None:
            raise RuntimeError(f"profile: no gradient reached the input of block {j + 1 if begin is None else j}")
        backward[j] = (end - begin) * ms
    return {
        "overhead": (starts[0] - t0) * ms,
        "forward": forward,
        "backward": backward,
        "after": (t_end - stamps.last_grad) * ms,
        "step": (t_end - t0) * ms,  # the whole step: its spread over the timed steps says how noisy they were
    }


def _time_cache_read(act_shape: tuple[int, ...], spec: ProfileSpec, gen) -> float:
    """Median ms to read a batch of cached activations by random keys from an fp32 store of
    ``cache_keys`` rows: the activation cache's own in-memory store
    (:meth:`freeze.cache.store.ActivationStore.read`: key lookup, index_select, cast to the compute
    dtype), so the profile times the read the cached training step does, not a copy of it."""
    import torch

    from freeze.cache.store import ActivationStore

    shape = torch.Size(act_shape)
    data = torch.randn((spec.cache_keys, *shape), generator=gen)
    keys = torch.arange(spec.cache_keys)
    # The store's level only names its cut; the format is the one a default-format model computes in.
    store = ActivationStore(0, keys, spec.cache_keys, shape, "fp32", torch.float32, torch.contiguous_format, data)
    cpu = torch.device("cpu")
    samples = []
    for _ in range(spec.cache_reads):
        batch = torch.randint(0, spec.cache_keys, (spec.batch_size,), generator=gen)
        t0 = time.perf_counter()
        store.read(batch, cpu)
        samples.append((time.perf_counter() - t0) * 1e3)
    return median(samples)


def _measure(spec: ProfileSpec) -> dict:
    import torch

    from freeze import Freezer, split_blocks

    torch.manual_seed(spec.seed)
    model = spec.make_model()
    blocks = split_blocks(model)
    optimizer = spec.make_optimizer(model)
    freezer = Freezer(model, blocks, optimizer=optimizer)
    stamps = _Stamps(len(blocks))
    handles = [m.register_forward_pre_hook(stamps.pre_hook(i)) for i, b in enumerate(blocks) for m in b.modules]
    handles += [p.register_post_accumulate_grad_hook(stamps.param_hook) for p in model.parameters()]
    gen = torch.Generator().manual_seed(spec.seed + 1)
    shape = (spec.batch_size, *spec.input_shape)
    L = len(blocks)
    samples = {"overhead": [], "forward": [[] for _ in range(L)], "forward_frozen": [[] for _ in range(L)]}
    samples |= {"backward": [[] for _ in range(L)], "backward_first": [[] for _ in range(L)]}
    samples["after"] = [[] for _ in range(L)]
    samples["step"] = [[] for _ in range(L)]
    act_bytes, act_shape = [None] * L, [None] * L
    try:
        for k in range(L):
            freezer.set_boundary(k)
            freezer.train()
            for step in range(spec.warmup + spec.steps):
                x = torch.randn(shape, generator=gen)
                y = torch.randint(0, spec.num_classes, (spec.batch_size,), generator=gen)
                m = _timed_step(freezer, optimizer, stamps, x, y)
                for i in range(L):
                    if act_bytes[i] is None and stamps.act_bytes[i] is not None:
                        act_bytes[i], act_shape[i] = stamps.act_bytes[i], stamps.act_shape[i]
                if step < spec.warmup:
                    continue
                samples["overhead"].append(m["overhead"])
                for i, ms in enumerate(m["forward"]):
                    samples["forward_frozen" if i < k else "forward"][i].append(ms)
                for j, ms in m["backward"].items():
                    samples["backward_first" if j == k else "backward"][j].append(ms)
                samples["after"][k].append(m["after"])
                samples["step"][k].append(m["step"])
    finally:
        for h in handles:
            h.remove()
    cache_read = [None] + [_time_cache_read(act_shape[i], spec, gen) for i in range(1, L)]
    return {
        "names": [b.name for b in blocks],
        "param_bytes": [[p.numel() * p.element_size() for p in b.params] for b in blocks],
        "buffer_bytes": [
            sum(getattr(mod, n).numel() * getattr(mod, n).element_size() for _, mod, n in b.buffers()) for b in blocks
        ],
        "act_bytes": act_bytes,
        "samples": samples,
        "cache_read": cache_read,
        "threads": torch.get_num_threads(),
    }


def _profile_rank(rank: int, spec: ProfileSpec, layout: Sequence[NodeCores], workdir: str) -> None:
    """One profiled process: pinned, its own one-process gloo group, then :func:`_measure`."""
    import torch
    import torch.distributed as dist

    from freeze import comm
    from freeze.testing import write_payload

    try:
        node = layout[rank]
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, node.cores)
        torch.set_num_threads(node.threads)
        torch.set_flush_denormal(True)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/rendezvous-{rank}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=600),
        )
        payload = {"ok": True, "result": _measure(spec)}
    except BaseException:
        payload = {"ok": False, "error": traceback.format_exc()}
    finally:
        comm.end_process_group()  # collects the profiled DDP wrappers first: none alive at destroy
    write_payload(workdir, rank, payload)


# ------------------------------------------------------------------------------------- the parent
def _slowest(per_process: list[list[float]]) -> float | None:
    medians = [median(s) for s in per_process if s]
    return max(medians) if medians else None


def _spread_of_slowest(per_process: list[list[float]]) -> dict[str, float]:
    """The whole step's quartiles and range in ms at one boundary, from the process with the slowest
    median (the one whose medians the profile keeps): what noise_warnings reads."""
    slowest = sorted(max((p for p in per_process if p), key=median))
    q1, q3 = _quantile(slowest, 0.25), _quantile(slowest, 0.75)
    return {"low": slowest[0], "q1": q1, "median": median(slowest), "q3": q3, "high": slowest[-1]}


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linear between neighbours (numpy's default)."""
    at = q * (len(ordered) - 1)
    below = int(at)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (at - below)


def combine(results: list[dict], spec: ProfileSpec, layout: Sequence[NodeCores], meta: dict) -> Profile:
    """A Profile from every process's samples: per quantity, the slowest process's median.

    Args:
        results: what each process measured (``_measure``), in layout order.
        spec: what was profiled.
        layout: each process's cores and threads.
        meta: how it was measured (host, load), stored in the profile.
    """
    first = results[0]
    L = len(first["names"])
    s = [r["samples"] for r in results]
    blocks = []
    for i in range(L):
        frozen = _slowest([p["forward_frozen"][i] for p in s])
        backward = _slowest([p["backward"][i] for p in s])
        reads = [r["cache_read"][i] for r in results if r["cache_read"][i] is not None]
        blocks.append(
            BlockCost(
                name=first["names"][i],
                param_bytes=tuple(first["param_bytes"][i]),
                buffer_bytes=first["buffer_bytes"][i],
                activation_bytes_per_sample=first["act_bytes"][i] or 0,
                forward_ms=_slowest([p["forward"][i] for p in s]),
                forward_frozen_ms=None if i == L - 1 else frozen,
                backward_ms=None if i == 0 else backward,
                backward_first_ms=_slowest([p["backward_first"][i] for p in s]),
                cache_read_ms=max(reads) if reads else None,
            )
        )
    meta = {**meta, "step_ms": [_spread_of_slowest([p["step"][k] for p in s]) for k in range(L)]}
    return Profile(
        model=spec.model_name,
        batch_size=spec.batch_size,
        threads=max(n.threads for n in layout),
        nodes_per_core=nodes_per_core(layout),
        optimizer=spec.optimizer_label(),
        forward_overhead_ms=_slowest([p["overhead"] for p in s]),
        after_backward_ms=tuple(_slowest([p["after"][k] for p in s]) for k in range(L)),
        blocks=tuple(blocks),
        meta=meta,
    )


def profile_model(
    spec: ProfileSpec, layout: Sequence[NodeCores], deadline_s: float = 3600.0, workdir: str | Path | None = None
) -> Profile:
    """Profile ``spec`` with one process per entry of ``layout``, all at once (module docstring).

    Args:
        spec: the model, batch and step counts.
        layout: each process's cores and threads, e.g. one per node of an emulated cluster.
        deadline_s: kill the processes after this long.
        workdir: where rendezvous files and payloads go (a temporary directory if None).
    """
    from freeze.testing import SpawnError, spawn_and_collect

    if not layout:
        raise ValueError("profile_model: layout is empty; give at least one NodeCores")
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="freeze-profile-", dir=workdir) as tmp:
        try:
            payloads = spawn_and_collect(
                _profile_rank, (spec, list(layout), tmp), len(layout), tmp, deadline_s, max(n.threads for n in layout)
            )
        except TimeoutError:
            raise TimeoutError(f"profile: not done within {deadline_s:.0f} s") from None
        except SpawnError as e:
            raise RuntimeError(f"profile: {e}") from None
    for rank, payload in enumerate(payloads):
        if not payload["ok"]:
            raise RuntimeError(f"profile: process {rank} failed:\n{payload['error']}")
    results = [p["result"] for p in payloads]
    meta = {
        "steps": spec.steps,
        "warmup": spec.warmup,
        "cache_keys": spec.cache_keys,
        "input_shape": list(spec.input_shape),
        "layout": [{"cores": list(n.cores), "threads": n.threads} for n in layout],
        "load_avg_1min": [load_before, os.getloadavg()[0]],
        "wall_s": time.perf_counter() - start,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        # which machine measured it: a run prices its freezes only with its own kind of CPU's profile
        "cpu": cpu_name(),
        "host": socket.gethostname(),
    }
    return combine(results, spec, layout, meta)
