"""Run directories -> PNG figures (matplotlib's Agg canvas; no pyplot, so no display and no global state).

Only complete runs are drawn, the same runs the tables average. A group's line is the mean over its
seeds and its band spans min..max over seeds, so one bad seed stays visible.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from freeze._atomic import atomic_write
from freeze.pipeline.report.load import Run
from freeze.pipeline.report.tables import PHASE_COLUMNS, GroupKey, Table, complete_groups, group_label
from freeze.pipeline.schema import TRAIN_PHASES
from freeze.policies import Policy, PolicyError, parse_policy

_DPI = 110


def _label(key: GroupKey, multi_world_size: bool) -> str:
    label = group_label(key)
    return f"{label} ({key.world_size} workers)" if multi_world_size else label


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "group"


def _per_epoch(members: list[Run], column: str) -> np.ndarray:
    """seeds x epochs, NaN-padded when seeds ran different numbers of epochs."""
    n_epochs = max(len(r.metrics) for r in members)
    out = np.full((len(members), n_epochs), np.nan)
    for i, run in enumerate(members):
        out[i, : len(run.metrics)] = run.metrics[column].to_numpy(dtype=float)
    return out


def _mean_min_max(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # NaN propagates on purpose: an epoch some seed did not evaluate is skipped rather than drawn as a
    # mean over fewer seeds, which would make the line jump between different subsets.
    return values.mean(axis=0), values.min(axis=0), values.max(axis=0)


# Groups that compute the same numbers (the control on the baseline) draw identical lines: each group
# gets its own dash pattern and marker, so a line drawn over another still shows both.
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def line_style(index: int) -> dict:
    """The dash pattern and marker of the index-th group in a figure (distinct for the first 8)."""
    return {"linestyle": _LINESTYLES[index % len(_LINESTYLES)], "marker": _MARKERS[index % len(_MARKERS)]}


def accuracy_column(groups: dict[GroupKey, list[Run]]) -> tuple[str, str]:
    """("test_acc", "test") when every run has test accuracy at more than one epoch; otherwise
    ("val_acc", "validation"): a study run with train.test_eval = final has test accuracy at its last
    epoch only, which draws one dot per group on a meaningless axis, while validation accuracy exists
    at every evaluated epoch."""
    runs = [r for members in groups.values() for r in members]
    if all(int(np.isfinite(r.metrics["test_acc"].to_numpy(dtype=float)).sum()) > 1 for r in runs):
        return "test_acc", "test"
    return "val_acc", "validation"


def _draw_band(ax, x: np.ndarray, values: np.ndarray, label: str, index: int = 0) -> None:
    mean, low, high = _mean_min_max(values)
    ok = np.isfinite(mean) & np.isfinite(x)
    line = ax.plot(x[ok], mean[ok], markersize=4, label=label, **line_style(index))[0]
    if len(values) > 1:
        ax.fill_between(x[ok], low[ok], high[ok], color=line.get_color(), alpha=0.2, linewidth=0)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, dpi=_DPI, format=path.suffix.lstrip(".")))
    return path


def plot_accuracy_vs_epoch(groups: dict[GroupKey, list[Run]], path: Path) -> Path:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    multi = len({ws for _, _, ws in groups}) > 1
    column, name = accuracy_column(groups)
    for i, (key, members) in enumerate(groups.items()):
        acc = 100 * _per_epoch(members, column)
        _draw_band(ax, np.arange(1, acc.shape[1] + 1, dtype=float), acc, _label(key, multi), i)
    ax.set_xlabel("epoch (1 = after the first epoch)")
    ax.set_ylabel(f"{name} accuracy (%)")
    ax.set_title(f"{name.capitalize()} accuracy per epoch (mean over seeds, band = min..max)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_accuracy_vs_time(groups: dict[GroupKey, list[Run]], path: Path) -> Path:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    multi = len({ws for _, _, ws in groups}) > 1
    column, name = accuracy_column(groups)
    for i, (key, members) in enumerate(groups.items()):
        minutes, _, _ = _mean_min_max(_per_epoch(members, "cumulative_wall_s") / 60)
        _draw_band(ax, minutes, 100 * _per_epoch(members, column), _label(key, multi), i)
    ax.set_xlabel("cumulative training wall time (min, no eval; mean over seeds)")
    ax.set_ylabel(f"{name} accuracy (%)")
    ax.set_title(f"{name.capitalize()} accuracy vs training time (band = min..max over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_freeze_boundary(groups: dict[GroupKey, list[Run]], path: Path) -> Path:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    multi = len({ws for _, _, ws in groups}) > 1
    for i, (key, members) in enumerate(groups.items()):
        boundary = _per_epoch(members, "boundary")
        _draw_band(ax, np.arange(1, boundary.shape[1] + 1, dtype=float), boundary, _label(key, multi), i)
    ax.set_xlabel("epoch (1 = after the first epoch)")
    ax.set_ylabel("frozen leading blocks k (end of epoch)")
    ax.set_title("Freeze boundary per epoch (mean over seeds, band = min..max)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _eta_role(run: Run) -> str:
    """Whether the run's policy decides from eta (it compares eta with a threshold) or only records
    it: a heatmap of a signal the policy never reads must not read as its reason (issue 48)."""
    spec = str(run.manifest.get("policy") or "")
    try:
        policy = parse_policy(spec)
    except PolicyError:
        return f"policy {spec or 'unknown'}: whether it reads eta is unknown here"
    if type(policy).threshold is not Policy.threshold:
        return f"{policy.name} freezes a block when its eta falls below the threshold"
    return f"recorded only: {policy.name} does not decide from eta (its explain lines say what it reads)"


def plot_eta_heatmap(key: GroupKey, run: Run, path: Path) -> Path:
    """Per-block eta over epochs for one run; grey cells are null (frozen, or no previous interval)."""
    eta = np.ma.masked_invalid(run.eta.T)  # blocks x epochs
    fig = Figure(figsize=(max(6.5, 0.35 * eta.shape[1] + 3), max(3.5, 0.3 * eta.shape[0] + 2.0)))
    ax = fig.add_subplot()
    vmax = float(eta.max()) if eta.count() else 1.0
    image = ax.imshow(
        eta,
        aspect="auto",
        interpolation="nearest",
        vmin=0.0,
        vmax=vmax or 1.0,
        cmap=colormaps["viridis"].with_extremes(bad="lightgrey"),
        extent=(0.5, eta.shape[1] + 0.5, eta.shape[0] - 0.5, -0.5),
    )
    ax.set_yticks(range(len(run.block_names)), run.block_names, fontsize="small")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch (1 = first epoch)")
    ax.set_ylabel("block (input at top)")
    ax.set_title(
        f"{group_label(key)} ({key.world_size} workers), seed {run.seed}\n"
        "eta = |G_prev - G_cur| / G_prev; grey = null (frozen or undefined)\n" + _eta_role(run),
        fontsize="small",
    )
    fig.colorbar(image, ax=ax, label="eta (unitless)")
    return _save(fig, path)


def plot_phase_times(groups: dict[GroupKey, list[Run]], path: Path) -> Path:
    fig = Figure(figsize=(max(6.0, 1.2 * len(groups) + 3), 4.5))
    ax = fig.add_subplot()
    multi = len({ws for _, _, ws in groups}) > 1
    x = np.arange(len(groups))
    bottom = np.zeros(len(groups))
    for phase in TRAIN_PHASES:
        seconds = np.array([np.mean([r.metrics[PHASE_COLUMNS[phase]].mean() for r in m]) for m in groups.values()])
        ax.bar(x, seconds, bottom=bottom, label=phase)
        bottom += seconds
    ax.set_xticks(x, [_label(key, multi) for key in groups], rotation=20, ha="right", fontsize="small")
    ax.set_xlabel("group")
    ax.set_ylabel("seconds per epoch (mean over epochs and seeds)")
    ax.set_title("Per-epoch phase times (backward includes communication; no eval)")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _against(paired: pd.DataFrame) -> str:
    """The title's " against baseline 'none'": the group every point is compared with (the report may
    have chosen it among several policy-none groups, or --baseline named it)."""
    names = sorted(set(paired["baseline"])) if "baseline" in paired else []
    if not names:
        return ""
    return f" against baseline {', '.join(repr(n) for n in names)}"


def _group_colour(index: int, n_groups: int) -> tuple[float, ...]:
    """The index-th of n_groups distinct colours: tab10's, or beyond 10 groups tab20's dark shades
    first and then its light ones, so that neighbouring groups never get two shades of one hue."""
    if n_groups <= 10:
        return colormaps["tab10"](index % 10)
    index %= 20
    return colormaps["tab20"](2 * index if index < 10 else 2 * (index - 10) + 1)


def _is_frontier_row(paired: pd.DataFrame) -> pd.Series:
    """The budget frontier's rows: policy none trained on a fraction of the steps."""
    if "budget_fraction" not in paired:
        return pd.Series(False, index=paired.index)
    return (paired["policy"] == "none") & (paired["budget_fraction"] < 1.0)


