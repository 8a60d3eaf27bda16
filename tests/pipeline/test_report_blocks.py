"""freeze.pipeline.report.blocks: one row per seed block - when it ran, how many runs, the load range."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from freeze.pipeline.report.blocks import blocks_table
from freeze.pipeline.report.load import Run


def run(seed: int, start: str, end: str, loads: tuple[float, float], complete: bool = True) -> Run:
    manifest = {
        "run_name": f"r{seed}{start}",
        "group": "none",
        "policy": "none",
        "seed": seed,
        "status": "complete" if complete else "running",
        "epochs_planned": 1,
        "epochs_done": 1 if complete else 0,
        "start_time": start,
        "end_time": end,
        "load_avg_1min_start": loads[0],
        "load_avg_1min_end": loads[1],
        "hardware": {"cpu": "AMD EPYC", "cores": 2, "gpus": [], "device": "cpu"},
    }
    metrics = pd.DataFrame({"epoch": [0], "val_acc": [0.9]}) if complete else pd.DataFrame({"epoch": []})
    return Run(Path(f"/x/{seed}/{start}"), manifest, {}, metrics, np.zeros((1, 1)))


def test_one_row_per_seed_with_span_runs_and_load_range():
    runs = [
        run(0, "2026-11-25T00:00:00+00:00", "2026-11-25T00:02:00+00:00", (1.5, 1.9)),
        run(0, "2026-11-25T00:02:05+00:00", "2026-11-25T00:31:00+00:00", (2.0, 3.4)),
        run(1, "2026-11-26T09:00:00+00:00", "2026-11-26T09:01:00+00:00", (0.2, 1.1), complete=False),
    ]
    table = blocks_table(runs)
    rows = table.data.set_index("seed")
    assert rows.loc[0, "runs"] == 2 and rows.loc[0, "complete"] == 2
    assert rows.loc[0, "span_min"] == 31.0
    assert (rows.loc[0, "load_min"], rows.loc[0, "load_max"]) == (1.5, 3.4)
    assert rows.loc[1, "complete"] == 0  # an unfinished block shows as such
    display = table.display.iloc[0].tolist()
    assert "2026-11-25 00:00" in display and "2026-11-25 00:31" in display and "1.5-3.4" in display
    assert "AMD EPYC, 2 cores" in display


def test_runs_without_times_or_loads_read_n_a():
    bare = run(2, "", "", (float("nan"), float("nan")))
    table = blocks_table([bare])
    assert table.display.iloc[0].tolist()[2:6] == ["n/a", "n/a", "n/a", "n/a"]
