"""The registration a plugin module makes by name (``register_model``, ``register_dataset``): one
rule for both, so a model and a dataset of your own are refused alike (docs/plugins.md)."""

from __future__ import annotations

from collections.abc import Callable, Collection, MutableMapping
from typing import TypeVar

Builder = TypeVar("Builder", bound=Callable)


def registration(
    decorator: str,
    name: str,
    table: MutableMapping[str, Callable],
    reserved: Callable[[], Collection[str]],
    reserved_as: str,
    error: type[Exception],
) -> Callable[[Builder], Builder]:
    """The decorator that puts a builder into ``table`` under ``name``.

    Args:
        decorator: its public name, for messages ("register_model").
        name: the name the config will use.
        table: the registry.
        reserved: the names the pipeline has of its own (asked when the builder is registered).
        reserved_as: what a reserved name is, for messages ("a torchvision model").
        error: the one-line error type of the registry's module.

    Raises:
        error: the name is empty, reserved, or another builder's (re-registering the same builder,
            as a module imported twice does, is accepted).
    """
    if not isinstance(name, str) or not name.strip():
        raise error(f"{decorator}: name {name!r}; accepted: a non-empty name")

    def register(builder: Builder) -> Builder:
        if name in reserved():
            raise error(f"{decorator}: {name!r} is {reserved_as}; accepted: a name of your own")
        if table.get(name, builder) is not builder:
            raise error(f"{decorator}: {name!r} is already registered by {table[name]!r}; accepted: a new name")
        table[name] = builder
        return builder

    return register
