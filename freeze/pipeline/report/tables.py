"""Run directories -> the study's tables (raw numbers for CSV, formatted strings for md/tex).

Rules that every table follows, because they decide what a number means:
* only complete runs enter a mean; the others are listed in the incomplete-runs table;
* accuracy is the LAST epoch's test accuracy, never the best epoch's (choosing the best epoch on the
  test set is selection on the test set);
* comparisons are made within one setting and world size, against the baseline group's runs there.
"""

from __future__ import annotations

import math
import tomllib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd
from scipy import stats

from freeze.names import split_policy_spec
from freeze.pipeline.config import config_to_toml, load_config
from freeze.pipeline.report.frontier import IsoSpeedup
from freeze.pipeline.report.load import ReportInputError, Run
from freeze.pipeline.schema import TRAIN_PHASES


class GroupKey(NamedTuple):
    """Which arm a run belongs to in a report: runs of one key differ only in their seed."""

    setting: str  # a study's setting ("" for a plain sweep)
    group: str
    world_size: int


# table phase name -> metrics column; total is epoch_wall_s (no eval)
PHASE_COLUMNS = {phase: f"phase_{phase}_s" for phase in TRAIN_PHASES} | {"total": "epoch_wall_s"}
NA = "n/a"
DEFAULT_MARGIN_POINTS = 0.5  # non-inferiority margin, accuracy points


@dataclass(frozen=True, eq=False)
class Table:
    name: str  # file stem: main, static_sweep, phases, incomplete
    title: str
    caption: str  # one line: what the numbers are and how many runs back them
    data: pd.DataFrame  # full-precision values, written to CSV
    display: pd.DataFrame  # formatted strings, written to markdown and LaTeX
    align: tuple[str, ...]  # "l" or "r" per display column
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Baseline:
    group: str | None  # None: no baseline, comparison columns are omitted
    note: str


ON_DUPLICATE = ("error", "newest")


def drop_duplicate_runs(runs: list[Run], on_duplicate: str, runs_dir) -> tuple[list[Run], list[tuple[Run, Run]]]:
    """Complete runs of one (group, world_size, seed) counted once: a second copy (a run re-made
    under a new name, results copied twice) would count one seed twice in every mean.

    Args:
        runs: the loaded runs.
        on_duplicate: "error" stops with one line naming both directories and the way round;
            "newest" keeps the run that ended last (manifest end_time) and leaves the others out.
        runs_dir: the folder given to the report (named in the error's command).

    Returns:
        (runs kept, [(left-out run, the run kept instead)]).
    """
    if on_duplicate not in ON_DUPLICATE:
        raise ReportInputError(f"--on-duplicate {on_duplicate!r}; accepted: {', '.join(ON_DUPLICATE)}")
    by_key: dict[tuple, list[Run]] = {}
    for run in runs:
        if run.is_complete:
            by_key.setdefault((run.setting, run.group, run.world_size, run.seed), []).append(run)
    dropped: list[tuple[Run, Run]] = []
    for (setting, group, world_size, seed), members in sorted(by_key.items()):
        if len(members) < 2:
            continue
        members.sort(key=lambda r: (str(r.manifest.get("end_time") or ""), str(r.run_dir)))
        if on_duplicate == "error":
            raise ReportInputError(
                f"group {group!r} ({'setting ' + setting + ', ' if setting else ''}world_size {world_size}) has "
                f"{len(members)} complete runs with seed {seed}: "
                f"{', '.join(str(r.run_dir) for r in members)}; keep the newest with "
                f"`python -m report {runs_dir} --on-duplicate newest`, or move the others out of {runs_dir}"
            )
        dropped += [(old, members[-1]) for old in members[:-1]]
    left_out = {id(old) for old, _ in dropped}
    return [r for r in runs if id(r) not in left_out], dropped


def complete_groups(runs: list[Run]) -> dict[GroupKey, list[Run]]:
    """Complete runs by (setting, group, world_size), sorted; each seed at most once per group."""
    groups: dict[GroupKey, list[Run]] = {}
    for run in runs:
        if run.is_complete:
            groups.setdefault(GroupKey(run.setting, run.group, run.world_size), []).append(run)
    for (setting, group, world_size), members in groups.items():
        members.sort(key=lambda r: (r.seed, r.name))
        for a, b in zip(members, members[1:]):
            if a.seed == b.seed:
                where = f"setting {setting!r}, " if setting else ""
                raise ReportInputError(
                    f"group {group!r} ({where}world_size {world_size}) has two complete runs with seed {a.seed}: "
                    f"{a.run_dir} and {b.run_dir}"
                )
    return dict(sorted(groups.items()))


