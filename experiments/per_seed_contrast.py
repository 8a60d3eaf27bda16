"""Paired contrasts and iso-accuracy speedups recomputed from a study's committed per-seed CSV
(report/per-seed/<study>.csv, written by the study's --update-report), without runs/.

    python -m experiments.per_seed_contrast report/per-seed/anneal.csv --setting loopback \\
        --contrast anneal-k9-t0.5=at-k9-t0.5 --contrast anneal-k9-t0.65=at-k9-t0.65 --frontier

For each ``A=B``: the paired difference in final test accuracy A - B over the seeds both ran (95 %
t interval) and how many paired seeds would decide its sign at the spread seen. With ``--frontier``:
every arm's iso-accuracy speedup against the budget frontier of that setting (budgets: policy none
with budget_fraction < 1, and the full-budget group ``--baseline``), by the report's own arithmetic
(freeze.pipeline.report.frontier), with its control check: the control group (``--control``, default
``control`` where the setting has one) must not read beyond the frontier, or every verdict reads
invalid, as in the report's table. Only the setting's own frontier is read: a setting without budgets
(the emulated cluster) borrows one in the report, which this does not. Prints markdown; exit 2 with
one line on bad input.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

from freeze.pipeline.report.frontier import (
    CONTROL_BELOW_REASONS,
    Point,
    control_check,
    invalid_verdict,
    iso_accuracy_speedup,
)
from freeze.pipeline.report.paired import seeds_to_decide
from freeze.pipeline.report.tables import mean_ci95

REQUIRED = ("setting", "group", "seed", "policy", "budget_fraction", "train_s", "test_acc")

CONTROL_LINES = {
    "": "No control group in this setting: the statistic's calibration is not checked.",
    "passed": "The control ({control}) does not read beyond the frontier: the check passed.",
    "failed": "CALIBRATION FAILED: the control ({control}) reads beyond the frontier it lies on; no verdict stands.",
    "warning": "WARNING: the control ({control}) reads below the frontier: " + CONTROL_BELOW_REASONS + ".",
}


def contrast_row(frame: pd.DataFrame, arm: str, other: str) -> dict:
    """A - B in test accuracy points, paired by seed."""
    a = frame[frame["group"] == arm].set_index("seed")["test_acc"]
    b = frame[frame["group"] == other].set_index("seed")["test_acc"]
    seeds = sorted(set(a.index) & set(b.index))
    diffs = [100 * (a[s] - b[s]) for s in seeds]
    mean, half = mean_ci95(diffs)
    needed = seeds_to_decide(diffs, 0.0)
    return {
        "contrast": f"{arm} - {other}",
        "seeds": len(seeds),
        "diff_points": mean,
        "low": mean - half,
        "high": mean + half,
        "per_seed": " ".join(f"{d:+.2f}" for d in diffs),
        "seeds_to_decide_sign": needed,
    }


def frontier_rows(frame: pd.DataFrame, baseline: str, control: str | None = None) -> tuple[list[dict], str]:
    """Every non-budget arm's iso-accuracy speedup against the frontier of the frame's budgets, and
    what the ``control`` group's reading says of them (report.frontier.control_check: "" without one)."""
    budgets = frame[(frame["policy"] == "none") & (frame["budget_fraction"] < 1.0)]
    full = frame[frame["group"] == baseline]
    frontier = {
        float(f): {int(r.seed): Point(r.train_s, 100 * r.test_acc) for r in rows.itertuples()}
        for f, rows in budgets.groupby("budget_fraction")
    }
    frontier[1.0] = {int(r.seed): Point(r.train_s, 100 * r.test_acc) for r in full.itertuples()}
    rows = []
    for group, members in frame[frame["budget_fraction"] >= 1.0].groupby("group", sort=True):
        if group == baseline:
            continue
        arm = {int(r.seed): Point(r.train_s, 100 * r.test_acc) for r in members.itertuples()}
        iso = iso_accuracy_speedup(frontier, arm)
        rows.append({"arm": group, "seeds": iso.seeds, "iso": iso.label(), "beyond the frontier": iso.verdict()})
    by_arm = {row["arm"]: row["beyond the frontier"] for row in rows}
    check = control_check(by_arm[control]) if control in by_arm else ""
    if check == "failed":
        setting = str(frame["setting"].iloc[0])
        for row in rows:
            row["beyond the frontier"] = invalid_verdict([f"{setting}/{control}"])
    return rows, check


def _markdown(rows: list[dict]) -> str:
    if not rows:
        return "(none)"
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for c in columns:
            value = row[c]
            if isinstance(value, float):
                value = "n/a" if not math.isfinite(value) else f"{value:+.2f}"
            cells.append("more than 1000" if c == "seeds_to_decide_sign" and value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.per_seed_contrast", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("csv", type=Path, help="a study's per-seed CSV (report/per-seed/<study>.csv)")
    parser.add_argument("--setting", default="", help="the setting to read (default: the only one)")
    parser.add_argument("--contrast", action="append", default=[], help="A=B: arm A minus arm B, paired by seed")
    parser.add_argument("--frontier", action="store_true", help="every arm's iso-accuracy speedup")
    parser.add_argument("--baseline", default="none", help="the full-budget group of the frontier")
    parser.add_argument(
        "--control", default="control", help="the group that runs the baseline again (the check; default: control)"
    )
    args = parser.parse_args(argv)
    try:
        frame = pd.read_csv(args.csv, keep_default_na=False, na_values=[""])
    except (OSError, pd.errors.ParserError, UnicodeDecodeError) as e:
        print(f"error: {args.csv} cannot be read ({e})", file=sys.stderr)
        return 2
    missing = [c for c in REQUIRED if c not in frame]
    if missing:
        print(
            f"error: {args.csv} lacks columns {', '.join(missing)}; accepted: a per_seed.csv of the report",
            file=sys.stderr,
        )
        return 2
    settings = sorted(set(frame["setting"].astype(str)))
    setting = args.setting or (settings[0] if len(settings) == 1 else None)
    if setting not in settings:
        print(f"error: --setting {args.setting!r}; accepted: one of {', '.join(settings)}", file=sys.stderr)
        return 2
    frame = frame[frame["setting"].astype(str) == setting]
    groups = set(frame["group"])
    rows = []
    for spec in args.contrast:
        arm, sep, other = spec.partition("=")
        if not sep or arm not in groups or other not in groups:
            print(
                f"error: --contrast {spec!r}; accepted: A=B with A and B among {', '.join(sorted(groups))}",
                file=sys.stderr,
            )
            return 2
        rows.append(contrast_row(frame, arm, other))
    if rows:
        print("Paired differences in final test accuracy (points, 95 % t interval over seeds):\n")
        print(_markdown(rows))
    if args.frontier:
        if args.baseline not in groups:
            print(f"error: --baseline {args.baseline!r} is not a group of {args.csv}", file=sys.stderr)
            return 2
        if args.control not in groups and args.control != "control":
            print(f"error: --control {args.control!r} is not a group of {args.csv}", file=sys.stderr)
            return 2
        found, check = frontier_rows(frame, args.baseline, args.control)
        print("\nIso-accuracy speedup against the budget frontier (the report's arithmetic):\n")
        print(_markdown(found))
        print("\n" + CONTROL_LINES[check].format(control=args.control))
    return 0


if __name__ == "__main__":
    sys.exit(main())
