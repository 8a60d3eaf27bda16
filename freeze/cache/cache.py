"""Exact activation caching of the frozen prefix: a frozen prefix then costs neither backward nor forward.

Once blocks 0..k-1 are frozen (and run as frozen blocks do: in eval by default), their output for a
given input never changes. The cache stores it per sample KEY at a cut c <= k (the exact cut closest
to k, see freeze.cache.cuts) and later training steps run the model with blocks 0..c-1 skipped and
the stored rows fed to block c. Keys identify inputs exactly (a sample and one of its fixed
augmented views), so an entry is never reused for an input it was not computed from.

Life cycle, driven by the Freezer at every boundary change (:meth:`ActivationCache.plan`, then
:meth:`commit`), carried out at the next training forward (:meth:`before_training_forward`, on
every rank), so that entries are computed from the weights and under the autocast that the training
forward itself uses - weights loaded after the Freezer was built included:
- freeze (no cache): BUILD at cut c from the inputs of every key still to be read (sharded over the
  ranks, then exchanged: see freeze.cache.build);
- freeze further (k -> k'): ADVANCE the stored activations through blocks c..c'-1, whose weights
  are now final; never rebuilt from scratch;
- unfreeze below c: DROP. Nothing stale is ever read: an entry exists only for the cut it was
  computed at, the cut only moves down by dropping, and frozen weights that change anyway (a load
  in the middle of a run) are found by a fingerprint at the next decision, which rebuilds.

What a build costs, per rank, with N samples, V views, W ranks and E epochs left: ceil(K/W) prefix
forwards, where K = the keys still to be read (known in advance from the data order, at most
N * min(V, E)); nothing exchanged within a node (one shared store), (W-1)/W * K rows received per
rank otherwise. Without the cache the same E epochs cost E * N/W prefix forwards, so with V = 1 the
build is the first epoch's prefix forward done ahead of time, and every later epoch is saved
outright (auto: freeze.cache.config.pays). A policy that may unfreeze counts reads only until the
end of the current epoch: the next unfreeze may drop the store.

The cache is not checkpointed. ``state_dict()`` holds its LINEAGE (each build/advance: cut, epoch)
and storage dtype, and a resumed run repeats the lineage from the restored weights with the same
deterministic chunking, so it serves the same bits as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from freeze import comm
from freeze.blocks import Block
from freeze.cache.build import FillPlan, Topology, fill
from freeze.cache.config import (
    CacheConfig,
    CacheCounters,
    CacheEstimate,
    CacheSource,
    LineageStep,
    check_source,
    pays,
)
from freeze.cache.cuts import CacheError, Cuts, probing, to_device
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
from freeze.fingerprint import fingerprint, module_state

# A GPU store is used when it takes at most this share of the device's free memory: the rest is
# the training step's.
DEVICE_STORE_SHARE = 0.1
# Statuses under which the cache will not serve at the current boundary (ActivationCache.state).
_REFUSALS = ("no exact cut", "auto:")
_UNCHECKED = object()  # no training forward's inputs compared yet


@dataclass(frozen=True)
class CachePlan:
    """What bringing the cache to a boundary does, decided (on every rank alike) before anything changes."""

    boundary: int
    epoch: int
    level: int | None  # the cut to compute; None: nothing to compute
    keys: torch.Tensor | None  # the keys to compute
    keep: bool  # whether the current store stays (and, if level is set, is advanced from)
    placement: str  # private | device | shm | disk
    reads_remaining: float  # per rank, until the store may be dropped
    status: str


class ActivationCache:
    """The cache of one Freezer. Collective calls (plan, check_weights, before_training_forward)
    run on every rank.

    Args:
        model: the bare model.
        blocks: its blocks.
        config: the cache's settings.
        source: keys -> inputs, and the keys each epoch reads.
        epochs: planned epochs (``auto`` needs them).
        process_group: the group the Freezer trains with.
        frozen_mode: how frozen blocks run ("eval" or "train", see freeze.cache.cuts).
        read_horizon_epochs: count reads for this many epochs at most (1 for a policy that may
            unfreeze: the next unfreeze may drop the store); None: until the end of training.
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: list[Block],
        config: CacheConfig,
        source: CacheSource,
        epochs: int | None = None,
        process_group=None,
        *,
        frozen_mode: str = "eval",
        read_horizon_epochs: int | None = None,
    ):
        if config.mode == "auto" and not epochs:
            raise CacheError("cache: mode 'auto' needs the run length to weigh cost against saving: pass epochs=N")
        if not isinstance(source, CacheSource) or source.num_keys < 1:
            raise CacheError("cache: cache_source must be a CacheSource with num_keys >= 1")
        self.model, self.blocks, self.config, self.source = model, list(blocks), config, source
        self.epochs, self.process_group, self.read_horizon_epochs = epochs, process_group, read_horizon_epochs
        check_source(source, model)
        self.cuts = Cuts(model, self.blocks, self._inputs, source.num_keys, frozen_mode)  # probes the model now
        self._never = self._refuse_unservable_model()
        self.topology = Topology.detect(process_group)
        self.token = _shared_token(process_group)
        self.store: ActivationStore | None = None
        # The store whose inputs were last compared with the source's (None: the first training
        # step's, before any store); _UNCHECKED until then.
        self._inputs_checked: object = _UNCHECKED
        self.lineage: list[LineageStep] = []
        self.counters = CacheCounters()
        self.status = "no frozen prefix yet"  # one line: why the cache is (not) serving at the current boundary
        self._pending: CachePlan | None = None  # built at the next training forward
        self._replay: list[LineageStep] | None = None  # a checkpoint's lineage, repeated at the next training forward
        self._fingerprint: torch.Tensor | None = None  # of the prefix weights the store was computed from
        self._autocast: tuple | None = None  # the training forward's autocast when the store was computed

    # ------------------------------------------------------------------ reading
    @property
    def level(self) -> int | None:
        return None if self.store is None else self.store.level

    @property
    def nbytes(self) -> int:
        return 0 if self.store is None else self.store.nbytes

    @property
    def state(self) -> str:
        """active (serving stored activations), waiting (nothing to serve yet, or a build pending
        for the next training step) or refused (no exact cut at the boundary, or ``auto`` found it
        does not pay)."""
        if self.store is not None:
            return "active"
        if self._pending is not None or self._replay is not None:
            return "waiting"
        return "refused" if self.status.startswith(_REFUSALS) else "waiting"

    def describe(self) -> str:
        """One line for ``freezer.explain()``: the state and why."""
        return f"cache ({self.config.mode}): {self.state}: {self.status}"

    def read(self, keys: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """Stored activations of ``keys``, or None if any key has no entry (the caller computes)."""
        out = None if self.store is None else self.store.read(keys, device)
        if self.store is not None:
            if out is None:
                self.counters.miss_keys += keys.numel()
            else:
                self.counters.hit_keys += keys.numel()
        return out

    @contextlib.contextmanager
    def serving(self, rows: torch.Tensor) -> Iterator[None]:
        """A forward of the model inside it runs from the stored rows ``rows`` (see Cuts.serving)."""
        with self.cuts.serving(self.store.level, rows):
            yield

    def compute_prefix(self, inputs: Any, level: int) -> torch.Tensor:
        """What the store holds at ``level`` for ``inputs``, computed afresh from the current weights."""
        with probing(self.model):
            return self.cuts.capture(to_device(inputs, self._device()), level)

    # ------------------------------------------------------------------ boundary changes
    def plan(self, boundary: int, epoch: int, done_fraction: float = 0.0) -> CachePlan:
        """What :meth:`commit` will do for ``boundary`` (collective; raises the CacheError of a
        memory cache over its budget before anything changes)."""
        kept = self.store if self.store is not None and self.store.level <= boundary else None
        serving = "" if kept is None else f"; serving the activations before block {kept.level}"

        def nothing(status: str, keep: bool = kept is not None) -> CachePlan:
            return CachePlan(boundary, epoch, None, None, keep, "", 0.0, status)

        if boundary < 1:
            return nothing(self._never or "no frozen prefix", keep=False)
        cut, why = self.cuts.best(boundary)
        cut = _from_rank0(-1 if cut is None else cut, self.process_group)  # ranks follow one verdict
        if cut < 0:
            return nothing(f"no exact cut at or below boundary {boundary}: {why}{serving}")
        self.cuts.why_not(cut)  # a rank whose own verdict differed still needs the cut's sizes
        if kept is not None and kept.level == cut:
            return nothing(self._serving(boundary))
        keys = self._keys_needed(epoch)
        if kept is not None:
            keys = keys[kept.slot_of[keys] >= 0]  # an advance computes only what it holds
        if keys.numel() == 0:
            return nothing("dropped: no key is read again", keep=False)
        placement = self._placement(cut, keys.numel(), kept)
        return CachePlan(boundary, epoch, cut, keys, kept is not None, placement, self._reads(epoch, done_fraction), "")

    def commit(self, plan: CachePlan) -> None:
        """Drop or keep the store as ``plan`` says; its build or advance runs at the next training forward."""
        if not plan.keep and self.store is not None:
            below = plan.boundary < self.store.level
            self.drop(
                f"boundary moved back to {plan.boundary}, below the cache at {self.store.level}"
                if below
                else plan.status.removeprefix("dropped: ")
            )
        self.status = plan.status or (
            f"building the cache before block {plan.level} at the next training step"
            if self.store is None
            else f"advancing the cache to block {plan.level} at the next training step"
        )
        self._pending = plan if plan.level is not None else None

    def before_training_forward(self) -> None:
        """Carry out what is pending (a checkpoint's lineage, the last plan): every rank's training
        forward calls it, inside the forward's autocast, so entries are what that forward computes."""
        if self._replay is not None:
            steps, self._replay = self._replay, None
            self._repeat(steps)
        if self._pending is not None:
            plan, self._pending = self._pending, None
            self._execute(plan, decide=self.config.mode == "auto")
        elif self.store is not None and _autocast_state(self._device()) != self._autocast:
            raise CacheError(
                f"cache: the training forward's autocast changed from {self._autocast} to "
                f"{_autocast_state(self._device())} after the cache was built; keep one precision for the whole run"
            )

    def check_weights(self, boundary: int, epoch: int) -> bool:
        """Whether the frozen weights the store was computed from changed (collective); if so the
        store is dropped and rebuilt at the next training forward. True: it was stale."""
        stale = self.store is not None and not torch.equal(
            self._prefix_fingerprint(self.store.level), self._fingerprint
        )
        if not comm.any_rank(stale, self.process_group):
            return False
        warnings.warn(
            "Freezer: the frozen weights changed after the activation cache was built (weights loaded into a "
            "running Freezer?); the cache is rebuilt from the current weights. Load weights before building the "
            "Freezer, or restore runs with freezer.load_training_state_dict()",
            RuntimeWarning,
            stacklevel=3,
        )
        self.drop("the frozen weights changed")
        self.commit(self.plan(boundary, epoch))
        return True

    def drop(self, why: str) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
            self.counters.drops += 1
        self.lineage = []
        self._fingerprint = None
        self.status = f"dropped: {why}"

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        return {
            "storage_dtype": self.config.storage_dtype,
            "lineage": [asdict(s) for s in self.lineage],
            "counters": asdict(self.counters),
            "status": self.status,
        }

    def load_state_dict(self, state: dict) -> None:
        """Take a checkpoint's cache: its lineage is repeated from the restored weights at the next
        training forward (whatever this process built before is dropped), its counters and status
        continue."""
        saved = state.get("storage_dtype", self.config.storage_dtype)
        if saved != self.config.storage_dtype:
            raise CacheError(
                f"cache: the checkpoint's cache stored {saved}, this Freezer's stores {self.config.storage_dtype}; "
                f"resume with storage_dtype='{saved}' (other bits would be served)"
            )
        steps = [LineageStep(**s) for s in state.get("lineage", [])]
        self.drop("resuming from a checkpoint")
        self._pending = None
        self._replay = steps or None
        if "counters" in state:
            self.counters = CacheCounters(**state["counters"])
        self.status = state.get("status", self.status)

    # ------------------------------------------------------------------ internals
    def check_inputs(self, keys: torch.Tensor, given: Any) -> None:
        """At the first training forward given keys, and again at the first one of each store: the
        inputs the training forward got for ``keys`` must be ``source.inputs(keys)``, from which the
        store's rows are computed, or every served row would be the activation of another input.
        Random augmentation outside the source, or keys that are not the source's numbering, show
        at the run's first step (not at the first freeze, which may come late in the run), and again
        for each store: one batch of the source's inputs and one comparison (a host sync) then,
        none per step.

        Args:
            keys: the batch's sample_ids.
            given: the forward's ``(args, kwargs)``. Both calls are bound to the model's forward
                signature and the source's tensors compared with the call's of the same name
                (arguments the source does not supply, such as a batch's labels, and non-tensor
                arguments such as flags, are not compared).
        """
        if self._inputs_checked is self.store:
            return
        self._inputs_checked = self.store
        if keys.numel() and (int(keys.min()) < 0 or int(keys.max()) >= self.source.num_keys):
            raise CacheError(
                f"Freezer: sample_ids holds keys outside 0..{self.source.num_keys - 1}; pass the keys the cache "
                "source numbers the inputs by"
            )
        expected = _tensor_arguments(self.model, self._inputs(keys.cpu()))
        actual = _tensor_arguments(self.model, given)
        same = (
            expected is None
            or actual is None
            or all(
                name in actual and torch.equal(t.to(actual[name].device), actual[name]) for name, t in expected.items()
            )
        )
        if not same:
            raise CacheError(
                "Freezer: the training forward's inputs for these sample_ids are not cache_source.inputs(sample_ids), "
                "from which the cache computed its rows, so it would serve activations of other inputs; augment "
                "inside cache_source.inputs (fixed views), pass the source's own keys, or turn the cache off"
            )

    def _inputs(self, keys: torch.Tensor) -> Any:
        return to_device(self.source.inputs(keys), self._device())

    def _refuse_unservable_model(self) -> str:
        """At construction: whether any boundary at all can be served exactly (the probe of every
        cut from the top down, which the first freeze would otherwise run). If none can, the cache
        will never build: said once now, not discovered after the run. Returns the status then
        ("" if some cut is exact); the verdicts are kept for the boundary changes."""
        if len(self.blocks) < 2:  # nothing can freeze: the status says "no frozen prefix"
            return ""
        cut, _ = self.cuts.best(len(self.blocks) - 1)
        if cut is not None:
            return ""
        why = self.cuts.why_not(1)  # the shortest prefix's reason: the cause every longer one shares
        warnings.warn(
            f"Freezer: the activation cache can serve no boundary of this model exactly ({why}), so it will never "
            "build; train with cache=None",
            RuntimeWarning,
            stacklevel=5,  # Freezer(...) -> make_cache -> ActivationCache -> here
        )
        return f"no exact cut at any boundary: {why}"

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _serving(self, boundary: int) -> str:
        return f"serving the activations before block {self.store.level} (boundary {boundary})"

    def _prefix_fingerprint(self, level: int) -> torch.Tensor:
        return fingerprint(module_state(m for b in self.blocks[:level] for m in b.modules))

    def _horizon(self, epoch: int) -> int:
        end = self.epochs or epoch + 1
        return min(end, epoch + self.read_horizon_epochs) if self.read_horizon_epochs else end

    def _keys_needed(self, epoch: int) -> torch.Tensor:
        if self.epochs and epoch >= self.epochs:
            return torch.zeros(0, dtype=torch.int64)  # training is over: nothing is read again
        if self.source.epoch_keys is None or not self.epochs:
            return torch.arange(self.source.num_keys)
        parts = [self.source.epoch_keys(e).to(torch.int64).cpu() for e in range(epoch, self._horizon(epoch))]
        return torch.cat(parts).unique() if parts else torch.zeros(0, dtype=torch.int64)

    def _reads(self, epoch: int, done_fraction: float) -> float:
        """Reads this rank will make of the store until it may be dropped."""
        if not self.epochs:
            return float("inf")
        per_epoch = [
            (self.source.epoch_keys(e).numel() if self.source.epoch_keys else self.source.num_keys)
            for e in range(epoch, self._horizon(epoch))
        ]
        if per_epoch:
            per_epoch[0] *= max(0.0, 1.0 - done_fraction)
        return sum(per_epoch) / self.topology.world_size

    def _placement(self, level: int, n_keys: int, source: ActivationStore | None) -> str:
        """private | device | shm | disk, the same on every rank (collective), within the budget of
        one NODE: a private store counts once per local rank, a shared one once, and an advance
        holds its source store until it is done."""
        shape = self.cuts.sample_meta[level][0]
        need = n_keys * shape.numel() * element_bytes(self.config.storage_dtype)
        local = self.topology.local_ranks
        held = 0 if source is None else source.nbytes * (1 if source.shared else local) * (source.placement != "disk")
        distributed = self.topology.world_size > 1
        shm = distributed and self.config.node_shared and shm_has_room(need)
        over = lambda shared: need * (1 if shared else local) + held > self.config.budget  # noqa: E731
        if distributed:  # one vote per rank: shared only if every node has room, disk if any node lacks it
            shm = not comm.any_rank(not shm, self.process_group)
            too_big = comm.any_rank(over(shm), self.process_group)
        else:
            too_big = over(False)
        if too_big:
            if self.config.mode == "memory":
                copies = "one copy per node" if shm else f"{local} copies, one per local rank"
                raise CacheError(
                    f"cache: a memory cache before block {level} needs {need:,} bytes per copy ({n_keys:,} keys, "
                    f"{copies}{', plus the store it advances from' if held else ''}), over the per-node budget of "
                    f"{self.config.budget:,} bytes: raise budget_bytes or use mode 'disk'"
                )
            return "disk"
        if shm:
            return "shm"
        device = self._device()
        if device.type == "cuda" and need <= DEVICE_STORE_SHARE * torch.cuda.mem_get_info(device)[0]:
            return "device"  # rank-local either way: ranks may differ here without changing any collective
        return "private"

    def _repeat(self, steps: list[LineageStep]) -> None:
        """A checkpoint's builds and advances, from the current weights (not counted again)."""
        status = self.status
        for step in steps:
            if self.cuts.why_not(step.level):
                raise CacheError(
                    f"cache: the checkpoint's cache served block {step.level}, which this model cannot serve exactly "
                    f"({self.cuts.why_not(step.level)})"
                )
            keys = self._keys_needed(step.epoch)
            if self.store is not None:
                keys = keys[self.store.slot_of[keys] >= 0]
            placement = self._placement(step.level, keys.numel(), self.store)
            plan = CachePlan(step.level, step.epoch, step.level, keys, self.store is not None, placement, 0.0, "")
            self._execute(plan, count=False)
        self.status = status

    def _execute(self, plan: CachePlan, *, decide: bool = False, count: bool = True) -> bool:
        """Build (no store) or advance (from the store) to ``plan.level``; record the lineage.
        False: the ``auto`` rule stopped it (an advance leaves the store where it was)."""
        level, keys = plan.level, plan.keys
        source = self.store if self.store is not None and self.store.level < level else None
        device = self._device()
        store = self._allocate(level, keys, plan.placement)
        fill_plan = FillPlan.make(keys, self.topology.world_size, self.config.chunk_samples)
        if source is None:

            def compute(k):
                return self.cuts.capture(self._inputs(k), level)
        else:

            def compute(k):
                return self.cuts.capture(self._inputs(k), level, served=(source.level, source.read(k, device)))

        def after_first_chunk(partial) -> bool:
            estimate = CacheEstimate(
                boundary=plan.boundary,
                level=level,
                from_level=None if source is None else source.level,
                keys=keys.numel(),
                store_bytes=store.nbytes,
                forwards_per_rank=fill_plan.forwards_per_rank,
                reads_remaining_per_rank=plan.reads_remaining,
                compute_s_per_row=partial.compute_s / fill_plan.chunk,
                exchange_s=partial.exchange_s * fill_plan.chunks,
                saved_s_per_read=partial.compute_s / fill_plan.chunk,  # see pays()
            )
            verdict = (self.config.rule or pays)(estimate)
            return bool(_from_rank0(int(verdict), self.process_group))  # ranks must agree

        start = time.perf_counter()
        with probing(self.model):  # training mode, and the run's random state untouched
            result = fill(
                store, fill_plan, compute, self.topology, self.process_group, after_first_chunk if decide else None
            )
        elapsed = time.perf_counter() - start
        if count:
            self.counters.forwards_total += result.forwards
            self.counters.exchanged_bytes_total += result.exchanged_bytes
        if not result.completed:
            store.close()
            what = "building" if source is None else "advancing"
            self.status = f"auto: {what} the cache to block {level} does not pay"
            if source is not None:
                self.status += f"; serving the activations before block {source.level}"
            return False
        if count and source is None:
            self.counters.builds += 1
            self.counters.build_s_total += elapsed
        elif count:
            self.counters.advances += 1
            self.counters.advance_s_total += elapsed
        if source is not None:
            source.close()
        self.store = store
        self.lineage.append(LineageStep("build" if source is None else "advance", level, plan.epoch))
        self._fingerprint = self._prefix_fingerprint(level)
        self._autocast = _autocast_state(device)
        self.status = self._serving(plan.boundary)
        return True

    def _allocate(self, level: int, keys: torch.Tensor, placement: str) -> ActivationStore:
        shape, _, fmt = self.cuts.sample_meta[level]
        if placement in ("private", "device"):
            data = allocate_memory(keys.numel(), shape, self.config.storage_dtype)
            if placement == "device":
                data = data.to(self._device())
        else:
            directory = SHM_DIR if placement == "shm" else self.config.directory
            path = shared_path(directory, self.topology.node_name, self.token, level)
            data = _map_shared(path, keys.numel(), shape, self.config.storage_dtype, self.topology, self.process_group)
        # The compute dtype is the one the first chunk comes out in (autocast decides it): fill sets it.
        return ActivationStore(
            level, keys, self.source.num_keys, shape, self.config.storage_dtype, None, fmt, data, placement
        )


def make_cache(
    model: nn.Module,
    blocks: list[Block],
    cache: CacheConfig | str | None,
    source: CacheSource | None,
    epochs: int | None,
    process_group,
    frozen_mode: str,
    may_unfreeze: bool,
) -> ActivationCache | None:
    """A Freezer's cache from its ``cache=`` argument (a CacheConfig or a mode; None: off)."""
    config = CacheConfig(mode=cache) if isinstance(cache, str) else (cache or CacheConfig())
    if config.mode == "off":
        return None
    if source is None:
        raise CacheError(
            f"Freezer: cache mode '{config.mode}' needs cache_source=CacheSource(inputs=..., num_keys=...)"
        )
    # An unfreezing policy's next step may drop the store: count on reads until the end of this epoch only.
    horizon = 1 if may_unfreeze else None
    return ActivationCache(
        model, blocks, config, source, epochs, process_group, frozen_mode=frozen_mode, read_horizon_epochs=horizon
    )


def _autocast_state(device: torch.device) -> tuple | None:
    kind = device.type
    return (kind, torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else None


def _from_rank0(value: int, process_group) -> int:
    return comm.broadcast_int_from_rank0(value, process_group)


def _shared_token(process_group) -> str:
    """One random token for the whole job (rank 0's), naming its disk files."""
    return comm.broadcast_object_from_rank0(uuid.uuid4().hex[:12], process_group)


def _map_shared(path: Path, rows: int, shape, storage_dtype: str, topo: Topology, process_group) -> torch.Tensor:
    """The node leader creates the file, every rank of the node maps it, then the leader unlinks it."""
    data = map_file(path, rows, shape, storage_dtype, create=True) if topo.is_node_leader else None
    if topo.world_size > 1:
        comm.barrier(process_group)
    if data is None:
        data = map_file(path, rows, shape, storage_dtype, create=False)
    if topo.world_size > 1:
        comm.barrier(process_group)
    if topo.is_node_leader:
        unlink(path)
    return data


def _tensor_arguments(model: nn.Module, call: Any) -> dict[str, Any] | None:
    """The tensor leaves of a forward call, by argument name (``model.forward``'s signature):
    ``call`` is ``(args, kwargs)`` or a CacheSource's inputs (dict: kwargs, tuple/list: args, else
    one argument). None when the call does not bind (then nothing can be compared)."""
    if isinstance(call, tuple) and len(call) == 2 and isinstance(call[1], dict) and isinstance(call[0], tuple):
        args, kwargs = call
    elif isinstance(call, dict):
        args, kwargs = (), call
    elif isinstance(call, (tuple, list)):
        args, kwargs = tuple(call), {}
    else:
        args, kwargs = (call,), {}
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    out = {}
    for name, value in bound.items():
        # By key path, not position: a **kwargs argument's order is the call's, not the source's.
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            if isinstance(leaf, torch.Tensor):
                out[name + pytree.keystr(path)] = leaf
    return out