def baseline_runs(groups: dict[GroupKey, list[Run]], baseline: Baseline, key: GroupKey) -> list[Run] | None:
    """The baseline group's runs in the setting and world size of ``key`` (None without a baseline)."""
    if baseline.group is None:
        return None
    return groups.get(key._replace(group=baseline.group))


def group_label(key: GroupKey) -> str:
    """ "setting/group" (just the group outside a study with settings)."""
    return f"{key.setting}/{key.group}" if key.setting else key.group


def resolve_baseline(runs: list[Run], baseline: str | None) -> Baseline:
    if baseline is not None:
        known = sorted({r.group for r in runs})
        if baseline not in known:
            raise ReportInputError(f"--baseline {baseline!r} is not a group of these runs; groups: {', '.join(known)}")
        return Baseline(baseline, f"baseline: group {baseline!r} (--baseline)")
    candidates = sorted({r.group for r in runs if r.is_complete and r.policy == "none"})
    if not candidates:
        return Baseline(
            None, "no complete group with policy 'none': comparison columns omitted (choose one with --baseline GROUP)"
        )
    chosen = _default_policy_none_group(runs, candidates)
    others = [c for c in candidates if c != chosen]
    extra = f"; other policy-none groups not used: {', '.join(others)}" if others else ""
    return Baseline(chosen, f"baseline: group {chosen!r} (policy none){extra}")


# Keys that name a run rather than change what it computes (as paired.RUN_IDENTITY_KEYS).
_IDENTITY_KEYS = frozenset({"run.name", "run.study", "run.out_dir", "run.group", "run.setting", "run.seed"})


def _flat_config(config: dict) -> dict[str, object]:
    return {
        f"{section}.{key}": value
        for section, values in config.items()
        if isinstance(values, dict)
        for key, value in values.items()
        if f"{section}.{key}" not in _IDENTITY_KEYS
    }


def _default_policy_none_group(runs: list[Run], candidates: list[str]) -> str:
    """The policy-none group to compare against when several exist: the one whose config keys, where
    the candidates differ, hold the defaults (a sweep's none_cache=off beside none_cache=memory: the
    cache is off by default). Candidates computing the same thing (a study's none and control) tie,
    and "none" or the first name is taken. Otherwise ReportInputError asks for --baseline.

    Configs are compared within each study setting: a study's settings differ in keys of their own
    (dist.nproc, cluster.nodes), and a group that runs in one setting only (a budget arm on loopback,
    a compression hook on the cluster) is compared with the groups of that setting."""
    if len(candidates) == 1:
        return candidates[0]
    defaults = _flat_config(tomllib.loads(config_to_toml(load_config(None, check_files=False))))
    # runs read back from per-seed rows record only some fields: then every group is compared on those
    recorded = any(r.from_rows for r in runs if r.group in candidates)
    differing: set[str] = set()
    off_defaults: set[str] = set()  # groups with a non-default value where the groups of a setting differ
    computations: dict[str, set[str]] = {}  # group -> its configs, one per setting
    for setting in sorted({r.setting for r in runs if r.group in candidates and r.is_complete}):
        configs = {}
        for group in candidates:
            run = next((r for r in runs if r.group == group and r.setting == setting and r.is_complete), None)
            if run is not None:
                configs[group] = _flat_config(run.recorded_config if recorded else run.config)
        keys = sorted({k for c in configs.values() for k in c})
        value = {g: {k: c.get(k, defaults.get(k)) for k in keys} for g, c in configs.items()}  # absent: default
        here = [k for k in keys if len({repr(v[k]) for v in value.values()}) > 1]
        differing.update(here)
        off_defaults.update(g for g in value if any(value[g][k] != defaults.get(k) for k in here))
        for g in value:
            computations.setdefault(g, set()).add(repr({k: value[g][k] for k in here}))
    at_defaults = [g for g in candidates if g not in off_defaults]
    if (
        at_defaults and len({frozenset(computations[g]) for g in at_defaults}) == 1
    ):  # one computation (none and control)
        return "none" if "none" in at_defaults else at_defaults[0]
    raise ReportInputError(
        f"several policy-none groups ({', '.join(candidates)}) differ in {', '.join(sorted(differing))}; "
        "choose the baseline with --baseline GROUP"
    )


