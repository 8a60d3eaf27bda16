"""Runs read back from a study's committed per-seed rows (``report/per-seed/<study>.csv``, written by
:mod:`freeze.pipeline.report.per_seed`): what a report is built from when the run directories are gone.

Run directories hold checkpoints and weights, so ``runs/`` is never committed, and a fresh machine, a
cluster's scratch space that was purged, or a study finished on another machine has none of them. The
per-seed rows are committed; each becomes a :class:`~freeze.pipeline.report.load.Run` with what the
row records (final-epoch test accuracy, validation accuracy and training seconds per epoch, steps, the
boundary per epoch and at each change, the probes, the hardware it was timed on; in rows written
since they were added, bytes on the wire, peak memory, the frozen fraction per epoch, mean phase
seconds and when it ran) and NaN for what it does not (per-block gradient norms, losses, and the newer
fields in older rows). Every table
built from those fields gives the same numbers as from the directories (lists in a row keep 6
significant digits; the final accuracy and training seconds are kept whole); the phase table leaves
out the runs without phase times and says so, and the eta figures need run directories.

A row holds a total or a mean where a run directory has one value per epoch; the row-run puts it where
the report's sum or mean reads it back (the bytes in the last epoch, the mean phase seconds and the
peak memory in every epoch). Two properties are reconstructed rather than read:
- its config holds only the recorded fields that change what a run computes (policy, hook, budget,
  workers are paired anyway): a control is a run whose recorded fields equal its baseline's
  (report.paired.computes_like), where two run directories' resolved configs are compared whole;
- in rows older than the frozen fraction's column, it is 0 in every epoch of a run whose boundary never
  moved (nothing was frozen) and unknown (NaN, never read as 0) in a run that froze.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from freeze.pipeline.report.load import METRIC_COLUMNS, ReportInputError, Run, load_runs, timing_from_words
from freeze.pipeline.report.per_seed import MANIFEST_COLUMNS
from freeze.pipeline.schema import PHASES, TRAIN_PHASES

# The columns a row needs (freeze.pipeline.report.per_seed._row writes them all).
ROW_COLUMNS = (
    "setting",
    "group",
    "seed",
    "run",
    "policy",
    "comm_hook",
    "budget_fraction",
    "world_size",
    "epochs",
    "steps",
    "train_s",
    "test_acc",
    "val_acc",
    "boundary_steps",
    "boundary_per_epoch",
    "val_acc_per_epoch",
    "train_s_per_epoch",
    "probes",
    "timed_on",
)


def is_rows_file(source: str | Path) -> bool:
    """Whether a report source names a per-seed CSV file rather than a folder of run directories."""
    return Path(source).suffix == ".csv"


def load_rows(path: str | Path) -> list[Run]:
    """One complete :class:`Run` per row of a per-seed CSV.

    Raises:
        ReportInputError: the file is missing or unreadable, lacks a column, or a cell is not what
            the per-seed writer writes (one line naming the file, line and column).
    """
    path = Path(path)
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except FileNotFoundError:
        raise ReportInputError(f"per-seed rows not found: {path}") from None
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise ReportInputError(f"{path}: cannot read as CSV ({exc})") from None
    missing = [c for c in ROW_COLUMNS if c not in frame.columns]
    if missing:
        raise ReportInputError(
            f"{path}: not a per-seed table (missing columns: {', '.join(missing)}); "
            "give the per_seed.csv a report writes, or a folder of run directories"
        )
    if frame.empty:
        raise ReportInputError(f"{path}: no rows")
    # line 1 is the header
    return [_run(path, row, f"{path}:{line}") for line, row in enumerate(frame.to_dict("records"), start=2)]


def load_sources(sources: Iterable[str | Path], log: Callable[[str], None] | None = None) -> list[Run]:
    """The runs of every source, each a folder of run directories or a per-seed CSV: a run that has
    a directory is read from it (the directory holds everything, a row only part), and a row fills
    in each run that has none; two rows of one run name are refused."""
    dirs: list[Run] = []
    rows: list[Run] = []
    for source in sources:
        if is_rows_file(source):
            rows += load_rows(source)
        else:
            dirs += load_runs(source)
    # a complete directory wins over the row of its run; an interrupted or failed rerun does not
    complete = {run.name for run in dirs if run.is_complete}
    unfinished = {run.name for run in dirs if not run.is_complete}
    seen: dict[str, Path] = {}
    kept = []
    for run in rows:
        if run.name in seen:
            raise ReportInputError(f"run {run.name} has two per-seed rows ({seen[run.name]} and {run.run_dir})")
        seen[run.name] = run.run_dir
        if run.name not in complete:
            kept.append(run)
    if log is not None and rows:
        superseded = len(rows) - len(kept)
        beside = sum(run.name in unfinished for run in kept)
        log(
            f"report: {len(kept)} runs read from per-seed rows, {len(dirs)} from run directories"
            + (f" ({superseded} rows left out: their run directories are here)" if superseded else "")
            + (f" ({beside} rows kept beside an unfinished run directory of the same run)" if beside else "")
        )
    return [*dirs, *kept]


def _run(path: Path, row: dict, where: str) -> Run:
    """One row as a complete Run: its per-epoch metrics, its manifest and the config fields it records."""
    epochs = _integer(row, "epochs", where, low=1)
    boundary_steps = tuple(_pairs(row, "boundary_steps", where, integers=True))
    # the fields Run.recorded_config reads (a control is compared on them when a run comes from a row)
    config = {
        "freeze": {"policy": row["policy"], "comm_hook": row["comm_hook"]},
        "train": {"budget_fraction": _float(row, "budget_fraction", where)},
    }
    return Run(
        run_dir=path,
        manifest=_manifest(row, epochs, where),
        config=config,
        metrics=_metrics(row, epochs, boundary_steps, where),
        eta=np.empty((epochs, 0)),
        probes=tuple(_pairs(row, "probes", where, integers=False)),
        boundary_steps=boundary_steps,
        rows_file=path,
    )


def _metrics(row: dict, epochs: int, boundary_steps: tuple, where: str) -> pd.DataFrame:
    """Run.metrics from a row: its per-epoch lists, its final numbers in the last epoch, NaN for the rest."""
    val = _per_epoch(row, "val_acc_per_epoch", epochs, where, low=0.0, high=1.0)
    wall = _per_epoch(row, "train_s_per_epoch", epochs, where, low=0.0)
    boundary = _per_epoch(row, "boundary_per_epoch", epochs, where, low=0.0, whole=True)
    # the final numbers kept whole (the lists hold 6 significant digits)
    wall[-1] = _float(row, "train_s", where, low=0.0)
    if not math.isnan(final_val := _float(row, "val_acc", where, nullable=True, low=0.0, high=1.0)):
        val[-1] = final_val
    metrics = pd.DataFrame(np.nan, index=range(epochs), columns=[*METRIC_COLUMNS, *(f"phase_{p}_s" for p in PHASES)])
    metrics["epoch"] = range(epochs)
    metrics["val_acc"] = val
    metrics["boundary"] = boundary
    metrics["cumulative_wall_s"] = wall
    metrics["epoch_wall_s"] = np.diff(wall, prepend=0.0)
    metrics["frozen_param_fraction"] = _frozen_fraction(row, boundary, boundary_steps, where)
    # steps: "" in a row of a run directory older than the step count
    metrics.loc[epochs - 1, "step"] = _float(row, "steps", where, nullable=True, low=0.0)
    metrics.loc[epochs - 1, "test_acc"] = _float(row, "test_acc", where, low=0.0, high=1.0)
    metrics.loc[epochs - 1, "allreduce_bytes"] = _optional(row, "allreduce_bytes", where)
    metrics["peak_memory_bytes"] = _optional(row, "peak_memory_bytes", where)
    for phase in TRAIN_PHASES:
        metrics[f"phase_{phase}_s"] = _optional(row, f"phase_{phase}_s", where)
    return metrics.astype(float).astype({"epoch": int})


def _manifest(row: dict, epochs: int, where: str) -> dict:
    """The manifest fields the report reads, as a complete run's (a row is written for complete runs only)."""
    processor, placement = timing_from_words(row["timed_on"])
    return {
        "run_name": row["run"],
        "group": row["group"],
        "policy": row["policy"],
        "seed": _integer(row, "seed", where, low=0),
        "setting": row["setting"],
        "world_size": _integer(row, "world_size", where, low=1),
        "status": "complete",
        "epochs_planned": epochs,
        "epochs_done": epochs,
        "block_names": [],
        "hardware": {"cpu": processor, **_cores(row, where)},
        "placement": placement,
        **{
            key: _manifest_cell(row, key, kind, where)
            for key, kind in MANIFEST_COLUMNS.items()
            if row.get(key, "").strip()
        },
    }


