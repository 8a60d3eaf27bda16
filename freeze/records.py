"""What a Freezer counts and records: plain dataclasses, saved in its state_dict; and the checks a
saved state passes before a Freezer loads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FreezerCounters:
    steps: int = 0  # optimizer steps seen by after_backward, skipped ones included
    skipped_steps: int = 0  # of those, steps the optimizer skipped (fp16 overflow)
    allreduce_bytes_total: int = 0  # per rank, since construction
    allreduce_bytes_last_step: int = 0
    rewraps: int = 0  # DDP constructions after the first
    rewrap_s_total: float = 0.0
    rewrap_s_last: float = 0.0


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


def check_saved_freezer(state: dict, block_names: list[str], policy_spec: str) -> None:
    """Refuse a Freezer state saved for other blocks or another policy."""
    if state["block_names"] != block_names:
        raise ValueError(
            f"Freezer.load_state_dict: checkpoint blocks {state['block_names']} differ from this model's {block_names}"
        )
    # A policy's parameters are its whole state (decisions are pure): equal specs, equal policies.
    if state["policy_spec"] != policy_spec:
        raise ValueError(
            f"Freezer.load_state_dict: checkpoint policy '{state['policy_spec']}' differs from '{policy_spec}'"
        )


def check_saved_training_state(state: dict, has_optimizer: bool) -> None:
    """Refuse a training state with an optimizer entry for a Freezer without one, or the reverse."""
    saved = "optimizer" in state
    if saved != has_optimizer:
        raise ValueError(
            f"Freezer.load_training_state_dict: the state {'has' if saved else 'lacks'} an 'optimizer' entry "
            f"and this Freezer {'has no' if saved else 'has an'} optimizer; build it as the saving run did"
        )
