"""A signal of your own: a per-block statistic of each evaluation interval that a policy reads, beside
the gradient statistics the monitor keeps (issue 47: a rule that needs a new signal touched 16 files;
with this seam it is one module with the signal and the policy, its page and its tests).

A policy declares the signals it reads in its :class:`~freeze.policies.Needs` (``signals=(MySignal,)``);
the Freezer's monitor makes one of each per run, calls :meth:`Signal.observe` after every observed
optimizer step (``Freezer.after_backward``: the gradients are all-reduced by then, still multiplied
by the loss scale it was given, and not checked for inf or NaN; a step declared skipped is not
observed) and :meth:`Signal.close` when an interval closes, and records the values in
``IntervalStats.signals[name]``, where ``decide`` reads them from its ``history``. Checkpoints keep
:meth:`Signal.state_dict`, so a resumed run reads the same values.

The contract, as for policies: every rank must compute the same values (read all-reduced gradients
or the weights, which DDP keeps equal; the Freezer broadcasts rank 0's decision anyway), and a step
should launch device work only: a host read per step (``.item()``, ``float(t)``) stalls a CUDA stream.
Torch-free here, so :mod:`freeze.policies` can name signals without importing torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from freeze.blocks import Block


class Signal(ABC):
    """One per-block statistic per interval; subclass it, name it and implement :meth:`close`.

    Example: docs/policies.md, "A signal of your own" (the relative weight change of each block)."""

    name: ClassVar[str] = ""  # the key in IntervalStats.signals

    def bind(self, blocks: Sequence[Block]) -> None:
        """Called once, when the monitor is built, with every block in forward order."""
        self.blocks = list(blocks)

    def observe(self, first_active: int, grad_scale: float | Any | None) -> None:  # noqa: B027 - optional
        """After each observed optimizer step; blocks before ``first_active`` are frozen. ``grad_scale``:
        the loss scale the gradients still carry (a float, GradScaler's scale tensor, or None:
        unscaled). A signal read only at close needs no observe."""

    @abstractmethod
    def close(self, first_active: int) -> Sequence[float | None]:
        """The interval's value per block (None where there is none); the monitor sets frozen blocks'
        to None. Called once per interval, on the host's clock: reading tensors here is fine."""

    def state_dict(self) -> dict:
        """What a resume needs to continue the running interval (tensors and plain values)."""
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 - stateless by default
        """Continue from :meth:`state_dict`."""


def check_signals(signals: Sequence[type], where: str) -> None:
    """ValueError (one line) unless ``signals`` are Signal subclasses with distinct, non-empty names.

    Args:
        signals: what a policy's ``Needs.signals`` declares.
        where: the policy's spec, for the message.
    """
    names = []
    for signal in signals:
        if not (isinstance(signal, type) and issubclass(signal, Signal)) or not signal.name:
            raise ValueError(
                f"policy '{where}': Needs.signals holds {signal!r}; accepted: subclasses of freeze.signals.Signal "
                "with a name"
            )
        names.append(signal.name)
    if len(set(names)) != len(names):
        raise ValueError(f"policy '{where}': Needs.signals names {', '.join(names)}; accepted: distinct names")
