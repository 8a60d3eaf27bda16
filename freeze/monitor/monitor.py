"""Per-block gradient-norm monitor.

Reads the (already all-reduced) gradients of the active blocks once per optimizer step and keeps,
per block and per evaluation interval:

* ``summed_grad_norm`` / ``summed_grad_l1_norm``: the L2 / L1 norm of the gradient SUMMED over the
  interval, ``||sum_t g_t||``: the statistic AutoFreeze (L1, its reference code's
  ``torch.norm(grad, p=1)``) and the reference study (L2) compare between intervals.
* ``mean_step_grad_norm``: the mean over the interval's steps of the per-step norm ``||g_t||``.
* ``descent`` and a policy's own ``signals``, when its needs declare them.

The monitor counts steps and keeps the closed intervals; the statistics come from trackers made only
when the policy's needs ask for them (:meth:`freeze.freezer.Freezer` passes them): the step norms
(:mod:`freeze.monitor.step_norms`), the summed gradient (:mod:`freeze.monitor.grad_sums`), the
descent (:mod:`freeze.descent`) and signals (:mod:`freeze.signals`). A policy that reads no gradient
statistic gets none of them, and a step then only counts.

Per step it only launches device kernels: no ``.item()`` and no host sync, so it does not stall a
CUDA stream. The host sees numbers once per interval, in :meth:`GradNormMonitor.close_interval`.
A step whose gradients are not finite (an fp16 step GradScaler skips for overflow, or a NaN loss) is
masked and counted on the device, so neither sum is poisoned; the count is reported in
``IntervalStats.skipped_steps``. GradScaler skips exactly when some trainable gradient is inf or
NaN, which makes the fp32 norm of those gradients non-finite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from freeze.blocks import Block
from freeze.descent import DescentTracker
from freeze.intervals import IntervalStats
from freeze.monitor.blockwise import BlockIndex, GradScale, refuse_bad_float_scale
from freeze.monitor.grad_sums import GradientSums
from freeze.monitor.step_norms import StepNorms
from freeze.signals import Signal


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
        track_step_norms: keep the per-step norms (``mean_step_grad_norm``) and the overflow
            counts; on anyway with ``track_summed`` or ``track_descent`` (their masks need them).
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
        self.history_kept = history_kept
        self.history: list[IntervalStats] = []  # the last history_kept closed intervals
        self.intervals_closed = 0
        self._first_active = 0
        # Flat parameter list and the block index of each: per-block norms are then one
        # segment-sum over one foreach norm, whatever the number of blocks.
        self._params: list[torch.nn.Parameter] = [p for b in self.blocks for p in b.params]
        self._param_block = [i for i, b in enumerate(self.blocks) for _ in b.params]
        # Norms accumulate in fp32 (fp16/bf16 gradients are widened), and in fp64 when any parameter
        # is fp64: torch refuses to narrow a double to a float32 norm, and an fp64 model asks for
        # fp64 statistics. Fixed here, so every step's sums share one dtype.
        wide = any(p.dtype == torch.float64 for p in self._params)
        self.norm_dtype = torch.float64 if wide else torch.float32
        self._index = BlockIndex(self._param_block, len(self.blocks), self.norm_dtype)
        # The trackers the caller asked for; None: not tracked. Off, a step only counts (no norm, no
        # overflow check): for a policy that reads no gradient statistic, whose monitor would
        # otherwise launch a norm per step that nothing reads. Sums and descent need the per-step
        # norms (their overflow masks), so they keep them on.
        step_norms_on = track_step_norms or track_summed or track_descent
        self.step_norms: StepNorms | None = StepNorms(self._index) if step_norms_on else None
        self.grad_sums: GradientSums | None = GradientSums(self._index) if track_summed or track_descent else None
        self.descent: DescentTracker | None = (
            DescentTracker(self._params, self._param_block, len(self.blocks), descent_span) if track_descent else None
        )
        self._summing = self._sums_next_interval()  # whether this interval's gradients are summed
        self._block_steps = [0] * len(self.blocks)  # steps each block was observed this interval
        self._interval_steps = 0
        self._interval_skipped_steps = 0
        self.overflow_steps_total = 0  # masked steps in closed intervals (host, updated at close)
        self._active_positions = list(range(len(self._params)))

    # ---------------------------------------------------------------- per step
    def set_first_active(self, first_active: int) -> None:
        """Blocks before ``first_active`` are frozen: stop observing them and free their sums.

        Args:
            first_active: the freeze boundary k; blocks ``0 .. k-1`` are no longer observed.
        """
        if self.step_norms is not None:
            self.step_norms.set_first_active(first_active)  # folds the steps observed under the old one
        self._first_active = first_active
        if self.grad_sums is not None:
            self.grad_sums.drop_frozen(first_active)
        self._active_positions = [pos for pos, b in enumerate(self._param_block) if b >= first_active]
        self._index.forget_layouts()

    def _tick(self) -> None:
        self._interval_steps += 1

    def skip_step(self) -> None:
        """Count an optimizer step whose gradients must not be read (an fp16 step GradScaler skips
        for overflow): the step clock moves, no statistic changes."""
        self._tick()
        self._interval_skipped_steps += 1

    @torch.no_grad()
    def observe(self, grad_scale: GradScale = None) -> None:
        """Read the current gradients of the active blocks (call once per optimizer step). A step
        whose gradients are not finite is masked and counted on the device (no host sync).

        Args:
            grad_scale: the loss scale the gradients are still multiplied by (GradScaler's
                ``get_scale()``, or its scale tensor to stay off the host); None: unscaled.
        """
        refuse_bad_float_scale(grad_scale)  # before the step counts
        self._tick()
        for b in range(self._first_active, len(self.blocks)):
            self._block_steps[b] += 1
        for signal in self.signals:
            signal.observe(self._first_active, grad_scale)
        if self.step_norms is None:
            return
        positions = [pos for pos in self._active_positions if self._params[pos].grad is not None]
        if not positions:
            return
        grads = [self._params[pos].grad for pos in positions]
        row, grad_scale = self.step_norms.record(positions, grads, grad_scale)
        if self._summing:  # the gradients are gone after this step: sum them now
            self.grad_sums.add(positions, grads, row, grad_scale)

    def refuse_bad_grad_scales(self) -> None:
        """Raise ValueError when a ``grad_scale`` tensor of the running interval was NaN, inf, 0 or
        negative (the float form is refused at the call). One host read, and only when a tensor
        scale came since the last check; :meth:`close_interval` calls it before changing anything."""
        if self.step_norms is not None:
            self.step_norms.refuse_bad_scales()

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
        self.refuse_bad_grad_scales()  # folds the pending steps first
        num_blocks = len(self.blocks)
        overflows, overflow_steps = [0.0] * num_blocks, 0
        if self.step_norms is not None:
            overflows, overflow_steps = self.step_norms.take_overflows()
        self.overflow_steps_total += overflow_steps
        # Steps each block was observed with finite gradients: a block seen only in masked steps
        # has no statistic (a zero sum would read as a 100 % change to the policy).
        finite_steps = [self._block_steps[b] - int(overflows[b]) for b in range(num_blocks)]
        summed: list[float | None] = [None] * num_blocks
        summed_l1: list[float | None] = [None] * num_blocks
        if self._summing:
            summed, summed_l1 = self.grad_sums.block_norms(finite_steps)
        descent: tuple[float | None, ...] = ()
        if self.descent is not None:
            # A block trained through the whole interval: observed at every step, none frozen. A declared
            # skipped step (fp16 overflow, skip_step) moved no parameter: it does not break a block's span.
            observed = self._interval_steps - self._interval_skipped_steps
            active = [b >= self._first_active and self._block_steps[b] == observed for b in range(num_blocks)]
            descent = tuple(self.descent.close(self.grad_sums.sums, finite_steps, active))
        if self._summing:
            self.grad_sums.zero()
        self._summing = self._sums_next_interval()
        mean: list[float | None] = [None] * num_blocks
        if self.step_norms is not None:
            mean = self.step_norms.take_means(finite_steps)
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
        return self.track_summed or (self.descent is not None and self.descent.reads_next_sum)

    @property
    def interval_steps(self) -> int:
        return self._interval_steps

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        # the step norms fold first: the saved sums hold every step observed (no pending rows saved)
        step_norms = self.step_norms.state_dict() if self.step_norms is not None else {}
        return {
            "history": [s.to_dict() for s in self.history],
            "intervals_closed": self.intervals_closed,
            "first_active": self._first_active,
            "interval_steps": self._interval_steps,
            "interval_skipped_steps": self._interval_skipped_steps,
            "block_steps": list(self._block_steps),
            # Partial sums, so a run checkpointed mid-interval resumes with the same statistics.
            "summed": self.grad_sums.state_dict() if self.grad_sums is not None else {},
            "norm_sum": step_norms.get("norm_sum"),
            "overflows": step_norms.get("overflows"),
            "overflow_steps": step_norms.get("overflow_steps"),
            "overflow_steps_total": self.overflow_steps_total,
            "descent": None if self.descent is None else self.descent.state_dict(),
            "signals": {signal.name: signal.state_dict() for signal in self.signals},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`, partial interval sums included.

        Args:
            state: written by :meth:`state_dict` of a monitor over the same blocks (the Freezer
                checks it first: :func:`freeze.freezer.records.check_saved_monitor`).
        """
        if self.step_norms is not None:
            self.step_norms.discard_pending()  # replaced, not folded
        self.history = [IntervalStats.from_dict(d) for d in state["history"]][-self.history_kept :]
        self.intervals_closed = int(state.get("intervals_closed", len(state["history"])))
        self.set_first_active(int(state["first_active"]))
        self._interval_steps = int(state["interval_steps"])
        self._interval_skipped_steps = int(state["interval_skipped_steps"])
        self._block_steps = [int(s) for s in state["block_steps"]]
        if self.grad_sums is not None:
            self.grad_sums.load_state_dict(state["summed"], self._params)
        if self.step_norms is not None:
            device = self._params[0].device if self._params else torch.device("cpu")
            self.step_norms.load_state_dict(state, device)
        self.overflow_steps_total = int(state.get("overflow_steps_total", 0))
        saved_descent = state.get("descent")
        if self.descent is not None and saved_descent is not None:
            self.descent.load_state_dict(saved_descent)
        elif self.descent is not None:  # saved without it: the estimates start afresh
            self.descent = DescentTracker(self._params, self._param_block, len(self.blocks), self.descent.span)
        saved_signals = state.get("signals") or {}  # .get: saved before signals existed
        for signal in self.signals:
            if signal.name in saved_signals:
                signal.load_state_dict(saved_signals[signal.name])
        self._summing = self._sums_next_interval()
