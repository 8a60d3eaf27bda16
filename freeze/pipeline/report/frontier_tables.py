"""The report's budget-frontier tables (issue 35): the frontier itself, and every arm's
iso-accuracy speedup against it (freeze.pipeline.report.frontier holds the arithmetic).

A budget run is a complete policy-none run with ``train.budget_fraction`` below 1; the baseline group
is the frontier's full budget. A setting without budget runs of its own (the emulated cluster, where
accuracy is the same as on loopback and only the time differs) borrows the frontier of the first
setting that has one: each budget run's accuracy, at its own fraction of the steps times that
setting's baseline time, seed by seed. That holds when train time is proportional to steps, which
the frontier table shows for the setting that ran the budgets (time fraction beside step fraction).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from freeze.pipeline.report.frontier import IsoSpeedup, Point, iso_accuracy_speedup
from freeze.pipeline.report.load import Run
from freeze.pipeline.report.tables import (
    Baseline,
    Column,
    GroupKey,
    Table,
    complete_groups,
    csv_frame,
    display_columns,
    final_test_acc,
    fmt_number,
    mean_ci95,
    ratio_ci95,
    train_wall_s,
)

NO_FRONTIER = (
    "no budget runs (train.budget_fraction < 1, policy none): no frontier; a study's [frontier] table adds them"
)


def _final_step(run: Run) -> float:
    return float(run.metrics["step"].iloc[-1])


def _is_budget(members: list[Run]) -> bool:
    return members[0].policy == "none" and members[0].budget_fraction < 1.0


def _point(run: Run) -> Point:
    return Point(train_wall_s(run), 100 * final_test_acc(run))


def _frontier_runs(
    groups: dict[GroupKey, list[Run]], baseline: Baseline, setting: str, world_size: int
) -> dict[float, dict[int, Run]] | None:
    """fraction -> seed -> run of the budgets and the baseline in one setting (None without budgets)."""
    budgets = {
        m[0].budget_fraction: {r.seed: r for r in m}
        for (s, _, w), m in groups.items()
        if s == setting and w == world_size and _is_budget(m)
    }
    base = groups.get((setting, baseline.group, world_size))
    if not budgets or not base:
        return None
    return {**budgets, 1.0: {r.seed: r for r in base}}


def _time_per_step_ratio(runs: list[Run], base: dict[int, Run]) -> tuple[float, float, float]:
    """(time fraction) / (step fraction) of full fine-tuning, geometric mean over seeds with its 95 %
    interval: 1.00 when training time is proportional to steps."""
    paired = [r for r in runs if r.seed in base]
    return ratio_ci95(
        [(train_wall_s(r) / train_wall_s(base[r.seed])) / (_final_step(r) / _final_step(base[r.seed])) for r in paired]
    )


def _proportional(frontier: dict[float, dict[int, Run]]) -> bool:
    """Every budget's time per step is full fine-tuning's within its interval (one seed: no evidence)."""
    full = frontier[1.0]
    for fraction, by_seed in frontier.items():
        if fraction == 1.0:
            continue
        _, low, high = _time_per_step_ratio(list(by_seed.values()), full)
        if not (low <= 1.0 <= high):  # NaN bounds (one seed) compare False: not shown
            return False
    return True


def _frontier_points(
    groups: dict[GroupKey, list[Run]], baseline: Baseline, key: GroupKey
) -> tuple[dict[float, dict[int, Point]], str] | None:
    """The frontier an arm in ``key``'s setting is read against, and the setting it was measured in."""
    own = _frontier_runs(groups, baseline, key[0], key[2])
    if own is not None:
        return {f: {s: _point(r) for s, r in by_seed.items()} for f, by_seed in own.items()}, key[0]
    base = {r.seed: r for r in groups.get((key[0], baseline.group, key[2]), [])}
    for setting in sorted({k[0] for k in groups}):
        borrowed = _frontier_runs(groups, baseline, setting, key[2])
        if borrowed is None or not base:
            continue
        if not _proportional(borrowed):
            # Its times cannot be carried over as step fractions: no frontier here, rather than a
            # wrong one (the frontier table shows where time per step is not constant).
            return None
        full = borrowed[1.0]
        points = {
            f: {
                s: Point(train_wall_s(base[s]) * _final_step(r) / _final_step(full[s]), 100 * final_test_acc(r))
                for s, r in by_seed.items()
                if s in base and s in full
            }
            for f, by_seed in borrowed.items()
        }
        return points, setting
    return None


