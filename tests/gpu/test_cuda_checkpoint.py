"""A checkpoint written on one device resumes on the other: written on CUDA, loaded on a CPU machine
(``torch.load(..., map_location="cpu")``, as a machine without CUDA must), and written on the CPU,
loaded on CUDA (plain ``torch.load``: the tensors come back on the CPU and the Freezer, the model and
the optimizer move them to the parameters' device). The resumed run holds the saved bits, boundary,
optimizer state and monitor interval, trains on, and its cache rebuilds from the lineage on the new
device and serves the rows the prefix computes there."""

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, split_blocks
from freeze.cache import CacheSource
from tests.gpu.devices import cuda_only
from tests.tiny_models import TinyNet, global_batch

N_KEYS = 16
INPUTS = torch.randn(N_KEYS, 3, 8, 8, generator=torch.Generator().manual_seed(7))


def build(device: torch.device) -> tuple[Freezer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    source = CacheSource(lambda k: INPUTS[k], N_KEYS)
    freezer = Freezer(
        model,
        split_blocks(model),
        optimizer=optimizer,
        interval_steps=3,
        cache="memory",
        cache_source=source,
        track_summed_grads=True,  # the monitor's statistics are part of what travels (policy none reads none)
    )
    return freezer, optimizer


def step(freezer: Freezer, optimizer, index: int) -> torch.Tensor:
    device = next(freezer.model.parameters()).device
    keys = torch.arange(index % 4, N_KEYS, 4)
    _, y = global_batch(index, len(keys))
    freezer.train()
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(freezer.module(INPUTS[keys].to(device), sample_ids=keys), y.to(device))
    loss.backward()
    freezer.after_backward()
    optimizer.step()
    freezer.after_step()
    return loss


PAIRS = [pytest.param("cpu", "cpu", id="cpu-to-cpu"), cuda_only("cuda", "cpu", id="cuda-to-cpu")]
PAIRS.append(cuda_only("cpu", "cuda", id="cpu-to-cuda"))


@pytest.mark.parametrize("saved_on,resumed_on", PAIRS)
def test_checkpoint_resumes_on_the_other_device(saved_on, resumed_on, tmp_path):
    source_device, target_device = torch.device(saved_on), torch.device(resumed_on)
    freezer, optimizer = build(source_device)
    for i in range(2):
        step(freezer, optimizer, i)
    freezer.set_boundary(2)
    for i in range(2, 4):  # mid-interval at the save: partial sums travel too
        step(freezer, optimizer, i)
    path = tmp_path / "checkpoint.pt"
    torch.save(freezer.training_state_dict(), path)
    saved = {n: t.detach().cpu().clone() for n, t in freezer.model.state_dict().items()}

    map_location = "cpu" if target_device.type == "cpu" else None
    state = torch.load(path, weights_only=True, map_location=map_location)
    resumed, resumed_optimizer = build(target_device)
    resumed.load_training_state_dict(state)
    assert resumed.boundary == 2 and resumed.monitor.interval_steps == freezer.monitor.interval_steps
    assert all(torch.equal(t.cpu(), saved[n]) for n, t in resumed.model.state_dict().items())
    assert not any(p.requires_grad for b in resumed.blocks[:2] for p in b.params)
    moments = [t for s in resumed_optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert moments and all(t.device.type == target_device.type for t in moments)

    losses = [step(resumed, resumed_optimizer, i) for i in range(4, 7)]  # closes an interval with the saved sums
    assert all(torch.isfinite(loss) for loss in losses)
    assert len(resumed.history) == len(freezer.history) + 1
    assert all(v is not None for v in resumed.history[-1].mean_step_grad_norm[2:])
    store = resumed.cache.store
    assert store is not None and resumed.cache.counters.miss_keys == 0
    keys = torch.arange(N_KEYS)
    device = next(resumed.model.parameters()).device
    rows = resumed.cache.read(keys, device)
    assert rows.device == device and device.type == target_device.type
    assert torch.equal(rows, resumed.cache.compute_prefix(INPUTS[keys], store.level))
