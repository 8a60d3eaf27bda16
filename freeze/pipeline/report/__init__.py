"""Study report: run directories in, markdown / LaTeX / CSV tables and PNG figures out.

    python -m report runs/<study> [--out DIR] [--baseline GROUP] [--target-fraction 0.95] [--formats md,tex,csv,png]

Reads only run directories (manifest.json, config.toml, metrics.jsonl), never the training code.

The names below load on first use (PEP 562): the command line (freeze.pipeline.report.cli) starts
without pandas and matplotlib, so a Ctrl-C while they load is its one line, not a traceback.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "FORMATS": "freeze.pipeline.report.build",
    "build_report": "freeze.pipeline.report.build",
    "build_tables": "freeze.pipeline.report.build",
    "default_out_dir": "freeze.pipeline.report.build",
    "ON_DUPLICATE": "freeze.pipeline.report.tables",
    "Table": "freeze.pipeline.report.tables",
    "ReportInputError": "freeze.pipeline.report.load",
    "Run": "freeze.pipeline.report.load",
    "load_runs": "freeze.pipeline.report.load",
}

__all__ = [
    "FORMATS",
    "ON_DUPLICATE",
    "ReportInputError",
    "Run",
    "Table",
    "build_report",
    "build_tables",
    "default_out_dir",
    "load_runs",
]  # the names of _HOMES

if TYPE_CHECKING:
    from freeze.pipeline.report.build import FORMATS, build_report, build_tables, default_out_dir
    from freeze.pipeline.report.load import ReportInputError, Run, load_runs
    from freeze.pipeline.report.tables import ON_DUPLICATE, Table


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
