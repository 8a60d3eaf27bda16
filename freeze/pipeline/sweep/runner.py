"""Runs of a sweep, one after another on this machine: each under its lock, complete ones skipped,
interrupted or failed ones resumed, and what happened to each in a summary."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from freeze.pipeline.config import Config
from freeze.pipeline.failures import killed_line, record_failure
from freeze.pipeline.lifetime import launcher_env, worker_argv
from freeze.pipeline.log import PROGRESS_PREFIX_ENV
from freeze.pipeline.run import INTERRUPTED_EXIT_CODE, exported, launch_cluster, launch_local, prepare_run_dir
from freeze.pipeline.run_lock import RunBusyError, RunLock
from freeze.pipeline.runs import IN_SWEEP_ENV, RunDir, RunError
from freeze.pipeline.slurm import Allocation
from freeze.pipeline.sweep.grid import RunSpec
from freeze.pipeline.sweep.nodes import announce


@dataclass
class SweepSummary:
    ran: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    busy: list[tuple[str, str]] = field(default_factory=list)  # another process writes them
    failed: list[tuple[str, str]] = field(default_factory=list)
    interrupted: list[str] = field(default_factory=list)  # Ctrl-C or SIGTERM: resumed by the next invocation
    emitted: list[str] = field(default_factory=list)  # written into an sbatch script, not run (--emit-sbatch)

    @property
    def ok(self) -> bool:
        """Every run is complete: none failed, none left to another writer."""
        return not self.failed and not self.busy and not self.interrupted and not self.emitted

    def lines(self) -> list[str]:
        out = [
            f"sweep: {len(self.ran)} ran ({len(self.resumed)} of them resumed), "
            f"{len(self.skipped)} skipped (complete), {len(self.busy)} busy (another writer), "
            f"{len(self.failed)} failed"
        ]
        if self.emitted:
            out.append(f"  {len(self.emitted)} runs written into an sbatch script, not run (--emit-sbatch)")
        out += [f"  busy: {name}: {error}" for name, error in self.busy]
        if self.interrupted:
            out.append(
                f"  interrupted: {', '.join(self.interrupted)} (completed epochs kept; the same command resumes them)"
            )
        out += [f"  failed: {name}: {error}" for name, error in self.failed]
        return out


@dataclass(frozen=True)
class TaskMode:
    """How a scheduler's task (:mod:`freeze.pipeline.sweep.task`) runs its one run, unlike a sweep on
    this machine: a run another process writes is awaited (it may be this task's own earlier life,
    still stopping, or a second submission), every run goes through torchrun's agent hosted here (it
    stops its workers on SLURM's SIGTERM and says "interrupted"), and a run over several nodes
    announces itself to the other nodes' tasks (:mod:`freeze.pipeline.sweep.nodes`)."""

    allocation: Allocation | None = None  # the SLURM job, when the run spans its nodes
    busy_poll_s: float = 5.0
    # A task's previous life lets go within SLURM's KillWait (30 s by default); a run still held after
    # this is another submission's, and this task gives its GPUs back instead of idling for hours.
    busy_wait_s: float = 900.0


def _launch(config: Config, resume: bool, lock: RunLock, task: TaskMode | None = None) -> int:
    """Run one resolved config to its end under ``lock`` (held here); returns the exit code."""
    resolved = prepare_run_dir(config, resume)
    if task is not None:
        if task.allocation is not None:
            announce(config.run_dir(), task.allocation, resume, lock.token)
        return launch_local(resolved, config.dist.nproc, resume, lock=lock, allocation=task.allocation)
    if config.cluster.nodes:  # one torchrun agent per emulated node (freeze.pipeline.cluster)
        return launch_cluster(config, resolved, resume, lock=lock)
    if config.dist.nproc > 1:
        # Workers are separate processes either way; hosting torchrun's agent here saves a
        # launcher process (interpreter + torch import, ~3 s) per run.
        return launch_local(resolved, config.dist.nproc, resume, lock=lock)
    # A single-process run trains in its own process, so a crash cannot take the sweep down; it
    # dies with the sweep and works under the sweep's lock (launcher_env, lock.env).
    cmd = [sys.executable, *worker_argv("freeze.pipeline.run"), "--config", str(resolved)]
    env = {**os.environ, **launcher_env(), **lock.env()}
    code = subprocess.run(cmd + (["--resume"] if resume else []), env=env).returncode
    if code < 0 and -code not in (signal.SIGINT, signal.SIGTERM):  # killed (the OOM killer): it recorded nothing
        line = killed_line("the run's process", -code)
        print(f"error: {line}", file=sys.stderr)
        record_failure(config.run_dir(), line, replace_failed=True)
        return 1
    return code


