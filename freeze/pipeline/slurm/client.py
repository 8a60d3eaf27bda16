"""SLURM's commands, each behind one function that turns its failure into one line: is it here,
which partitions exist, how large may an array be, submit a script, what is queued, requeue a job.

Only squeue is read for a job's state, never sacct: many clusters (and this project's test cluster)
run without accounting, where submitit and TorchX misreport states (submitit#1720, TorchX PR #87).
What happened to a run is read from its run directory instead, which the run itself writes.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

COMMANDS = ("sbatch", "squeue", "sinfo", "scontrol", "scancel")
DEFAULT_MAX_ARRAY_SIZE = 1001  # SLURM's default MaxArraySize


class SlurmError(RuntimeError):
    """A SLURM command that is missing or refused; one line."""


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]} is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{shlex.join(argv)} did not answer within 120 s (is slurmctld up?)") from None


def require_commands() -> None:
    """SlurmError unless SLURM's client commands are on PATH."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise SlurmError(
            f"{', '.join(missing)} not on PATH: --executor slurm runs on a SLURM login node (load its module); "
            "without SLURM use --executor local"
        )


def partitions() -> tuple[list[str], str | None]:
    """The partitions this user can submit to, and the default one (sinfo marks it with *)."""
    done = _run(["sinfo", "-h", "-o", "%P"])
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise SlurmError(
            f"sinfo cannot reach the cluster ({said[-1].strip() if said else f'exit code {done.returncode}'}): "
            "is this a login node, the cluster's module loaded, SLURM_CONF set?"
        )
    names, default = [], None
    for line in done.stdout.split():
        name = line.rstrip("*")
        names.append(name)
        if line.endswith("*"):
            default = name
    return names, default


def check_partition(partition: str | None) -> None:
    names, default = partitions()
    if partition is None and default is None:
        raise SlurmError(
            f"this cluster has no default partition; pass --slurm partition=NAME (one of {', '.join(names)})"
        )
    if partition is not None and partition not in names:
        raise SlurmError(f"slurm option partition={partition!r} is not a partition here; accepted: {', '.join(names)}")


def max_array_size() -> int:
    """MaxArraySize from ``scontrol show config`` (array task ids must stay below it)."""
    done = _run(["scontrol", "show", "config"])
    match = re.search(r"^MaxArraySize\s*=\s*(\d+)", done.stdout, re.MULTILINE)
    return int(match.group(1)) if match else DEFAULT_MAX_ARRAY_SIZE


def submit(script: Path) -> str:
    """``sbatch --parsable script``: the job id. SlurmError with sbatch's own words when refused."""
    done = _run(["sbatch", "--parsable", str(script)])
    if done.returncode != 0:
        reason = " ".join(done.stderr.split()) or f"exit code {done.returncode}"
        raise SlurmError(f"sbatch refused {script}: {reason}")
    return done.stdout.strip().split(";")[0]


# Why a pending job waits, when the wait can never end: the request exceeds what the partition or
# the account allows (squeue's %r). Reasons that also mean "nodes are down or drained for now"
# (PartitionNodeLimit, BadConstraints) are left out: a maintenance window must not cancel a stage.
NEVER_STARTS = frozenset({"PartitionConfig", "PartitionTimeLimit", "InvalidAccount", "InvalidQOS"})
# A held task waits until someone releases it (scontrol release): said, not cancelled.
HELD = ("JobHeldAdmin", "JobHeldUser", "launch failed requeued held")


@dataclass(frozen=True)
class QueuedTask:
    job_id: str  # <array job id>_<index>
    state: str  # PENDING, RUNNING, COMPLETING, ...
    reason: str  # why it waits (squeue's %r), "None" when running

    @property
    def never_starts(self) -> bool:
        return self.state == "PENDING" and self.reason in NEVER_STARTS

    @property
    def held(self) -> bool:
        return self.state == "PENDING" and any(h in self.reason for h in HELD)


def queued_tasks(job_ids: list[str]) -> dict[int, QueuedTask]:
    """The queued or running array tasks of the jobs ``job_ids`` (those this stage submitted), by
    array index. Jobs that left the queue are absent: their runs' directories say how they ended.
    By id, not by name: two checkouts' studies of one name must not await each other's tasks."""
    if not job_ids:
        return {}
    done = _run(["squeue", "-h", "-r", "-j", ",".join(job_ids), "-o", "%i|%K|%T|%r"])
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:  # every job left the queue long ago (MinJobAge)
            return {}
        raise SlurmError(f"squeue failed: {done.stderr.strip() or done.stdout.strip()}")
    tasks: dict[int, QueuedTask] = {}
    for line in done.stdout.splitlines():
        job_id, index, state, reason = (line.split("|") + ["", "", ""])[:4]
        if index.isdigit():
            tasks[int(index)] = QueuedTask(job_id, state, reason)
    return tasks


def cancel_pending(job_ids: list[str]) -> None:
    """Cancel the pending tasks of ``job_ids`` (tasks that can never start); running ones go on."""
    done = _run(["scancel", "--state=PENDING", *job_ids])
    if done.returncode != 0:
        raise SlurmError(f"scancel {' '.join(job_ids)} failed: {done.stderr.strip()}")


def requeue(job_id: str) -> None:
    done = _run(["scontrol", "requeue", job_id])
    if done.returncode != 0:
        raise SlurmError(f"scontrol requeue {job_id} failed: {done.stderr.strip()}")
