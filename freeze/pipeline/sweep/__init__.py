"""A grid of runs (policies x parameters x seeds x worker counts x any config key): one after another
here, side by side (--executor local), or as a SLURM job array (--executor slurm).

    python -m experiments.sweep --sweep experiments/configs/sweep_smoke.toml --dry-run  # list the runs
    python -m experiments.sweep --sweep experiments/configs/sweep_smoke.toml            # run them
    python -m experiments.sweep --sweep experiments/configs/sweep_ablation.toml dist.nproc=1   # an override for every run
    python -m experiments.sweep --sweep experiments/configs/sweep_ablation.toml --executor slurm --slurm partition=gpu,time=1:00:00

Sweep file (docs/experiments.md, "Sweeps"; a learnable ablation to copy: "Your own ablation",
experiments/configs/sweep_ablation.toml; sweep_smoke.toml below is a pipeline check only):

    [sweep]                                          # accepted keys: base, study, overrides, budgets
    base = "experiments/configs/smoke.toml"          # the run config every run starts from
    study = "smoke-sweep"                            # runs/<study>/<run-name>/
    overrides = ["train.epochs=2"]                   # applied to every run (section.key=value)
    [grid]                                           # the cartesian product of these config keys
    "freeze.policy" = ["none", "geometric:alpha=0.5"]
    "run.seed" = [0, 1, 2]

Run names join the grid values (none_seed=0); runs that differ only in run.seed share a group.
``budgets = [0.5, 0.7]`` under [sweep] adds, after each baseline run (policy none), the same run at
those fractions of its steps (``train.budget_fraction``; named budget-0.5_seed=0): the budget
frontier the report reads every freezing arm against ("beyond the frontier", docs/frontier.md).

Every run's config is resolved and validated once, before anything runs (:func:`expand`); each run
then starts from the resolved config.toml written into its run directory.

Re-running a sweep skips complete runs, resumes interrupted or failed ones from their checkpoint
and never overwrites a result. A failing run is recorded as failed (its manifest holds the error)
and the sweep goes on; the summary says what ran, what was skipped and what failed. The sweep holds
each run's lock while it runs it (:mod:`freeze.pipeline.run_lock`): a run another process writes
(a second sweep on the same study) is left to it and reported as busy, with that process's pid and
host; two sweeps of one study thus share its runs, each run trained once. The exit code is 0 only
when every run is complete. On SLURM and side by side: docs/study.md, "Submit it".

The package: :mod:`.grid` (the sweep file, expanded and checked), :mod:`.runner` (runs one after
another on this machine), :mod:`.executors` and :mod:`.executor_args` (where runs go: here, side by
side in :mod:`.local_executor`, on SLURM in :mod:`.slurm_executor`), :mod:`.stage` (a stage's folder
its tasks read), :mod:`.task` (one array task), :mod:`.nodes` (a run over several nodes),
:mod:`.timing` (a measured epoch against a time limit), :mod:`.cli` (the command).
"""

from freeze.pipeline.sweep.grid import (
    SEED_KEY,
    RunSpec,
    SweepError,
    check_runnable_here,
    dry_run_lines,
    expand,
    read_sweep,
    read_toml,
)
from freeze.pipeline.sweep.runner import (
    INTERRUPTED_EXIT_CODE,
    INTERRUPTED_MESSAGE,
    SweepSummary,
    WorkEta,
    run_specs,
)

__all__ = [
    "INTERRUPTED_EXIT_CODE",
    "INTERRUPTED_MESSAGE",
    "SEED_KEY",
    "RunSpec",
    "SweepError",
    "SweepSummary",
    "WorkEta",
    "check_runnable_here",
    "dry_run_lines",
    "expand",
    "main",
    "read_sweep",
    "read_toml",
    "run_specs",
]


def main(argv: list[str] | None = None) -> int:
    """The command (:func:`freeze.pipeline.sweep.cli.main`), imported when called."""
    from freeze.pipeline.sweep.cli import main as cli_main

    return cli_main(argv)
