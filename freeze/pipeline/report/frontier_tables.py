"""The report's budget-frontier tables (issue 35): the frontier itself, and every arm's
iso-accuracy speedup against it (freeze.pipeline.report.frontier holds the arithmetic).

A budget run is a complete policy-none run with ``train.budget_fraction`` below 1; the baseline group
is the frontier's full budget. A setting without budget runs of its own (the emulated cluster, where
accuracy is the same as on loopback and only the time differs) borrows the frontier of the first
setting that has one: each budget run's accuracy, at a time read off the arm's anchor in its own
setting, seed by seed. The anchor is full fine-tuning sent the way the arm sends its gradients (the
policy-none, full-budget group with the arm's ``freeze.comm_hook``: an arm that freezes on top of
bf16 is compared with training less AND compressing, not with training less alone), so what
compression buys is not credited to freezing; compression alone is read against the plain frontier. The anchor's time is carried over two ways, since neither is known
to hold on the other setting: as the budget's step fraction (right when time is proportional to
steps; the frontier's cheapest reading, so the one an arm must beat for "beyond") and as the budget's
measured time fraction where it ran (right when a short run's extra cost per step carries over; the
dearest reading, so the one an arm must lose to for "not beyond"). The frontier table shows how far
the two differ (time per step against full fine-tuning's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from freeze.pipeline.report.frontier import (
    BEYOND_MARGIN,
    CONTROL_BELOW_REASONS,
    MIN_VERDICT_SEEDS,
    IsoSpeedup,
    Point,
    control_check,
    invalid_verdict,
    iso_accuracy_speedup,
)
from freeze.pipeline.report.load import Run
from freeze.pipeline.report.paired import computes_like
from freeze.pipeline.report.tables import (
    Baseline,
    Column,
    GroupKey,
    Table,
    complete_groups,
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


def _carried_fraction(run: Run, full: Run, carry: str) -> float:
    """A run's share of full fine-tuning's ``full`` (same seed), by steps or by measured train time."""
    if carry == "time":
        return train_wall_s(run) / train_wall_s(full)
    return run.final_step / full.final_step


def _time_per_step_ratio(runs: list[Run], base: dict[int, Run]) -> tuple[float, float, float]:
    """(time fraction) / (step fraction) of full fine-tuning, geometric mean over seeds with its 95 %
    interval: 1.00 when training time is proportional to steps."""
    paired = [r for r in runs if r.seed in base]
    return ratio_ci95(
        [_carried_fraction(r, base[r.seed], "time") / _carried_fraction(r, base[r.seed], "steps") for r in paired]
    )


def _anchor(groups: dict[GroupKey, list[Run]], baseline: Baseline, key: GroupKey) -> dict[int, Run]:
    """seed -> run of full fine-tuning in ``key``'s setting sent as ``key``'s arm sends its gradients;
    empty when the setting has no such group. An arm that freezes nothing (compression alone) is itself
    what a user could do instead, so it is read against the plain frontier: the baseline group."""
    arm = groups[key][0]
    hook = arm.comm_hook if arm.policy != "none" else None
    base = groups.get(key._replace(group=baseline.group), [])
    if base and (hook is None or base[0].comm_hook == hook):
        return {r.seed: r for r in base}
    for (setting, _, world), members in sorted(groups.items()):
        first = members[0]
        same_place = (setting, world) == (key.setting, key.world_size)
        if same_place and first.policy == "none" and first.budget_fraction == 1.0 and first.comm_hook == hook:
            return {r.seed: r for r in members}
    return {}


def _frontier_points(
    groups: dict[GroupKey, list[Run]], baseline: Baseline, key: GroupKey, carry: str = "steps"
) -> tuple[dict[float, dict[int, Point]], str] | None:
    """The frontier an arm in ``key``'s setting is read against, and where it was measured; a borrowed
    frontier's times carried over as step fractions (``carry="steps"``) or as the measured time
    fractions of the setting that ran the budgets (``carry="time"``)."""
    own = _frontier_runs(groups, baseline, key.setting, key.world_size)
    if own is not None:
        return {f: {s: _point(r) for s, r in by_seed.items()} for f, by_seed in own.items()}, key.setting
    anchor = _anchor(groups, baseline, key)
    if not anchor:
        return None
    for setting in sorted({k.setting for k in groups}):
        borrowed = _frontier_runs(groups, baseline, setting, key.world_size)
        if borrowed is None:
            continue
        full = borrowed[1.0]
        points = {
            f: {
                s: Point(
                    train_wall_s(anchor[s]) * _carried_fraction(r, full[s], carry),
                    100 * final_test_acc(r if f < 1.0 else anchor[s]),
                )
                for s, r in by_seed.items()
                if s in anchor and s in full
            }
            for f, by_seed in borrowed.items()
        }
        anchor_group = next(iter(anchor.values())).group
        return points, setting if anchor_group == baseline.group else f"{setting}, times of {anchor_group}"
    return None


def _timed_against(groups: dict[GroupKey, list[Run]], baseline: Baseline, key: GroupKey) -> dict[int, list[Run]]:
    """Per seed, the runs whose times an arm in ``key``'s setting is read against: its own setting's
    budget runs, or the anchor whose times a borrowed frontier carries. An arm's seed timed on other
    hardware than these is left out of its iso-accuracy speedup, as from the paired speedups."""
    own = _frontier_runs(groups, baseline, key.setting, key.world_size)
    if own is not None:
        seeds = {s for by_seed in own.values() for s in by_seed}
        return {s: [by_seed[s] for by_seed in own.values() if s in by_seed] for s in seeds}
    return {s: [r] for s, r in (_anchor(groups, baseline, key) or {}).items()}


def frontier_table(runs: list[Run], baseline: Baseline) -> Table:
    """The frontier per setting: each budget's step and time fractions of full fine-tuning, paired by
    seed, and its final test accuracy."""
    groups = complete_groups(runs)
    rows = []
    if baseline.group is not None:
        for key, members in groups.items():
            base = {r.seed: r for r in groups.get(key._replace(group=baseline.group), [])}
            if not (_is_budget(members) or key.group == baseline.group) or not base:
                continue
            paired = [r for r in members if r.seed in base]
            time_fraction, low, high = ratio_ci95([_carried_fraction(r, base[r.seed], "time") for r in paired])
            per_step, per_step_low, per_step_high = _time_per_step_ratio(members, base)
            acc, half = mean_ci95([final_test_acc(r) for r in members])
            rows.append(
                {
                    "setting": key.setting,
                    "group": key.group,
                    "budget_fraction": members[0].budget_fraction,
                    "n_runs": len(members),
                    "step_fraction": float(np.mean([_carried_fraction(r, base[r.seed], "steps") for r in paired])),
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
        "interval of time per step against full fine-tuning's holds 1.00. A setting without budget runs "
        "borrows this frontier with its times read two ways, as the step fractions and as the time fractions "
        "(the iso-accuracy table gives both): where a budget is not proportional, the two differ by its time "
        "per step."
    )
    return Table("frontier", "Budget frontier", caption, data, display, align)


@dataclass(frozen=True)
class FrontierReading:
    """An arm's iso-accuracy speedup, the setting (and anchor) of the frontier it was read on, and, for
    a borrowed frontier, the same read with the measured time fractions (module docstring)."""

    iso: IsoSpeedup  # own frontier, or a borrowed one with its times as step fractions
    source: str
    by_time: IsoSpeedup | None = None  # a borrowed frontier with the measured time fractions
    control: bool = False  # the group computes what the baseline computes (report.paired.computes_like)

    def verdict(self) -> str:
        """The verdict every table gives the arm: :meth:`reading_verdict`, or the one :func:`settle`
        put on its ``iso``."""
        return self.reading_verdict() if self.iso.settled is None else self.iso.settled

    def reading_verdict(self) -> str:
        """yes / no only where every reading says so; else undecided (or the reading's n/a)."""
        if self.by_time is None:
            return self.iso.interval_verdict()
        both = {self.iso.interval_verdict(), self.by_time.interval_verdict()}
        if len(both) == 1:
            return both.pop()
        # "below the frontier" by one reading and "beyond, but not by the margin" by the other: no by both
        return f"no (not by {BEYOND_MARGIN:.2f}x)" if all(v.startswith("no") for v in both) else "undecided"


def iso_speedups(runs: list[Run], baseline: Baseline) -> dict[GroupKey, FrontierReading]:
    """Every non-budget group's iso-accuracy speedup against the frontier of its setting, or the one it
    borrows; groups without a frontier to read (no budgets anywhere, no baseline, no anchor, no shared
    seed) are left out."""
    groups = complete_groups(runs)
    found: dict[GroupKey, FrontierReading] = {}
    if baseline.group is None:
        return found
    for key, members in groups.items():
        frontier = None if _is_budget(members) else _frontier_points(groups, baseline, key)
        if frontier is None:
            continue
        timed = _timed_against(groups, baseline, key)
        arm = {r.seed: _point(r) for r in members if all(r.timed_like(other) for other in timed.get(r.seed, ()))}
        try:
            iso = iso_accuracy_speedup(frontier[0], arm)
        except ValueError:
            continue  # no seed shared with every budget: nothing paired to read
        by_time = None
        if frontier[1] != key.setting:  # borrowed: read it with the measured time fractions too
            by_time = iso_accuracy_speedup(_frontier_points(groups, baseline, key, carry="time")[0], arm)
        base = {r.seed: r for r in groups.get(key._replace(group=baseline.group), [])}
        control = key.group != baseline.group and any(r.seed in base for r in members)
        control = control and all(computes_like(r, base[r.seed]) for r in members if r.seed in base)
        found[key] = FrontierReading(iso, frontier[1], by_time, control)
    return found


def failed_controls(readings: dict[GroupKey, FrontierReading]) -> list[str]:
    """The controls (``setting/group``) that read beyond the frontier: they compute what the
    frontier's full budget computes, so such a reading is the statistic's false positive, and no
    verdict of the table stands (:func:`report.frontier.control_check`)."""
    return [
        f"{key.setting}/{key.group}"
        for key, reading in readings.items()
        if reading.control and control_check(reading.reading_verdict()) == "failed"
    ]


def settle(readings: dict[GroupKey, FrontierReading]) -> dict[GroupKey, FrontierReading]:
    """Each arm's verdict fixed on its ``iso``, so that the main, paired, atlas and summary tables
    (which carry only ``iso``) say what this table says: both readings of a borrowed frontier
    combined, and "invalid" everywhere when a control reads beyond the frontier."""
    failed = failed_controls(readings)
    return {
        key: replace(
            reading,
            iso=replace(
                reading.iso,
                settled=invalid_verdict(failed) if failed else reading.reading_verdict(),
            ),
        )
        for key, reading in readings.items()
    }


def iso_speedup_table(readings: dict[GroupKey, FrontierReading]) -> Table:
    """The iso-accuracy speedups of :func:`iso_speedups`, one row per group."""
    readings = settle(readings)
    rows = [_iso_row(key, reading) for key, reading in readings.items()]
    columns: list[Column] = [
        ("setting", "l", lambda r: r["setting"]),
        ("group", "l", lambda r: r["group"]),
        ("seeds", "r", lambda r: str(r["seeds"])),
        ("frontier of", "l", lambda r: r["frontier_setting"]),
        ("iso-accuracy speedup [95% CI]", "r", lambda r: r["iso"].label()),
        ("with the measured time fractions", "r", lambda r: "" if r["by_time"] is None else r["by_time"].label()),
        ("beyond the frontier", "l", lambda r: r["verdict"]),
    ]
    display, align = display_columns(rows, columns)
    data = pd.DataFrame([{k: v for k, v in r.items() if k not in ("iso", "by_time")} for r in rows])
    if not rows:
        return Table("iso_speedup", "Iso-accuracy speedup", NO_FRONTIER, data, display, align)
    notes = tuple(_control_note(key, reading) for key, reading in readings.items() if reading.control)
    return Table("iso_speedup", "Iso-accuracy speedup", ISO_DEFINITION, data, display, align, notes)


def _control_note(key: GroupKey, reading: FrontierReading) -> str:
    verdict = reading.reading_verdict()
    head = f"control {key.setting}/{key.group} (computes what the full budget computes): {reading.iso.label()} - "
    return (
        head
        + {
            "failed": "CALIBRATION FAILED: it reads beyond the frontier, so no verdict in this table stands",
            "warning": (
                f"WARNING: it reads below the frontier: {CONTROL_BELOW_REASONS} (its paired speedup in the paired "
                "table says whether it drifted)"
            ),
            "passed": f"reads '{verdict}', as a calibrated statistic must",
        }[control_check(verdict)]
    )


ISO_DEFINITION = (
    "Iso-accuracy speedup = T_frontier(arm's accuracy) / arm's train time, per seed on that seed's own "
    "frontier (linear between its budgets, made non-decreasing): the time full fine-tuning on a shorter "
    "budget needs to reach the arm's final test accuracy over the arm's train time; geometric mean over "
    "the paired seeds, 95 % t interval on their logs. Beyond the frontier: yes when the interval's low end "
    f"is above {BEYOND_MARGIN:.2f}x (a practical margin over loopback's 7 % per-seed timing noise), no when "
    f"its high end is below {BEYOND_MARGIN:.2f}x, else undecided; at least {MIN_VERDICT_SEEDS} seeds. "
    ">= / <= mark bounds past the frontier's ends, and an interval end resting on such a seed (an upper "
    "bound never counts as beyond). A control must not read beyond: if one does, the table says so "
    "and no verdict in it stands; one that reads below is named with a warning. "
    "A setting without budgets of its own borrows another's frontier, anchored on full fine-tuning sent as the "
    "arm sends its gradients (frontier of: 'loopback, times of bf16': training less with the bf16 hook), its "
    "times carried over as the budgets' step fractions (the column before) and as their measured time "
    "fractions (the next); beyond the frontier: yes or no only where both readings agree."
)


def _iso_row(key: GroupKey, reading: FrontierReading) -> dict:
    iso, by_time = reading.iso, reading.by_time
    return {
        "setting": key.setting,
        "group": key.group,
        "world_size": key.world_size,
        "seeds": iso.seeds,
        "frontier_setting": reading.source,
        "iso_speedup": iso.speedup,
        "iso_speedup_low": iso.ci_low,
        "iso_speedup_high": iso.ci_high,
        "bound": iso.bound,
        "iso_speedup_by_time": np.nan if by_time is None else by_time.speedup,
        "iso_speedup_by_time_low": np.nan if by_time is None else by_time.ci_low,
        "iso_speedup_by_time_high": np.nan if by_time is None else by_time.ci_high,
        "beyond_frontier": reading.verdict() == "yes",
        "verdict": reading.verdict(),
        "iso": iso,  # for the display; not CSV columns
        "by_time": by_time,
    }
