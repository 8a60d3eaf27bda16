"""freeze.monitor.step_norms: per-step norms recorded as rows and folded in step order; masked and
counted when not finite or badly scaled; its state round trip."""

import pytest
import torch

from freeze.monitor.blockwise import BlockIndex
from freeze.monitor.step_norms import StepNorms

INDEX = [0, 0, 1, 2]  # four parameters in three blocks


def _tracker() -> StepNorms:
    return StepNorms(BlockIndex(INDEX, 3, torch.float32))


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [
        torch.randn(3, generator=g),
        torch.randn(2, generator=g),
        torch.randn(4, generator=g),
        torch.randn(1, generator=g),
    ]


def _block_norms(grads: list[torch.Tensor]) -> list[float]:
    per_block = [0.0, 0.0, 0.0]
    for block, g in zip(INDEX, grads):
        per_block[block] += float(g.pow(2).sum())
    return [v**0.5 for v in per_block]


def test_more_steps_than_the_buffer_holds_fold_to_the_per_step_sums():
    tracker, expected = _tracker(), [0.0, 0.0, 0.0]
    for step in range(300):  # past the 256 rows a buffer holds before it folds
        grads = _grads(step)
        tracker.record([0, 1, 2, 3], grads, None)
        expected = [e + n for e, n in zip(expected, _block_norms(grads))]
    means = tracker.take_means([300, 300, 300])
    assert means == pytest.approx([e / 300 for e in expected], rel=1e-5)
    assert tracker.take_means([1, 1, 1]) == [0.0, 0.0, 0.0]  # taken: reset


def test_a_non_finite_step_is_masked_and_counted_for_the_active_blocks_only():
    tracker = _tracker()
    tracker.set_first_active(1)  # block 0 frozen
    good = _grads(0)
    tracker.record([2, 3], good[2:], None)
    tracker.record([2, 3], [torch.tensor([float("inf")] * 4), good[3]], None)
    overflows, steps = tracker.take_overflows()
    assert overflows == [0.0, 1.0, 1.0] and steps == 1
    means = tracker.take_means([0, 1, 1])  # one finite step per active block
    assert means[0] is None and means[1:] == pytest.approx(_block_norms(good)[1:])


def test_a_host_scale_divides_and_a_bad_tensor_scale_is_refused_once():
    tracker = _tracker()
    grads = _grads(1)
    tracker.record([0, 1, 2, 3], [g * 8 for g in grads], 8.0)
    assert tracker.take_means([1, 1, 1]) == pytest.approx(_block_norms(grads), rel=1e-6)
    tracker.record([0, 1, 2, 3], grads, torch.tensor(0.0))
    with pytest.raises(ValueError, match="NaN, inf, 0 or negative at 1 step"):
        tracker.refuse_bad_scales()
    tracker.record([0, 1, 2, 3], grads, torch.tensor(2.0))
    with pytest.raises(ValueError):  # the count is never reset: still refused
        tracker.refuse_bad_scales()


def test_a_tensor_scale_is_copied_when_recorded():
    """GradScaler updates its scale tensor in place after the step: the step keeps the one it had."""
    tracker, scale = _tracker(), torch.tensor(2.0)
    _, kept = tracker.record([0, 1, 2, 3], _grads(2), scale)
    scale.fill_(4.0)
    assert float(kept) == 2.0


def test_state_round_trip_keeps_the_pending_steps():
    a, b = _tracker(), _tracker()
    for step in range(5):
        a.record([0, 1, 2, 3], _grads(step), None)
    b.load_state_dict(a.state_dict(), torch.device("cpu"))  # state_dict folds the pending rows first
    for step in range(5, 8):
        a.record([0, 1, 2, 3], _grads(step), None)
        b.record([0, 1, 2, 3], _grads(step), None)
    assert a.take_means([8, 8, 8]) == b.take_means([8, 8, 8])
