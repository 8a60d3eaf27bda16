"""Exact activation caching of the frozen prefix: a frozen prefix then costs neither backward nor forward.

Once blocks 0..k-1 are frozen (and their BatchNorm is in eval), their output for a given input never
changes. The cache stores it per sample KEY at a cut c <= k (the valid cut closest to k) and later
steps run only the tail c.. on the stored activations. Keys identify inputs exactly (a sample and one
of its fixed augmented views), so an entry is never reused for an input it was not computed from.

Life cycle, driven by the Freezer at every boundary change:
- freeze (no cache): BUILD at cut c from the inputs of every key still to be read (sharded over the
  ranks, then exchanged: see freeze.cache.build);
- freeze further (k -> k'): ADVANCE the stored activations through blocks c..c'-1, whose weights
  are now final; never rebuilt from the inputs;
- unfreeze below c: DROP. Nothing stale is ever read: an entry exists only for the cut it was
  computed at, and the cut only moves down by dropping.

What a build costs, per rank, with N samples, V views, W ranks and E epochs left: ceil(K/W) prefix
forwards, where K = the keys still to be read (known in advance from the data order, at most
N * min(V, E)); nothing exchanged within a node (one shared store), (W-1)/W * K rows received per
rank otherwise. Without the cache the same E epochs cost E * N/W prefix forwards, so the cache never
computes more than it saves: with V = 1 the build is the first epoch's prefix forward done ahead of
time, and every later epoch is saved outright (auto: freeze.cache.config.pays).

The cache is not checkpointed. ``state_dict()`` holds its LINEAGE (each build/advance: cut, epoch,
storage dtype), and ``replay()`` repeats it from the restored weights with the same deterministic
chunking, so a resumed run serves the same bits as an uninterrupted one.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import fx, nn

from freeze import comm
from freeze.blocks import Block
from freeze.cache.build import FillPlan, Topology, fill
from freeze.cache.config import CacheConfig, CacheCounters, CacheEstimate, CacheSource, LineageStep, pays
from freeze.cache.graph import CacheError, SplitGraph
from freeze.cache.store import (
    SHM_DIR,
    ActivationStore,
    allocate_memory,
    element_bytes,
    map_file,
    shared_path,
    shm_has_room,
    unlink,
)

# Random or batch-dependent computations: a prefix containing one (in training mode) has no single
# activation per sample, so it cannot be cached exactly.
_STOCHASTIC_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU)
_STOCHASTIC_MODULE_NAMES = {"StochasticDepth", "DropPath"}  # torchvision.ops, timm: random in training
_STOCHASTIC_FUNCTIONS = {
    torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.bernoulli, torch.dropout, torch.nn.functional.dropout, torch.nn.functional.dropout1d,
    torch.nn.functional.dropout2d, torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout,
    torch.nn.functional.feature_alpha_dropout, torch.nn.functional.rrelu,
}  # fmt: skip


class ActivationCache:
    """The cache of one Freezer. Collective calls (build, advance, replay) run on every rank."""

    def __init__(
        self,
        model: nn.Module,
        blocks: list[Block],
        config: CacheConfig,
        source: CacheSource,
        epochs: int | None = None,
        process_group=None,
    ):
        if config.mode == "auto" and not epochs:
            raise CacheError("cache: mode 'auto' needs the run length to weigh cost against saving: pass epochs=N")
        if not isinstance(source, CacheSource) or source.num_keys < 1:
            raise CacheError("cache: cache_source must be a CacheSource with num_keys >= 1")
        self.model, self.blocks, self.config, self.source = model, list(blocks), config, source
        self.epochs, self.process_group = epochs, process_group
        self.graph = SplitGraph(model, self.blocks)
        self.topology = Topology.detect(process_group)
        self.token = _shared_token(process_group)
        self.store: ActivationStore | None = None
        self.lineage: list[LineageStep] = []
        self.counters = CacheCounters()
        self.status = "off"  # one line: why the cache is (not) serving at the current boundary
        self._segments: dict[tuple[int, int | None], fx.GraphModule] = {}
        self._checked: set[tuple[int, int]] = set()

    # ------------------------------------------------------------------ reading
    @property
    def level(self) -> int | None:
        return None if self.store is None else self.store.level

    @property
    def nbytes(self) -> int:
        return 0 if self.store is None else self.store.nbytes

    def bytes_per_key(self, boundary: int) -> int | None:
        """Bytes one key's entry takes when the boundary is ``boundary`` (at the valid cut it would
        use), known before anything is built; None if no cut at or below it can be cached."""
        self._ensure_probed()
        cut = self.graph.best_cut(boundary)
        if cut is None:
            return None
        return self.graph.sample_shape(cut.k)[0].numel() * element_bytes(self.config.storage_dtype)

    def tail(self) -> fx.GraphModule | None:
        """The module that turns cached activations into the model's output (None: no cache)."""
        return None if self.store is None else self.segment(self.store.level, None)

    def prefix(self) -> fx.GraphModule | None:
        return None if self.store is None else self.segment(0, self.store.level)

    def segment(self, start: int, end: int | None) -> fx.GraphModule:
        key = (start, end)
        if key not in self._segments:
            self._segments[key] = self.graph.segment(start, end)
        return self._segments[key]

    def read(self, keys: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """Stored activations of ``keys``, or None if any key has no entry (the caller computes)."""
        out = None if self.store is None else self.store.read(keys, device)
        if self.store is not None:
            if out is None:
                self.counters.miss_keys += keys.numel()
            else:
                self.counters.hit_keys += keys.numel()
        return out

    # ------------------------------------------------------------------ boundary changes
    def check(self, boundary: int, epoch: int) -> None:
        """Raise the CacheError that :meth:`update` would raise, before anything changes."""
        self._plan(boundary, epoch)

    def update(self, boundary: int, epoch: int, epoch_done_fraction: float = 0.0) -> None:
        """Bring the cache to ``boundary`` (collective): drop, keep, advance or build."""
        level, keys, status = self._plan(boundary, epoch)
        if self.store is not None and self.store.level > boundary:
            self.drop(f"boundary moved back to {boundary}, below the cache at {self.store.level}")
        if keys is not None and keys.numel() == 0:
            self.drop("no key is read again")
        self.status = status
        if level is None or keys is None or keys.numel() == 0:
            return
        reads = self._reads_remaining(epoch, epoch_done_fraction)
        decide = self.config.mode == "auto"
        if self._compute(level, keys, epoch, boundary=boundary, reads_remaining=reads, decide=decide):
            self.status = self._serving(boundary)

    def _plan(self, boundary: int, epoch: int) -> tuple[int | None, torch.Tensor | None, str]:
        """(cut to compute, keys to compute, status); (None, None, why) when nothing is to compute."""
        kept = self.store if self.store is not None and self.store.level <= boundary else None
        if boundary < 1:
            return None, None, "no frozen prefix"
        self._ensure_probed()
        cut = self.graph.best_cut(boundary)
        if cut is None:
            return None, None, f"no valid cut at or below boundary {boundary}: {self.graph.cuts[boundary].reason}"
        if kept is not None and kept.level == cut.k:
            return None, None, self._serving(boundary)
        reason = self._nondeterminism(0 if kept is None else kept.level, cut.k)
        if reason:
            return (
                None,
                None,
                f"not caching at {cut.k}: {reason}"
                + (f"; serving the activations before block {kept.level}" if kept is not None else ""),
            )
        keys = self._keys_needed(epoch)
        if kept is not None:
            keys = keys[kept.slot_of[keys] >= 0]  # an advance computes only what it holds
        if keys.numel() == 0:
            return None, keys, "dropped: no key is read again"
        self._store_bytes(cut.k, keys.numel())  # raises over budget
        return cut.k, keys, ""

    def _store_bytes(self, level: int, n_keys: int) -> int:
        """Bytes of a store of ``n_keys`` at ``level``; a memory cache over budget raises."""
        shape, _, _ = self.graph.sample_shape(level)
        row_bytes = shape.numel() * element_bytes(self.config.storage_dtype)
        need = n_keys * row_bytes
        if self.config.mode == "memory" and need > self.config.budget:
            raise CacheError(
                f"cache: a memory cache before block {level} needs {need:,} bytes ({n_keys:,} keys x "
                f"{row_bytes:,} bytes), over the budget of {self.config.budget:,} bytes: raise the budget or use "
                "mode 'disk'"
            )
        return need

    def _placement(self, need: int) -> str:
        """private | shm | disk (collective: every rank must choose the same)."""
        if self.config.mode != "memory" and need > self.config.budget:
            return "disk"
        if not self.config.node_shared or self.topology.local_ranks < 2:
            return "private"
        room = int(shm_has_room(need))
        if comm.is_distributed():  # shared only if every node has room: the protocol is collective
            flag = torch.tensor([room], device=comm.collective_device(self.process_group))
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.process_group)
            room = int(flag.item())
        return "shm" if room else "private"

    def drop(self, why: str) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
            self.counters.drops += 1
        self.lineage = []
        self.status = f"dropped: {why}"

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        return {"storage_dtype": self.config.storage_dtype, "lineage": [asdict(s) for s in self.lineage]}

    def same_lineage(self, state: dict) -> bool:
        return [LineageStep(**s) for s in state.get("lineage", [])] == self.lineage

    def replay(self, state: dict) -> None:
        """Rebuild the cache of a checkpointed run by repeating its lineage (collective)."""
        steps = [LineageStep(**s) for s in state.get("lineage", [])]
        if steps == self.lineage:
            return
        self.drop("replaying the checkpoint's cache lineage")
        self._ensure_probed()
        for step in steps:
            keys = self._keys_needed(step.epoch)
            if self.store is not None:
                keys = keys[self.store.slot_of[keys] >= 0]
            self._compute(step.level, keys, step.epoch)
        self.status = "replayed" if steps else self.status

    # ------------------------------------------------------------------ internals
    def _serving(self, boundary: int) -> str:
        return f"serving the activations before block {self.store.level} (boundary {boundary})"

    def _ensure_probed(self) -> None:
        if not self.graph.probed:
            self.graph.probe(self.source.inputs(torch.arange(min(2, self.source.num_keys))).to(self._device()))

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _keys_needed(self, epoch: int) -> torch.Tensor:
        if self.epochs and epoch >= self.epochs:
            return torch.zeros(0, dtype=torch.int64)  # training is over: nothing is read again
        if self.source.epoch_keys is None or not self.epochs:
            return torch.arange(self.source.num_keys)
        parts = [self.source.epoch_keys(e).to(torch.int64).cpu() for e in range(epoch, self.epochs)]
        return torch.cat(parts).unique() if parts else torch.zeros(0, dtype=torch.int64)

    def _reads_remaining(self, epoch: int, done_fraction: float) -> float:
        if not self.epochs:
            return float("inf")
        per_epoch = [
            (self.source.epoch_keys(e).numel() if self.source.epoch_keys else self.source.num_keys)
            for e in range(epoch, self.epochs)
        ]
        if per_epoch:
            per_epoch[0] *= max(0.0, 1.0 - done_fraction)
        return sum(per_epoch) / self.topology.world_size

    def _nondeterminism(self, start: int, end: int) -> str:
        """Why segment start..end has no single output per input in TRAINING mode, the mode its
        entries are computed in ("" if it has one)."""
        if (start, end) in self._checked:
            return ""
        frozen_bn = {bn for b in self.blocks[:end] for bn in b.running_stat_norms()}  # kept in eval by the Freezer
        seg = self.segment(start, end)
        for node in seg.graph.nodes:
            random_call = node.op == "call_function" and node.target in _STOCHASTIC_FUNCTIONS
            if random_call and node.kwargs.get("training", True) and node.kwargs.get("p", 1.0) != 0.0:
                return f"random operation {getattr(node.target, '__name__', node.target)} in the prefix"
            if node.op != "call_module":
                continue
            for name, mod in seg.get_submodule(node.target).named_modules(prefix=str(node.target)):
                random_module = isinstance(mod, _STOCHASTIC_MODULES) or type(mod).__name__ in _STOCHASTIC_MODULE_NAMES
                if random_module and (getattr(mod, "p", None) or getattr(mod, "drop_prob", None) or 0) > 0:
                    return f"module '{name}' ({type(mod).__name__}) is random in training mode"
                if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod not in frozen_bn:
                    return f"module '{name}' ({type(mod).__name__}) uses batch statistics in training mode"
        self._checked.add((start, end))
        return ""

    def _compute(
        self, level: int, keys: torch.Tensor, epoch: int, *, boundary: int = -1, reads_remaining: float = 0.0,
        decide: bool = False,
    ) -> bool:  # fmt: skip
        """Build (no store) or advance (from the store) to ``level`` for ``keys``; record the lineage.
        False: the ``auto`` rule stopped it (an advance leaves the store where it was)."""
        source_store = self.store
        shape, dtype, fmt = self.graph.sample_shape(level)
        placement = self._placement(self._store_bytes(level, keys.numel()))
        store = self._allocate(level, keys, shape, dtype, fmt, placement)
        plan = FillPlan.make(keys, self.topology.world_size, self.config.chunk_samples)
        device = self._device()
        if source_store is None:
            segment = self.segment(0, level)

            def compute(k):
                return segment(self.source.inputs(k).to(device))
        else:
            segment = self.segment(source_store.level, level)

            def compute(k):
                return segment(source_store.read(k, device))

        def after_first_chunk(partial) -> bool:
            estimate = CacheEstimate(
                boundary=boundary,
                level=level,
                from_level=None if source_store is None else source_store.level,
                keys=keys.numel(),
                store_bytes=store.nbytes,
                forwards_per_rank=plan.forwards_per_rank,
                reads_remaining_per_rank=reads_remaining,
                compute_s_per_row=partial.compute_s / plan.chunk,
                exchange_s=partial.exchange_s * plan.chunks,
            )
            verdict = (self.config.rule or pays)(estimate)
            return bool(comm.broadcast_int_from_rank0(int(verdict), self.process_group))  # ranks must agree

        start = time.perf_counter()
        with _training_mode(self.model):
            result = fill(
                store, plan, compute, self.topology, self.process_group, after_first_chunk if decide else None
            )
        elapsed = time.perf_counter() - start
        self.counters.forwards_total += result.forwards
        self.counters.exchanged_bytes_total += result.exchanged_bytes
        if not result.completed:
            store.close()
            what = "building" if source_store is None else "advancing"
            self.status = f"auto: {what} the cache to block {level} does not pay"
            if source_store is not None:
                self.status += f"; serving the activations before block {source_store.level}"
            return False
        if source_store is None:
            self.counters.builds += 1
            self.counters.build_s_total += elapsed
        else:
            self.counters.advances += 1
            self.counters.advance_s_total += elapsed
            source_store.close()
        self.store = store
        self.lineage.append(LineageStep("build" if source_store is None else "advance", level, epoch))
        return True

    def _allocate(self, level, keys, shape, dtype, fmt, placement: str) -> ActivationStore:
        if placement == "private":
            data = allocate_memory(keys.numel(), shape, self.config.storage_dtype)
        else:
            directory = SHM_DIR if placement == "shm" else self.config.directory
            path = shared_path(directory, self.topology.node_name, self.token, level)
            data = _map_shared(path, keys.numel(), shape, self.config.storage_dtype, self.topology, self.process_group)
        return ActivationStore(
            level, keys, self.source.num_keys, shape, self.config.storage_dtype, dtype, fmt, data, placement
        )


class _training_mode:
    """Compute cache entries in the mode the training forward runs in (frozen BN stays in eval
    through the Freezer's hooks), then restore every module's mode."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.modes = {m: m.training for m in self.model.modules()}
        self.model.train()

    def __exit__(self, *exc):
        for m, training in self.modes.items():
            m.training = training
        return False


def _shared_token(process_group) -> str:
    """One random token for the whole job (rank 0's), naming its disk files."""
    token = [uuid.uuid4().hex[:12]]
    if comm.is_distributed():
        dist.broadcast_object_list(
            token, src=dist.get_global_rank(process_group, 0) if process_group else 0, group=process_group
        )
    return token[0]


def _map_shared(path: Path, rows: int, shape, storage_dtype: str, topo: Topology, process_group) -> torch.Tensor:
    """The node leader creates the file, every rank of the node maps it, then the leader unlinks it."""
    data = map_file(path, rows, shape, storage_dtype, create=True) if topo.is_node_leader else None
    if topo.world_size > 1:
        dist.barrier(group=process_group)
    if data is None:
        data = map_file(path, rows, shape, storage_dtype, create=False)
    if topo.world_size > 1:
        dist.barrier(group=process_group)
    if topo.is_node_leader:
        unlink(path)
    return data
