"""The study's paired view: speedup and accuracy difference per seed, against the baseline run of the
same seed, setting and world size.

Why paired, and why on log ratios: runs of one seed share the data order, the validation split and
(for arms that freeze nothing) every computed number, so the seed-to-seed spread cancels in a
difference; and a study runs them interleaved (one block of all arms per seed, in random order), so
the machine's drift over the study cancels in a ratio taken within a block. A speedup is a ratio:
its interval comes from a Student t interval on the mean of log(baseline time / arm time) over the
pairs, turned back with exp (a geometric mean with an asymmetric interval). A control is a group
whose runs compute exactly what the baseline's runs compute (the same resolved config.toml, run
identity aside: :func:`is_control`), so its interval must hold 1.00x: a table whose control does not
is measuring the machine, not the policy. Policy none alone does not make a control: an arm that
changes the data augmentation, the optimizer or the setting's links freezes nothing and still
computes something else.

Non-inferiority at a margin m (points): the arm is non-inferior when the lower bound of the 95 %
interval of the paired accuracy difference is above -m; "inferior" when its upper bound is below
-m; otherwise the data cannot tell ("undecided"). No verdict is a finding when the arm or its baseline
scored at chance (nothing was learned: "at chance, no test") or the arm never froze a parameter (it
computed what the baseline computes: "froze nothing, no test"); the smoke config's runs are both, and a
new user read their zero-width "non-inferior" as a result (issue 32).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import pandas as pd
from scipy import stats

from freeze.pipeline.report.frontier import IsoSpeedup
from freeze.pipeline.report.load import Run
from freeze.pipeline.report.tables import (
    DEFAULT_MARGIN_POINTS,
    ISO_COLUMN,
    NA,
    SPEEDUP_DEFINITION,
    Baseline,
    Column,
    GroupKey,
    Table,
    at_chance,
    baseline_runs,
    complete_groups,
    csv_frame,
    display_columns,
    final_test_acc,
    fmt_number,
    froze_nothing,
    group_fields,
    iso_fields,
    mean_ci95,
    paired_speedups,
    ratio_ci95,
    time_to_target_s,
    train_wall_s,
    ttt_definition,
    ttt_target,
    uses_probes,
)

# Keys of a resolved config that name a run rather than change what it computes: where it is written
# (out_dir, study, name), which group and setting it is reported under, and the seed (a control is
# compared with the baseline run of its own seed, so the pairing already holds the seed equal).
RUN_IDENTITY_KEYS = frozenset({"run.name", "run.study", "run.out_dir", "run.group", "run.setting", "run.seed"})


def _computation(config: dict) -> dict:
    """The config with its run-identity keys left out (sections as in config.toml)."""
    return {
        section: (
            {k: v for k, v in values.items() if f"{section}.{k}" not in RUN_IDENTITY_KEYS}
            if isinstance(values, dict)
            else values
        )
        for section, values in config.items()
    }


def computes_like(run: Run, baseline: Run) -> bool:
    """:func:`is_control` for two runs: their resolved configs, or where either was read back from a
    per-seed row, the fields a row records (policy, hook, budget: ``Run.recorded_config``)."""
    if run.from_rows or baseline.from_rows:
        return run.recorded_config == baseline.recorded_config
    return is_control(run.config, baseline.config)


def is_control(run_config: dict, baseline_config: dict) -> bool:
    """Does a run compute exactly what its baseline run computes (its timing then measures the machine)?

    Why the resolved configs and not the policy: the report's control note claims a true speedup of
    1.00x, which holds only when the two runs do the same work. A policy-none arm that trains on other
    augmentations (data.augment = views:1) or another optimizer freezes nothing and is still no
    control. Each run directory's config.toml is the resolved config, every key written out, so equal
    configs (apart from :data:`RUN_IDENTITY_KEYS`) mean the same computation. A run without a
    config.toml cannot show that, and is not taken for a control.

    Args:
        run_config: the run's config.toml as a dict (``Run.config``).
        baseline_config: the config of the baseline run it is paired with (same seed, setting, world size).
    """
    if not run_config or not baseline_config:
        return False
    return _computation(run_config) == _computation(baseline_config)


UNDECIDED = "undecided"
AT_CHANCE_VERDICT = "at chance, no test"
FROZE_NOTHING_VERDICT = "froze nothing, no test"


def non_inferiority(diff_low: float, diff_high: float, margin_points: float) -> str:
    if not (math.isfinite(diff_low) and math.isfinite(diff_high)):
        return NA
    if diff_low > -margin_points:
        return "non-inferior"
    if diff_high < -margin_points:
        return "inferior"
    return UNDECIDED


def paired_verdict(non_inferior: str, arm_or_base_at_chance: bool, arm_froze_nothing: bool) -> str:
    """The verdict column: :func:`non_inferiority`'s, unless the comparison can hold no finding."""
    if arm_or_base_at_chance:
        return AT_CHANCE_VERDICT
    if arm_froze_nothing:
        return FROZE_NOTHING_VERDICT
    return non_inferior


