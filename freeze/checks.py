"""The vocabulary every reader of settings shares, torch-free: the application's config and the
policies' specs check a value, name its accepted range and suggest a name the same way, so one
message reads alike wherever it comes from.

``bool`` is a subclass of ``int`` in Python: without the type checks, ``epochs = true`` in a TOML
file or ``"nodes": true`` in a JSON file would silently mean 1."""

from __future__ import annotations

import difflib
import numbers
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


def is_int(value: Any) -> bool:
    """An integer (Python's or numpy's), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An integer or a float (Python's or numpy's), never a bool; finiteness is the caller's check."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def as_int(value: Any, field: str) -> int:
    """``value`` as a Python int when it is integer-like: an int, a numpy integer or a 0-d integer
    array / tensor (what ``operator.index`` takes); never a bool, a float or a longer tensor.

    A numpy or tensor integer kept as it is would end up in a Freezer's state, which then fails
    ``torch.load(..., weights_only=True)``; a float (``0.0``) would compare equal to an int and be
    stored as a float.

    Args:
        value: what the caller passed.
        field: who took it and the argument's name, e.g. ``"Freezer.end_epoch: epoch"``.

    Raises:
        ValueError: one line naming ``field`` and the accepted values.
    """
    is_bool = isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")
    if not is_bool and getattr(value, "ndim", 0) == 0:
        try:
            return operator.index(value)
        except TypeError:
            pass
    # A longer array's repr spans lines; the message stays one line.
    shown = repr(value) if getattr(value, "ndim", 0) == 0 else f"a {type(value).__name__} of shape {tuple(value.shape)}"
    raise ValueError(
        f"{field} = {shown}; accepted: an integer (int, numpy integer or 0-d integer tensor), not a bool or a float"
    )


@dataclass(frozen=True)
class Range:
    """Closed (``ge``, ``le``) or open (``gt``, ``lt``) bounds of a numeric setting."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def contains(self, value: float) -> bool:
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def describe(self) -> str:
        """``"in [0, 1)"``, ``">= 1"``, ``"< 5"``; "" when unbounded."""
        low = self.ge if self.ge is not None else self.gt
        high = self.le if self.le is not None else self.lt
        if low is not None and high is not None:
            opening, closing = "[" if self.ge is not None else "(", "]" if self.le is not None else ")"
            return f"in {opening}{_number(low)}, {_number(high)}{closing}"
        if low is not None:
            return f"{'>=' if self.ge is not None else '>'} {_number(low)}"
        if high is not None:
            return f"{'<=' if self.le is not None else '<'} {_number(high)}"
        return ""


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def did_you_mean(word: Any, accepted: Iterable[str], show: Callable[[str], str] = repr) -> str:
    """`` (did you mean 'x'?)`` for the accepted name closest to ``word``; "" when none is close."""
    close = difflib.get_close_matches(str(word), list(accepted), n=1)
    return f" (did you mean {show(close[0])}?)" if close else ""


def spell(value: Any) -> str:
    """A value as a TOML file or a spec spells it: ``true``/``false``, a float's shortest exact
    repr, a list in brackets; other values as ``str``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(spell(v) for v in value) + "]"
    return str(value)