def final_test_acc(run: Run) -> float:
    value = float(run.metrics["test_acc"].iloc[-1])
    if math.isnan(value):
        raise ReportInputError(
            f"{run.run_dir / 'metrics.jsonl'}: last epoch has test_acc null; the final epoch must be evaluated"
        )
    return value


# A test accuracy within this many binomial standard deviations of 1/num_classes is what a classifier
# that guesses scores (3: a guesser exceeds it about once in 700 evaluations).
CHANCE_SDS = 3.0


def chance_upper_bound(members: list[Run]) -> tuple[float, float] | None:
    """(chance accuracy 1/C, the highest accuracy still within noise of it) for a group's runs, from
    the class count and test-set size their manifests record; None when a run does not record them
    (run directories older than issue 32) or the runs disagree on the class count."""
    classes = {r.num_classes for r in members}
    images = [r.test_images for r in members]
    if len(classes) != 1 or None in classes or None in images:
        return None
    chance = 1.0 / next(iter(classes))
    sd = math.sqrt(chance * (1.0 - chance) / min(images))  # the fewest images: the widest noise
    return chance, chance + CHANCE_SDS * sd


def at_chance(members: list[Run]) -> bool:
    """Did the group learn nothing: its mean final test accuracy within noise of 1/num_classes?"""
    bound = chance_upper_bound(members)
    return bound is not None and float(np.mean([final_test_acc(r) for r in members])) <= bound[1]


def froze_nothing(members: list[Run]) -> bool:
    """A freezing policy that never froze a parameter during training (frozen fraction 0 at every
    step of every run): it computed what the baseline computes, so no comparison says anything about
    the policy. Policy none is excluded: freezing nothing is what it is for."""
    if split_policy_spec(members[0].policy)[0] == "none":
        return False
    # an unknown fraction (a run read back from a per-seed row older than that column) is no zero
    return all(
        r.metrics["frozen_param_fraction"].notna().all() and float(r.metrics["frozen_param_fraction"].sum()) == 0.0
        for r in members
    )


def chance_note(group: str, members: list[Run]) -> str:
    """The main table's line for a group at chance: its accuracy and where chance and noise end."""
    chance, bound = chance_upper_bound(members) or (math.nan, math.nan)
    acc = 100 * float(np.mean([final_test_acc(r) for r in members]))
    return (
        f"{group} is AT CHANCE: test acc {acc:.2f} % against 1/{members[0].num_classes} = {100 * chance:.2f} % "
        f"(within noise up to {100 * bound:.2f} %, {CHANCE_SDS:g} binomial SDs on {min(r.test_images or 0 for r in members)} "
        "test images): it learned nothing, so its comparisons say nothing about a policy; train longer or on "
        'learnable data (docs/experiments.md, "Your own ablation")'
    )


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """Mean and 95% CI half-width (Student t, n-1 dof); the half-width is NaN for n < 2."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = float(np.mean(values))
    if n < 2:
        return mean, math.nan
    return mean, float(stats.t.ppf(0.975, n - 1) * np.std(values, ddof=1) / math.sqrt(n))


def compare_seeds(row: dict[int, float], base: dict[int, float]) -> tuple[float, str]:
    """p-value and test name: paired over shared seeds when >= 2 pairs, else Welch, else n/a."""
    shared = sorted(row.keys() & base.keys())
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        # Identical samples give p = NaN with a precision warning; NaN is shown as n/a.
        warnings.simplefilter("ignore", RuntimeWarning)
        if len(shared) >= 2:
            return float(stats.ttest_rel([row[s] for s in shared], [base[s] for s in shared]).pvalue), "paired"
        if len(row) >= 2 and len(base) >= 2:
            return float(stats.ttest_ind(list(row.values()), list(base.values()), equal_var=False).pvalue), "welch"
    return math.nan, NA


def train_wall_s(run: Run) -> float:
    """The run's training wall time: cumulative_wall_s at its last epoch, the sum of its epochs'
    epoch_wall_s (every training phase, evaluation excluded)."""
    return float(run.metrics["cumulative_wall_s"].iloc[-1])


def time_to_target_s(run: Run, target_val_acc: float) -> float | None:
    """First cumulative training wall time at which val accuracy reached the target, else None: at a
    probe when the run has probes (train.probe_every_steps), which see a freeze late in an epoch,
    else at an epoch end."""
    if run.probes:
        return next((s for s, acc in run.probes if acc >= target_val_acc), None)
    hits = run.metrics[run.metrics["val_acc"] >= target_val_acc]
    return float(hits["cumulative_wall_s"].iloc[0]) if len(hits) else None


def uses_probes(runs: list[Run]) -> bool:
    """Every run has probes: time to target is read on them, against a margin-based target."""
    return bool(runs) and all(r.probes for r in runs)


def ttt_target(base: list[Run], target_fraction: float, margin_points: float) -> float:
    """The val accuracy an arm must reach. With probes: the baseline's mean last-probe accuracy (the
    same fixed subset) minus the non-inferiority margin, the accuracy the study calls good enough.
    Without (older run directories): target_fraction x the baseline's mean final val accuracy."""
    if uses_probes(base):
        return float(np.mean([b.probes[-1][1] for b in base])) - margin_points / 100
    return target_fraction * float(np.mean([b.metrics["val_acc"].iloc[-1] for b in base]))


