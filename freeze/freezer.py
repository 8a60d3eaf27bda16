"""The Freezer: applies a freeze boundary to a model, under DistributedDataParallel or without it.

Boundary ``k`` freezes blocks ``0 .. k-1``. Applying a boundary follows rules measured on 2 gloo
ranks (each one checked by tests/test_freezer_ddp.py):

1. the boundary changes only between optimizer steps, and rank 0's decision is broadcast;
2. frozen parameters get ``requires_grad=False`` and ``grad=None`` (a zero gradient would still let
   momentum / weight decay move them) and their optimizer state is dropped;
3. norm layers with running statistics in frozen blocks (BatchNorm, InstanceNorm with
   ``track_running_stats``) stay in eval mode, also across ``model.train()`` calls; newly frozen
   buffers are broadcast from rank 0 once and kept out of DDP's per-forward buffer broadcast;
4. the frozen prefix runs under ``no_grad`` (a frozen module whose input requires grad passes the
   gradient through), and the blocks must run in list order (checked on the first forward after
   each boundary change);
5. DDP is rebuilt with ``init_sync=False`` and the byte-counting comm hook re-registered.

Without an initialised process group the same object drives a plain model in one process.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from freeze import comm, steering
from freeze.blocks import Block, frozen_names
from freeze.cache import ActivationCache, CacheConfig, CacheError, CacheSource
from freeze.dispatch import STALE_WRAPPER_FIX, FreezerModule, retire
from freeze.monitor import GradNormMonitor, IntervalStats
from freeze.policies import Policy, Progress, make_policy


@dataclass
class FreezerCounters:
    steps: int = 0  # optimizer steps seen by after_backward, skipped ones included
    skipped_steps: int = 0  # of those, steps the optimizer skipped (fp16 overflow)
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


class Freezer:
    """Owns the boundary, the gradient-norm monitor, the policy and the current DDP wrapper.

    Build it after the model is on its device and the process group (if any) is initialised, in
    place of wrapping the model in DDP; then call ``freezer.module`` for the forward pass.
    ``freezer.model`` is the bare model (torchvision's ``model_without_ddp``).

    Args:
        model: the model to train (not wrapped in DDP).
        blocks: its ordered freezable blocks, ``split_blocks(model)``; boundary k freezes 0..k-1.
        policy: what moves the boundary (``make_policy(...)``); ``None`` never freezes.
        optimizer: the optimizer over the model's parameters: the state of parameters that freeze
            is dropped, and :meth:`training_state_dict` saves it.
        epochs: planned epochs; required by run-length policies (freezeout, linear).
        steps_per_epoch: optimizer steps per epoch; required by run-length policies evaluated
            every ``interval_steps`` steps.
        interval_steps: evaluate the policy every N optimizer steps (in :meth:`after_step`)
            instead of once per epoch (0, in :meth:`end_epoch`).
        ddp_kwargs: passed to every DDP wrapper (``init_sync`` is always False).
        comm_hook: "allreduce", or "bf16" to send gradients as bfloat16 (half the bytes).
        process_group: the DDP process group (default: the world).
        track_summed_grads: also sum gradients over intervals when the policy does not read them
            (costs a pass over every trainable gradient per step); default: only if it does.
        grad_checkpointing: recompute the activations of trainable blocks in backward.
    """

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
        model_params = {id(p) for p in model.parameters()}
        for block in blocks:
            stray = [n for n, p in zip(block.param_names, block.params) if id(p) not in model_params]
            if stray:
                raise ValueError(
                    f"Freezer: block '{block.name}' holds '{stray[0]}', which is not a parameter of this model; "
                    "build the blocks with split_blocks(model) of the model you pass"
                )
        self.model = model
        self.blocks = list(blocks)
        self.policy = policy if policy is not None else make_policy("none")
        if self.policy.needs_run_length and not epochs:
            raise ValueError(f"Freezer: policy '{self.policy.name}' needs the run length: pass epochs=N")
        if self.policy.needs_run_length and interval_steps and not steps_per_epoch:
            # Between epoch ends only steps say how far training is; an epoch count would put the
            # whole running epoch in the past or in the future.
            raise ValueError(
                f"Freezer: policy '{self.policy.name}' evaluated every interval_steps={interval_steps} steps "
                "needs the run length in steps: pass steps_per_epoch=N"
            )
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
        self._steering = steering.Steering(model, self.blocks, grad_checkpointing)
        # A loop that forgets after_backward leaves the policy without gradients and the byte
        # counters at 0, silently unless end_epoch compares the steps with the training forwards.
        self._steps_at_epoch_start = 0
        self._ddp: nn.Module | None = None
        self._closed = False
        self.module = FreezerModule(self)
        self._epochs_completed = 0
        self._total_param_bytes = sum(b.param_bytes for b in self.blocks)
        self.boundary = 0
        self._epoch_start_step = 0
        if self.distributed:
            # What DDP's constructor would do: start every replica from rank 0's weights and buffers.
            comm.broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), process_group)
        self.cache = self._make_cache(cache, cache_source)
        self._apply(self._clamp(self.policy.initial_boundary(len(self.blocks))), first=True)

    # ------------------------------------------------------------------ the user-facing loop API
    # self.module (set in __init__): the module to call for the forward pass, see FreezerModule.
    @property
    def ddp(self) -> nn.Module:
        raise AttributeError(f"Freezer.ddp was removed: it went stale at every re-wrap; {STALE_WRAPPER_FIX}")

    def _forward(self, *args, sample_ids: torch.Tensor | None = None, **kwargs):
        """The one place a forward pass goes through (``freezer.module(...)`` calls it): the
        current DDP wrapper, or the model itself without a process group; while the activation
        cache serves, the tail on the cached activations of ``sample_ids`` (see :meth:`forward`)."""
        if self._closed:
            raise RuntimeError("Freezer: closed (its DDP wrapper is released); build a new Freezer to train again")
        if self.cache_active:
            return self._cached_forward(args[0] if args else kwargs.get("x"), sample_ids)
        target = self._ddp if self._ddp is not None else self.model
        return target(*args, **kwargs)

    def close(self) -> None:
        """Release the DDP wrapper; call it after training, before
        ``torch.distributed.destroy_process_group()``.

        A live wrapper holds the process group, and then destroying the group leaves gloo's worker
        and transport threads running into interpreter shutdown (observed: 3 gloo threads still
        alive when the README example's interpreter began finalizing), where a thread that needs
        the interpreter aborts the process ("terminate called without an active exception").
        ``freezer.module`` refuses to run afterwards; the model is left as it is."""
        if self._ddp is not None:
            retire(self._ddp)
            self._ddp = None
        self._closed = True

    def train(self, mode: bool = True) -> Freezer:
        """``model.train(mode)`` that keeps frozen norm layers with running statistics in eval.

        Args:
            mode: True for training mode, False for evaluation mode.
        """
        self.model.train(mode)
        tail = self.cache.tail() if self.cache is not None else None
        if tail is not None:
            tail.train(mode)  # its own containers; the modules it shares with the model agree already
        for b in self.blocks[: self.boundary]:
            for norm in b.running_stat_norms():
                norm.eval()
        return self

    def eval(self) -> Freezer:
        """``model.eval()``."""
        self.model.eval()
        return self

    def after_backward(self, skipped: bool = False) -> None:
        """Call once per optimizer step, after the last backward (and after GradScaler.unscale_),
        before gradient clipping and before optimizer.step(): reads the synchronized gradients,
        counts the step and the bytes it all-reduced.

        Args:
            skipped: the optimizer will not take this step (GradScaler found inf/NaN gradients).
                The step still counts (the step clock, ``interval_steps`` and the bytes per step
                stay in step with the loop); its gradients are not read.
        """
        if skipped:
            self.monitor.skip_step()
            self.counters.skipped_steps += 1
        else:
            self.monitor.observe()
        self.counters.steps += 1
        self.counters.allreduce_bytes_total = self._comm.allreduce_bytes_total
        self.counters.allreduce_bytes_last_step = self._comm.allreduce_bytes_total - self._bytes_at_last_step
        self._bytes_at_last_step = self._comm.allreduce_bytes_total

    def after_step(self) -> bool:
        """Call after ``optimizer.step()`` when evaluating every ``interval_steps`` steps: the
        policy decides once ``interval_steps`` steps have passed since its last decision.

        Returns:
            whether the boundary changed.
        """
        if self.interval_steps and self.monitor.interval_steps >= self.interval_steps:
            return self._evaluate(epoch=self._epochs_completed)  # the running epoch
        return False

    def end_epoch(self, epoch: int) -> bool:
        """Call after the last optimizer step of an epoch. Per-epoch policies decide here.

        Args:
            epoch: the 0-based epoch that just ended.

        Returns:
            whether the boundary changed.
        """
        self._epochs_completed = epoch + 1
        self._epoch_start_step = self.monitor.total_steps
        self._warn_if_after_backward_was_forgotten(epoch)
        if self.interval_steps:
            return False
        return self._evaluate(epoch)

    def _warn_if_after_backward_was_forgotten(self, epoch: int) -> None:
        forwards = self._steering.take_train_forwards()
        if forwards and self.counters.steps == self._steps_at_epoch_start:
            warnings.warn(
                f"Freezer: epoch {epoch} ran {forwards} training forward passes but "
                "after_backward() was never called, so the policy saw no gradients and no bytes were "
                "counted; call freezer.after_backward() after loss.backward(), once per optimizer step",
                RuntimeWarning,
                stacklevel=3,
            )
        self._steps_at_epoch_start = self.counters.steps

    def set_boundary(self, k: int) -> None:
        """Freeze blocks 0..k-1 now (between optimizer steps), bypassing the policy.

        Args:
            k: the new boundary, 0 .. len(blocks) - 1 (the head stays trainable); rank 0's value
                is used on every rank.
        """
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
        """Names of the frozen blocks."""
        return [b.name for b in self.blocks[: self.boundary]]

    @property
    def frozen_param_fraction(self) -> float:
        """Share of the model's parameter bytes that is frozen."""
        frozen = sum(b.param_bytes for b in self.blocks[: self.boundary])
        return frozen / self._total_param_bytes if self._total_param_bytes else 0.0

    @property
    def trainable_grad_bytes(self) -> int:
        """Gradient bytes a step must all-reduce at the current boundary (uncompressed)."""
        return sum(b.param_bytes for b in self.blocks[self.boundary :])

    @property
    def history(self) -> list[IntervalStats]:
        """The monitor's closed intervals, oldest first."""
        return self.monitor.history

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Boundary, monitor statistics, policy, decisions and counters: plain containers, numbers,
        strings and tensors only, so ``torch.load(..., weights_only=True)`` reads it back."""
        return {
            "boundary": self.boundary,
            "epochs_completed": self._epochs_completed,
            "block_names": [b.name for b in self.blocks],
            "policy_spec": self.policy.spec(),
            "policy": self.policy.state_dict(),
            "monitor": self.monitor.state_dict(),
            "decisions": [asdict(d) for d in self.decisions],
            "counters": asdict(self.counters),
            "cache": None if self.cache is None else self.cache.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`: after the model's state, before the optimizer's (see
        :meth:`load_training_state_dict`, which does all three in that order).

        Args:
            state: what :meth:`state_dict` returned, for the same blocks and policy.
        """
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
        self._epochs_completed = int(state["epochs_completed"])
        self._steps_at_epoch_start = self.counters.steps
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

    def training_state_dict(self) -> dict:
        """What a checkpoint needs from the model, the Freezer and the optimizer, as
        ``{"model", "freezer", "optimizer"}`` (no "optimizer" without one). Add your own entries
        (scheduler, epoch) and ``torch.save`` it; it loads with ``weights_only=True``."""
        state = {"model": self.model.state_dict(), "freezer": self.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_training_state_dict(self, state: dict) -> None:
        """Restore a :meth:`training_state_dict` on every rank, in the one order that is right:
        the model first (re-applying the saved boundary broadcasts frozen buffers from the loaded
        model), then the Freezer, then the optimizer (last, so that re-applying the boundary, which
        drops the state of newly frozen parameters, cannot touch the restored optimizer state).

        Args:
            state: a dict with "model" and "freezer" entries, and "optimizer" when this Freezer
                has one (e.g. ``torch.load(path, weights_only=True)``).
        """
        saved, here = "optimizer" in state, self.optimizer is not None
        if saved != here:
            raise ValueError(
                f"Freezer.load_training_state_dict: the state {'has' if saved else 'lacks'} an 'optimizer' entry "
                f"and this Freezer {'has no' if saved else 'has an'} optimizer; build it as the saving run did"
            )
        self.model.load_state_dict(state["model"])
        self.load_state_dict(state["freezer"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    # ------------------------------------------------------------------ internals
    def _clamp(self, k: int) -> int:
        return max(0, min(int(k), len(self.blocks) - 1))

    def _progress(self) -> Progress:
        steps_total = self.epochs * self.steps_per_epoch if (self.epochs and self.steps_per_epoch) else 0
        return Progress(
            epochs_completed=self._epochs_completed,
            epochs_total=self.epochs or max(self._epochs_completed, 1),
            steps_completed=self.monitor.total_steps,
            steps_total=steps_total,
        )

    def _evaluate(self, epoch: int) -> bool:
        """``epoch``: the 0-based epoch the closing interval is recorded under."""
        stats = self.monitor.close_interval(epoch, self.boundary)
        proposed = self.policy.decide(self.boundary, self.monitor.history, self._progress(), len(self.blocks))
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
        """Make ``k`` the boundary: requires_grad and grads, optimizer state, frozen buffers,
        hooks, norm-layer modes, the monitor's active blocks, the activation cache and the DDP wrapper.

        Args:
            k: the boundary to apply (already clamped and agreed on by every rank).
            first: the constructor's call: every block below ``k`` counts as newly frozen, and no
                buffer broadcast is needed (the constructor has just broadcast every tensor).
            count_rewrap: count the DDP construction in ``counters.rewraps``; False when
                restoring a checkpoint, so a resumed run's counters match the run that wrote it.
            update_cache: build, advance or drop the activation cache for ``k``; False when a
                checkpoint's cache lineage is replayed instead.
        """
        if update_cache and self.cache is not None:
            self.cache.check(k, self._epochs_completed)  # a cache that cannot be built refuses before anything changes
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
        self._steering.apply(k)
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
        if self._ddp is not None:
            retire(self._ddp)  # a script that kept it gets a clear error, not DDP's misleading one
        self._ddp = None  # each live wrapper holds its own gradient buckets: drop the old one first
        ignored = frozen_names(self.blocks, self.boundary)
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
        """The training forward, the same as ``freezer.module(x, sample_ids=...)``.

        Args:
            x: the batch's inputs; while the activation cache serves it is read only for a batch
                with a key the cache does not hold (then it may be None).
            sample_ids: the keys of the batch's inputs, as the cache source numbers them; needed
                while the cache serves, ignored otherwise.
        """
        if x is None and not self.cache_active:
            raise ValueError("Freezer.forward: x is required while no activation cache serves")
        return self._forward(x, sample_ids=sample_ids)

    def _cached_forward(self, x: torch.Tensor | None, sample_ids: torch.Tensor | None) -> torch.Tensor:
        """Only the tail runs, on the stored activations of ``sample_ids``."""
        if sample_ids is None:
            raise CacheError(
                "Freezer: the activation cache is serving; pass sample_ids= (the keys of the batch's inputs) "
                "to freezer.module(x, sample_ids=...)"
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
        self.cache.update(self.boundary, self._epochs_completed, done)

    def _replay_cache(self, state: dict) -> None:
        self.cache.replay(state)
        self.train(self.model.training)
        self._rewrap(count=False)

    def _wrapped_module(self) -> nn.Module:
        tail = self.cache.tail() if self.cache is not None else None
        return tail if tail is not None else self.model
