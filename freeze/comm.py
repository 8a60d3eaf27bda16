"""DDP construction for a given frozen set, and counting what crosses the wire.

DDP fixes the parameters it reduces when it is constructed: its reducer and gradient buckets are
built from the parameters that require grad at that moment (PyTorch's DDP documentation: parameters
must not be added or removed after wrapping). Freezing more of them afterwards leaves the next
step's gradients unsynchronised and then fails with "Expected to have finished reduction in the
prior iteration", so the Freezer builds a new wrapper whenever the frozen set changes. Everything
about that construction lives here.
"""

# No `from __future__ import annotations`: DDP checks the comm hooks' annotations at runtime.

import gc
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from freeze.names import COMM_HOOKS, POWERSGD_RANKS, CommHook
from freeze.powersgd import PowerSGDState, compress_and_allreduce


def is_distributed() -> bool:
    """True when a default process group exists (torch.distributed is available and initialised)."""
    return dist.is_available() and dist.is_initialized()


def check_launch(owner: str, process_group=None) -> None:
    """Refuse to train without a process group in a process that a launcher started as one of
    several (torchrun, ``accelerate launch``: WORLD_SIZE > 1): without a group every such process
    trains its own model, all-reduces nothing and exits 0 with results shaped like a correct run's
    (seen in a new user's trial: parameter checksums 4680.56 and 4692.91 on 2 ranks). A WORLD_SIZE
    of 1, or none, is one process: fine. An explicit ``process_group`` needs the default group too.

    Args:
        owner: who refuses (the error's first word, e.g. "Freezer").
        process_group: the group the caller was given (None: the default group).

    Raises:
        RuntimeError: no default process group, and WORLD_SIZE > 1 or a ``process_group`` given.
    """
    if is_distributed():
        return
    fix = "call torch.distributed.init_process_group() first"
    if process_group is not None:
        raise RuntimeError(f"{owner}: process_group is given but torch.distributed is not initialised; {fix}")
    world = os.environ.get("WORLD_SIZE", "1").strip()
    if world.isdigit() and int(world) > 1:
        raise RuntimeError(
            f"{owner}: WORLD_SIZE={world} (a launcher such as torchrun started {world} processes) but no process "
            f"group is initialised, so each process would train its own model; {fix}, then build the {owner}"
        )


def end_process_group() -> None:
    """Destroy the default process group so that its threads stop while the interpreter is alive.

    A DDP wrapper still alive holds the group, and then ``destroy_process_group()`` leaves gloo's
    two worker threads and its transport thread running (observed at interpreter finalization in
    the README example); during interpreter shutdown such a thread can abort the process
    ("terminate called without an active exception"). Wrappers that are garbage but in reference
    cycles (a Freezer and its module) are collected first; close a live Freezer before calling
    this."""
    gc.collect()
    if is_distributed():
        dist.destroy_process_group()


def world_size(process_group=None) -> int:
    """Ranks in ``process_group``; 1 without a process group (the same code runs in one process).

    Args:
        process_group: the group (None: the default group).
    """
    return dist.get_world_size(process_group) if is_distributed() else 1


def rank(process_group=None) -> int:
    """This process's rank in ``process_group``; 0 without a process group.

    Args:
        process_group: the group (None: the default group).
    """
    return dist.get_rank(process_group) if is_distributed() else 0


def collective_device(process_group=None) -> torch.device:
    """The device collectives on ``process_group`` take tensors on: NCCL only moves CUDA tensors,
    every other backend here takes CPU tensors.

    Args:
        process_group: the group (None: the default group, which must exist).
    """
    if dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class CommCounter:
    """Bytes handed to the all-reduce by the comm hook, as actually sent (after compression); for
    PowerSGD also its state, which outlives every DDP wrapper the counter serves."""

    process_group: object | None = None
    allreduce_bytes_total: int = 0
    buckets_total: int = 0
    powersgd: PowerSGDState | None = None


