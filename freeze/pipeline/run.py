"""One training run.

    # one process
    python -m experiments.run --config experiments/configs/smoke.toml
    # N local workers (this command starts them through torchrun's launcher)
    python -m experiments.run --config experiments/configs/smoke.toml dist.nproc=2
    # on an emulated cluster of 2 network namespaces with 1 Gbit/s links (freeze.pipeline.cluster)
    python -m experiments.run --config experiments/configs/smoke.toml dist.nproc=1 cluster.nodes=2 cluster.bandwidth=1gbit
    # under torchrun, one node or many (gloo on CPU, nccl on CUDA)
    torchrun --nnodes=4 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \
        --rdzv-id=study --max-restarts=1 -m experiments.run --config experiments/configs/reference.toml

Overrides are ``section.key=value``. The config is resolved (file + overrides, validated) once, by
whoever starts the run: this command, when it starts its own workers, writes the resolved config into
the run directory as config.toml and the workers load that file. Under a plain torchrun there is no
launcher of ours, so every worker resolves the same file and overrides (torchrun passes every worker
the same arguments, and resolving is a pure function of them); rank 0 writes config.toml. Reading it
back on the other ranks would need the run directory on a file system every machine shares, and
the process group's own settings (dist.*) are needed before any rank can hear from another.
Exit codes: 0 complete, 2 bad input (one line on stderr; no manifest is written, and for a bad
config nothing at all), 1 the run failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from freeze.pipeline.config import Config, ConfigError, config_to_toml, load_config
from freeze.pipeline.runs import RunDir, RunError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.run", description="Run one freeze experiment.")
    parser.add_argument("--config", required=True, help="TOML config file")
    parser.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    parser.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a worker failure")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    return parser.parse_intermixed_args(argv)  # overrides may come before and after flags


def _under_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def prepare_run_dir(config: Config, resume: bool) -> Path:
    """Refuse a run that must not start (complete, or progress without ``resume``, or a resume with
    another config) and write its resolved config.toml; returns that file's path, the one the
    workers load. Raises RunError."""
    run = RunDir(config.run_dir())
    run.prepare(config_to_toml(config), resume)
    return run.config_path


def launch_local(resolved_config: Path, nproc: int, resume: bool = False, max_restarts: int = 0) -> int:
    """Start ``nproc`` workers on this machine with torchrun's launcher (same code path as a
    multi-node torchrun, including --max-restarts) on the resolved config file written by
    :func:`prepare_run_dir`, and return the run's exit code. The launcher agent runs in the calling
    process: a separate torchrun process would cost one more interpreter and torch import per run
    (sweeps call this directly for the same reason)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "-m",
        "freeze.pipeline.run",
        "--config",
        str(resolved_config),
    ]
    argv += ["--resume"] if resume else []
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for its workers when unset
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        # torchrun has printed each worker's failure; exit with the first worker's exit code.
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c and c > 0), 1)
    return 0


def launch_cluster(config, resolved_config: Path, resume: bool = False, max_restarts: int = 0) -> int:
    """Run on an emulated cluster of ``config.cluster.nodes`` network namespaces, ``dist.nproc``
    workers each, one torchrun agent per node (freeze.pipeline.cluster), on the resolved config file
    written by :func:`prepare_run_dir`; returns the exit code."""
    from freeze.pipeline.cluster.jobs import run_config_entry, run_on_cluster

    entry = run_config_entry(resolved_config, resume)
    return run_on_cluster(config.cluster, entry, config.dist.nproc, max_restarts, run_dir=config.run_dir())


def _mark_failed(config, error: BaseException) -> None:
    run = RunDir(config.run_dir())
    try:
        if run.status() == "running":
            run.finish("failed", f"{type(error).__name__}: {error}")
    except RunError:
        pass  # the manifest itself is unreadable: nothing more can be recorded


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not _under_launcher() and (config.dist.nproc > 1 or config.cluster.nodes):
        try:  # refuse before starting workers, so bad input costs nothing
            resolved = prepare_run_dir(config, args.resume)
        except RunError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        where = f"{config.cluster.nodes} emulated nodes x " if config.cluster.nodes else ""
        print(f"run {config.run_dir()}: starting {where}{config.dist.nproc} workers", flush=True)
        if config.cluster.nodes:
            return launch_cluster(config, resolved, args.resume, args.max_restarts)
        return launch_local(resolved, config.dist.nproc, args.resume, args.max_restarts)

    # Heavy imports only in the worker: the launcher process stays light.
    from freeze.pipeline.data import DataError
    from freeze.pipeline.distributed import setup_worker, teardown_worker
    from freeze.pipeline.models import ModelError
    from freeze.pipeline.train import train_worker

    ctx = None
    try:
        ctx = setup_worker(config.dist)
        train_worker(config, ctx, resume=args.resume)
        return 0
    except (RunError, DataError, ModelError) as e:  # bad input: raised before the run writes anything
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if ctx is None or ctx.is_main:
            _mark_failed(config, e)
        raise
    finally:
        teardown_worker()


if __name__ == "__main__":
    sys.exit(main())
