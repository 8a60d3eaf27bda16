"""How a Freezer steers the parameters and modules of its model at a boundary.

Parameters: blocks ``0 .. k-1`` get ``requires_grad=False`` and ``grad=None``, the rest
``requires_grad=True``, except parameters the user had frozen when the Freezer was built: they stay
frozen at every boundary.

Three things happen in a forward pass at boundary ``k``:

* a frozen block records no autograd graph, unless its input requires grad: then a trainable block
  ran before it (a module called twice, e.g. a shared layer called again after a trainable one) and
  the gradient must flow through it to that block; its own parameters still get none. With neither
  its input nor its parameters requiring grad autograd records nothing there by itself, so such a
  block carries no hook; one holding a parameter that still trains (a weight tied to a trainable
  block's, in blocks made by hand) runs without autograd unless its input needs it, so that the
  frozen use adds no gradient to the shared weight;
* a frozen block runs in eval, whatever ``model.train()`` did: every module of it
  (``frozen_mode="eval"``, the default, as AutoFreeze and PipeTransformer run frozen layers:
  dropout off, so a frozen block computes one output per input) or only its norm layers with
  running statistics (``"train"``: dropout stays on), set again at the start of every forward of
  the model and of the first frozen block;
* on the first forward after a boundary change, the order in which the blocks first run is checked
  against their order in the block list: "freeze the first k blocks" means the first k to run.

Every hook acts only on the module it was registered on (:class:`ModuleHook`): ``copy.deepcopy``
of the model (an EMA copy) carries the hooks along, and in the copy they do nothing, so a copy is
never steered by the original's Freezer.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from freeze.blocks import Block, held_in_eval
from freeze.freezer import recompute
from freeze.names import FROZEN_MODES


class BlockOrderError(RuntimeError):
    """The blocks given to a Freezer are not in the order the forward pass runs them."""


class _Inert:
    """What a Freezer hook becomes in a copy of the model (deepcopy, pickle): nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __deepcopy__(self, memo: dict) -> _Inert:
        return self

    def __reduce__(self):
        return (_Inert, ())


class ModuleHook:
    """A forward (pre-)hook that runs ``fn`` for the module it was registered on and for no other.

    ``copy.deepcopy(model)`` copies each module's hook dictionaries; here the copy receives an inert
    hook, so it neither runs ``fn`` nor keeps the Freezer alive. Pickling (``torch.save(model)``)
    stores an inert hook too."""

    def __init__(self, module: nn.Module, fn: Callable[..., Any]):
        self._module = weakref.ref(module)
        self._fn = fn

    def __call__(self, module: nn.Module, *args: Any) -> Any:
        if module is not self._module():
            return None
        return self._fn(module, *args)

    def __deepcopy__(self, memo: dict) -> _Inert:
        return _Inert()

    def __reduce__(self):
        return (_Inert, ())


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_requires_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_requires_grad(v) for v in value.values())
    return False


class NoGradUnlessInputNeeds:
    """Pre- and post-hook of a frozen module that holds a parameter still training: no autograd
    inside it unless its input needs it. Only such modules carry hooks (a hook pair per frozen module
    was most of the engine's host time over the static limit: issue 49's bench). Grad mode: a stack,
    not a flag, as a module may be called again from inside its own forward."""

    def __init__(self) -> None:
        self._saved_modes: list[bool] = []

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._saved_modes.append(torch.is_grad_enabled())
        if not (_requires_grad(args) or _requires_grad(kwargs)):
            torch.set_grad_enabled(False)

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        # always_call=True: also runs when the forward raised, so grad mode is never left disabled.
        if self._saved_modes:
            torch.set_grad_enabled(self._saved_modes.pop())


