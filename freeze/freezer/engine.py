"""The forward path of a Freezer: the DDP wrapper over the model, the activation cache, and the one
forward that chooses between them.

A training forward (model in train mode, autograd on) first lets the cache carry out what the last
boundary change planned (every rank's forward does, so the cache's collectives line up), then runs
the current DDP wrapper, serving the stored rows of ``sample_ids`` when the cache holds all of
them. Any other forward (evaluation, ``torch.no_grad``, no ``sample_ids``) runs the model on its
inputs: the cache only ever stands in for what the training forward of those exact keys computes.

The wrapper always wraps the bare model (the cache serves through the model's own forward), and it
is rebuilt only when the frozen set changes; :attr:`Engine.wrapper` is the sanctioned handle on it
and :meth:`Engine.add_rebuild_listener` tells a trainer that holds the wrapper itself about each
new one; such a trainer runs :meth:`Engine.check_ranks` before its training forward, which then
bypasses :meth:`Engine.forward`.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from freeze import comm
from freeze.blocks import Block, frozen_names
from freeze.cache import ActivationCache, CacheError, CachePlan
from freeze.cache.cuts import batch_size
from freeze.fingerprint import fingerprint, module_state
from freeze.names import CommHook

STALE_WRAPPER_FIX = "call freezer.module, which always runs the current wrapper"


class StaleWrapperError(RuntimeError):
    """A DDP wrapper the Freezer has replaced was called."""


class RankMismatchError(RuntimeError):
    """Ranks hold different weights where they must hold the same."""


class Engine:
    """Owns the DDP wrapper and the activation cache of one Freezer.

    Args:
        model: the bare model.
        blocks: its blocks.
        cache: the activation cache, or None.
        comm_hook: "allreduce", "bf16", "powersgd1" or "powersgd4" (see freeze.comm).
        ddp_kwargs: passed to every DDP wrapper.
        process_group: the DDP process group (None: the world).
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[Block],
        cache: ActivationCache | None,
        *,
        comm_hook: CommHook = "allreduce",
        ddp_kwargs: dict | None = None,
        process_group=None,
    ):
        self.model, self.blocks, self.cache = model, list(blocks), cache
        self.comm_hook, self.ddp_kwargs, self.process_group = comm_hook, dict(ddp_kwargs or {}), process_group
        self.distributed = comm.is_distributed()
        # The one owner of the byte count and of PowerSGD's state; refuses an unknown hook (also
        # without a process group, where no wrapper is ever built).
        self.comm = comm.make_counter(comm_hook, process_group)
        self.wrapper: nn.Module | None = None  # the current DDP wrapper; None without a process group
        self.closed = False
        self._listeners: list[Callable[[nn.Module | None], None]] = []
        self._check_ranks = self.distributed  # at the next training forward: do the ranks hold the same weights?
        self._warned_no_keys = False
        self._warned_train_no_grad = False
        # A forward through the current wrapper since the last after_backward whose backward DDP
        # all-reduces (grad enabled, outside no_sync): see check_synced_forward.
        self._synced_forward = False

    # ------------------------------------------------------------------ boundary changes
    def plan(self, boundary: int, epoch: int, done_fraction: float) -> CachePlan | None:
        """What the cache will do at ``boundary``; raises before anything changes if it cannot."""
        return None if self.cache is None else self.cache.plan(boundary, epoch, done_fraction)

    def apply(self, boundary: int, plan: CachePlan | None) -> float:
        """Make the forward path match ``boundary`` (requires_grad already set): commit the cache's
        plan and build a new DDP wrapper over what is now trainable. Returns the rebuild's seconds."""
        if plan is not None:
            self.cache.commit(plan)
        return self.rebuild(boundary)

    def rebuild(self, boundary: int) -> float:
        """A new DDP wrapper over the parameters that require grad now (nothing without a group)."""
        if not self.distributed:
            return 0.0
        start = time.perf_counter()
        if self.ddp_kwargs.get("gradient_as_bucket_view"):
            # Gradients may be views into the old wrapper's buckets, which are about to go away.
            for p in self.model.parameters():
                p.grad = None
        if self.wrapper is not None:
            retire(self.wrapper)  # a script that kept it gets a clear error, not DDP's misleading one
        self.wrapper = None  # each live wrapper holds its own gradient buckets: drop the old one first
        ignored = frozen_names(self.blocks, boundary)
        self.wrapper = comm.build_ddp(self.model, ignored, self.comm, self.comm_hook, self.ddp_kwargs)
        # On the wrapper, not in forward(): trainers that call the wrapper themselves (Lightning) count too.
        self.wrapper.register_forward_pre_hook(self._note_forward)
        elapsed_s = time.perf_counter() - start
        for listener in self._listeners:
            listener(self.wrapper)
        return elapsed_s

    def restore_cache(self, state: dict | None, boundary: int, epochs_completed: int) -> None:
        """After a checkpoint's boundary is applied: the cache's saved lineage (replayed from the
        loaded weights at the next training forward), or, saved without one, a fresh plan."""
        if self.cache is None:
            return
        if state is not None:
            self.cache.load_state_dict(state)
        else:
            self.cache.drop("resuming from a checkpoint without a cache")
            self.cache.commit(self.cache.plan(boundary, epochs_completed))

    def add_rebuild_listener(self, listener: Callable[[nn.Module | None], None]) -> None:
        """Call ``listener(new_wrapper)`` after every rebuild (for a trainer that holds the wrapper)."""
        self._listeners.append(listener)

    def expect_rank_check(self) -> None:
        """Compare the ranks' weights at the next training forward (after a load)."""
        self._check_ranks = self.distributed

    def check_ranks(self, fix: str | None = None) -> None:
        """The rank check :meth:`forward` runs at the first training forward after construction or
        :meth:`expect_rank_check`, run now if it is still pending (else nothing): one all-gather of
        a fingerprint of the weights; raises :class:`RankMismatchError` on every rank when they
        differ. Collective: every rank calls it at the same point. For a trainer that calls
        :attr:`wrapper` itself (its training forward bypasses :meth:`forward`): call it before
        that forward; ``fix`` replaces the error's advice with the trainer's own words."""
        if self._check_ranks:
            self._check_ranks = False
            self._refuse_diverged_ranks(fix)

    def _note_forward(self, wrapper: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled() and wrapper.require_backward_grad_sync:
            self._synced_forward = True

    def check_synced_forward(self) -> None:
        """At every after_backward under a process group: some forward since the previous one ran
        through the current DDP wrapper with autograd on and outside ``no_sync()``, so this step's
        backward was all-reduced. Otherwise the script computed its loss from the bare model (or
        only under ``no_sync``): each rank would keep its own gradients and the ranks would train
        different models, silently (a new user's trial: exit 0, 0 bytes all-reduced). Evaluation
        forwards (no autograd) and accumulation micro-batches under ``no_sync`` do not count, and
        need not: the step's last micro-batch runs outside it. Without a process group nothing is
        checked: the bare model computes the same gradients there (nothing is all-reduced to
        miss), and Lightning's single-device strategy calls the LightningModule itself."""
        if self.distributed and not self._synced_forward:
            raise RuntimeError(
                "Freezer: after_backward() ran but no training forward went through freezer.module since the last "
                "step (outside no_sync()), so DDP all-reduced nothing and every rank trains its own model; compute "
                "the loss from freezer.module(x), not from the bare model"
            )
        self._synced_forward = False

    def close(self) -> None:
        """Release the DDP wrapper: a live wrapper holds the process group, and then destroying the
        group leaves gloo's worker and transport threads running into interpreter shutdown (observed:
        3 gloo threads still alive when the README example's interpreter began finalizing), where a
        thread that needs the interpreter aborts the process ("terminate called without an active
        exception"). The forward refuses to run afterwards."""
        if self.wrapper is not None:
            retire(self.wrapper)
            self.wrapper = None
            # DDP keeps reference cycles (its reducer's hooks point back at it): dropping the last
            # reference does not free it, and a script that calls destroy_process_group() next
            # (torchvision's reference does) would still abort at exit now and then (seen: one rank
            # of the reference-style script under torchrun, with the machine loaded). Free it now.
            gc.collect()
        self.closed = True

    # ------------------------------------------------------------------ the forward
    def forward(self, *args: Any, sample_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """The model's forward through the current wrapper; a training forward with ``sample_ids``
        runs from the cache's stored rows when it holds every one of them."""
        if self.closed:
            raise RuntimeError("Freezer: closed (its DDP wrapper is released); build a new Freezer to train again")
        target = self.wrapper if self.wrapper is not None else self.model
        if not (self.model.training and torch.is_grad_enabled()):
            if self.model.training:
                self._warn_train_mode_without_grad()
            return target(*args, **kwargs)
        self.check_ranks()
        if self.cache is None:
            return target(*args, **kwargs)
        self.cache.before_training_forward()  # on every rank: builds are collective
        # The checks on the keys and inputs run from the first training step on, not only once a
        # store exists: a wiring mistake shows before the run's first freeze (80 % into a freezeout run).
        if sample_ids is None:
            self._warn_no_keys()
            return target(*args, **kwargs)
        keys = torch.as_tensor(sample_ids)
        inputs = args[0] if len(args) == 1 and not kwargs else (args, kwargs)
        batch = batch_size(inputs)
        if keys.dim() != 1 or (batch is not None and keys.numel() != batch):
            raise CacheError(
                f"Freezer: sample_ids holds {keys.numel()} keys for a batch of {batch}; pass one key per sample "
                "(the keys the cache source numbers the inputs by)"
            )
        self.cache.check_inputs(keys, (args, kwargs))
        if self.cache.store is None:
            return target(*args, **kwargs)
        rows = self.cache.read(keys, _device_of(self.model))
        if rows is None:  # exact fallback: the model computes the prefix, as without the cache
            return target(*args, **kwargs)
        with self.cache.serving(rows):
            return target(*args, **kwargs)

    def _warn_train_mode_without_grad(self) -> None:
        """A forward under no_grad in train mode is an evaluation that forgot ``freezer.eval()``
        (measured in a new user's trial: accuracy 0.17 instead of 0.55, and BatchNorm's running
        statistics moved by the held-out data). Said once: a deliberate one (recalibrating BatchNorm
        statistics) need not be refused."""
        if not self._warned_train_no_grad:
            self._warned_train_no_grad = True
            warnings.warn(
                "Freezer: a forward under torch.no_grad() with the model in train mode: batch statistics in "
                "BatchNorm (its running statistics updated by this data) and dropout on; to evaluate, call "
                "freezer.eval() before and freezer.train() after",
                RuntimeWarning,
                stacklevel=_user_stacklevel(),
            )

    def _warn_no_keys(self) -> None:
        if not self._warned_no_keys:
            self._warned_no_keys = True
            warnings.warn(
                "Freezer: a training forward got no sample_ids, so the activation cache cannot serve it (the frozen "
                "prefix is computed as without the cache); pass freezer.module(x, sample_ids=keys)",
                RuntimeWarning,
                stacklevel=_user_stacklevel(),
            )

    def _refuse_diverged_ranks(self, fix: str | None = None) -> None:
        """One all-gather of a 2-number fingerprint of every parameter and buffer, at the first
        training forward after the Freezer was built or loaded: the moment a weight load on some
        ranks only (after the Freezer's broadcast) shows."""
        mine = fingerprint(module_state([self.model])).to(comm.collective_device(self.process_group))
        every = comm.all_gather(mine, self.process_group)
        differ = [r for r, f in enumerate(every) if not torch.equal(f, every[0])]
        if differ:
            fix = fix or (
                "load weights on every rank BEFORE building the Freezer (it broadcasts rank 0's at construction), "
                "or restore with freezer.load_training_state_dict() on every rank"
            )
            raise RankMismatchError(
                f"Freezer: rank {differ[0]} holds other weights than rank 0 at the first training step; {fix}"
            )


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's line: the first frame, counting from
    the caller of this function, outside freeze/ and torch/ (a forward reaches the engine through
    freezer.module and nn.Module's call, or through a trainer's own frames: the depth differs)."""
    library = os.path.dirname(os.path.dirname(__file__))  # freeze/, not only freeze/freezer/: integrations too
    roots = (library + os.sep, os.path.dirname(torch.__file__) + os.sep)
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(roots):
        level, frame = level + 1, frame.f_back
    return level


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _refuse_stale_call(module: nn.Module, args: tuple) -> None:
    raise StaleWrapperError(
        "Freezer: this DDP wrapper was replaced when the freeze boundary moved and no longer "
        f"reduces the right gradients; {STALE_WRAPPER_FIX}"
    )


def retire(ddp: nn.Module) -> None:
    """Make a replaced wrapper refuse to run, with an error naming the fix."""
    ddp.register_forward_pre_hook(_refuse_stale_call)
