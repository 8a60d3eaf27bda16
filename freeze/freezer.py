"""The Freezer: applies a freeze boundary to a model, under DistributedDataParallel or without it.

Boundary ``k`` freezes blocks ``0 .. k-1``. Applying a boundary follows the rules measured in
ddp-freezing.md:

1. the boundary changes only between optimizer steps, and rank 0's decision is broadcast;
2. frozen parameters get ``requires_grad=False`` and ``grad=None`` (a zero gradient would still let
   momentum / weight decay move them) and their optimizer state is dropped;
3. BatchNorm in frozen blocks stays in eval mode, also across ``model.train()`` calls; newly frozen
   BN buffers are broadcast from rank 0 once and kept out of DDP's per-forward buffer broadcast;
4. the frozen prefix runs under ``no_grad``;
5. DDP is rebuilt with ``init_sync=False`` and the byte-counting comm hook re-registered.

Without an initialised process group the same object drives a plain model in one process.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from freeze import checkpointing, comm
from freeze.blocks import Block
from freeze.cache import ActivationCache, CacheConfig, CacheError, CacheSource
from freeze.monitor import GradNormMonitor, IntervalStats
from freeze.policies import Policy, Progress, make_policy


@dataclass
class FreezerCounters:
    steps: int = 0  # optimizer steps seen by after_backward
    allreduce_bytes_total: int = 0  # per rank, since construction
    allreduce_bytes_last_step: int = 0
    rewraps: int = 0  # DDP constructions after the first
    rewrap_s_total: float = 0.0
    rewrap_s_last: float = 0.0


@dataclass(frozen=True)
class Decision:
    interval: int
    epoch: int
    step: int
    boundary_before: int
    boundary_after: int


@dataclass
class _Hooks:
    handles: list = field(default_factory=list)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _no_grad_pre(module, args):
    module._freeze_grad_was_enabled = torch.is_grad_enabled()
    torch.set_grad_enabled(False)


def _no_grad_post(module, args, output):
    torch.set_grad_enabled(getattr(module, "_freeze_grad_was_enabled", True))


def _keep_eval_pre(module, args):
    # A user's model.train() would switch frozen BN back to batch statistics and running-stat
    # updates; re-asserting eval right before the forward makes that impossible.
    module.training = False


class Freezer:
    """Owns the boundary, the gradient-norm monitor, the policy and the current DDP wrapper."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[Block],
        policy: Policy | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        interval_steps: int = 0,
        ddp_kwargs: dict | None = None,
        comm_hook: comm.CommHook = "allreduce",
        process_group=None,
        track_summed_grads: bool | None = None,
        grad_checkpointing: bool = False,
        cache: CacheConfig | str | None = None,
        cache_source: CacheSource | None = None,
    ):
        if not blocks:
            raise ValueError("Freezer: blocks is empty; build them with split_blocks(model)")
        if interval_steps < 0:
            raise ValueError(f"Freezer: interval_steps must be >= 0 (0 = once per epoch), got {interval_steps}")
        self.model = model
        self.blocks = list(blocks)
        self.policy = policy if policy is not None else make_policy("none")
        if self.policy.needs_run_length and not epochs:
            raise ValueError(f"Freezer: policy '{self.policy.name}' needs the run length: pass epochs=N")
        self.optimizer = optimizer
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        self.interval_steps = interval_steps
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.comm_hook = comm_hook
        self.process_group = process_group
        self.grad_checkpointing = grad_checkpointing
        self.distributed = comm.is_distributed()
        # Summing gradients over an interval reads and writes every trainable gradient each step
        # (measured: ~2.6% of a 2-rank ResNet-18 CPU step), so by default only policies that read
        # the sums pay for it; True records them anyway (eta heatmaps for every policy).
        if track_summed_grads is None:
            track_summed_grads = self.policy.uses_gradients
        self.monitor = GradNormMonitor(self.blocks, track_summed=track_summed_grads or self.policy.uses_gradients)
        self.counters = FreezerCounters()
        self.decisions: list[Decision] = []
        self._comm = comm.CommCounter(process_group=process_group)
        self._bytes_at_last_step = 0
        self._hooks = _Hooks()
        self._ddp: nn.Module | None = None
        self._epoch = 0
        self._total_param_bytes = sum(b.param_bytes for b in self.blocks)
        self.boundary = 0
        self._epoch_start_step = 0
        if self.distributed:
            # What DDP's constructor would do: start every replica from rank 0's weights and buffers.
            comm.broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), process_group)
        self.cache = self._make_cache(cache, cache_source)
        self._apply(self._clamp(self.policy.initial_boundary(len(self.blocks))), first=True)

    # ------------------------------------------------------------------ the user-facing loop API
    @property
    def ddp(self) -> nn.Module:
        """The module to call for the forward pass: the current DDP wrapper, or the model itself.
        While the activation cache serves, the wrapper holds the tail only: call :meth:`forward`."""
        return self._ddp if self._ddp is not None else self.model

    def train(self, mode: bool = True) -> Freezer:
        """``model.train(mode)`` that keeps frozen BatchNorm in eval."""
        self.model.train(mode)
        tail = self.cache.tail() if self.cache is not None else None
        if tail is not None:
            tail.train(mode)  # its own containers; the modules it shares with the model agree already
        for b in self.blocks[: self.boundary]:
            for bn in b.batchnorms():
                bn.eval()
        return self

    def eval(self) -> Freezer:
        self.model.eval()
        return self

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer whose state for frozen parameters is dropped; also drops it now."""
        self.optimizer = optimizer
        self._drop_optimizer_state(range(self.boundary))

    def after_backward(self) -> None:
        """Call once per optimizer step, after the last backward (and after GradScaler.unscale_),
        before or after optimizer.step(): reads the synchronized gradients, counts traffic."""
        self.monitor.observe()
        self.counters.steps += 1
        self.counters.allreduce_bytes_total = self._comm.allreduce_bytes_total
        self.counters.allreduce_bytes_last_step = self._comm.allreduce_bytes_total - self._bytes_at_last_step
        self._bytes_at_last_step = self._comm.allreduce_bytes_total

    def after_step(self) -> bool:
        """Call after optimizer.step() when evaluating every ``interval_steps`` steps.
        Returns whether the boundary changed."""
        if self.interval_steps and self.monitor.interval_steps >= self.interval_steps:
            return self._evaluate(self._epoch)
        return False

    def end_epoch(self, epoch: int) -> bool:
        """Call after the last optimizer step of ``epoch`` (0-based). Per-epoch policies decide here.
        Returns whether the boundary changed."""
        self._epoch = epoch + 1
        self._epoch_start_step = self.monitor.total_steps
        if self.interval_steps:
            return False
        return self._evaluate(epoch)

    def set_boundary(self, k: int) -> None:
        """Freeze blocks 0..k-1 now (between optimizer steps), bypassing the policy."""
        k = comm.broadcast_int_from_rank0(int(k), self.process_group)
        if not 0 <= k <= len(self.blocks) - 1:
            raise ValueError(
                f"set_boundary: k={k} is out of range; accepted: 0..{len(self.blocks) - 1} (the head stays trainable)"
            )
        if k != self.boundary:
            self._apply(k)

    # ------------------------------------------------------------------ read-outs
    @property
    def frozen_blocks(self) -> list[str]:
        return [b.name for b in self.blocks[: self.boundary]]

    @property
    def frozen_param_fraction(self) -> float:
        frozen = sum(b.param_bytes for b in self.blocks[: self.boundary])
        return frozen / self._total_param_bytes if self._total_param_bytes else 0.0

    @property
    def trainable_grad_bytes(self) -> int:
        """Gradient bytes a step must all-reduce at the current boundary (uncompressed)."""
        return sum(b.param_bytes for b in self.blocks[self.boundary :])

    @property
    def history(self) -> list[IntervalStats]:
        return self.monitor.history

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {
            "boundary": self.boundary,
            "epoch": self._epoch,
            "block_names": [b.name for b in self.blocks],
            "policy_spec": self.policy.spec(),
            "policy": self.policy.state_dict(),
            "monitor": self.monitor.state_dict(),
            "decisions": [asdict(d) for d in self.decisions],
            "counters": asdict(self.counters),
            "cache": None if self.cache is None else self.cache.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore after the model's own state was loaded (frozen BN buffers are re-synced from it)."""
        names = [b.name for b in self.blocks]
        if state["block_names"] != names:
            raise ValueError(
                f"Freezer.load_state_dict: checkpoint blocks {state['block_names']} differ from this model's {names}"
            )
        if state["policy_spec"] != self.policy.spec():
            raise ValueError(
                f"Freezer.load_state_dict: checkpoint policy '{state['policy_spec']}' differs from '{self.policy.spec()}'"
            )
        self.policy.load_state_dict(state["policy"])
        self.monitor.load_state_dict(state["monitor"])
        self.decisions = [Decision(**d) for d in state["decisions"]]
        self.counters = FreezerCounters(**state["counters"])
        self._comm.allreduce_bytes_total = self.counters.allreduce_bytes_total
        self._bytes_at_last_step = self.counters.allreduce_bytes_total
        self._epoch = int(state["epoch"])
        self._epoch_start_step = self.monitor.total_steps
        k = int(state["boundary"])
        if self.cache is not None and state.get("cache") is not None:
            if not self.cache.same_lineage(state["cache"]):
                self.cache.drop("resuming from a checkpoint")  # built from the weights before loading
            if k != self.boundary:
                self._apply(k, count_rewrap=False, update_cache=False)
            self._replay_cache(state["cache"])
        elif k != self.boundary:
            self._apply(k, count_rewrap=False)

    # ------------------------------------------------------------------ internals
    def _clamp(self, k: int) -> int:
        return max(0, min(int(k), len(self.blocks) - 1))

    def _progress(self, epoch: int) -> Progress:
        steps_total = self.epochs * self.steps_per_epoch if (self.epochs and self.steps_per_epoch) else 0
        return Progress(
            epoch=epoch,
            epochs_total=self.epochs or max(epoch + 1, 1),
            step=self.monitor.total_steps,
            steps_total=steps_total,
        )

    def _evaluate(self, epoch: int) -> bool:
        stats = self.monitor.close_interval(epoch, self.boundary)
        proposed = self.policy.decide(self.boundary, self.monitor.history, self._progress(epoch), len(self.blocks))
        # Statistics come from all-reduced gradients, so ranks agree already; the broadcast makes
        # a disagreement (e.g. a non-deterministic reduction order) impossible rather than unlikely.
        k = self._clamp(comm.broadcast_int_from_rank0(int(proposed), self.process_group))
        if k == self.boundary:
            return False
        self.decisions.append(Decision(stats.index, epoch, self.monitor.total_steps, self.boundary, k))
        self._apply(k)
        return True

    def _drop_optimizer_state(self, block_indices) -> None:
        if self.optimizer is None:
            return
        for i in block_indices:
            for p in self.blocks[i].params:
                self.optimizer.state.pop(p, None)

    def _apply(self, k: int, first: bool = False, count_rewrap: bool = True, update_cache: bool = True) -> None:
        if update_cache and self.cache is not None:
            self.cache.check(k, self._epoch)  # a cache that cannot be built refuses before anything changes
        old = self.boundary
        newly_frozen = range(0, k) if first else range(old, max(old, k))
        for i, block in enumerate(self.blocks):
            frozen = i < k
            for p in block.params:
                p.requires_grad_(not frozen)
                if frozen:
                    p.grad = None
        if self.ddp_kwargs.get("gradient_as_bucket_view"):
            # Gradients may be views into the old wrapper's buckets, which are about to go away.
            for p in self.model.parameters():
                p.grad = None
        self._drop_optimizer_state(newly_frozen)
        if not first:  # the constructor has just broadcast every tensor
            # Each rank updated its running statistics with its own data: without this one
            # broadcast, newly frozen BN buffers would stay different across ranks forever.
            frozen_buffers = [getattr(mod, name) for i in newly_frozen for _, mod, name in self.blocks[i].buffers()]
            comm.broadcast_from_rank0(frozen_buffers, self.process_group)
        self.boundary = k
        self._install_hooks()
        self.monitor.set_first_active(k)
        if update_cache:
            self._update_cache()
        self.train(self.model.training)
        self._rewrap(count=not first and count_rewrap)

    def _rewrap(self, count: bool) -> None:
        """(Re)build DDP over what the forward runs: the model, or the cache's tail (same trainable
        parameters, so the same bytes per step)."""
        if not self.distributed:
            return
        start = time.perf_counter()
        self._ddp = None  # each live wrapper holds its own gradient buckets: drop the old one first
        ignored = [n for b in self.blocks[: self.boundary] for n in b.param_names]
        ignored += [n for b in self.blocks[: self.boundary] for n, _, _ in b.buffers()]
        self._ddp = comm.build_ddp(self._wrapped_module(), ignored, self._comm, self.comm_hook, self.ddp_kwargs)
        elapsed_s = time.perf_counter() - start
        if count:
            self.counters.rewraps += 1
            self.counters.rewrap_s_total += elapsed_s
            self.counters.rewrap_s_last = elapsed_s

    # ------------------------------------------------------------------ activation cache
    @property
    def cache_active(self) -> bool:
        """Whether the forward currently runs the tail on cached activations."""
        return self.cache is not None and self.cache.store is not None

    def forward(self, x: torch.Tensor | None = None, sample_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The training forward. While the activation cache serves, ``sample_ids`` (the keys of the
        batch's inputs, as the cache source numbers them) select stored activations and only the
        tail runs; ``x`` is then read only for a batch with a key the cache does not hold."""
        if not self.cache_active:
            if x is None:
                raise ValueError("Freezer.forward: x is required while no activation cache serves")
            return self.ddp(x)
        if sample_ids is None:
            raise CacheError(
                "Freezer.forward: the activation cache is serving; pass sample_ids= (the keys of the batch's inputs)"
            )
        device = next(self.model.parameters()).device
        activations = self.cache.read(torch.as_tensor(sample_ids), device)
        if activations is None:  # exact fallback: the same prefix the cache would have stored
            inputs = x if x is not None else self.cache.source.inputs(torch.as_tensor(sample_ids)).to(device)
            with torch.no_grad():
                activations = self.cache.prefix()(inputs)
        return (self._ddp if self._ddp is not None else self.cache.tail())(activations)

    def _make_cache(self, cache: CacheConfig | str | None, source: CacheSource | None) -> ActivationCache | None:
        config = CacheConfig(mode=cache) if isinstance(cache, str) else (cache or CacheConfig())
        if config.mode == "off":
            return None
        if source is None:
            raise CacheError(
                f"Freezer: cache mode '{config.mode}' needs cache_source=CacheSource(inputs=..., num_keys=...)"
            )
        return ActivationCache(self.model, self.blocks, config, source, self.epochs, self.process_group)

    def _update_cache(self) -> None:
        if self.cache is None:
            return
        done = (
            (self.monitor.total_steps - self._epoch_start_step) / self.steps_per_epoch if self.steps_per_epoch else 0.0
        )
        self.cache.update(self.boundary, self._epoch, done)

    def _replay_cache(self, state: dict) -> None:
        self.cache.replay(state)
        self.train(self.model.training)
        self._rewrap(count=False)

    def _wrapped_module(self) -> nn.Module:
        tail = self.cache.tail() if self.cache is not None else None
        return tail if tail is not None else self.model

    def _install_hooks(self) -> None:
        self._hooks.remove()
        for i, block in enumerate(self.blocks):
            frozen = i < self.boundary
            for mod in block.modules:
                if frozen:
                    checkpointing.disable_checkpointing(mod)
                    self._hooks.handles.append(mod.register_forward_pre_hook(_no_grad_pre))
                    self._hooks.handles.append(mod.register_forward_hook(_no_grad_post, always_call=True))
                elif self.grad_checkpointing:
                    checkpointing.enable_checkpointing(mod)
                else:
                    checkpointing.disable_checkpointing(mod)
            if frozen:
                for bn in block.batchnorms():
                    self._hooks.handles.append(bn.register_forward_pre_hook(_keep_eval_pre))
