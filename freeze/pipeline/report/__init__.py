"""Study report: run directories in, markdown / LaTeX / CSV tables and PNG figures out.

    python -m report runs/<study> [--out DIR] [--baseline GROUP] [--target-fraction 0.95] [--formats md,tex,csv,png]

Reads only run directories (manifest.json, config.toml, metrics.jsonl), never the training code.
"""

from __future__ import annotations

from pathlib import Path

from freeze._atomic import atomic_write_text
from freeze.pipeline.report.load import ReportInputError, Run, load_runs
from freeze.pipeline.report.tables import Table, build_tables, combined_markdown, to_latex, to_markdown

FORMATS = ("md", "tex", "csv", "png")

__all__ = ["FORMATS", "ReportInputError", "Run", "Table", "build_report", "load_runs"]


def _check_out_dir(out: Path) -> None:
    """ReportInputError when ``out``, or the nearest part of it that exists, is not a directory."""
    for existing in (out, *out.parents):
        if existing.exists():
            if not existing.is_dir():
                raise ReportInputError(f"output folder {out}: {existing} is a file, not a directory; give a directory")
            return


def build_report(
    runs_dir: str | Path,
    out_dir: str | Path | None = None,
    baseline: str | None = None,
    target_fraction: float = 0.95,
    formats: tuple[str, ...] = FORMATS,
) -> dict[str, Path]:
    """Write every table and figure for the runs under ``runs_dir``; returns file name -> path.

    ``out_dir`` defaults to ``<runs_dir>/report``. Raises ReportInputError (one line) on bad input.
    """
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        rejected = ", ".join(unknown) or "(empty)"
        raise ReportInputError(f"formats {rejected} not accepted; accepted: {', '.join(FORMATS)}")
    if not 0.0 < target_fraction <= 1.0:
        raise ReportInputError(f"target_fraction must be in (0, 1], got {target_fraction}")
    out = Path(out_dir) if out_dir is not None else Path(runs_dir) / "report"
    _check_out_dir(out)  # before the work, not after it
    runs = load_runs(runs_dir)
    tables = build_tables(runs, baseline, target_fraction)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportInputError(f"output folder {out} cannot be created: {exc.strerror}") from None
    written: dict[str, Path] = {}

    def write(name: str, text: str) -> None:
        atomic_write_text(out / name, text)
        written[name] = out / name

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

        written.update(write_plots(runs, out))
    return written
