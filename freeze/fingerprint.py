"""A cheap, exact fingerprint of tensors: two 64-bit sums over their bits.

It answers "are these the same weights?" without copying them anywhere: across ranks (a rank that
loaded a checkpoint the others did not), and over time (frozen weights that changed after the
activation cache stored what they compute). Exact: any changed bit changes the position-weighted
sum unless another change cancels it at the same weights, which a load or a training step never
arranges. The sums stay on the tensors' device; the caller decides when to read them (one host
sync), so it costs nothing on a hot path.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements per step: bounds the int64 copy to 32 MB whatever the tensor's size
_WEIGHT_PERIOD = 65521  # a prime: positions weighted 1..65521, so a swap of two values is seen


@torch.no_grad()
def fingerprint(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """int64 ``[2]``: the sum of every element's bits, and the sum weighted by position (wrapping
    on overflow), over ``tensors`` in order. Empty input gives zeros on the CPU."""
    total: torch.Tensor | None = None
    offset = 0
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        words = flat.view(_INT_OF_SIZE[flat.element_size()])
        if total is None:
            total = torch.zeros(2, dtype=torch.int64, device=flat.device)
        for begin in range(0, words.numel(), _CHUNK):
            chunk = words[begin : begin + _CHUNK].to(torch.int64)
            weights = (torch.arange(chunk.numel(), device=chunk.device) + offset + begin) % _WEIGHT_PERIOD + 1
            total[0] += chunk.sum()
            total[1] += (chunk * weights).sum()
        offset += words.numel()
    return total if total is not None else torch.zeros(2, dtype=torch.int64)


def module_state(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Parameters and buffers of ``modules`` (each module with its submodules), each tensor once."""
    seen: set[int] = set()
    out = []
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out
