"""The training loop's per-step bookkeeping, on a tiny model in one process."""

import torch
import torch.nn.functional as F

from freeze import Freezer, split_blocks
from freeze.pipeline.train import observe_then_clip
from tests.tiny_models import TinyNet, global_batch


def _backward(model, step=0, scaler=None):
    x, y = global_batch(step, 8)
    loss = F.cross_entropy(model(x), y)
    (loss if scaler is None else scaler.scale(loss)).backward()


def test_monitor_reads_gradients_before_clipping():
    torch.manual_seed(0)
    model = TinyNet()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    # the statistics under test: policy none reads none, so they are asked for
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer, track_summed_grads=True)
    _backward(model)
    unclipped = torch.nn.utils.get_total_norm([p.grad for p in params])
    observe_then_clip(freezer, params, optimizer, torch.amp.GradScaler("cpu", enabled=False), grad_clip_norm=1e-3)
    stats = freezer.monitor.close_interval(epoch=0, boundary=0, end_step=freezer.counters.steps)
    read = sum(n**2 for n in stats.mean_step_grad_norm) ** 0.5
    assert abs(read - unclipped.item()) < 1e-4 * unclipped.item()
    assert torch.nn.utils.get_total_norm([p.grad for p in params]) < 1.01e-3  # and clipping still happened


def test_overflowed_fp16_step_is_counted_as_skipped():
    torch.manual_seed(0)
    model = TinyNet()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer, interval_steps=2, track_summed_grads=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        _backward(model, step, scaler)
        if step == 0:
            model.head.weight.grad[0, 0] = float("inf")  # what an fp16 overflow leaves behind
        observe_then_clip(freezer, params, optimizer, scaler, grad_clip_norm=0.0)
        scaler.step(optimizer)
        scaler.update()
    assert (freezer.counters.steps, freezer.counters.skipped_steps) == (2, 1)
    freezer.after_step()  # the interval of 2 steps (one of them skipped) closes here
    (stats,) = freezer.history
    assert (stats.steps, stats.skipped_steps, stats.end_step) == (2, 1, 2)
    assert all(n is not None and torch.isfinite(torch.tensor(n)) for n in stats.mean_step_grad_norm)