def make_counter(comm_hook: CommHook, process_group=None) -> CommCounter:
    """The counter (and, for a PowerSGD hook, its state) that every DDP wrapper of one Freezer shares.

    Raises:
        ValueError: an unknown ``comm_hook``, in one line listing the accepted ones.
    """
    check_comm_hook(comm_hook)
    rank = POWERSGD_RANKS.get(comm_hook)
    return CommCounter(process_group=process_group, powersgd=None if rank is None else PowerSGDState(rank))


def check_comm_hook(comm_hook: object) -> None:
    """Refuse a comm hook name that is not one of ``COMM_HOOKS``."""
    if comm_hook not in _HOOKS:
        raise ValueError(f"comm_hook: '{comm_hook}' is not accepted; accepted: {', '.join(COMM_HOOKS)}")


def _counting_allreduce_hook(state: CommCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    state.allreduce_bytes_total += buf.numel() * buf.element_size()
    state.buckets_total += 1
    return default_hooks.allreduce_hook(state.process_group, bucket)


def _counting_bf16_hook(state: CommCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    state.allreduce_bytes_total += buf.numel() * 2  # the hook sends the bucket cast to bfloat16
    state.buckets_total += 1
    return default_hooks.bf16_compress_hook(state.process_group, bucket)


def _counting_powersgd_hook(state: CommCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD (freeze.powersgd) after its warm-up of plain all-reduce; counts what it sends."""
    psgd = state.powersgd
    if psgd.compressing:
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        future, sent_bytes = compress_and_allreduce(psgd, bucket, group)
        state.allreduce_bytes_total += sent_bytes
        state.buckets_total += 1
    else:
        future = _counting_allreduce_hook(state, bucket)
    if bucket.is_last():  # DDP hands its buckets over in index order: one iteration is done
        psgd.iteration += 1
    return future


_HOOKS = {
    "allreduce": _counting_allreduce_hook,
    "bf16": _counting_bf16_hook,
    **dict.fromkeys(POWERSGD_RANKS, _counting_powersgd_hook),
}


def build_ddp(
    model: nn.Module,
    ignored_names: Iterable[str],
    counter: CommCounter,
    comm_hook: CommHook = "allreduce",
    ddp_kwargs: dict | None = None,
) -> DistributedDataParallel:
    """A DDP wrapper over the parameters that currently require grad.

    ``init_sync=False``: the Freezer guarantees identical replicas, and a re-broadcast of the whole
    model on every boundary change costs ~45 MB for ResNet-18.

    Args:
        model: the module to wrap; its frozen parameters must already have requires_grad=False.
        ignored_names: qualified names of frozen parameters and buffers. Frozen parameters are
            skipped by DDP anyway (requires_grad=False); naming frozen buffers keeps them out of the
            per-forward buffer broadcast, which would otherwise re-send statistics that can no
            longer change.
        counter: receives the bytes each bucket sends (its ``process_group`` is the default for DDP).
        comm_hook: "allreduce" (full precision), "bf16" (buckets sent as bfloat16: half the bytes),
            or "powersgd1" / "powersgd4" (PowerSGD of rank 1 / 4; its state is ``counter.powersgd``,
            made by :func:`make_counter`, and carries over from the previous wrapper).
        ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``, ``device_ids``).

    Raises:
        ValueError: an unknown ``comm_hook``.
    """
    check_comm_hook(comm_hook)
    ignored = sorted(ignored_names)
    if comm_hook in POWERSGD_RANKS:
        if counter.powersgd is None or counter.powersgd.matrix_rank != POWERSGD_RANKS[comm_hook]:
            raise ValueError(f"build_ddp: comm_hook '{comm_hook}' needs the counter of make_counter('{comm_hook}')")
        frozen = set(ignored)
        trainable = ((n, p) for n, p in model.named_parameters() if p.requires_grad and n not in frozen)
        counter.powersgd.attach(trainable)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    kwargs = dict(ddp_kwargs or {})
    kwargs.setdefault("process_group", counter.process_group)
    ddp = DistributedDataParallel(model, init_sync=False, **kwargs)
    ddp.register_comm_hook(counter, _HOOKS[comm_hook])
    return ddp


@torch.no_grad()
def broadcast_from_rank0(tensors: Iterable[torch.Tensor], process_group=None) -> None:
    """Overwrite ``tensors`` on every rank with rank 0's values (in place); nothing without a group.

    Args:
        tensors: the tensors to overwrite, in the same order on every rank.
        process_group: the group whose rank 0 is the source (None: the default group).
    """
    if not is_distributed():
        return
    device = collective_device(process_group)
    src = _rank0(process_group)
    for t in tensors:
        if t.device == device and t.is_contiguous():
            dist.broadcast(t, src=src, group=process_group)
        else:
            tmp = t.detach().to(device).contiguous()
            dist.broadcast(tmp, src=src, group=process_group)
            t.copy_(tmp)


def broadcast_int_from_rank0(value: int, process_group=None) -> int:
    """Rank 0's value of a small integer (the freeze decision), so ranks can never disagree.

    Args:
        value: this rank's value (only rank 0's is used).
        process_group: the group whose rank 0 is the source (None: the default group).
    """
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(process_group))
    dist.broadcast(t, src=_rank0(process_group), group=process_group)
    return int(t.item())


def broadcast_object_from_rank0(obj: object, process_group=None) -> object:
    """Rank 0's ``obj`` (any picklable object) on every rank; ``obj`` itself without a group.

    Args:
        obj: this rank's object (only rank 0's is used).
        process_group: the group whose rank 0 is the source (None: the default group).
    """
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=_rank0(process_group), group=process_group)
    return box[0]


def any_rank(flag: bool, process_group=None) -> bool:
    """Whether ``flag`` is True on some rank of ``process_group`` (one MAX all-reduce: every rank
    gets the same answer, so every rank takes the same branch); ``flag`` itself without a group.

    Args:
        flag: this rank's vote.
        process_group: the group that votes (None: the default group).
    """
    if not is_distributed():
        return flag
    vote = torch.tensor([int(flag)], device=collective_device(process_group))
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=process_group)
    return bool(vote.item())


def sum_over_ranks(tensor: torch.Tensor, process_group=None) -> None:
    """Replace ``tensor`` (on the collective device) with its sum over the ranks, in place. Not a
    gradient: the comm counter does not count it. Collective: needs a process group.

    Args:
        tensor: this rank's summand, overwritten with the sum.
        process_group: the group to sum over (None: the default group).
    """
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=process_group)


def all_gather(tensor: torch.Tensor, process_group=None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (the same shape and dtype on every rank, on the collective device),
    indexed by rank in ``process_group``. Collective: needs a process group.

    Args:
        tensor: this rank's tensor.
        process_group: the group to gather from (None: the default group).
    """
    gathered = [torch.empty_like(tensor) for _ in range(world_size(process_group))]
    dist.all_gather(gathered, tensor, group=process_group)
    return gathered


def all_gather_object(obj: object, process_group=None) -> list:
    """Every rank's ``obj`` (any picklable object), indexed by rank in ``process_group``.
    Collective: needs a process group.

    Args:
        obj: this rank's object.
        process_group: the group to gather from (None: the default group).
    """
    gathered: list = [None] * world_size(process_group)
    dist.all_gather_object(gathered, obj, group=process_group)
    return gathered


def barrier(process_group=None) -> None:
    """Wait until every rank of ``process_group`` arrives here. Collective: needs a process group.

    Args:
        process_group: the group to wait for (None: the default group).
    """
    dist.barrier(group=process_group)


def _rank0(process_group) -> int:
    """The global rank of ``process_group``'s rank 0: the source of every broadcast here
    (``dist.broadcast`` takes a global rank, also for a subgroup)."""
    return dist.get_global_rank(process_group, 0) if process_group is not None else 0
