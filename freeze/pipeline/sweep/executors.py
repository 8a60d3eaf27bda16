"""Where a stage of runs (a sweep, or one stage of a study) runs: one after another here (serial),
side by side on this machine's cores and GPUs (local), or as a SLURM job array (slurm).

Every executor ends with the same :class:`SweepSummary`, read from the run directories, which the
runs write themselves; the scheduler's own records (squeue's states, exit codes) only say whether a
task is still queued. Running the same command again re-attaches: complete runs are skipped, runs
whose tasks are still queued or running are awaited (their tasks are found by the stage's job name),
and the rest are submitted again, resuming from their checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from freeze._atomic import atomic_write_text
from freeze.pipeline.config import ConfigError
from freeze.pipeline.distributed import device_type
from freeze.pipeline.runs import SIDE_BY_SIDE_ENV, RunDir, RunError
from freeze.pipeline.slurm import SlurmError, SlurmOptions, SlurmOptionsError, parse_slurm_options
from freeze.pipeline.slurm import client as slurm
from freeze.pipeline.slurm.script import sbatch_script
from freeze.pipeline.sweep.grid import RunSpec, SweepError
from freeze.pipeline.sweep.runner import SweepSummary, WorkEta, run_specs
from freeze.pipeline.sweep.stage import Stage

EXECUTORS = ("serial", "local", "slurm")
_PR_SET_PDEATHSIG = 1


class Executor(Protocol):
    def check(self, specs: list[RunSpec]) -> None:
        """Refuse, before anything runs, what this executor cannot run (ConfigError or SweepError, one line)."""

    def run(self, stage: str, specs: list[RunSpec], eta: WorkEta | None = None, log=print) -> SweepSummary:
        """Run ``specs`` (one stage) to their ends; the summary says what happened to each."""


def outcome(summary: SweepSummary, spec: RunSpec, complete_before: bool, log_path: Path | None = None) -> None:
    """Record in ``summary`` how ``spec``'s run ended, from its run directory."""
    run = RunDir(spec.config.run_dir())
    try:
        status = run.status()
        error = run.read_manifest().get("error") if status == "failed" else None
    except RunError as e:
        status, error = "failed", str(e)
    where = f" (log: {log_path})" if log_path is not None else ""
    if status == "complete":
        (summary.skipped if complete_before else summary.ran).append(spec.name)
    elif status == "failed":
        summary.ran.append(spec.name)
        summary.failed.append((spec.name, f"{error or 'failed'}{where}"))
    elif status == "interrupted":
        summary.interrupted.append(spec.name)
    else:
        summary.failed.append((spec.name, f"its task ended with the run {status}{where}"))


@dataclass(frozen=True)
class SerialExecutor:
    """One run after another in this process's care (the sweep's and the study's default)."""

    def check(self, specs: list[RunSpec]) -> None:
        from freeze.pipeline.sweep.grid import check_runnable_here

        check_runnable_here(specs)

    def run(self, stage: str, specs: list[RunSpec], eta: WorkEta | None = None, log=print) -> SweepSummary:
        return run_specs(specs, log=log, eta=eta)


@dataclass(frozen=True)
class Slot:
    """What one of the runs side by side owns: its cores and, on CUDA, its GPUs."""

    cores: tuple[int, ...]
    gpus: tuple[int, ...] = ()

    def env(self, parallel: int) -> dict[str, str]:
        env = {SIDE_BY_SIDE_ENV: str(parallel)}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
        return env


def plan_slots(parallel: int, cores: list[int], gpus: int, gpus_per_run: int) -> list[Slot]:
    """``parallel`` slots, each with its own cores (an equal share, disjoint) and ``gpus_per_run``
    GPUs of the ``gpus`` visible. ConfigError when the machine cannot give every run its own."""
    if len(cores) < parallel:
        raise ConfigError(f"--parallel {parallel}: each run needs its own cores and this process may use {len(cores)}")
    if gpus_per_run and parallel * gpus_per_run > gpus:
        raise ConfigError(
            f"--parallel {parallel}: {parallel} runs x dist.nproc={gpus_per_run} GPUs each need "
            f"{parallel * gpus_per_run}, and {gpus} are visible"
        )
    share = len(cores) // parallel
    return [
        Slot(tuple(cores[i * share : (i + 1) * share]), tuple(range(i * gpus_per_run, (i + 1) * gpus_per_run)))
        for i in range(parallel)
    ]


