"""The sbatch script that runs a stage of runs as a SLURM job array: one array task per run.

The script is meant to be read and edited: every line says what it is for. A task runs
``python -m freeze.pipeline.sweep.task <stage dir> <index>`` on each of the run's nodes (``srun``, one
task per node), which resumes the run from its checkpoint when it has one; so submitting the same
script again (or SLURM requeueing a task) continues where the runs stopped and never trains a run
twice. Before the time limit SLURM sends the batch shell a warning signal (``--signal=B:USR1@S``);
the shell requeues its own task, SLURM stops it (SIGTERM: the run keeps its completed epochs) and
starts it again. Preemption by the scheduler (PreemptMode=REQUEUE) goes the same way without the
warning. The log is appended across restarts (``--open-mode=append``). For a run over several
nodes the shell also hosts the agents' rendezvous store from before ``srun`` until it returns
(:mod:`freeze.pipeline.slurm.store`).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from freeze.pipeline.slurm.allocation import STORE_HOST_ENV
from freeze.pipeline.slurm.options import SlurmOptions

TASK_MODULE = "freeze.pipeline.sweep.task"
STORE_MODULE = "freeze.pipeline.slurm.store"  # hosted by the batch shell, when a run spans several nodes


def array_spec(indices: list[int], max_parallel: int) -> str:
    """``[0, 1, 2, 5, 7, 8]``, 4 -> ``"0-2,5,7-8%4"``."""
    if not indices:
        raise ValueError("an array needs at least one index")
    ranges, start, prev = [], indices[0], indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        ranges.append(f"{start}-{prev}" if prev > start else f"{start}")
        if i is not None:
            start = prev = i
    return ",".join(ranges) + (f"%{max_parallel}" if max_parallel else "")


def _store_start(python: str) -> list[str]:
    return [
        "# The rendezvous store of the run's torchrun agents, hosted here, apart from the agents: it outlives",
        "# the last of them to close the rendezvous and stops once srun has returned. srun passes the variable",
        "# (this node's name) to every node's task, whose agent connects to it.",
        f'export {STORE_HOST_ENV}="${{SLURMD_NODENAME:-$(hostname)}}"',
        f"{shlex.quote(python)} -m {STORE_MODULE} &",
        "store=$!",
    ]


_STORE_STOP = [
    "# srun has returned: every agent has exited. Stop the store (SIGKILL if it has not ended within 10 s).",
    'kill -TERM "$store" 2>/dev/null',
    'for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$store" 2>/dev/null || break; sleep 1; done',
    'kill -KILL "$store" 2>/dev/null; wait "$store" 2>/dev/null',
]


def sbatch_script(
    options: SlurmOptions,
    *,
    job_name: str,
    stage_dir: Path,
    indices: list[int],
    nodes: int,
    nproc: int,
    python: str,
    workdir: Path,
) -> str:
    """The script's text for the runs at ``indices`` (array task ids) of the stage written to
    ``stage_dir``; every run of the stage has ``nodes`` nodes of ``nproc`` workers."""
    directives = [
        f"--job-name={job_name}",
        f"--array={array_spec(indices, options.max_parallel)}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",  # one task per node hosts torchrun's agent for the node's workers
        f"--cpus-per-task={nproc * options.cpus_per_worker}",
    ]
    if options.gpus_per_worker:
        directives.append(f"--gpus-per-node={nproc * options.gpus_per_worker}")
    for key, flag in (
        ("partition", "partition"),
        ("time", "time"),
        ("mem", "mem"),
        ("constraint", "constraint"),
        ("nodelist", "nodelist"),
        ("account", "account"),
        ("qos", "qos"),
    ):
        value = getattr(options, key)
        if value is not None:
            directives.append(f"--{flag}={value}")
    if options.exclusive:
        directives.append("--exclusive")
    directives += [
        f"--output={stage_dir / 'logs' / '%a.log'}",  # one log per run, across its restarts
        "--open-mode=append",
        "--requeue",
        f"--signal=B:USR1@{options.signal_s}",
    ]
    # srun does not inherit sbatch's --cpus-per-task on SLURM 22.05-23.02: without it the step (every
    # worker and data loader) may get one CPU. --kill-on-bad-exit ends the other nodes' tasks when one fails.
    task = (
        "srun --kill-on-bad-exit=1 --cpus-per-task=$SLURM_CPUS_PER_TASK "
        f"{shlex.quote(python)} -m {TASK_MODULE} {shlex.quote(str(stage_dir))} $SLURM_ARRAY_TASK_ID"
    )
    lines = [
        "#!/bin/bash",
        "# A stage of freeze runs as a SLURM job array, one array task per run (written by freeze; edit freely).",
        "# Submit it again at any time: complete runs are skipped, interrupted ones resume from their checkpoint.",
        *(f"#SBATCH {d}" for d in directives),
        "",
        f"cd {shlex.quote(str(workdir))}",
        "export PYTHONUNBUFFERED=1",
        *([options.setup] if options.setup else []),
        'echo "== array task $SLURM_ARRAY_TASK_ID, job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) '
        'on $SLURM_JOB_NODELIST at $(date -Is)"',
        "# The warning before the time limit: requeue this task. SLURM then stops it (SIGTERM: the run keeps",
        "# its completed epochs) and starts it again, and the run resumes from its last epoch. At most",
        f"# {options.max_requeues} times: a life too short for one epoch would otherwise requeue for ever.",
        "requeue() {",
        f'  if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {options.max_requeues} ]; then',
        # this task only: an array's first task has the array's own job id, which names every task
        '    echo "== time limit near: requeueing"; scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
        "  else",
        f'    echo "== time limit near: not requeued, {options.max_requeues} restarts already (max_requeues)"',
        "  fi",
        "}",
        "trap requeue USR1",
        *(_store_start(python) if nodes > 1 else []),
        f"{task} &",
        "task=$!",
        'wait "$task"; code=$?',
        'while kill -0 "$task" 2>/dev/null; do wait "$task"; code=$?; done  # the trap cut a wait short',
        *(_STORE_STOP if nodes > 1 else []),
        'echo "== array task $SLURM_ARRAY_TASK_ID: exit code $code at $(date -Is)"',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"
