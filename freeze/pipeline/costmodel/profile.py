"""A measured compute profile of one model on one node: per-block forward and backward ms, gradient
and activation bytes, cache read ms, and what runs after the backward, at one batch size and thread
count. :mod:`freeze.pipeline.costmodel.profiler` measures it; this module holds it and reads/writes it as
JSON (``format: freeze-costmodel-profile/1``)::

    format, model, batch_size, threads        the node's batch and torch thread count
    nodes_per_core                            profiled processes that shared one core (1: own cores)
    optimizer                                 e.g. "sgd(momentum=0.9)"
    forward_overhead_ms                       step start -> first block (zero_grad, DDP pre-forward)
    after_backward_ms: [per boundary k]       last gradient -> end of step at boundary k: DDP's copy
                                              of the buckets into .grad, the Freezer's monitor, the
                                              optimizer step
    blocks: [{name,
              param_bytes: [...],             each parameter's gradient bytes, registration order
              buffer_bytes,                   buffers DDP broadcasts each forward while trainable
              activation_bytes_per_sample,    the block's input: a cache at boundary = this block
              forward_ms,                     with autograd recording (trainable)
              forward_frozen_ms,              under no_grad (frozen); null for the last block
              backward_ms,                    with the input gradient (an earlier block trains too);
                                              null for block 0, which never needs it
              backward_first_ms,              as the first trainable block (no input gradient)
              cache_read_ms}]                 reading a batch of cached inputs; null for block 0
    meta                                      how it was measured (steps, load, cores, host)
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from freeze._atomic import atomic_write_json
from freeze.checks import is_int, is_number

PROFILE_FORMAT = "freeze-costmodel-profile/1"


class ProfileError(ValueError):
    """A profile that cannot be used; the message is one line naming the field."""


@dataclass(frozen=True)
class BlockCost:
    name: str
    param_bytes: tuple[int, ...]
    buffer_bytes: int
    activation_bytes_per_sample: int
    forward_ms: float
    forward_frozen_ms: float | None
    backward_ms: float | None
    backward_first_ms: float
    cache_read_ms: float | None

    @property
    def grad_bytes(self) -> int:
        return sum(self.param_bytes)


@dataclass(frozen=True)
class Profile:
    model: str
    batch_size: int
    threads: int
    nodes_per_core: int
    optimizer: str
    forward_overhead_ms: float
    after_backward_ms: tuple[float, ...]
    blocks: tuple[BlockCost, ...]
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check_profile(self)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def grad_bytes(self, k: int) -> int:
        """Gradient bytes a step all-reduces at boundary ``k`` (blocks k.. trainable).

        Args:
            k: the boundary.
        """
        return sum(b.grad_bytes for b in self.blocks[k:])


# Upper bounds of a measured cost: an hour for one block's part of one step, a pebibyte for one block's
# bytes. Anything above is a hand edit, and would reach the workers as an infinite price (1e308 ms).
MAX_MS = 3.6e6
MAX_BYTES = float(1 << 50)


def _number(value, where: str, minimum: float = 0.0, none_ok: bool = False, maximum: float = MAX_MS) -> None:
    if value is None and none_ok:
        return
    if not is_number(value) or not math.isfinite(value) or not minimum <= value <= maximum:
        raise ProfileError(f"profile {where}: expected a number from {minimum:g} to {maximum:g}, got {value!r}")


def _check_meta_layout(layout) -> None:
    """meta.layout, when recorded: one {"cores": [core, ...], "threads": n} per process (the pricing
    compares it with the run's, so a string where a number belongs would read as another layout)."""
    if layout is None:
        return
    accepted = 'a list of {"cores": [integers >= 0], "threads": integer >= 1}, one per process'
    if not isinstance(layout, list) or not layout:
        raise ProfileError(f"profile meta.layout: expected {accepted}, got {layout!r}")
    for i, node in enumerate(layout):
        cores = node.get("cores") if isinstance(node, dict) else None
        threads = node.get("threads") if isinstance(node, dict) else None
        if (
            not isinstance(cores, list)
            or not cores
            or any(not is_int(c) or c < 0 for c in cores)
            or not is_int(threads)
            or threads < 1
        ):
            raise ProfileError(f"profile meta.layout[{i}]: expected {accepted}, got {node!r}")


def _check_profile(p: Profile) -> None:
    for name in ("batch_size", "threads", "nodes_per_core"):
        value = getattr(p, name)
        if not is_int(value) or value < 1:
            raise ProfileError(f"profile {name}: expected an integer >= 1, got {value!r}")
    if len(p.blocks) < 1:
        raise ProfileError("profile blocks: expected at least one block")
    if len(p.after_backward_ms) != len(p.blocks):
        raise ProfileError(
            f"profile after_backward_ms: expected one value per boundary ({len(p.blocks)}), got {len(p.after_backward_ms)}"
        )
    _number(p.forward_overhead_ms, "forward_overhead_ms")
    for k, ms in enumerate(p.after_backward_ms):
        _number(ms, f"after_backward_ms[{k}]")
    last = len(p.blocks) - 1
    for i, b in enumerate(p.blocks):
        where = f"blocks[{i}] ({b.name})"
        if not b.param_bytes or any(not is_int(n) or not 0 <= n <= MAX_BYTES for n in b.param_bytes):
            raise ProfileError(
                f"profile {where}.param_bytes: expected a non-empty list of integers from 0 to {MAX_BYTES:g}"
            )
        for key in ("forward_ms", "backward_first_ms"):
            _number(getattr(b, key), f"{where}.{key}")
        _number(b.buffer_bytes, f"{where}.buffer_bytes", maximum=MAX_BYTES)
        _number(b.activation_bytes_per_sample, f"{where}.activation_bytes_per_sample", maximum=MAX_BYTES)
        # The last block is never frozen, block 0 never needs an input gradient, and a cache at
        # boundary 0 would hold the inputs themselves: those three are null, every other is a number.
        _number(b.forward_frozen_ms, f"{where}.forward_frozen_ms", none_ok=i == last)
        _number(b.backward_ms, f"{where}.backward_ms", none_ok=i == 0)
        _number(b.cache_read_ms, f"{where}.cache_read_ms", none_ok=True)
    if not isinstance(p.meta, dict):
        raise ProfileError(f"profile meta: expected an object (how it was measured), got {p.meta!r}")
    _check_meta_layout(p.meta.get("layout"))


def profile_to_dict(p: Profile) -> dict:
    d = asdict(p)
    return {"format": PROFILE_FORMAT, **d}


def profile_from_dict(d: dict, where: str = "profile") -> Profile:
    """The inverse of :func:`profile_to_dict`, checking every field.

    Args:
        d: parsed JSON.
        where: a name for error messages (the file).
    """
    if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ProfileError(f"{where}: format {got!r}, expected {PROFILE_FORMAT!r}")
    try:
        blocks = tuple(
            BlockCost(
                name=str(b["name"]),
                param_bytes=tuple(b["param_bytes"]),
                buffer_bytes=b["buffer_bytes"],
                activation_bytes_per_sample=b["activation_bytes_per_sample"],
                forward_ms=b["forward_ms"],
                forward_frozen_ms=b["forward_frozen_ms"],
                backward_ms=b["backward_ms"],
                backward_first_ms=b["backward_first_ms"],
                cache_read_ms=b["cache_read_ms"],
            )
            for b in d["blocks"]
        )
        return Profile(
            model=str(d["model"]),
            batch_size=d["batch_size"],
            threads=d["threads"],
            nodes_per_core=d["nodes_per_core"],
            optimizer=str(d["optimizer"]),
            forward_overhead_ms=d["forward_overhead_ms"],
            after_backward_ms=tuple(d["after_backward_ms"]),
            blocks=blocks,
            meta=d.get("meta") or {},
        )
    except KeyError as e:
        raise ProfileError(f"{where}: key {e} is missing") from None
    except TypeError as e:
        raise ProfileError(f"{where}: malformed ({e})") from None
    except ProfileError as e:
        raise ProfileError(f"{where}: {e}") from None


def save_profile(p: Profile, path: str | Path) -> None:
    """Write ``p`` as JSON, atomically; an existing file is refused (measurements are never overwritten).

    Args:
        p: the profile.
        path: the JSON file to create; its directory is created if missing.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"profile: {path} exists; profiles are never overwritten: choose another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, profile_to_dict(p))


def load_profile(path: str | Path) -> Profile:
    """Read a profile JSON written by :func:`save_profile`.

    Args:
        path: the file.
    """
    path = Path(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ProfileError(f"{path}: not a readable profile ({e})") from None
    return profile_from_dict(d, str(path))


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of no values")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# A profile whose whole-step times at some boundary spread more than this (interquartile range over
# the timed steps, relative to their median: unlike the range, it does not grow with more steps) is
# called too noisy to rank boundaries: a newcomer's 3-step profile on a loaded machine priced one
# frozen block at 0.50x the step time, between 1.5x and 2.4x neighbours, without a word (research
# note newcomer.md, F-C8).
NOISY_STEP_SPREAD = 0.10


def step_spreads(p: Profile) -> list[float] | None:
    """Each boundary's whole-step spread, (q3 - q1) / median over the timed steps; None for a profile
    written before spreads were recorded."""
    recorded = p.meta.get("step_ms")
    if not isinstance(recorded, list) or len(recorded) != p.num_blocks:
        return None
    if not all(isinstance(r, dict) and {"q1", "median", "q3"} <= set(r) for r in recorded):
        return None
    return [(r["q3"] - r["q1"]) / r["median"] if r["median"] > 0 else math.inf for r in recorded]


def noise_warnings(p: Profile, where: str = "profile") -> list[str]:
    """One line when ``p`` is too noisy to rank boundaries (or says nothing about its noise), else none."""
    spreads = step_spreads(p)
    if spreads is None:
        return [
            f"{where}: records no spread of its step times (written by an older version): its ranking of "
            "boundaries has no noise check; profile again to get one"
        ]
    worst = max(range(len(spreads)), key=spreads.__getitem__)
    if spreads[worst] <= NOISY_STEP_SPREAD:
        return []
    steps = p.meta.get("steps", "its")
    return [
        f"{where}: too noisy to rank boundaries: the step time at boundary {worst} spread "
        f"{spreads[worst]:.0%} (interquartile range over median, {steps} timed steps; the limit is "
        f"{NOISY_STEP_SPREAD:.0%}); predictions that differ by less than that are not a ranking: profile again "
        "on an idle machine"
    ]