# INTERRUPTED_EXIT_CODE (run.py): what a launcher returns when it was interrupted (Ctrl-C or
# SIGTERM) and stopped its workers. The emulated cluster's launcher catches the interrupt to remove
# its namespaces and returns it too, so the sweep must stop on it rather than start the next run.
INTERRUPTED_MESSAGE = "interrupted: completed runs are kept; run the same command again to resume the rest"


def _acquire_awaiting(run: RunDir, tag: str, log, task: TaskMode) -> RunLock | None:
    """The run's lock once its other writer let go; None when that writer completed it. RunBusyError
    when it still holds it after ``task.busy_wait_s``."""
    end, said = time.monotonic() + task.busy_wait_s, False
    while True:
        try:
            return RunLock.acquire(run.path)
        except RunBusyError as e:
            if time.monotonic() > end:
                raise
            if not said:
                log(f"{tag}: waiting ({e})")
                said = True
        time.sleep(task.busy_poll_s)
        if run.status() == "complete":
            return None


def run_one(spec: RunSpec, tag: str, summary: SweepSummary, log, task: TaskMode | None = None) -> None:
    """Run ``spec`` unless it is complete or another process writes it (in a scheduler's ``task``:
    until that process lets go); record the outcome. Raises KeyboardInterrupt when the run was
    interrupted: the sweep stops there."""
    run = RunDir(spec.config.run_dir())
    try:
        if run.status() == "complete":  # checked before the lock: a complete run is not touched
            summary.skipped.append(spec.name)
            log(f"{tag}: complete, skipped")
            return
        if task is None:
            lock = RunLock.acquire(run.path)
        else:
            lock = _acquire_awaiting(run, tag, log, task)
            if lock is None:
                summary.skipped.append(spec.name)
                log(f"{tag}: completed by its other writer")
                return
    except RunBusyError as e:
        summary.busy.append((spec.name, str(e)))
        log(f"{tag}: BUSY ({e})")
        return
    except RunError as e:
        summary.failed.append((spec.name, str(e)))
        log(f"{tag}: FAILED ({e})")
        return
    with lock:
        try:
            status = run.status()  # again, now that no one else writes it
        except RunError as e:
            summary.failed.append((spec.name, str(e)))
            return
        if status == "complete":  # another sweep finished it meanwhile
            summary.skipped.append(spec.name)
            log(f"{tag}: complete, skipped")
            return
        resume = run.has_progress()
        log(f"{tag}: {'resuming' if resume else 'starting'}")
        start_s = time.perf_counter()
        try:
            code = _launch(spec.config, resume, lock, task)
        except RunError as e:  # e.g. resuming a run directory written with another config
            lock.discard_if_unstarted()
            summary.failed.append((spec.name, str(e)))
            log(f"{tag}: FAILED ({e})")
            return
        if code != 0:
            lock.discard_if_unstarted()  # refused before it started: nothing left behind
        if code not in (0, INTERRUPTED_EXIT_CODE):
            record_failure(run.path, f"exit code {code}")  # started, and no worker said why
    summary.ran.append(spec.name)
    if resume:
        summary.resumed.append(spec.name)
    if code == INTERRUPTED_EXIT_CODE:
        run.mark_interrupted()
        summary.interrupted.append(spec.name)
        log(f"{tag}: interrupted (its completed epochs are kept)")
        raise KeyboardInterrupt
    if code != 0:
        error = f"exit code {code}"
        with contextlib.suppress(RunError):  # no manifest, or an unreadable one: the exit code is all we know
            error = run.read_manifest().get("error") or error
        summary.failed.append((spec.name, error))
        log(f"{tag}: FAILED ({error})")
    else:
        log(f"{tag}: complete in {time.perf_counter() - start_s:.1f} s")


