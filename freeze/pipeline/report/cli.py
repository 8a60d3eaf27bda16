"""Command line: ``python -m report <runs_dir>`` (console script ``freeze-report``).

Example: python -m report runs/study --baseline none --formats md,png
         python -m report report/per-seed/horizon.csv --out /tmp/horizon-report   # from committed rows
"""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path

from freeze.pipeline.interrupts import INTERRUPTED_EXIT, InterruptGuard

# What an interrupted report leaves: it is built aside and moved in whole (freeze.pipeline.report.build).
INTERRUPTED = (
    "report: interrupted: the output folder holds the report it held before (or this one, whole); run it again"
)


def _parser() -> argparse.ArgumentParser:
    from freeze.pipeline.report.build import FORMATS
    from freeze.pipeline.report.load import ReportInputError
    from freeze.pipeline.report.tables import ON_DUPLICATE

    class _Parser(argparse.ArgumentParser):
        # argparse prints usage + message over two lines; the contract is one line and exit code 2.
        def error(self, message: str):
            raise ReportInputError(message)

    parser = _Parser(
        prog="python -m report",
        description="Tables, figures and what they mean, from run directories. What the tables say and which "
        'rows are no finding: docs/experiments.md, "Your own ablation"; the studies: docs/study.md.',
    )
    parser.add_argument(
        "sources",
        nargs="+",
        metavar="runs_dir",
        help="folder searched recursively for run directories (manifest.json), or a study's per-seed CSV "
        "(report/per-seed/<study>.csv: its runs read back from their rows); with several, a run with a "
        "directory is read from it and rows fill in the runs that have none",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output folder (default: <runs_dir>-report beside the first, e.g. runs/offline -> runs/offline-report)",
    )
    parser.add_argument(
        "--baseline", default=None, help="group to compare against (default: the group with policy none)"
    )
    parser.add_argument(
        "--target-fraction",
        type=float,
        default=0.95,
        help="time-to-target threshold, as a fraction of the baseline's mean final val accuracy",
    )
    parser.add_argument(
        "--on-duplicate",
        default="error",
        choices=ON_DUPLICATE,
        help="two complete runs of one group and seed: stop (error) or keep the one that ended last (newest)",
    )
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated subset of {','.join(FORMATS)}")
    return parser


def print_meaning(written: dict[str, Path]) -> None:
    """The plain sentences ``make study`` ends with (freeze.pipeline.report.verdict), read from the
    csv files just written: the same answer whichever command made the report."""
    if "paired.csv" not in written:
        return  # written without the csv format: the sentences have nothing to read
    from freeze.pipeline.report.paired import DEFAULT_MARGIN_POINTS
    from freeze.pipeline.report.verdict import verdict_lines

    lines = verdict_lines(written["paired.csv"].parent, DEFAULT_MARGIN_POINTS)
    if lines:
        print("== what this means")
        print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    with InterruptGuard() as interrupt:
        try:
            return _report(argv, interrupt)
        except BaseException as error:
            if not interrupt.caused(error):
                raise
        print(INTERRUPTED, file=sys.stderr)
        return INTERRUPTED_EXIT


def _report(argv: list[str] | None, interrupt: InterruptGuard) -> int:
    # pandas and matplotlib load here, inside the caller's guard, and before the try: its except
    # clauses name what the import binds
    from freeze.pipeline.report.build import ReportMoveError, build_report
    from freeze.pipeline.report.load import ReportInputError

    try:
        args = _parser().parse_args(argv)
        formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
        written = build_report(
            args.sources, args.out, args.baseline, args.target_fraction, formats, args.on_duplicate, log=print
        )
    except ReportInputError as exc:
        print(f"report: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the disk filled up while writing (a read-only folder is refused up front)
        where = exc.filename or "the output folder"
        # the report is built aside and moved in whole, so what the folder held before is still there,
        # unless a rename into it failed part way
        held = "part of this report" if isinstance(exc, ReportMoveError) else "the report it held before"
        advice = "free space and run it again" if exc.errno == errno.ENOSPC else "run it again once it can be written"
        print(
            f"report: error: cannot write {where}: {exc.strerror or exc}; the output folder holds {held}: {advice}",
            file=sys.stderr,
        )
        return 1
    if interrupt.seen:  # raised inside a library that swallowed it (a weakref callback)
        raise KeyboardInterrupt
    if "main.md" in written:  # the answer on the terminal, as the study prints its tables; the rest is in files
        print(written["main.md"].read_text(encoding="utf-8"))
    print_meaning(written)
    out_dirs = sorted({str(p.parent) for p in written.values()})
    print(f"report: wrote {len(written)} files to {', '.join(out_dirs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
