"""What a Freezer counts and records: plain dataclasses, saved in its state_dict; and the checks a
saved training state (model, Freezer) passes before a Freezer loads any of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from freeze.blocks import Block
from freeze.checks import is_int
from freeze.comm import CommCounter
from freeze.monitor import IntervalStats
from freeze.policies import Policy
from freeze.policies.base import same_policy


@dataclass
class FreezerCounters:
    """What a Freezer counts, per rank. The step count lives here (the monitor is handed it); the
    byte total lives in the engine's comm counter, which the comm hook adds every bucket to, and is
    read from there (:attr:`allreduce_bytes_total`), not copied."""

    steps: int = 0  # optimizer steps seen by after_backward, skipped ones included
    skipped_steps: int = 0  # of those, steps the optimizer skipped (fp16 overflow)
    allreduce_bytes_last_step: int = 0  # what the comm counter counted between the last two steps
    rewraps: int = 0  # DDP constructions after the first
    rewrap_s_total: float = 0.0
    rewrap_s_last: float = 0.0
    wire: CommCounter = field(default_factory=CommCounter, init=False, repr=False, compare=False)
    _bytes_before_step: int = field(default=0, init=False, repr=False, compare=False)

    @property
    def allreduce_bytes_total(self) -> int:
        """Bytes handed to all-reduce since construction (the comm counter's count)."""
        return self.wire.allreduce_bytes_total

    def attach(self, wire: CommCounter) -> None:
        """Read the byte total from ``wire`` (the engine's comm counter); a step counts from its value now."""
        self.wire = wire
        self._bytes_before_step = wire.allreduce_bytes_total

    def count_step(self, skipped: bool) -> None:
        """One optimizer step (Freezer.after_backward): its bytes are what the wire counted since the last one."""
        self.steps += 1
        self.skipped_steps += int(skipped)
        self.allreduce_bytes_last_step = self.wire.allreduce_bytes_total - self._bytes_before_step
        self._bytes_before_step = self.wire.allreduce_bytes_total

    def state_dict(self) -> dict:
        """The saved form, as saved states have always had it: every count, the byte total included."""
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "allreduce_bytes_total": self.allreduce_bytes_total,
            "allreduce_bytes_last_step": self.allreduce_bytes_last_step,
            "rewraps": self.rewraps,
            "rewrap_s_total": self.rewrap_s_total,
            "rewrap_s_last": self.rewrap_s_last,
        }


@dataclass(frozen=True)
class Decision:
    interval: int
    epoch: int
    step: int
    boundary_before: int
    boundary_after: int


@dataclass(frozen=True)
class Evaluation(Decision):
    """A decision with what it read: the policy's signal in one line (kept for :meth:`Freezer.explain`)."""

    signal: str = ""

    def line(self) -> str:
        moved = (
            f"{self.boundary_before} -> {self.boundary_after}"
            if self.boundary_after != self.boundary_before
            else (f"stays {self.boundary_after}")
        )
        return f"interval {self.interval} (epoch {self.epoch}, step {self.step}): {self.signal}; boundary {moved}"


# What Freezer.state_dict writes; "cache" is optional (states written before the cache had none).
FREEZER_STATE_KEYS = ("boundary", "epochs_completed", "block_names", "policy_spec", "monitor", "decisions", "counters")


def _refuse(what: str) -> ValueError:
    return ValueError(f"Freezer.load_state_dict: {what}")


def check_saved_freezer(state: dict, block_names: list[str], policy: Policy) -> None:
    """Refuse a Freezer state saved for other blocks or another policy, one lacking an entry, or
    one whose boundary, epoch count, decisions or counters could not be applied; all before
    anything is loaded (a refusal halfway left the model or the boundary replaced)."""
    if not isinstance(state, dict):
        raise _refuse(f"the state is a {type(state).__name__}; accepted: a dict written by Freezer.state_dict()")
    missing = [key for key in FREEZER_STATE_KEYS if key not in state]
    if missing:
        raise _refuse(
            f"the state lacks {', '.join(repr(k) for k in missing)}; accepted: a dict written by Freezer.state_dict()"
        )
    if state["block_names"] != block_names:
        raise ValueError(
            f"Freezer.load_state_dict: checkpoint blocks {state['block_names']} differ from this model's {block_names}"
        )
    # A policy's parameters are its whole state (decisions are pure): equal policies, equal runs.
    if not same_policy(state["policy_spec"], policy):
        raise ValueError(
            f"Freezer.load_state_dict: checkpoint policy '{state['policy_spec']}' differs from '{policy.spec()}'"
        )
    boundary, head = state["boundary"], len(block_names) - 1
    if not is_int(boundary) or not 0 <= boundary <= head:
        raise _refuse(f"boundary = {boundary!r}; accepted: 0..{head} (the head, block {head}, is never frozen)")
    if not is_int(state["epochs_completed"]) or state["epochs_completed"] < 0:
        raise _refuse(f"epochs_completed = {state['epochs_completed']!r}; accepted: an integer >= 0")
    saved_records(state)