def _child_setup(cores: tuple[int, ...]):
    def setup() -> None:
        os.sched_setaffinity(0, cores)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return setup


def _task_argv(stage: Stage, index: int) -> list[str]:
    return [sys.executable, "-m", "freeze.pipeline.sweep.task", str(stage.path), str(index)]


@dataclass(frozen=True)
class LocalExecutor:
    """``parallel`` runs side by side on this machine, each on its own cores (and GPUs), each in its
    own task process (:mod:`freeze.pipeline.sweep.task`, as on SLURM). Runs are started in the
    stage's order, so a study's interleaving of arms within a seed block is kept."""

    parallel: int

    def check(self, specs: list[RunSpec]) -> None:
        SerialExecutor().check(specs)
        for spec in specs:
            if spec.config.cluster.nodes:
                raise ConfigError(f"run {spec.name}: cluster.nodes (the emulated cluster) runs with --executor serial")
        self._slots(specs)

    def _slots(self, specs: list[RunSpec]) -> list[Slot]:
        import torch

        on_cuda = any(device_type(s.config.dist.device) == "cuda" for s in specs)
        gpus = torch.cuda.device_count() if on_cuda else 0
        nproc = max(s.config.dist.nproc for s in specs)
        return plan_slots(self.parallel, sorted(os.sched_getaffinity(0)), gpus, nproc if on_cuda else 0)

    def run(self, stage_name: str, specs: list[RunSpec], eta: WorkEta | None = None, log=print) -> SweepSummary:
        stage = Stage.of(stage_name, specs)
        stage.write(specs, nodes=1)
        eta = eta or WorkEta(len(specs))
        eta.runs_at_once = self.parallel
        summary, free = SweepSummary(), list(self._slots(specs))
        complete_before = {i for i, s in enumerate(specs) if _status(s) == "complete"}
        waiting = [i for i in range(len(specs)) if i not in complete_before]
        for i in sorted(complete_before):
            outcome(summary, specs[i], True)
            eta.record(None)
        if complete_before:
            log(f"{len(complete_before)} of {len(specs)} runs complete already, skipped")
        running: dict[int, tuple[subprocess.Popen, Slot, float, Path]] = {}
        try:
            while waiting or running:
                while waiting and free:
                    index, slot = waiting.pop(0), free.pop(0)
                    log_path = stage.logs / f"{specs[index].name}.log"
                    with open(log_path, "a", encoding="utf-8") as out:
                        proc = subprocess.Popen(
                            _task_argv(stage, index),
                            env={**os.environ, **slot.env(self.parallel), "OMP_NUM_THREADS": str(len(slot.cores))},
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            preexec_fn=_child_setup(slot.cores),
                        )
                    running[index] = (proc, slot, time.perf_counter(), log_path)
                    log(
                        f"[{index + 1}/{len(specs)}] {specs[index].name}: started on cores {_span(slot.cores)}"
                        + (f", GPUs {','.join(map(str, slot.gpus))}" if slot.gpus else "")
                        + f" (log: {log_path})"
                    )
                time.sleep(0.2)
                for index, (proc, slot, start_s, log_path) in list(running.items()):
                    if proc.poll() is None:
                        continue
                    del running[index]
                    free.append(slot)
                    fresh = not RunDir(specs[index].config.run_dir()).has_progress() or None
                    outcome(summary, specs[index], False, log_path)
                    ended = (
                        "complete"
                        if specs[index].name in summary.ran and not _failed(summary, specs[index])
                        else "ended"
                    )
                    log(
                        f"[{index + 1}/{len(specs)}] {specs[index].name}: {ended} in {time.perf_counter() - start_s:.1f} s"
                    )
                    eta.record(time.perf_counter() - start_s if ended == "complete" and fresh is None else None)
                    log(eta.line())
        except KeyboardInterrupt:
            for proc, *_ in running.values():
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            for proc, *_ in running.values():
                proc.wait()
            raise
        return summary


