"""The monitor's summed-gradient tracker: per parameter, the gradient summed over the running
interval, from which a close reads each block's ``||sum_t g_t||`` (L2 and L1).

The sums live in flat buffers (:class:`_FlatRun`), so the operations a step launches do not grow with
the parameter count: on the host a finite, unscaled step adds its gradients in place (one foreach
add per buffer); elsewhere it copies them into a staging buffer, masks a step that was not finite
(a masked fill, not a product: inf * 0 is NaN), unscales, and adds (three operations per buffer),
without reading the device's finiteness flag on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freeze.monitor.blockwise import BlockIndex, GradScale, scale_inverses

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


class GradientSums:
    """The running interval's summed gradient of each observed parameter.

    Args:
        index: the monitor's parameters -> blocks.
    """

    def __init__(self, index: BlockIndex):
        self.index = index
        self.sums: dict[int, torch.Tensor] = {}  # param position -> summed gradient (a view of a flat buffer)
        # The flat buffers the sums live in, and the (positions, shapes, dtypes) they were laid out for.
        self._runs: list[_FlatRun] = []
        self._layout: tuple = ()

    def drop_frozen(self, first_active: int) -> None:
        """Free the sums of the blocks before ``first_active``; the buffers are laid out again at the next step."""
        for pos in [pos for pos in self.sums if self.index.param_block[pos] < first_active]:
            del self.sums[pos]
        self._runs, self._layout = [], ()

    def add(self, positions: list[int], grads: list[torch.Tensor], row: torch.Tensor, grad_scale: GradScale) -> None:
        """Add this step's gradients (of parameters ``positions``; ``row``: their norms, from
        :meth:`StepNorms.record`) unscaled to the sums; nothing where the step was not finite or its
        scale tensor bad."""
        finite = torch.isfinite(self.index.rows_block_norms(positions, row.unsqueeze(0)).sum())
        inv_tensor, alpha = None, 1.0
        if isinstance(grad_scale, torch.Tensor):
            scale_ok, inv_scales = scale_inverses([grad_scale], row.device, self.index.norm_dtype)
            finite, inv_tensor = finite & scale_ok[0], inv_scales[0]
        elif grad_scale is not None:  # a host float: no copy to the device
            alpha = 1.0 / float(grad_scale)
        layout = (tuple(positions), tuple((g.shape, g.dtype, g.device) for g in grads))
        if layout != self._layout:  # a boundary move, a parameter without a gradient, a load
            self._runs, self.sums = _flat_runs(positions, grads, self.sums)
            self._layout = layout
        if inv_tensor is None and alpha == 1.0 and row.device.type in _FREE_TO_READ_DEVICE_TYPES:
            # On the host the step's finiteness costs nothing to read, so the gradients are added
            # where they are, or not at all: one pass over them instead of three through the staging
            # buffer (copy, mask, add), and the same sums bit for bit (x + 1 * g is exact either way;
            # a scaled step keeps the staging path, whose rounding the sums were measured with).
            if bool(finite):
                for run in self._runs:
                    torch._foreach_add_(run.sum_views, grads[run.grads])
            return
        not_finite = ~finite
        for run in self._runs:
            torch._foreach_copy_(run.staging_views, grads[run.grads])
            run.staging.masked_fill_(not_finite, 0.0)
            if inv_tensor is not None:
                run.staging.mul_(inv_tensor.to(run.staging.dtype))
            run.flat_sum.add_(run.staging, alpha=alpha)

    def block_norms(self, finite_steps: list[int]) -> tuple[list[float | None], list[float | None]]:
        """Each block's L2 and L1 norm of its summed gradient (one host read); None for a block not
        summed, or seen only in masked steps (``finite_steps`` 0: a zero sum would read as a 100 %
        change to the policy)."""
        num_blocks = self.index.num_blocks
        if not self.sums:
            return [None] * num_blocks, [None] * num_blocks
        positions = sorted(self.sums)
        tensors = [self.sums[pos] for pos in positions]
        l2 = self.index.block_norms(positions, tensors, ord=2)
        l1 = self.index.block_norms(positions, tensors, ord=1)
        values, values_l1 = torch.stack([l2, l1]).cpu().tolist()
        param_block = self.index.param_block
        observed = {param_block[pos] for pos in positions if finite_steps[param_block[pos]] > 0}
        summed = [values[b] if b in observed else None for b in range(num_blocks)]
        summed_l1 = [values_l1[b] if b in observed else None for b in range(num_blocks)]
        return summed, summed_l1

    def zero(self) -> None:
        if self.sums:
            torch._foreach_zero_(list(self.sums.values()))

    def state_dict(self) -> dict[int, torch.Tensor]:
        # Partial sums, so a run checkpointed mid-interval resumes with the same statistics.
        return {pos: t.detach().cpu().clone() for pos, t in self.sums.items()}

    def load_state_dict(self, saved: dict, params: list[torch.nn.Parameter]) -> None:
        """Continue from :meth:`state_dict` (``params``: the monitor's flat parameter list)."""
        self.sums, self._runs, self._layout = {}, [], ()
        for pos, t in saved.items():
            p = params[int(pos)]
            self.sums[int(pos)] = t.to(device=p.device, dtype=p.dtype)