def seeds_to_decide(diffs: list[float], margin_points: float, most: int = 1000) -> int | None:
    """How many paired seeds the non-inferiority verdict would need to be decided (interval wholly
    above or wholly below -margin), were the mean difference and the seed-to-seed spread what
    ``diffs`` show: the smallest n with t(0.975, n - 1) * sd / sqrt(n) < |mean + margin|. Seeds
    already run count. None without a spread to read (fewer than two seeds, or all equal), when the
    mean sits on -margin, or beyond ``most``. The spread of a few seeds is itself uncertain (with 4
    degrees of freedom its 95 % interval is about 0.6x-2.9x the estimate), so this says "about
    this many", not a power calculation."""
    if len(diffs) < 2:
        return None
    sd = float(np.std(diffs, ddof=1))
    distance = abs(float(np.mean(diffs)) + margin_points)
    if sd == 0.0 or distance == 0.0:
        return None
    for n in range(2, most + 1):
        if float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n) < distance:
            return n
    return None


def paired_row(members: list[Run], base: list[Run], target_fraction: float, margin_points: float) -> dict:
    """Every paired number of one group against its baseline (seeds present on both sides only)."""
    base_by_seed = {r.seed: r for r in base}
    pairs = [(r, base_by_seed[r.seed]) for r in members if r.seed in base_by_seed]
    speedup, speedup_low, speedup_high = ratio_ci95(paired_speedups(members, base))
    diffs = [100 * (final_test_acc(r) - final_test_acc(b)) for r, b in pairs]
    diff, diff_half = mean_ci95(diffs)
    diff_low, diff_high = diff - diff_half, diff + diff_half
    # Time to target on validation, never test: the target must not be chosen on test.
    target = ttt_target(base, target_fraction, margin_points)
    timed_pairs = [(r, b) for r, b in pairs if r.timed_like(b)]  # times pair only on the same hardware
    ttt_ratios = []
    for r, b in timed_pairs:
        arm_s, base_s = time_to_target_s(r, target), time_to_target_s(b, target)
        if arm_s is not None and base_s is not None and arm_s > 0:
            ttt_ratios.append(base_s / arm_s)
    ttt, ttt_low, ttt_high = ratio_ci95(ttt_ratios)
    arm_at_chance, base_at_chance, arm_froze_nothing = at_chance(members), at_chance(base), froze_nothing(members)
    return {
        **group_fields(members[0]),
        "baseline": base[0].group,  # named in the Pareto figure's title
        "budget_fraction": members[0].budget_fraction,  # below 1: a point of the budget frontier
        "n_pairs": len(pairs),
        "speedup": speedup,
        "speedup_low": speedup_low,
        "speedup_high": speedup_high,
        "diff_points": diff,
        "diff_low": diff_low,
        "diff_high": diff_high,
        "verdict": paired_verdict(
            non_inferiority(diff_low, diff_high, margin_points), arm_at_chance or base_at_chance, arm_froze_nothing
        ),
        "arm_at_chance": arm_at_chance,
        "base_at_chance": base_at_chance,
        "froze_nothing": arm_froze_nothing,
        "seeds_to_decide": seeds_to_decide(diffs, margin_points),
        "ttt_target_val_acc": target,
        "ttt_pairs": len(ttt_ratios),
        "ttt_speedup": ttt,
        "ttt_speedup_low": ttt_low,
        "ttt_speedup_high": ttt_high,
        "arm_train_min": float(np.mean([train_wall_s(r) for r, _ in timed_pairs])) / 60 if timed_pairs else math.nan,
        "base_train_min": float(np.mean([train_wall_s(b) for _, b in timed_pairs])) / 60 if timed_pairs else math.nan,
        "control": bool(pairs) and all(computes_like(r, b) for r, b in pairs),
        # the seeds left out of the time ratios, each with both runs' hardware
        "mixed_timing": "; ".join(
            f"seed {r.seed} ({r.timing_kind} / {b.timing_kind})" for r, b in pairs if not r.timed_like(b)
        ),
    }


