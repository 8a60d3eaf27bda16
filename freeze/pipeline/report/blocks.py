"""When, on what and under what load each seed block of a study ran (issue 24: a study run in parts
across sittings says so beside its results).

A study runs one interleaved block per seed; a long one runs its blocks in parts, on different
days, beside other work. This table reads each run's manifest (start and end time, the 1-minute
load average at its start and end, the machine) and gives one row per seed: the span of the block,
its runs, the load range, and the hardware - so a reader can see which blocks ran quiet and which
shared the machine, and that a block's runs kept together (the pairing assumes it).
"""

from __future__ import annotations

import math
from datetime import datetime

import pandas as pd

from freeze.pipeline.report.load import Run
from freeze.pipeline.report.tables import NA, Column, Table, display_columns, fmt_number


def _when(text: object) -> datetime | None:
    try:
        return datetime.fromisoformat(str(text))
    except ValueError:
        return None


def _loads(run: Run) -> list[float]:
    values = [run.manifest.get("load_avg_1min_start"), run.manifest.get("load_avg_1min_end")]
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _machine(run: Run) -> str:
    cores = run.hardware.get("cores")  # not in a per-seed row
    return f"{run.processor}, {cores} cores" if cores is not None else run.processor


def blocks_table(runs: list[Run]) -> Table:
    """One row per seed: first start and last end (UTC), runs, minutes, load average range, machine."""
    rows = []
    for seed in sorted({r.seed for r in runs}):
        members = [r for r in runs if r.seed == seed]
        starts = [t for t in (_when(r.manifest.get("start_time")) for r in members) if t is not None]
        ends = [t for t in (_when(r.manifest.get("end_time")) for r in members) if t is not None]
        loads = [v for r in members for v in _loads(r)]
        rows.append(
            {
                "seed": seed,
                "runs": len(members),
                "complete": sum(r.is_complete for r in members),
                "first_start": min(starts).isoformat() if starts else "",
                "last_end": max(ends).isoformat() if ends else "",
                "span_min": (max(ends) - min(starts)).total_seconds() / 60 if starts and ends else math.nan,
                "load_min": min(loads) if loads else math.nan,
                "load_max": max(loads) if loads else math.nan,
                "machine": " / ".join(sorted({_machine(r) for r in members})),
            }
        )
    columns: list[Column] = [
        ("seed block", "r", lambda r: str(r["seed"])),
        ("runs (complete)", "r", lambda r: f"{r['runs']} ({r['complete']})"),
        ("first start (UTC)", "l", lambda r: r["first_start"][:16].replace("T", " ") or NA),
        ("last end (UTC)", "l", lambda r: r["last_end"][:16].replace("T", " ") or NA),
        ("span (min)", "r", lambda r: fmt_number(r["span_min"], ".0f")),
        (
            "1-min load, start/end of runs",
            "r",
            lambda r: f"{r['load_min']:.1f}-{r['load_max']:.1f}" if math.isfinite(r["load_min"]) else NA,
        ),
        ("machine", "l", lambda r: r["machine"]),
    ]
    display, align = display_columns(rows, columns)
    caption = (
        f"When each seed block ran ({len(runs)} runs): the first run's start and the last run's end, "
        "the block's span, and the range of the machine's 1-minute load average at the runs' starts and ends "
        "(the study's own two workers account for about 2 on this machine; more is other work)."
    )
    undated = sum(r.from_rows and not r.manifest.get("start_time") for r in runs)
    if undated:
        caption += (
            f" {undated} runs read back from per-seed rows that record no times: n/a where a block has only those."
        )
    return Table("blocks", "When and under what load each block ran", caption, pd.DataFrame(rows), display, align)
