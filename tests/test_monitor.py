import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freeze import Freezer, GradNormMonitor, make_policy, split_blocks
from freeze.monitor import IntervalStats, relative_change
from freeze.policies import POLICIES
from tests.tiny_models import TinyNet, global_batch


def _model():
    return nn.Sequential(nn.Linear(3, 2, bias=False), nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False))


def _set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = None if g is None else torch.full_like(p, g)


def test_summed_and_mean_norms_match_hand_computation():
    model = _model()
    mon = GradNormMonitor(split_blocks(model))
    _set_grads(model, [1.0, 2.0, 3.0])
    mon.observe()
    _set_grads(model, [-1.0, 2.0, 1.0])
    mon.observe()
    s = mon.close_interval(epoch=0, boundary=0, end_step=2)
    n = [6, 4, 2]  # elements per block
    # block 0: grads cancel -> summed norm 0; mean per-step norm = sqrt(6)
    assert s.summed_grad_norm[0] == 0.0
    assert math.isclose(s.mean_step_grad_norm[0], math.sqrt(n[0]), rel_tol=1e-6)
    assert math.isclose(s.summed_grad_norm[1], 4.0 * math.sqrt(n[1]), rel_tol=1e-6)
    assert math.isclose(s.summed_grad_norm[2], 4.0 * math.sqrt(n[2]), rel_tol=1e-6)
    assert math.isclose(s.mean_step_grad_norm[2], 2.0 * math.sqrt(n[2]), rel_tol=1e-6)
    # L1 of the summed gradient: |sum| per element times the elements (AutoFreeze's statistic)
    assert s.summed_grad_l1_norm == (0.0, 4.0 * n[1], 4.0 * n[2])
    assert (s.steps, s.skipped_steps, s.end_step, s.index) == (2, 0, 2, 0)
    # the next interval starts from zero
    _set_grads(model, [1.0, 1.0, 1.0])
    mon.observe()
    s2 = mon.close_interval(epoch=1, boundary=0, end_step=3)
    assert math.isclose(s2.summed_grad_norm[0], math.sqrt(6), rel_tol=1e-6)


def test_frozen_blocks_are_not_observed():
    model = _model()
    mon = GradNormMonitor(split_blocks(model))
    mon.set_first_active(1)
    _set_grads(model, [5.0, 1.0, 1.0])
    mon.observe()
    s = mon.close_interval(epoch=0, boundary=1, end_step=1)
    assert s.summed_grad_norm[0] is None and s.summed_grad_l1_norm[0] is None and s.mean_step_grad_norm[0] is None
    assert s.summed_grad_norm[1] is not None


def test_state_round_trip_mid_interval_gives_identical_statistics():
    model = _model()
    mon = GradNormMonitor(split_blocks(model))
    _set_grads(model, [1.0, 2.0, 3.0])
    mon.observe()
    mon.close_interval(0, 0, end_step=1)
    mon.observe()  # one step into the next interval
    restored = GradNormMonitor(split_blocks(model))
    restored.load_state_dict(mon.state_dict())
    _set_grads(model, [0.5, 0.5, 0.5])
    mon.observe()
    restored.observe()
    assert mon.close_interval(1, 0, end_step=3) == restored.close_interval(1, 0, end_step=3)
    assert len(restored.history) == 2


def test_relative_change():
    a = IntervalStats(0, 0, 1, 1, 0, 0, (2.0, None, 0.0, 4.0), (4.0, 1.0, 1.0, 1.0), (0, 0, 0, 0))
    b = IntervalStats(1, 1, 2, 1, 0, 0, (1.0, 1.0, 1.0, 5.0), (1.0, 1.0, 1.0, 1.0), (0, 0, 0, 0))
    assert relative_change(a, b) == [0.5, None, None, 0.25]
    assert relative_change(a, b, norm="l1") == [0.75, 0.0, 0.0, 0.0]


def test_observe_copies_no_host_data_per_step(monkeypatch):
    """Per-step work is device kernels only: the block index is built once per boundary change."""
    model = _model()
    mon = GradNormMonitor(split_blocks(model))
    _set_grads(model, [1.0, 2.0, 3.0])
    mon.observe()
    built = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **kw: built.append(a) or real_tensor(*a, **kw))
    for _ in range(3):
        mon.observe()
    assert built == []
    mon.set_first_active(1)
    for _ in range(3):
        mon.observe()
    assert len(built) == 1  # the new active set's index, once


def test_skipped_steps_move_the_clock_not_the_statistics():
    model = _model()
    mon = GradNormMonitor(split_blocks(model))
    _set_grads(model, [1.0, 2.0, 3.0])
    mon.observe()
    _set_grads(model, [float("inf"), 2.0, 3.0])  # an fp16 overflow: not read
    mon.skip_step()
    s = mon.close_interval(epoch=0, boundary=0, end_step=2)
    assert (s.steps, s.skipped_steps, s.end_step) == (2, 1, 2)  # the Freezer's count: test_integration_core
    assert math.isclose(s.mean_step_grad_norm[0], math.sqrt(6), rel_tol=1e-6)  # one observed step
    assert math.isclose(s.summed_grad_l1_norm[0], 6.0, rel_tol=1e-6)


# ------------------------------------------------------------------------------ fp64 parameters (issue 33, D3)
def _train_fp64(model: nn.Module, policy: str, epochs: int = 3, steps: int = 2) -> Freezer:
    freezer = Freezer(model, split_blocks(model), make_policy(policy), epochs=epochs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(epochs):
        for step in range(steps):
            x, y = global_batch(epoch * steps + step, 8)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(freezer.module(x.double()), y).backward()
            freezer.after_backward()
            opt.step()
        freezer.end_epoch(epoch)
    return freezer


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_an_fp64_model_trains_under_every_policy_with_finite_fp64_statistics(policy):
    torch.manual_seed(0)
    freezer = _train_fp64(TinyNet().double(), policy)
    observed = [v for s in freezer.history for v in s.mean_step_grad_norm + s.summed_grad_norm if v is not None]
    assert observed and all(math.isfinite(v) for v in observed)
    assert freezer.monitor._norm_dtype == torch.float64


def test_one_fp64_block_among_fp32_ones_is_read_in_fp64_and_equals_the_fp64_reference():
    mixed = _model()
    mixed[1].double()
    reference = _model().double()
    mon, ref = GradNormMonitor(split_blocks(mixed)), GradNormMonitor(split_blocks(reference))
    for values in ([1.0, 2.0, 3.0], [0.5, -1.0, 0.25]):
        _set_grads(mixed, values)
        _set_grads(reference, values)
        mon.observe()
        ref.observe()
    s, r = mon.close_interval(0, 0, end_step=2), ref.close_interval(0, 0, end_step=2)
    assert s.summed_grad_norm == r.summed_grad_norm and s.mean_step_grad_norm == r.mean_step_grad_norm
