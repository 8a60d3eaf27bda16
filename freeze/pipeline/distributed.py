"""Process-group setup for one worker, from torchrun's environment (or a single process)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from freeze import comm
from freeze.pipeline.config import Config, ConfigError, DistConfig
from freeze.pipeline.runs import cores_allowed

T = TypeVar("T")


@dataclass(frozen=True)
class WorkerContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: single process, no process group
    threads: int = 1  # torch threads of this worker (CPU), see worker_threads
    cores: int = 1  # cores this process may run on

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def device_type(requested: str) -> str:
    """The device type ``dist.device`` (auto, cpu, cuda) means on this machine: "cuda" or "cpu"."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def check_hardware(config: Config) -> None:
    """ConfigError (one line naming the key) when ``config`` asks for hardware this machine does not
    show. The launcher calls it before it starts anything, and so does every worker."""
    cuda = torch.cuda.is_available()
    if config.dist.device == "cuda" and not cuda:
        raise ConfigError("dist.device: 'cuda' was requested but no CUDA device is visible; accepted here: auto, cpu")
    on_cpu = device_type(config.dist.device) == "cpu"
    if config.dist.backend == "nccl" and on_cpu:
        raise ConfigError(
            "dist.backend: 'nccl' needs CUDA devices and this run uses the CPU; accepted on CPU: auto, gloo"
        )
    if config.train.precision == "fp16" and on_cpu:
        raise ConfigError(
            "train.precision: 'fp16' needs a CUDA device (its GradScaler) and this run uses the CPU; "
            "accepted on CPU: fp32, bf16"
        )


def _pick_device(requested: str, local_rank: int) -> torch.device:
    if device_type(requested) == "cuda":
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


def worker_threads(configured: int, cores: int, local_world_size: int) -> int:
    """Torch threads per worker: ``configured`` (dist.threads_per_worker) when set, else the cores
    shared equally among the workers of this machine, at least 1.

    Workers on one machine share its cores: torch's default, one thread per core in every process,
    would run local_world_size x cores threads on them. torchrun sets OMP_NUM_THREADS=1 against
    that; an equal share also uses the cores that leaves idle. Only this machine's workers are
    known here: agents started by hand for several "nodes" on one host each see every core, so set
    dist.threads_per_worker there (the emulated cluster pins each node to its own cores instead).

    Args:
        configured: dist.threads_per_worker; 0 means "derive it".
        cores: the cores this process may run on (its affinity mask, not the machine's count).
        local_world_size: the workers on this machine (torchrun's LOCAL_WORLD_SIZE).
    """
    if configured:
        return configured
    return max(1, cores // max(1, local_world_size))


def available_cores() -> int:
    """The cores this process may use (:func:`freeze.pipeline.runs.cores_allowed`)."""
    return cores_allowed()


def setup_worker(dist_cfg: DistConfig) -> WorkerContext:
    """Join the process group when torchrun's variables are set. The config has passed
    :func:`check_hardware`."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device = _pick_device(dist_cfg.device, local_rank)
    cores = available_cores()
    threads = worker_threads(dist_cfg.threads_per_worker, cores, local_world_size)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    backend = None
    if world_size > 1:
        backend = dist_cfg.backend if dist_cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        timeout = datetime.timedelta(seconds=dist_cfg.timeout_s)
        store = _per_attempt_store(world_size, timeout)
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            **({"store": store, "rank": rank, "world_size": world_size} if store is not None else {}),
        )
    return WorkerContext(rank, world_size, local_rank, local_world_size, device, backend, threads, cores)


def teardown_worker() -> None:
    comm.end_process_group()


def from_rank0(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (``obj`` itself without a process group); a collective."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on at least one."""
    if not dist.is_initialized():
        return flag
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))  # object collectives work on gloo and nccl alike
    return any(flags)


def all_reduce_sum(totals: torch.Tensor) -> torch.Tensor:
    """``totals`` summed over every rank (``totals`` itself without a process group). The sum runs on
    the backend's device (gloo: CPU, NCCL: CUDA) and comes back on ``totals``' device."""
    if not comm.is_distributed():
        return totals
    reduced = totals.to(comm.collective_device())
    dist.all_reduce(reduced)
    return reduced.to(totals.device)


def run_and_agree(fn: Callable[[], T], *, run_here: bool, error_type: type[Exception]) -> T | None:
    """Run ``fn`` on the ranks where ``run_here`` is true; if it raised ``error_type`` on any rank,
    raise that error (the lowest such rank's message) on EVERY rank, so all ranks stop together
    instead of the others hanging in the next collective until the timeout.

    Returns ``fn()``'s result where it ran, None elsewhere. Every rank must call this (it is a
    collective); it also acts as a barrier, as nobody gets past it before ``fn`` is done everywhere.
    """
    result, error = None, None
    if run_here:
        try:
            result = fn()
        except error_type as e:
            error = str(e)
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise error_type(first)
    return result
