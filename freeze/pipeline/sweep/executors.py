"""Where a stage of runs (a sweep, or one stage of a study) runs: one after another here (serial),
side by side on this machine's cores and GPUs (local: :mod:`.local_executor`), or as a SLURM job
array (slurm: :mod:`.slurm_executor`); the command-line flags that choose one: :mod:`.executor_args`.

Every executor ends with the same :class:`SweepSummary`, read from the run directories, which the
runs write themselves; the scheduler's own records only say whether a task is still queued.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Protocol

from freeze.pipeline.failures import record_failure
from freeze.pipeline.run_lock import RunLock
from freeze.pipeline.runs import RunDir, RunError
from freeze.pipeline.sweep.grid import RunSpec, check_runnable_here
from freeze.pipeline.sweep.runner import SweepSummary, WorkEta, run_specs


class Executor(Protocol):
    def check(self, specs: list[RunSpec]) -> None:
        """Refuse, before anything runs, what this executor cannot run (ConfigError or SweepError, one line)."""

    def run(self, stage: str, specs: list[RunSpec], eta: WorkEta | None = None, log=print) -> SweepSummary:
        """Run ``specs`` (one stage) to their ends; the summary says what happened to each."""


def status_of(spec: RunSpec) -> str:
    """The run's status; an unreadable manifest reads as failed."""
    try:
        return RunDir(spec.config.run_dir()).status()
    except RunError:
        return "failed"


def _log_text(log_path: Path | None) -> str:
    """A task's log ("" when there is none yet), read once per outcome."""
    if log_path is None:
        return ""
    with contextlib.suppress(OSError):
        return log_path.read_text(encoding="utf-8", errors="replace")
    return ""


def last_error_line(log_text: str) -> str | None:
    """The last ``error: ...`` line of a task's log (a run refused before it started writes its one
    line there and nothing in its run directory), without the prefix."""
    found = None
    for line in log_text.splitlines():
        if line.startswith("error: "):
            found = line.removeprefix("error: ").strip()
    return found


def record_outcome(
    summary: SweepSummary,
    spec: RunSpec,
    complete_before: bool,
    log_path: Path | None = None,
    resumed: bool = False,
) -> None:
    """Record in ``summary`` how ``spec``'s run ended, from its run directory (``log_path``: its task's
    log, named beside an error; ``resumed``: it had progress when its task started)."""
    run = RunDir(spec.config.run_dir())
    try:
        status = run.status()
        error = run.read_manifest().get("error") if status == "failed" else None
    except RunError as e:
        status, error = "failed", str(e)
    where = f" (log: {log_path})" if log_path is not None else ""
    log_text = _log_text(log_path)
    resumed = resumed or f"] {spec.name}: resuming" in log_text  # a requeued task's later life resumed it
    refused = last_error_line(log_text)
    if status in ("complete", "failed") and not complete_before and resumed:
        summary.resumed.append(spec.name)
    if status == "complete":
        (summary.skipped if complete_before else summary.ran).append(spec.name)
    elif status == "absent" and refused:  # refused before it started: its one line
        summary.failed.append((spec.name, f"{refused}{where}"))
    elif status == "failed":
        summary.ran.append(spec.name)
        summary.failed.append((spec.name, f"{error or 'failed'}{where}"))
    elif status == "interrupted":
        summary.interrupted.append(spec.name)
    else:
        summary.failed.append((spec.name, f"its task ended with the run {status}{where}"))


def mark_abandoned(spec: RunSpec, log_path: Path) -> None:
    """A run whose task is gone while its manifest still says running (the task or its node was
    killed: nothing in it could say so) is marked failed, in one line, once no process holds its
    lock; its checkpoint stays, so the next submission resumes it."""
    run = RunDir(spec.config.run_dir())
    if status_of(spec) != "running":
        return
    try:
        lock = RunLock.acquire(run.path)
    except RunError:  # another writer has it: its outcome is its own
        return
    with lock:
        record_failure(
            run.path, f"its task ended without finishing the run (killed, or its node lost); log: {log_path}"
        )


class SerialExecutor:
    """One run after another in this process's care (the sweep's and the study's default)."""

    def check(self, specs: list[RunSpec]) -> None:
        check_runnable_here(specs)

    def run(self, stage: str, specs: list[RunSpec], eta: WorkEta | None = None, log=print) -> SweepSummary:
        return run_specs(specs, log=log, eta=eta)