def saved_records(state: dict) -> tuple[list[Decision], FreezerCounters, int]:
    """The decisions, counters and all-reduced byte total of a saved Freezer state, or one line
    saying which entry is bad."""
    try:
        counters = {**state["counters"]}
        bytes_total = counters.pop("allreduce_bytes_total", 0)
        return [Decision(**d) for d in state["decisions"]], FreezerCounters(**counters), bytes_total
    except TypeError as e:  # a missing or unknown field, or not a mapping
        raise _refuse(
            f"its decisions or counters cannot be read ({e}); accepted: the entries Freezer.state_dict() writes"
        ) from None


def check_saved_training_state(state: dict, has_optimizer: bool) -> None:
    """Refuse a training state without its "model" and "freezer" entries, or with an optimizer
    entry for a Freezer without one, or the reverse."""
    missing = [key for key in ("model", "freezer") if not isinstance(state, dict) or key not in state]
    if missing:
        raise ValueError(
            f"Freezer.load_training_state_dict: the state lacks {', '.join(repr(k) for k in missing)}; "
            "accepted: a dict written by Freezer.training_state_dict()"
        )
    saved = "optimizer" in state
    if saved != has_optimizer:
        raise ValueError(
            f"Freezer.load_training_state_dict: the state {'has' if saved else 'lacks'} an 'optimizer' entry "
            f"and this Freezer {'has no' if saved else 'has an'} optimizer; build it as the saving run did"
        )


def check_saved_model(saved: dict, model: nn.Module) -> None:
    """Refuse a model state whose keys or tensor shapes differ from ``model``'s, before any tensor
    is copied (torch's own strict load copies tensors until the first mismatch)."""
    mine = model.state_dict()
    if not isinstance(saved, dict):
        raise ValueError(
            f"Freezer.load_training_state_dict: 'model' is a {type(saved).__name__}; accepted: a state dict"
        )
    missing, unexpected = [k for k in mine if k not in saved], [k for k in saved if k not in mine]
    if missing or unexpected:
        lacks = [f"lacks {_names(missing)}"] if missing else []
        extra = [f"has {_names(unexpected)} this model does not"] if unexpected else []
        raise ValueError(
            f"Freezer.load_training_state_dict: the checkpoint's model {' and '.join(lacks + extra)}; "
            "accepted: the state of the same architecture"
        )
    shapes = [
        f"{k} {_shape(saved[k])} vs {_shape(t)}"
        for k, t in mine.items()
        if isinstance(t, torch.Tensor) and _shape(saved[k]) != _shape(t)
    ]
    if shapes:
        raise ValueError(
            f"Freezer.load_training_state_dict: {len(shapes)} tensors differ in shape from this model's "
            f"(checkpoint vs model: {'; '.join(shapes[:3])}); accepted: the state of the same architecture"
        )


def _shape(value) -> tuple[int, ...] | str:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return f"{len(keys)} keys ({shown})"


# What GradNormMonitor.state_dict writes and its load_state_dict needs (the overflow entries are
# optional: checkpoints written before overflow detection have none).
MONITOR_STATE_KEYS = (
    "history",
    "total_steps",
    "first_active",
    "interval_steps",
    "interval_skipped_steps",
    "block_steps",
    "summed",
    "norm_sum",
)


def check_saved_monitor(state: dict, blocks: Sequence[Block]) -> None:
    """Refuse a saved monitor state the monitor over ``blocks`` cannot continue from: an entry
    missing, a history it cannot read, or counts and sums for other blocks or parameters."""

    def refuse(what: str) -> ValueError:
        return _refuse(f"the monitor's {what}; accepted: the state of a monitor over these blocks")

    if not isinstance(state, dict) or any(key not in state for key in MONITOR_STATE_KEYS):
        raise refuse(f"state lacks an entry of {', '.join(MONITOR_STATE_KEYS)}")
    for key in ("total_steps", "interval_steps", "interval_skipped_steps"):
        if not is_int(state[key]) or state[key] < 0:
            raise refuse(f"{key} = {state[key]!r}, not an integer >= 0")
    try:
        for d in state["history"]:
            IntervalStats.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise refuse(f"history cannot be read ({type(e).__name__}: {e})") from None
    num_blocks = len(blocks)
    if not isinstance(state["block_steps"], list | tuple) or len(state["block_steps"]) != num_blocks:
        raise refuse(f"block_steps do not hold one count per block ({num_blocks})")
    if not is_int(state["first_active"]) or not 0 <= state["first_active"] < num_blocks:
        raise refuse(f"first_active = {state['first_active']!r} with {num_blocks} blocks")
    shapes = [p.shape for b in blocks for p in b.params]  # the monitor's flat parameter order
    if not isinstance(state["summed"], dict):
        raise refuse("summed gradients are not a dict")
    for pos, t in state["summed"].items():
        fits = is_int(pos) and 0 <= pos < len(shapes) and isinstance(t, torch.Tensor) and t.shape == shapes[pos]
        if not fits:
            raise refuse(f"summed gradient of parameter {pos!r} does not fit this model's")
    for key in ("norm_sum", "overflows"):
        saved = state.get(key)
        if saved is not None and (not isinstance(saved, torch.Tensor) or saved.shape != (num_blocks,)):
            raise refuse(f"{key} is not a tensor of {num_blocks} per-block values")
