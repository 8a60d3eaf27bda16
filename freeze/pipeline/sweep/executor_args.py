"""The command-line flags that choose where a sweep's or a study's runs go (``--executor``,
``--parallel``, ``--slurm``, ``--emit-sbatch``), checked in one line each before anything runs."""

from __future__ import annotations

import argparse

from freeze.pipeline.slurm import SlurmOptionsError, parse_slurm_options
from freeze.pipeline.sweep.executors import Executor, SerialExecutor
from freeze.pipeline.sweep.grid import SweepError
from freeze.pipeline.sweep.local_executor import LocalExecutor
from freeze.pipeline.sweep.slurm_executor import SlurmExecutor

EXECUTORS = ("serial", "local", "slurm")


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
        "--share-gpus",
        action="store_true",
        help="local: the runs side by side share the visible GPUs instead of each owning its own (for studies "
        "read for accuracy: steps bound by kernel launches run about as fast side by side; their times are "
        "recorded as side by side and pair only with runs that shared alike)",
    )
    group.add_argument(
        "--slurm",
        action="append",
        default=None,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="slurm: partition, nodes, time, gpus_per_worker, cpus_per_worker, mem, max_parallel, constraint, "
        "nodelist, account, qos, exclusive, signal_s, max_requeues, setup, poll_s",
    )
    group.add_argument(
        "--emit-sbatch",
        action="store_true",
        help="slurm: write each stage's sbatch script and submit nothing (then: sbatch <script>)",
    )


def executor_from_args(args: argparse.Namespace) -> Executor:
    """The executor the command line asks for; SweepError (one line) for flags that do not fit it."""
    if args.executor != "local" and (args.parallel is not None or args.share_gpus):
        raise SweepError(
            f"{'--parallel' if args.parallel is not None else '--share-gpus'} is an option of --executor local"
        )
    if args.executor != "slurm" and (args.slurm or args.emit_sbatch):
        raise SweepError(f"{'--slurm' if args.slurm else '--emit-sbatch'} is an option of --executor slurm")
    if args.executor == "local":
        if args.parallel is None or args.parallel < 1:
            raise SweepError("--executor local needs --parallel N (N >= 1 runs side by side)")
        return LocalExecutor(args.parallel, share_gpus=args.share_gpus)
    if args.executor == "slurm":
        try:
            return SlurmExecutor(parse_slurm_options(args.slurm), emit_only=args.emit_sbatch)
        except SlurmOptionsError as e:
            raise SweepError(str(e)) from None
    return SerialExecutor()
