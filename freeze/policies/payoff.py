"""``payoff``: the project's own rule - freeze the prefix whose saved step time outweighs the
gradient signal it would stop (issue 24).

The rules of the field (rules.py) decide from gradients or from the clock alone; none asks what a
freeze buys. On a link-bound cluster the answer is very uneven: a ResNet-18's last two blocks hold
75 % of the all-reduce bytes, its stem and layer1 under 2 %, so freezing the bottom half first costs
accuracy early and saves almost no time. This rule prices each candidate prefix ``0 .. j-1``:

    gain(j) = sum_{i = k .. j-1} share_i * (1 - exchange * signal_i)

``share_i``: block i's fraction of the parameter bytes that train (what its all-reduce and
optimizer step cost: the cost model's dominant term on a capped link, docs/costmodel.md).
``signal_i``: block i's gradient signal now relative to its own peak - the per-step norm of the
interval's summed gradient, averaged over the last ``window`` intervals, divided by the largest such
value the block has shown - so 1 while a block still learns as fast as it ever did and falling as it
settles. A block pays for its freeze when its signal is below 1 / ``exchange``, and is weighed by
its bytes, as the time its freeze saves is: the boundary moves to the j maximising gain(j) when
that gain is positive (the prefix whose byte-weighted signal is lowest against the bar), bottom-up
and never back.

What this assumes, and where it can be wrong: a block's learning is worth its bytes, so a small
block that still learns (a stem: 0.1 % of ResNet-18's bytes) is frozen with the heavy blocks above
it once they have settled. On ResNet-18 over a link the rule therefore freezes the whole body at
once (the top two blocks hold 75 % of the bytes); on a model of equal blocks it freezes the settled
leading run. How it was set: on the planted-boundary tasks and the study's search seeds only
(report/fdsl32-study.md); its one parameter, ``exchange``, by the study's search on validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from freeze.intervals import IntervalStats
from freeze.policies.base import Policy, PolicyError, Progress, param, register_policy


@register_policy
@dataclass(frozen=True)
class Payoff(Policy):
    """The project's rule (no paper): freeze the prefix whose byte-weighted gradient signal, relative
    to each block's peak, is furthest below 1 / ``exchange`` (module docstring)."""

    name: ClassVar[str] = "payoff"
    uses_gradients: ClassVar[bool] = True
    uses_block_bytes: ClassVar[bool] = True
    exchange: float = param(3.0, low=0.0, low_open=True)
    window: int = param(2, low=1)  # intervals averaged into a block's current signal
    min_intervals: int = param(3, low=2)  # a peak needs a few intervals before it means anything

    def decide(
        self,
        boundary: int,
        history: Sequence[IntervalStats],
        progress: Progress,
        num_blocks: int,
        *,
        block_bytes: Sequence[int] = (),
    ) -> int:
        self._check_call(boundary, num_blocks)
        shares = self.shares(block_bytes, num_blocks)
        if len(history) < self.intervals_needed or boundary >= num_blocks - 1:
            return boundary
        gains = self.gains(boundary, self.signals(history, num_blocks), shares, num_blocks)
        best = max(range(len(gains)), key=lambda i: (gains[i], i))
        return boundary + 1 + best if gains[best] > 0 else boundary

    def explain(
        self,
        boundary: int,
        history: Sequence[IntervalStats],
        progress: Progress,
        num_blocks: int,
        *,
        block_bytes: Sequence[int] = (),
    ) -> str:
        if len(history) < self.intervals_needed:
            return f"{len(history)} interval(s) closed; the peak needs {self.intervals_needed}"
        signals = self.signals(history, num_blocks)
        shown = " ".join("-" if s is None else f"{s:.2f}" for s in signals)
        gains = self.gains(boundary, signals, self.shares(block_bytes, num_blocks), num_blocks)
        best = " ".join(f"{g:+.3f}" for g in gains)
        return f"signal per block [{shown}], gain of freezing to k+1.. [{best}]"

    # ---------------------------------------------------------------- the rule's parts
    @property
    def intervals_needed(self) -> int:
        """Closed intervals before the first decision: a peak to compare with, and one full window."""
        return max(self.min_intervals, self.window)

    def shares(self, block_bytes: Sequence[int], num_blocks: int) -> list[float]:
        """Each block's fraction of the gradient bytes that train (``block_bytes``, from the Freezer)."""
        if len(block_bytes) != num_blocks or any(int(b) < 0 for b in block_bytes) or sum(block_bytes) <= 0:
            raise PolicyError(
                f"policy '{self.name}': block_bytes = {list(block_bytes)!r} with {num_blocks} blocks; "
                f"accepted: {num_blocks} non-negative byte counts, not all zero (the Freezer passes them)"
            )
        total = float(sum(block_bytes))
        return [int(b) / total for b in block_bytes]

    def signals(self, history: Sequence[IntervalStats], num_blocks: int) -> list[float | None]:
        """Per block: the mean per-step summed-gradient norm of the last ``window`` intervals over
        the block's peak of that mean; None for a block not observed in all of them."""
        per_step = []
        for stats in history:
            if len(stats.summed_grad_norm) != num_blocks:
                raise PolicyError(
                    f"policy '{self.name}': interval {stats.index} has {len(stats.summed_grad_norm)} "
                    f"block statistics; accepted: exactly num_blocks = {num_blocks}"
                )
            steps = max(stats.finite_steps, 1)
            per_step.append([None if g is None else g / steps for g in stats.summed_grad_norm])
        out: list[float | None] = []
        for block in range(num_blocks):
            column = [row[block] for row in per_step]
            smoothed = [_mean(column[end - self.window : end]) for end in range(self.window, len(column) + 1)]
            seen = [s for s in smoothed if s is not None]
            now = smoothed[-1]
            peak = max(seen) if seen else 0.0
            out.append(None if now is None or peak <= 0.0 else now / peak)
        return out

    def gains(
        self, boundary: int, signals: Sequence[float | None], shares: Sequence[float], num_blocks: int
    ) -> list[float]:
        """gain(j) for j = boundary + 1 .. L - 1; a block with bytes to train but no signal stops
        the prefix there (what cannot be priced is not frozen); one without (the user froze it) passes."""
        gains: list[float] = []
        total = 0.0
        for i in range(boundary, num_blocks - 1):
            if signals[i] is None and shares[i] > 0:
                break
            # a block with nothing to train (the user froze it) has share 0: it costs and saves nothing
            total += shares[i] * (1.0 - self.exchange * (signals[i] or 0.0))
            gains.append(total)
        return gains or [0.0]


def _mean(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values) / len(values)
