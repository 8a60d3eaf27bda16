"""The Freezer and its organs: the forward path (engine, dispatch), what a boundary does to the model
(steering, recompute), the run clock, the records it counts and checks, and the optimizer state it
drops (optimizer_state). Users import :class:`Freezer` (``from freeze import Freezer``); the organs
serve it, and a trainer integration reaches the engine through ``freezer.engine``."""

from freeze.freezer.freezer import Freezer

__all__ = ["Freezer"]