class OrderCheck:
    """Records which block runs first, second, ... in a forward pass and raises as soon as a block
    runs for the first time after a block that comes later in the list."""

    def __init__(self, block_names: Sequence[str]):
        self.block_names = list(block_names)
        self.armed = False
        self._seen: set[int] = set()
        self._last = -1

    def arm(self) -> None:
        self.armed, self._seen, self._last = True, set(), -1

    def disarm(self) -> None:
        self.armed = False

    def block_runs(self, index: int) -> None:
        if not self.armed or index in self._seen:
            return
        self._seen.add(index)
        if index < self._last:
            self.armed = False
            raise BlockOrderError(
                f"Freezer: block '{self.block_names[index]}' (block {index}) ran after block "
                f"'{self.block_names[self._last]}' (block {self._last}); list the blocks in the order "
                "the forward pass runs them (split_blocks(model, names=[...]))"
            )
        self._last = index


class Steering:
    """The hooks a Freezer keeps on its model: those of the current boundary (frozen forwards,
    frozen norm layers in eval, activation checkpointing of trainable blocks), the block-order
    check until the first complete forward after each change, and a count of training forwards."""

    def __init__(self, model: nn.Module, blocks: Sequence[Block], grad_checkpointing: bool, frozen_mode: str = "eval"):
        if frozen_mode not in FROZEN_MODES:
            raise ValueError(
                f"Freezer: frozen_mode '{frozen_mode}' is not accepted; accepted: {', '.join(FROZEN_MODES)}"
            )
        self.model = model
        self.blocks = list(blocks)
        self.grad_checkpointing = grad_checkpointing
        self.frozen_mode = frozen_mode
        # What the user froze before handing the model over stays frozen, whatever the boundary.
        self.user_frozen = {id(p) for p in model.parameters() if not p.requires_grad}
        # Per block, the gradient bytes it all-reduces while it trains: fixed, as blocks and user_frozen are.
        self.block_grad_bytes: tuple[int, ...] = tuple(
            sum(p.numel() * p.element_size() for p in b.params if id(p) not in self.user_frozen) for b in self.blocks
        )
        self.order = OrderCheck([b.name for b in self.blocks])
        self._handles: list = []
        self._order_handles: list = []
        self._held: list[nn.Module] = []  # the frozen blocks' modules that run in eval
        self._train_forwards = 0
        self._count_handle = model.register_forward_pre_hook(ModuleHook(model, self._before_forward))

    def apply(self, boundary: int) -> None:
        """Steer blocks ``0 .. boundary-1`` as frozen and the rest as trainable."""
        _remove(self._handles)
        for i, block in enumerate(self.blocks):
            frozen = i < boundary
            for p in block.params:
                if id(p) not in self.user_frozen:
                    p.requires_grad_(not frozen)
                if frozen:
                    p.grad = None
            for mod in block.modules:
                if self.grad_checkpointing and not frozen:
                    recompute.enable_checkpointing(mod)
                else:
                    recompute.disable_checkpointing(mod)
        self._held = held_in_eval(self.blocks[:boundary], self.frozen_mode)
        self._hold_in_eval()
        if boundary:
            # Where the frozen prefix starts (blocks run in list order: OrderCheck), for a trainer that
            # calls a submodule of the model instead of the model (Lightning's training_step calling
            # self.net), whose forward pre-hook (_before_forward) then never runs.
            for mod in self.blocks[0].modules:
                self._handles.append(mod.register_forward_pre_hook(ModuleHook(mod, self._prefix_starts)))
        # After every block is steered: a frozen module whose parameter a trainable block owns.
        for mod in (mod for block in self.blocks[:boundary] for mod in block.modules):
            if any(p.requires_grad for p in mod.parameters()):
                hook = NoGradUnlessInputNeeds()
                pre, post = ModuleHook(mod, hook.pre), ModuleHook(mod, hook.post)
                self._handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
                self._handles.append(mod.register_forward_hook(post, always_call=True))
        self._arm_order_check()

    def _prefix_starts(self, module: nn.Module, args: tuple) -> None:
        self._hold_in_eval()

    def _hold_in_eval(self) -> None:
        """The frozen blocks' modules back in eval: a user's ``model.train()`` would switch a frozen
        norm layer back to batch statistics and running-stat updates (and frozen dropout back on)."""
        for m in self._held:
            if m.training:  # nn.Module's __setattr__ is slow; a write is needed only after a train()
                m.training = False

    def train(self, mode: bool) -> None:
        """``model.train(mode)``, then the frozen blocks back in eval (every module of them, or with
        ``frozen_mode="train"`` their norm layers with running statistics)."""
        self.model.train(mode)
        self._hold_in_eval()

    def trainable_grad_bytes(self, boundary: int) -> int:
        """Gradient bytes of the parameters that train at ``boundary`` (the user's frozen ones excluded)."""
        return sum(self.block_grad_bytes[boundary:])

    def warn_if_no_steps(self, epoch: int, steps_taken: int) -> None:
        """At the end of ``epoch``: a loop that forgot ``after_backward`` left the policy without
        gradients, silently unless the training forwards since the last epoch end say so."""
        forwards, self._train_forwards = self._train_forwards, 0
        if steps_taken:
            return
        if forwards:
            message = (
                f"epoch {epoch} ran {forwards} training forward passes but after_backward() was never called, so the "
                "policy saw no gradients and no bytes were counted; call freezer.after_backward() after "
                "loss.backward(), once per optimizer step"
            )
        else:
            message = f"epoch {epoch} ended without a training step; the policy decides on an empty interval"
        warnings.warn(f"Freezer: {message}", RuntimeWarning, stacklevel=3)  # the user's end_epoch call

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        """At the start of each forward of the model: the frozen blocks in eval, and a training forward counted."""
        self._hold_in_eval()
        if module.training and torch.is_grad_enabled():
            self._train_forwards += 1

    def _arm_order_check(self) -> None:
        # Registered after the frozen hooks: a check that raises leaves grad mode balanced.
        _remove(self._order_handles)
        # Armed by the model's own forward only: an activation cache runs the tail (and builds the
        # prefix) through modules of its own, whose block order is the traced model's by construction.
        self.order.disarm()
        start = ModuleHook(self.model, lambda m, a: self.order.arm())
        self._order_handles.append(self.model.register_forward_pre_hook(start))
        for i, block in enumerate(self.blocks):
            for mod in block.modules:
                runs = ModuleHook(mod, lambda m, a, i=i: self.order.block_runs(i))
                self._order_handles.append(mod.register_forward_pre_hook(runs))
        done = ModuleHook(self.model, lambda m, a, out: self._disarm_order_check())
        self._order_handles.append(self.model.register_forward_hook(done))

    def remove(self) -> None:
        """Take every hook off the model (a closed Freezer steers nothing; a new one adds its own)."""
        _remove(self._handles)
        _remove(self._order_handles)
        self._count_handle.remove()
        for block in self.blocks:
            for mod in block.modules:
                recompute.disable_checkpointing(mod)

    def _disarm_order_check(self) -> None:
        self.order.disarm()
        _remove(self._order_handles)


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def warn_if_no_epoch_ended(steps_taken: int, epochs_ended: int, boundary: int) -> None:
    """At ``close()``: optimizer steps were taken and ``end_epoch()`` was never called. Per-epoch
    policies decide only there, so the run never froze and exited as if freezing cost and saved
    nothing (a new user's ablation read it so); checkpoints record no completed epoch either."""
    if steps_taken and not epochs_ended:
        warnings.warn(
            f"Freezer: closed after {steps_taken} optimizer steps and end_epoch() was never called, so per-epoch "
            f"policies never decided (the boundary stayed at {boundary}); call freezer.end_epoch(epoch) after each "
            "epoch's last step (ignore this if you stopped within the first epoch on purpose)",
            RuntimeWarning,
            stacklevel=3,  # the user's close() call
        )


def warn_no_optimizer_state() -> None:
    """At ``training_state_dict()`` without an optimizer: a resume from it starts the optimizer
    afresh (momentum, Adam's moments) and trains differently from an uninterrupted run, silently."""
    warnings.warn(
        "Freezer: training_state_dict() holds no optimizer state because this Freezer has no optimizer; a "
        "resume from it restarts momentum and trains differently from an uninterrupted run. Pass "
        "optimizer= to Freezer(...) (or freezer.attach_optimizer(opt)), or save optimizer.state_dict() yourself",
        RuntimeWarning,
        stacklevel=3,  # the user's training_state_dict() call
    )
