"""What one evaluation interval measured, and the gradient-norm arithmetic policies read: torch-free,
so that :mod:`freeze.policies`, a config and the report read policies without importing torch. The
monitor that fills these records lives in :mod:`freeze.monitor`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class IntervalStats:
    """What the monitor measured over one evaluation interval. ``None`` marks a block that was
    frozen (not observed) during the interval."""

    index: int  # 0-based interval number
    epoch: int  # 0-based epoch in which the interval ended
    end_step: int  # optimizer steps completed when the interval ended
    steps: int  # optimizer steps in the interval, skipped ones included
    skipped_steps: int  # of those, steps whose gradients were not observed (fp16 overflow)
    boundary: int  # boundary k in force when the interval ended
    summed_grad_norm: tuple[float | None, ...]  # L2
    summed_grad_l1_norm: tuple[float | None, ...]
    mean_step_grad_norm: tuple[float | None, ...]  # L2
    # Per block, the loss its movement over the last span removed, by the trapezoid rule
    # (freeze.descent); set at the closes that end a span. Empty unless the monitor tracks it
    # (track_descent); None for a block not trained through the span and the intervals around it.
    descent: tuple[float | None, ...] = ()
    # The loss on a fixed held-out subset, measured at this interval's close when the policy asked
    # for it (Freezer(probe=...)); None otherwise.
    held_out_loss: float | None = None
    # The values of the signals the policy declared (freeze.signals), per block, by signal name.
    signals: dict[str, tuple[float | None, ...]] = field(default_factory=dict, hash=False)

    @property
    def finite_steps(self) -> int:
        """Steps whose gradients the sums hold: the interval's steps less the skipped (masked) ones."""
        return self.steps - self.skipped_steps

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> IntervalStats:
        """The inverse of :meth:`to_dict`.

        Args:
            d: a dict written by :meth:`to_dict` (e.g. read back from a checkpoint).
        """
        return cls(
            index=int(d["index"]),
            epoch=int(d["epoch"]),
            end_step=int(d["end_step"]),
            steps=int(d["steps"]),
            skipped_steps=int(d["skipped_steps"]),
            boundary=int(d["boundary"]),
            summed_grad_norm=tuple(d["summed_grad_norm"]),
            summed_grad_l1_norm=tuple(d["summed_grad_l1_norm"]),
            mean_step_grad_norm=tuple(d["mean_step_grad_norm"]),
            # .get: intervals saved before these statistics existed have neither
            descent=tuple(d.get("descent", ())),
            held_out_loss=None if d.get("held_out_loss") is None else float(d["held_out_loss"]),
            signals={str(name): tuple(values) for name, values in d.get("signals", {}).items()},
        )


NORMS: tuple[str, ...] = ("l1", "l2")


def summed_norms(stats: IntervalStats, norm: str = "l2") -> tuple[float | None, ...]:
    """The per-block norms of the interval's summed gradient, ``norm`` in :data:`NORMS`."""
    if norm not in NORMS:
        raise ValueError(f"norm: '{norm}' is not accepted; accepted: {', '.join(NORMS)}")
    return stats.summed_grad_l1_norm if norm == "l1" else stats.summed_grad_norm


def relative_change(prev: IntervalStats, cur: IntervalStats, norm: str = "l2") -> list[float | None]:
    """eta_l = |G_prev - G_cur| / G_prev per block (AutoFreeze's gradient-norm change), G the
    ``norm`` ("l1" or "l2") of the summed gradient per finite step.

    Per finite step: an interval whose non-finite (fp16 overflow, NaN) steps were masked sums fewer
    gradients, and its raw sum read as a large change (2 NaN steps in an epoch moved AutoFreeze's
    and CS744's decisions). Where both intervals have the same finite step count it cancels, and
    eta is computed from the raw sums, bit for bit as before.

    Args:
        prev: the earlier interval.
        cur: the later interval; both must come from the same blocks.

    Returns:
        One value per block, computed from ``summed_grad_norm``; ``None`` where either interval did
        not observe the block or G_prev is zero/non-finite.
    """
    n_prev, n_cur = prev.finite_steps, cur.finite_steps
    out: list[float | None] = []
    for g_prev, g_cur in zip(summed_norms(prev, norm), summed_norms(cur, norm)):
        if g_prev is None or g_cur is None or not math.isfinite(g_prev) or g_prev <= 0.0:
            out.append(None)
        elif n_prev == n_cur:
            out.append(abs(g_prev - g_cur) / g_prev)
        elif n_prev <= 0 or n_cur <= 0:  # only masked steps: no statistic (the sums are None then anyway)
            out.append(None)
        else:
            per_step_prev, per_step_cur = g_prev / n_prev, g_cur / n_cur
            out.append(abs(per_step_prev - per_step_cur) / per_step_prev)
    return out
