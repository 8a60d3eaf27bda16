"""The same arms at two horizons (issue 37): does what freezing costs shrink when the run is longer?

For every group (setting, arm, world size) that both studies ran, with the same policy, beside their own baseline, the
paired numbers of each study (freeze.pipeline.report.paired: accuracy difference and speedup against
its own full fine-tuning, same seeds), where the arm froze (the first boundary change as a fraction
of its run), and the change of the accuracy difference from the shorter study to the longer one.
The two studies train on different data (the longer one on more images), so that change is not
paired: its interval is the normal approximation sqrt(h_short^2 + h_long^2) from the two paired
half-widths, said in the caption.
"""

from __future__ import annotations

import math

import numpy as np

from freeze.pipeline.report.decisions import first_freeze_fractions
from freeze.pipeline.report.load import Run
from freeze.pipeline.report.paired import fmt_interval, paired_row
from freeze.pipeline.report.tables import (
    NA,
    Column,
    GroupKey,
    Table,
    baseline_runs,
    complete_groups,
    csv_frame,
    display_columns,
    resolve_baseline,
)

HORIZONS_CAPTION = (
    "The same arms at two horizons, each against its own study's full fine-tuning on the same seeds (paired t, "
    "95 %): steps per run, where the arm first froze (run fraction, mean over seeds), accuracy difference in "
    "points and speedup. Change: the long horizon's accuracy difference minus the short one's; the studies use "
    "different training images, so it is unpaired, its interval the normal approximation from the two paired "
    "half-widths."
)


def _first_freeze_fraction(members: list[Run]) -> float:
    fractions = first_freeze_fractions(members)
    return float(np.mean(fractions)) if fractions else math.nan


def _side(members: list[Run], base: list[Run], target_fraction: float, margin_points: float) -> dict:
    paired = paired_row(members, base, target_fraction, margin_points)
    return {
        "steps": float(np.mean([r.final_step for r in members])),
        "first_freeze": _first_freeze_fraction(members),
        **{
            k: paired[k]
            for k in ("n_pairs", "diff_points", "diff_low", "diff_high", "speedup", "speedup_low", "speedup_high")
        },
    }


def horizons_row(short: dict, long: dict, key: GroupKey, policy: str) -> dict:
    """One group's row from its two sides (:func:`_side`)."""
    change = long["diff_points"] - short["diff_points"]
    half = math.hypot(short["diff_high"] - short["diff_points"], long["diff_high"] - long["diff_points"])
    return {
        "setting": key.setting,
        "group": key.group,
        "world_size": key.world_size,
        "policy": policy,
        **{f"short_{k}": v for k, v in short.items()},
        **{f"long_{k}": v for k, v in long.items()},
        "change_points": change,
        "change_low": change - half,
        "change_high": change + half,
    }


def _side_columns(prefix: str, label: str) -> list[Column]:
    def freeze_at(r: dict) -> str:
        value = r[f"{prefix}_first_freeze"]
        return NA if not math.isfinite(value) else f"{value:.2f}"

    return [
        (f"{label} steps", "r", lambda r: f"{r[f'{prefix}_steps']:.0f}"),
        (f"{label} pairs", "r", lambda r: str(r[f"{prefix}_n_pairs"])),
        (f"{label} froze at", "r", freeze_at),
        (
            f"{label} acc diff [95% CI]",
            "r",
            lambda r: fmt_interval(
                r[f"{prefix}_diff_points"], r[f"{prefix}_diff_low"], r[f"{prefix}_diff_high"], "+.2f"
            ),
        ),
        (
            f"{label} speedup [95% CI]",
            "r",
            lambda r: fmt_interval(
                r[f"{prefix}_speedup"], r[f"{prefix}_speedup_low"], r[f"{prefix}_speedup_high"], ".2f", "x"
            ),
        ),
    ]


def horizons_table(
    short_runs: list[Run],
    long_runs: list[Run],
    short_name: str,
    long_name: str,
    target_fraction: float,
    margin_points: float,
) -> Table:
    """Every group both studies ran with a baseline beside it (module docstring), sorted by setting
    and group; ``short_name``/``long_name`` label the two sides (e.g. "1x", "4x")."""
    sides = []
    for runs in (short_runs, long_runs):
        groups = complete_groups(runs)
        baseline = resolve_baseline(runs, None)
        sides.append({key: (members, baseline_runs(groups, baseline, key)) for key, members in groups.items()})
    short, long = sides
    rows, unmatched = [], []
    for key in sorted(set(short) & set(long)):
        (s_members, s_base), (l_members, l_base) = short[key], long[key]
        if not s_base or not l_base or s_members[0].group == s_base[0].group:
            continue
        if s_members[0].policy != l_members[0].policy:  # the same name, another arm: not comparable
            unmatched.append(f"{key.setting}/{key.group} ({s_members[0].policy} against {l_members[0].policy})")
            continue
        row = horizons_row(
            _side(s_members, s_base, target_fraction, margin_points),
            _side(l_members, l_base, target_fraction, margin_points),
            key,
            l_members[0].policy,
        )
        rows.append(row)
    columns = [
        ("setting", "l", lambda r: r["setting"]),
        ("group", "l", lambda r: r["group"]),
        *_side_columns("short", short_name),
        *_side_columns("long", long_name),
        (
            f"change {long_name} - {short_name}, points [95% CI]",
            "r",
            lambda r: fmt_interval(r["change_points"], r["change_low"], r["change_high"], "+.2f"),
        ),
    ]
    display, align = display_columns(rows, columns)
    caption = HORIZONS_CAPTION if rows else f"no group ran beside its baseline in both {short_name} and {long_name}"
    notes = (f"Not compared (the same group name with another policy): {', '.join(unmatched)}",) if unmatched else ()
    return Table(
        "horizons", f"The same arms at {short_name} and {long_name}", caption, csv_frame(rows), display, align, notes
    )
