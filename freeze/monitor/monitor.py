"""Per-block gradient-norm monitor.

Reads the (already all-reduced) gradients of the active blocks once per optimizer step and keeps,
per block and per evaluation interval:

* ``summed_grad_norm`` / ``summed_grad_l1_norm``: the L2 / L1 norm of the gradient SUMMED over the
  interval, ``||sum_t g_t||``: the statistic AutoFreeze (L1, its reference code's
  ``torch.norm(grad, p=1)``) and the reference study (L2) compare between intervals.
* ``mean_step_grad_norm``: the mean over the interval's steps of the per-step norm ``||g_t||``.

Per step it only launches device kernels: no ``.item()`` and no host sync, so it does not stall a
CUDA stream. The host sees numbers once per interval, in :meth:`GradNormMonitor.close_interval`.
And it launches few: a step records its per-tensor norms as one row (one foreach norm, one stack),
and the rows are folded into the per-block sums when the interval closes, the boundary moves or a
checkpoint is written, in the order the steps came (the sums are those a per-step fold would give,
bit for bit on the CPU). On a GPU a small model's step is bound by launching kernels, not by their
arithmetic: the first GPU check (docs/benchmarks.md) measured 0.8-1.2 ms a step for the ~15 small
operations a per-step fold launched.

A step whose gradients are not finite (an fp16 step GradScaler skips for overflow, or a NaN loss) is
detected on the device: a finite flag masks its contribution (``torch.where``/``masked_fill``:
inf * 0 would be NaN) and counts it, so neither sum is poisoned and no host sync is needed; the count is read at
interval close and reported in ``IntervalStats.skipped_steps``. GradScaler skips exactly when some
trainable gradient is inf or NaN, which makes the fp32 norm of those gradients non-finite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from freeze.blocks import Block
from freeze.checks import is_number
from freeze.descent import DescentTracker
from freeze.intervals import NORMS, IntervalStats, relative_change, summed_norms
from freeze.signals import Signal

__all__ = ["NORMS", "GradNormMonitor", "IntervalStats", "relative_change", "summed_norms"]


def _refuse_bad_float_scale(grad_scale: float | torch.Tensor | None) -> None:
    """Refuse a host-side ``grad_scale`` that is not a finite number > 0 (checking a float costs no
    sync; inf would zero every norm, NaN poison them). A tensor is checked on the device."""
    if grad_scale is None or isinstance(grad_scale, torch.Tensor):
        return
    if not is_number(grad_scale) or not (math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"grad_scale = {grad_scale!r}; accepted: the loss scale, a finite number > 0")


# Pending steps folded at the latest after this many (the rows cost 4 bytes per tensor each).
_PENDING_ROWS_MAX = 256
# Elements per flat buffer of the summed gradient: the staging buffer a step copies its gradients
# into is one such buffer (32 MiB of fp32), and ResNet-18's 11.2 M parameters take two.
_FLAT_CHUNK_ELEMENTS = 1 << 23
# Devices whose tensors the host reads without a sync: there a step's finiteness is read and its
# gradients added in place (one pass); elsewhere they go through a staging buffer, masked on the device.
_FREE_TO_READ_DEVICE_TYPES = frozenset({"cpu"})


@dataclass
class _FlatRun:
    """Parameters whose summed gradients share one flat buffer, ``flat_sum`` (the monitor's sums are
    views of it in their shapes, ``sum_views``): on the host a finite, unscaled step adds its
    gradients to them (one foreach add); otherwise it copies them into ``staging`` (one foreach copy
    through ``staging_views``; the runs of one dtype and device share it), masks and scales them
    there, and adds it to ``flat_sum`` (one add)."""

    positions: list[int]
    grads: slice  # where its parameters' gradients lie in the step's list (runs are consecutive)
    flat_sum: torch.Tensor
    sum_views: list[torch.Tensor]  # flat_sum in the parameters' shapes (the monitor's sums)
    staging: torch.Tensor
    staging_views: list[torch.Tensor]


def _flat_runs(
    positions: list[int], grads: list[torch.Tensor], sums: dict[int, torch.Tensor]
) -> tuple[list[_FlatRun], dict[int, torch.Tensor]]:
    """The buffers for summing ``grads`` (of parameters ``positions``): consecutive gradients of one
    dtype and device up to :data:`_FLAT_CHUNK_ELEMENTS` elements per buffer, each parameter's sum a
    view of it, holding the sum it had in ``sums`` (0 if none). Returns the runs and every sum: the
    new views, and the sums of parameters without a gradient now, kept as they were."""
    groups: list[list[int]] = []  # indices into grads, one list per buffer
    totals: list[int] = []  # elements per buffer
    for i, g in enumerate(grads):
        first = grads[groups[-1][0]] if groups else None
        if (
            first is not None
            and (first.dtype, first.device) == (g.dtype, g.device)
            and totals[-1] + g.numel() <= _FLAT_CHUNK_ELEMENTS
        ):
            groups[-1].append(i)
            totals[-1] += g.numel()
        else:
            groups.append([i])
            totals.append(g.numel())
    # One staging buffer per dtype and device, as long as the longest run: the runs are added one
    # after another on one stream, so they share it (the staging memory stays under one chunk).
    longest: dict[tuple, int] = {}
    for group, total in zip(groups, totals):
        key = (grads[group[0]].dtype, grads[group[0]].device)
        longest[key] = max(longest.get(key, 0), total)
    staging_for = {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in longest.items()}
    runs: list[_FlatRun] = []
    new_sums = dict(sums)
    for group, total in zip(groups, totals):
        first = grads[group[0]]
        flat_sum = torch.zeros(total, dtype=first.dtype, device=first.device)
        staging = staging_for[(first.dtype, first.device)][:total]
        sum_views, staging_views, offset = [], [], 0
        for i in group:
            n, shape = grads[i].numel(), grads[i].shape
            view = flat_sum[offset : offset + n].view(shape)
            old = sums.get(positions[i])
            if old is not None:
                view.copy_(old)
            new_sums[positions[i]] = view
            sum_views.append(view)
            staging_views.append(staging[offset : offset + n].view(shape))
            offset += n
        runs.append(
            _FlatRun(
                [positions[i] for i in group],
                slice(group[0], group[-1] + 1),
                flat_sum,
                sum_views,
                staging,
                staging_views,
            )
        )
    return runs, new_sums


class GradNormMonitor:
    """Accumulates per-block gradient statistics over intervals; keeps the closed intervals.

    Args:
        blocks: the blocks to observe, in forward order (from :func:`freeze.blocks.split_blocks`).
        track_summed: also keep the gradient summed over the interval (``summed_grad_norm``), which
            costs one extra tensor per parameter; gradient-reading policies need it.
        history_kept: closed intervals kept in ``history`` (and in every checkpoint); older ones
            are dropped. Every policy reads the last two; the default leaves room for plots.
        track_descent: also record each block's ``descent`` (freeze.descent: two copies of the
            parameters, a pass over them at two of every span + 1 interval closes). Without
            ``track_summed`` the gradient is summed only in the intervals the descent reads (one
            of every span + 1), so a policy that reads nothing else pays a quarter of the sums.
        descent_span: the intervals a descent's displacement spans (freeze.descent).
        signals: signals of the policy's own (freeze.signals), one instance each: observed after
            every step, their values recorded in ``IntervalStats.signals`` at each close.
    """

    def __init__(
        self,
        blocks: Sequence[Block],
        track_summed: bool = True,
        history_kept: int = 64,
        track_descent: bool = False,
        descent_span: int = 1,
        track_step_norms: bool = True,
        signals: Sequence[Signal] = (),
    ):
        if not isinstance(history_kept, int) or history_kept < 2:
            raise ValueError(f"GradNormMonitor: history_kept must be an integer >= 2, got {history_kept!r}")
        self.blocks = list(blocks)
        self.signals = list(signals)
        for signal in self.signals:
            signal.bind(self.blocks)
        self.track_summed = track_summed
        # Off: a step only counts (no norm, no overflow check): for a policy that reads no gradient
        # statistic, whose monitor would otherwise launch a norm per step that nothing reads. Sums
        # and descent need the per-step norms (their overflow masks), so they keep them on.
        self.track_step_norms = track_step_norms or track_summed or track_descent
        self.history_kept = history_kept
        self.history: list[IntervalStats] = []  # the last history_kept closed intervals
        self.intervals_closed = 0
        self._first_active = 0
        # Flat parameter list and the block index of each: per-block norms are then one
        # segment-sum over one foreach norm, whatever the number of blocks.
        self._params: list[torch.nn.Parameter] = [p for b in self.blocks for p in b.params]
        # Norms accumulate in fp32 (fp16/bf16 gradients are widened), and in fp64 when any parameter
        # is fp64: torch refuses to narrow a double to a float32 norm, and an fp64 model asks for
        # fp64 statistics. Fixed here, so every step's sums share one dtype.
        wide = any(p.dtype == torch.float64 for p in self._params)
        self._norm_dtype = torch.float64 if wide else torch.float32
        self._param_block = [i for i, b in enumerate(self.blocks) for _ in b.params]
        self._descent = (
            DescentTracker(self._params, self._param_block, len(self.blocks), descent_span) if track_descent else None
        )
        self._summing = self._sums_next_interval()  # whether this interval's gradients are summed
        self._summed: dict[int, torch.Tensor] = {}  # param position -> summed gradient
        # The flat buffers the sums live in, and the (positions, shapes, dtypes) they were laid out for.
        self._summed_runs: list[_FlatRun] = []
        self._summed_layout: tuple = ()
        self._norm_sum: torch.Tensor | None = None  # [num_blocks] sum of per-step norms
        self._block_steps = [0] * len(self.blocks)  # steps each block was observed this interval
        self._interval_steps = 0
        self._interval_skipped_steps = 0
        self._active_positions = list(range(len(self._params)))
        # Block index of each observed parameter, as a device tensor, per set of observed
        # positions: built once per boundary change rather than copied from the host every step
        # (on CUDA a host-to-device copy per step would stall the stream).
        self._block_ids: dict[tuple[int, ...], torch.Tensor] = {}
        # Device-side overflow accounting (no host sync per step): per block, the observed steps
        # that were masked as non-finite; and the masked steps of the interval. Read at close.
        self._overflows: torch.Tensor | None = None  # [num_blocks] float
        self._overflow_steps: torch.Tensor | None = None  # [] float
        self.overflow_steps_total = 0  # masked steps in closed intervals (host, updated at close)
        # Steps whose grad_scale tensor was not a finite number > 0 (device, never reset: a
        # non-zero count is refused), and whether a tensor scale came since the last check.
        self._bad_scale_steps: torch.Tensor | None = None
        self._scales_unchecked = False
        # Steps observed but not yet folded into the sums: one row of per-tensor norms each, all
        # over the same positions (a change of positions folds first), with each step's grad_scale.
        self._pending_rows: torch.Tensor | None = None  # [capacity, len(positions)]
        self._pending_count = 0
        self._pending_positions: tuple[int, ...] = ()
        self._pending_scales: list[float | torch.Tensor | None] = []

    def _block_ids_for(self, positions: list[int], device: torch.device) -> torch.Tensor:
        key = tuple(positions)
        ids = self._block_ids.get(key)
        if ids is None or ids.device != device:
            if len(self._block_ids) >= 8:  # the set of parameters with a gradient keeps changing
                self._block_ids.clear()
            ids = torch.tensor([self._param_block[pos] for pos in positions], device=device)
            self._block_ids[key] = ids
        return ids

    def _block_norms(self, positions: list[int], tensors: list[torch.Tensor], ord: int = 2) -> torch.Tensor:
        """[num_blocks] L``ord`` norm (1 or 2) per block of ``tensors`` (the tensors of parameters
        ``positions``): one foreach norm and one segment-sum, whatever the number of blocks; 0 for
        blocks absent."""
        # fp32 (or fp64) accumulation: a finite fp16 block whose norm exceeds 65504 must not read
        # as inf (that would mask a good step as an overflow).
        per_tensor = torch.stack(list(torch._foreach_norm(tensors, ord, dtype=self._norm_dtype))).unsqueeze(0)
        if ord == 1:  # the L1 norm of a block is the sum of its tensors' L1 norms
            return self._segment_sum(positions, per_tensor)[0]
        return self._rows_block_norms(positions, per_tensor)[0]

    def _rows_block_norms(self, positions: list[int], rows: torch.Tensor) -> torch.Tensor:
        """[n, num_blocks] L2 norm per block of each row of per-tensor L2 norms; 0 for blocks absent."""
        return self._segment_sum(positions, rows.square()).sqrt()

    def _segment_sum(self, positions: list[int], rows: torch.Tensor) -> torch.Tensor:
        """[n, num_blocks]: each row's per-tensor values (tensors of parameters ``positions``) summed per block."""
        block_ids = self._block_ids_for(positions, rows.device)
        summed = torch.zeros(rows.shape[0], len(self.blocks), device=rows.device, dtype=self._norm_dtype)
        return summed.index_add_(1, block_ids, rows)

    # ---------------------------------------------------------------- per step
    def set_first_active(self, first_active: int) -> None:
        """Blocks before ``first_active`` are frozen: stop observing them and free their sums.

        Args:
            first_active: the freeze boundary k; blocks ``0 .. k-1`` are no longer observed.
        """
        self._fold_pending()  # the pending steps were observed under the old boundary
        self._first_active = first_active
        for pos in [pos for pos in self._summed if self._param_block[pos] < first_active]:
            del self._summed[pos]
        self._summed_runs, self._summed_layout = [], ()  # the frozen blocks' buffers go with the next layout
        self._active_positions = [pos for pos, b in enumerate(self._param_block) if b >= first_active]
        self._block_ids.clear()

    def _tick(self) -> None:
        self._interval_steps += 1

    def skip_step(self) -> None:
        """Count an optimizer step whose gradients must not be read (an fp16 step GradScaler skips
        for overflow): the step clock moves, no statistic changes."""
        self._tick()
        self._interval_skipped_steps += 1

    @torch.no_grad()
    def observe(self, grad_scale: float | torch.Tensor | None = None) -> None:
        """Read the current gradients of the active blocks (call once per optimizer step). A step
        whose gradients are not finite is masked and counted on the device (no host sync).

        Args:
            grad_scale: the loss scale the gradients are still multiplied by (GradScaler's
                ``get_scale()``, or its scale tensor to stay off the host); None: unscaled.
        """
        _refuse_bad_float_scale(grad_scale)  # before the step counts
        self._tick()
        for b in range(self._first_active, len(self.blocks)):
            self._block_steps[b] += 1
        for signal in self.signals:
            signal.observe(self._first_active, grad_scale)
        if not self.track_step_norms:
            return
        positions = [pos for pos in self._active_positions if self._params[pos].grad is not None]
        if not positions:
            return
        grads = [self._params[pos].grad for pos in positions]
        if tuple(positions) != self._pending_positions:
            self._fold_pending()
            self._pending_positions = tuple(positions)
        row = self._next_pending_row(len(positions), grads[0].device)
        # fp32 (or fp64) accumulation: a finite fp16 block whose norm exceeds 65504 must not read
        # as inf (that would mask a good step as an overflow).
        torch.stack(torch._foreach_norm(grads, 2, dtype=self._norm_dtype), out=row)
        if isinstance(grad_scale, torch.Tensor):  # the scaler updates its tensor in place: keep this step's
            grad_scale = grad_scale.detach().to(device=row.device, dtype=self._norm_dtype, copy=True)
        self._pending_scales.append(grad_scale)
        if self._summing:  # the gradients are gone after this step: sum them now
            self._add_summed(positions, grads, row, grad_scale)

    def _next_pending_row(self, width: int, device: torch.device) -> torch.Tensor:
        """The next free row of the pending buffer (folded first when full; doubled up to 256 rows)."""
        rows = self._pending_rows
        if rows is not None and (rows.shape[1] != width or rows.device != device):
            self._fold_pending()
            rows = self._pending_rows = None
        if rows is None or self._pending_count == rows.shape[0]:
            if rows is not None and rows.shape[0] >= _PENDING_ROWS_MAX:
                self._fold_pending()
            else:
                capacity = 8 if rows is None else 2 * rows.shape[0]
                grown = torch.empty(capacity, width, device=device, dtype=self._norm_dtype)
                if rows is not None:
                    grown[: self._pending_count].copy_(rows[: self._pending_count])
                self._pending_rows = grown
        self._pending_count += 1
        return self._pending_rows[self._pending_count - 1]

    def _scale_inverses(
        self, scales: list[float | torch.Tensor | None], device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per step, whether its tensor grad_scale was a finite number > 0 ([n] bool; None when no
        step had a tensor scale), and 1 / its scale ([n]; 1 for a step without one, 0 for a bad one;
        None when no step had a scale)."""
        if all(scale is None for scale in scales):
            return None, None
        if not any(isinstance(scale, torch.Tensor) for scale in scales):
            # host floats: one copy per fold (a fold comes with a host read anyway, or every 256 steps)
            inverses = [1.0 if scale is None else 1.0 / float(scale) for scale in scales]
            return None, torch.tensor(inverses, dtype=self._norm_dtype).to(device)
        one = torch.ones((), device=device, dtype=self._norm_dtype)
        scale = torch.stack(
            [s if isinstance(s, torch.Tensor) else one * (1.0 if s is None else float(s)) for s in scales]
        )
        scale_ok = torch.isfinite(scale) & (scale > 0)
        return scale_ok, torch.where(scale_ok, scale.reciprocal(), 0.0)

    def _fold_pending(self) -> None:
        """Add the pending steps to the interval's sums, in the order they came."""
        n = self._pending_count
        if n == 0:
            return
        positions = list(self._pending_positions)
        rows = self._pending_rows[:n]
        scales = self._pending_scales
        self._pending_count, self._pending_scales = 0, []
        device = rows.device
        block_norms = self._rows_block_norms(positions, rows)
        finite = torch.isfinite(block_norms.sum(dim=1))  # a device bool per step: never read here
        scale_ok, inv_scale = self._scale_inverses(scales, device)
        if scale_ok is not None:  # a NaN, 0 or negative scale masks its step, as an overflow
            finite = finite & scale_ok
            if self._bad_scale_steps is None or self._bad_scale_steps.device != device:
                self._bad_scale_steps = torch.zeros((), device=device)
            self._bad_scale_steps += (~scale_ok).sum()
            self._scales_unchecked = True
        if inv_scale is not None:
            block_norms = block_norms * inv_scale.unsqueeze(1)
        masked = torch.where(finite.unsqueeze(1), block_norms, 0.0)
        if self._norm_sum is None or self._norm_sum.device != device:
            self._norm_sum = torch.zeros(len(self.blocks), device=device, dtype=self._norm_dtype)
        for step_norms in masked.unbind(0):  # one add per step, as the sums always were (bit for bit)
            self._norm_sum.add_(step_norms)
        if self._overflows is None or self._overflows.device != device:
            self._overflows = torch.zeros(len(self.blocks), device=device)
            self._overflow_steps = torch.zeros((), device=device)
        overflow_steps = (~finite).sum()
        self._overflows[self._first_active :] += overflow_steps
        self._overflow_steps += overflow_steps

    def _add_summed(
        self,
        positions: list[int],
        grads: list[torch.Tensor],
        row: torch.Tensor,
        grad_scale: float | torch.Tensor | None,
    ) -> None:
        """Add this step's gradients (unscaled) to the interval's summed gradient; nothing where the
        step was not finite or its scale tensor bad (a masked fill, not a product: inf * 0 is NaN).
        The gradients are summed per flat buffer (one foreach add each on the host; one foreach copy,
        mask and add each through staging: :class:`_FlatRun`), so the operations a step launches do not
        grow with the parameter count."""
        finite = torch.isfinite(self._rows_block_norms(positions, row.unsqueeze(0)).sum())
        inv_tensor, alpha = None, 1.0
        if isinstance(grad_scale, torch.Tensor):
            scale_ok, inv_scales = self._scale_inverses([grad_scale], row.device)
            finite, inv_tensor = finite & scale_ok[0], inv_scales[0]
        elif grad_scale is not None:  # a host float: no copy to the device
            alpha = 1.0 / float(grad_scale)
        layout = (tuple(positions), tuple((g.shape, g.dtype, g.device) for g in grads))
        if layout != self._summed_layout:  # a boundary move, a parameter without a gradient, a load
            self._summed_runs, self._summed = _flat_runs(positions, grads, self._summed)
            self._summed_layout = layout
        if inv_tensor is None and alpha == 1.0 and row.device.type in _FREE_TO_READ_DEVICE_TYPES:
            # On the host the step's finiteness costs nothing to read, so the gradients are added
            # where they are, or not at all: one pass over them instead of three through the staging
            # buffer (copy, mask, add), and the same sums bit for bit (x + 1 * g is exact either way;
            # a scaled step keeps the staging path, whose rounding the sums were measured with).
            if bool(finite):
                for run in self._summed_runs:
                    torch._foreach_add_(run.sum_views, grads[run.grads])
            return
        not_finite = ~finite
        for run in self._summed_runs:
            torch._foreach_copy_(run.staging_views, grads[run.grads])
            run.staging.masked_fill_(not_finite, 0.0)
            if inv_tensor is not None:
                run.staging.mul_(inv_tensor.to(run.staging.dtype))
            run.flat_sum.add_(run.staging, alpha=alpha)

    def refuse_bad_grad_scales(self) -> None:
        """Raise ValueError when a ``grad_scale`` tensor of the running interval was NaN, inf, 0 or
        negative (the float form is refused at the call). One host read, and only when a tensor
        scale came since the last check; :meth:`close_interval` calls it before changing anything."""
        self._fold_pending()
        if not self._scales_unchecked:
            return
        bad_steps = int(self._bad_scale_steps.item())
        if bad_steps:
            raise ValueError(
                f"grad_scale: the tensor passed to after_backward was NaN, inf, 0 or negative at {bad_steps} step(s) "
                "of this interval (those steps were not read); accepted: the loss scale, a finite number > 0"
            )
        self._scales_unchecked = False

    # ---------------------------------------------------------------- per interval
    @torch.no_grad()
    def close_interval(self, epoch: int, boundary: int, end_step: int) -> IntervalStats:
        """Turn the running sums into one :class:`IntervalStats` (one host sync) and reset.

        Args:
            epoch: 0-based epoch in which the interval ends (recorded in the result).
            boundary: the boundary k in force as the interval ends (recorded in the result).
            end_step: optimizer steps taken when the interval ends (the caller's step count,
                ``freezer.counters.steps``; recorded in the result).

        Returns:
            The closed interval, also appended to ``history``.
        """
        self._fold_pending()
        self.refuse_bad_grad_scales()
        num_blocks = len(self.blocks)
        overflows = [0.0] * num_blocks
        overflow_steps = 0
        if self._overflows is not None:
            *overflows, overflow_steps = torch.cat([self._overflows, self._overflow_steps.reshape(1)]).cpu().tolist()
            overflow_steps = int(overflow_steps)
            self._overflows.zero_()
            self._overflow_steps.zero_()
        self.overflow_steps_total += overflow_steps
        # Steps each block was observed with finite gradients: a block seen only in masked steps
        # has no statistic (a zero sum would read as a 100 % change to the policy).
        finite_steps = [self._block_steps[b] - int(overflows[b]) for b in range(num_blocks)]
        summed: list[float | None] = [None] * num_blocks
        summed_l1: list[float | None] = [None] * num_blocks
        mean: list[float | None] = [None] * num_blocks
        if self._summing and self._summed:
            positions = sorted(self._summed)
            tensors = [self._summed[pos] for pos in positions]
            l2 = self._block_norms(positions, tensors, ord=2)
            l1 = self._block_norms(positions, tensors, ord=1)
            values, values_l1 = torch.stack([l2, l1]).cpu().tolist()
            observed = {self._param_block[pos] for pos in positions if finite_steps[self._param_block[pos]] > 0}
            summed = [values[b] if b in observed else None for b in range(num_blocks)]
            summed_l1 = [values_l1[b] if b in observed else None for b in range(num_blocks)]
        descent: tuple[float | None, ...] = ()
        if self._descent is not None:
            # A block trained through the whole interval: observed at every step, none frozen. A declared
            # skipped step (fp16 overflow, skip_step) moved no parameter: it does not break a block's span.
            observed = self._interval_steps - self._interval_skipped_steps
            active = [b >= self._first_active and self._block_steps[b] == observed for b in range(num_blocks)]
            descent = tuple(self._descent.close(self._summed, finite_steps, active))
        if self._summing and self._summed:
            torch._foreach_zero_(list(self._summed.values()))
        self._summing = self._sums_next_interval()
        if self._norm_sum is not None:
            sums = self._norm_sum.cpu().tolist()
            mean = [sums[b] / finite_steps[b] if finite_steps[b] > 0 else None for b in range(num_blocks)]
            self._norm_sum.zero_()
        # A block frozen for the whole interval was never observed.
        for b in range(min(self._first_active, num_blocks)):
            summed[b] = summed_l1[b] = mean[b] = None
        signals = {signal.name: self._signal_values(signal, num_blocks) for signal in self.signals}
        stats = IntervalStats(
            index=self.intervals_closed,
            epoch=epoch,
            end_step=end_step,
            steps=self._interval_steps,
            skipped_steps=self._interval_skipped_steps + overflow_steps,
            boundary=boundary,
            summed_grad_norm=tuple(summed),
            summed_grad_l1_norm=tuple(summed_l1),
            mean_step_grad_norm=tuple(mean),
            descent=descent,
            signals=signals,
        )
        self.history.append(stats)
        self.intervals_closed += 1
        del self.history[: -self.history_kept]
        self._block_steps = [0] * num_blocks
        self._interval_steps = 0
        self._interval_skipped_steps = 0
        return stats

    def _signal_values(self, signal: Signal, num_blocks: int) -> tuple[float | None, ...]:
        """The signal's values at this close, None for the frozen blocks; one line if it gave a value
        per block of some other model."""
        values = tuple(None if v is None else float(v) for v in signal.close(self._first_active))
        if len(values) != num_blocks:
            raise ValueError(
                f"signal '{signal.name}': close() gave {len(values)} values; accepted: one per block ({num_blocks})"
            )
        return tuple(None if b < self._first_active else v for b, v in enumerate(values))

    def _sums_next_interval(self) -> bool:
        return self.track_summed or (self._descent is not None and self._descent.reads_next_sum)

    @property
    def interval_steps(self) -> int:
        return self._interval_steps

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        self._fold_pending()  # the saved sums hold every step observed (the format has no pending rows)
        return {
            "history": [s.to_dict() for s in self.history],
            "intervals_closed": self.intervals_closed,
            "first_active": self._first_active,
            "interval_steps": self._interval_steps,
            "interval_skipped_steps": self._interval_skipped_steps,
            "block_steps": list(self._block_steps),
            # Partial sums, so a run checkpointed mid-interval resumes with the same statistics.
            "summed": {pos: t.detach().cpu().clone() for pos, t in self._summed.items()},
            "norm_sum": None if self._norm_sum is None else self._norm_sum.detach().cpu().clone(),
            "overflows": None if self._overflows is None else self._overflows.detach().cpu().clone(),
            "overflow_steps": None if self._overflow_steps is None else self._overflow_steps.detach().cpu().clone(),
            "overflow_steps_total": self.overflow_steps_total,
            "descent": None if self._descent is None else self._descent.state_dict(),
            "signals": {signal.name: signal.state_dict() for signal in self.signals},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`, partial interval sums included.

        Args:
            state: written by :meth:`state_dict` of a monitor over the same blocks (the Freezer
                checks it first: :func:`freeze.freezer.records.check_saved_monitor`).
        """
        self._pending_count, self._pending_scales, self._pending_positions = 0, [], ()  # replaced, not folded
        self.history = [IntervalStats.from_dict(d) for d in state["history"]][-self.history_kept :]
        self.intervals_closed = int(state.get("intervals_closed", len(state["history"])))
        self.set_first_active(int(state["first_active"]))
        self._interval_steps = int(state["interval_steps"])
        self._interval_skipped_steps = int(state["interval_skipped_steps"])
        self._block_steps = [int(s) for s in state["block_steps"]]
        self._summed = {}  # set_first_active above dropped the flat buffers
        for pos, t in state["summed"].items():
            p = self._params[int(pos)]
            self._summed[int(pos)] = t.to(device=p.device, dtype=p.dtype)
        norm_sum = state["norm_sum"]
        if norm_sum is None:
            self._norm_sum = None
        else:
            device = self._params[0].device if self._params else torch.device("cpu")
            self._norm_sum = norm_sum.to(device=device, dtype=self._norm_dtype)
        # .get: checkpoints written before overflow detection have no such entries.
        overflows, overflow_steps = state.get("overflows"), state.get("overflow_steps")
        if overflows is None:
            self._overflows = self._overflow_steps = None
        else:
            device = self._params[0].device if self._params else torch.device("cpu")
            self._overflows, self._overflow_steps = overflows.to(device), overflow_steps.to(device)
        self.overflow_steps_total = int(state.get("overflow_steps_total", 0))
        saved_descent = state.get("descent")
        if self._descent is not None and saved_descent is not None:
            self._descent.load_state_dict(saved_descent)
        elif self._descent is not None:  # saved without it: the estimates start afresh
            self._descent = DescentTracker(self._params, self._param_block, len(self.blocks), self._descent.span)
        saved_signals = state.get("signals") or {}  # .get: saved before signals existed
        for signal in self.signals:
            if signal.name in saved_signals:
                signal.load_state_dict(saved_signals[signal.name])
        self._summing = self._sums_next_interval()
