"""``python -m experiments.sweep``: the sweep file's grid, checked whole, then run (module docstring
of :mod:`freeze.pipeline.sweep`)."""

from __future__ import annotations

import argparse
import sys

from freeze.pipeline import sweep as _package
from freeze.pipeline.config import ConfigError
from freeze.pipeline.sweep.executor_args import add_executor_arguments, executor_from_args
from freeze.pipeline.sweep.grid import BUDGET_KEY, SweepError, dry_run_lines, expand, read_sweep
from freeze.pipeline.sweep.runner import INTERRUPTED_EXIT_CODE, INTERRUPTED_MESSAGE

# Keys a sweep sets for every run itself: an override would be overwritten, so it is refused.
SWEEP_OWNED_KEYS = ("run.study", "run.name", "run.group", "run.out_dir")


def check_command_line_overrides(overrides: list[str], grid: dict) -> None:
    """SweepError (one line) for a command-line override of a key the sweep sets itself or varies in
    its grid (it would be overwritten run by run, silently)."""
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key in SWEEP_OWNED_KEYS or key in grid:
            where = "its grid varies it" if key in grid else "the sweep sets it for every run"
            hint = "; choose where runs go with --out-dir" if key == "run.out_dir" else ""
            raise SweepError(f"override {override!r}: {where}; accepted: any other section.key=value{hint}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.sweep",
        description=_package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sweep", required=True, help="sweep TOML file")
    parser.add_argument("--out-dir", default=None, help="override run.out_dir for every run")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and exit")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="applied to every run after the sweep file's overrides, e.g. dist.nproc=1 (workers per node; "
        "train.batch_size is per worker, so this changes the global batch)",
    )
    add_executor_arguments(parser)
    args = parser.parse_intermixed_args(argv)
    try:
        executor = executor_from_args(args)
        sweep = read_sweep(args.sweep)
        # the budget runs set train.budget_fraction themselves: varied like a grid key
        varied = {**sweep["grid"], **({BUDGET_KEY: sweep["budgets"]} if sweep["budgets"] else {})}
        check_command_line_overrides(args.overrides, varied)
        overrides = [*sweep["overrides"], *args.overrides]
        try:
            specs = expand(
                sweep["base"], sweep["study"], sweep["grid"], overrides, args.out_dir, budgets=sweep["budgets"]
            )
        except SweepError as e:  # a grid or override key of the sweep file (the base file names itself)
            raise SweepError(f"sweep file {args.sweep}: {e}") from None
        if not args.dry_run:  # a dry run lists names for other machines: this one's hardware is moot
            executor.check(specs)
    except (SweepError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("\n".join(dry_run_lines(specs)))
        return 0
    try:
        summary = executor.run("sweep", specs)
    except KeyboardInterrupt:
        print(INTERRUPTED_MESSAGE, file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except SweepError as e:  # the scheduler refused, or can never start the runs (said in one line)
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in summary.lines():
        print(line)
    if summary.emitted and not summary.failed:
        return 0  # the script's path and the sbatch command are said above
    # what comes next, as a single run says it (the runs' own hint is off inside a sweep)
    print(f"report: python -m report {specs[0].config.run_dir().parent}" if specs else "sweep: no runs")
    return 0 if summary.ok else 1
