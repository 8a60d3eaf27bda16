"""The report's tables written out: markdown (one file per table, and tables.md with the setup line
every run shares) and LaTeX (booktabs, ready for \\input). The tables themselves are built in
:mod:`freeze.pipeline.report.tables` and the modules beside it."""

from __future__ import annotations

from freeze.pipeline import markdown
from freeze.pipeline.report.load import Run
from freeze.pipeline.report.tables import Table

_SETUP_KEYS = (
    ("data", "dataset"),
    ("model", "arch"),
    ("model", "weights"),
    ("train", "epochs"),
    ("train", "batch_size"),
    ("optim", "name"),
    ("optim", "lr"),
    ("schedule", "name"),
)
_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "±": r"$\pm$",
    "—": "---",
    "<": r"$<$",
    ">": r"$>$",
}


def setup_line(runs: list[Run]) -> str:
    """One line naming the setup all runs share (values that differ are joined by ' / ')."""
    parts = []
    for section, key in _SETUP_KEYS:
        values = sorted(
            {
                str(r.config[section][key])
                for r in runs
                if isinstance(r.config.get(section), dict) and key in r.config[section]
            }
        )
        if values:
            parts.append(f"{section}.{key}={' / '.join(values)}")
    hardware = set()
    for run in runs:
        hardware.add(f"{run.hardware.get('device', '?')}: {run.processor}")
    parts.append(f"hardware={' / '.join(sorted(hardware))}")
    return f"Setup ({len(runs)} run directories): " + "; ".join(parts)


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(c, c) for c in text)


def _without_rows(table: Table) -> list[str] | None:
    """What a table with no rows says instead of a header over nothing: its notes (e.g. no baseline),
    else its caption (e.g. no static arm); None when the table has rows."""
    if len(table.display):
        return None
    return list(table.notes) or [table.caption]


def to_markdown(table: Table) -> str:
    if (instead := _without_rows(table)) is not None:
        return "\n".join(instead) + "\n"
    lines = markdown.table(table.display.columns, table.display.itertuples(index=False, name=None), table.align)
    if table.notes:
        lines += ["", *[f"Note: {note}" for note in table.notes]]
    return "\n".join(lines) + "\n"


def to_latex(table: Table) -> str:
    """A booktabs table environment, ready for \\input (a table with no rows: one sentence instead)."""
    if (instead := _without_rows(table)) is not None:
        return "\n".join(f"{latex_escape(line)}\\par" for line in instead) + "\n"
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        rf"\caption{{{latex_escape(table.caption)}}}",
        rf"\label{{tab:{table.name}}}",
        rf"\begin{{tabular}}{{{''.join(table.align)}}}",
        r"\toprule",
        " & ".join(map(latex_escape, table.display.columns)) + r" \\",
        r"\midrule",
    ]
    for row in table.display.itertuples(index=False, name=None):
        lines.append(" & ".join(latex_escape(str(c)) for c in row) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    lines += [rf"\par\smallskip{{\footnotesize Note: {latex_escape(note)}}}" for note in table.notes]
    return "\n".join([*lines, r"\end{table}"]) + "\n"


def combined_markdown(tables: list[Table], runs: list[Run]) -> str:
    parts = ["# Tables", "", setup_line(runs), ""]
    for table in tables:
        if _without_rows(table) == [table.caption]:  # the caption is the whole answer: once, not twice
            parts += [f"## {table.title}", "", to_markdown(table)]
        else:
            parts += [f"## {table.title}", "", table.caption, "", to_markdown(table)]
    return "\n".join(parts)
