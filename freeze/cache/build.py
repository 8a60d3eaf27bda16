"""Fill a store so that EVERY rank can serve EVERY key: each rank computes 1/W of the keys, then the
ranks exchange chunk by chunk (memory stores) or write into their node's shared file (disk stores).

The plan is a pure function of (keys, world size, chunk size): rank r computes the contiguous
shard ``keys[r*S:(r+1)*S]`` (S = ceil(K/W)) in chunks of exactly C rows, the last one padded with a
repeated key, so a rebuild runs the same kernels on the same batches and is bit-identical. Chunks
never have one row: on this machine a batch of one takes another convolution path than a batch of
two or more (measured: 4.9e-6 max difference on ResNet-18's layer2 output; batches of 7, 32, 64, 128,
300 and any composition agreed bitwise), so C >= 2 keeps cached rows equal to the rows a training
batch computes.

Cost per rank: ceil(K/W) rounded up to chunks, forwards of the cached segment. A store shared by
the node's ranks (/dev/shm or disk) receives only the rows computed on other nodes: nothing on one
node; a private store receives (W-1)/W of all rows (K x bytes per row).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from freeze import comm
from freeze.cache.store import ActivationStore


@dataclass(frozen=True)
class Topology:
    """Which ranks share a node (and so a node-local file): torchrun's GROUP_RANK (the node's index)
    when set, else the host name (several emulated nodes on one host have one host name)."""

    rank: int
    world_size: int
    node_name: str
    node_of: tuple[int, ...]  # node index of every rank

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @property
    def is_node_leader(self) -> bool:
        return self.rank == min(r for r, n in enumerate(self.node_of) if n == self.node)

    @property
    def single_node(self) -> bool:
        return len(set(self.node_of)) == 1

    @property
    def local_ranks(self) -> int:
        return self.node_of.count(self.node)

    @classmethod
    def detect(cls, process_group=None) -> Topology:
        group = os.environ.get("GROUP_RANK")
        name = socket.gethostname() + (f"-node{group}" if group is not None else "")
        if not comm.is_distributed():
            return cls(0, 1, name, (0,))
        world = comm.world_size(process_group)
        names = comm.all_gather_object(name, process_group)
        order = {h: i for i, h in enumerate(dict.fromkeys(names))}
        return cls(comm.rank(process_group), world, name, tuple(order[h] for h in names))


@dataclass(frozen=True)
class FillPlan:
    keys: torch.Tensor  # sorted unique keys to fill
    world_size: int
    chunk: int  # rows per chunk (>= 2)
    shard: int  # keys per rank (the last ranks may hold fewer real ones)

    @classmethod
    def make(cls, keys: torch.Tensor, world_size: int, chunk_samples: int) -> FillPlan:
        shard = -(-keys.numel() // world_size)
        return cls(keys, world_size, max(2, min(chunk_samples, shard)), shard)

    @property
    def chunks(self) -> int:
        return -(-self.shard // self.chunk)

    def real_keys(self, rank: int, j: int) -> torch.Tensor:
        begin = rank * self.shard + j * self.chunk
        end = min(rank * self.shard + min((j + 1) * self.chunk, self.shard), self.keys.numel())
        return self.keys[begin:end] if begin < end else self.keys[:0]

    def padded_keys(self, rank: int, j: int) -> torch.Tensor:
        real = self.real_keys(rank, j)
        pad = self.keys[:1].expand(self.chunk - real.numel())
        return torch.cat([real, pad])

    @property
    def forwards_per_rank(self) -> int:
        return self.chunks * self.chunk


@dataclass
class FillResult:
    forwards: int = 0  # rows this rank computed (pads included)
    exchanged_bytes: int = 0  # bytes this rank received
    compute_s: float = 0.0
    exchange_s: float = 0.0
    completed: bool = True


def fill(
    store: ActivationStore,
    plan: FillPlan,
    compute: Callable[[torch.Tensor], torch.Tensor],
    topo: Topology,
    process_group=None,
    after_first_chunk: Callable[[FillResult], bool] | None = None,
) -> FillResult:
    """Compute every key of ``plan`` into ``store``; ``compute(keys) -> activations``.

    ``after_first_chunk(result)`` may stop the fill (returns False; every rank must agree)."""
    result = FillResult()
    # A private store needs every row; a shared one only the rows computed on other nodes.
    exchange = topo.world_size > 1 and (not store.shared or not topo.single_node)
    for j in range(plan.chunks):
        start = time.perf_counter()
        with torch.no_grad():
            values = compute(plan.padded_keys(topo.rank, j))
        if store.compute_dtype is None:
            store.compute_dtype = values.dtype  # what the forward computes (under autocast: its dtype)
        values = values.to(store.data.dtype)
        real = plan.real_keys(topo.rank, j)
        store.write(store.slot_of[real], values[: real.numel()])
        result.forwards += plan.chunk
        result.compute_s += time.perf_counter() - start
        if exchange:
            start = time.perf_counter()
            result.exchanged_bytes += _exchange(store, plan, j, values, topo, process_group)
            result.exchange_s += time.perf_counter() - start
        if j == 0 and after_first_chunk is not None and not after_first_chunk(result):
            result.completed = False
            return result
    if store.shared and topo.world_size > 1:
        comm.barrier(process_group)  # every rank's rows are in the shared file before anyone reads
    return result


def _exchange(
    store: ActivationStore, plan: FillPlan, j: int, values: torch.Tensor, topo: Topology, process_group
) -> int:
    device = comm.collective_device(process_group)
    # Exchange raw bytes: no backend has to support the storage dtype (gloo has no int16/bf16 gather).
    bits = values.contiguous().reshape(-1).view(torch.uint8).to(device)
    gathered = comm.all_gather(bits, process_group)
    received = 0
    for src in range(topo.world_size):
        if src == topo.rank:
            continue
        received += bits.numel() * bits.element_size()
        same_node = topo.node_of[src] == topo.node
        if store.shared and (same_node or not topo.is_node_leader):
            continue  # a rank of that node wrote these rows into the shared file already
        real = plan.real_keys(src, j)
        rows = gathered[src].cpu().view(store.data.dtype).view(values.shape)
        store.write(store.slot_of[real], rows[: real.numel()])
    return received
