"""What a Freezer counts and records: plain dataclasses, saved in its state_dict."""

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
