"""Freeze policies: turn (boundary, monitor history, progress) into the next boundary k.

Blocks ``0 .. k-1`` are frozen. The last block (the head) never is, so every policy returns k in
``[0, L-1]``, and only a policy with ``may_unfreeze`` ever returns k below the current boundary.

A policy is a frozen dataclass whose fields are its parameters and nothing else: ``decide`` is a
pure function of its arguments, so every rank computes the same k from the same all-reduced
statistics, and a run restored from a checkpoint (boundary + monitor history) decides as the run
that wrote it did.

Spec strings name a policy and its parameters, e.g. ``"none"``, ``"static:k=4"``,
``"autofreeze:percentile=50"``, ``"freezeout:t0=0.8,scale=cubic"``. Each class's docstring names
the paper or library its rule comes from (FreezeOut, Brock et al. 2017; Composer's LayerFreezing;
PipeTransformer; AutoFreeze, Liu et al. 2021; ULMFiT), as does the README's policy table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from freeze.checks import spell
from freeze.intervals import NORMS, IntervalStats
from freeze.policies.base import (
    SCHEDULE_EPS,
    Policy,
    PolicyError,
    Progress,
    cosine_to_zero,
    floor_with_slack,
    param,
    register_policy,
)


# -------------------------------------------------------------------- the policies
@register_policy
@dataclass(frozen=True)
class NoFreezing(Policy):
    """Full fine-tuning baseline: nothing is ever frozen."""

    name: ClassVar[str] = "none"

    def decide(self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int) -> int:
        self._check_call(boundary, num_blocks)
        return boundary  # 0 from initial_boundary, and never moved


@register_policy
@dataclass(frozen=True)
class StaticFreeze(Policy):
    """Blocks 0..k-1 frozen from the first step (transfer learning, the reference study's sweep)."""

    name: ClassVar[str] = "static"
    k: int = param(0, low=0)

    def initial_boundary(self, num_blocks: int) -> int:
        self._check_k(num_blocks)
        return self.k

    def decide(self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int) -> int:
        self._check_call(boundary, num_blocks)
        self._check_k(num_blocks)
        return max(boundary, self.k)

    def _check_k(self, num_blocks: int) -> None:
        # Refused, not clamped: a run of static:k=99 that froze 9 blocks would be reported as k=99.
        self._check_blocks(num_blocks)
        if self.k > num_blocks - 1:
            raise PolicyError(
                f"policy 'static': k = {self.k} with {num_blocks} blocks; accepted: 0..{num_blocks - 1} "
                f"(the head, block {num_blocks - 1}, is never frozen)"
            )


@register_policy
@dataclass(frozen=True)
class FreezeOut(Policy):
    """FreezeOut (Brock et al. 2017): block i freezes at fraction t_i of training, then scaled.

    ``anneal=true`` is the method as published: block i's learning rate follows its own cosine,
    0.5 lr_i (1 + cos(pi t / t_i)), and reaches zero at t_i, where the block freezes; ``scale_lr``
    starts block i at lr / t_i (the paper's scaled variant, the same area under each block's
    curve). The factors act on top of the run's schedule and are written for the schedule the paper
    trains with, a cosine to zero over the whole run (the head's, t = 1): block i's factor is
    cos_i(t) / cos_run(t), so a run on another schedule anneals the body relative to that one (the
    pipeline refuses it). ``anneal=false`` (the default) stops each block at t_i with its
    learning rate where the run's schedule has it: a hard freeze, what ``freezeout`` always was."""

    name: ClassVar[str] = "freezeout"
    needs_run_length: ClassVar[bool] = True
    t0: float = param(0.8, low=0.0, high=1.0)
    scale: str = param("cubic", choices=("linear", "squared", "cubic"))
    anneal: bool = param(False)
    scale_lr: bool = param(False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scale_lr and not self.anneal:
            raise PolicyError(
                "policy 'freezeout': scale_lr=true scales the annealed learning rates; accepted: scale_lr with "
                "anneal=true, or neither"
            )
        if self.anneal and self.t0 == 0.0:
            raise PolicyError(
                "policy 'freezeout': anneal=true with t0 = 0 anneals block 0 over no steps; accepted: t0 in (0, 1]"
            )

    @property
    def sets_block_lr(self) -> bool:
        return self.anneal

    @property
    def assumes_cosine_run(self) -> bool:
        return self.anneal

    def freeze_fractions(self, num_blocks: int) -> list[float]:
        """t_i per block; the head's is 1.0, i.e. the end of training."""
        self._check_blocks(num_blocks)
        if num_blocks == 1:
            return [1.0]
        power = {"linear": 1, "squared": 2, "cubic": 3}[self.scale]
        return [(self.t0 + (1.0 - self.t0) * i / (num_blocks - 1)) ** power for i in range(num_blocks)]

    def block_lr_scales(self, progress: Progress, num_blocks: int) -> list[float]:
        if not self.anneal:
            return super().block_lr_scales(progress, num_blocks)
        done = progress.fraction
        run = cosine_to_zero(done)  # the run's own cosine: the head's schedule, t = 1
        scales = []
        for t_i in self.freeze_fractions(num_blocks):
            if t_i >= 1.0 - SCHEDULE_EPS:
                scales.append(1.0)  # the head (and any block due at the end) follows the run's schedule
                continue
            own = cosine_to_zero(done / t_i) * (1.0 / t_i if self.scale_lr else 1.0)
            # own is 0 once done >= t_i; before that run >= cos(pi t_i) > 0, so the ratio is finite
            scales.append(0.0 if own == 0.0 else own / run)
        return scales

    def decide(self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int) -> int:
        self._check_call(boundary, num_blocks)
        done = progress.fraction
        k = 0
        for t in self.freeze_fractions(num_blocks)[:-1]:  # the head is never frozen
            if t > done + SCHEDULE_EPS:
                break
            k += 1
        return max(boundary, k)


@register_policy
@dataclass(frozen=True)
class LinearFreeze(Policy):
    """Composer LayerFreezing: the frozen fraction grows linearly from freeze_start to the end.

    The fraction is of the L - 1 freezable blocks (the head excluded), rounded down, as Composer's
    ``int(freeze_percentage * len(flat_children[0:-1]))``."""

    name: ClassVar[str] = "linear"
    needs_run_length: ClassVar[bool] = True
    freeze_start: float = param(0.5, low=0.0, high=1.0, high_open=True)
    freeze_level: float = param(1.0, low=0.0, high=1.0)

    def decide(self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int) -> int:
        self._check_call(boundary, num_blocks)
        ramp = (progress.fraction - self.freeze_start) / (1.0 - self.freeze_start)
        frozen_fraction = min(max(ramp, 0.0), 1.0) * self.freeze_level
        return max(boundary, floor_with_slack(frozen_fraction * (num_blocks - 1)))


@register_policy
@dataclass(frozen=True)
class GeometricFreeze(Policy):
    """PipeTransformer's hand-crafted schedule: floor(L * (1 - (1 - alpha)^e)) after e epochs."""

    name: ClassVar[str] = "geometric"
    alpha: float = param(1.0 / 3.0, low=0.0, low_open=True, high=1.0)

    def decide(self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int) -> int:
        self._check_call(boundary, num_blocks)
        k = floor_with_slack(num_blocks * (1.0 - (1.0 - self.alpha) ** progress.epochs_completed))
        return max(boundary, min(k, num_blocks - 1))


@register_policy
@dataclass(frozen=True)
class AutoFreeze(Policy):
    """AutoFreeze (Liu et al. 2021): freeze the leading active blocks whose gradient-norm change
    eta is below the ``percentile`` of eta over the active freezable blocks.

    As the reference code (and PipeTransformer's): G is the L1 norm of the gradient accumulated
    over the interval (``norm="l2"`` takes the Euclidean norm instead), and the percentile is taken
    over the active blocks that may freeze, the head left out."""

    name: ClassVar[str] = "autofreeze"
    uses_gradients: ClassVar[bool] = True
    percentile: float = param(50.0, low=0.0, high=100.0)
    min_intervals: int = param(2, low=2)  # eta compares two intervals
    norm: str = param("l1", choices=NORMS)

    def decide(self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int) -> int:
        self._check_call(boundary, num_blocks)
        if len(history) < self.min_intervals:
            return boundary
        eta = self._last_etas(history, num_blocks, self.norm)
        threshold = self.threshold(eta, boundary, num_blocks)
        if threshold is None:
            return boundary
        k = boundary
        # Only a leading run can freeze: a slow block behind a fast one stays active.
        while k < num_blocks - 1 and eta[k] is not None and eta[k] < threshold:
            k += 1
        return k

    def threshold(self, eta: Sequence[float | None], boundary: int, num_blocks: int) -> float | None:
        """The ``percentile`` of eta over the active blocks that may freeze (the head left out)."""
        defined = [e for e in eta[boundary : num_blocks - 1] if e is not None]
        return float(np.percentile(defined, self.percentile, method="linear")) if defined else None


@register_policy
@dataclass(frozen=True)
class CS744Freeze(Policy):
    """The reference study's Algorithm 1: freeze the first active block only when its eta is the
    smallest among the active blocks; at most one block per evaluation."""

    name: ClassVar[str] = "cs744"
    uses_gradients: ClassVar[bool] = True

    def decide(self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int) -> int:
        self._check_call(boundary, num_blocks)
        if len(history) < 2 or boundary >= num_blocks - 1:
            return boundary
        eta = self._last_etas(history, num_blocks)
        first = eta[boundary]
        if first is None:
            return boundary
        return boundary + 1 if first <= self.threshold(eta, boundary, num_blocks) else boundary  # a tie freezes

    def threshold(self, eta: Sequence[float | None], boundary: int, num_blocks: int) -> float | None:
        """The smallest eta among the active blocks: the first active block freezes at or below it."""
        defined = [e for e in eta[boundary:] if e is not None]
        return min(defined) if defined else None


@register_policy
@dataclass(frozen=True)
class GradualUnfreeze(Policy):
    """ULMFiT / BackboneFinetuning: start with all but the head frozen and unfreeze one block from
    the top after every ``every_epochs`` completed epochs."""

    name: ClassVar[str] = "gradual-unfreeze"
    may_unfreeze: ClassVar[bool] = True
    every_epochs: int = param(1, low=1)

    def initial_boundary(self, num_blocks: int) -> int:
        self._check_blocks(num_blocks)
        return num_blocks - 1

    def decide(self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int) -> int:
        self._check_call(boundary, num_blocks)
        scheduled = max(num_blocks - 1 - progress.epochs_completed // self.every_epochs, 0)
        # Moves only towards unfreezing: a block once unfrozen is never frozen again.
        return min(boundary, scheduled)


@register_policy
@dataclass(frozen=True)
class ClockFreeze(Policy):
    """Freeze blocks 0..k-1 once a fraction ``t`` of the run is done: the clock, with no signal.

    What users ask for ("freeze these blocks at epoch N": t = N / epochs with per-epoch evaluation),
    and the ablation a signal-driven rule has to beat: a rule that freezes k blocks at t is worth its
    signal only if it lands beyond ``at:k=K,t=T`` for the same k (issue 35's freeze-time atlas).

    ``anneal=W`` anneals before it freezes: over the last W of the run before t the learning rate
    of blocks 0..k-1 is multiplied by a cosine from 1 to 0 (on top of the run's schedule), so the
    blocks stop where an annealed run would have brought them, not mid-stride (budgeted training
    anneals every budget; a hard freeze at t stops a body whose learning rate is still high).
    ``anneal=0`` (the default) is the hard freeze."""

    name: ClassVar[str] = "at"
    needs_run_length: ClassVar[bool] = True
    k: int = param(1, low=0)
    # Open at both ends: t = 0 is static freezing and t = 1 never freezes - each has its own policy,
    # and a study that labels either as "the clock" would misreport what ran.
    t: float = param(0.5, low=0.0, high=1.0, low_open=True, high_open=True)
    anneal: float = param(0.0, low=0.0, high=1.0, high_open=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.anneal > self.t + SCHEDULE_EPS:
            raise PolicyError(
                f"policy 'at': anneal = {spell(self.anneal)} starts the anneal before the run does (t = {spell(self.t)}); "
                f"accepted: 0 <= anneal <= t"
            )

    @property
    def sets_block_lr(self) -> bool:
        return self.anneal > 0.0

    def initial_boundary(self, num_blocks: int) -> int:
        self._check_blocks(num_blocks)
        self._check_k(num_blocks)  # at the Freezer's construction, not at fraction t of the run
        return 0

    def block_lr_scales(self, progress: Progress, num_blocks: int) -> list[float]:
        if not self.sets_block_lr:
            return super().block_lr_scales(progress, num_blocks)
        into_window = (progress.fraction - (self.t - self.anneal)) / self.anneal
        body = 0.0 if progress.fraction + SCHEDULE_EPS >= self.t else cosine_to_zero(into_window)
        k = min(self.k, num_blocks - 1)
        return [body] * k + [1.0] * (num_blocks - k)

    def decide(self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int) -> int:
        self._check_call(boundary, num_blocks)
        self._check_k(num_blocks)
        due = progress.fraction + SCHEDULE_EPS >= self.t
        return max(boundary, self.k) if due else boundary

    def _check_k(self, num_blocks: int) -> None:
        # Refused, not clamped (as static's k): a run of at:k=99 that froze 9 blocks would be reported as k=99.
        if self.k > num_blocks - 1:
            raise PolicyError(
                f"policy 'at': k = {self.k} with {num_blocks} blocks; accepted: 0..{num_blocks - 1} "
                f"(the head, block {num_blocks - 1}, is never frozen)"
            )