def _fmt_seeds(row: dict) -> str:
    n = row["seeds_to_decide"]
    return "more than 1000" if n is None or not math.isfinite(n) else f"about {int(n)}"


def fmt_interval(value: float, low: float, high: float, spec: str, suffix: str = "") -> str:
    """``value [low, high]`` (the paired and atlas tables' intervals); the value alone without bounds."""
    if not math.isfinite(value):
        return NA
    if not (math.isfinite(low) and math.isfinite(high)):
        return fmt_number(value, spec, suffix)
    return f"{fmt_number(value, spec, suffix)} [{fmt_number(low, spec)}, {fmt_number(high, spec)}]"


def paired_table(
    runs: list[Run],
    baseline: Baseline,
    target_fraction: float,
    margin_points: float = DEFAULT_MARGIN_POINTS,
    iso: Mapping[GroupKey, IsoSpeedup] | None = None,
) -> Table:
    """One row per group against its baseline. ``iso``: the groups' iso-accuracy speedups against
    the budget frontier, a column beside the speedup when given."""
    iso = iso or {}
    groups = complete_groups(runs)
    rows = []
    if baseline.group is not None:
        for key, members in groups.items():
            base = baseline_runs(groups, baseline, key)
            if key.group != baseline.group and base:
                rows.append({**paired_row(members, base, target_fraction, margin_points), **iso_fields(iso.get(key))})
    columns: list[Column] = [("setting", "l", lambda r: r["setting"])] if any(k.setting for k in groups) else []
    columns += [
        ("group", "l", lambda r: r["group"]),
        ("policy", "l", lambda r: r["policy"]),
        ("workers", "r", lambda r: str(r["world_size"])),
        ("pairs", "r", lambda r: str(r["n_pairs"])),
        (
            "train min (arm / base)",
            "r",
            lambda r: f"{fmt_number(r['arm_train_min'], '.2f')} / {fmt_number(r['base_train_min'], '.2f')}",
        ),
        (
            "speedup [95% CI]",
            "r",
            lambda r: fmt_interval(r["speedup"], r["speedup_low"], r["speedup_high"], ".2f", "x"),
        ),
        *([ISO_COLUMN] if iso else []),
        (
            "acc diff, points [95% CI]",
            "r",
            lambda r: fmt_interval(r["diff_points"], r["diff_low"], r["diff_high"], "+.2f"),
        ),
        (f"non-inferior at {margin_points:g}", "l", lambda r: r["verdict"]),
        ("seeds to decide", "r", lambda r: _fmt_seeds(r) if r["verdict"] == UNDECIDED else ""),
        (
            "time-to-target speedup [95% CI]",
            "r",
            lambda r: (
                fmt_interval(r["ttt_speedup"], r["ttt_speedup_low"], r["ttt_speedup_high"], ".2f", "x")
                + (f" ({r['ttt_pairs']}/{r['n_pairs']} reached)" if r["ttt_pairs"] < r["n_pairs"] else "")
            ),
        ),
    ]
    display, align = display_columns(rows, columns)
    caption = (
        f"Paired comparison with the baseline of the same seed, setting and world size ({len(rows)} groups): "
        f"{SPEEDUP_DEFINITION}, with a 95% Student-t interval on the logs; accuracy difference is the final-epoch "
        "test accuracy minus the baseline's, mean and 95% interval over seeds; non-inferior when the interval's "
        f"lower bound is above -{margin_points:g} points (inferior when its upper bound is below, undecided "
        "otherwise; no test when the arm or the baseline is at chance, or the arm froze nothing); seeds to decide "
        "(undecided rows): how many paired seeds would decide it at the mean and spread these show; "
        f"{ttt_definition(target_fraction, margin_points, uses_probes(runs))}; time-to-target "
        "speedup: the same paired geometric mean over the seeds where both runs reached it."
    )
    notes = [baseline.note]
    for row in (r for r in rows if r["mixed_timing"]):
        notes.append(
            f"{row['setting'] + '/' if row['setting'] else ''}{row['group']}: timed on other hardware than its "
            f"baseline, left out of the speedup (accuracy still paired): {row['mixed_timing']}"
        )
    for row in (r for r in rows if r["control"]):
        has_interval = math.isfinite(row["speedup_low"]) and math.isfinite(row["speedup_high"])
        holds = has_interval and row["speedup_low"] <= 1.0 <= row["speedup_high"]
        if not has_interval:  # one pair: nothing to hold or break
            verdict = "one pair, no interval: run more seeds to check it"
        else:
            verdict = "holds 1.00x" if holds else "DOES NOT hold 1.00x: timing drift larger than the intervals say"
        notes.append(
            f"control {row['setting'] + '/' if row['setting'] else ''}{row['group']} (policy {row['policy']}, computes what the "
            f"baseline computes): {fmt_interval(row['speedup'], row['speedup_low'], row['speedup_high'], '.2f', 'x')}"
            f" - {verdict}"
        )
    return Table("paired", "Paired speedup and accuracy", caption, csv_frame(rows), display, align, tuple(notes))