# The one speedup and the one time to target every table reports, named in their captions.
SPEEDUP_DEFINITION = (
    "speedup = geometric mean over seeds of baseline train time / arm train time, each run paired with the "
    "baseline run of its seed (train time: training wall time without evaluation)"
)


def ttt_definition(target_fraction: float, margin_points: float, probes: bool = False) -> str:
    if probes:
        return (
            "time to target = the first cumulative train time at which a probe (the fixed validation subset, "
            f"every train.probe_every_steps steps) reaches the baseline's mean last-probe accuracy minus "
            f"{margin_points:g} points"
        )
    return (
        f"time to target = the first cumulative train time at which val accuracy reaches {target_fraction:g} x "
        "the baseline's mean final val accuracy"
    )


def ratio_ci95(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of ``ratios`` and its 95 % interval (t on the logs); NaN bounds for n < 2."""
    logs = [math.log(r) for r in ratios if math.isfinite(r) and r > 0]
    mean, half = mean_ci95(logs)
    if not math.isfinite(mean):
        return math.nan, math.nan, math.nan
    if not math.isfinite(half):
        return math.exp(mean), math.nan, math.nan
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def paired_speedups(members: list[Run], base: list[Run]) -> list[float]:
    """Baseline train time / arm train time for each seed present on both sides, timed on the same
    kind of hardware (:meth:`Run.timed_like`; the paired table names the others)."""
    base_by_seed = {r.seed: r for r in base}
    return [
        train_wall_s(base_by_seed[r.seed]) / train_wall_s(r)
        for r in members
        if r.seed in base_by_seed and r.timed_like(base_by_seed[r.seed])
    ]


def _per_run_mean(runs: list[Run], column: str) -> float:
    """Mean over seeds of each run's mean over epochs (NaN where an epoch's value is unknown)."""
    return float(np.mean([r.metrics[column].mean(skipna=False) for r in runs])) if runs else math.nan


def _ratio(numerator: float, denominator: float) -> float:
    ok = all(math.isfinite(v) and v > 0 for v in (numerator, denominator))
    return numerator / denominator if ok else math.nan


def fmt_number(value: float, spec: str, suffix: str = "") -> str:
    return format(value, spec) + suffix if math.isfinite(value) else NA


def _fmt_acc(mean: float, half: float) -> str:
    return f"{fmt_number(100 * mean, '.2f')} ± {fmt_number(100 * half, '.2f')}"


def _fmt_p(p: float) -> str:
    if not math.isfinite(p):
        return NA
    return "<0.0001" if p < 1e-4 else f"{p:.4f}"


# A display column: header, alignment ("l" or "r"), and how to format it from one raw row.
Column = tuple[str, str, Callable[[dict], str]]


def display_columns(rows: list[dict], columns: list[Column]) -> tuple[pd.DataFrame, tuple[str, ...]]:
    """Every table's formatted strings (for markdown and LaTeX) and alignments, from its raw rows."""
    display = pd.DataFrame([[fmt(r) for _, _, fmt in columns] for r in rows], columns=[c[0] for c in columns])
    return display, tuple(c[1] for c in columns)


