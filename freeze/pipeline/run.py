"""One training run.

    # one process
    python -m experiments.run --config experiments/configs/smoke.toml
    # N local workers (this command starts them through torchrun's launcher)
    python -m experiments.run --config experiments/configs/smoke.toml dist.nproc=2
    # on an emulated cluster of 2 network namespaces with 1 Gbit/s links (freeze.pipeline.cluster)
    python -m experiments.run --config experiments/configs/smoke.toml dist.nproc=1 cluster.nodes=2 cluster.bandwidth=1gbit
    # on SLURM, one task per worker (no torchrun): ranks from SLURM_PROCID, SLURM_LOCALID and the layout
    srun --ntasks-per-node=4 python -m experiments.run --config experiments/configs/reference.toml
    # under torchrun, one node or many (gloo on CPU, nccl on CUDA)
    torchrun --nnodes=4 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \
        --rdzv-id=study -m experiments.run --config experiments/configs/reference.toml
    # (no --max-restarts: torchrun would restart a refused run too; the same command resumes a failed one)

Overrides are ``section.key=value``. The config is resolved (file + overrides, validated) once, by
whoever starts the run: this command, when it starts its own workers, writes the resolved config into
the run directory as config.toml and the workers load that file. Under a plain torchrun there is no
launcher of ours, so every worker resolves the same file and overrides (torchrun passes every worker
the same arguments, and resolving is a pure function of them); rank 0 writes config.toml. Reading it
back on the other ranks would need the run directory on a file system every machine shares, and
the process group's own settings (dist.*) are needed before any rank can hear from another.

One writer per run directory (:mod:`freeze.pipeline.run_lock`): this command holds the run's lock
while its workers run, or, without workers of its own, the worker holds it (rank 0 under a plain
torchrun). Workers die with the process that started them (:mod:`freeze.pipeline.lifetime`).

Exit codes: 0 complete; 2 refused before the run started (bad input, hardware this machine lacks, a
complete run, a run another process writes): one line on stderr, and a run directory this command
created is removed again; 1 the run failed (its manifest says why).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

from freeze.cache import CacheError
from freeze.pipeline.cluster.jobs import run_config_entry, run_on_cluster
from freeze.pipeline.cluster.spec import ClusterSpecError
from freeze.pipeline.config import Config, ConfigError, config_to_toml, default_values, load_config
from freeze.pipeline.data import DataError
from freeze.pipeline.distributed import check_hardware, setup_worker, teardown_worker
from freeze.pipeline.failures import (
    INTERRUPTED_EXIT_CODE,
    collective_timeout_line,
    peer_lost_line,
    record_failure,
    worker_failure,
)
from freeze.pipeline.lifetime import die_with_parent, launcher_env, worker_argv
from freeze.pipeline.models import ModelError
from freeze.pipeline.preflight import preflight
from freeze.pipeline.run_lock import RunLock
from freeze.pipeline.runs import RunDir, RunError, in_sweep
from freeze.pipeline.slurm import Allocation, SlurmEnvError, srun_rank_env
from freeze.pipeline.torchrun_agent import restore_signal_handlers, run_agent, signal_handlers
from freeze.pipeline.train import WorkerOutcome, train_worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.run",
        description="Run one freeze experiment. Configs, overrides and where results land: docs/experiments.md; "
        'the real CIFAR-10 study: docs/study.md, "Submit it".',
    )
    parser.add_argument("--config", required=True, help="TOML config file")
    parser.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    parser.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a worker failure")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    return parser.parse_intermixed_args(argv)  # overrides may come before and after flags


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: the one typed, with --resume."""
    args = [a for a in argv if a != "--resume"]
    return shlex.join(["python", "-m", "experiments.run", *args, "--resume"])


def interrupted_line(config: Config, argv: list[str]) -> str:
    return f"interrupted: {config.run_dir()} keeps its completed epochs; resume with: {resume_command(argv)}"


class _Interrupt:
    """Ctrl-C or SIGTERM in a worker: remembered, then raised as KeyboardInterrupt. A rank whose peer
    stopped first fails in a collective with some other error; the flag tells the two apart, so an
    interrupted run ends quietly instead of with a traceback per rank."""

    seen = False

    @classmethod
    def install(cls) -> None:
        def handler(signum, frame):
            if cls.seen:
                return  # a second Ctrl-C (or the agent's SIGTERM after it): already stopping, quietly
            cls.seen = True
            raise KeyboardInterrupt

        with contextlib.suppress(ValueError):  # not the main thread (a test calling run_worker): keep defaults
            signal.signal(signal.SIGINT, handler)
            signal.signal(signal.SIGTERM, handler)


