"""One row per complete run: what every paired number of a report is computed from (issue 46).

A study's run directories are not committed (they hold checkpoints and weights); this table is, as
``report/per-seed/<study>.csv`` (the study command's ``--update-report``), so that a reader can
recompute a paired difference, a speedup, an iso-accuracy ratio or a freeze step without ``runs/``.
Lists inside a cell are ``;``-separated: per epoch, and per boundary change (``step:k``) and probe
(``train s:val acc``) in the order they happened. The rows are also a report's input when the run
directories are gone (freeze.pipeline.report.rows): what the main, phase and blocks tables read (bytes
on the wire, peak memory, mean phase seconds per epoch, when the run started and ended and the load
then) is in them too.
"""

from __future__ import annotations

import math

import pandas as pd

from freeze.pipeline.report.load import Run
from freeze.pipeline.report.tables import Column, Table, display_columns, final_test_acc, fmt_number, train_wall_s
from freeze.pipeline.schema import TRAIN_PHASES

# manifest fields a row carries as they are, with their kinds: when and under what load a run ran (the
# blocks table's), its classes and test images (the report's at-chance check)
MANIFEST_COLUMNS = {
    "start_time": str,
    "end_time": str,
    "load_avg_1min_start": float,
    "load_avg_1min_end": float,
    "num_classes": int,
    "test_images": int,
}

CAPTION = (
    "Every complete run, one row per seed and arm: final-epoch test and validation accuracy (never the best "
    "epoch), optimizer steps, training seconds (evaluation excluded) and the hardware they were timed on, the "
    "boundary after every change (step:k) and per epoch, and the probes' (train s:val acc); the CSV has "
    "every column, at full precision."
)


def per_seed_table(runs: list[Run]) -> Table:
    """The per-seed rows of the complete runs, sorted by setting, group and seed."""
    complete = sorted((r for r in runs if r.is_complete), key=lambda r: (r.setting, r.group, r.seed, r.name))
    rows = [_row(run) for run in complete]
    columns: list[Column] = [
        ("setting", "l", lambda r: r["setting"]),
        ("group", "l", lambda r: r["group"]),
        ("seed", "r", lambda r: str(r["seed"])),
        ("steps", "r", lambda r: fmt_number(r["steps"], ".0f")),
        ("train s", "r", lambda r: fmt_number(r["train_s"], ".1f")),
        ("test acc %", "r", lambda r: fmt_number(100 * r["test_acc"], ".2f")),
        ("final boundary", "r", lambda r: fmt_number(r["final_boundary"], ".0f")),
        ("boundary changes (step:k)", "l", lambda r: r["boundary_steps"] or "none"),
    ]
    display, align = display_columns(rows, columns)
    return Table("per_seed", "Per-seed results", CAPTION, pd.DataFrame(rows), display, align)


def _row(run: Run) -> dict:
    metrics = run.metrics
    val = metrics["val_acc"].iloc[-1]
    return {
        "setting": run.setting,
        "group": run.group,
        "seed": run.seed,
        "run": run.name,
        "policy": run.policy,
        "comm_hook": run.comm_hook,
        "budget_fraction": run.budget_fraction,
        "world_size": run.world_size,
        "epochs": len(metrics),
        "steps": run.final_step,  # NaN in a run directory older than the step count
        "train_s": train_wall_s(run),
        "test_acc": final_test_acc(run),
        "val_acc": float(val) if val is not None and not pd.isna(val) else math.nan,
        "final_boundary": float(metrics["boundary"].iloc[-1]),
        "boundary_steps": ";".join(f"{step}:{k}" for step, k in run.boundary_steps),
        "boundary_per_epoch": ";".join(_number(k) for k in metrics["boundary"]),
        "val_acc_per_epoch": ";".join(_number(v) for v in metrics["val_acc"]),
        "frozen_fraction_per_epoch": ";".join(_number(v) for v in metrics["frozen_param_fraction"]),
        "train_s_per_epoch": ";".join(_number(v) for v in metrics["cumulative_wall_s"]),
        "probes": ";".join(f"{_number(s)}:{_number(acc)}" for s, acc in run.probes),
        "timed_on": run.timing_kind,
        "allreduce_bytes": float(metrics["allreduce_bytes"].sum(min_count=1)),
        "peak_memory_bytes": float(metrics["peak_memory_bytes"].max()),
        # mean seconds per epoch, as the phase table reads them
        **{f"phase_{phase}_s": float(metrics[f"phase_{phase}_s"].mean()) for phase in TRAIN_PHASES},
        **{key: _manifest_value(run.manifest.get(key)) for key in MANIFEST_COLUMNS},
        "machine_cores": _manifest_value(run.hardware.get("cores")),  # the blocks table's machine
    }


def _manifest_value(value: object) -> object:
    return value if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""


def _number(value: object) -> str:
    number = float(value) if value is not None else math.nan
    return "" if not math.isfinite(number) else f"{number:.6g}"
