"""The type checks every config reader, file loader and loop call shares (torch-free).

``bool`` is a subclass of ``int`` in Python: without these, ``epochs = true`` in a TOML file or
``"nodes": true`` in a JSON file would silently mean 1."""

from __future__ import annotations

import numbers
import operator
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
