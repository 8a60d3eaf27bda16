"""The descent (freeze/descent.py): the loss a block's movement over a span removed, by the trapezoid
rule; unbiased by gradient noise, resumed bit for bit, summed only where it reads, unbroken by a
skipped step."""

import pytest
import torch
from torch import nn

from freeze import Freezer, split_blocks
from freeze.monitor import GradNormMonitor
from freeze.policies import make_policy
from tests.tiny_models import TinyNet, global_batch


class _Vector(nn.Module):
    """One block of 64 weights and a head, to hand the monitor gradients whose mean is known."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(64, 1, bias=False)
        self.head = nn.Linear(1, 1, bias=False)


def _descents(mean_gradient: float, noise: float, intervals: int = 60, steps: int = 4, lr: float = 0.05) -> list[float]:
    """The body's descent estimates under SGD on gradients = mean + Gaussian noise (no curvature:
    the true first-order loss decrease per unit LR is |mean|^2 = 64 * mean_gradient^2)."""
    torch.manual_seed(0)
    model = _Vector()
    blocks = split_blocks(model)
    monitor = GradNormMonitor(blocks, track_summed=True, track_descent=True)
    out = []
    for i in range(intervals):
        for _ in range(steps):
            model.body.weight.grad = mean_gradient + noise * torch.randn_like(model.body.weight)
            model.head.weight.grad = torch.zeros_like(model.head.weight)
            monitor.observe()
            with torch.no_grad():
                model.body.weight -= lr * model.body.weight.grad
        d = monitor.close_interval(0, 0, (i + 1) * steps).descent[0]
        if d is not None:
            out.append(d / (lr * steps))  # per unit of the LR the displacement spent
    return out


def test_descent_is_unbiased_by_gradient_noise_where_the_same_interval_dot_is_not():
    pure_noise = _descents(0.0, noise=1.0)
    mean = sum(pure_noise) / len(pure_noise)
    se = (sum((v - mean) ** 2 for v in pure_noise) / (len(pure_noise) - 1) / len(pure_noise)) ** 0.5
    assert abs(mean) < 3 * se  # zero learning reads as zero, within noise
    # the same-interval dot would read tr(Sigma) / steps = 64 / 4 = 16 per unit LR here: far outside
    assert mean + 6 * se < 16
    signal = _descents(0.5, noise=0.2)
    assert sum(signal) / len(signal) == pytest.approx(64 * 0.25, rel=0.05)


def test_descent_survives_a_checkpoint_bit_for_bit():
    def run(split_at: int | None):
        torch.manual_seed(0)
        model = TinyNet()
        freezer = Freezer(model, split_blocks(model), make_policy("none"), interval_steps=2, track_summed_grads=True)
        freezer.monitor = GradNormMonitor(freezer.blocks, track_summed=True, track_descent=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(8):
            if step == split_at:
                saved = {
                    "model": model.state_dict(),
                    "monitor": freezer.monitor.state_dict(),
                    "opt": optimizer.state_dict(),
                }
                model = TinyNet()
                model.load_state_dict(saved["model"])
                freezer = Freezer(
                    model, split_blocks(model), make_policy("none"), interval_steps=2, track_summed_grads=True
                )
                freezer.monitor = GradNormMonitor(freezer.blocks, track_summed=True, track_descent=True)
                freezer.monitor.load_state_dict(saved["monitor"])
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                optimizer.load_state_dict(saved["opt"])
            x, y = global_batch(step, 8)
            optimizer.zero_grad()
            nn.functional.cross_entropy(freezer.module(x), y).backward()
            freezer.monitor.observe()
            optimizer.step()
            if step % 2 == 1:
                freezer.monitor.close_interval(0, 0, step + 1)
        return [s.descent for s in freezer.monitor.history]

    whole, resumed = run(None), run(5)
    assert whole == resumed
    assert whole[2] != (None,) * 4 and all(d is not None for d in whole[2])  # the estimate after the resume


def test_without_summed_norms_the_descent_sums_only_the_intervals_it_reads_and_reads_the_same():
    torch.manual_seed(0)
    model = TinyNet()
    blocks = split_blocks(model)
    every = GradNormMonitor(blocks, track_summed=True, track_descent=True, descent_span=3)
    needed = GradNormMonitor(blocks, track_summed=False, track_descent=True, descent_span=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(24):
        x, y = global_batch(step, 8)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        every.observe()
        needed.observe()
        optimizer.step()
        if step % 2 == 1:
            every.close_interval(0, 0, step + 1)
            needed.close_interval(0, 0, step + 1)
    assert [s.descent for s in every.history] == [s.descent for s in needed.history]
    assert any(d is not None for s in needed.history for d in s.descent)
    summed = [s.summed_grad_norm[0] is not None for s in needed.history]
    assert summed == [i % 4 == 0 for i in range(12)]  # one interval of every span + 1


def test_a_declared_skipped_step_does_not_void_the_descent():
    torch.manual_seed(0)
    model = TinyNet()
    monitor = GradNormMonitor(split_blocks(model), track_summed=False, track_descent=True, descent_span=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(12):
        if step == 3:
            monitor.skip_step()  # an fp16 overflow GradScaler skipped: no update
        else:
            x, y = global_batch(step, 8)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            monitor.observe()
            optimizer.step()
        if step % 2 == 1:
            monitor.close_interval(0, 0, step + 1)
    assert all(d is not None for d in monitor.history[2].descent)  # the span over the skipped step still counts
