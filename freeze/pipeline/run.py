"""One training run.

    # one process
    python -m experiments.run --config experiments/configs/smoke.toml
    # N local workers (this command starts them through torchrun's launcher)
    python -m experiments.run --config experiments/configs/smoke.toml dist.nproc=2
    # under torchrun, one node or many (gloo on CPU, nccl on CUDA)
    torchrun --nnodes=4 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \
        --rdzv-id=study --max-restarts=1 -m experiments.run --config experiments/configs/reference_fixed.toml

Overrides are ``section.key=value``; the resolved config is written into the run directory.
Exit codes: 0 complete, 2 bad input (one line on stderr, nothing written), 1 the run failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from freeze.pipeline.config import ConfigError, load_config
from freeze.pipeline.runs import RunDir, RunError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.run", description="Run one freeze experiment.")
    parser.add_argument("--config", required=True, help="TOML config file")
    parser.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    parser.add_argument("--nproc", type=int, default=None, help="local workers to start (overrides dist.nproc)")
    parser.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a worker failure")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    return parser.parse_args(argv)


def _under_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def launch_local(
    config_path: str, overrides: list[str], nproc: int, resume: bool = False, max_restarts: int = 0
) -> int:
    """Start ``nproc`` workers on this machine with torchrun's launcher (same code path as a
    multi-node torchrun, including --max-restarts) and return the run's exit code. The launcher
    agent runs in the calling process: a separate torchrun process would cost one more interpreter
    and torch import per run (sweeps call this directly for the same reason)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "-m",
        "freeze.pipeline.run",
        "--config",
        config_path,
    ]
    argv += (["--resume"] if resume else []) + list(overrides) + [f"dist.nproc={nproc}"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for its workers when unset
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        # torchrun has printed each worker's failure; exit with the first worker's exit code.
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c and c > 0), 1)
    return 0


def _mark_failed(config, error: BaseException) -> None:
    run = RunDir(config.run_dir())
    try:
        if run.status() == "running":
            run.finish("failed", f"{type(error).__name__}: {error}")
    except RunError:
        pass  # the manifest itself is unreadable: nothing more can be recorded


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides) + ([f"dist.nproc={args.nproc}"] if args.nproc is not None else [])
    try:
        config = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not _under_launcher() and config.dist.nproc > 1:
        try:  # refuse before starting workers, so bad input costs nothing
            RunDir(config.run_dir()).ensure_not_complete()
        except RunError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return launch_local(args.config, list(args.overrides), config.dist.nproc, args.resume, args.max_restarts)

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
        # The traceback keeps train_worker's locals (its Freezer and DDP wrapper, which hold the
        # process group) alive; clear them so that teardown_worker can stop the group's threads.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        teardown_worker()


if __name__ == "__main__":
    sys.exit(main())
