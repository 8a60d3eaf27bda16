"""freeze.cache.build: the fill plan is a pure function of (keys, world size, chunk size) that
covers every key once, in chunks of at least two rows; one process fills a store alone. (The
exchange between ranks: the 2-rank runs of tests/test_cache.py.)"""

import pytest
import torch

from freeze.cache.build import FillPlan, FillResult, Topology, fill
from freeze.cache.store import ActivationStore


@pytest.mark.parametrize("num_keys, world, chunk", [(10, 1, 4), (10, 2, 4), (7, 3, 2), (5, 4, 256), (1, 2, 8)])
def test_the_ranks_chunks_cover_every_key_once_in_chunks_of_at_least_two_rows(num_keys, world, chunk):
    keys = torch.arange(100, 100 + num_keys)
    plan = FillPlan.make(keys, world, chunk)
    assert plan.chunk >= 2 and plan.shard == -(-num_keys // world)
    real = [plan.real_keys(r, j) for r in range(world) for j in range(plan.chunks)]
    assert torch.equal(torch.cat(real), keys)  # each key once, in rank then chunk order
    for r in range(world):
        for j in range(plan.chunks):
            padded = plan.padded_keys(r, j)
            assert padded.numel() == plan.chunk and torch.equal(
                padded[: real[r * plan.chunks + j].numel()], real[r * plan.chunks + j]
            )
            assert set(padded.tolist()) <= set(keys.tolist())  # padding repeats a real key
    assert plan.forwards_per_rank == plan.chunks * plan.chunk


def test_the_chunk_is_never_one_row_nor_larger_than_a_shard():
    keys = torch.arange(9)
    assert FillPlan.make(keys, 1, 1).chunk == 2  # a batch of one takes another kernel path
    assert FillPlan.make(keys, 3, 256).chunk == 3  # no more rows than a rank computes
    plan = FillPlan.make(keys, 2, 4)  # shards of 5: rank 0 computes 4 + 1 real keys, rank 1 computes 4 + none
    assert (plan.shard, plan.chunks) == (5, 2)
    assert plan.real_keys(0, 1).tolist() == [4] and plan.padded_keys(0, 1).tolist() == [4, 0, 0, 0]
    assert plan.real_keys(1, 1).numel() == 0 and plan.padded_keys(1, 1).tolist() == [0, 0, 0, 0]  # same kernels
    again = FillPlan.make(keys.clone(), 2, 4)  # a pure function: the same plan, chunk by chunk
    assert all(torch.equal(plan.padded_keys(r, j), again.padded_keys(r, j)) for r in range(2) for j in range(2))


def test_a_topology_names_node_leaders_and_local_ranks():
    two_nodes = Topology(rank=3, world_size=4, node_name="b", node_of=(0, 0, 1, 1))
    assert two_nodes.node == 1 and not two_nodes.is_node_leader and two_nodes.local_ranks == 2
    assert not two_nodes.single_node
    assert Topology(rank=2, world_size=4, node_name="b", node_of=(0, 0, 1, 1)).is_node_leader
    alone = Topology.detect()  # no process group: one rank on one node
    assert (alone.rank, alone.world_size, alone.node_of) == (0, 1, (0,)) and alone.single_node


def test_one_process_fills_a_store_with_what_compute_returns_for_each_key():
    keys = torch.tensor([2, 3, 5, 8, 9])
    store = ActivationStore(1, keys, 10, torch.Size([3]), "fp32", None, torch.contiguous_format, torch.zeros(5, 3))
    seen = []

    def compute(batch: torch.Tensor) -> torch.Tensor:
        seen.append(batch.tolist())
        return batch.float().unsqueeze(1).expand(-1, 3) * 10

    result = fill(store, FillPlan.make(keys, 1, 2), compute, Topology.detect())
    assert seen == [[2, 3], [5, 8], [9, 2]]  # the last chunk padded with the first key
    assert store.compute_dtype == torch.float32  # learned from what compute returned
    assert torch.equal(store.read(keys, torch.device("cpu")), keys.float().unsqueeze(1).expand(-1, 3) * 10)
    assert (result.forwards, result.exchanged_bytes, result.completed) == (6, 0, True)


def test_after_first_chunk_can_stop_the_fill():
    keys = torch.arange(6)
    store = ActivationStore(1, keys, 6, torch.Size([1]), "fp32", None, torch.contiguous_format, torch.zeros(6, 1))
    calls = []
    result = fill(
        store,
        FillPlan.make(keys, 1, 2),
        lambda k: k.float().unsqueeze(1),
        Topology.detect(),
        after_first_chunk=lambda r: calls.append(r.forwards) or False,
    )
    assert calls == [2] and not result.completed and result.forwards == 2
    assert store.slots(torch.tensor([0, 1])) is not None and store.data[2:].eq(0).all()  # nothing after the stop
    assert FillResult().completed
