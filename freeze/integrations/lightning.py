"""``FreezerCallback``: adaptive layer freezing in Lightning (2.x) with ``strategy="ddp"``.

    from freeze.integrations.lightning import FreezerCallback
    trainer = L.Trainer(strategy="ddp", callbacks=[FreezerCallback("autofreeze")])

Lightning reads ``trainer.strategy.model`` afresh at every step (``training_step``,
``block_backward_sync``), so the callback can hand it each DDP wrapper the Freezer builds: at
``on_fit_start`` (after Lightning wrapped the module and built the optimizer, after this callback's
checkpoint state was restored, before the optimizer state is) it builds the Freezer over the
LightningModule, retires Lightning's wrapper and installs the Freezer's; every rebuild installs the
new one. Each installed wrapper runs the Freezer's rank check before its first training forward
(Lightning calls the wrapper, not ``freezer.module``, whose forward runs it otherwise): ranks whose
weights differ are refused in one line instead of training replicas that never agree.
``after_backward`` runs in ``on_before_optimizer_step`` (gradients accumulated and unscaled, not yet
clipped), decisions in ``on_train_batch_end`` once per optimizer step and in
``on_train_epoch_end``; the Freezer's state is the callback's checkpoint state.

Lightning's ``BaseFinetuning`` changes ``requires_grad`` under a DDP wrapper built before the
change: parameters it unfreezes are never all-reduced and the replicas drift apart
(Lightning-AI/pytorch-lightning#20340). Here the wrapper is rebuilt at every boundary change.

Not counted by the Freezer's byte counter: Lightning's own collectives (``self.log(...,
sync_dist=True)``, metric syncs, DDP's used-parameter map with ``find_unused_parameters=True``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from freeze.block_finder import default_block_names
from freeze.blocks import Block, split_blocks
from freeze.freezer import Freezer
from freeze.freezer.engine import Engine, retire
from freeze.integrations._common import ddp_kwargs_of, refuse_comm_hook, resolve_policy
from freeze.policies import Policy


class FreezerCallback(Callback):
    """Freeze blocks of the LightningModule as ``policy`` decides, with exact DDP communication.

    Args:
        policy: a policy spec (``"autofreeze"``, ``"gradual-unfreeze"``, ...) or a :class:`freeze.Policy`.
        blocks: block names as ``split_blocks`` takes them, relative to ``module`` (or ready Blocks
            of the LightningModule); None: the default split of ``module``.
        module: the attribute of the LightningModule holding the network to split (``"net"``);
            None: the LightningModule itself. Every parameter of the LightningModule must be in a block.
        interval_steps: decide every N optimizer steps (0: at each epoch end).
        **freezer_options: more keyword arguments for :class:`freeze.Freezer` (``comm_hook="bf16"``,
            ``frozen_mode``, ...).

    ``callback.freezer`` holds the decisions, counters and history after ``fit``.
    """

    def __init__(
        self,
        policy: str | Policy = "autofreeze",
        blocks: Sequence | None = None,
        module: str | None = None,
        interval_steps: int = 0,
        **freezer_options: Any,
    ):
        self.policy = resolve_policy(policy)
        self.blocks = blocks
        self.module = module
        self.interval_steps = interval_steps
        self.freezer_options = freezer_options
        self.freezer: Freezer | None = None
        self._pending_state: dict | None = None
        self._last_global_step = -1
        self._strategy = None
        self._epochs_closed = 0  # epochs the Freezer has closed (end_epoch), restored with its state

    # ------------------------------------------------------------------ setup
    def _check_strategy(self, trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        name = type(strategy).__name__
        if "DeepSpeed" in name or "FSDP" in name or "ModelParallel" in name:
            raise ValueError(
                f"FreezerCallback: strategy {name} partitions or shards parameters at setup and cannot follow a "
                "moving freeze boundary; use strategy='ddp'"
            )
        if not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):
            raise ValueError(f"FreezerCallback: strategy {name} is not supported; use strategy='ddp'")
        if isinstance(strategy, DDPStrategy):
            if getattr(strategy, "_ddp_comm_hook", None) is not None:
                refuse_comm_hook("FreezerCallback", strategy._ddp_comm_hook)
            if strategy._ddp_kwargs.get("static_graph"):
                raise ValueError(
                    "FreezerCallback: static_graph=True breaks on every rebuilt DDP wrapper (Lightning flushes the "
                    "static graph once per strategy); use DDPStrategy(static_graph=False)"
                )

    def _make_blocks(self, pl_module: pl.LightningModule) -> list[Block]:
        if self.blocks is not None and len(self.blocks) and all(isinstance(b, Block) for b in self.blocks):
            return list(self.blocks)
        if self.module is None:
            return split_blocks(pl_module, self.blocks)
        inner = pl_module.get_submodule(self.module)
        names = default_block_names(inner) if self.blocks is None else list(self.blocks)

        def prefixed(entry):
            if isinstance(entry, str):
                return f"{self.module}.{entry}"
            return [f"{self.module}.{e}" for e in entry]

        return split_blocks(pl_module, [prefixed(n) for n in names])

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.freezer is not None:
            raise RuntimeError(
                "FreezerCallback: this callback already ran a fit and its Freezer still steers the module; pass a "
                "new FreezerCallback to the next Trainer"
            )
        self._check_strategy(trainer)
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"FreezerCallback: {len(trainer.optimizers)} optimizers; the Freezer drives one, return a single "
                "optimizer from configure_optimizers"
            )
        strategy = trainer.strategy
        ddp_kwargs: dict = {}
        if isinstance(strategy, DDPStrategy):
            ddp_kwargs = ddp_kwargs_of("FreezerCallback", strategy._ddp_kwargs)
            device_ids = strategy.determine_ddp_device_ids()
            if device_ids is not None:
                ddp_kwargs["device_ids"] = device_ids
        accumulate = max(1, trainer.accumulate_grad_batches)
        batches = trainer.num_training_batches
        steps_per_epoch = None
        if isinstance(batches, int) or (isinstance(batches, float) and batches != float("inf")):
            steps_per_epoch = max(1, -(-int(batches) // accumulate))
        self.freezer = Freezer(
            pl_module,
            self._make_blocks(pl_module),
            self.policy,
            epochs=trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None,
            steps_per_epoch=steps_per_epoch,
            interval_steps=self.interval_steps,
            ddp_kwargs=ddp_kwargs,
            **self.freezer_options,
        )
        self.freezer.attach_optimizer(trainer.optimizers[0])
        if self._pending_state is not None:
            # Lightning restored the weights before on_fit_start and restores the optimizer after.
            self.freezer.load_state_dict(self._pending_state)
            self._epochs_closed = int(self._pending_state["epochs_completed"])
            self._pending_state = None
        self._last_global_step = trainer.global_step
        wrapper = self.freezer.engine.wrapper
        if wrapper is not None:
            if isinstance(strategy.model, DistributedDataParallel):
                retire(strategy.model)  # Lightning's own wrapper reduces the wrong set from now on
            self._strategy = strategy
            self._install(wrapper)
            self.freezer.engine.add_rebuild_listener(self._install)

    def _install(self, wrapper: nn.Module | None) -> None:
        if self._strategy is not None and wrapper is not None:
            wrapper.register_forward_pre_hook(_RankCheck(self.freezer.engine))
            self._strategy.model = wrapper

    # ------------------------------------------------------------------ the loop
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.freezer is not None:
            self.freezer.after_backward()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Fires on every batch; with accumulate_grad_batches > 1 only some stepped.
        if self.freezer is not None and trainer.global_step != self._last_global_step:
            self._last_global_step = trainer.global_step
            self.freezer.after_step()

    def _close_skipped_epochs(self, trainer) -> None:
        # A checkpoint written at an epoch's last batch (every_n_train_steps) precedes that epoch's
        # on_train_epoch_end; resumed from it, Lightning starts the next epoch without calling it
        # (nor on_train_epoch_start: it counts as restarted mid-epoch). Close the epoch before the
        # next step, as the uninterrupted run did right after saving.
        while self.freezer is not None and self._epochs_closed < trainer.current_epoch:
            self.freezer.end_epoch(self._epochs_closed)
            self._epochs_closed += 1

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._close_skipped_epochs(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._close_skipped_epochs(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._close_skipped_epochs(trainer)
        if self.freezer is not None and self._epochs_closed == trainer.current_epoch:
            self.freezer.end_epoch(trainer.current_epoch)
            self._epochs_closed += 1

    def on_fit_end(self, trainer, pl_module) -> None:
        self._release(pl_module)

    def on_exception(self, trainer, pl_module, exception) -> None:
        # Release the wrapper now: a live one at destroy_process_group can abort the process at exit.
        self._release(pl_module)

    def _release(self, pl_module) -> None:
        if self.freezer is not None:
            self.freezer.close()
            if self._strategy is not None:
                self._strategy.model = pl_module  # as Lightning's teardown leaves it
                self._strategy = None

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return {} if self.freezer is None else {"freezer": self.freezer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_state = state_dict.get("freezer")


RANK_FIX = (
    "under Lightning, load weights on every rank before fit() reaches the callbacks' on_fit_start (in the "
    "LightningModule's __init__, setup() or configure_model(), or with fit(ckpt_path=...)), not in a hook that "
    "runs later (the LightningModule's on_fit_start, on_train_start) or on some ranks only: FreezerCallback "
    "broadcasts rank 0's weights in its on_fit_start"
)


class _RankCheck:
    """A forward pre-hook on each installed wrapper: Lightning's training forward calls the wrapper,
    not ``freezer.module``, so the Freezer's check that every rank holds the same weights (at the
    first training forward after the Freezer was built or its state loaded) runs here."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.engine.model.training and torch.is_grad_enabled():
            self.engine.check_ranks(RANK_FIX)