def _cores(row: dict, where: str) -> dict:
    """The machine's core count (the blocks table's), where the row records it."""
    return {"cores": _integer(row, "machine_cores", where, low=1)} if row.get("machine_cores", "").strip() else {}


def _frozen_fraction(row: dict, boundary: np.ndarray, changes: tuple, where: str) -> np.ndarray:
    """Per epoch, from the row; in rows older than that column, 0 for a run whose boundary never moved
    and unknown for one that froze (a boundary back at 0 by an epoch's end may have frozen within it)."""
    if row.get("frozen_fraction_per_epoch", "").strip():
        return _per_epoch(row, "frozen_fraction_per_epoch", len(boundary), where, low=0.0, high=1.0)
    froze = bool(changes) or bool((boundary > 0).any())
    return np.full(len(boundary), np.nan if froze else 0.0)


def _float(
    row: dict, column: str, where: str, nullable: bool = False, low: float = -math.inf, high: float = math.inf
) -> float:
    """A cell's number, refused (one line) unless finite and within [low, high]: a value no run writes
    is never averaged into a table (reliability case 25, as for run directories)."""
    text = row[column].strip()
    if text == "" and nullable:
        return math.nan
    return _number(text, column, where, low, high)


def _number(text: str, column: str, where: str, low: float = -math.inf, high: float = math.inf) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and low <= value <= high):
        if math.isfinite(high):
            accepted = f"a number in [{low:g}, {high:g}]"
        else:
            accepted = f"a number >= {low:g}" if math.isfinite(low) else "a finite number"
        raise ReportInputError(f"{where}: column {column} must be {accepted}, got {text!r}")
    return value


