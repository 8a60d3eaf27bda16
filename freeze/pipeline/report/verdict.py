"""What a study's tables mean, in a few plain sentences a reader can act on.

The tables give every interval; a newcomer reading "autofreeze 0.94x [0.56, 1.57], flat: NO" had
to work out alone that the quick study is too short and too noisy to show a speedup. These lines say
it: whether the speedup interval excludes 1.0, what the accuracy difference allows, whether the
control's timing can be trusted, how much each arm froze, and whether the baseline was still
improving. They are read from the report's own CSV files (paired.csv, main.csv, convergence.csv), so
they never disagree with the tables.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from freeze.pipeline.report.frontier import BELOW_FRONTIER, BEYOND_MARGIN, CONTROL_BELOW_REASONS, INVALID_PREFIX


def _label(row: pd.Series) -> str:
    setting = row.get("setting")
    return f"{setting}/{row['group']}" if isinstance(setting, str) and setting else str(row["group"])


def _interval(value: float, low: float, high: float, suffix: str = "", spec: str = ".2f") -> str:
    if math.isfinite(low) and math.isfinite(high):
        return f"{value:{spec}}{suffix} (95% CI [{low:{spec}}, {high:{spec}}])"
    return f"{value:{spec}}{suffix} (one pair of runs: no interval)"


def _speed_sentence(row: pd.Series) -> str:
    s, low, high = float(row["speedup"]), float(row["speedup_low"]), float(row["speedup_high"])
    shown = _interval(s, low, high, "x")
    if not math.isfinite(s):
        return f"{_label(row)}: no speedup could be computed (no seed shared with the baseline)."
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"{_label(row)}: {shown}; run more seeds before reading anything into it."
    if low <= 1.0 <= high:
        return f"{_label(row)}: no measurable speedup over the whole run, {shown} includes 1.0{_ttt_clause(row)}."
    if low > 1.0:
        return f"{_label(row)}: trained faster than the baseline, {shown}."
    return f"{_label(row)}: trained slower than the baseline, {shown}."


def _ttt_clause(row: pd.Series) -> str:
    """Where the run's speedup says nothing, a time to target whose interval excludes 1.0 says something
    (issue 48: "no measurable speedup" sat beside a time-to-target interval above 1.0, unremarked)."""
    ttt, low, high = (float(row.get(k, math.nan)) for k in ("ttt_speedup", "ttt_speedup_low", "ttt_speedup_high"))
    if not (math.isfinite(low) and math.isfinite(high)) or low <= 1.0 <= high:
        return ""
    which = "sooner" if low > 1.0 else "later"
    return f"; it reached the target accuracy {which}, time to target {_interval(ttt, low, high, 'x')}"


def _accuracy_sentence(row: pd.Series, margin_points: float) -> str:
    diff = _interval(float(row["diff_points"]), float(row["diff_low"]), float(row["diff_high"]), " points", "+.2f")
    meaning = {
        "non-inferior": f"it loses no more than {margin_points:g} points",
        "inferior": f"it loses more than {margin_points:g} points",
        "undecided": f"too uncertain to tell whether it loses more than {margin_points:g} points",
        "not shown": f"too uncertain to tell whether it loses more than {margin_points:g} points",  # older csv
    }.get(str(row["verdict"]), "no interval, so nothing can be said about a loss")
    return f"Its test accuracy differs by {diff}: {meaning}."


def _flag(row: pd.Series, column: str) -> bool:
    """A boolean column of paired.csv; False in a csv written before the column existed."""
    value = row.get(column, False)
    return value is True or str(value) == "True"


def _no_finding_sentence(row: pd.Series) -> str | None:
    """Why an arm's row holds no finding (at chance, or it froze nothing), or None when it may hold one.
    Said instead of the speed and accuracy sentences: "non-inferior" with a zero-width interval from an
    arm that froze nothing read as a result (issue 32)."""
    at_chance = [
        who for who, column in (("it", "arm_at_chance"), ("its baseline", "base_at_chance")) if _flag(row, column)
    ]
    if at_chance:
        return (
            f"{_label(row)}: no finding: {' and '.join(at_chance)} scored at chance level (test accuracy within "
            "noise of 1 / number of classes), so nothing was learned to compare; train longer or on learnable "
            'data (docs/experiments.md, "Your own ablation").'
        )
    if _flag(row, "froze_nothing"):
        return (
            f"{_label(row)}: no finding: it froze nothing (frozen fraction 0 at every step of every run), so it "
            "computed what the baseline computed; its speedup and accuracy say nothing about its policy."
        )
    return None


def _is_budget(row: pd.Series) -> bool:
    """A point of the budget frontier: policy none on a fraction of the steps (paired.csv's
    budget_fraction; absent in a csv written before budgets existed)."""
    fraction = row.get("budget_fraction", 1.0)
    return str(row.get("policy")) == "none" and isinstance(fraction, float) and fraction < 1.0


def _budget_sentence(row: pd.Series) -> str:
    speed = _interval(float(row["speedup"]), float(row["speedup_low"]), float(row["speedup_high"]), "x")
    diff = _interval(float(row["diff_points"]), float(row["diff_low"]), float(row["diff_high"]), " points", "+.2f")
    return (
        f"{_label(row)}: full fine-tuning on {float(row['budget_fraction']):g} of the steps (a point of the budget "
        f"frontier, what a user could do instead of freezing) trained {speed} as fast at {diff}."
    )


def _frontier_sentence(row: pd.Series) -> str:
    """The arm against training fewer steps, when the report had a frontier to read it on."""
    value = row.get("iso_speedup", math.nan)
    if not isinstance(value, float) or not math.isfinite(value):
        return ""
    iso = _interval(value, float(row["iso_speedup_low"]), float(row["iso_speedup_high"]), "x")
    verdict = str(row.get("iso_verdict", ""))
    meaning = {
        "yes": f"beyond the budget frontier by at least {BEYOND_MARGIN:.2f}x: it beats training fewer steps",
        BELOW_FRONTIER: "not beyond the budget frontier: training fewer steps does as well or better",
        f"no (not by {BEYOND_MARGIN:.2f}x)": (
            f"not beyond the budget frontier by {BEYOND_MARGIN:.2f}x: at best it matches training fewer steps "
            "within timing noise"
        ),
        "undecided": "too uncertain to tell whether it beats training fewer steps",
    }.get(verdict, f"against the budget frontier: {verdict}")
    if verdict.startswith("undecided ("):  # the reason in parentheses: too few seeds, or a capped interval
        meaning = f"too uncertain to tell whether it beats training fewer steps ({verdict.split('(', 1)[1]}"
    if verdict.startswith(INVALID_PREFIX):  # a control read beyond the frontier: no verdict of the report stands
        meaning = (
            f"no verdict against the budget frontier stands ({verdict.removeprefix(INVALID_PREFIX)} the frontier it "
            "lies on: the timing drifted more than the intervals say)"
        )
    return f" Its iso-accuracy speedup is {iso}: {meaning}."


def _key(row: pd.Series) -> tuple[str, str, str]:
    setting = row.get("setting")
    return (setting if isinstance(setting, str) else "", str(row["group"]), str(row.get("world_size", "")))


def _frozen_sentence(fraction: float) -> str:
    """How much the arm froze: an arm that froze almost nothing had nothing to skip (the quick study's
    autofreeze froze the stem, 0.02 % of ResNet-18's weights, and only in two seeds)."""
    if not math.isfinite(fraction):
        return ""
    shown = f"It froze {100 * fraction:.2g} % of the parameters (mean over epochs)"
    return f" {shown}: almost nothing to skip." if fraction < 0.01 else f" {shown}."


def _control_sentence(row: pd.Series) -> str:
    return _control_timing_sentence(row) + _control_frontier_sentence(row)


def _control_frontier_sentence(row: pd.Series) -> str:
    """What the control's own iso-accuracy reading says of the report's frontier verdicts."""
    verdict = str(row.get("iso_verdict", ""))
    if verdict.startswith(INVALID_PREFIX):
        return (
            f" No verdict against the budget frontier in this report stands: {verdict.removeprefix(INVALID_PREFIX)} "
            "the frontier it lies on, that statistic's false positive."
        )
    if verdict == BELOW_FRONTIER:
        return f" Against the budget frontier it lies on it reads below: {CONTROL_BELOW_REASONS}."
    return ""


def _control_timing_sentence(row: pd.Series) -> str:
    s, low, high = float(row["speedup"]), float(row["speedup_low"]), float(row["speedup_high"])
    if not (math.isfinite(low) and math.isfinite(high)):  # one pair: no interval to hold 1.00x or not
        return (
            f"The control {_label(row)} (the baseline run again) reads {_interval(s, low, high, 'x')}: without an "
            "interval the timing's drift cannot be judged; run more seeds before reading a speedup here."
        )
    holds = low <= 1.0 <= high
    if holds:
        return (
            f"The control {_label(row)} (the baseline run again) reads {_interval(s, low, high, 'x')}: timing is sound."
        )
    return (
        f"The control {_label(row)} (the baseline run again) reads {_interval(s, low, high, 'x')}, not 1.00x: the "
        "machine's timing drifted more than the intervals allow, so no speedup here can be trusted."
    )


def _convergence_sentence(row: pd.Series, margin_points: float) -> str:
    change = float(row["val_change_points"])
    # "state" since 2026-11-28 (decided by the interval); older convergence.csv files have "flat" only
    state = str(row["state"]) if "state" in row else ("converged" if bool(row["flat"]) else "still improving")
    moved = f"{change:+.2f} points of validation accuracy over the last fifth of training"
    if state == "converged":
        return f"The baseline {_label(row)} had converged ({moved}, within {margin_points:g})."
    if state == "no validation data":
        return f"The baseline {_label(row)} has no validation accuracy (data.val_size = 0): convergence not assessed."
    if state == "falling":
        return f"The baseline {_label(row)} was losing accuracy ({moved}): check its learning rate and schedule."
    if state == "undecided":
        return f"Whether the baseline {_label(row)} had converged is undecided ({moved}; more seeds would tell)."
    return (
        f"The baseline {_label(row)} was still improving ({moved}): these runs are too short to show a speedup at "
        "equal accuracy."
    )


def verdict_lines(report_dir: str | Path, margin_points: float) -> list[str]:
    """Plain sentences from ``report_dir``'s paired.csv and convergence.csv (empty without them).

    Args:
        report_dir: a report folder written with the csv format.
        margin_points: the non-inferiority margin the paired table used.
    """
    report = Path(report_dir)
    lines: list[str] = []
    paired_csv, convergence_csv = report / "paired.csv", report / "convergence.csv"
    main_csv = report / "main.csv"
    frozen: dict[tuple[str, str, str], float] = {}
    if main_csv.exists() and main_csv.stat().st_size > 1:
        main = pd.read_csv(main_csv, keep_default_na=False, na_values=[""])
        if "frozen_fraction" in main:
            frozen = {_key(row): float(row["frozen_fraction"]) for _, row in main.iterrows()}
    if paired_csv.exists() and paired_csv.stat().st_size > 1:
        paired = pd.read_csv(paired_csv, keep_default_na=False, na_values=[""])
        for _, row in paired.iterrows():
            if bool(row["control"]):
                lines.append(_control_sentence(row))
            elif _is_budget(row):
                lines.append(_budget_sentence(row))
            elif (no_finding := _no_finding_sentence(row)) is not None:
                lines.append(no_finding)
            else:
                lines.append(
                    f"{_speed_sentence(row)} {_accuracy_sentence(row, margin_points)}"
                    + _frozen_sentence(frozen.get(_key(row), math.nan))
                    + _frontier_sentence(row)
                )
    if convergence_csv.exists() and convergence_csv.stat().st_size > 1:
        convergence = pd.read_csv(convergence_csv, keep_default_na=False, na_values=[""])
        lines += [_convergence_sentence(row, margin_points) for _, row in convergence.iterrows()]
    return lines