def _failed(summary: SweepSummary, spec: RunSpec) -> bool:
    return any(name == spec.name for name, _ in summary.failed)


def _span(cores: tuple[int, ...]) -> str:
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])


def _status(spec: RunSpec) -> str:
    try:
        return RunDir(spec.config.run_dir()).status()
    except RunError:
        return "failed"


@dataclass
class SlurmExecutor:
    """Each stage as a SLURM job array (:mod:`freeze.pipeline.slurm.script`), submitted with sbatch and
    awaited through squeue; ``emit_only``: write the scripts and submit nothing."""

    options: SlurmOptions
    emit_only: bool = False
    submitted: list[str] = field(default_factory=list)  # job ids, in order

    def check(self, specs: list[RunSpec]) -> None:
        for spec in specs:
            if spec.config.cluster.nodes:
                raise ConfigError(
                    f"run {spec.name}: cluster.nodes is the emulated cluster on one machine; on SLURM the "
                    f"nodes are real: --slurm nodes=N"
                )
            if self.options.gpus_per_worker and spec.config.dist.device == "cpu":
                raise ConfigError(
                    f"run {spec.name}: --slurm gpus_per_worker={self.options.gpus_per_worker} with dist.device='cpu'"
                )
        if self.emit_only:
            return
        try:
            slurm.require_commands()
            slurm.check_partition(self.options.partition)
        except SlurmError as e:
            raise SweepError(str(e)) from None
        limit_s = self.options.time_limit_s
        if limit_s is not None:
            check_time_limit(specs, limit_s)

    def _script(self, stage: Stage, specs: list[RunSpec], indices: list[int]) -> Path:
        text = sbatch_script(
            self.options,
            job_name=stage.job_name,
            stage_dir=stage.path.resolve(),
            indices=indices,
            nodes=self.options.nodes,
            nproc=max(s.config.dist.nproc for s in specs),
            python=sys.executable,
            workdir=Path.cwd(),
        )
        path = stage.path / "job.sbatch"
        atomic_write_text(path, text)
        return path

    def run(self, stage_name: str, specs: list[RunSpec], eta: WorkEta | None = None, log=print) -> SweepSummary:
        stage = Stage.of(stage_name, specs)
        stage.write(specs, nodes=self.options.nodes)
        complete_before = {i for i, s in enumerate(specs) if _status(s) == "complete"}
        todo = [i for i in range(len(specs)) if i not in complete_before]
        if self.emit_only:
            path = self._script(stage, specs, todo or list(range(len(specs))))
            log(f"wrote {path} ({len(todo)} of {len(specs)} runs to do); submit it with: sbatch {path}")
            return SweepSummary(skipped=[specs[i].name for i in complete_before], emitted=[specs[i].name for i in todo])
        try:
            queued = slurm.queued_tasks(stage.job_name)
            to_submit = [i for i in todo if i not in queued]
            if queued:
                log(f"{len([i for i in todo if i in queued])} runs' tasks are queued or running already: awaiting them")
            if to_submit:
                self._submit(stage, specs, to_submit, log)
            self._await(stage, specs, log)
        except SlurmError as e:
            raise SweepError(str(e)) from None
        except KeyboardInterrupt:
            log(
                f"the driver stopped; the runs' tasks stay queued or running on SLURM: run the same command "
                f"again to await them (scancel --name={stage.job_name} stops them)"
            )
            raise
        summary = SweepSummary()
        for i, spec in enumerate(specs):
            outcome(summary, spec, i in complete_before, stage.logs / f"{stage.job_name}-{i}.log")
        if eta is not None:
            for _ in specs:
                eta.record(None)
        return summary

    def _submit(self, stage: Stage, specs: list[RunSpec], indices: list[int], log) -> None:
        limit = slurm.max_array_size()
        if max(indices) >= limit:
            raise SlurmError(
                f"the stage has {len(specs)} runs and this cluster's MaxArraySize is {limit}: "
                "split the grid (run.seed values, --seeds blocks) into smaller sweeps"
            )
        path = self._script(stage, specs, indices)
        job_id = slurm.submit(path)
        self.submitted.append(job_id)
        with open(stage.path / "jobs.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"job_id": job_id, "indices": indices, "submitted": time.time()}) + "\n")
        log(f"submitted job {job_id}: {len(indices)} runs as array tasks ({path}; logs in {stage.logs})")

    def _await(self, stage: Stage, specs: list[RunSpec], log) -> None:
        last = None
        while True:
            queued = slurm.queued_tasks(stage.job_name)
            if not queued:
                return
            stuck = sorted({task.reason for task in queued.values() if task.reason in slurm.NEVER_STARTS})
            if stuck:
                slurm.cancel(stage.job_name)
                raise SlurmError(
                    f"SLURM can never start this stage's tasks ({', '.join(stuck)}: the request exceeds what the "
                    f"partition or account allows); cancelled them. Check --slurm nodes, time, partition, "
                    f"constraint against `sinfo` (script: {stage.path / 'job.sbatch'})"
                )
            counts: dict[str, int] = {}
            for task in queued.values():
                counts[task.state] = counts.get(task.state, 0) + 1
            done = sum(1 for s in specs if _status(s) == "complete")
            line = f"{done} of {len(specs)} complete; tasks " + ", ".join(
                f"{n} {s.lower()}" for s, n in sorted(counts.items())
            )
            if line != last:
                log(line)
                last = line
            time.sleep(self.options.poll_s)


def check_time_limit(specs: list[RunSpec], limit_s: int) -> None:
    """SweepError when a run's measured epoch (from a complete run of the same config, apart from seed
    and name, already in its study) is longer than the time limit: every life of its task would end
    before its first checkpoint, requeued for ever."""
    from freeze.pipeline.sweep.timing import longest_epoch_s

    longest = longest_epoch_s(specs)
    if longest is not None and longest[0] > limit_s:
        epoch_s, source = longest
        raise SweepError(
            f"slurm option time: {limit_s} s is shorter than one epoch ({epoch_s:.0f} s measured in {source}); "
            "a run's task would be stopped before its first checkpoint, every time"
        )


def add_executor_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('where the runs go (docs/study.md, "Submit it")')
    group.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="serial",
        help="serial: one after another here (default); local: --parallel runs side by side here, each on its "
        "own cores and GPUs; slurm: each stage as a SLURM job array (--slurm)",
    )
    group.add_argument("--parallel", type=int, default=None, help="local: runs side by side")
    group.add_argument(
        "--slurm",
        action="append",
        default=None,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="slurm: partition, time, nodes, gpus_per_worker, cpus_per_worker, mem, max_parallel, constraint, "
        "nodelist, account, qos, signal_s, setup, poll_s",
    )
    group.add_argument(
        "--emit-sbatch",
        action="store_true",
        help="slurm: write each stage's sbatch script and submit nothing (then: sbatch <script>)",
    )


def executor_from_args(args: argparse.Namespace) -> Executor:
    """The executor the command line asks for; SweepError (one line) for flags that do not fit it."""
    if args.executor != "local" and args.parallel is not None:
        raise SweepError("--parallel is an option of --executor local")
    if args.executor != "slurm" and (args.slurm or args.emit_sbatch):
        raise SweepError(f"{'--slurm' if args.slurm else '--emit-sbatch'} is an option of --executor slurm")
    if args.executor == "local":
        if args.parallel is None or args.parallel < 1:
            raise SweepError("--executor local needs --parallel N (N >= 1 runs side by side)")
        return LocalExecutor(args.parallel)
    if args.executor == "slurm":
        try:
            return SlurmExecutor(parse_slurm_options(args.slurm), emit_only=args.emit_sbatch)
        except SlurmOptionsError as e:
            raise SweepError(str(e)) from None
    return SerialExecutor()
