"""The monitor's per-step tracker: each step's gradient norm per block, and the steps masked as not
finite, without a host sync per step.

A step records its per-tensor norms as one row on the device (one foreach norm, one stack); the rows
are folded into the per-block sums when the interval closes, the boundary moves or a checkpoint is
written, in the order the steps came (the sums are those a per-step fold would give, bit for bit on
the CPU). On a GPU a small model's step is bound by launching kernels, not by their arithmetic: the
first GPU check (docs/benchmarks.md) measured 0.8-1.2 ms a step for the ~15 small operations a
per-step fold launched.

A step whose gradients are not finite (an fp16 step GradScaler skips for overflow, or a NaN loss),
or whose grad_scale tensor was not a finite number > 0, is masked when folded (``torch.where``:
inf * 0 would be NaN) and counted on the device; the counts are read at interval close.
"""

from __future__ import annotations

import torch

from freeze.monitor.blockwise import BlockIndex, GradScale, scale_inverses

# Pending steps folded at the latest after this many (the rows cost 4 bytes per tensor each).
_PENDING_ROWS_MAX = 256


class StepNorms:
    """Sums of per-step gradient norms per block, and overflow counts, over the running interval.

    Args:
        index: the monitor's parameters -> blocks.
    """

    def __init__(self, index: BlockIndex):
        self.index = index
        self.first_active = 0  # blocks before it are frozen: a masked step counts only for the others
        self.norm_sum: torch.Tensor | None = None  # [num_blocks] sum of per-step norms
        # Per block, the observed steps that were masked as non-finite; and the masked steps.
        self.overflows: torch.Tensor | None = None  # [num_blocks] float
        self.overflow_steps: torch.Tensor | None = None  # [] float
        # Steps whose grad_scale tensor was not a finite number > 0 (device, never reset: a
        # non-zero count is refused), and whether a tensor scale came since the last check.
        self._bad_scale_steps: torch.Tensor | None = None
        self._scales_unchecked = False
        # Steps recorded but not yet folded: one row of per-tensor norms each, all over the same
        # positions (a change of positions folds first), with each step's grad_scale.
        self._rows: torch.Tensor | None = None  # [capacity, len(positions)]
        self._count = 0
        self._positions: tuple[int, ...] = ()
        self._scales: list[GradScale] = []

    def set_first_active(self, first_active: int) -> None:
        self.fold()  # the pending steps were observed under the old boundary
        self.first_active = first_active

    def record(
        self, positions: list[int], grads: list[torch.Tensor], grad_scale: GradScale
    ) -> tuple[torch.Tensor, GradScale]:
        """Record one step's gradients (of parameters ``positions``). Returns the step's row of
        per-tensor norms and its grad_scale as kept (a tensor scale copied: the scaler updates its
        tensor in place)."""
        if tuple(positions) != self._positions:
            self.fold()
            self._positions = tuple(positions)
        row = self._next_row(len(positions), grads[0].device)
        # fp32 (or fp64) accumulation: a finite fp16 block whose norm exceeds 65504 must not read
        # as inf (that would mask a good step as an overflow).
        torch.stack(torch._foreach_norm(grads, 2, dtype=self.index.norm_dtype), out=row)
        if isinstance(grad_scale, torch.Tensor):
            grad_scale = grad_scale.detach().to(device=row.device, dtype=self.index.norm_dtype, copy=True)
        self._scales.append(grad_scale)
        return row, grad_scale

    def _next_row(self, width: int, device: torch.device) -> torch.Tensor:
        """The next free row of the pending buffer (folded first when full; doubled up to 256 rows)."""
        rows = self._rows
        if rows is not None and (rows.shape[1] != width or rows.device != device):
            self.fold()
            rows = self._rows = None
        if rows is None or self._count == rows.shape[0]:
            if rows is not None and rows.shape[0] >= _PENDING_ROWS_MAX:
                self.fold()
            else:
                capacity = 8 if rows is None else 2 * rows.shape[0]
                grown = torch.empty(capacity, width, device=device, dtype=self.index.norm_dtype)
                if rows is not None:
                    grown[: self._count].copy_(rows[: self._count])
                self._rows = grown
        self._count += 1
        return self._rows[self._count - 1]

    def discard_pending(self) -> None:
        """Forget the steps not yet folded (a loaded state replaces them)."""
        self._count, self._scales, self._positions = 0, [], ()

    def fold(self) -> None:
        """Add the pending steps to the interval's sums, in the order they came."""
        n = self._count
        if n == 0:
            return
        positions = list(self._positions)
        rows = self._rows[:n]
        scales = self._scales
        self._count, self._scales = 0, []
        device = rows.device
        block_norms = self.index.rows_block_norms(positions, rows)
        finite = torch.isfinite(block_norms.sum(dim=1))  # a device bool per step: never read here
        scale_ok, inv_scale = scale_inverses(scales, device, self.index.norm_dtype)
        if scale_ok is not None:  # a NaN, 0 or negative scale masks its step, as an overflow
            finite = finite & scale_ok
            if self._bad_scale_steps is None or self._bad_scale_steps.device != device:
                self._bad_scale_steps = torch.zeros((), device=device)
            self._bad_scale_steps += (~scale_ok).sum()
            self._scales_unchecked = True
        if inv_scale is not None:
            block_norms = block_norms * inv_scale.unsqueeze(1)
        masked = torch.where(finite.unsqueeze(1), block_norms, 0.0)
        if self.norm_sum is None or self.norm_sum.device != device:
            self.norm_sum = torch.zeros(self.index.num_blocks, device=device, dtype=self.index.norm_dtype)
        for step_norms in masked.unbind(0):  # one add per step, as the sums always were (bit for bit)
            self.norm_sum.add_(step_norms)
        if self.overflows is None or self.overflows.device != device:
            self.overflows = torch.zeros(self.index.num_blocks, device=device)
            self.overflow_steps = torch.zeros((), device=device)
        overflow_steps = (~finite).sum()
        self.overflows[self.first_active :] += overflow_steps
        self.overflow_steps += overflow_steps

    def refuse_bad_scales(self) -> None:
        """Raise ValueError when a ``grad_scale`` tensor of the running interval was NaN, inf, 0 or
        negative. One host read, and only when a tensor scale came since the last check."""
        self.fold()
        if not self._scales_unchecked:
            return
        bad_steps = int(self._bad_scale_steps.item())
        if bad_steps:
            raise ValueError(
                f"grad_scale: the tensor passed to after_backward was NaN, inf, 0 or negative at {bad_steps} step(s) "
                "of this interval (those steps were not read); accepted: the loss scale, a finite number > 0"
            )
        self._scales_unchecked = False

    def take_overflows(self) -> tuple[list[float], int]:
        """The interval's masked steps per block and in all (one host read), reset to 0."""
        self.fold()
        if self.overflows is None:
            return [0.0] * self.index.num_blocks, 0
        *overflows, overflow_steps = torch.cat([self.overflows, self.overflow_steps.reshape(1)]).cpu().tolist()
        self.overflows.zero_()
        self.overflow_steps.zero_()
        return overflows, int(overflow_steps)

    def take_means(self, finite_steps: list[int]) -> list[float | None]:
        """Each block's mean step norm over its ``finite_steps`` (None for none), reset to 0."""
        self.fold()
        if self.norm_sum is None:
            return [None] * self.index.num_blocks
        sums = self.norm_sum.cpu().tolist()
        self.norm_sum.zero_()
        return [sums[b] / steps if steps > 0 else None for b, steps in enumerate(finite_steps)]

    def state_dict(self) -> dict:
        self.fold()  # the saved sums hold every step recorded (the format has no pending rows)
        return {
            "norm_sum": None if self.norm_sum is None else self.norm_sum.detach().cpu().clone(),
            "overflows": None if self.overflows is None else self.overflows.detach().cpu().clone(),
            "overflow_steps": None if self.overflow_steps is None else self.overflow_steps.detach().cpu().clone(),
        }

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        """Continue from the monitor's saved ``norm_sum``, ``overflows`` and ``overflow_steps``."""
        norm_sum = state["norm_sum"]
        self.norm_sum = None if norm_sum is None else norm_sum.to(device=device, dtype=self.index.norm_dtype)
        # .get: checkpoints written before overflow detection have no such entries.
        overflows, overflow_steps = state.get("overflows"), state.get("overflow_steps")
        if overflows is None:
            self.overflows = self.overflow_steps = None
        else:
            self.overflows, self.overflow_steps = overflows.to(device), overflow_steps.to(device)
