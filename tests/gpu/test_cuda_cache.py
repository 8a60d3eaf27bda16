"""The activation cache with the model on the device: its rows, served, are bitwise the rows the frozen
prefix computes (fp32, and under bf16 autocast the bits that autocast computes), in both placements a
CUDA model can get: on the device (a gather there) and on the host (rows gathered into a pinned buffer,
copied without blocking the host; two buffers in turn, each refilled only after its last copy ended)."""

import time

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, split_blocks
from freeze.cache import CacheSource
from tests.gpu.devices import CUDA_MARKS, DEVICES, autocast, cuda_only, deterministic
from tests.tiny_models import TinyNet

N_KEYS, BOUNDARY = 24, 2


def cached_on(device: torch.device, monkeypatch, placement: str = "auto") -> tuple[Freezer, torch.Tensor]:
    """A Freezer over TinyNet on ``device`` whose memory cache holds blocks 0..1's output; its inputs
    live on the host, as a dataset's do. ``placement="host"`` keeps a CUDA model's store on the host."""
    if placement == "host":
        monkeypatch.setattr("freeze.cache.cache.DEVICE_STORE_SHARE", 0.0)
    torch.manual_seed(0)
    model = TinyNet().to(device)
    x = torch.randn(N_KEYS, 3, 8, 8)
    freezer = Freezer(model, split_blocks(model), cache="memory", cache_source=CacheSource(lambda k: x[k], N_KEYS))
    freezer.set_boundary(BOUNDARY)
    return freezer, x


def train_step(freezer: Freezer, x: torch.Tensor, keys: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    device = next(freezer.model.parameters()).device
    freezer.train()
    with autocast(device.type, precision):
        out = freezer.module(x[keys].to(device), sample_ids=keys)
    F.cross_entropy(out.float(), torch.zeros(len(keys), dtype=torch.long, device=device)).backward()
    freezer.after_backward()
    return out


PLACEMENTS = [pytest.param("cpu", "auto", id="cpu"), cuda_only("cuda", "auto", id="cuda-device-store")]
PLACEMENTS.append(cuda_only("cuda", "host", id="cuda-host-store"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("device,placement", PLACEMENTS)
def test_served_equals_recomputed_bitwise(device, placement, precision, monkeypatch):
    deterministic(monkeypatch)
    freezer, x = cached_on(torch.device(device), monkeypatch, placement)
    device = next(freezer.model.parameters()).device  # cuda:0: the device the engine reads to
    train_step(freezer, x, torch.arange(4), precision)  # the build, under the training forward's autocast
    store = freezer.cache.store
    assert store is not None and store.level == BOUNDARY
    expected = "device" if (device.type == "cuda" and placement == "auto") else "private"
    assert store.placement == expected and store.data.device.type == ("cuda" if expected == "device" else "cpu")
    keys = torch.tensor([5, 0, 17, 9, 23, 3])
    rows = freezer.cache.read(keys, device)
    assert rows.device == next(freezer.model.parameters()).device
    with autocast(device.type, precision):
        recomputed = freezer.cache.compute_prefix(x[keys], BOUNDARY)
        assert torch.equal(rows, recomputed), "served rows differ from the prefix's output"
        freezer.train()
        served = freezer.module(x[keys].to(device), sample_ids=keys)
        with pytest.warns(RuntimeWarning, match="no sample_ids"):
            computed = freezer.module(x[keys].to(device))  # the same forward, prefix computed
    assert torch.equal(served, computed), "the served forward differs from the computed one"
    assert freezer.cache.counters.hit_keys >= len(keys)


@pytest.mark.parametrize("device", DEVICES)
def test_the_cache_serves_every_training_step_after_its_build(device, monkeypatch):
    device = torch.device(device)
    freezer, x = cached_on(device, monkeypatch)
    for step in range(4):
        train_step(freezer, x, torch.arange(step, N_KEYS, 4))
    counters = freezer.cache.counters
    assert counters.builds == 1 and counters.miss_keys == 0 and counters.hit_keys == N_KEYS  # the build step serves too


def _busy_s(cycles: int = 10**9) -> float:
    """Seconds the GPU takes for ``torch.cuda._sleep(cycles)``: one busy thread, about half a second."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return time.perf_counter() - start


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS, id="cuda")])
def test_device_store_reads_do_not_wait_for_the_gpu(device, monkeypatch):
    """A device store gathers by slots copied from pinned memory: a "non-blocking" copy from
    pageable memory waits for the stream to drain first, a host sync on every step that
    torch.cuda.set_sync_debug_mode does not report."""
    freezer, x = cached_on(torch.device(device), monkeypatch)
    device = next(freezer.model.parameters()).device
    train_step(freezer, x, torch.arange(4))
    store = freezer.cache.store
    assert store.placement == "device"
    keys = torch.arange(8)
    expected = store.read(keys, device)
    busy_s = _busy_s()
    torch.cuda._sleep(10**9)
    start = time.perf_counter()
    rows = store.read(keys, device)
    read_s = time.perf_counter() - start
    torch.cuda.synchronize()
    assert read_s < busy_s / 2, f"a read held the host {read_s:.3f} s behind a {busy_s:.3f} s kernel"
    assert torch.equal(rows, expected)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS, id="cuda")])
def test_host_store_reads_are_nonblocking_and_never_overwrite_a_copy_in_flight(device, monkeypatch):
    """The GPU is kept busy (torch.cuda._sleep) so the reads' copies queue behind it: the first two reads
    return to the host before the GPU gets to them (non-blocking, from pinned buffers), and the third,
    which refills the first read's buffer, waits for that copy instead of overwriting its rows."""
    freezer, x = cached_on(torch.device(device), monkeypatch, "host")
    device = next(freezer.model.parameters()).device
    train_step(freezer, x, torch.arange(4))
    store = freezer.cache.store
    assert store.placement == "private" and store.data.device.type == "cpu"
    batches = [torch.arange(0, 8), torch.arange(8, 16), torch.arange(16, 24)]
    expected = [store.data[store.slots(b)].to(device) for b in batches]
    for b in batches[:2]:  # both pinned buffers allocated (an allocation may wait for the GPU) and idle
        store.read(b, device)
    busy_s = _busy_s()
    torch.cuda._sleep(10**9)
    start = time.perf_counter()
    reads = [store.read(b, device) for b in batches[:2]]
    two_reads_s = time.perf_counter() - start
    reads.append(store.read(batches[2], device))
    torch.cuda.synchronize()
    assert all(b.is_pinned() for b in store._staging._buffers), "the staging buffers are not pinned"
    assert two_reads_s < busy_s / 2, f"two reads held the host {two_reads_s:.3f} s behind a {busy_s:.3f} s kernel"
    for i, (got, want) in enumerate(zip(reads, expected)):
        assert torch.equal(got, want), f"read {i} returned other rows (a staging buffer overwritten in flight)"