@dataclass
class WorkEta:
    """Time left for a whole sweep or study, from the wall times of the runs trained start to end in
    this invocation (a run skipped as complete, resumed or failed says nothing about a fresh run's
    length). A study shares one across its stages, so the estimate covers every run still to come."""

    runs_total: int
    runs_done: int = 0
    fresh_run_wall_s: list[float] = field(default_factory=list)
    runs_at_once: int = 1  # runs side by side (the local executor's --parallel)

    def record(self, fresh_run_wall_s: float | None) -> None:
        """One more run is done; ``fresh_run_wall_s``: its wall time when it trained from its start."""
        self.runs_done += 1
        if fresh_run_wall_s is not None:
            self.fresh_run_wall_s.append(fresh_run_wall_s)

    def position(self) -> str:
        """The next run's place in the work and the time left for all of it, for its progress bar:
        "run 4/203, about 2 h 10 min left" (the time once a run trained here)."""
        place = f"run {min(self.runs_done + 1, self.runs_total)}/{self.runs_total}"
        if not self.fresh_run_wall_s:
            return place
        mean_s = sum(self.fresh_run_wall_s) / len(self.fresh_run_wall_s)
        return f"{place}, about {_duration((self.runs_total - self.runs_done) * mean_s / self.runs_at_once)} left"

    def line(self) -> str:
        left = self.runs_total - self.runs_done
        if left <= 0:
            return f"eta: all {self.runs_total} runs done"
        if not self.fresh_run_wall_s:
            return f"eta: {self.runs_done} of {self.runs_total} runs done; time left known after the first run trained here"
        mean_s = sum(self.fresh_run_wall_s) / len(self.fresh_run_wall_s)
        return (
            f"eta: {self.runs_done} of {self.runs_total} runs done; about {_duration(left * mean_s / self.runs_at_once)} "
            f"left ({left} run{'' if left == 1 else 's'} x {mean_s:.0f} s, the mean of the "
            f"{len(self.fresh_run_wall_s)} trained here"
            + (f", {self.runs_at_once} at once)" if self.runs_at_once > 1 else ")")
        )


def _duration(seconds: float) -> str:
    """45 s, 12 min, 3 h 05 min."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def run_specs(specs: list[RunSpec], log=print, eta: WorkEta | None = None) -> SweepSummary:
    """Run every spec in turn (:func:`run_one`); the summary says what happened to each. After each
    run, a line of ``eta`` (default: one for these runs alone) says how much of the work is left."""
    summary = SweepSummary()
    eta = eta or WorkEta(len(specs))
    with exported({IN_SWEEP_ENV: "1"}):  # the runs' workers inherit it (see runs.IN_SWEEP_ENV)
        for i, spec in enumerate(specs, 1):
            start_s, fresh_before = time.perf_counter(), _fresh_complete(summary)
            with exported({PROGRESS_PREFIX_ENV: eta.position()}):  # the run's bar leads with it
                run_one(spec, f"[{i}/{len(specs)}] {spec.name}", summary, log)
            eta.record(time.perf_counter() - start_s if _fresh_complete(summary) > fresh_before else None)
            log(eta.line())
    return summary


def _fresh_complete(summary: SweepSummary) -> int:
    """How many runs trained from their start to complete so far (for :class:`WorkEta`)."""
    failed = {name for name, _ in summary.failed}
    return sum(1 for name in summary.ran if name not in failed and name not in summary.resumed)
