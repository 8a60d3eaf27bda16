"""A run over several nodes of a SLURM job: node 0's task decides, the other nodes' tasks follow.

Node 0 takes the run's lock and decides whether the run starts or resumes (or is complete already);
then it writes that decision into the run directory (``.nodes.json``: the job, the restart count,
resume or not, the lock's token) and starts its torchrun agent. Every other node's task waits for a
decision of this same job life (job id and restart count) and starts its own agent with it, so all
agents pass the workers the same ``--resume`` and the same lock token (rank 0, whichever node it lands
on, checks that the lock is still held under it). Needs what a cluster's runs need anyway: the run
directory on a file system every node shares.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from freeze._atomic import atomic_write_text
from freeze.pipeline.runs import RunDir
from freeze.pipeline.slurm import Allocation

DECISION_FILE = ".nodes.json"


def announce(run_dir: Path, allocation: Allocation, resume: bool, token: str) -> None:
    """Node 0: the run starts (or resumes) now, in this job life."""
    record = {"job": allocation.rendezvous_id, "resume": resume, "token": token}
    atomic_write_text(Path(run_dir) / DECISION_FILE, json.dumps(record) + "\n")


def _decision(run_dir: Path, allocation: Allocation) -> dict | None:
    try:
        record = json.loads((Path(run_dir) / DECISION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("job") == allocation.rendezvous_id else None


def await_decision(
    run_dir: Path, allocation: Allocation, deadline_s: float, poll_s: float = 1.0
) -> tuple[bool, str] | None:
    """Another node: (resume, lock token) once node 0 announced the run in this job life; None when
    the run is complete (node 0 had nothing to do). TimeoutError after ``deadline_s``."""
    run = RunDir(run_dir)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        record = _decision(run_dir, allocation)
        if record is not None:
            return bool(record.get("resume")), str(record.get("token", ""))
        if run.manifest_path.exists() and run.status() == "complete":
            return None
        time.sleep(poll_s)
    raise TimeoutError(
        f"node {allocation.node_rank}: node 0 of job {allocation.job_id} did not start {run_dir} within "
        f"{deadline_s:.0f} s (its log says why)"
    )