def _draw_frontier(ax, rows: pd.DataFrame, label: str):
    """The frontier as a curve from full fine-tuning (0 points, 1x) through each budget, with a band
    of each budget's accuracy interval: an arm up and to the right of it beats training less."""
    rows = rows.sort_values("speedup")
    x = np.concatenate([[0.0], rows["diff_points"].to_numpy(float)])
    y = np.concatenate([[1.0], rows["speedup"].to_numpy(float)])
    low = np.concatenate([[0.0], rows["diff_low"].to_numpy(float)])
    high = np.concatenate([[0.0], rows["diff_high"].to_numpy(float)])
    ax.fill_betweenx(y, low, high, color="black", alpha=0.12, linewidth=0)
    (line,) = ax.plot(x, y, color="black", marker=".", linewidth=1.2, label=label)
    return line


def plot_pareto(paired: pd.DataFrame, margin_points: float | None, path: Path) -> Path:
    """Speedup against accuracy difference, one point per (setting, group), 95 % intervals both ways:
    the study's headline picture (up and to the right of the margin line is a win).

    One panel per setting, sharing the speedup axis, and one colour and marker per group in every
    panel with a single legend: a study of a dozen arms puts most of its points near (0, 1x), where
    text labels beside each point would cover one another. The budget frontier, where the runs hold
    one, is a curve with its band (a setting without budget runs draws the first one's, dashed)."""
    frontier = paired[_is_frontier_row(paired)]
    paired = paired[~_is_frontier_row(paired)]
    settings = sorted(set(paired["setting"]) | set(frontier["setting"]))
    groups = sorted(set(paired["group"]))
    style = {
        g: {"color": _group_colour(i, len(groups)), "fmt": _MARKERS[i % len(_MARKERS)]} for i, g in enumerate(groups)
    }
    fig = Figure(figsize=(1.5 + 4.5 * len(settings), 5))
    axes = fig.subplots(1, len(settings), sharey=True, squeeze=False)[0]
    handles, margin_line, frontier_line = {}, None, None
    frontier_settings = sorted(set(frontier["setting"]))
    for ax, setting in zip(axes, settings, strict=True):
        source = setting if setting in frontier_settings else next(iter(frontier_settings), None)
        if source is not None:
            borrowed = "" if source == setting else f" (from {source})"
            frontier_line = _draw_frontier(ax, frontier[frontier["setting"] == source], f"budget frontier{borrowed}")
            if borrowed:
                frontier_line.set_linestyle("--")
        for row in paired[paired["setting"] == setting].itertuples(index=False):
            x, y = row.diff_points, row.speedup
            if not (np.isfinite(x) and np.isfinite(y)):
                continue
            xerr = [[x - row.diff_low], [row.diff_high - x]] if np.isfinite(row.diff_low) else None
            yerr = [[y - row.speedup_low], [row.speedup_high - y]] if np.isfinite(row.speedup_low) else None
            handles[row.group] = ax.errorbar(
                x, y, xerr=xerr, yerr=yerr, capsize=3, markersize=6, elinewidth=1, **style[row.group]
            )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.axvline(0.0, color="grey", linewidth=0.8)
        if margin_points:
            margin_line = ax.axvline(-margin_points, color="red", linestyle="--", linewidth=0.8)
        ax.set_xlabel("final test accuracy - baseline's\n(points, paired over seeds, 95% CI)")
        ax.set_title((f"{setting}: " if setting else "") + "speedup vs accuracy" + _against(paired), fontsize="small")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup in train wall time (x, geometric mean, 95% CI)")
    legend = [(handles[g], g) for g in groups if g in handles]
    if margin_line is not None:
        legend.append((margin_line, f"-{margin_points:g} point margin"))
    if frontier_line is not None:
        legend.append((frontier_line, "budget frontier (train less)"))
    if legend:  # beside the last panel; tight_layout (in _save) makes room for it
        axes[-1].legend(*zip(*legend, strict=True), loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    return _save(fig, path)


def write_plots(
    runs: list[Run], out_dir: Path, tables: list[Table] = (), margin_points: float | None = None
) -> dict[str, Path]:
    """All figures for the complete runs; returns file name -> path (nothing when none is complete).

    Args:
        runs: every loaded run directory (incomplete ones are skipped).
        out_dir: where the PNGs go.
        tables: the report's tables; the Pareto figure is drawn from the "paired" one when present.
        margin_points: the non-inferiority margin drawn on the Pareto figure (None: not drawn).
    """
    groups = complete_groups(runs)
    if not groups:
        return {}
    out_dir = Path(out_dir)
    paths = [
        plot_accuracy_vs_epoch(groups, out_dir / "accuracy_vs_epoch.png"),
        plot_accuracy_vs_time(groups, out_dir / "accuracy_vs_time.png"),
        plot_freeze_boundary(groups, out_dir / "freeze_boundary.png"),
    ]
    # runs read back from per-seed rows older than their phase columns have no phase times
    timed = complete_groups([r for r in runs if r.has_phase_times])
    if timed:
        paths.append(plot_phase_times(timed, out_dir / "phase_times.png"))
    paired = next((t for t in tables if t.name == "paired"), None)
    if paired is not None and len(paired.data):  # the frontier's budget rows are in it too
        paths.append(plot_pareto(paired.data, margin_points, out_dir / "pareto.png"))
    for key, members in groups.items():
        # Runs record summed-gradient norms only when their policy reads them (or when
        # freeze.track_summed_grads is set); an all-undefined heatmap would say nothing. The first
        # seed that has them (runs read back from per-seed rows have no eta).
        drawn = next((r for r in members if np.isfinite(r.eta).any()), None)
        if drawn is not None:
            name = f"eta_{_slug(group_label(key))}_ws{key.world_size}.png"
            paths.append(plot_eta_heatmap(key, drawn, out_dir / name))
    return {p.name: p for p in paths}
