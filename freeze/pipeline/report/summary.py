"""The study in one table a researcher pastes: one row per arm, every number with its interval named
in the column header (issue 48), read from the main and paired tables and the iso-accuracy readings
(nothing computed twice)."""

from __future__ import annotations

import math

import pandas as pd

from freeze.pipeline.report.frontier_tables import FrontierReading
from freeze.pipeline.report.paired import fmt_interval
from freeze.pipeline.report.tables import Column, GroupKey, Table, display_columns, fmt_number

CAPTION = (
    "One row per arm. Intervals are 95 % t intervals over the paired seeds, written [low, high]: accuracy over "
    "the arm's seeds; its difference from the baseline and its speedup paired by seed (a speedup is a geometric "
    "mean, its interval on the logs); the iso-accuracy speedup against the budget frontier per seed on that seed's "
    "frontier. 'verdict' is the paired table's non-inferiority verdict; 'beyond frontier' the iso-accuracy table's."
)


def summary_table(main: Table, paired: Table, readings: dict[GroupKey, FrontierReading]) -> Table:
    """One row per (setting, arm, workers) of ``main``, with its paired and iso-accuracy numbers."""
    paired_by_key = {_key(r): r for r in paired.data.to_dict("records")} if len(paired.data) else {}
    rows = []
    for row in main.data.to_dict("records") if len(main.data) else []:
        key = _key(row)
        pair = paired_by_key.get(key, {})
        iso = readings.get(key)
        rows.append(
            {
                "setting": row["setting"],
                "arm": row["group"],
                "workers": row["world_size"],
                "policy": row["policy"],
                "seeds": row["n_runs"],
                "test_acc_pct": 100 * row["test_acc_mean"],
                "test_acc_pct_low": 100 * (row["test_acc_mean"] - row["test_acc_ci95"]),
                "test_acc_pct_high": 100 * (row["test_acc_mean"] + row["test_acc_ci95"]),
                "diff_points": pair.get("diff_points", math.nan),
                "diff_points_low": pair.get("diff_low", math.nan),
                "diff_points_high": pair.get("diff_high", math.nan),
                "verdict": pair.get("verdict", ""),
                "speedup": pair.get("speedup", math.nan),
                "speedup_low": pair.get("speedup_low", math.nan),
                "speedup_high": pair.get("speedup_high", math.nan),
                "iso_speedup": math.nan if iso is None else iso.iso.speedup,
                "iso_speedup_low": math.nan if iso is None else iso.iso.ci_low,
                "iso_speedup_high": math.nan if iso is None else iso.iso.ci_high,
                "beyond_frontier": "" if iso is None else iso.verdict(),
                "frozen_fraction": row["frozen_fraction"],
            }
        )
    columns: list[Column] = [
        ("setting", "l", lambda r: r["setting"]),
        ("arm", "l", lambda r: r["arm"]),
        ("seeds", "r", lambda r: str(r["seeds"])),
        ("test acc % [95% CI]", "r", lambda r: _interval(r, "test_acc_pct", ".2f")),
        ("Δ points vs baseline [95% CI]", "r", lambda r: _interval(r, "diff_points", "+.2f")),
        ("verdict", "l", lambda r: r["verdict"]),
        ("speedup [95% CI]", "r", lambda r: _interval(r, "speedup", ".2f", "x")),
        ("iso-accuracy speedup [95% CI]", "r", lambda r: _interval(r, "iso_speedup", ".2f", "x")),
        ("beyond frontier", "l", lambda r: r["beyond_frontier"]),
        ("frozen share", "r", lambda r: fmt_number(r["frozen_fraction"], ".2f")),
    ]
    display, align = display_columns(rows, columns)
    return Table("summary", "Summary: one row per arm", CAPTION, pd.DataFrame(rows), display, align)


def _key(row: dict) -> GroupKey:
    return GroupKey(row["setting"], row["group"], row["world_size"])


def _interval(row: dict, name: str, spec: str, suffix: str = "") -> str:
    """The paired table's ``value [low, high]``; blank where the arm has no such number."""
    value = row[name]
    return fmt_interval(value, row[f"{name}_low"], row[f"{name}_high"], spec, suffix) if math.isfinite(value) else ""
