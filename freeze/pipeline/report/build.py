"""The report's stages: run directories loaded, every table built, tables and figures written
(the package's docstring says what goes in and out)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from freeze._atomic import atomic_write_text, sync_directory
from freeze.pipeline.interrupts import signals_deferred
from freeze.pipeline.report.atlas import atlas_table
from freeze.pipeline.report.blocks import blocks_table
from freeze.pipeline.report.decisions import decisions_table
from freeze.pipeline.report.frontier_tables import frontier_table, iso_speedup_table, iso_speedups, settle
from freeze.pipeline.report.load import ReportInputError, Run
from freeze.pipeline.report.paired import DEFAULT_MARGIN_POINTS, convergence_table, paired_table
from freeze.pipeline.report.per_seed import per_seed_table
from freeze.pipeline.report.rows import is_rows_file, load_sources
from freeze.pipeline.report.summary import summary_table
from freeze.pipeline.report.tables import (
    Table,
    drop_duplicate_runs,
    incomplete_table,
    main_table,
    phase_table,
    resolve_baseline,
    static_sweep_table,
)
from freeze.pipeline.report.writers import combined_markdown, to_latex, to_markdown

FORMATS = ("md", "tex", "csv", "png")
# tables a report does not make when its runs lack what they read (build_tables): an earlier report's
# copy in the output folder goes, or a study page would splice it as this report's
OPTIONAL_TABLES = ("phases", "blocks")
# the folder a report is built in before it is moved into its output folder (inside it)
STAGING_PREFIX = ".report-building-"
STAGING_LOCK = ".lock"  # held while its report builds


def default_out_dir(runs_dir: str | Path) -> Path:
    """``<runs_dir>-report``, beside the runs folder: runs/offline -> runs/offline-report (a per-seed
    CSV: report/per-seed/horizon.csv -> runs/horizon-report, where the study command writes its report,
    not beside the committed rows).

    Args:
        runs_dir: the folder of run directories, or the per-seed CSV, the report reads.
    """
    if is_rows_file(runs_dir):
        return Path("runs") / f"{Path(runs_dir).stem}-report"
    runs = Path(runs_dir)
    runs = runs if runs.name else runs.resolve()  # "." has no name of its own
    return runs.with_name(f"{runs.name}-report")


def build_tables(
    runs: list[Run],
    baseline: str | None = None,
    target_fraction: float = 0.95,
    margin_points: float = DEFAULT_MARGIN_POINTS,
) -> list[Table]:
    chosen = resolve_baseline(runs, baseline)
    # against the budget frontier ({} without budget runs), each verdict settled once for every table
    iso = settle(iso_speedups(runs, chosen))
    iso_by_group = {key: reading.iso for key, reading in iso.items()}
    main = main_table(runs, chosen, target_fraction, margin_points, iso_by_group)
    paired = paired_table(runs, chosen, target_fraction, margin_points, iso_by_group)
    timed = [r for r in runs if r.has_phase_times]
    # Read back from per-seed rows older than their phase and time columns, a study has no phase times
    # and no start times at all: those two tables are not made (a page keeps the ones its run
    # directories gave), rather than made of n/a.
    only_old_rows = all(r.from_rows for r in runs)
    phases = [] if only_old_rows and not timed else [phase_table(timed, chosen, left_out=len(runs) - len(timed))]
    when = not only_old_rows or any(r.manifest.get("start_time") for r in runs)
    return [
        summary_table(main, paired, iso),
        main,
        paired,
        frontier_table(runs, chosen),
        iso_speedup_table(iso),
        atlas_table(runs, chosen, target_fraction, margin_points, iso_by_group),
        decisions_table(runs, chosen),
        convergence_table(runs, chosen, margin_points),
        static_sweep_table(runs, chosen),
        *phases,
        incomplete_table(runs),
        *([blocks_table(runs)] if when else []),
        per_seed_table(runs),
    ]


def _check_out_dir(out: Path) -> None:
    """ReportInputError when ``out``, or the nearest part of it that exists, is not a directory or
    cannot be written (a read-only file system; root passes every permission check, so a file is
    made and removed rather than asking os.access)."""
    for existing in (out, *out.parents):
        if existing.exists():
            if not existing.is_dir():
                raise ReportInputError(f"output folder {out}: {existing} is a file, not a directory; give a directory")
            try:
                handle, probe = tempfile.mkstemp(dir=existing, prefix=".report-write-check-")
                os.close(handle)
                os.unlink(probe)
            except OSError as exc:
                raise ReportInputError(
                    f"output folder {out}: {existing} cannot be written ({exc.strerror}); give a writable folder"
                ) from None
            return


def _write_files(
    folder: Path, runs: list[Run], tables: list[Table], formats: tuple[str, ...], margin_points: float
) -> list[str]:
    """Every table in every format, the combined markdown and the figures, into ``folder``; returns
    the file names."""
    names: list[str] = []

    def write(name: str, text: str) -> None:
        atomic_write_text(folder / name, text)
        names.append(name)

    for table in tables:
        if "md" in formats:
            write(f"{table.name}.md", to_markdown(table))
        if "tex" in formats:
            write(f"{table.name}.tex", to_latex(table))
        if "csv" in formats:
            write(f"{table.name}.csv", table.data.to_csv(index=False))
    if "md" in formats:
        write("tables.md", combined_markdown(tables, runs))
    if "png" in formats:
        # Imported here so table-only reports never pay for matplotlib.
        from freeze.pipeline.report.plots import write_plots

        names.extend(write_plots(runs, folder, tables, margin_points))
    return names


class ReportMoveError(OSError):
    """A rename into the output folder failed after others were made: the folder holds part of this
    report (renames on one file system do not fail for space; this is the rare remaining case)."""


def _move_in(staging: Path, out: Path, names: list[str]) -> dict[str, Path]:
    """The built files renamed into ``out``, and an earlier report's figures and optional tables this
    one did not make removed (they would sit beside tables that contradict them, and a study's
    --update-report would publish them). Ctrl-C and SIGTERM wait for the last rename, so the folder holds one report or
    the other whole."""
    with signals_deferred((signal.SIGINT, signal.SIGTERM)):
        try:
            for name in names:
                os.replace(staging / name, out / name)
            drawn = set(names)
            for stale in sorted(out.glob("*.png")):
                if stale.name not in drawn:
                    stale.unlink()
            for table in OPTIONAL_TABLES:
                for stale in sorted(out.glob(f"{table}.*")):
                    if stale.name not in drawn and stale.suffix in (".md", ".csv", ".tex"):
                        stale.unlink()
        except OSError as exc:
            raise ReportMoveError(exc.errno, exc.strerror, exc.filename) from exc
    sync_directory(out)
    return {name: out / name for name in names}


@contextlib.contextmanager
def _staging_folder(out: Path) -> Iterator[Path]:
    """A new build folder inside ``out``, removed when the block ends. While it builds, an exclusive
    ``flock`` on its lock file says so (the kernel drops it however the holder ends, as a run's
    ``.lock``: freeze.pipeline.run_lock), so a folder whose lock nobody holds is what a killed report
    left and goes first, and a report building beside this one into the same folder keeps its own."""
    for old in out.glob(f"{STAGING_PREFIX}*"):
        _remove_if_abandoned(old)
    try:
        folder = Path(tempfile.mkdtemp(dir=out, prefix=STAGING_PREFIX))
    except OSError as exc:  # name the folder the user asked for, not a random name in it
        exc.filename = str(out)
        raise
    fd = os.open(folder / STAGING_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)  # closing the descriptor releases the lock


def _remove_if_abandoned(folder: Path) -> None:
    try:
        fd = os.open(folder / STAGING_LOCK, os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # no lock file yet: a report making its folder this instant
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # a report building now
        os.close(fd)
        return
    shutil.rmtree(folder, ignore_errors=True)
    os.close(fd)


def build_report(
    runs_dir: str | Path | Sequence[str | Path],
    out_dir: str | Path | None = None,
    baseline: str | None = None,
    target_fraction: float = 0.95,
    formats: tuple[str, ...] = FORMATS,
    on_duplicate: str = "error",
    log=None,
    margin_points: float = DEFAULT_MARGIN_POINTS,
    extra_tables: Sequence[Table] = (),
) -> dict[str, Path]:
    """Write every table and figure for the runs under ``runs_dir``; returns file name -> path.

    ``runs_dir`` is a folder searched for run directories, a per-seed CSV (report/per-seed/<study>.csv:
    the runs read back from their rows, freeze.pipeline.report.rows), or several of both: a run with
    a directory is read from it, and rows fill in the runs that have none. ``out_dir`` defaults to
    :func:`default_out_dir` of the first (``runs/<study>-report`` beside ``runs/<study>``, where the
    study command writes too). ``extra_tables`` (e.g. the study's
    predicted-vs-measured table) are written after the report's own, in the same formats.
    Raises ReportInputError (one line) on bad input.
    """
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        rejected = ", ".join(unknown) or "(empty)"
        raise ReportInputError(f"formats {rejected} not accepted; accepted: {', '.join(FORMATS)}")
    if not 0.0 < target_fraction <= 1.0:
        raise ReportInputError(f"target_fraction must be in (0, 1], got {target_fraction}")
    if not margin_points > 0:
        raise ReportInputError(f"margin_points must be > 0, got {margin_points}")
    sources = [runs_dir] if isinstance(runs_dir, (str, Path)) else list(runs_dir)
    if not sources:
        raise ReportInputError("no runs to report: give a folder of run directories or a per-seed CSV")
    out = Path(out_dir) if out_dir is not None else default_out_dir(sources[0])
    _check_out_dir(out)  # before the work, not after it
    where = " ".join(map(str, sources))
    runs, dropped = drop_duplicate_runs(load_sources(sources, log), on_duplicate, where)
    for old, kept in dropped:
        if log is not None:
            log(
                f"report: left out {old.run_dir}: same group and seed as the newer {kept.run_dir} (--on-duplicate newest)"
            )
    tables = [*build_tables(runs, baseline, target_fraction, margin_points), *extra_tables]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportInputError(f"output folder {out} cannot be created: {exc.strerror}") from None
    # Built whole in a folder of its own inside ``out`` (the same file system), then moved in: a full
    # disk or a Ctrl-C while writing leaves the earlier report in ``out`` as it was, never half of each.
    with _staging_folder(out) as staging:
        try:
            names = _write_files(staging, runs, tables, formats, margin_points)
        except OSError as exc:  # name the file the user asked for, not the build folder that goes now
            if exc.filename and Path(exc.filename).parent == staging:
                exc.filename = str(out / Path(exc.filename).name)
            raise
        written = _move_in(staging, out, names)
    if runs and not any(run.is_complete for run in runs):
        raise ReportInputError(
            f"none of the {len(runs)} runs under {where} is complete: no table has a result "
            f"({out / 'incomplete.md'} lists each run and why)"
        )
    return written
