"""Process-group setup for one worker, from torchrun's environment (or a single process)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from freeze.comm import end_process_group


@dataclass(frozen=True)
class WorkerContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: single process, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "dist.device: 'cuda' was requested but no CUDA device is available; accepted here: auto, cpu"
        )
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _per_attempt_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """torchrun's agent keeps ONE store across worker restarts (--max-restarts), and env://
    rendezvous no longer prefixes keys per attempt: a restarted rank can then read the gloo address
    a killed rank published in the previous attempt and fail with 'connection refused' (seen here).
    A prefix per restart attempt gives every attempt fresh keys."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"freeze/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def setup_worker(dist_cfg) -> WorkerContext:
    """``dist_cfg``: DistConfig. Joins the process group when torchrun's variables are set."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device = _pick_device(dist_cfg.device, local_rank)
    # Workers on one machine share its cores; oversubscription makes every rank slower.
    threads = dist_cfg.threads_per_worker or max(1, (os.cpu_count() or 1) // local_world_size)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    backend = None
    if world_size > 1:
        backend = dist_cfg.backend if dist_cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl" and device.type != "cuda":
            raise RuntimeError("dist.backend: 'nccl' needs CUDA devices; accepted on CPU: gloo, auto")
        timeout = datetime.timedelta(seconds=dist_cfg.timeout_s)
        store = _per_attempt_store(world_size, timeout)
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            **({"store": store, "rank": rank, "world_size": world_size} if store is not None else {}),
        )
    return WorkerContext(rank, world_size, local_rank, local_world_size, device, backend)


def teardown_worker() -> None:
    end_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def agree_on_error(message: str | None) -> str | None:
    """Share rank 0's error (or None) with every rank, so all ranks stop together instead of the
    others hanging in the next collective until the timeout."""
    if not dist.is_initialized():
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]