def _under_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


# How long a worker whose peer vanished waits for torchrun's agent to stop it: the agent polls its
# workers every 0.1 s (--monitor-interval) and then sends SIGTERM to the rest at once.
PEER_LOSS_GRACE_S = 10.0


def _stopped_after_peer_loss(error: BaseException, grace_s: float = PEER_LOSS_GRACE_S) -> bool:
    """True when ``error`` says a peer's connection was lost and this worker's agent then stopped it
    (SIGTERM, within ``grace_s``): the error is a consequence of the peer's end, which the launcher
    names, so this worker stays quiet instead of printing a ~45-line gloo traceback per rank. An
    error of this rank's own (not a lost peer, or no stop follows) is not."""
    if not _under_launcher() or peer_lost_line(error) is None:
        return False
    deadline = time.monotonic() + grace_s
    try:
        while not _Interrupt.seen and time.monotonic() < deadline:
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass  # the agent's SIGTERM, through _Interrupt's handler: what we waited for
    return _Interrupt.seen


def prepare_run_dir(config: Config, resume: bool) -> Path:
    """Refuse a run that must not start (complete, or progress without ``resume``, or a resume with
    another config) and write its resolved config.toml; returns that file's path, the one the
    workers load. The caller holds the run's lock. Raises RunError."""
    run = RunDir(config.run_dir())
    run.prepare(config_to_toml(config), resume, default_values())
    return run.config_path


