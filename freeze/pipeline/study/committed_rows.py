"""A study's committed per-seed rows as its results (``--from-rows``): the runs whose directories are
gone are read back from ``report/per-seed/<study>.csv`` (freeze.pipeline.report.rows) and not run again.

Run directories are never committed; a study that spans machines or sessions, or a page regenerated on
a fresh clone, has only the rows its last ``--update-report`` committed. With ``--from-rows`` the study
runs what neither a run directory nor a row holds, and its report reads the directories first and the
rows for the rest; with every run in the rows it regenerates the page without training.
"""

from __future__ import annotations

import csv
from pathlib import Path

from freeze.pipeline.schema import find_run_dirs
from freeze.pipeline.study.plan import StudyFile
from freeze.pipeline.sweep import RunSpec, SweepError

PER_SEED_FOLDER = "per-seed"  # beside the study's report_md: report/per-seed/<study>.csv


def per_seed_path(study: StudyFile, name: str | None = None) -> Path:
    """Where ``--update-report`` commits the rows of study ``name`` (default: this study's)."""
    if not study.report_md:
        raise SweepError(f"study file {study.path}: per-seed rows need report_md (they are committed beside it)")
    return Path(study.report_md).parent / PER_SEED_FOLDER / f"{name or study.name}.csv"


def check_from_rows(study: StudyFile) -> Path:
    """The study's committed rows, or SweepError (one line) when ``--from-rows`` cannot apply."""
    if study.search is not None:
        raise SweepError(
            f"study file {study.path}: --from-rows: the parameter search's runs are not in the per-seed rows; "
            "run this study without --from-rows"
        )
    if study.predict:
        raise SweepError(
            f"study file {study.path}: --from-rows: the cost model's prediction (predict = true) reads run "
            "directories; set predict = false or run without --from-rows"
        )
    path = per_seed_path(study)
    if not path.is_file():
        raise SweepError(f"study file {study.path}: --from-rows: no committed per-seed rows at {path}")
    return path


def has_run_dirs(folder: Path) -> bool:
    """Whether ``folder`` holds a run directory (a study's folder may hold only its scheduler's stage
    folder, or nothing yet)."""
    return folder.is_dir() and bool(find_run_dirs(folder))


def row_run_names(path: Path) -> set[str]:
    """The run names a per-seed CSV holds (its ``run`` column)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if "run" not in (reader.fieldnames or []):
            raise SweepError(f"{path}: not a per-seed table (no run column)")
        return {row["run"] for row in reader}


def still_to_run(specs: list[RunSpec], rows: Path) -> list[RunSpec]:
    """The runs neither a run directory nor a committed row holds (a directory, complete or not, stays
    the executor's to skip or resume)."""
    in_rows = row_run_names(rows)
    return [s for s in specs if s.name not in in_rows or Path(s.config.run_dir()).is_dir()]
