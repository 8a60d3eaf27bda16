"""Two DDP ranks over gloo with the model on the device: with CUDA both ranks share the one GPU
(cuda:0). NCCL cannot do this: it refuses two ranks on one device ("Duplicate GPU detected"), so a
one-GPU machine checks the multi-rank path over gloo, whose all-reduce takes CUDA tensors.

Claims, every step: the bytes the comm hook all-reduced equal the trainable gradient bytes; the frozen
parameters and BatchNorm statistics stay bit-identical; the ranks end with identical weights. The
activation cache runs beside (built, advanced, dropped and rebuilt as the boundary moves; its store
shared by the node's ranks in /dev/shm, read into the device through the pinned staging buffers), and
serves bitwise what the prefix computes on each rank."""

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, split_blocks
from freeze.blocks import frozen_names
from freeze.cache import CacheSource
from tests.distributed_harness import run_distributed
from tests.gpu.devices import DEVICES
from tests.tiny_models import TinyNet, global_batch

SCHEDULE = [0, 1, 1, 2, 2, 3, 3, 1]  # boundary in force at each step: freeze further, then unfreeze
GLOBAL_BATCH = 8
N_KEYS = 32
INPUTS = torch.randn(N_KEYS, 3, 8, 8, generator=torch.Generator().manual_seed(3))  # the cache's source


def _state(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def ddp_on_device(rank: int, world_size: int, device_name: str) -> dict:
    device = torch.device(device_name)  # cuda: both ranks on cuda:0
    torch.manual_seed(rank)  # different weights per rank: the Freezer broadcasts rank 0's
    model = TinyNet().to(device)
    blocks = split_blocks(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    source = CacheSource(lambda keys: INPUTS[keys], N_KEYS)
    freezer = Freezer(model, blocks, optimizer=optimizer, cache="memory", cache_source=source)
    out = {"bytes": [], "trainable": [], "frozen_moved": [], "grad_device": set()}
    local = GLOBAL_BATCH // world_size
    for step, k in enumerate(SCHEDULE):
        freezer.set_boundary(k)
        freezer.train()
        before = _state(model)
        _, y = global_batch(step, GLOBAL_BATCH)
        keys = (torch.arange(GLOBAL_BATCH) + step * GLOBAL_BATCH) % N_KEYS
        keys, y = keys[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local].to(device)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(freezer.module(INPUTS[keys].to(device), sample_ids=keys), y).backward()
        out["grad_device"] |= {str(p.grad.device) for p in model.parameters() if p.grad is not None}
        freezer.after_backward()
        optimizer.step()
        after = _state(model)
        out["frozen_moved"].append([n for n in frozen_names(blocks, k) if not torch.equal(before[n], after[n])])
        out["bytes"].append(freezer.counters.allreduce_bytes_last_step)
        out["trainable"].append(freezer.trainable_grad_bytes)
    out["state"] = {n: t.cpu() for n, t in _state(model).items()}
    store, keys = freezer.cache.store, torch.tensor([3, 17, 0, 31])
    rows = freezer.cache.read(keys, next(model.parameters()).device)
    out["cache"] = (store.placement, store.level, freezer.cache.counters.hit_keys, freezer.cache.counters.builds)
    out["cache_exact"] = torch.equal(rows, freezer.cache.compute_prefix(INPUTS[keys], store.level))
    freezer.close()
    return out


@pytest.mark.processes
@pytest.mark.parametrize("device", DEVICES)
def test_two_ranks_on_the_device_reduce_exactly_the_trainable_bytes(tmp_path, device):
    ranks = run_distributed(ddp_on_device, 2, tmp_path, device)
    for r in ranks:
        assert r["grad_device"] == {"cuda:0" if device == "cuda" else "cpu"}
        assert r["bytes"] == r["trainable"], "bytes all-reduced per step != trainable gradient bytes"
        assert all(b > 0 for b in r["bytes"])
        assert not any(r["frozen_moved"]), f"frozen tensors moved: {r['frozen_moved']}"
        placement, level, hits, builds = r["cache"]
        assert level == SCHEDULE[-1] and builds == 2 and hits > 0, r["cache"]  # rebuilt after the unfreeze
        assert r["cache_exact"], f"the cache ({placement} store) served other rows than the prefix computes"
    differ = {n for n, t in ranks[0]["state"].items() if not torch.equal(t, ranks[1]["state"][n])}
    # Trainable BatchNorm statistics differ between DDP's forwards (each rank's own batch) until the
    # next forward's buffer broadcast; parameters and every frozen tensor must be identical.
    model = TinyNet()
    frozen = set(frozen_names(split_blocks(model), SCHEDULE[-1]))
    must_agree = {n for n, _ in model.named_parameters()} | frozen
    assert not differ & must_agree, f"ranks hold different tensors: {sorted(differ & must_agree)}"
