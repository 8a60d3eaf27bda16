"""What a block's training still buys: the first-order loss decrease of its last interval of updates,
measured against the gradient of the next interval.

At each interval close, per block ``b`` observed for the whole of the last two intervals:

    descent_b = -< g_bar_b(m), delta_b(m-1) >

``g_bar(m)``: the mean gradient of interval m (the monitor's summed gradient / its finite steps);
``delta(m-1)``: how far the optimizer moved the block's parameters over interval m-1 (two snapshots of
the parameters, taken at interval closes). Divided by the learning rates of interval m-1's steps it is
the loss the block's training removes per unit of learning rate, whatever the optimizer (SGD,
momentum, AdamW: the update it actually took), which a policy can project over the run's remaining
LR integral (freeze.policies.horizon).

Why the NEXT interval's gradient: ``-<g_bar(m-1), delta(m-1)>`` would dot the update with the very
gradients that drove it, and their sampling noise adds ``lr * tr(Sigma) / B`` per step to it (for
SGD): a block that learns nothing would still read as learning. The gradients of interval m are
drawn from other batches, so their noise is independent of ``delta(m-1)`` and the estimate is
unbiased to first order.

Cost: two copies of the trainable parameters (the last snapshot and the last displacement), one
pass over them per interval close; nothing per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DescentTracker:
    """Snapshots and displacements of each parameter, per block; :meth:`close` gives one
    ``descent`` per block at every interval close (None where not yet defined)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], param_block: Sequence[int], num_blocks: int):
        self._params = list(params)
        self._param_block = list(param_block)
        self._num_blocks = num_blocks
        self._snapshot: dict[int, torch.Tensor] = {}  # position -> parameter at the last close
        self._displacement: dict[int, torch.Tensor] = {}  # position -> its change over the last interval
        # Per block: its snapshot was taken at the last close while it trained (0), and its
        # displacement spans an interval in which it trained throughout (1).
        self._snapshot_valid = [False] * num_blocks
        self._displacement_valid = [False] * num_blocks

    @torch.no_grad()
    def close(
        self, summed: dict[int, torch.Tensor], finite_steps: Sequence[int], active: Sequence[bool]
    ) -> list[float | None]:
        """Descent per block for the interval closing now, then advance the snapshots.

        Args:
            summed: position -> the interval's summed gradient (the monitor's), read before it resets.
            finite_steps: per block, the interval's steps with a finite gradient.
            active: per block, whether it trained through the whole interval.
        """
        descent = self._dots(summed, finite_steps, active)
        self._advance(active)
        return descent

    def _dots(
        self, summed: dict[int, torch.Tensor], finite_steps: Sequence[int], active: Sequence[bool]
    ) -> list[float | None]:
        ready = [
            b for b in range(self._num_blocks) if active[b] and self._displacement_valid[b] and finite_steps[b] > 0
        ]
        positions = [pos for pos in summed if self._param_block[pos] in ready and pos in self._displacement]
        out: list[float | None] = [None] * self._num_blocks
        if not positions:
            return out
        # One device reduction per tensor, one host read for all: fp64 so a block of millions of
        # small products does not lose the sign of their sum.
        dots = torch.stack([(summed[pos].double() * self._displacement[pos].double()).sum() for pos in positions]).cpu()
        totals = [0.0] * self._num_blocks
        for pos, dot in zip(positions, dots.tolist()):
            totals[self._param_block[pos]] += dot
        for b in ready:
            out[b] = -totals[b] / finite_steps[b]
        return out

    def _advance(self, active: Sequence[bool]) -> None:
        for pos, p in enumerate(self._params):
            b = self._param_block[pos]
            if not active[b]:
                self._snapshot.pop(pos, None)
                self._displacement.pop(pos, None)
                continue
            now = p.detach()
            if self._snapshot_valid[b]:
                moved = self._displacement.get(pos)
                if moved is None or moved.shape != now.shape or moved.device != now.device:
                    moved = self._displacement[pos] = torch.empty_like(now)
                torch.sub(now, self._snapshot[pos], out=moved)
            snap = self._snapshot.get(pos)
            if snap is None or snap.shape != now.shape or snap.device != now.device:
                self._snapshot[pos] = now.clone()
            else:
                snap.copy_(now)
        for b in range(self._num_blocks):
            self._displacement_valid[b] = bool(active[b]) and self._snapshot_valid[b]
            self._snapshot_valid[b] = bool(active[b])

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "snapshot": {pos: t.detach().cpu().clone() for pos, t in self._snapshot.items()},
            "displacement": {pos: t.detach().cpu().clone() for pos, t in self._displacement.items()},
            "snapshot_valid": list(self._snapshot_valid),
            "displacement_valid": list(self._displacement_valid),
        }

    def load_state_dict(self, state: dict) -> None:
        def placed(saved: dict) -> dict[int, torch.Tensor]:
            out = {}
            for pos, t in saved.items():
                p = self._params[int(pos)]
                out[int(pos)] = t.to(device=p.device, dtype=p.dtype)
            return out

        self._snapshot = placed(state["snapshot"])
        self._displacement = placed(state["displacement"])
        self._snapshot_valid = [bool(v) for v in state["snapshot_valid"]]
        self._displacement_valid = [bool(v) for v in state["displacement_valid"]]