@contextlib.contextmanager
def exported(env: dict[str, str]) -> Iterator[None]:
    """``env`` in os.environ while the block runs: torchrun's agent, hosted in this process, gives
    its workers a copy of os.environ."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def launch_local(
    resolved_config: Path,
    nproc: int,
    resume: bool = False,
    max_restarts: int = 0,
    lock: RunLock | None = None,
    allocation: Allocation | None = None,
) -> int:
    """Start ``nproc`` workers on this machine with torchrun's launcher (same code path as a
    multi-node torchrun, including --max-restarts) on the resolved config file written by
    :func:`prepare_run_dir`, and return the run's exit code. The launcher agent runs in the calling
    process: a separate torchrun process would cost one more interpreter and torch import per run
    (sweeps call this directly for the same reason). ``lock``: the run's lock, held by the caller;
    the workers get its token, and die with this process (:mod:`freeze.pipeline.lifetime`).
    A worker that fails (a signal this process did not send, such as the out-of-memory killer's
    SIGKILL, included) fails the run: one line, the manifest beside ``resolved_config`` marked
    "failed" with it, exit code 1 (or the worker's own); only a stop sent to this process, or to
    every worker, is an interruption (130).

    ``allocation``: a SLURM job of several nodes (:mod:`freeze.pipeline.slurm.allocation`), whose
    every node calls this: the agents meet at a c10d rendezvous on the job's first node under the
    job's id and restart count, instead of the standalone rendezvous of one machine."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser

    argv = ["--standalone"] if allocation is None else _rendezvous_argv(allocation)
    argv += [
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        *worker_argv("freeze.pipeline.run"),  # bound to this process before it imports torch
        "--config",
        str(resolved_config),
    ]
    argv += ["--resume"] if resume else []
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for its workers when unset
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    env = {**launcher_env(), **(lock.env() if lock is not None else {})}
    if allocation is not None:
        # A fresh store per rendezvous round (as on the emulated cluster, cluster/launch.py): with the
        # agent's shared store, a restarted round counts restarts differently on each node.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # torchrun's agent installs its own SIGINT/SIGTERM/SIGHUP/SIGQUIT handlers and never restores
    # them: after one local run, Ctrl-C in a sweep would raise torch's SignalException everywhere
    # else (between runs, in the cluster launcher, in the report) instead of KeyboardInterrupt.
    saved_handlers = signal_handlers()
    try:
        with exported(env):
            run_agent(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        code, line, killed = worker_failure(e.failures.values())
        if line is not None:
            print(f"error: {line}", file=sys.stderr)
            # The workers could not record it: the killed one is gone, its peers were stopped by the
            # agent (and stay quiet, as when interrupted) or failed in a collective because of it.
            record_failure(resolved_config.parent, line, replace_failed=killed)
        return code
    except SignalException:
        # torchrun's agent turns SIGINT/SIGTERM into this after stopping the workers; the caller
        # (a sweep, a study) sees the same interrupted code as from the emulated cluster.
        return INTERRUPTED_EXIT_CODE
    finally:
        restore_signal_handlers(saved_handlers)
    return 0


def _rendezvous_argv(allocation: Allocation) -> list[str]:
    """torchrun's options for one node of a SLURM job: every node's agent meets the others at the store
    the batch shell hosts (freeze.pipeline.slurm.store), or, under a script of an older freeze that
    starts none, at node 0's agent. ``is_host`` is explicit: by name, on a cluster whose nodes share
    one (this project's test cluster on one machine), each agent would think it hosts the store."""
    return [
        f"--nnodes={len(allocation.nodes)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={allocation.rendezvous_endpoint}",
        f"--rdzv-id={allocation.rendezvous_id}",
        f"--rdzv-conf=is_host={1 if allocation.agent_hosts_store else 0}",
    ]


def launch_cluster(
    config: Config, resolved_config: Path, resume: bool = False, max_restarts: int = 0, lock: RunLock | None = None
) -> int:
    """Run on an emulated cluster of ``config.cluster.nodes`` network namespaces, ``dist.nproc``
    workers each, one torchrun agent per node (freeze.pipeline.cluster), on the resolved config file
    written by :func:`prepare_run_dir`; returns the exit code. ``lock``: the run's lock, held by the
    caller; the workers get its token. They die with this process through the cluster's own PID
    namespaces (freeze.pipeline.cluster.launch), not through :data:`lifetime.PARENT_PID_ENV`: their
    parent is their node's agent, which the launcher's pid would not match."""
    entry = run_config_entry(resolved_config, resume)
    with exported(lock.env() if lock is not None else {}):  # each node's agent copies os.environ
        return run_on_cluster(config.cluster, entry, config.dist.nproc, max_restarts, run_dir=config.run_dir())


def _refuse(error: Exception) -> int:
    # Every rank of a plain torchrun checks the same things: one line from rank 0 is enough.
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {error}", file=sys.stderr)
    return 2


def _mark_failed(config: Config, error: BaseException) -> None:
    record_failure(config.run_dir(), f"{type(error).__name__}: {error}")


def run_worker(config: Config, resume: bool, argv: list[str] | None = None) -> int:
    """This process trains: alone, or as one worker of torchrun (ours or a plain torchrun command).
    ``argv``: the command's arguments, for the resume command an interrupted single process prints."""
    ctx, outcome = None, WorkerOutcome()
    # setup_worker sets this worker's torch threads; a run in the caller's own process (dist.nproc=1,
    # main() from a notebook or a test) gives the caller its count back, or its later arithmetic
    # runs on other threads and sums in another order (found by the suite's golden runs).
    caller_threads = torch.get_num_threads()
    _Interrupt.install()
    try:
        ctx = setup_worker(config.dist)
        train_worker(config, ctx, resume, outcome)
        return 0
    except KeyboardInterrupt:
        return _interrupted(config, ctx, outcome, argv)
    except CacheError as e:  # the cache asked for cannot be held (budget) or cut (model): every rank stops here
        if _Interrupt.seen:
            return _interrupted(config, ctx, outcome, argv)
        if ctx is None or ctx.is_main:
            _mark_failed(config, e)
        print(f"error: {e} (config keys freeze.cache, freeze.cache_budget_bytes)", file=sys.stderr)
        return 2
    except (ConfigError, ClusterSpecError, RunError, DataError, ModelError, OSError) as e:
        if _Interrupt.seen:  # e.g. a write cut short by the signal
            return _interrupted(config, ctx, outcome, argv)
        if not outcome.started:
            return _refuse(e)  # raised before the run was marked as started
        if ctx.is_main:
            print(f"error: {e}", file=sys.stderr)
            _mark_failed(config, e)
        return 1
    except Exception as e:
        # A collective broke because a peer was stopped or died: part of the interrupt, or of the
        # peer's failure, which the launcher reports in one line.
        if _Interrupt.seen or _stopped_after_peer_loss(e):
            traceback.clear_frames(e.__traceback__)
            return _interrupted(config, ctx, outcome, argv)
        # One line from rank 0, not a gloo traceback from every rank: a collective past the timeout,
        # or a peer lost that no stop from our agent followed (it ran on another node).
        line = collective_timeout_line(e, config.dist.timeout_s) or peer_lost_line(e)
        if line is not None:
            if ctx is None or ctx.is_main:
                print(f"error: {line}", file=sys.stderr)
                if outcome.started:
                    record_failure(config.run_dir(), line)
            traceback.clear_frames(e.__traceback__)
            return 1
        if outcome.started and (ctx is None or ctx.is_main):
            _mark_failed(config, e)
        # The traceback keeps train_worker's locals (its Freezer and DDP wrapper, which hold the
        # process group) alive; clear them so that teardown_worker can stop the group's threads.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        try:
            teardown_worker()
        except KeyboardInterrupt:
            # Ctrl-C while the process group shuts down (the run's outcome is settled): the
            # launcher, or the return code, says it; a traceback from gc.collect() says nothing.
            _Interrupt.seen = True
        torch.set_num_threads(caller_threads)


def _interrupted(config: Config, ctx, outcome, argv: list[str] | None) -> int:
    """Ctrl-C or SIGTERM in a worker. Alone, it marks the run and says how to resume (unless a sweep
    started it: the sweep says so); under a launcher, the launcher does, after every worker has
    stopped, so the worker stays quiet."""
    if not _under_launcher() and outcome.started and (ctx is None or ctx.is_main):
        RunDir(config.run_dir()).mark_interrupted()
        if not in_sweep():
            print(interrupted_line(config, argv or []), file=sys.stderr)
    return INTERRUPTED_EXIT_CODE


def _say_interrupted(config: Config, lock: RunLock, argv: list[str] | None) -> None:
    """The launcher's one line after its workers stopped on Ctrl-C or SIGTERM (they say nothing)."""
    run = RunDir(config.run_dir())
    run.mark_interrupted()
    try:
        status = run.status()
    except RunError:
        status = "running"  # an unreadable manifest: the resume command is still the way on
    if status == "complete":
        print(f"interrupted: {run.path} had completed; its results are kept", file=sys.stderr)
    elif status == "absent" and not run.has_progress():
        lock.discard_if_unstarted()
        print(f"interrupted: {run.path} had not started; nothing was kept", file=sys.stderr)
    else:
        print(interrupted_line(config, argv or []), file=sys.stderr)


def run_launcher(config: Config, resume: bool, max_restarts: int, argv: list[str] | None = None) -> int:
    """Hold the run's lock, write its config.toml and start ``dist.nproc`` local workers (on each
    node of an emulated cluster when ``cluster.nodes`` is set)."""
    try:
        lock = RunLock.acquire(config.run_dir())
    except RunError as e:
        return _refuse(e)
    with lock:
        try:  # refuse before starting workers, so bad input costs nothing
            resolved = prepare_run_dir(config, resume)
        except RunError as e:
            lock.discard_if_unstarted()
            return _refuse(e)
        where = f"{config.cluster.nodes} emulated nodes x " if config.cluster.nodes else ""
        print(f"run {config.run_dir()}: starting {where}{config.dist.nproc} workers", flush=True)
        if config.cluster.nodes:
            code = launch_cluster(config, resolved, resume, max_restarts, lock)
        else:
            code = launch_local(resolved, config.dist.nproc, resume, max_restarts, lock)
        if code == INTERRUPTED_EXIT_CODE:
            _say_interrupted(config, lock, argv)
        elif code != 0:
            lock.discard_if_unstarted()  # the workers refused the run before it started
            record_failure(config.run_dir(), f"exit code {code}")  # started, and no worker said why
        return code


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # first: a worker must not outlive its launcher, even while it imports
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        # srun with one task per worker and no torchrun: the ranks from SLURM's own variables
        os.environ.update(srun_rank_env())
    except SlurmEnvError as e:
        return _refuse(e)
    try:
        config = load_config(args.config, args.overrides)
        if not _under_launcher():  # a worker parses its policy where it builds it: once per process
            preflight(config)
        check_hardware(config)
    except ConfigError as e:
        return _refuse(e)
    if not _under_launcher() and (config.dist.nproc > 1 or config.cluster.nodes):
        return run_launcher(config, args.resume, args.max_restarts, argv)
    return run_worker(config, args.resume, argv)


if __name__ == "__main__":
    sys.exit(main())
