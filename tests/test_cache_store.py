"""freeze.cache.store: where cached activations live (a host tensor, or a memory-mapped file a
node's ranks share): rows by key, storage dtypes cast back to the compute dtype on read."""

import pytest
import torch

from freeze.cache.store import (
    STORAGE_DTYPES,
    ActivationStore,
    allocate_memory,
    element_bytes,
    map_file,
    shared_path,
    unlink,
)
from freeze.names import STORAGE_DTYPE_NAMES


def _store(keys, num_keys=10, storage_dtype="fp32", data=None, placement="private") -> ActivationStore:
    keys = torch.tensor(keys, dtype=torch.int64)
    if data is None:
        data = allocate_memory(keys.numel(), torch.Size([2, 3]), storage_dtype)
    return ActivationStore(
        level=1,
        keys=keys,
        num_keys=num_keys,
        sample_shape=torch.Size([2, 3]),
        storage_dtype=storage_dtype,
        compute_dtype=torch.float32,
        memory_format=torch.contiguous_format,
        data=data,
        placement=placement,
    )


def test_every_storage_dtype_name_has_its_dtype_and_size():
    assert tuple(STORAGE_DTYPES) == STORAGE_DTYPE_NAMES
    assert [element_bytes(n) for n in STORAGE_DTYPE_NAMES] == [4, 2, 2]


def test_rows_are_found_by_key_and_a_batch_with_any_key_missing_reads_nothing():
    store = _store([1, 4, 7])
    rows = torch.arange(18, dtype=torch.float32).reshape(3, 2, 3)
    store.write(store.slot_of[torch.tensor([1, 4, 7])], rows)
    assert store.slot_of.tolist() == [-1, 0, -1, -1, 1, -1, -1, 2, -1, -1]
    assert torch.equal(store.read(torch.tensor([7, 1]), torch.device("cpu")), rows[[2, 0]])
    assert store.read(torch.tensor([1, 2]), torch.device("cpu")) is None  # 2 has no entry
    assert store.slots(torch.tensor([1, 10])) is None and store.slots(torch.tensor([-1])) is None  # out of range
    assert store.slots(torch.tensor([], dtype=torch.int64)).numel() == 0
    assert store.nbytes == 3 * 6 * 4 and not store.shared and store.placement == "private"
    store.close()
    assert store.nbytes == 0


@pytest.mark.parametrize("storage_dtype", ["bf16", "fp16"])
def test_a_half_precision_store_holds_half_the_bytes_and_reads_back_in_the_compute_dtype(storage_dtype):
    store = _store([0, 1], storage_dtype=storage_dtype)
    values = torch.tensor([1.0, 1 / 3, -2.5, 1000.0, 1e-3, 0.0]).reshape(1, 2, 3).expand(2, 2, 3)
    store.write(torch.tensor([0, 1]), values)
    out = store.read(torch.tensor([1]), torch.device("cpu"))
    assert store.data.dtype == STORAGE_DTYPES[storage_dtype] and store.nbytes == 2 * 6 * 2
    assert out.dtype == torch.float32
    assert torch.equal(out[0], values[1].to(STORAGE_DTYPES[storage_dtype]).float())  # rounded once, cast back
    assert not torch.equal(out[0], values[1])  # 1/3 is not exact in 16 bits


@pytest.mark.parametrize("storage_dtype", ["fp32", "bf16", "fp16"])
def test_a_mapped_file_is_shared_by_every_mapping_and_gone_after_unlink(tmp_path, storage_dtype):
    path = shared_path(tmp_path / "sub", "node/0 a", "tok", 3)
    assert path.parent == tmp_path / "sub" and path.name == "freeze-cache-node_0_a-tok-k3.bin"
    writer = map_file(path, 4, torch.Size([2, 3]), storage_dtype, create=True)  # creates the directory too
    reader = map_file(path, 4, torch.Size([2, 3]), storage_dtype, create=False)
    assert writer.shape == (4, 2, 3) and writer.dtype == STORAGE_DTYPES[storage_dtype]
    writer[2] = 1.5
    assert torch.equal(reader[2], torch.full((2, 3), 1.5, dtype=reader.dtype))
    unlink(path)
    unlink(path)  # already gone: no error
    assert not path.exists() and reader[2, 0, 0].item() == 1.5  # the mapping keeps the data alive
    assert map_file(tmp_path / "empty.bin", 0, torch.Size([2]), storage_dtype, create=True).shape == (0, 2)


def test_shared_placements_are_shm_and_disk():
    assert _store([0], placement="shm").shared and _store([0], placement="disk").shared
