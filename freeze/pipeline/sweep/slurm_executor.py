"""Each stage as a SLURM job array (``--executor slurm``): submitted with sbatch, awaited through
squeue, judged from the run directories.

Running the same command again re-attaches: complete runs are skipped, runs whose tasks are still
queued or running are awaited (found by the job ids the stage recorded in jobs.jsonl), and the rest
are submitted again, resuming from their checkpoints. One driver at a time per stage
(:meth:`Stage.driver_lock`). The driver holds no GPU; stopping it stops nothing on the cluster.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from freeze.pipeline.config import ConfigError
from freeze.pipeline.runs import RunDir
from freeze.pipeline.slurm import SlurmError, SlurmOptions
from freeze.pipeline.slurm import client as slurm
from freeze.pipeline.slurm.options import STARTUP_S
from freeze.pipeline.slurm.script import sbatch_script
from freeze.pipeline.sweep.executors import mark_abandoned, record_outcome, status_of
from freeze.pipeline.sweep.grid import RunSpec, SweepError
from freeze.pipeline.sweep.runner import SweepSummary, WorkEta
from freeze.pipeline.sweep.stage import Stage

# squeue failing (slurmctld busy or restarting) this many polls in a row ends the driver; fewer are
# waited out, as submitit's watcher does
SQUEUE_FAILURES_TOLERATED = 10
# a "can never start" reason must persist this many polls before the stage is cancelled (a reason
# seen once may be a scheduler's passing state)
NEVER_STARTS_POLLS = 3


@dataclass
class SlurmExecutor:
    """``emit_only``: write the scripts and submit nothing (``--emit-sbatch``)."""

    options: SlurmOptions
    emit_only: bool = False

    def check(self, specs: list[RunSpec]) -> None:
        for spec in specs:
            self._check_run(spec)
        if self.emit_only:
            return
        try:
            slurm.require_commands()
            slurm.check_partition(self.options.partition)
            limit = slurm.max_array_size()
        except SlurmError as e:
            raise SweepError(str(e)) from None
        # a stage's runs share a folder: its size bounds the stage's
        for folder, count in Counter(spec.config.run_dir().parent for spec in specs).items():
            if count > limit:
                raise SweepError(
                    f"{folder}: {count} runs in one stage, and this cluster's MaxArraySize is {limit}: "
                    "split the grid (run.seed values, --seeds blocks) into smaller sweeps"
                )
        if self.options.time_limit_s is not None:
            check_time_limit(specs, self.options.time_limit_s - self.options.signal_s - STARTUP_S)

    def _check_run(self, spec: RunSpec) -> None:
        config = spec.config
        if config.cluster.nodes:
            raise ConfigError(
                f"run {spec.name}: cluster.nodes is the emulated cluster on one machine; on SLURM the "
                "nodes are real: --slurm nodes=N"
            )
        if self.options.gpus_per_worker and config.dist.device == "cpu":
            raise ConfigError(
                f"run {spec.name}: --slurm gpus_per_worker={self.options.gpus_per_worker} with dist.device='cpu'"
            )
        if config.dist.device == "cuda" and not self.options.gpus_per_worker:
            raise ConfigError(
                f"run {spec.name}: dist.device='cuda' asks for GPUs and --slurm gpus_per_worker is 0: "
                "every task would fail on its node; pass --slurm gpus_per_worker=1"
            )
        if any(c.isspace() for c in str(config.run_dir().resolve())):
            raise ConfigError(
                f"run {spec.name}: its folder {config.run_dir()} has white space, which an #SBATCH line "
                "cannot hold; choose an --out-dir without"
            )

    def run(self, stage_name: str, specs: list[RunSpec], eta: WorkEta | None = None, log=print) -> SweepSummary:
        stage = Stage.of(stage_name, specs, self.options.nodes)
        with stage.driver_lock(log):
            stage.write(specs, nodes=self.options.nodes)
            complete_before = {i for i, s in enumerate(specs) if status_of(s) == "complete"}
            todo = [i for i in range(len(specs)) if i not in complete_before]
            had_progress = {i for i in todo if RunDir(specs[i].config.run_dir()).has_progress()}
            if self.emit_only:
                path = self._script(stage, specs, todo or list(range(len(specs))))
                log(f"wrote {path} ({len(todo)} of {len(specs)} runs to do); submit it with: sbatch {path}")
                return SweepSummary(
                    skipped=[specs[i].name for i in complete_before], emitted=[specs[i].name for i in todo]
                )
            try:
                self._submit_missing(stage, specs, todo, log)
                self._await(stage, specs, log)
            except SlurmError as e:
                raise SweepError(str(e)) from None
            except KeyboardInterrupt:
                log(
                    "the driver stopped; the runs' tasks stay queued or running on SLURM: run the same command "
                    f"again to await them (scancel {' '.join(stage.job_ids())} stops them)"
                )
                raise
        summary = SweepSummary()
        for i, spec in enumerate(specs):
            if i not in complete_before:
                mark_abandoned(spec, stage.log_path(i))
            record_outcome(summary, spec, i in complete_before, stage.log_path(i), resumed=i in had_progress)
        if eta is not None:
            for _ in specs:
                eta.record(None)
        return summary

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
        path.write_text(text, encoding="utf-8")
        return path

    def _submit_missing(self, stage: Stage, specs: list[RunSpec], todo: list[int], log) -> None:
        """Submit the runs to do whose tasks are not queued already (re-attaching to those that are)."""
        queued = slurm.queued_tasks(stage.job_ids())
        awaited = [i for i in todo if i in queued]
        if awaited:
            log(f"{len(awaited)} runs' tasks are queued or running already: awaiting them")
        missing = [i for i in todo if i not in queued]
        if not missing:
            return
        path = self._script(stage, specs, missing)
        nproc = max(s.config.dist.nproc for s in specs)
        try:
            job_id = slurm.submit(path)
        except SlurmError as e:  # say where the request's numbers come from
            gpus = (
                f", --gpus-per-node={nproc * self.options.gpus_per_worker} (x gpus_per_worker)"
                if self.options.gpus_per_worker
                else ""
            )
            raise SlurmError(
                f"{e} (it asked --nodes={self.options.nodes} (--slurm nodes), --cpus-per-task="
                f"{nproc * self.options.cpus_per_worker} (dist.nproc={nproc} x cpus_per_worker){gpus})"
            ) from None
        stage.record_job(job_id, missing)
        runs = f"{len(missing)} run{'' if len(missing) == 1 else 's'}"
        log(f"submitted job {job_id}: {runs} as array tasks ({path}; logs in {stage.logs})")

    def _await(self, stage: Stage, specs: list[RunSpec], log) -> None:
        last, failures, never_polls, said_held = None, 0, 0, False
        while True:
            try:
                queued = slurm.queued_tasks(stage.job_ids())
                failures = 0
            except SlurmError as e:
                failures += 1
                if failures >= SQUEUE_FAILURES_TOLERATED:
                    raise
                log(f"squeue did not answer ({e}); trying again")
                time.sleep(self.options.poll_s)
                continue
            if not queued:
                return
            never = sorted({t.reason for t in queued.values() if t.never_starts})
            never_polls = never_polls + 1 if never else 0
            if never_polls >= NEVER_STARTS_POLLS:
                slurm.cancel_pending(stage.job_ids())
                raise SlurmError(
                    f"SLURM can never start this stage's pending tasks ({', '.join(never)}: the request exceeds what "
                    "the partition or account allows); cancelled them. Check --slurm nodes, time, partition, "
                    f"constraint against `sinfo` (script: {stage.path / 'job.sbatch'})"
                )
            held = [t for t in queued.values() if t.held]
            if held and not said_held:
                log(
                    f"{len(held)} tasks are held ({held[0].reason}): `scontrol release {held[0].job_id}` lets one go on"
                )
                said_held = True
            counts: dict[str, int] = {}
            for task in queued.values():
                counts[task.state] = counts.get(task.state, 0) + 1
            done = sum(1 for s in specs if status_of(s) == "complete")
            states = ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items()))
            line = f"{done} of {len(specs)} complete; tasks {states}"
            if line != last:
                log(line)
                last = line
            time.sleep(self.options.poll_s)


def check_time_limit(specs: list[RunSpec], usable_s: float) -> None:
    """SweepError when a run's measured epoch (from a complete run of the same shape already in its
    study: :mod:`.timing`) is longer than the time a task's life can train (``usable_s``: the limit
    less start-up and the requeue warning): every life would end before its first checkpoint."""
    from freeze.pipeline.sweep.timing import longest_epoch_s

    longest = longest_epoch_s(specs)
    if longest is not None and longest[0] > usable_s:
        epoch_s, source = longest
        raise SweepError(
            f"slurm option time: a task's life trains at most {max(usable_s, 0):.0f} s (the limit less {STARTUP_S} s "
            f"start-up and signal_s), shorter than one epoch ({epoch_s:.0f} s measured in {source}); "
            "every life would be stopped before its first checkpoint"
        )