def _optional(row: dict, column: str, where: str) -> float:
    """A column rows written before it existed lack: NaN there, and where the run did not record it."""
    return _float(row, column, where, nullable=True) if column in row else math.nan


def _manifest_cell(row: dict, key: str, kind: type, where: str) -> str | float | int:
    """A time stays the text it was; a load average is a number, a count an integer >= 1."""
    if kind is str:
        return row[key]
    return _integer(row, key, where, low=1) if kind is int else _float(row, key, where, low=0.0)


def _integer(row: dict, column: str, where: str, low: int) -> int:
    value = _float(row, column, where)
    if not (value.is_integer() and value >= low):
        raise ReportInputError(f"{where}: column {column} must be an integer >= {low}, got {row[column]!r}")
    return int(value)


def _per_epoch(
    row: dict,
    column: str,
    epochs: int,
    where: str,
    low: float = -math.inf,
    high: float = math.inf,
    whole: bool = False,
) -> np.ndarray:
    """One value per epoch, ';'-separated; an empty cell is unknown (NaN)."""
    cells = row[column].split(";")
    if len(cells) != epochs:
        raise ReportInputError(f"{where}: column {column} has {len(cells)} values for {epochs} epochs")
    values = np.array([_number(c, column, where, low, high) if c.strip() else math.nan for c in cells])
    if whole and not all(math.isnan(v) or float(v).is_integer() for v in values):
        raise ReportInputError(f"{where}: column {column} must be whole numbers separated by ';', got {row[column]!r}")
    return values


def _pairs(row: dict, column: str, where: str, integers: bool) -> list[tuple]:
    """``a:b;c:d`` as [(a, b), (c, d)], integers or floats (an empty cell: none)."""
    text = row[column].strip()
    pairs = []
    for cell in text.split(";") if text else ():
        first, sep, second = cell.partition(":")
        try:
            a, b = float(first), float(second)
        except ValueError:
            a = b = math.nan
        whole = all(float(v).is_integer() and v >= 0 for v in (a, b)) if integers else True
        if not (sep and math.isfinite(a) and math.isfinite(b) and whole):
            kind = "whole numbers >= 0 " if integers else ""
            raise ReportInputError(
                f"{where}: column {column} must be pairs a:b of {kind}separated by ';', got {cell!r}"
            )
        pairs.append((int(a), int(b)) if integers else (a, b))
    return pairs
