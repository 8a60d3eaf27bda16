"""Where cached activations live: a host tensor, or a memory-mapped file shared by a node's ranks.

One store holds the activation at ONE cut for a set of keys, in a storage dtype (fp32 by default,
bf16/fp16 halve it), and casts back to the compute dtype on read. Rows are in ascending key order;
``slot_of[key]`` is the row of a key or -1.

Placements: ``private`` (a tensor of this process, on the host or, when it fits, on the model's
GPU: ``device``), ``shm`` (a file in /dev/shm, i.e. memory, shared
by the node's ranks) and ``disk`` (a file in a directory, for stores over the memory budget). Shared
files are created by the node's lowest rank, mapped by the node's other ranks, then unlinked at once:
the mapping keeps the data alive until the last rank drops it, so no file is ever left behind, even
by a crash.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from freeze.names import STORAGE_DTYPE_NAMES

STORAGE_DTYPES = dict(zip(STORAGE_DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))
# numpy has no bfloat16: the file holds its bits as int16 and torch views them back.
_NUMPY_TWIN = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}


def element_bytes(storage_dtype: str) -> int:
    return torch.empty((), dtype=STORAGE_DTYPES[storage_dtype]).element_size()


class ActivationStore:
    """Activations at cut ``level`` for ``keys`` (sorted, unique int64)."""

    def __init__(
        self,
        level: int,
        keys: torch.Tensor,
        num_keys: int,
        sample_shape: torch.Size,
        storage_dtype: str,
        compute_dtype: torch.dtype,
        memory_format: torch.memory_format,
        data: torch.Tensor,
        placement: str = "private",
    ):
        self.level = level
        self.keys = keys
        self.slot_of = torch.full((num_keys,), -1, dtype=torch.int64)
        self.slot_of[keys] = torch.arange(keys.numel())
        self.sample_shape = sample_shape
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.memory_format = memory_format
        self.data = data
        self.placement = placement
        self._staging = _PinnedStaging()

    @property
    def shared(self) -> bool:
        """Whether the node's ranks share this store (each writes its own rows into it)."""
        return self.placement in ("shm", "disk")

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def slots(self, keys: torch.Tensor) -> torch.Tensor | None:
        """Host rows of ``keys``, or None if any key has no entry. Keys on a GPU cost a
        device-to-host sync here: pass them on the host (a DataLoader's index tensor is)."""
        keys = keys.to(torch.int64).cpu()
        if keys.numel() and (keys.min() < 0 or keys.max() >= self.slot_of.numel()):
            return None
        slots = self.slot_of[keys]
        return None if bool((slots < 0).any()) else slots

    def read(self, keys: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """Activations of ``keys`` in the compute dtype on ``device``, or None if any is missing.

        Host store, GPU model: the rows are gathered into a pinned buffer and copied without
        blocking the host (the step's kernels queue behind the copy on the stream, as a
        DataLoader's pinned batches do). Device store: one gather on the device, by slots copied
        from pinned memory (neither waits for the GPU: tests/gpu/test_cuda_cache.py)."""
        slots = self.slots(keys)
        if slots is None:
            return None
        if self.data.device == device:
            # The slots go to the GPU from pinned memory: a non-blocking copy from pageable memory
            # first waits for the stream to drain (CUDA's rule), a host sync on every step.
            index = slots.pin_memory() if device.type == "cuda" else slots
            out = self.data.index_select(0, index.to(device, non_blocking=True))
        elif device.type == "cuda":
            out = self._staging.gather(self.data, slots).to(device, non_blocking=True)
            self._staging.mark_in_flight()
        else:
            out = self.data.index_select(0, slots).to(device)
        out = out.to(self.compute_dtype)
        if out.dim() == 4:
            out = out.contiguous(memory_format=self.memory_format)
        return out

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.data[slots.to(self.data.device)] = values.to(device=self.data.device, dtype=self.data.dtype)

    def close(self) -> None:
        self.data = torch.empty(0)


class _PinnedStaging:
    """Two pinned host buffers used in turn for host-to-GPU reads: a buffer is refilled only after
    the copy that last read it has finished (an event per buffer), so a non-blocking copy never
    reads rows that the next gather overwrites."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[object | None] = [None, None]
        self._turn = 0

    def gather(self, data: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()  # the copy issued two reads ago: long finished in a training loop
        shape = (slots.numel(), *data.shape[1:])
        buf = self._buffers[self._turn]
        if buf is None or buf.numel() < slots.numel() * data[0].numel() or buf.dtype != data.dtype:
            buf = torch.empty(shape, dtype=data.dtype).pin_memory()
            self._buffers[self._turn] = buf
        out = buf.reshape(-1)[: slots.numel() * data[0].numel()].view(shape)
        torch.index_select(data, 0, slots, out=out)
        return out

    def mark_in_flight(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self._events[self._turn] = event


def allocate_memory(rows: int, sample_shape: torch.Size, storage_dtype: str) -> torch.Tensor:
    return torch.empty((rows, *sample_shape), dtype=STORAGE_DTYPES[storage_dtype])


SHM_DIR = Path("/dev/shm")


def shared_path(directory: str | Path | None, node: str, token: str, level: int) -> Path:
    """A name unique per node, run and level: on a shared file system every node has its own file."""
    root = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    safe_node = "".join(c if c.isalnum() or c in "-_." else "_" for c in node)
    return root / f"freeze-cache-{safe_node}-{token}-k{level}.bin"


def shm_has_room(nbytes: int) -> bool:
    """Whether /dev/shm exists and has ``nbytes`` free with a 10 % margin (a full tmpfs kills the
    writer with SIGBUS, so the check errs on the safe side)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= nbytes * 1.1 + (64 << 20)


def map_file(path: Path, rows: int, sample_shape: torch.Size, storage_dtype: str, create: bool) -> torch.Tensor:
    """A tensor over a shared (MAP_SHARED) mapping of ``path``; ``create`` sizes a new file."""
    dtype = STORAGE_DTYPES[storage_dtype]
    shape = (max(rows, 1), *sample_shape)  # numpy refuses to map zero bytes
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    array = np.memmap(path, dtype=_NUMPY_TWIN[dtype], mode="w+" if create else "r+", shape=shape)
    tensor = torch.from_numpy(array)
    if dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    return tensor[:rows]


def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
