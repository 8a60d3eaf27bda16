"""Markdown written by code: the one owner of a table's syntax and of the markers around a span of a
hand-written file that a command regenerates (a study page's tables, BENCH.md's sections, the family
table of docs/blocks.md) or that a command reads (the README's example). Imports nothing heavy.

A span is the lines between two marker lines, each a line of its own::

    <!-- NAME:start -->
    ...
    <!-- NAME:end -->

A file holds each span once: a span whose start or end marker is missing, doubled, or out of order
is a :class:`MarkerError` naming the file and the marker, never a silent append or a half replace.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from os import PathLike

# Column alignment -> the cell of the separator row under the header.
ALIGN = {"l": "---", "r": "---:", "c": ":---:"}
_MARKER_LINE = re.compile(r"^<!-- ([\w-]+):(?:start|end) -->$", re.M)


def cell(value: object) -> str:
    """``value`` as one table cell: ``|`` escaped, a newline turned into a space."""
    return str(value).replace("|", r"\|").replace("\n", " ")


def row(cells: Iterable[object]) -> str:
    """One table line: ``| a | b |``, every cell through :func:`cell`."""
    return "| " + " | ".join(map(cell, cells)) + " |"


def table(header: Sequence[object], rows: Iterable[Sequence[object]], align: str | Sequence[str] = "") -> list[str]:
    """The lines of a GitHub markdown table (no trailing newline; join them with ``"\\n"``).

    Args:
        header: the column names.
        rows: one sequence of cells per row, as many as ``header`` has (``str()`` of each is shown).
        align: one of ``l`` (left), ``r`` (right), ``c`` (centre) per column, e.g. ``"llrr"``; empty
            means every column left.

    Raises:
        ValueError: ``align`` or a row does not have one entry per column, or an unknown alignment.
    """
    header = list(header)
    align = align or "l" * len(header)
    if len(align) != len(header) or not set(align) <= set(ALIGN):
        raise ValueError(f"markdown.table: align {align!r} needs one of l/r/c per column ({len(header)} columns)")
    lines = [row(header), "|" + "|".join(ALIGN[a] for a in align) + "|"]
    for i, cells in enumerate(rows):
        cells = list(cells)
        if len(cells) != len(header):
            raise ValueError(f"markdown.table: row {i} has {len(cells)} cells for {len(header)} columns")
        lines.append(row(cells))
    return lines


class MarkerError(ValueError):
    """A span's markers are missing, doubled or out of order (one line: the file and the marker)."""


def markers(name: str) -> tuple[str, str]:
    """The start and end marker lines of span ``name``."""
    if not re.fullmatch(r"[\w-]+", name):
        raise ValueError(f"markdown: span name {name!r} must be letters, digits, '_' or '-'")
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def span(name: str, body: str) -> str:
    """The span ``name`` holding ``body``, markers included (no trailing newline)."""
    start, end = markers(name)
    return f"{start}\n{body}\n{end}"


def spans(text: str, where: str | PathLike = "<text>") -> list[tuple[str, int]]:
    """(name, offset of its start marker) of every span in ``text``, in order.

    Raises:
        MarkerError: a marker line without its partner, doubled, or an end before its start.
    """
    names = dict.fromkeys(m.group(1) for m in _MARKER_LINE.finditer(text))
    found = [(name, _locate(text, name, where)[0]) for name in names]
    return sorted(found, key=lambda item: item[1])


def _locate(text: str, name: str, where: str | PathLike) -> tuple[int, int] | None:
    """(offset of the start marker, offset just past the end marker); None when neither is there."""
    start, end = markers(name)
    found = [[m.start() for m in re.finditer(rf"^{re.escape(marker)}$", text, re.M)] for marker in (start, end)]
    if not found[0] and not found[1]:
        return None
    for marker, offsets in zip((start, end), found):
        if len(offsets) != 1:
            raise MarkerError(f"{where}: {marker} is on {len(offsets)} lines, expected on exactly one")
    if found[1][0] < found[0][0]:
        raise MarkerError(f"{where}: {end} comes before {start}")
    return found[0][0], found[1][0] + len(end)


def has(text: str, name: str, where: str | PathLike = "<text>") -> bool:
    """Whether ``text`` holds span ``name`` (False when neither marker is there).

    Raises:
        MarkerError: one marker without the other, a marker twice, or the end before the start.
    """
    return _locate(text, name, where) is not None


def _required(text: str, name: str, where: str | PathLike) -> tuple[int, int]:
    """:func:`_locate`, and a MarkerError when neither marker is there either."""
    found = _locate(text, name, where)
    if found is None:
        raise MarkerError(f"{where}: no {markers(name)[0]} line")
    return found


def read(text: str, name: str, where: str | PathLike = "<text>") -> str:
    """The lines between span ``name``'s markers (no leading or trailing newline); ``where`` names
    the file in the :class:`MarkerError` raised when the span is missing, doubled or out of order."""
    first, last = _required(text, name, where)
    start, end = markers(name)
    inner = text[first + len(start) : last - len(end)]
    return "" if inner == "\n" else inner.removeprefix("\n").removesuffix("\n")


def splice(text: str, name: str, body: str, where: str | PathLike = "<text>") -> str:
    """``text`` with the lines between span ``name``'s markers replaced by ``body`` (no leading or
    trailing newline); a :class:`MarkerError` naming ``where`` as :func:`read` raises it."""
    first, last = _required(text, name, where)
    return text[:first] + span(name, body) + text[last:]
