"""Mixed precision on the device: fp16 autocast with a GradScaler (CUDA) and bf16 autocast.

Claims: a step the GradScaler skips is counted by the monitor exactly as the scaler counts it, and the
norms the monitor records are those of the unscaled gradients of the steps taken, whether it reads
them after ``unscale_`` or before it with ``grad_scale=``; frozen parameters and BatchNorm statistics
stay bit-identical under every precision. The CPU variant has no fp16 overflow of its own: it plants
inf losses (the same steps on CUDA), and the CUDA variant adds whatever fp16 overflows by itself."""

import math

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, split_blocks
from freeze.blocks import frozen_names
from tests.gpu.devices import DEVICES, autocast, cuda_only
from tests.tiny_models import TinyNet, global_batch

STEPS, INTERVAL, BOUNDARY = 16, 4, 1
PLANTED_INF_STEPS = {2, 5, 6, 13}  # the loss is multiplied by inf: every gradient is non-finite


def _block_norms(blocks, first: int) -> list[float]:
    """L2 norm per block of the current (unscaled) gradients, blocks ``first..``; fp64 on the host."""
    return [
        math.sqrt(sum(float(p.grad.double().square().sum()) for p in b.params if p.grad is not None))
        for b in blocks[first:]
    ]


def scaled_run(device_name: str, read: str) -> dict:
    """STEPS steps with a GradScaler; ``read``: "after_unscale" or "grad_scale" (before unscale_)."""
    device = torch.device(device_name)
    precision = "fp16" if device.type == "cuda" else "fp32"
    torch.manual_seed(0)
    model = TinyNet().to(device)
    blocks = split_blocks(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    freezer = Freezer(model, blocks, optimizer=optimizer, interval_steps=INTERVAL, track_summed_grads=True)
    freezer.set_boundary(BOUNDARY)
    freezer.train()
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16)
    skipped, norms, sums = [], [], []  # per step: scaler skipped it; per-block norms; gradients taken
    for step in range(STEPS):
        x, y = (t.to(device) for t in global_batch(step, 8))
        optimizer.zero_grad(set_to_none=True)
        with autocast(device.type, precision):
            loss = F.cross_entropy(freezer.module(x), y)
        if step in PLANTED_INF_STEPS:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        if read == "grad_scale":
            freezer.after_backward(grad_scale=scale)
            scaler.unscale_(optimizer)
        else:
            scaler.unscale_(optimizer)
            freezer.after_backward()
        norms.append(_block_norms(blocks, BOUNDARY))
        sums.append([p.grad.detach().double().clone() for b in blocks[BOUNDARY:] for p in b.params])
        scaler.step(optimizer)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)  # the scaler halves its scale on each step it skips
        freezer.after_step()
    return {"skipped": skipped, "norms": norms, "sums": sums, "history": freezer.history, "blocks": blocks}


@pytest.mark.parametrize("read", ["after_unscale", "grad_scale"])
@pytest.mark.parametrize("device", DEVICES)
def test_skipped_steps_counted_as_the_scaler_counts_them_and_norms_unscaled(device, read):
    run = scaled_run(device, read)
    history, skipped = run["history"], run["skipped"]
    assert len(history) == STEPS // INTERVAL
    assert all(skipped[s] for s in PLANTED_INF_STEPS)
    assert sum(skipped) < STEPS - 4, "too few steps taken to compare norms"
    for i, stats in enumerate(history):
        window = range(i * INTERVAL, (i + 1) * INTERVAL)
        taken = [s for s in window if not skipped[s]]
        assert stats.skipped_steps == len(window) - len(taken), f"interval {i}: the scaler skipped {window}"
        for b, block_norm in enumerate(stats.mean_step_grad_norm[BOUNDARY:]):
            if not taken:
                assert block_norm is None
                continue
            expected = sum(run["norms"][s][b] for s in taken) / len(taken)
            assert block_norm == pytest.approx(expected, rel=1e-4), f"interval {i}, block {b + BOUNDARY}"
        offsets = [0]
        for blk in run["blocks"][BOUNDARY:]:
            offsets.append(offsets[-1] + len(blk.params))
        for b, summed in enumerate(stats.summed_grad_norm[BOUNDARY:]):
            if not taken:
                continue
            parts = [sum(run["sums"][s][j] for s in taken) for j in range(offsets[b], offsets[b + 1])]
            expected = math.sqrt(sum(float(t.square().sum()) for t in parts))
            assert summed == pytest.approx(expected, rel=1e-4), f"interval {i}, block {b + BOUNDARY} (summed)"


@pytest.mark.parametrize(
    "device,precision",
    [("cpu", "fp32"), ("cpu", "bf16"), cuda_only("cuda", "fp32", id="cuda-fp32")]
    + [cuda_only("cuda", "bf16", id="cuda-bf16"), cuda_only("cuda", "fp16", id="cuda-fp16")],
)
def test_frozen_parameters_and_batchnorm_statistics_stay_bit_identical(device, precision):
    device = torch.device(device)
    torch.manual_seed(0)
    model = TinyNet().to(device)
    blocks = split_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)  # decay would move them
    freezer = Freezer(model, blocks, optimizer=optimizer)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    for step, k in enumerate([0, 2, 2, 2, 3, 3]):
        freezer.set_boundary(k)
        freezer.train()
        model.train()  # a plain train() must not wake frozen BatchNorm up
        frozen = frozen_names(blocks, k)
        before = {n: t.detach().clone() for n, t in model.state_dict().items() if n in frozen}
        x, y = (t.to(device) for t in global_batch(step, 8))
        optimizer.zero_grad(set_to_none=True)
        with autocast(device.type, precision):
            loss = F.cross_entropy(freezer.module(x), y)
        assert torch.isfinite(loss), f"step {step}: loss {loss}"
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        freezer.after_backward()
        scaler.step(optimizer)
        scaler.update()
        after = model.state_dict()
        moved = [n for n, t in before.items() if not torch.equal(t, after[n])]
        assert not moved, f"step {step} (k={k}, {precision}): frozen tensors moved: {moved}"