def main_table(
    runs: list[Run],
    baseline: Baseline,
    target_fraction: float,
    margin_points: float = DEFAULT_MARGIN_POINTS,
    iso: Mapping[GroupKey, IsoSpeedup] | None = None,
) -> Table:
    """One row per group. ``iso``: the groups' iso-accuracy speedups against the budget frontier
    (freeze.pipeline.report.frontier_tables.iso_speedups), a column beside the speedup when given."""
    iso = iso or {}
    groups = complete_groups(runs)
    compare = baseline.group is not None
    rows = []
    for key, members in groups.items():
        row = _main_row(members)
        if compare:
            base = baseline_runs(groups, baseline, key)
            row.update(_comparison(members, row, base, target_fraction, margin_points))
        row.update(iso_fields(iso.get(key)))
        rows.append(row)
    columns: list[Column] = [("setting", "l", lambda r: r["setting"])] if any(k.setting for k in groups) else []
    columns += [
        ("group", "l", lambda r: r["group"]),
        ("workers", "r", lambda r: str(r["world_size"])),
        ("policy", "l", lambda r: r["policy"]),
        ("n", "r", lambda r: str(r["n_runs"])),
        ("test acc % (final epoch) ± 95% CI", "r", lambda r: _fmt_acc(r["test_acc_mean"], r["test_acc_ci95"])),
    ]
    if compare:
        columns += [
            (
                "diff vs baseline (points)",
                "r",
                lambda r: "—" if r["test"] == "baseline" else fmt_number(r["diff_points"], "+.2f"),
            ),
            ("p", "r", lambda r: "—" if r["test"] == "baseline" else _fmt_p(r["p_value"])),
            ("test", "l", lambda r: r["test"]),
        ]
    columns.append(("train time (min)", "r", lambda r: fmt_number(r["wall_min"], ".2f")))
    if compare:
        columns += [
            ("speedup (paired)", "r", lambda r: fmt_number(r["speedup"], ".2f", "x")),
            *([ISO_COLUMN] if iso else []),
            ("time to target (min, runs that reached it)", "r", _fmt_time_to_target),
            (
                "reached",
                "r",
                lambda r: f"{r['ttt_reached']}/{r['n_runs']}" if math.isfinite(r["ttt_target_val_acc"]) else NA,
            ),
        ]
    if any(math.isfinite(r["peak_memory_mb"]) for r in rows):
        columns.append(("peak memory (MB, rank 0)", "r", lambda r: fmt_number(r["peak_memory_mb"], ".0f")))
    columns += [
        ("all-reduced (GB)", "r", lambda r: fmt_number(r["allreduce_gb"], ".3f")),
        ("frozen param fraction (mean over epochs)", "r", lambda r: fmt_number(r["frozen_fraction"], ".3f")),
    ]
    display, align = display_columns(rows, columns)
    notes = [baseline.note, *_learning_notes(groups)]
    missing = sorted({(s, ws) for s, _, ws in groups} - {(s, ws) for s, g, ws in groups if g == baseline.group})
    if compare and missing:
        where = "; ".join(f"{'setting ' + s + ', ' if s else ''}world_size {ws}" for s, ws in missing)
        notes.append(f"no complete baseline runs with {where}: comparisons n/a there")
    n_runs, n_incomplete = sum(map(len, groups.values())), sum(not r.is_complete for r in runs)
    caption = (
        f"Main results: {n_runs} complete runs in {len(groups)} groups ({n_incomplete} incomplete "
        f"{'run' if n_incomplete == 1 else 'runs'} excluded, listed separately); accuracy is the final-epoch test "
        "accuracy (mean ± 95% CI half-width over seeds, Student t), never the best epoch; train time is training "
        f"wall time without evaluation; {SPEEDUP_DEFINITION} (n/a without a shared seed); "
        f"{ttt_definition(target_fraction, margin_points, uses_probes(runs))}, mean over the runs that reached it "
        "(reached: how many)."
    )
    return Table("main", "Main results", caption, csv_frame(rows), display, align, tuple(notes))


