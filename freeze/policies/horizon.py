"""``horizon``: freeze the prefix whose saving over the rest of the run outweighs the learning it
stops, both priced over the run that is left; a held-out check on probation can undo it (issue 37).

For each candidate boundary j above the current one, k, at step t of T:

    saved(j) = ([c(k) - c(j)] * (T - t) - rewrap - build(j)) / (c(0) * T)
    lost(j)  = R(t) * sum_{i = k .. j-1} rate_i
    score(j) = saved(j) - exchange * lost(j)

``c(k)``: the predicted seconds of one step at boundary k on the machine and link the run is on
(``Pricing.step_time_s``: the pipeline takes it from the cost model, freeze.pipeline.costmodel, with
the activation cache where the run has one), so the saving is right on loopback, over a capped link
and on a GPU alike; ``saved`` is a share of the whole run's time at k = 0. ``rate_i``: the
training loss block i's updates remove per unit of learning rate, measured from its displacement over
``span`` intervals and the mean gradients just before and after them (freeze.descent, the trapezoid
rule: whatever the optimizer), averaged over the last ``window`` estimates and taken as 0 when negative. ``R(t)``: the learning rate still to be spent, the sum of the
schedule's LR over the steps left (``Pricing.lr_per_step``). So ``lost`` is, to first order, the
training loss the frozen blocks would still have removed, in nats: independent of the interval
length and the batch size, and it shrinks as the schedule decays (a freeze at 0.85 of a cosine
run stops 0.5 % of its LR, one at 0.65 6.6 %). ``exchange``: the share of the run's time one nat of
training loss is worth. The boundary moves to the j with the largest positive score, a prefix, so the
activation cache stays exact.

Probation (``probation`` intervals, 0 = off): when the rule proposes a freeze, the Freezer first
measures the loss on a fixed held-out subset (``Freezer(probe=...)``); at each of the next
``probation`` intervals it measures it again, and when every one of those checks is above the
pre-freeze loss by more than ``tolerance`` (a relative rise that persists, not one bump: a single
interval's held-out loss rose 7 % mid-run in development with nothing frozen that mattered) the
freeze is undone at the last: the blocks train again, and no freeze is proposed for ``hold_off``
intervals, doubled at every further undo (the undone blocks also need ``window`` fresh rates, one every
span + 1 intervals, before they can be priced again). The check catches a freeze that breaks
training (a cliff), not one that merely stops it from improving: a frozen prefix's held-out loss
usually goes on falling while the head trains.

Everything the rule reads is in the monitor's history (descent and held-out loss per interval), the
run's progress and the pricing: a pure function, so ranks agree and a resumed run decides as the
one that saved it did.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from freeze.intervals import IntervalStats
from freeze.policies.base import Policy, PolicyError, Progress, param, register_policy


@dataclass(frozen=True)
class Pricing:
    """What a freeze costs and saves in seconds, for a policy that prices its freezes
    (``policy.uses_pricing``); given to the Freezer as ``pricing=``.

    Args:
        step_time_s: predicted seconds of one optimizer step at each boundary k = 0 .. L-1.
        lr_per_step: the learning rate of every optimizer step of the run, in order (its length
            is the run's steps); for several parameter groups, the one the blocks train with.
        rewrap_s: seconds one boundary change costs beyond its steps (the DDP rebuild and its
            first, unbucketed step).
        build_s: seconds to build the activation cache at each boundary (empty: no cache, or free).
    """

    step_time_s: tuple[float, ...]
    lr_per_step: tuple[float, ...]
    rewrap_s: float = 0.0
    build_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_time_s", tuple(float(v) for v in self.step_time_s))
        object.__setattr__(self, "lr_per_step", tuple(float(v) for v in self.lr_per_step))
        object.__setattr__(self, "build_s", tuple(float(v) for v in self.build_s))
        object.__setattr__(self, "rewrap_s", float(self.rewrap_s))
        if not self.step_time_s or not all(math.isfinite(v) and v > 0 for v in self.step_time_s):
            raise ValueError(
                f"Pricing: step_time_s = {list(self.step_time_s)!r}; accepted: seconds > 0, one per boundary"
            )
        if not self.lr_per_step or not all(math.isfinite(v) and v >= 0 for v in self.lr_per_step):
            raise ValueError(
                "Pricing: lr_per_step holds a negative or non-finite rate, or none; accepted: one LR >= 0 per step"
            )
        if not (math.isfinite(self.rewrap_s) and self.rewrap_s >= 0):
            raise ValueError(f"Pricing: rewrap_s = {self.rewrap_s!r}; accepted: seconds >= 0")
        if not all(math.isfinite(v) and v >= 0 for v in self.build_s):
            raise ValueError(f"Pricing: build_s = {list(self.build_s)!r}; accepted: seconds >= 0, one per boundary")

    def check(self, num_blocks: int, steps_total: int) -> None:
        """Refuse pricing for another model or run length, in one line."""
        if len(self.step_time_s) != num_blocks:
            raise ValueError(
                f"Pricing: step_time_s has {len(self.step_time_s)} entries for {num_blocks} blocks; "
                f"accepted: one per boundary 0..{num_blocks - 1}"
            )
        if self.build_s and len(self.build_s) != num_blocks:
            raise ValueError(f"Pricing: build_s has {len(self.build_s)} entries; accepted: none or {num_blocks}")
        if len(self.lr_per_step) != steps_total:
            raise ValueError(
                f"Pricing: lr_per_step has {len(self.lr_per_step)} entries for a run of {steps_total} steps; "
                "accepted: one per optimizer step (epochs x steps_per_epoch)"
            )

    def remaining_lr(self, steps_completed: int) -> float:
        """R(t): the learning rate the schedule has still to spend after ``steps_completed`` steps."""
        return math.fsum(self.lr_per_step[steps_completed:])

    def lr_between(self, start_step: int, end_step: int) -> float:
        """The learning rate spent by steps ``start_step .. end_step - 1``."""
        return math.fsum(self.lr_per_step[max(start_step, 0) : end_step])


@register_policy
@dataclass(frozen=True)
class Horizon(Policy):
    """The project's second rule (no paper): the prefix whose saved share of the run outweighs,
    at ``exchange``, the training loss its blocks would still remove over the LR left; undone on
    probation by a held-out check (module docstring)."""

    name: ClassVar[str] = "horizon"
    uses_gradients: ClassVar[bool] = True
    needs_run_length: ClassVar[bool] = True
    may_unfreeze: ClassVar[bool] = True  # the probation's undo
    uses_pricing: ClassVar[bool] = True
    uses_descent: ClassVar[bool] = True
    # the share of the run's time one nat of training loss is worth (set in development: docs/horizon.md)
    exchange: float = param(10.0, low=0.0, low_open=True)
    window: int = param(2, low=1)  # descent estimates averaged into a block's rate
    span: int = param(3, low=1)  # intervals a descent's displacement spans (freeze.descent): one estimate per span + 1
    probation: int = param(2, low=0)  # intervals of held-out checks after a freeze; 0: none
    tolerance: float = param(0.02, low=0.0)  # relative rise of every check that undoes a freeze
    hold_off: int = param(2, low=1)  # intervals without a freeze after an undo; doubled per undo

    @property
    def intervals_needed(self) -> int:
        """Closed intervals before the first rates: ``window`` descent estimates, one every span + 1."""
        return self.window * (self.span + 1) + 1

    @property
    def descent_span(self) -> int:
        return self.span

    @property
    def uses_probe(self) -> bool:
        """Whether the Freezer must measure held-out losses for this policy (``probe=``)."""
        return self.probation > 0

    def decide(
        self,
        boundary: int,
        history: Sequence[IntervalStats],
        progress: Progress,
        num_blocks: int,
        *,
        pricing: Pricing | None = None,
    ) -> int:
        self._check_call(boundary, num_blocks)
        pricing = self._checked(pricing, num_blocks, progress)
        undo = self.undo_to(boundary, history)
        if undo is not None:
            return undo
        j, _ = self.best_prefix(boundary, history, progress, num_blocks, pricing)
        if j is None:
            return boundary
        if self.uses_probe and history[-1].held_out_loss is None:
            raise PolicyError(
                f"policy '{self.name}': a freeze on probation needs the held-out loss at the interval that "
                "proposes it; accepted: a Freezer built with probe=..., or probation=0"
            )
        if self.uses_probe and not math.isfinite(history[-1].held_out_loss):
            return boundary  # a diverging run (held-out loss nan or inf): nothing to check a freeze against
        return j

    def wants_probe(
        self,
        boundary: int,
        history: Sequence[IntervalStats],
        progress: Progress,
        num_blocks: int,
        *,
        pricing: Pricing | None = None,
    ) -> bool:
        """Whether this evaluation needs the held-out loss: a freeze is on probation, or one is
        about to be proposed (its pre-freeze level)."""
        if not self.uses_probe:
            return False
        if self._on_probation(boundary, history) is not None:
            return True
        pricing = self._checked(pricing, num_blocks, progress)
        return self.best_prefix(boundary, history, progress, num_blocks, pricing)[0] is not None

    def explain(
        self,
        boundary: int,
        history: Sequence[IntervalStats],
        progress: Progress,
        num_blocks: int,
        *,
        pricing: Pricing | None = None,
    ) -> str:
        pricing = self._checked(pricing, num_blocks, progress)
        rates = self.rates(history, pricing, num_blocks)
        shown = " ".join("-" if r is None else f"{r:.3g}" for r in rates)
        scores = self.scores(boundary, history, progress, num_blocks, pricing)
        best = " ".join(f"{s:+.3f}" for _, s in scores) or "-"
        held = (
            ""
            if not history or history[-1].held_out_loss is None
            else f", held-out loss {history[-1].held_out_loss:.4f}"
        )
        return (
            f"rate per block [{shown}] (nats per unit LR), LR left {pricing.remaining_lr(progress.steps_completed):.4g}, "
            f"score of freezing to k+1.. [{best}]{held}"
        )

    # ---------------------------------------------------------------- the rule's parts
    def rates(self, history: Sequence[IntervalStats], pricing: Pricing, num_blocks: int) -> list[float | None]:
        """Per block: the loss its training removes per unit LR, the mean of its last ``window``
        intervals' descent over the LR its displacement spent (signed: the score floors it at 0);
        None where one of them has no descent (the block did not train through it) or spent no LR."""
        estimates: list[list[float | None]] = []  # one row per interval that closed a span
        for i in range(self.span, len(history)):
            current, spanned = history[i], history[i - self.span : i]
            if len(current.descent) not in (0, num_blocks):
                raise PolicyError(
                    f"policy '{self.name}': interval {current.index} has {len(current.descent)} descent values; "
                    f"accepted: exactly num_blocks = {num_blocks} (a Freezer built with this policy records them)"
                )
            if all(d is None for d in current.descent):
                continue
            spent = pricing.lr_between(spanned[0].end_step - spanned[0].steps, spanned[-1].end_step)
            contiguous = current.index - spanned[0].index == self.span
            estimates.append(
                [None if d is None or spent <= 0 or not contiguous else d / spent for d in current.descent]
            )
        recent = estimates[-self.window :]
        if len(recent) < self.window:
            return [None] * num_blocks
        out: list[float | None] = []
        for block in range(num_blocks):
            column = [row[block] for row in recent]
            out.append(None if any(v is None for v in column) else math.fsum(column) / len(column))
        return out

    def scores(
        self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int, pricing: Pricing
    ) -> list[tuple[int, float]]:
        """(j, score(j)) for j = boundary + 1 .. up to the first block that cannot be priced."""
        rates = self.rates(history, pricing, num_blocks)
        steps_left = max(progress.steps_total - progress.steps_completed, 0)
        lr_left = pricing.remaining_lr(progress.steps_completed)
        run_s = pricing.step_time_s[0] * progress.steps_total
        cost = pricing.step_time_s
        out: list[tuple[int, float]] = []
        lost = 0.0
        for j in range(boundary + 1, num_blocks):
            rate = rates[j - 1]
            if rate is None:  # not measured through the window: what cannot be priced is not frozen
                break
            lost += max(rate, 0.0) * lr_left  # a block whose updates raised the loss stops no learning
            build = pricing.build_s[j] if pricing.build_s else 0.0
            saved = ((cost[boundary] - cost[j]) * steps_left - pricing.rewrap_s - build) / run_s
            out.append((j, saved - self.exchange * lost))
        return out

    def best_prefix(
        self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int, pricing: Pricing
    ) -> tuple[int | None, float]:
        """The j with the largest positive score (the higher j on a tie), or (None, 0) when no
        freeze pays, during a hold-off or a probation, or before the first rates."""
        if boundary >= num_blocks - 1 or self._held_off(history) or self._on_probation(boundary, history) is not None:
            return None, 0.0  # a freeze still on probation is judged before another is stacked on it
        best: tuple[int | None, float] = (None, 0.0)
        for j, score in self.scores(boundary, history, progress, num_blocks, pricing):
            if score > 0.0 and score >= best[1]:
                best = (j, score)
        return best

    def undo_to(self, boundary: int, history: Sequence[IntervalStats]) -> int | None:
        """At the probation's last interval: the boundary to return to when every held-out check
        since the freeze rose above the pre-freeze loss by more than ``tolerance``; else None."""
        freeze_at = self._on_probation(boundary, history)
        if freeze_at is None or len(history) - 1 - freeze_at < self.probation:
            return None
        before = history[freeze_at].held_out_loss
        checks = [stats.held_out_loss for stats in history[freeze_at + 1 :]]
        if before is None or any(c is None for c in checks):
            return None  # measured by no probe: nothing to compare (probation needs the Freezer's probe)
        if not math.isfinite(before):
            return history[freeze_at].boundary  # proposed on a diverged loss (a run from before the check above)
        limit = before + abs(before) * self.tolerance
        # a check that diverged (nan, inf) is a rise: `nan > limit` is false, and kept such a freeze for good
        rose = [not math.isfinite(c) or c > limit for c in checks]
        return history[freeze_at].boundary if all(rose) else None

    def _on_probation(self, boundary: int, history: Sequence[IntervalStats]) -> int | None:
        """Index in ``history`` of the interval whose close decided the freeze now on probation."""
        if not self.uses_probe:
            return None
        for i in range(len(history) - 2, -1, -1):
            if history[i + 1].boundary > history[i].boundary:
                since = len(history) - 1 - i
                return i if since <= self.probation and boundary > history[i].boundary else None
            if history[i + 1].boundary < history[i].boundary:
                return None  # the last change was an undo
        return None

    def _held_off(self, history: Sequence[IntervalStats]) -> bool:
        undos = [i for i in range(len(history) - 1) if history[i + 1].boundary < history[i].boundary]
        if not undos:
            return False
        wait = self.hold_off * 2 ** (len(undos) - 1)
        return len(history) - 1 - undos[-1] < wait

    def _checked(self, pricing: Pricing | None, num_blocks: int, progress: Progress) -> Pricing:
        if pricing is None:
            raise PolicyError(
                f"policy '{self.name}': no pricing; accepted: a Freezer built with pricing=Pricing(step_time_s=..., "
                "lr_per_step=...) (freeze.pipeline computes it from the cost model)"
            )
        if not progress.steps_total:
            raise PolicyError(
                f"policy '{self.name}': the run's steps are unknown; accepted: epochs and steps_per_epoch"
            )
        try:
            pricing.check(num_blocks, progress.steps_total)
        except ValueError as e:
            raise PolicyError(f"policy '{self.name}': {e}") from None
        return pricing
