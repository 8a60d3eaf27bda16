"""The SLURM allocation a process runs in, read from the variables slurmd sets for a job.

Two ways a run meets SLURM, both without a flag the user repeats:

- One task per node (what our sbatch script does): each node's task hosts torchrun's agent for
  ``dist.nproc`` workers; the agents meet at a c10d rendezvous on the node the batch shell runs on,
  whose store the shell hosts (:mod:`.store`; a script of an older freeze did not: node 0's agent
  then hosts it on the allocation's first node), under the id ``<job id>-<restart count>`` so that a
  requeued job never joins its previous life's round. :class:`Allocation` gives the nodes, this
  node's rank and the rendezvous.
- One task per worker (``srun --ntasks-per-node=G python -m experiments.run ...``, as torchvision's
  references and Lightning's SLURMEnvironment support): no torchrun, so RANK and friends are unset;
  :func:`srun_rank_env` derives them from SLURM_PROCID, SLURM_LOCALID and the task layout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

# The rendezvous (and, one task per worker, the process group's store) listens on the first node at
# a port derived from the job id, so that two jobs sharing a node do not collide (submitit derives
# its MASTER_PORT the same way). Above the usual service ports, below the ephemeral range.
RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 12000
# Set by the batch script to the node it runs on, where it hosts the rendezvous store (script.py);
# srun passes it on to every node's task.
STORE_HOST_ENV = "FREEZE_RDZV_STORE_HOST"


class SlurmEnvError(ValueError):
    """A SLURM variable this process cannot read; the message is one line naming it."""


def _int_var(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None:
        if default is None:
            raise SlurmEnvError(f"{name} is not set; this process is not inside a SLURM job step")
        return default
    try:
        return int(text)
    except ValueError:
        raise SlurmEnvError(f"{name}={text!r} is not an integer") from None


def _split_top_level(nodelist: str) -> list[str]:
    """``"a[1-2,5],b"`` -> ``["a[1-2,5]", "b"]``: commas outside brackets separate hosts."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    parts.append(nodelist[start:])
    return [p for p in parts if p]


def _expand_one(host: str) -> list[str] | None:
    """``gpu[01-03,07]`` -> gpu01, gpu02, gpu03, gpu07 (zero padding kept); None for what this
    reader does not know (several bracket groups), which SLURM's own expansion then handles."""
    match = re.fullmatch(r"([^\[\]]*)\[([\d,\-]+)\]([^\[\]]*)", host)
    if match is None:
        return None if "[" in host else [host]
    prefix, ranges, suffix = match.groups()
    hosts = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return None
        width = len(low)
        hosts += [f"{prefix}{n:0{width}d}{suffix}" for n in range(int(low), int(high or low) + 1)]
    return hosts


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """``gpu[01-02],cpu7`` -> ``("gpu01", "gpu02", "cpu7")``, in SLURM's order. One bracket group per
    host is read here; anything else goes to ``scontrol show hostnames``."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        expanded = _expand_one(part)
        if expanded is None:
            return _scontrol_hostnames(nodelist)
        hosts += expanded
    return tuple(hosts)


def _scontrol_hostnames(nodelist: str) -> tuple[str, ...]:
    if shutil.which("scontrol"):
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.split():
            return tuple(done.stdout.split())
    raise SlurmEnvError(f"cannot expand the node list {nodelist!r}: scontrol is not on PATH or refused it")


def rendezvous_port(job_id: str) -> int:
    digits = re.sub(r"\D", "", job_id) or "0"
    return RDZV_PORT_BASE + int(digits) % RDZV_PORT_SPAN


@dataclass(frozen=True)
class Allocation:
    """The job this process belongs to: its nodes in SLURM's order and this node's place in them."""

    job_id: str  # SLURM_JOB_ID: unique per array task, kept across a requeue
    restart_count: int  # SLURM_RESTART_COUNT: 0 at the first start, +1 per requeue
    nodes: tuple[str, ...]
    node_rank: int  # SLURM_NODEID
    store_host: str | None = None  # FREEZE_RDZV_STORE_HOST: the node whose batch shell hosts the store

    @property
    def head(self) -> str:
        return self.nodes[0]

    @property
    def rendezvous_id(self) -> str:
        return f"{self.job_id}-{self.restart_count}"

    @property
    def rendezvous_host(self) -> str:
        return self.store_host or self.head

    @property
    def rendezvous_port(self) -> int:
        return rendezvous_port(self.job_id)

    @property
    def rendezvous_endpoint(self) -> str:
        return f"{self.rendezvous_host}:{self.rendezvous_port}"

    @property
    def agent_hosts_store(self) -> bool:
        """True for node 0's agent when no batch shell hosts the store (a script of an older freeze)."""
        return self.store_host is None and self.node_rank == 0


def current_allocation(environ: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation from the environment; None outside a SLURM job. SlurmEnvError: a variable
    that is set but cannot be read."""
    environ = os.environ if environ is None else environ
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmEnvError("SLURM_JOB_ID is set but SLURM_JOB_NODELIST is not; cannot tell the job's nodes")
    nodes = expand_nodelist(nodelist)
    node_rank = _int_var(environ, "SLURM_NODEID", 0)
    if not 0 <= node_rank < len(nodes):
        raise SlurmEnvError(f"SLURM_NODEID={node_rank} is not the index of one of the job's {len(nodes)} nodes")
    store_host = environ.get(STORE_HOST_ENV) or None
    return Allocation(job_id, _int_var(environ, "SLURM_RESTART_COUNT", 0), nodes, node_rank, store_host)


def _tasks_on_node(layout: str, node_rank: int) -> int:
    """SLURM's compressed task layout (``"4(x2),2"``: 4 tasks on each of 2 nodes, then 2) at ``node_rank``."""
    counts: list[int] = []
    for part in layout.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise SlurmEnvError(f"cannot read the task layout {layout!r} (SLURM_STEP_TASKS_PER_NODE)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node_rank < len(counts):
        raise SlurmEnvError(f"the task layout {layout!r} has no node {node_rank}")
    return counts[node_rank]


def srun_rank_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for a process that
    srun started as one of several tasks of a step, when no launcher set RANK; {} otherwise (a single
    task, a batch script's shell, torchrun's workers). SlurmEnvError: a layout that cannot be read."""
    environ = os.environ if environ is None else environ
    if "RANK" in environ or "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
        return {}
    world_size = _int_var(environ, "SLURM_STEP_NUM_TASKS", _int_var(environ, "SLURM_NTASKS", 1))
    if world_size <= 1:
        return {}
    node_rank = _int_var(environ, "SLURM_NODEID", 0)
    layout = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or str(world_size)
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "localhost"
    job_id = environ.get("SLURM_JOB_ID", "0")
    return {
        "RANK": str(_int_var(environ, "SLURM_PROCID")),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(_int_var(environ, "SLURM_LOCALID", 0)),
        "LOCAL_WORLD_SIZE": str(_tasks_on_node(layout, node_rank)),
        "MASTER_ADDR": expand_nodelist(nodelist)[0],
        "MASTER_PORT": str(rendezvous_port(job_id)),
    }
