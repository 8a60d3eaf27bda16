"""BENCH.md as several commands write it: the main table first (experiments.bench.engine_report),
then spans (freeze.pipeline.markdown) that other commands splice in: the BERT rows, the cluster
benchmark, the cost model's validation. Each rewrite keeps what it does not own."""

from __future__ import annotations

from pathlib import Path

from freeze._atomic import atomic_write_text
from freeze.pipeline import markdown

TITLE = "# Freezing under DDP: where a step's time goes"  # also a new file's first line when a span creates it


def spliced_sections(path: Path) -> str:
    """Everything of ``path`` from its first span on ("" when none or no file): what the main
    table's rewrite keeps.

    Raises:
        markdown.MarkerError: a span's marker is missing or doubled.
    """
    if not path.exists():
        return ""
    old = path.read_text(encoding="utf-8")
    found = markdown.spans(old, path)
    return old[found[0][1] :] if found else ""


def splice_section(path: Path, name: str, body: str, *, before_others: bool) -> None:
    """Replace span ``name`` of ``path`` by ``body``; a file without it gets it before its first
    other span (``before_others``: right after the main table) or at its end. The rest stays as it was.

    Args:
        path: the markdown file (created with the main table's title when missing).
        name: the span (markers as freeze.pipeline.markdown writes them).
        body: the section's lines, without the markers.
        before_others: where a new span goes: before the other spans, else at the end.

    Raises:
        markdown.MarkerError: the span's start or end marker is missing or doubled.
    """
    old = path.read_text(encoding="utf-8") if path.exists() else TITLE + "\n"
    others = markdown.spans(old, path)
    if markdown.has(old, name, path):
        new = markdown.splice(old, name, body, path)
    elif before_others and others:
        new = old[: others[0][1]] + markdown.span(name, body) + "\n\n" + old[others[0][1] :]
    else:
        new = old.rstrip("\n") + "\n\n" + markdown.span(name, body) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, new)
