"""The freeze-time atlas (issue 35): what freezing late costs, one row per clock arm (``at:k=K,t=T``).

A clock arm asks to freeze blocks 0..K-1 once a fraction T of the run is done, but the Freezer
evaluates its policy on a cadence (freeze.interval_steps, else once per epoch), so the freeze lands
at the first evaluation at or after T: with evaluations every 6 steps of 170, t = 0.5 freezes after
step 90, 0.53 of the run. The atlas therefore places each arm at the step it actually froze, read from
its run directories, beside the nominal T; its accuracy and speed come from the paired comparison
(freeze.pipeline.report.paired) and the budget frontier (frontier_tables.iso_speedups).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from freeze.checks import is_number
from freeze.names import split_policy_spec
from freeze.pipeline.report.frontier import IsoSpeedup
from freeze.pipeline.report.load import Run
from freeze.pipeline.report.paired import fmt_interval, paired_row
from freeze.pipeline.report.tables import (
    ISO_COLUMN,
    NA,
    Baseline,
    Column,
    GroupKey,
    Table,
    baseline_runs,
    complete_groups,
    csv_frame,
    display_columns,
    fmt_number,
    group_fields,
    iso_fields,
)
from freeze.policies.rules import ClockFreeze

CLOCK_POLICY = ClockFreeze.name

NO_CLOCK_ARM = (
    "no clock arms (policy at:k=K,t=T) with baseline runs in their setting: no freeze-time atlas; "
    "a study's at:k=K,t=T arms add it"
)

ATLAS_CAPTION = (
    "The freeze-time atlas: each clock arm (at:k=K,t=T freezes blocks 0..K-1 once a fraction T of the run is "
    "done) against the baseline of the same seed, setting and world size, sorted by K then T. The policy is "
    "evaluated on a cadence (freeze.interval_steps, else once per epoch), so T snaps to the first evaluation at "
    "or after it: the freeze step is read from each run's metrics.jsonl, the optimizer step after which its "
    "boundary first reached K (boundary_steps; a run directory without them: the end of the first epoch whose "
    "boundary reached K), and the run fraction is that step over the run's steps; mean over seeds, (min-max) "
    "where seeds differ. Accuracy difference and speedup as in the paired table; iso-accuracy speedup against "
    "the budget frontier (n/a without one)."
)


def clock_arm(policy: str) -> tuple[int, float] | None:
    """(K, T) of an ``at:k=K,t=T`` spec (the manifest holds the canonical spec, every parameter
    written out), None for any other policy, a spec without both numbers, or an annealed clock
    (``anneal`` > 0: another arm than the hard freeze at the same K and T)."""
    name, items = split_policy_spec(policy)
    params = dict(items)
    k, t = params.get("k"), params.get("t")
    if name != CLOCK_POLICY or k is None or t is None or not k.strip().isdigit():
        return None
    try:
        fraction = float(t)
        annealed = float(params.get("anneal") or 0.0) > 0.0
    except ValueError:
        return None
    return None if annealed else (int(k), fraction)


def freeze_step(run: Run, k: int) -> float:
    """The optimizer step after which ``run``'s boundary first reached ``k`` (NaN if it never did)."""
    step = next((s for s, boundary in run.boundary_steps if boundary >= k), None)
    if step is not None:
        return float(step)
    # A run directory older than boundary_steps: the epoch records' boundary after each epoch's last
    # evaluation, so the end of the first epoch that reached k bounds the freeze step from above.
    reached = run.metrics[run.metrics["boundary"] >= k]
    return float(reached["step"].iloc[0]) if len(reached) else math.nan


def _spread(values: list[float]) -> dict[str, float]:
    """Mean, min and max over the finite ``values`` (NaN where none)."""
    finite = [v for v in values if is_number(v) and math.isfinite(v)]
    if not finite:
        return {"mean": math.nan, "min": math.nan, "max": math.nan}
    return {"mean": float(np.mean(finite)), "min": min(finite), "max": max(finite)}


