"""The Freezer: applies a freeze boundary to a model, under DistributedDataParallel or without it.

Boundary ``k`` freezes blocks ``0 .. k-1``. Applying a boundary follows rules measured on 2 gloo
ranks (each one checked by tests/test_freezer_ddp.py):

1. the boundary changes only between optimizer steps, and rank 0's decision is broadcast;
2. frozen parameters get ``requires_grad=False`` and ``grad=None`` (a zero gradient would still let
   momentum / weight decay move them) and their optimizer state is dropped; parameters the user
   froze before building the Freezer stay frozen at every boundary;
3. frozen blocks run like inference (freeze.freezer.steering), and their newly frozen buffers are broadcast
   from rank 0 once and kept out of DDP's per-forward buffer broadcast;
4. DDP is rebuilt with ``init_sync=False`` and the byte-counting comm hook (freeze.freezer.engine).

The Freezer owns the boundary, the policy, the monitor, the hooks on the model and the state; the
forward path (DDP wrapper, activation cache, the forward) is its :class:`freeze.freezer.engine.Engine`.
Without an initialised process group the same object drives a plain model in one process.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from freeze import comm
from freeze.blocks import Block, check_partition
from freeze.cache import ActivationCache, CacheConfig, CacheSource, make_cache
from freeze.checks import as_int
from freeze.freezer import steering
from freeze.freezer.block_lr import BlockLR
from freeze.freezer.clock import RunClock
from freeze.freezer.dispatch import FreezerModule
from freeze.freezer.engine import Engine
from freeze.freezer.optimizer_state import check_saved_optimizer, check_steps_model, drop_state, unwrap_optimizer
from freeze.freezer.records import (
    Decision,
    Evaluation,
    FreezerCounters,
    check_saved_freezer,
    check_saved_model,
    check_saved_monitor,
    check_saved_training_state,
    saved_records,
)
from freeze.monitor import GradNormMonitor, IntervalStats
from freeze.names import CommHook, split_policy_spec
from freeze.policies import Policy, Pricing, make_policy
from freeze.policies.base import DecisionContext, Needs
from freeze.signals import check_signals

_log = logging.getLogger("freeze")


class Freezer:
    """Owns the boundary, the gradient-norm monitor, the policy and the hooks on the model; its
    :attr:`engine` owns the DDP wrapper and the activation cache.

    Build it LAST: after the weights are loaded, the model is on its device and the process group
    (if any) is initialised, in place of wrapping the model in DDP; pass the bare model. Then call
    ``freezer.module`` for every forward pass, training and evaluation. ``freezer.model`` is the
    bare model (torchvision's ``model_without_ddp``).

    Args:
        model: the model to train (not wrapped in DDP).
        blocks: its ordered freezable blocks, ``split_blocks(model)``; boundary k freezes 0..k-1.
        policy: what moves the boundary (``make_policy(...)``); ``None`` never freezes.
        optimizer: its state of parameters that freeze is dropped; :meth:`training_state_dict` saves it.
        epochs: planned epochs; required by run-length policies (freezeout, linear).
        steps_per_epoch: optimizer steps per epoch; required by run-length policies evaluated
            every ``interval_steps`` steps.
        interval_steps: evaluate the policy every N optimizer steps (in :meth:`after_step`)
            instead of once per epoch (0, in :meth:`end_epoch`).
        ddp_kwargs: passed to every DDP wrapper (``init_sync`` is always False).
        comm_hook: "allreduce"; "bf16" to send gradients as bfloat16 (half the bytes); "powersgd1"
            or "powersgd4": PowerSGD of rank 1 or 4 after 17 iterations of plain all-reduce, its
            error feedback kept per parameter across re-wraps and saved in :meth:`state_dict`.
        process_group: the DDP process group (default: the world).
        track_summed_grads: also record the gradient statistics (each step's per-block norms and
            the interval's summed gradient, a pass over every trainable gradient per step) when the
            policy reads none; default: only what the policy reads (``policy.needs()``).
        grad_checkpointing: recompute the activations of trainable blocks in backward.
        frozen_mode: "eval" (default): frozen blocks run like inference, dropout off; "train":
            dropout stays on (norm layers with running statistics stay in eval either way).
        cache: the activation cache (a CacheConfig or a mode: off, memory, disk, auto).
        cache_source: keys -> the model's inputs, and the keys each epoch reads (the cache's data).
        pricing: what each boundary's step costs and the run's LR per step, for a policy that prices
            its freezes (``horizon``; freeze.policies.Pricing; the pipeline makes it from the cost model).
        probe: a function of no arguments returning the loss on a fixed held-out subset, the same on
            every rank (all-reduce it), for a policy with a held-out check (``horizon`` on probation).
            It runs between steps at the evaluations the policy asks for, on every rank, with the
            model in eval mode and gradients off (the Freezer restores the training mode after it).
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
        comm_hook: CommHook = "allreduce",
        process_group=None,
        track_summed_grads: bool = False,
        grad_checkpointing: bool = False,
        frozen_mode: str = "eval",
        cache: CacheConfig | str | None = None,
        cache_source: CacheSource | None = None,
        pricing: Pricing | None = None,
        probe: Callable[[], float] | None = None,
    ):
        _refuse_wrapped(model)
        comm.check_comm_hook(comm_hook)  # before any hook goes onto the model
        comm.check_launch("Freezer", process_group)
        if not blocks:
            raise ValueError("Freezer: blocks is empty; build them with split_blocks(model)")
        check_partition(model, blocks)
        self.model = model
        self.blocks = list(blocks)
        self.policy = policy if policy is not None else make_policy("none")
        # The one question the Freezer asks the policy about itself: everything below reads the answer.
        self.needs = self.policy.needs()
        self.clock = RunClock(epochs, steps_per_epoch, interval_steps)
        self.clock.check_needs(self.needs, self.policy.spec())
        self.pricing, self.probe = _checked_policy_inputs(
            self.needs, self.policy.spec(), self.clock, len(blocks), pricing, probe
        )
        self.optimizer = optimizer
        self._block_lr = (
            BlockLR(self.policy, self.blocks, self.clock, lambda: self.counters.steps) if self.needs.block_lr else None
        )
        if optimizer is not None:
            self._attach_block_lr(optimizer)
        self.frozen_mode = frozen_mode
        self.process_group = process_group
        # Summing gradients over an interval reads and writes every trainable gradient each step
        # (measured: ~2.6% of a 2-rank ResNet-18 CPU step), so by default only policies that read
        # the sums pay for it; True records them anyway (eta heatmaps for every policy).
        self.monitor = GradNormMonitor(
            self.blocks,
            # a policy that reads only the descent has the monitor sum just the intervals it reads
            track_summed=track_summed_grads or self.needs.gradient_sums,
            track_descent=self.needs.descent_span > 0,
            descent_span=self.needs.descent_span or 1,
            # a policy that reads no gradient statistic gets none: the step only counts (issue 49:
            # the norms were most of the engine's host time over the static limit)
            track_step_norms=self.needs.gradient_norms,
            signals=[signal() for signal in self.needs.signals],
        )
        self.counters = FreezerCounters()
        # What close() checks (steering.warn_if_no_epoch_ended): steps taken and epochs ended in this
        # Freezer's life, a resume's restored counters aside.
        self._epochs_ended = 0
        self._steps_at_start = 0
        self.decisions: list[Decision] = []
        self.evaluations: deque[Evaluation] = deque(maxlen=64)  # the last policy evaluations, changed or not
        self._steering = steering.Steering(model, self.blocks, grad_checkpointing, frozen_mode)
        self.boundary = 0
        if comm.is_distributed():
            # What DDP's constructor would do: start every replica from rank 0's weights and buffers.
            comm.broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), process_group)
        activation_cache = make_cache(
            model,
            self.blocks,
            cache=cache,
            source=cache_source,
            epochs=epochs,
            process_group=process_group,
            frozen_mode=frozen_mode,
            may_unfreeze=self.needs.may_unfreeze,
        )
        ddp = {"comm_hook": comm_hook, "ddp_kwargs": ddp_kwargs, "process_group": process_group}
        self.engine = Engine(model, self.blocks, activation_cache, **ddp)
        self.counters.attach(self.engine.comm)  # the byte total's one owner
        self.module = FreezerModule(model, self.engine, train=self.train)
        self._apply(self._clamp(self.policy.initial_boundary(len(self.blocks))), first=True)

    # ------------------------------------------------------------------ the user-facing loop API
    @property
    def cache(self) -> ActivationCache | None:
        """The activation cache (None when off)."""
        return self.engine.cache

    @property
    def cache_active(self) -> bool:
        """Whether the cache holds activations it can serve at the current boundary."""
        return self.cache is not None and self.cache.store is not None

    def close(self) -> None:
        """Release the DDP wrapper (see Engine.close) and take the Freezer's hooks off the model;
        call it after training, before ``torch.distributed.destroy_process_group()``. The model's
        weights and requires_grad flags are left as they are."""
        self.engine.close()
        self._steering.remove()
        if self._block_lr is not None:
            self._block_lr.detach()
        steering.warn_if_no_epoch_ended(self.counters.steps - self._steps_at_start, self._epochs_ended, self.boundary)

    def train(self, mode: bool = True) -> Freezer:
        """``model.train(mode)`` that keeps frozen blocks in eval (all their modules, or with
        ``frozen_mode="train"`` their norm layers with running statistics).

        Args:
            mode: True for training mode, False for evaluation mode.
        """
        self._steering.train(mode)
        return self

    def eval(self) -> Freezer:
        """``model.eval()``."""
        return self.train(False)

    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (collective: call it on every rank), e.g. before an
        evaluation: trainable BatchNorm statistics drift apart between DDP's forwards."""
        comm.broadcast_from_rank0(list(self.model.buffers()), self.process_group)

    def after_backward(self, skipped: bool = False, *, grad_scale: float | torch.Tensor | None = None) -> None:
        """Call once per optimizer step, after the last backward, before ``zero_grad()``: reads the
        synchronized gradients, counts the step and the bytes it all-reduced. Supported positions:
        after ``GradScaler.unscale_`` and before clipping (the exact statistic); before unscaling
        with ``grad_scale=`` the loss scale; or after ``optimizer.step()`` (``GradScaler.step``
        unscales in place when ``unscale_`` was not called). Clipped gradients bias the policy's
        signal (the clip factor changes from step to step).

        A step whose gradients are not finite (fp16 overflow: GradScaler skips it) is detected on
        the device without a host sync: its gradients are not read, and it is counted in the
        interval's ``IntervalStats.skipped_steps`` when the interval closes (not in
        ``counters.skipped_steps``, which counts the steps declared with ``skipped=True``).

        Args:
            skipped: the optimizer will not take this step (GradScaler found inf/NaN gradients).
                The step still counts (the step clock, ``interval_steps`` and the bytes per step
                stay in step with the loop); its gradients are not read. Optional: overflow is
                detected anyway.
            grad_scale: the loss scale the gradients are still multiplied by (a float, or the
                scaler's scale tensor, which keeps the call off the host); None: unscaled. A
                float that is not finite and > 0 is refused here; such a tensor masks its step
                and is refused when the interval closes (end_epoch / after_step), read once there.

        Raises:
            RuntimeError: under a process group, no training forward ran through ``freezer.module``
                since the last call (the loss came from the bare model: nothing was all-reduced).
        """
        self.engine.check_synced_forward()
        if self._block_lr is not None:
            if self.optimizer is None:
                raise RuntimeError(
                    f"Freezer: policy '{self.policy.spec()}' sets each block's learning rate through the optimizer: "
                    "pass optimizer= to the Freezer or call attach_optimizer(optimizer) before training"
                )
            self._block_lr.note_backward()
        if skipped:
            self.monitor.skip_step()
        else:
            self.monitor.observe(grad_scale=grad_scale)
        self.counters.count_step(skipped)

    def attach_optimizer(self, optimizer) -> None:
        """Give the Freezer the optimizer after construction (trainers build it after the model is
        wrapped). A trainer's wrapper is unwrapped to the torch optimizer it drives (accelerate's
        ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``); the state of parameters
        frozen at the current boundary is dropped, as when they froze.

        Args:
            optimizer: a ``torch.optim.Optimizer`` over the model's parameters, or a trainer's
                wrapper around one.
        """
        inner = unwrap_optimizer(optimizer)
        check_steps_model(inner, self.model)
        self.optimizer = inner
        self._attach_block_lr(inner)
        drop_state(inner, (p for b in self.blocks[: self.boundary] for p in b.params))

    def block_lr_scales(self) -> list[float]:
        """The factor on each block's learning rate at the next optimizer step (1.0 everywhere
        unless the policy anneals blocks before freezing them)."""
        if self._block_lr is None:
            return [1.0] * len(self.blocks)
        return self._block_lr.scales_now()

    def _attach_block_lr(self, optimizer: torch.optim.Optimizer) -> None:
        if self._block_lr is not None:
            self._block_lr.attach(unwrap_optimizer(optimizer))

    def after_step(self) -> bool:
        """Call after ``optimizer.step()`` when evaluating every ``interval_steps`` steps: the
        policy decides once ``interval_steps`` steps have passed since its last decision.

        Returns:
            whether the boundary changed.
        """
        if self.clock.interval_steps and self.monitor.interval_steps >= self.clock.interval_steps:
            return self._evaluate(epoch=self.clock.epochs_completed)  # the running epoch
        return False

    def end_epoch(self, epoch: int) -> bool:
        """Call once per epoch, after its last optimizer step. Per-epoch policies decide here.

        Args:
            epoch: the 0-based epoch that just ended (after a resume: the first epoch the run had
                not completed).

        Returns:
            whether the boundary changed.
        """
        # Checked before the clock moves: 0.0 or a float tensor used to advance it, then fail.
        epoch = as_int(epoch, "Freezer.end_epoch: epoch")
        self.monitor.refuse_bad_grad_scales()  # a bad scale tensor, read once per interval
        steps_taken = self.clock.end_epoch(epoch, self.counters.steps)
        self._epochs_ended += 1
        self._steering.warn_if_no_steps(epoch, steps_taken)
        if self.cache is not None:
            self.cache.check_weights(self.boundary, self.clock.epochs_completed)
        if self.clock.interval_steps:
            return False
        return self._evaluate(epoch)

    def set_boundary(self, k: int) -> None:
        """Freeze blocks 0..k-1 now (between optimizer steps), bypassing the policy.

        Args:
            k: the new boundary, 0 .. len(blocks) - 1 (the head stays trainable); rank 0's value
                is used on every rank.
        """
        # int(1.5) would be 1 and int(True) 1: only integer-like values, as Python ints.
        k = comm.broadcast_int_from_rank0(as_int(k, "Freezer.set_boundary: k"), self.process_group)
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
        total = sum(b.param_bytes for b in self.blocks)
        return sum(b.param_bytes for b in self.blocks[: self.boundary]) / total if total else 0.0

    @property
    def trainable_grad_bytes(self) -> int:
        """Gradient bytes a step must all-reduce at the current boundary (uncompressed)."""
        return self._steering.trainable_grad_bytes(self.boundary)

    @property
    def history(self) -> list[IntervalStats]:
        """The monitor's closed intervals (the most recent ones), oldest first."""
        return self.monitor.history

    def explain(self) -> str:
        """Why the policy did (not) freeze: per evaluation, the signal it read and the boundary it
        chose; then, with a cache, one line with its state (active / waiting / refused) and why."""
        if not self.evaluations:
            lines = [f"{self.policy.spec()}: no evaluation yet (boundary {self.boundary})"]
        else:
            lines = [f"{self.policy.spec()}: {e.line()}" for e in self.evaluations]
        if self.cache is not None:
            lines.append(self.cache.describe())
        return "\n".join(lines)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Boundary, monitor statistics, policy, decisions and counters: plain containers, numbers,
        strings and tensors only, so ``torch.load(..., weights_only=True)`` reads it back."""
        return {
            "boundary": self.boundary,
            "epochs_completed": self.clock.epochs_completed,
            "block_names": [b.name for b in self.blocks],
            "policy_spec": self.policy.spec(),
            # The step count's owner is counters.steps; the saved monitor has always carried it too.
            "monitor": {**self.monitor.state_dict(), "total_steps": self.counters.steps},
            "decisions": [asdict(d) for d in self.decisions],
            "counters": self.counters.state_dict(),
            "cache": None if self.cache is None else self.cache.state_dict(),
            "powersgd": None if self._powersgd is None else self._powersgd.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`: after the model's state, before the optimizer's (see
        :meth:`load_training_state_dict`, which does all three in that order). A state that cannot
        be restored is refused in one line before anything changes.

        Args:
            state: what :meth:`state_dict` returned, for the same blocks and policy.
        """
        self._check_saved(state)
        self._restore(state)

    def _check_saved(self, state: dict) -> None:
        check_saved_freezer(state, [b.name for b in self.blocks], self.policy)
        check_saved_monitor(state["monitor"], self.blocks)
        self._check_saved_powersgd(state.get("powersgd"))

    def _restore(self, state: dict) -> None:
        """Apply a Freezer state :meth:`_check_saved` accepted."""
        self.monitor.load_state_dict(state["monitor"])
        self.decisions, self.counters, bytes_total = saved_records(state)
        self.engine.comm.allreduce_bytes_total = bytes_total  # restored into its one owner
        self.counters.attach(self.engine.comm)
        self.clock.epochs_completed = int(state["epochs_completed"])
        self.clock.epoch_start_step = self.counters.steps
        self._steps_at_start = self.counters.steps  # close() counts this life's steps from here
        k = int(state["boundary"])
        if k != self.boundary:
            self._apply(k, restoring=True)
        self.engine.restore_cache(state.get("cache"), k, self.clock.epochs_completed)
        self._restore_powersgd(state.get("powersgd"))  # after the re-wrap, which drops frozen parameters' state
        self.engine.expect_rank_check()

    def training_state_dict(self) -> dict:
        """What a checkpoint needs from the model, the Freezer and the optimizer, as
        ``{"model", "freezer", "optimizer"}`` (no "optimizer" without one). Add your own entries
        (scheduler, epoch) and ``torch.save`` it; it loads with ``weights_only=True``."""
        state = {"model": self.model.state_dict(), "freezer": self.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        else:
            steering.warn_no_optimizer_state()
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
        # Everything is checked before anything is loaded: a refusal halfway used to leave the
        # model's weights (and sometimes the boundary) replaced, and a caller that caught it and
        # started over trained the other checkpoint's weights.
        check_saved_training_state(state, has_optimizer=self.optimizer is not None)
        check_saved_model(state["model"], self.model)
        self._check_saved(state["freezer"])  # the PowerSGD state's hook and rank too
        if self.optimizer is not None:
            check_saved_optimizer(state["optimizer"], self.optimizer)
        self.model.load_state_dict(state["model"])
        self._restore(state["freezer"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    # ------------------------------------------------------------------ internals
    @property
    def _powersgd(self):
        return self.engine.comm.powersgd

    def _check_saved_powersgd(self, saved: dict | None) -> None:
        """Refuse a checkpoint saved under another comm hook (PowerSGD or not, another rank)."""
        if (saved is None) != (self._powersgd is None):
            raise ValueError(
                f"Freezer.load_state_dict: the checkpoint was saved {'without' if saved is None else 'with'} a "
                f"PowerSGD comm_hook and this Freezer's comm_hook is '{self.engine.comm_hook}'; resume with the "
                "saving run's comm_hook"
            )
        if saved is not None:
            self._powersgd.check_saved(saved)

    def _restore_powersgd(self, saved: dict | None) -> None:
        """The saved PowerSGD state (error feedback, Q memories, iteration, generator), so a resumed
        run sends and applies what the uninterrupted one would."""
        if saved is not None:
            self._powersgd.load_state_dict(saved)

    def _clamp(self, k: int) -> int:
        return max(0, min(int(k), len(self.blocks) - 1))

    def _evaluate(self, epoch: int) -> bool:
        """``epoch``: the 0-based epoch the closing interval is recorded under."""
        stats = self.monitor.close_interval(epoch, self.boundary, self.counters.steps)
        ctx = DecisionContext(
            boundary=self.boundary,
            history=self.monitor.history,
            progress=self.clock.progress(self.counters.steps),
            num_blocks=len(self.blocks),
            block_bytes=self._steering.block_grad_bytes,
            pricing=self.pricing,
            needs=self.needs,
        )
        # rank 0's answer on every rank: the probe runs collectives, which all ranks must enter
        if self.needs.probe and comm.broadcast_int_from_rank0(int(self.policy.wants_probe_in(ctx)), self.process_group):
            stats = self._probe(stats)
        proposed = self.policy.decide_in(ctx)
        # Statistics come from all-reduced gradients, so ranks agree already; the broadcast makes
        # a disagreement (e.g. a non-deterministic reduction order) impossible rather than unlikely.
        k = self._clamp(comm.broadcast_int_from_rank0(int(proposed), self.process_group))
        evaluation = Evaluation(stats.index, epoch, self.counters.steps, self.boundary, k, self.policy.explain_in(ctx))
        self.evaluations.append(evaluation)
        _log.debug("%s: %s", self.policy.spec(), evaluation.line())
        if k == self.boundary:
            return False
        self._apply(k)  # may raise (a cache over its budget): then no decision is recorded
        self.decisions.append(Decision(stats.index, epoch, evaluation.step, evaluation.boundary_before, k))
        return True

    def _probe(self, stats: IntervalStats) -> IntervalStats:
        """The closing interval with the held-out loss the probe measures now (rank 0's, on every rank)."""
        training = self.model.training
        self.eval()  # held-out images must not move BatchNorm statistics nor draw dropout masks
        with torch.no_grad():
            loss = float(self.probe())
        self.train(training)
        loss = float(comm.broadcast_object_from_rank0(loss, self.process_group))
        probed = dataclasses.replace(stats, held_out_loss=loss)
        self.monitor.history[-1] = probed
        return probed

    def _apply(self, k: int, first: bool = False, restoring: bool = False) -> None:
        """Make ``k`` the boundary: requires_grad and grads, optimizer state, frozen buffers,
        hooks, norm-layer modes, the monitor's active blocks, the activation cache and the DDP wrapper.

        Args:
            k: the boundary to apply (already clamped and agreed on by every rank).
            first: the constructor's call: every block below ``k`` counts as newly frozen, and no
                buffer broadcast is needed (the constructor has just broadcast every tensor).
            restoring: a checkpoint's boundary: its cache lineage is restored instead of planned,
                and the DDP construction is not counted (a resumed run's counters match the saver's).
        """
        # A cache that cannot be built at k refuses here, before anything changes.
        done = self.clock.epoch_done_fraction(self.counters.steps)
        plan = None if restoring else self.engine.plan(k, self.clock.epochs_completed, done)
        old = self.boundary
        newly_frozen = range(0, k) if first else range(old, max(old, k))
        self._steering.apply(k)  # requires_grad, grads and the hooks of every block
        drop_state(self.optimizer, (p for i in newly_frozen for p in self.blocks[i].params))
        if not first:  # the constructor has just broadcast every tensor
            # Each rank updated its running statistics with its own data: without this one
            # broadcast, newly frozen BN buffers would stay different across ranks forever.
            frozen_buffers = [getattr(mod, name) for i in newly_frozen for _, mod, name in self.blocks[i].buffers()]
            comm.broadcast_from_rank0(frozen_buffers, self.process_group)
        self.boundary = k
        self.monitor.set_first_active(k)
        self.train(self.model.training)
        elapsed_s = self.engine.apply(k, plan)
        if not first and not restoring and self.engine.distributed:
            self.counters.rewraps += 1
            self.counters.rewrap_s_total += elapsed_s
            self.counters.rewrap_s_last = elapsed_s


def _checked_policy_inputs(
    needs: Needs,
    spec: str,
    clock: RunClock,
    num_blocks: int,
    pricing: Pricing | None,
    probe: Callable[[], float] | None,
) -> tuple[Pricing | None, Callable[[], float] | None]:
    """Refuse, when the Freezer is built, a policy (``spec``) whose pricing or held-out probe is
    missing or wrong."""
    name = split_policy_spec(spec)[0]
    check_signals(needs.signals, spec)
    if needs.pricing:
        if pricing is None:
            raise ValueError(
                f"Freezer: policy '{name}' prices each freeze: pass pricing=Pricing(step_time_s=<seconds per "
                "step at each boundary>, lr_per_step=<the schedule's LR per step>) (docs/horizon.md; the "
                "pipeline takes it from the cost model: freeze.cost_profile)"
            )
        if not clock.steps_per_epoch or not clock.epochs:
            raise ValueError(f"Freezer: policy '{name}' needs the run length in steps: pass epochs and steps_per_epoch")
        pricing.check(num_blocks, clock.epochs * clock.steps_per_epoch)
        clock.check_evaluations(needs, spec)
    if needs.probe and probe is None:
        raise ValueError(
            f"Freezer: policy '{spec}' checks each freeze on a held-out subset: pass probe=<function returning "
            "that subset's loss>, or set the policy's probation=0"
        )
    if probe is not None and not callable(probe):
        raise ValueError(f"Freezer: probe = {probe!r}; accepted: a function of no arguments returning a loss")
    return pricing, probe


def _refuse_wrapped(model: nn.Module) -> None:
    """A wrapper cannot be frozen from outside: DDP fixed its parameters when it was built; other
    engines partition, shard or compile the model in ways a rebuild cannot follow."""
    if isinstance(model, (DistributedDataParallel, DataParallel)):
        raise ValueError(
            f"Freezer: the model is a {type(model).__name__} wrapper; pass the bare model ({type(model).__name__}"
            ".module): the Freezer builds DDP itself and rebuilds it whenever the boundary moves"
        )
    if isinstance(model, FreezerModule):
        raise ValueError("Freezer: the model is another Freezer's freezer.module; pass the bare model (freezer.model)")
    if type(model).__name__ in ("DeepSpeedEngine", "PipelineEngine") or hasattr(model, "zero_optimization_stage"):
        raise ValueError(
            "Freezer: the model is a DeepSpeed engine, which partitions the trainable parameters once at "
            "deepspeed.initialize; train with DDP instead (no deepspeed config / strategy='ddp') and pass the bare model"
        )
    if any(type(m).__name__.startswith(("FullyShardedDataParallel", "FSDP")) for m in model.modules()):
        raise ValueError(
            "Freezer: the model is sharded by FSDP, which flattens and shards parameters at wrapping time; the "
            "Freezer drives DistributedDataParallel only: pass the bare model"
        )
    if type(model).__name__ == "OptimizedModule" or any(
        getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()
    ):
        raise ValueError(
            "Freezer: the model is compiled with torch.compile, whose graphs guard on requires_grad and go stale at "
            "every rebuild; pass the uncompiled model (torch_compile=False / drop --torchcompile)"
        )
