"""The two type checks every config reader and file loader shares (torch-free).

``bool`` is a subclass of ``int`` in Python: without these, ``epochs = true`` in a TOML file or
``"nodes": true`` in a JSON file would silently mean 1."""

from __future__ import annotations

import numbers
from typing import Any


def is_int(value: Any) -> bool:
    """An integer (Python's or numpy's), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An integer or a float (Python's or numpy's), never a bool; finiteness is the caller's check."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