def atlas_row(
    members: list[Run], base: list[Run], target_fraction: float, margin_points: float, iso: IsoSpeedup | None
) -> dict:
    """One clock arm's row: where it froze, and the paired and iso-accuracy numbers against its baseline."""
    k, t = clock_arm(members[0].policy)
    steps = [freeze_step(r, k) for r in members]
    step = _spread(steps)
    fraction = _spread([s / r.final_step for s, r in zip(steps, members)])
    paired = paired_row(members, base, target_fraction, margin_points)
    return {
        **group_fields(members[0]),
        "k": k,
        "t": t,
        "n_runs": len(members),
        "froze_runs": sum(math.isfinite(s) for s in steps),
        "freeze_step_mean": step["mean"],
        "freeze_step_min": step["min"],
        "freeze_step_max": step["max"],
        "run_fraction_mean": fraction["mean"],
        "run_fraction_min": fraction["min"],
        "run_fraction_max": fraction["max"],
        **{key: paired[key] for key in ("n_pairs", "diff_points", "diff_low", "diff_high", "verdict")},
        **{key: paired[key] for key in ("speedup", "speedup_low", "speedup_high")},
        **iso_fields(iso),
    }


def _fmt_spread(row: dict, name: str, spec: str) -> str:
    """``mean`` alone when every seed agrees, else ``mean (min-max)``; the count when some never froze."""
    mean, low, high = row[f"{name}_mean"], row[f"{name}_min"], row[f"{name}_max"]
    if not math.isfinite(mean):
        return NA
    text = fmt_number(mean, spec) if low == high else f"{fmt_number(mean, spec)} ({low:{spec}}-{high:{spec}})"
    return text if row["froze_runs"] == row["n_runs"] else f"{text} ({row['froze_runs']}/{row['n_runs']} froze)"


def _columns(rows: list[dict], with_iso: bool, margin_points: float) -> list[Column]:
    return [
        ("K", "r", lambda r: str(r["k"])),
        ("T", "r", lambda r: f"{r['t']:g}"),
        *([("setting", "l", lambda r: r["setting"])] if any(r["setting"] for r in rows) else []),
        ("group", "l", lambda r: r["group"]),
        ("pairs", "r", lambda r: str(r["n_pairs"])),
        ("froze after step", "r", lambda r: _fmt_spread(r, "freeze_step", ".0f")),
        ("run fraction", "r", lambda r: _fmt_spread(r, "run_fraction", ".3f")),
        (
            "acc diff, points [95% CI]",
            "r",
            lambda r: fmt_interval(r["diff_points"], r["diff_low"], r["diff_high"], "+.2f"),
        ),
        (f"non-inferior at {margin_points:g}", "l", lambda r: r["verdict"]),
        (
            "speedup [95% CI]",
            "r",
            lambda r: fmt_interval(r["speedup"], r["speedup_low"], r["speedup_high"], ".2f", "x"),
        ),
        *([ISO_COLUMN] if with_iso else []),
    ]


def atlas_table(
    runs: list[Run],
    baseline: Baseline,
    target_fraction: float,
    margin_points: float,
    iso: Mapping[GroupKey, IsoSpeedup] | None = None,
) -> Table:
    """The atlas: one row per clock arm and setting that has baseline runs beside it. ``iso``: the
    groups' iso-accuracy speedups (:func:`freeze.pipeline.report.frontier_tables.iso_speedups`)."""
    iso = iso or {}
    groups = complete_groups(runs)
    rows = []
    for key, members in groups.items():
        base = baseline_runs(groups, baseline, key)
        if clock_arm(members[0].policy) is not None and base:
            rows.append(atlas_row(members, base, target_fraction, margin_points, iso.get(key)))
    rows.sort(key=lambda r: (r["k"], r["t"], r["setting"], r["group"], r["world_size"]))
    display, align = display_columns(rows, _columns(rows, bool(iso), margin_points))
    caption = ATLAS_CAPTION if rows else NO_CLOCK_ARM
    return Table("atlas", "Freeze-time atlas", caption, csv_frame(rows), display, align)
