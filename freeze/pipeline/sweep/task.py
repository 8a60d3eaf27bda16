"""One array task of a scheduler's stage: its one run, on this node of the job.

    python -m freeze.pipeline.sweep.task <stage dir> <index>     # what the sbatch script runs (srun)

Node 0 of the job (or the only node) runs the run as a sweep would (:func:`runner.run_one`), except
that a run another process writes is awaited rather than skipped, and torchrun's agent always runs
in this process, so SLURM's SIGTERM (a requeue, a preemption, the time limit) stops the workers with
their completed epochs kept. On a run over several nodes the other nodes follow node 0's decision
(:mod:`freeze.pipeline.sweep.nodes`).

Exit codes: 0 the run is complete (now or before); 130 interrupted (SLURM requeues or you resubmit:
it resumes); 1 the run failed (its manifest says why); 2 refused before anything ran (one line); 3
another process still writes the run after :attr:`runner.TaskMode.busy_wait_s` (a second submission
of it).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from freeze.pipeline.cluster.launch import sigterm_as_interrupt
from freeze.pipeline.failures import INTERRUPTED_EXIT_CODE
from freeze.pipeline.lifetime import die_with_parent
from freeze.pipeline.run import exported, launch_local
from freeze.pipeline.run_lock import RunLock
from freeze.pipeline.runs import IN_SWEEP_ENV, RunDir
from freeze.pipeline.slurm import Allocation, SlurmEnvError, current_allocation
from freeze.pipeline.slurm.store import StoreUnavailable, await_store
from freeze.pipeline.sweep.grid import SweepError
from freeze.pipeline.sweep.nodes import await_decision
from freeze.pipeline.sweep.runner import SweepSummary, TaskMode, run_one
from freeze.pipeline.sweep.stage import Stage

TASK_CORES_ENV = "FREEZE_TASK_CORES"  # set by the local executor: the cores this task may use

BUSY_EXIT_CODE = 3  # the run stayed held by another writer (a second submission of the same run)

# How long a node waits for node 0's decision: as long as the job lives (srun's --kill-on-bad-exit
# ends this node's task when node 0's fails; SLURM ends the job at its limit).
FOLLOW_DEADLINE_S = 7 * 86400.0


def _allocation_for(nodes: int) -> Allocation | None:
    """The job's allocation when the run spans ``nodes`` > 1 nodes (checked to be that many)."""
    if nodes <= 1:
        return None
    allocation = current_allocation()
    if allocation is None:
        raise SlurmEnvError(f"the run spans {nodes} nodes but this task is not inside a SLURM job")
    if len(allocation.nodes) != nodes:
        raise SlurmEnvError(
            f"the run spans {nodes} nodes but job {allocation.job_id} has {len(allocation.nodes)} "
            f"({', '.join(allocation.nodes)}); submit it with --nodes={nodes}"
        )
    return allocation


def _lead(spec, tag: str, allocation: Allocation | None) -> int:
    summary = SweepSummary()
    run_one(spec, tag, summary, lambda line: print(line, flush=True), TaskMode(allocation))
    if summary.busy:  # still written by another process after the wait: its outcome is its own
        return BUSY_EXIT_CODE
    return 1 if summary.failed else 0


def _follow(spec, allocation: Allocation) -> int:
    decision = await_decision(spec.config.run_dir(), allocation, FOLLOW_DEADLINE_S)
    if decision is None:
        print(f"node {allocation.node_rank}: {spec.name} is complete", flush=True)
        return 0
    resume, token = decision
    run = RunDir(spec.config.run_dir())
    lock = RunLock(run.path, None, token)  # node 0 holds it; the workers check it by its token
    return launch_local(run.config_path, spec.config.dist.nproc, resume, lock=lock, allocation=allocation)


def _pin_to_cores() -> None:
    """The cores the local executor gave this task (it cannot pin a child safely itself: a
    preexec_fn runs in a fork of a process whose torch threads may hold locks)."""
    named = os.environ.get(TASK_CORES_ENV, "")
    if named:
        with contextlib.suppress(ValueError, OSError):
            os.sched_setaffinity(0, {int(c) for c in named.split(",")})


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # started by the local executor: end with it (a no-op under SLURM's srun)
    _pin_to_cores()
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or not argv[1].lstrip("-").isdigit():
        print("usage: python -m freeze.pipeline.sweep.task <stage dir> <index>", file=sys.stderr)
        return 2
    with sigterm_as_interrupt():  # SLURM's SIGTERM (requeue, preemption, time limit) stops like Ctrl-C
        return _task(argv)


def _task(argv: list[str]) -> int:
    try:
        stage = Stage(Path(argv[0]))
        index = int(argv[1])
        spec = stage.spec(index)
        allocation = _allocation_for(stage.nodes)
    except (SweepError, SlurmEnvError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tag = f"[task {index}] {spec.name}"
    try:
        if allocation is not None and allocation.node_rank == 0 and allocation.store_host is not None:
            # one line when the batch shell's store is not there, not every agent's traceback after 60 s
            await_store(allocation)
        with exported({IN_SWEEP_ENV: "1"}):
            if allocation is None or allocation.node_rank == 0:
                return _lead(spec, tag, allocation)
            return _follow(spec, allocation)
    except StoreUnavailable as e:
        print(f"error: slurm: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the run said "interrupted (its completed epochs are kept)" itself, if it ran
        return INTERRUPTED_EXIT_CODE
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