def _learning_notes(groups: dict[GroupKey, list[Run]]) -> list[str]:
    """One note per group at chance or that froze nothing: such a row is no finding, whatever its numbers."""
    notes = []
    for key, members in groups.items():
        if at_chance(members):
            notes.append(chance_note(group_label(key), members))
        if froze_nothing(members):
            notes.append(
                f"{group_label(key)} FROZE NOTHING (frozen fraction 0 at every step of its {len(members)} runs): "
                "it computed what the baseline computes, so its speedup and accuracy are no finding about "
                f"{members[0].policy}"
            )
    return notes


def group_fields(run: Run) -> dict:
    """The columns that name a run's group in every table's raw rows."""
    return {"setting": run.setting, "group": run.group, "world_size": run.world_size, "policy": run.policy}


def _main_row(members: list[Run]) -> dict:
    """The numbers of one (group, world_size) that need no baseline."""
    acc_by_seed = {r.seed: final_test_acc(r) for r in members}
    acc_mean, acc_half = mean_ci95(list(acc_by_seed.values()))
    return {
        **group_fields(members[0]),
        "n_runs": len(members),
        "seeds": " ".join(str(s) for s in acc_by_seed),
        "test_acc_mean": acc_mean,
        "test_acc_ci95": acc_half,
        "wall_min": float(np.mean([train_wall_s(r) for r in members])) / 60,
        # a row read back holds the run's total in its last epoch; an older row none (NaN, not 0)
        "allreduce_gb": float(np.mean([r.metrics["allreduce_bytes"].sum(min_count=1) / 1e9 for r in members])),
        "frozen_fraction": _per_run_mean(members, "frozen_param_fraction"),
        # the process's peak over the whole run (older run directories did not record it: NaN)
        "peak_memory_mb": float(np.mean([r.metrics["peak_memory_bytes"].max() for r in members])) / 1e6,
        "at_chance": at_chance(members),
        "froze_nothing": froze_nothing(members),
    }


def csv_frame(rows: list[dict]) -> pd.DataFrame:
    """A table's CSV data: its rows without the objects kept for the display (``iso``)."""
    return pd.DataFrame([{k: v for k, v in r.items() if k != "iso"} for r in rows])


def iso_fields(found: IsoSpeedup | None) -> dict:
    """The iso-accuracy columns of a main or paired row (NaN without a frontier to read)."""
    if found is None:
        return {
            "iso_speedup": math.nan,
            "iso_speedup_low": math.nan,
            "iso_speedup_high": math.nan,
            "iso_verdict": "",
            "iso": None,
        }
    return {
        "iso_speedup": found.speedup,
        "iso_speedup_low": found.ci_low,
        "iso_speedup_high": found.ci_high,
        "iso_verdict": found.verdict(),  # beyond the frontier: yes / no / undecided / ...
        "iso": found,
    }


ISO_COLUMN: Column = (
    "iso-accuracy speedup [95% CI]",
    "r",
    lambda r: NA if r["iso"] is None else r["iso"].label(),
)


def _comparison(
    members: list[Run], row: dict, base_runs: list[Run] | None, target_fraction: float, margin_points: float
) -> dict:
    """Difference, test, speedup and time to target against the baseline runs of the same world size."""
    if not base_runs:
        return {
            "baseline_group": "",
            "diff_points": math.nan,
            "p_value": math.nan,
            "test": NA,
            "speedup": math.nan,
            "ttt_target_val_acc": math.nan,
            "ttt_min": math.nan,
            "ttt_reached": 0,
        }
    base_acc = {r.seed: final_test_acc(r) for r in base_runs}
    if members[0].group == base_runs[0].group:
        p_value, test = math.nan, "baseline"
    else:
        p_value, test = compare_seeds({r.seed: final_test_acc(r) for r in members}, base_acc)
    target = ttt_target(base_runs, target_fraction, margin_points)
    times = [time_to_target_s(r, target) for r in members] if math.isfinite(target) else []
    reached = [t for t in times if t is not None]
    return {
        "baseline_group": base_runs[0].group,
        "diff_points": 100 * (row["test_acc_mean"] - float(np.mean(list(base_acc.values())))),
        "p_value": p_value,
        "test": test,
        "speedup": ratio_ci95(paired_speedups(members, base_runs))[0],
        "ttt_target_val_acc": target,
        "ttt_min": float(np.mean(reached)) / 60 if reached else math.nan,
        "ttt_reached": len(reached),
    }


