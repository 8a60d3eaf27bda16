"""Per-block sums of per-tensor values on the device, and the loss scale a step's gradients carry:
what the monitor's trackers (:mod:`freeze.monitor.step_norms`, :mod:`freeze.monitor.grad_sums`)
share."""

from __future__ import annotations

import math

import torch

from freeze.checks import is_number


class BlockIndex:
    """Which block each monitored parameter belongs to, and per-block reductions over them.

    Args:
        param_block: the block index of each parameter, in the monitor's flat parameter order.
        num_blocks: the number of blocks.
        norm_dtype: the dtype norms accumulate in (fp32, or fp64 for an fp64 model).
    """

    def __init__(self, param_block: list[int], num_blocks: int, norm_dtype: torch.dtype):
        self.param_block = param_block
        self.num_blocks = num_blocks
        self.norm_dtype = norm_dtype
        # Block index of each observed parameter, as a device tensor, per set of observed
        # positions: built once per boundary change rather than copied from the host every step
        # (on CUDA a host-to-device copy per step would stall the stream).
        self._ids: dict[tuple[int, ...], torch.Tensor] = {}

    def forget_layouts(self) -> None:
        """Drop the cached index tensors (the observed parameters changed)."""
        self._ids.clear()

    def ids_for(self, positions: list[int], device: torch.device) -> torch.Tensor:
        key = tuple(positions)
        ids = self._ids.get(key)
        if ids is None or ids.device != device:
            if len(self._ids) >= 8:  # the set of parameters with a gradient keeps changing
                self._ids.clear()
            ids = torch.tensor([self.param_block[pos] for pos in positions], device=device)
            self._ids[key] = ids
        return ids

    def segment_sum(self, positions: list[int], rows: torch.Tensor) -> torch.Tensor:
        """[n, num_blocks]: each row's per-tensor values (tensors of parameters ``positions``) summed per block."""
        block_ids = self.ids_for(positions, rows.device)
        summed = torch.zeros(rows.shape[0], self.num_blocks, device=rows.device, dtype=self.norm_dtype)
        return summed.index_add_(1, block_ids, rows)

    def rows_block_norms(self, positions: list[int], rows: torch.Tensor) -> torch.Tensor:
        """[n, num_blocks] L2 norm per block of each row of per-tensor L2 norms; 0 for blocks absent."""
        return self.segment_sum(positions, rows.square()).sqrt()

    def block_norms(self, positions: list[int], tensors: list[torch.Tensor], ord: int = 2) -> torch.Tensor:
        """[num_blocks] L``ord`` norm (1 or 2) per block of ``tensors`` (the tensors of parameters
        ``positions``): one foreach norm and one segment-sum, whatever the number of blocks; 0 for
        blocks absent."""
        # fp32 (or fp64) accumulation: a finite fp16 block whose norm exceeds 65504 must not read
        # as inf (that would mask a good step as an overflow).
        per_tensor = torch.stack(list(torch._foreach_norm(tensors, ord, dtype=self.norm_dtype))).unsqueeze(0)
        if ord == 1:  # the L1 norm of a block is the sum of its tensors' L1 norms
            return self.segment_sum(positions, per_tensor)[0]
        return self.rows_block_norms(positions, per_tensor)[0]


GradScale = float | torch.Tensor | None


def refuse_bad_float_scale(grad_scale: GradScale) -> None:
    """Refuse a host-side ``grad_scale`` that is not a finite number > 0 (checking a float costs no
    sync; inf would zero every norm, NaN poison them). A tensor is checked on the device."""
    if grad_scale is None or isinstance(grad_scale, torch.Tensor):
        return
    if not is_number(grad_scale) or not (math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"grad_scale = {grad_scale!r}; accepted: the loss scale, a finite number > 0")


def scale_inverses(
    scales: list[GradScale], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per step, whether its tensor grad_scale was a finite number > 0 ([n] bool; None when no
    step had a tensor scale), and 1 / its scale ([n]; 1 for a step without one, 0 for a bad one;
    None when no step had a scale)."""
    if all(scale is None for scale in scales):
        return None, None
    if not any(isinstance(scale, torch.Tensor) for scale in scales):
        # host floats: one copy per fold (a fold comes with a host read anyway, or every 256 steps)
        inverses = [1.0 if scale is None else 1.0 / float(scale) for scale in scales]
        return None, torch.tensor(inverses, dtype=dtype).to(device)
    one = torch.ones((), device=device, dtype=dtype)
    scale = torch.stack([s if isinstance(s, torch.Tensor) else one * (1.0 if s is None else float(s)) for s in scales])
    scale_ok = torch.isfinite(scale) & (scale > 0)
    return scale_ok, torch.where(scale_ok, scale.reciprocal(), 0.0)
