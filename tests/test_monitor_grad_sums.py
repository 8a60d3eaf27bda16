"""freeze.monitor.grad_sums: the interval's summed gradient per parameter, in flat buffers; a step not
finite adds nothing; frozen blocks' sums freed; block norms at the close; its state round trip."""

import pytest
import torch

from freeze.monitor.blockwise import BlockIndex
from freeze.monitor.grad_sums import GradientSums

INDEX = [0, 0, 1, 2]
SHAPES = [(3, 2), (2,), (4,), (1,)]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def _row(index: BlockIndex, grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(grads, 2, dtype=index.norm_dtype))


def _summed(free_to_read: bool, monkeypatch, steps=4, scale=None) -> GradientSums:
    monkeypatch.setattr(
        "freeze.monitor.grad_sums._FREE_TO_READ_DEVICE_TYPES", frozenset({"cpu"} if free_to_read else ())
    )
    sums = GradientSums(BlockIndex(INDEX, 3, torch.float32))
    for step in range(steps):
        grads = _grads(step) if scale is None else [g * scale for g in _grads(step)]
        sums.add([0, 1, 2, 3], grads, _row(sums.index, grads), scale)
    return sums


@pytest.mark.parametrize("free_to_read", [True, False])
def test_the_sums_are_the_gradients_added_in_place_or_through_staging(monkeypatch, free_to_read):
    sums = _summed(free_to_read, monkeypatch)
    for pos in range(4):
        expected = sum(_grads(step)[pos] for step in range(4))
        torch.testing.assert_close(sums.sums[pos], expected, rtol=0, atol=1e-6)


def test_a_host_scale_is_divided_out(monkeypatch):
    sums = _summed(False, monkeypatch, scale=4.0)
    torch.testing.assert_close(sums.sums[0], sum(_grads(step)[0] for step in range(4)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("free_to_read", [True, False])
def test_a_step_that_is_not_finite_adds_nothing(monkeypatch, free_to_read):
    sums = _summed(free_to_read, monkeypatch, steps=2)
    before = {pos: t.clone() for pos, t in sums.sums.items()}
    bad = _grads(9)
    bad[2][0] = float("nan")
    sums.add([0, 1, 2, 3], bad, _row(sums.index, bad), None)
    assert all(torch.equal(sums.sums[pos], before[pos]) for pos in before)


def test_block_norms_read_none_for_a_block_seen_only_in_masked_steps(monkeypatch):
    sums = _summed(True, monkeypatch, steps=2)
    l2, l1 = sums.block_norms([2, 2, 0])  # block 2: no finite step this interval
    total = [sum(_grads(step)[pos] for step in range(2)) for pos in range(4)]
    assert l2[0] == pytest.approx(float(torch.cat([total[0].flatten(), total[1]]).norm()), rel=1e-6)
    assert l1[1] == pytest.approx(float(total[2].abs().sum()), rel=1e-6)
    assert l2[2] is None and l1[2] is None


def test_frozen_blocks_sums_are_freed_and_the_rest_kept(monkeypatch):
    sums = _summed(True, monkeypatch, steps=2)
    kept = sums.sums[2].clone()
    sums.drop_frozen(2)  # blocks 0 and 1 frozen
    assert sorted(sums.sums) == [3]
    sums.add([3], _grads(5)[3:], _row(sums.index, _grads(5)[3:]), None)  # laid out again for the new set
    assert sorted(sums.sums) == [3] and not torch.equal(kept, sums.sums[3])


def test_state_round_trip_and_zero(monkeypatch):
    a = _summed(True, monkeypatch, steps=3)
    b = GradientSums(BlockIndex(INDEX, 3, torch.float32))
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    b.load_state_dict(a.state_dict(), params)
    assert all(torch.equal(a.sums[pos], b.sums[pos]) for pos in a.sums)
    a.zero()
    assert all(not t.any() for t in a.sums.values())