def _fmt_time_to_target(row: dict) -> str:
    if not math.isfinite(row["ttt_target_val_acc"]):
        return NA  # no baseline runs at this world size, or the baseline logged no val accuracy
    return "not reached" if row["ttt_reached"] == 0 else fmt_number(row["ttt_min"], ".2f")


def static_k(policy: str) -> int | None:
    """k of a "static:k=K" spec, 0 for "none", None for any other policy."""
    name, params = split_policy_spec(policy)
    if name == "none":
        return 0
    if name != "static":
        return None
    return next((int(v) for key, v in params if key == "k" and v is not None and v.strip().isdigit()), None)


STATIC_SWEEP_COLUMNS = [
    "k",
    "setting",
    "group",
    "world_size",
    "n_runs",
    "epoch_wall_s",
    "test_acc_mean",
    "test_acc_ci95",
    "reference_group",
    "speedup_per_epoch",
]
NO_STATIC_ARM = (
    "No static arm in these runs (no complete group with policy static:k=K, K > 0): no static-k sweep to show."
)


def static_sweep_table(runs: list[Run], baseline: Baseline) -> Table:
    groups = {key: m for key, m in complete_groups(runs).items() if static_k(m[0].policy) is not None}
    k_of = {key: static_k(members[0].policy) for key, members in groups.items()}
    if not any(k_of.values()):
        # Only policy none (k = 0), or nothing: a table of k = 0 rows compares nothing with nothing.
        empty = pd.DataFrame(columns=STATIC_SWEEP_COLUMNS)
        return Table("static_sweep", "Static-k sweep", NO_STATIC_ARM, empty, empty, (), ())
    order = sorted(groups, key=lambda key: (key.setting, key.world_size, k_of[key], key.group))
    notes = []
    rows = []
    for key in order:
        members = groups[key]
        # The k = 0 reference: the chosen baseline when it is a k = 0 group, else policy none first.
        zero = sorted(
            (z for z in order if z.setting == key.setting and z.world_size == key.world_size and k_of[z] == 0),
            key=lambda z: (z.group != baseline.group, groups[z][0].policy != "none", z.group),
        )
        s_per_epoch = _per_run_mean(members, "epoch_wall_s")
        ref_s = _per_run_mean(groups[zero[0]], "epoch_wall_s") if zero else math.nan
        acc_mean, acc_half = mean_ci95([final_test_acc(r) for r in members])
        rows.append(
            {
                "k": k_of[key],
                "setting": key.setting,
                "group": key.group,
                "world_size": key.world_size,
                "n_runs": len(members),
                "epoch_wall_s": s_per_epoch,
                "test_acc_mean": acc_mean,
                "test_acc_ci95": acc_half,
                "reference_group": zero[0][1] if zero else "",
                "speedup_per_epoch": _ratio(ref_s, s_per_epoch),
            }
        )
        if not zero:
            notes.append(
                f"no k = 0 group with world_size {key.world_size}{' in ' + key.setting if key.setting else ''}: speedup n/a"
            )
    columns: list[Column] = [("setting", "l", lambda r: r["setting"])] if any(k.setting for k in groups) else []
    columns += [
        ("k", "r", lambda r: str(r["k"])),
        ("group", "l", lambda r: r["group"]),
        ("workers", "r", lambda r: str(r["world_size"])),
        ("n", "r", lambda r: str(r["n_runs"])),
        ("s/epoch", "r", lambda r: fmt_number(r["epoch_wall_s"], ".2f")),
        ("test acc % (final epoch) ± 95% CI", "r", lambda r: _fmt_acc(r["test_acc_mean"], r["test_acc_ci95"])),
        ("speedup per epoch vs k=0", "r", lambda r: fmt_number(r["speedup_per_epoch"], ".2f", "x")),
    ]
    display, align = display_columns(rows, columns)
    caption = (
        "Static-k sweep (the reference study's view): the first k blocks frozen from the first step, policy none "
        f"as k = 0; {sum(r['n_runs'] for r in rows)} complete runs; s/epoch is the mean training wall time per "
        "epoch (no eval); accuracy is the final-epoch test accuracy (mean ± 95% CI half-width)."
    )
    return Table(
        "static_sweep",
        "Static-k sweep",
        caption,
        pd.DataFrame(rows, columns=STATIC_SWEEP_COLUMNS),
        display,
        align,
        tuple(dict.fromkeys(notes)),
    )


