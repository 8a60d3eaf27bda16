"""``python -m experiments.substrate report``: the substrate's tables into report/substrate-study.md.

Each table is written under report/substrate/ by its own command (``gates``, ``planted-check``,
``score``), with that command in its caption; this only copies them into that page's generated spans
(``<!-- NAME:start -->`` ... ``<!-- NAME:end -->``), so the report never carries a number its file
does not. The score command splices its own table the same way when it ends.
"""

from __future__ import annotations

import os
from pathlib import Path

from freeze._atomic import atomic_write_text
from freeze.pipeline import markdown

# span name in report/substrate-study.md -> (the table file under report/substrate/, a figure beside it or None)
SPANS: dict[str, tuple[str, str | None]] = {
    "substrate-gates": ("gates-substrate-mix-adamw.md", None),  # the substrate's recipe (docs/substrate.md)
    "substrate-curves": ("curves.md", None),
    "planted-checks": ("planted-checks.md", None),
    "planted-score": ("planted-score.md", "planted-score-tracking.png"),
}


def splice_tables(report_md: Path, tables_dir: Path, names: tuple[str, ...] = tuple(SPANS)) -> list[str]:
    """Copy each named span's table file (and its figure, linked) from ``tables_dir`` into
    ``report_md``; returns the spans written.

    Raises:
        markdown.MarkerError: a span's markers are missing or doubled in ``report_md`` (one line).
        FileNotFoundError: a table file is missing (its command has not run yet).
    """
    missing = [tables_dir / SPANS[name][0] for name in names if not (tables_dir / SPANS[name][0]).is_file()]
    if missing:  # before any span is written: the report is left as it was
        raise FileNotFoundError(2, "no such file", str(missing[0]))
    for name in names:
        table, figure = SPANS[name]
        splice_file(report_md, name, tables_dir / table, None if figure is None else tables_dir / figure)
    return list(names)


def splice_file(report_md: Path, span: str, table: Path, figure: Path | None = None) -> None:
    """``report_md``'s span ``span`` replaced by the file ``table`` (and a link to ``figure`` if it exists)."""
    body = table.read_text(encoding="utf-8").strip()
    if figure is not None and figure.is_file():
        link = Path(os.path.relpath(figure.resolve(), report_md.parent.resolve())).as_posix()
        body += f"\n\n![{figure.name}]({link})"
    atomic_write_text(report_md, markdown.splice(report_md.read_text(encoding="utf-8"), span, body, report_md))
