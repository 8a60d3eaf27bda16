"""What a user asks of SLURM for a sweep or a study: ``--slurm partition=gpu,time=04:00:00,...``.

A run's workers per node are its config's ``dist.nproc``; how many nodes it spans is ``nodes`` here
(world size = nodes x dist.nproc, recorded in each run's manifest), as a plain torchrun command's
``--nnodes`` is. The rest are the resources and the policy around the runs: where (partition,
constraint, nodelist, account, qos, exclusive), for how long (time), what each worker gets
(gpus_per_worker, cpus_per_worker, mem), how many runs at once (max_parallel), and what a time limit
does (the warning signal ``signal_s`` before it makes the task requeue itself, at most
``max_requeues`` times, each life resuming from the last epoch).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass


class SlurmOptionsError(ValueError):
    """An option that cannot be used; one line naming it and what is accepted."""


@dataclass(frozen=True)
class SlurmOptions:
    partition: str | None = None  # None: the cluster's default partition
    nodes: int = 1  # nodes per run: dist.nproc workers on each (world size = nodes x dist.nproc)
    time: str | None = None  # sbatch --time (MM, HH:MM:SS, D-HH:MM...); None: the partition's default
    gpus_per_worker: int = 0  # 0: CPU runs; 1: one GPU per worker (--gpus-per-node = dist.nproc)
    cpus_per_worker: int = 1  # --cpus-per-task = dist.nproc x this (one task per node)
    mem: str | None = None  # sbatch --mem per node, e.g. 64G; None: the partition's default
    max_parallel: int = 0  # runs (array tasks) at once; 0: as many as the scheduler gives
    constraint: str | None = None  # sbatch --constraint: one kind of node, so timings pair (docs/study.md)
    nodelist: str | None = None  # sbatch --nodelist
    account: str | None = None
    qos: str | None = None
    exclusive: bool = False  # sbatch --exclusive: no other job shares a run's nodes (fair timings)
    signal_s: int = 120  # the warning SLURM sends this long before the time limit: the job requeues itself
    max_requeues: int = 20  # a task requeues itself at most this often (a life that never reaches a checkpoint)
    setup: str | None = None  # shell line run before the task, e.g. "module load cuda/12.4"
    poll_s: float = 10.0  # how often the driver asks the queue

    @property
    def time_limit_s(self) -> int | None:
        return None if self.time is None else parse_time_s(self.time)


KEYS = tuple(f.name for f in dataclasses.fields(SlurmOptions))
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def parse_time_s(text: str) -> int:
    """SLURM's time formats in seconds: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    match = _TIME.fullmatch(text.strip())
    if match is None:
        raise SlurmOptionsError(
            f"slurm option time={text!r}: accepted forms are MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS"
        )
    days, a, b, c = (int(g) if g is not None else None for g in match.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # HH:MM:SS
        seconds = a * 3600 + b * 60 + c
    elif b is not None:  # MM:SS
        seconds = a * 60 + b
    else:  # MM
        seconds = a * 60
    if seconds <= 0:
        raise SlurmOptionsError(f"slurm option time={text!r}: the time limit must be positive")
    return seconds


def _split(items: list[str]) -> list[tuple[str, str]]:
    """``["partition=gpu,time=60", "nodelist=a[1-2],b3"]`` -> pairs; a comma starts a new option only
    where ``key=`` follows, so a node list keeps its commas."""
    pairs: list[tuple[str, str]] = []
    for item in items:
        for part in item.split(","):
            key, eq, value = part.partition("=")
            if eq and re.fullmatch(r"[a-z_]+", key.strip()):
                pairs.append((key.strip(), value.strip()))
            elif pairs:
                pairs[-1] = (pairs[-1][0], f"{pairs[-1][1]},{part}")
            else:
                raise SlurmOptionsError(f"slurm option {part!r}: expected key=value; accepted keys: {', '.join(KEYS)}")
    return pairs


def _typed(key: str, text: str) -> object:
    field = {f.name: f for f in dataclasses.fields(SlurmOptions)}[key]
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    if kind == "int":
        try:
            value = int(text)
        except ValueError:
            raise SlurmOptionsError(f"slurm option {key}={text!r}: expected an integer") from None
        low = 1 if key in ("nodes", "cpus_per_worker", "signal_s") else 0
        if value < low:
            raise SlurmOptionsError(f"slurm option {key}={value}: must be >= {low}")
        return value
    if kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise SlurmOptionsError(f"slurm option {key}={text!r}: expected a number of seconds") from None
        if not math.isfinite(value) or value <= 0:
            raise SlurmOptionsError(f"slurm option {key}={text}: expected a number of seconds > 0")
        return value
    if kind == "bool":
        if text.lower() not in ("true", "false"):
            raise SlurmOptionsError(f"slurm option {key}={text!r}: accepted: true, false")
        return text.lower() == "true"
    if not text:
        raise SlurmOptionsError(f"slurm option {key}: empty value")
    if key == "time":
        parse_time_s(text)
    if key == "mem" and not re.fullmatch(r"\d+[KMGT]?", text):
        raise SlurmOptionsError(f"slurm option mem={text!r}: accepted: a size per node such as 64G, 512M or 0 (all)")
    return text


def parse_slurm_options(items: list[str] | None) -> SlurmOptions:
    """The ``--slurm`` arguments (each ``key=value[,key=value...]``) as options; SlurmOptionsError names
    an unknown key or a bad value."""
    values: dict[str, object] = {}
    for key, text in _split(items or []):
        if key not in KEYS:
            raise SlurmOptionsError(f"slurm option {key!r} is unknown; accepted: {', '.join(KEYS)}")
        values[key] = _typed(key, text)
    options = SlurmOptions(**values)
    limit_s = options.time_limit_s
    if limit_s is not None and limit_s <= options.signal_s + STARTUP_S:
        raise SlurmOptionsError(
            f"slurm option time={options.time}: {limit_s} s leaves no time to train after start-up ({STARTUP_S} s) "
            f"and the requeue warning (signal_s={options.signal_s}); a task would requeue itself at once, every time"
        )
    return options


# What a task's life spends before its first step: the interpreter, torch's import, data, the model,
# the rendezvous (minutes on a busy cluster's file system are not rare).
STARTUP_S = 60