def phase_table(runs: list[Run], baseline: Baseline, left_out: int = 0) -> Table:
    """Mean phase times per group. ``left_out``: how many runs without phase times (read back from
    per-seed rows older than those columns) the caller left out, said in the caption."""
    groups = complete_groups(runs)
    rows = []
    for key, members in groups.items():
        base_runs = baseline_runs(groups, baseline, key)
        row = {"setting": key.setting, "group": key.group, "world_size": key.world_size, "n_runs": len(members)}
        for phase, column in PHASE_COLUMNS.items():
            seconds = _per_run_mean(members, column)
            speedup = _ratio(_per_run_mean(base_runs, column), seconds) if base_runs else math.nan
            row[f"{phase}_s"], row[f"{phase}_speedup"] = seconds, speedup
        rows.append(row)

    def seconds_and_speedup(phase: str) -> Callable[[dict], str]:
        def fmt(r: dict) -> str:
            speedup = f" ({fmt_number(r[f'{phase}_speedup'], '.2f', 'x')})" if baseline.group else ""
            return fmt_number(r[f"{phase}_s"], ".2f") + speedup

        return fmt

    columns: list[Column] = [("setting", "l", lambda r: r["setting"])] if any(k.setting for k in groups) else []
    columns += [
        ("group", "l", lambda r: r["group"]),
        ("workers", "r", lambda r: str(r["world_size"])),
        ("n", "r", lambda r: str(r["n_runs"])),
        *[(f"{phase} (s)", "r", seconds_and_speedup(phase)) for phase in PHASE_COLUMNS],
    ]
    display, align = display_columns(rows, columns)
    vs = ""
    if baseline.group:
        vs = f"; in brackets the ratio baseline phase time / this phase time, vs {baseline.group!r} (n/a when a side is 0)"
    caption = (
        f"Mean per-epoch phase times in seconds over {sum(map(len, groups.values()))} complete runs; backward includes "
        f"communication; total is epoch_wall_s (no eval){vs}."
    )
    if left_out:
        caption += (
            f" Not in it: {left_out} runs read back from per-seed rows that record no phase times "
            "(their training seconds are in the main and paired tables)."
        )
    return Table("phases", "Phase times per epoch", caption, pd.DataFrame(rows), display, align, (baseline.note,))


NO_INCOMPLETE = "No incomplete runs: every run finished the epochs it planned."


def incomplete_table(runs: list[Run]) -> Table:
    members = sorted((r for r in runs if not r.is_complete), key=lambda r: (r.group, r.world_size, r.seed, r.name))
    rows = [
        {
            "run": r.name,
            "group": r.group,
            "world_size": r.world_size,
            "seed": r.seed,
            "status": r.status,
            "epochs_done": r.manifest["epochs_done"],
            "epochs_planned": r.manifest["epochs_planned"],
            "reason": r.incomplete_reason,
        }
        for r in members
    ]
    columns: list[Column] = [
        ("run", "l", lambda r: r["run"]),
        ("group", "l", lambda r: r["group"]),
        ("workers", "r", lambda r: str(r["world_size"])),
        ("seed", "r", lambda r: str(r["seed"])),
        ("status", "l", lambda r: r["status"]),
        ("epochs", "r", lambda r: f"{r['epochs_done']}/{r['epochs_planned']}"),
        ("reason", "l", lambda r: r["reason"]),
    ]
    display, align = display_columns(rows, columns)
    caption = (
        f"Incomplete runs ({len(rows)}): status running or failed, or fewer epochs than planned; "
        "excluded from every mean above."
    )
    frame_columns = ["run", "group", "world_size", "seed", "status", "epochs_done", "epochs_planned", "reason"]
    frame = pd.DataFrame(rows, columns=frame_columns)
    return Table("incomplete", "Incomplete runs", caption, frame, display, align, () if rows else (NO_INCOMPLETE,))
