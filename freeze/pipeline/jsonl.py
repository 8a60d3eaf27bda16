"""The one reader of metrics.jsonl, shared by the run directory (resume) and the report.

The file only grows: one JSON object per line, each appended and fsynced whole, so the newline is
what marks a record as complete. A crash mid-append leaves a torn last line (no newline; or, after a
power loss, zero-filled blocks) that both readers drop, the same way; any other bad line is an error.
Imports only json, so the report can use it without the training code.
"""

from __future__ import annotations

import json
from typing import Any


class JsonLinesError(ValueError):
    """A line that is not a JSON object; ``line`` is 1-based."""

    def __init__(self, line: int, reason: str):
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason = line, reason


def _decode(raw: bytes, line: int) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise JsonLinesError(line, f"not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise JsonLinesError(line, f"not valid JSON ({err.msg} at column {err.colno})") from None


def read_json_lines(data: bytes) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """(line number, record) for every complete record of ``data``, and the byte length of the
    prefix that holds them (a torn tail ends there). Blank lines are skipped.

    Raises:
        JsonLinesError: a line other than a torn last one is not a JSON object.
    """
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # the text after the final newline is never a complete record
    records: list[tuple[int, dict[str, Any]]] = []
    valid_bytes = 0
    for number, raw in enumerate(complete, start=1):
        if raw.strip():
            try:
                record = _decode(raw, number)
            except JsonLinesError:
                if number == len(complete) and not tail.strip(b"\0 \t\r"):
                    break  # torn final line, e.g. zero-filled blocks after a crash
                raise
            if not isinstance(record, dict):
                raise JsonLinesError(number, "not a JSON object")
            records.append((number, record))
        valid_bytes += len(raw) + 1
    return records, valid_bytes