def convergence_state(change: float, half: float, margin_points: float) -> str:
    """converged / still improving / falling / undecided / no validation data, decided by the interval
    change ± half (one seed, half NaN: by the change alone)."""
    if not math.isfinite(change):
        return "no validation data"
    low, high = (change, change) if not math.isfinite(half) else (change - half, change + half)
    if -margin_points <= low and high <= margin_points:
        return "converged"
    if low > 0:
        return "still improving"
    if high < 0:
        return "falling"
    return "undecided"


def convergence_table(runs: list[Run], baseline: Baseline, margin_points: float = DEFAULT_MARGIN_POINTS) -> Table:
    """Is the baseline converged? Its val accuracy change over the last fifth of training.

    Criterion (stated in the caption): the mean over seeds of val acc(final epoch) - val acc(the epoch
    before the last fifth starts) lies within +-margin points. A baseline still climbing makes every
    "no accuracy lost" claim about an unfinished race."""
    groups = complete_groups(runs)
    rows = []
    for key, members in groups.items():
        if key.group != baseline.group:
            continue
        epochs = min(len(r.metrics) for r in members)
        # The last fifth is rows floor(0.8 E)..E-1; its reference is the row just before it.
        start = max(0, math.floor(0.8 * epochs) - 1)
        changes = []
        for run in members:
            val = run.metrics["val_acc"].to_numpy(dtype=float)
            if start < epochs - 1 and math.isfinite(val[start]) and math.isfinite(val[epochs - 1]):
                changes.append(100 * (val[epochs - 1] - val[start]))
        change, half = mean_ci95(changes)
        state = convergence_state(change, half, margin_points)
        rows.append(
            {
                "setting": key.setting,
                "group": key.group,
                "world_size": key.world_size,
                "n_runs": len(changes),
                "epochs": epochs,
                "from_epoch": start + 1,
                "val_change_points": change,
                "val_change_ci95": half,
                "final_val_acc": float(np.mean([r.metrics["val_acc"].iloc[-1] for r in members])),
                "state": state,
                "flat": state == "converged",
            }
        )
    columns: list[Column] = [("setting", "l", lambda r: r["setting"])] if any(k.setting for k in groups) else []
    columns += [
        ("baseline", "l", lambda r: r["group"]),
        ("workers", "r", lambda r: str(r["world_size"])),
        ("seeds", "r", lambda r: str(r["n_runs"])),
        ("val acc % (final)", "r", lambda r: fmt_number(100 * r["final_val_acc"], ".2f")),
        (
            "val change over last fifth (points)",
            "r",
            lambda r: (
                f"{fmt_number(r['val_change_points'], '+.2f')} ± {fmt_number(r['val_change_ci95'], '.2f')}"
                f" (epoch {r['from_epoch']} -> {r['epochs']})"
            ),
        ),
        (f"converged (within ±{margin_points:g})", "l", lambda r: r["state"]),
    ]
    display, align = display_columns(rows, columns)
    caption = (
        "Convergence of the baseline: mean over seeds (± 95% CI half-width: a t interval, not an SD) of the change "
        "in validation accuracy from the epoch before the last fifth of training to the final epoch, decided by "
        f"its interval: converged when the whole interval lies within ±{margin_points:g} points, still improving "
        "when it lies above 0, falling when below 0, else undecided (one seed: by the change itself)."
    )
    notes = () if rows else ("no baseline group: convergence not assessed",)
    return Table("convergence", "Convergence of the baseline", caption, pd.DataFrame(rows), display, align, notes)
