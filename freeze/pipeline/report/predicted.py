"""The cost model's predicted training time beside the measured one, per (setting, group, workers).

The predictions come from outside the report (the study's prediction stage,
freeze.pipeline.study.predict, which needs a profile of this machine and a fitted link); this module
only lays them beside the runs' measured time, with the same rules as every other table: complete
runs only, grouped by setting, group and world size, compared with the baseline group of the same
setting and world size. Measured and predicted means are taken over the same runs (those the stage
predicted), so a left-out run changes both sides alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from freeze.pipeline.report.load import Run
from freeze.pipeline.report.tables import (
    Column,
    Table,
    baseline_runs,
    complete_groups,
    display_columns,
    fmt_number,
    group_fields,
    resolve_baseline,
    train_wall_s,
)

CAPTION = (
    "The cost model's prediction of each group's training time beside the measured one ({n} complete runs "
    "predicted): means over the group's predicted runs; error = (predicted - measured) / measured per run, "
    "its mean and worst |error| over the group; speedups are the baseline group's mean time over this "
    "group's, measured and predicted."
)
WHAT_IS_TIMED = (
    "measured = the runs' training wall time as in the main table (the sum of every epoch's epoch_wall_s: "
    "data loading, forward, backward with DDP's all-reduces, optimizer step, and the freezer phase, which "
    "holds the policy's decisions, DDP re-wraps and activation-cache builds; evaluation excluded); "
    "predicted = freeze.pipeline.costmodel.predict_run over the run's boundary at the start of each epoch (forward, "
    "backward, all-reduces and their overlap, monitor and optimizer step, one single-bucket step after each "
    "boundary change); data loading, policy decisions, the re-wrap itself and cache builds are not modelled"
)


def _times(members: list[Run], predicted_s: Mapping[Path, float]) -> tuple[list[float], list[float]]:
    """(measured, predicted) seconds of the members the stage predicted."""
    chosen = [r for r in members if r.run_dir in predicted_s]
    return [train_wall_s(r) for r in chosen], [predicted_s[r.run_dir] for r in chosen]


def _speedup(base: tuple[list[float], list[float]], arm: tuple[list[float], list[float]], side: int) -> float:
    if not base[side] or not arm[side]:
        return math.nan
    return float(np.mean(base[side])) / float(np.mean(arm[side]))


def predicted_table(runs: list[Run], predicted_s: Mapping[Path, float], notes: Sequence[str] = ()) -> Table:
    """Measured vs predicted training seconds per group.

    Args:
        runs: every loaded run directory of the study.
        predicted_s: run directory -> predicted training seconds (runs left out are not keys).
        notes: what the stage assumed and left out, one line each (link, profiles, skipped runs).
    """
    groups = complete_groups(runs)
    baseline = resolve_baseline(runs, None)
    rows = []
    for key, members in groups.items():
        measured, predicted = _times(members, predicted_s)
        if not measured:
            continue
        errors = [(p - m) / m for m, p in zip(measured, predicted)]
        base = baseline_runs(groups, baseline, key)
        base_times = _times(base, predicted_s) if base else ([], [])
        rows.append(
            {
                **group_fields(members[0]),
                "n_runs": len(measured),
                "measured_s": float(np.mean(measured)),
                "predicted_s": float(np.mean(predicted)),
                "error_mean": float(np.mean(errors)),
                "error_worst_abs": max(abs(e) for e in errors),
                "measured_speedup": _speedup(base_times, (measured, predicted), 0),
                "predicted_speedup": _speedup(base_times, (measured, predicted), 1),
            }
        )
    columns: list[Column] = [("setting", "l", lambda r: r["setting"])] if any(r["setting"] for r in rows) else []
    columns += [
        ("group", "l", lambda r: r["group"]),
        ("workers", "r", lambda r: str(r["world_size"])),
        ("n", "r", lambda r: str(r["n_runs"])),
        ("measured train s (mean)", "r", lambda r: fmt_number(r["measured_s"], ".1f")),
        ("predicted s (mean)", "r", lambda r: fmt_number(r["predicted_s"], ".1f")),
        ("error % (mean)", "r", lambda r: fmt_number(100 * r["error_mean"], "+.1f")),
        ("worst abs error %", "r", lambda r: fmt_number(100 * r["error_worst_abs"], ".1f")),
        ("measured speedup", "r", lambda r: fmt_number(r["measured_speedup"], ".2f", "x")),
        ("predicted speedup", "r", lambda r: fmt_number(r["predicted_speedup"], ".2f", "x")),
    ]
    display, align = display_columns(rows, columns)
    frame_columns = [
        "setting",
        "group",
        "world_size",
        "policy",
        "n_runs",
        "measured_s",
        "predicted_s",
        "error_mean",
        "error_worst_abs",
        "measured_speedup",
        "predicted_speedup",
    ]
    caption = CAPTION.format(n=sum(r["n_runs"] for r in rows))
    all_notes = (WHAT_IS_TIMED, baseline.note, *notes) if rows else (*notes, "no run was predicted")
    return Table(
        "predicted",
        "Predicted vs measured training time",
        caption,
        pd.DataFrame(rows, columns=frame_columns),
        display,
        align,
        tuple(all_notes),
    )
