"""What a block's training still buys: the loss its parameters' movement over a few intervals removed,
per unit of learning rate.

Every ``span`` + 1 interval closes, per block ``b`` trained through all of them:

    descent_b = -1/2 < g_bar_b(a) + g_bar_b(c), theta_b(end of c-1) - theta_b(end of a) >,   c = a + span + 1

``g_bar(a)``, ``g_bar(c)``: the mean gradients of the intervals just before and just after the
``span`` intervals the parameters moved over (the monitor's summed gradient / its finite steps).
This is the trapezoid rule for the loss change along the displacement: exact for a quadratic loss,
so the curvature the movement climbs cancels. Divided by the learning rate the span's steps spent
(the policy knows the schedule) it is the training loss the block's updates remove per unit of
learning rate, whatever the optimizer (SGD, momentum, AdamW: the update it actually took), which a
policy can project over the run's remaining LR (freeze.policies.horizon).

Why not the gradient after the move alone, ``-<g_bar(c), delta>``: over short intervals the
displacement is dominated by oscillation across high-curvature directions (and, under Adam, by
noise-sized steps), which the later gradient opposes, so a block that still learns reads as
unlearning. Measured in development (search seed 100, ResNet-18, AdamW, 6-step intervals): every
body block read -0.02 to -5.9 nats per unit LR while training the body on removed about 3 nats per
unit LR of what remained. Nor the same interval's gradient: its sampling noise drove the very update
it is dotted with (+lr tr(Sigma)/B a step for SGD), so a block learning nothing would read as
learning. The gradients before and after come from other batches; under momentum, the interval
before still leaks a little of its noise into the movement (a small bias towards "still learns",
the safe side for a freezing rule).

Cost: two copies of the parameters (the mean gradient before, and the snapshot that becomes the
displacement), two dot products per parameter at the close that ends a span and a copy at the one
that starts the next; the summed gradient it reads is needed in one of every span + 1 intervals only
(the monitor sums nothing in the others unless asked: ``reads_next_sum``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DescentTracker:
    """One span at a time: the mean gradient and the parameters where it starts, the displacement
    when it ends, the descent at the close after; :meth:`close` gives one value per block at that
    close and None at the others."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], param_block: Sequence[int], num_blocks: int, span: int = 1
    ):
        if not isinstance(span, int) or span < 1:
            raise ValueError(f"DescentTracker: span = {span!r}; accepted: an integer >= 1 (intervals)")
        self._params = list(params)
        self._param_block = list(param_block)
        self._num_blocks = num_blocks
        self.span = span
        self._grad_before: dict[int, torch.Tensor] = {}  # position -> mean gradient of the start interval
        self._moved: dict[int, torch.Tensor] = {}  # position -> parameter at the start, then its displacement
        self._phase = 0  # closes since the span's start close (0: this close starts one)
        self._trained_run = [0] * num_blocks  # consecutive intervals each block trained through, to now

    @property
    def reads_next_sum(self) -> bool:
        """Whether the next close reads its interval's summed gradient (a span's start or end): the
        monitor sums the gradient only in those intervals, one of every span + 1."""
        return self._phase in (0, self.span + 1)

    @torch.no_grad()
    def close(
        self, summed: dict[int, torch.Tensor], finite_steps: Sequence[int], active: Sequence[bool]
    ) -> list[float | None]:
        """Descent per block when the interval closing now ends a span (else None), then advance.

        Args:
            summed: position -> the interval's summed gradient (the monitor's), read before it resets.
            finite_steps: per block, the interval's steps with a finite gradient.
            active: per block, whether it trained through the whole interval.
        """
        self._trained_run = [run + 1 if on else 0 for run, on in zip(self._trained_run, active)]
        out: list[float | None] = [None] * self._num_blocks
        if self._phase == self.span + 1:
            out = self._trapezoid(summed, finite_steps)
            self._phase = 0  # the interval after a span is the next one's start
        if self._phase == 0:
            self._start(summed, finite_steps)
        elif self._phase == self.span:
            for pos, start in self._moved.items():  # the start's parameters become their displacement
                torch.sub(self._params[pos].detach(), start, out=start)  # one pass; = -start + p exactly
        self._phase += 1
        return out

    def _steps(self, pos: int, summed: dict[int, torch.Tensor], finite_steps: Sequence[int]) -> int:
        return finite_steps[self._param_block[pos]] if pos in summed else 0

    def _start(self, summed: dict[int, torch.Tensor], finite_steps: Sequence[int]) -> None:
        grad_before, moved = {}, {}
        for pos, p in enumerate(self._params):
            steps = self._steps(pos, summed, finite_steps)
            if steps <= 0:
                continue
            # the buffers of the last span, reused: no allocation per span; one pass each
            grad_before[pos] = torch.div(summed[pos], steps, out=_reuse(self._grad_before.get(pos), summed[pos]))
            moved[pos] = _reuse(self._moved.get(pos), p).copy_(p.detach())
        self._grad_before, self._moved = grad_before, moved

    def _trapezoid(self, summed: dict[int, torch.Tensor], finite_steps: Sequence[int]) -> list[float | None]:
        out: list[float | None] = [None] * self._num_blocks
        # trained through the start interval, the span and this one
        ready = {b for b in range(self._num_blocks) if self._trained_run[b] >= self.span + 2}
        positions = [
            pos for pos in self._moved if self._param_block[pos] in ready and self._steps(pos, summed, finite_steps) > 0
        ]
        if not positions:
            return out
        # Two dot products per tensor (no temporaries), one host read for all; summed per block in
        # fp64 on the host.
        dots = torch.stack(
            [
                torch.stack(
                    [
                        torch.dot(self._grad_before[pos].reshape(-1), self._moved[pos].reshape(-1)).double(),
                        torch.dot(summed[pos].reshape(-1), self._moved[pos].reshape(-1)).double()
                        / self._steps(pos, summed, finite_steps),
                    ]
                ).sum()
                for pos in positions
            ]
        ).cpu()
        totals = [0.0] * self._num_blocks
        for pos, dot in zip(positions, dots.tolist()):
            totals[self._param_block[pos]] += dot
        for b in {self._param_block[pos] for pos in positions}:
            out[b] = -0.5 * totals[b]
        return out

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "span": self.span,
            "phase": self._phase,
            "trained_run": list(self._trained_run),
            "grad_before": {pos: t.detach().cpu().clone() for pos, t in self._grad_before.items()},
            "moved": {pos: t.detach().cpu().clone() for pos, t in self._moved.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["span"]) != self.span:
            raise ValueError(
                f"DescentTracker: the state was saved with span {state['span']}; this tracker's is {self.span}"
            )
        self._phase = int(state["phase"])
        self._trained_run = [int(v) for v in state["trained_run"]]
        device = {pos: p.device for pos, p in enumerate(self._params)}
        self._grad_before = {int(pos): t.to(device[int(pos)]) for pos, t in state["grad_before"].items()}
        self._moved = {
            int(pos): t.to(device=device[int(pos)], dtype=self._params[int(pos)].dtype)
            for pos, t in state["moved"].items()
        }


def _reuse(buffer: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``buffer`` when it can hold ``like``, else a new one."""
    if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype or buffer.device != like.device:
        return torch.empty_like(like)
    return buffer
