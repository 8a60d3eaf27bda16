"""freeze.monitor.blockwise: per-block reductions of per-tensor values, and the loss scale a step's
gradients carry (what the monitor's trackers share)."""

import math

import pytest
import torch

from freeze.monitor.blockwise import BlockIndex, refuse_bad_float_scale, scale_inverses

# five parameters in three blocks: 0, 0, 1, 2, 2
INDEX = [0, 0, 1, 2, 2]


def test_per_block_norms_match_hand_computation_and_an_absent_block_reads_zero():
    index = BlockIndex(INDEX, 3, torch.float32)
    tensors = [torch.tensor([3.0]), torch.tensor([4.0]), torch.tensor([-1.0, 1.0])]
    positions = [0, 1, 2]  # block 2's parameters have no gradient this step
    l2 = index.block_norms(positions, tensors, ord=2).tolist()
    l1 = index.block_norms(positions, tensors, ord=1).tolist()
    assert l2 == pytest.approx([5.0, math.sqrt(2.0), 0.0])
    assert l1 == pytest.approx([7.0, 2.0, 0.0])
    rows = torch.tensor([[3.0, 4.0, 2.0], [0.0, 1.0, 0.0]])  # two steps' per-tensor L2 norms
    expected = torch.tensor([[5.0, 2.0, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(index.rows_block_norms(positions, rows), expected)


def test_the_index_tensors_are_kept_per_layout_and_bounded():
    index = BlockIndex(INDEX, 3, torch.float32)
    first = index.ids_for([0, 2], torch.device("cpu"))
    assert index.ids_for([0, 2], torch.device("cpu")) is first  # built once per set of positions
    for n in range(1, 10):  # a set of parameters with a gradient that keeps changing
        index.ids_for(list(range(n % 5)), torch.device("cpu"))
    assert len(index._ids) <= 8
    index.forget_layouts()
    assert index.ids_for([0, 2], torch.device("cpu")) is not first


def test_scale_inverses_mask_a_bad_tensor_scale_and_leave_host_floats_unmasked():
    cpu = torch.device("cpu")
    assert scale_inverses([None, None], cpu, torch.float32) == (None, None)
    ok, inverse = scale_inverses([2.0, None], cpu, torch.float32)
    assert ok is None and inverse.tolist() == [0.5, 1.0]
    scales = [torch.tensor(4.0), torch.tensor(float("nan")), torch.tensor(0.0), torch.tensor(-1.0), None]
    ok, inverse = scale_inverses(scales, cpu, torch.float32)
    assert ok.tolist() == [True, False, False, False, True]
    assert inverse.tolist() == [0.25, 0.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -2.0, True, "2"])
def test_a_bad_host_scale_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match="accepted: the loss scale, a finite number > 0") as info:
        refuse_bad_float_scale(bad)
    assert "\n" not in str(info.value)


def test_a_good_or_absent_scale_passes_and_a_tensor_is_left_to_the_device():
    for fine in (None, 1.0, 65536.0, torch.tensor(float("nan"))):
        refuse_bad_float_scale(fine)
