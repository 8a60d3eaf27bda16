"""Runs side by side on one machine (``--executor local --parallel N``), each on its own cores and,
on CUDA, its own GPUs (or, with ``--share-gpus``, all of them sharing the same ones), each in its own
task process (:mod:`freeze.pipeline.sweep.task`, as on SLURM).

Runs start in the stage's order, so a study's interleaving of arms within a seed block is kept. A
run's times compare with another's only when each owned its devices: the manifests record how many
runs shared the machine (``placement.runs_side_by_side``) and the report pairs on it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from freeze.pipeline.cluster.launch import sigterm_as_interrupt
from freeze.pipeline.config import ConfigError
from freeze.pipeline.distributed import device_type
from freeze.pipeline.lifetime import launcher_env
from freeze.pipeline.runs import SIDE_BY_SIDE_ENV, RunDir
from freeze.pipeline.slurm.script import TASK_MODULE
from freeze.pipeline.sweep.executors import SerialExecutor, mark_abandoned, record_outcome, status_of
from freeze.pipeline.sweep.grid import RunSpec
from freeze.pipeline.sweep.runner import SweepSummary, WorkEta
from freeze.pipeline.sweep.stage import Stage
from freeze.pipeline.sweep.task import TASK_CORES_ENV


@dataclass(frozen=True)
class Slot:
    """What one of the runs side by side owns: its cores and, on CUDA, its GPUs (as the machine
    numbers them, through this process's own CUDA_VISIBLE_DEVICES)."""

    cores: tuple[int, ...]
    gpus: tuple[str, ...] = ()

    def env(self, parallel: int) -> dict[str, str]:
        env = {
            SIDE_BY_SIDE_ENV: str(parallel),
            TASK_CORES_ENV: ",".join(map(str, self.cores)),
            "OMP_NUM_THREADS": str(len(self.cores)),
        }
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        return env


def visible_gpus(count: int) -> list[str]:
    """The machine's names of the ``count`` GPUs this process sees: its CUDA_VISIBLE_DEVICES (an
    allocation's, a shared box's), else 0..count-1. A child's CUDA_VISIBLE_DEVICES must use them."""
    listed = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def plan_slots(
    parallel: int, cores: list[int], gpus: list[str], gpus_per_run: int, share_gpus: bool = False
) -> list[Slot]:
    """``parallel`` slots, each with its own cores (an equal share, disjoint) and ``gpus_per_run`` of
    ``gpus``: its own, or with ``share_gpus`` the first ``gpus_per_run`` for every slot. ConfigError
    when the machine cannot give every run what it needs."""
    if len(cores) < parallel:
        raise ConfigError(f"--parallel {parallel}: each run needs its own cores and this process may use {len(cores)}")
    if gpus_per_run and share_gpus and gpus_per_run > len(gpus):
        raise ConfigError(
            f"--parallel {parallel} --share-gpus: the runs share dist.nproc={gpus_per_run} GPUs, and {len(gpus)} are visible"
        )
    if gpus_per_run and not share_gpus and parallel * gpus_per_run > len(gpus):
        raise ConfigError(
            f"--parallel {parallel}: {parallel} runs x dist.nproc={gpus_per_run} GPUs each need "
            f"{parallel * gpus_per_run}, and {len(gpus)} are visible (--share-gpus: the runs share the visible "
            "GPUs, for studies read for accuracy)"
        )
    share = len(cores) // parallel
    first = [0] * parallel if share_gpus else [i * gpus_per_run for i in range(parallel)]
    return [
        Slot(tuple(cores[i * share : (i + 1) * share]), tuple(gpus[first[i] : first[i] + gpus_per_run]))
        for i in range(parallel)
    ]


@dataclass(frozen=True)
class LocalExecutor:
    parallel: int
    share_gpus: bool = False  # every run side by side on the same GPUs (plan_slots)

    def check(self, specs: list[RunSpec]) -> None:
        SerialExecutor().check(specs)
        for spec in specs:
            if spec.config.cluster.nodes:
                raise ConfigError(f"run {spec.name}: cluster.nodes (the emulated cluster) runs with --executor serial")
        self._slots(specs)

    def _slots(self, specs: list[RunSpec]) -> list[Slot]:
        import torch

        on_cuda = any(device_type(s.config.dist.device) == "cuda" for s in specs)
        gpus = visible_gpus(torch.cuda.device_count()) if on_cuda else []
        nproc = max(s.config.dist.nproc for s in specs)
        return plan_slots(
            self.parallel, sorted(os.sched_getaffinity(0)), gpus, nproc if on_cuda else 0, self.share_gpus
        )

    def run(self, stage_name: str, specs: list[RunSpec], eta: WorkEta | None = None, log=print) -> SweepSummary:
        stage = Stage.of(stage_name, specs)
        stage.write(specs, nodes=1)
        eta = eta or WorkEta(len(specs))
        eta.runs_at_once = self.parallel
        summary = SweepSummary()
        complete_before = {i for i, s in enumerate(specs) if status_of(s) == "complete"}
        for i in sorted(complete_before):
            record_outcome(summary, specs[i], True)
            eta.record(None)
        if complete_before:
            log(f"{len(complete_before)} of {len(specs)} runs complete already, skipped")
        waiting = [i for i in range(len(specs)) if i not in complete_before]
        # SIGTERM (a scheduler, `kill`) stops the runs as Ctrl-C does: their completed epochs kept
        with sigterm_as_interrupt():
            self._run_waiting(stage, specs, waiting, summary, eta, log)
        return summary

    def _run_waiting(self, stage: Stage, specs, waiting: list[int], summary, eta: WorkEta, log) -> None:
        free = list(self._slots(specs))
        running: dict[int, tuple[subprocess.Popen, Slot, float, bool]] = {}
        try:
            while waiting or running:
                while waiting and free:
                    index, slot = waiting.pop(0), free.pop(0)
                    fresh = not RunDir(specs[index].config.run_dir()).has_progress()
                    running[index] = (self._start(stage, index, slot), slot, time.perf_counter(), fresh)
                    gpus = f", GPUs {','.join(slot.gpus)}" if slot.gpus else ""
                    span = f"{slot.cores[0]}-{slot.cores[-1]}" if len(slot.cores) > 1 else str(slot.cores[0])
                    log(
                        f"[{index + 1}/{len(specs)}] {specs[index].name}: started on cores {span}{gpus} (log: {stage.log_path(index)})"
                    )
                time.sleep(0.2)
                for index, (proc, slot, start_s, fresh) in list(running.items()):
                    if proc.poll() is None:
                        continue
                    del running[index]
                    free.append(slot)
                    mark_abandoned(specs[index], stage.log_path(index))
                    record_outcome(summary, specs[index], False, stage.log_path(index), resumed=not fresh)
                    wall_s = time.perf_counter() - start_s
                    complete = status_of(specs[index]) == "complete"
                    log(
                        f"[{index + 1}/{len(specs)}] {specs[index].name}: {'complete' if complete else 'ended'} in {wall_s:.1f} s"
                    )
                    eta.record(wall_s if complete and fresh else None)
                    log(eta.line())
        except KeyboardInterrupt:
            for proc, *_ in running.values():
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)  # each task stops its run, completed epochs kept
            for proc, *_ in running.values():
                proc.wait()
            raise

    def _start(self, stage: Stage, index: int, slot: Slot) -> subprocess.Popen:
        # The task pins itself and binds its life to this process (TASK_CORES_ENV, launcher_env): a
        # preexec_fn would run in a child forked from a process whose torch threads may hold locks.
        env = {**os.environ, **slot.env(self.parallel), **launcher_env()}
        with open(stage.log_path(index), "a", encoding="utf-8") as out:
            return subprocess.Popen(
                [sys.executable, "-m", TASK_MODULE, str(stage.path), str(index)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