def frontier_table(runs: list[Run], baseline: Baseline) -> Table:
    """The frontier per setting: each budget's step and time fractions of full fine-tuning, paired by
    seed, and its final test accuracy."""
    groups = complete_groups(runs)
    rows = []
    if baseline.group is not None:
        for key, members in groups.items():
            base = {r.seed: r for r in groups.get((key[0], baseline.group, key[2]), [])}
            if not (_is_budget(members) or key[1] == baseline.group) or not base:
                continue
            paired = [r for r in members if r.seed in base]
            time_fraction, low, high = ratio_ci95([train_wall_s(r) / train_wall_s(base[r.seed]) for r in paired])
            per_step, per_step_low, per_step_high = _time_per_step_ratio(members, base)
            acc, half = mean_ci95([final_test_acc(r) for r in members])
            rows.append(
                {
                    "setting": key[0],
                    "group": key[1],
                    "budget_fraction": members[0].budget_fraction,
                    "n_runs": len(members),
                    "step_fraction": float(np.mean([_final_step(r) / _final_step(base[r.seed]) for r in paired])),
                    "time_fraction": time_fraction,
                    "time_fraction_low": low,
                    "time_fraction_high": high,
                    "time_per_step_ratio": per_step,
                    "time_per_step_low": per_step_low,
                    "time_per_step_high": per_step_high,
                    "proportional": per_step_low <= 1.0 <= per_step_high,
                    "train_s": float(np.mean([train_wall_s(r) for r in members])),
                    "test_acc_mean": acc,
                    "test_acc_ci95": half,
                }
            )
    rows = [r for r in rows if any(o["setting"] == r["setting"] and o["budget_fraction"] < 1 for o in rows)]
    rows.sort(key=lambda r: (r["setting"], r["budget_fraction"]))
    columns: list[Column] = [
        ("setting", "l", lambda r: r["setting"]),
        ("group", "l", lambda r: r["group"]),
        ("budget", "r", lambda r: f"{r['budget_fraction']:g}"),
        ("runs", "r", lambda r: str(r["n_runs"])),
        ("steps / full", "r", lambda r: fmt_number(r["step_fraction"], ".3f")),
        (
            "train time / full [95% CI]",
            "r",
            lambda r: (
                f"{fmt_number(r['time_fraction'], '.3f')} "
                f"[{fmt_number(r['time_fraction_low'], '.3f')}, {fmt_number(r['time_fraction_high'], '.3f')}]"
            ),
        ),
        (
            "time per step / full's [95% CI]",
            "r",
            lambda r: (
                f"{fmt_number(r['time_per_step_ratio'], '.3f')} "
                f"[{fmt_number(r['time_per_step_low'], '.3f')}, {fmt_number(r['time_per_step_high'], '.3f')}]"
            ),
        ),
        ("proportional", "l", lambda r: "" if r["budget_fraction"] == 1.0 else ("yes" if r["proportional"] else "NO")),
        ("train s", "r", lambda r: fmt_number(r["train_s"], ".1f")),
        (
            "test acc % ± 95% CI",
            "r",
            lambda r: f"{fmt_number(100 * r['test_acc_mean'], '.2f')} ± {fmt_number(100 * r['test_acc_ci95'], '.2f')}",
        ),
    ]
    display, align = display_columns(rows, columns)
    data = pd.DataFrame(rows)
    if not rows:
        return Table("frontier", "Budget frontier", NO_FRONTIER, data, display, align)
    caption = (
        "The budget frontier: full fine-tuning on a fraction of every epoch's steps with its schedule over its "
        "own length (train.budget_fraction), against the full budget (the baseline group), paired by seed; "
        "train time / full is the geometric mean over seeds with a t interval on the logs; proportional: the "
        "interval of time per step against full fine-tuning's holds 1.00. Only where every budget is "
        "proportional does a setting without budget runs take this frontier, its times the step fraction of "
        "its own baseline's time."
    )
    return Table("frontier", "Budget frontier", caption, data, display, align)


def iso_speedups(runs: list[Run], baseline: Baseline) -> dict[GroupKey, tuple[IsoSpeedup, str]]:
    """Every non-budget group's iso-accuracy speedup and the setting whose frontier it was read on;
    groups without a frontier to read (no budgets anywhere, no baseline, no shared seed) are left out."""
    groups = complete_groups(runs)
    found: dict[GroupKey, tuple[IsoSpeedup, str]] = {}
    if baseline.group is None:
        return found
    for key, members in groups.items():
        frontier = None if _is_budget(members) else _frontier_points(groups, baseline, key)
        if frontier is None:
            continue
        try:
            found[key] = (iso_accuracy_speedup(frontier[0], {r.seed: _point(r) for r in members}), frontier[1])
        except ValueError:
            continue  # no seed shared with every budget: nothing paired to read
    return found


def iso_speedup_table(iso: dict[GroupKey, tuple[IsoSpeedup, str]]) -> Table:
    """The iso-accuracy speedups of :func:`iso_speedups`, one row per group."""
    rows = [_iso_row(key, found, source) for key, (found, source) in iso.items()]
    columns: list[Column] = [
        ("setting", "l", lambda r: r["setting"]),
        ("group", "l", lambda r: r["group"]),
        ("seeds", "r", lambda r: str(r["seeds"])),
        ("frontier of", "l", lambda r: r["frontier_setting"]),
        ("iso-accuracy speedup [95% CI]", "r", lambda r: r["iso"].label()),
        ("beyond the frontier", "l", lambda r: r["iso"].verdict()),
    ]
    display, align = display_columns(rows, columns)
    data = csv_frame(rows)
    if not rows:
        return Table("iso_speedup", "Iso-accuracy speedup", NO_FRONTIER, data, display, align)
    return Table("iso_speedup", "Iso-accuracy speedup", ISO_DEFINITION, data, display, align)


ISO_DEFINITION = (
    "Iso-accuracy speedup = T_frontier(arm's accuracy) / arm's train time: the time full fine-tuning on a "
    "shorter budget needs to reach the arm's mean final test accuracy (linear on the mean frontier, made "
    "non-decreasing), over the arm's mean train time; 95 % interval: paired percentile bootstrap over seeds "
    "(10,000 resamples, each recomputing frontier and arm from the same seeds). Above 1.00 the arm beats "
    "training less; >= / <= mark bounds past the frontier's ends (an upper bound never counts as beyond)."
)


def _iso_row(key: GroupKey, iso: IsoSpeedup, source: str) -> dict:
    return {
        "setting": key[0],
        "group": key[1],
        "world_size": key[2],
        "seeds": iso.seeds,
        "frontier_setting": source,
        "iso_speedup": iso.speedup,
        "iso_speedup_low": iso.ci_low,
        "iso_speedup_high": iso.ci_high,
        "bound": iso.bound,
        "beyond_frontier": iso.beyond_frontier,
        "iso": iso,  # for the display; not a CSV column
    }
