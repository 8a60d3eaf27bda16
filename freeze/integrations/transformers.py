"""``FreezeTrainer``: the Hugging Face ``Trainer`` (transformers >= 5) with adaptive layer freezing.

    from freeze.integrations.transformers import FreezeTrainer
    trainer = FreezeTrainer(model=model, args=args, train_dataset=train_ds, freeze_policy="autofreeze")
    trainer.train()

The Trainer keeps the DDP wrapper in a local variable for the whole run and its callbacks never see
it, so a callback cannot rebuild DDP. Instead the wrapper the Trainer gets is ``freezer.module``,
stable across the Freezer's rebuilds: ``_wrap_model`` returns it, and the Trainer then skips
``accelerator.prepare`` for the model (accelerate's ``prepare_model(..., evaluation_mode=True)`` is
called here instead: it applies bf16/fp16 autocast without building DDP).

* ``after_backward`` runs in :meth:`FreezeTrainer.training_step` on the micro-batch whose backward
  all-reduces, before clipping (``max_grad_norm``), with the loss scale in fp16 (the scaler's tensor:
  no host sync); overflowed fp16 steps are detected by the Freezer.
* Gradient accumulation: the Trainer's ``accelerator.no_sync(model=...)`` reaches
  ``freezer.module.no_sync()``.
* Checkpoints: every ``checkpoint-N`` gets ``freezer.pt`` (the Freezer's state, written by world
  rank 0); ``train(resume_from_checkpoint=...)`` loads it after the model and before the optimizer,
  so a resumed run makes the same decisions.
* Not counted by the Freezer's byte counter: the Trainer's own collectives outside DDP's buckets
  (token counts with ``average_tokens_across_devices``, ``include_num_input_tokens_seen``, the loss
  gathered for logging, DDP's used-parameter map with ``find_unused_parameters=True``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import transformers
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from freeze._atomic import atomic_write
from freeze.freezer import Freezer
from freeze.integrations._common import ddp_kwargs_of, resolve_blocks, resolve_policy
from freeze.policies import Policy

FREEZER_STATE_NAME = "freezer.pt"

TRANSFORMERS_MIN_MAJOR = 5  # setup.py's hf extra says the same (tests/test_integration_transformers.py)

if int(transformers.__version__.split(".")[0]) < TRANSFORMERS_MIN_MAJOR:
    raise ImportError(
        f"freeze.integrations.transformers needs transformers >= 5 (found {transformers.__version__}, whose Trainer "
        "builds DDP itself in _wrap_model); pip install 'transformers>=5'"
    )


class FreezeTrainer(Trainer):
    """``transformers.Trainer`` that freezes blocks of the model as ``freeze_policy`` decides.

    Args (besides the Trainer's):
        freeze_policy: a policy spec (``"autofreeze"``, ``"autofreeze:percentile=50"``,
            ``"gradual-unfreeze"``, ...) or a :class:`freeze.Policy`.
        freeze_blocks: the blocks, or the names ``split_blocks`` takes; None: ``split_blocks(model)``.
        freeze_interval_steps: ask the policy every N optimizer steps, after steps N, 2N, ..., but
            not after the run's last step, where a new boundary would rebuild DDP for nothing (0:
            at each epoch end). autofreeze waits for min_intervals closed intervals (default
            2), so it can first freeze after step 2N.
        freeze_options: more keyword arguments for :class:`freeze.Freezer` (``comm_hook="bf16"``,
            ``frozen_mode``, ``grad_checkpointing``, ``track_summed_grads``).

    After ``train()``, ``trainer.freezer`` holds the decisions, counters and history.
    """

    def __init__(
        self,
        *args,
        freeze_policy: str | Policy = "autofreeze",
        freeze_blocks: Sequence | None = None,
        freeze_interval_steps: int = 0,
        freeze_options: dict | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.freeze_policy = resolve_policy(freeze_policy)
        self.freeze_blocks = freeze_blocks
        self.freeze_interval_steps = freeze_interval_steps
        self.freeze_options = dict(freeze_options or {})
        self.freezer: Freezer | None = None
        self._freeze_resume: str | None = None
        self._freeze_steps_per_epoch: int | None = None
        self._refuse_unsupported()
        self.add_callback(_FreezerCallback(self))

    def _refuse_unsupported(self) -> None:
        args = self.args
        if self.is_deepspeed_enabled:
            raise ValueError(
                "FreezeTrainer: DeepSpeed partitions the trainable parameters once at initialisation and cannot "
                "follow a moving freeze boundary; drop the deepspeed config (train with DDP)"
            )
        if self.is_fsdp_enabled or getattr(self, "is_fsdp_xla_enabled", False):
            raise ValueError(
                "FreezeTrainer: FSDP flattens and shards parameters at wrapping time; drop the fsdp options (train "
                "with DDP)"
            )
        if args.torch_compile:
            raise ValueError(
                "FreezeTrainer: torch_compile=True compiles graphs that guard on requires_grad and go stale at every "
                "freeze; set torch_compile=False"
            )
        if args.n_gpu > 1:
            raise ValueError(
                f"FreezeTrainer: {args.n_gpu} GPUs in one process means nn.DataParallel, which the Freezer does not "
                "drive; launch one process per GPU with torchrun (DDP)"
            )
        if args.ddp_static_graph and args.gradient_accumulation_steps > 1:
            raise ValueError(
                "FreezeTrainer: ddp_static_graph=True with gradient_accumulation_steps > 1 fails at the first "
                "backward of every rebuilt DDP wrapper; set ddp_static_graph=False"
            )
        if args.label_smoothing_factor > 0 and "CausalLM" in type(self.model).__name__:
            # compute_loss picks the causal label shift from the class name of accelerate's
            # unwrap_model(model), which does not know freezer.module.
            raise ValueError(
                "FreezeTrainer: label_smoothing_factor with a causal LM would skip the label shift; set "
                "label_smoothing_factor=0 or pass a compute_loss_func"
            )

    # ------------------------------------------------------------------ the Trainer's seams
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """``Trainer.train``; a resumed run also restores the Freezer from ``checkpoint-N/freezer.pt``."""
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)  # as Trainer.train resolves it
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        self._freeze_resume = resume_from_checkpoint or None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def set_initial_training_values(self, args, dataloader):
        values = super().set_initial_training_values(args, dataloader)
        self._freeze_steps_per_epoch = values[1]  # num_update_steps_per_epoch
        return values

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if not training:
            return super()._wrap_model(model, training, dataloader)
        if self.freezer is not None:
            if not self.freezer.engine.closed:
                return self.freezer.module
            raise RuntimeError(
                "FreezeTrainer: train() already ran and its Freezer still steers the model (its hooks stay after close); "
                "build a new FreezeTrainer over a new model to train again"
            )
        # Autocast (and device placement) without DDP: accelerate patches model.forward, which every
        # DDP wrapper the Freezer builds calls. Also registers the model, so evaluation does not
        # prepare (and DDP-wrap) it again.
        if self.model not in self.accelerator._models:
            self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
        ddp_kwargs = {}
        handler = self.accelerator.ddp_handler
        if handler is not None:
            ddp_kwargs = ddp_kwargs_of("FreezeTrainer", {**handler.to_kwargs(), "comm_hook": handler.comm_hook})
        if self.args.device.type == "cuda":
            ddp_kwargs["device_ids"] = [self.accelerator.local_process_index]
            ddp_kwargs["output_device"] = self.accelerator.local_process_index
        self.freezer = Freezer(
            self.model,
            resolve_blocks(self.model, self.freeze_blocks),
            self.freeze_policy,
            epochs=max(1, math.ceil(self.state.num_train_epochs or self.args.num_train_epochs)),
            steps_per_epoch=self._freeze_steps_per_epoch,
            interval_steps=self.freeze_interval_steps,
            ddp_kwargs=ddp_kwargs,
            **self.freeze_options,
        )
        if self.optimizer is not None:
            self.freezer.attach_optimizer(self.optimizer)
        if self._freeze_resume is not None:
            # The model was loaded in train(); the optimizer loads after this: the documented order.
            path = os.path.join(self._freeze_resume, FREEZER_STATE_NAME)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"FreezeTrainer: {path} is missing, so the freezing decisions cannot be restored; resume from a "
                    "checkpoint a FreezeTrainer wrote"
                )
            state = torch.load(path, weights_only=True, map_location="cpu")
            self.freezer.load_state_dict(state)
            # A checkpoint written at an epoch's last step precedes that epoch's on_epoch_end: the
            # uninterrupted run closed the epoch (and maybe decided) right after saving; so do we.
            per_epoch = self._freeze_steps_per_epoch
            done = self.state.global_step // per_epoch if per_epoch else int(state["epochs_completed"])
            for epoch in range(int(state["epochs_completed"]), done):
                self.freezer.end_epoch(epoch)
        return self.freezer.module

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.freezer is not None and not self.freezer.engine.closed:
            self.freezer.attach_optimizer(optimizer)
        return optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.freezer is not None and self.accelerator.sync_gradients:
            # The backward that all-reduced has run; clipping and the step come later. In fp16 the
            # gradients are still multiplied by the loss scale: pass the scaler's tensor.
            scaler = self.accelerator.scaler
            scale = None
            if scaler is not None and scaler.is_enabled():
                scale = getattr(scaler, "_scale", None)
                if scale is None:
                    scale = scaler.get_scale()
            self.freezer.after_backward(grad_scale=scale)
        return loss


class _FreezerCallback(TrainerCallback):
    """The Trainer's events the Freezer follows: decisions at step and epoch ends, its state in
    every checkpoint, release at the end."""

    def __init__(self, trainer: FreezeTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        # No decision after the run's last optimizer step: a new boundary there rebuilds a DDP
        # wrapper that never trains (issue 32). Decisions come every freeze_interval_steps steps,
        # the first after step freeze_interval_steps.
        if self.trainer.freezer is not None and state.global_step < state.max_steps:
            self.trainer.freezer.after_step()

    def on_epoch_end(self, args, state, control, **kwargs):
        freezer = self.trainer.freezer
        if freezer is not None:
            # state.epoch is epoch + (step + 1) / steps_in_epoch: the epoch that just ended, 0-based.
            freezer.end_epoch(max(0, math.ceil(round(state.epoch, 6)) - 1))

    def on_save(self, args, state, control, **kwargs):
        freezer = self.trainer.freezer
        if freezer is None:
            return
        state_dict = freezer.state_dict()  # identical on every rank (all-reduced gradients, broadcast decisions)
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            atomic_write(os.path.join(folder, FREEZER_STATE_NAME), lambda f: torch.save(state_dict, f))

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer.freezer is not None:
            self.trainer.freezer.close()
