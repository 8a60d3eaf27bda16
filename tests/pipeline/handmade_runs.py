"""Runs made by hand for the report's tests: one epoch each, with the numbers a test chooses, so a
table computed from them has an answer known in advance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from freeze.pipeline.report.load import Run
from freeze.pipeline.schema import PHASES


def epoch_record(step: int, boundary: int, time_s: float, acc_pct: float, frozen_fraction: float) -> dict:
    """The one epoch record of a hand-made run: ``step`` steps in ``time_s`` seconds, ending at
    ``acc_pct`` % on validation and test."""
    return {
        "epoch": 0,
        "boundary": boundary,
        "step": step,
        "test_acc": acc_pct / 100,
        "val_acc": acc_pct / 100,
        "cumulative_wall_s": time_s,
        "epoch_wall_s": time_s,
        "frozen_param_fraction": frozen_fraction,
        "allreduce_bytes": 1e9,
        "peak_memory_bytes": 2e9,
        **{f"phase_{p}_s": time_s / len(PHASES) for p in PHASES},
    }


def handmade_run(
    setting: str,
    group: str,
    seed: int,
    policy: str,
    time_s: float,
    acc_pct: float,
    steps: int,
    *,
    fraction: float = 1.0,
    changes: tuple[tuple[int, int], ...] = (),
    blocks: int = 10,
    frozen_fraction: float | None = None,
    comm_hook: str = "allreduce",
) -> Run:
    """One complete single-epoch run of ``steps`` steps (``fraction`` of the budget) whose boundary
    changed at each (step, boundary) of ``changes``."""
    manifest = {
        "group": group,
        "policy": policy,
        "seed": seed,
        "setting": setting,
        "world_size": 2,
        "status": "complete",
        "epochs_done": 1,
        "epochs_planned": 1,
        "block_names": [f"b{i}" for i in range(blocks)],
    }
    config = {"train": {"budget_fraction": fraction}, "freeze": {"policy": policy, "comm_hook": comm_hook}}
    final_boundary = changes[-1][1] if changes else 0
    if frozen_fraction is None:
        frozen_fraction = 0.5 if final_boundary else 0.0
    metrics = pd.DataFrame([epoch_record(steps, final_boundary, time_s, acc_pct, frozen_fraction)])
    return Run(
        Path(f"/runs/{setting}_{group}_{seed}"),
        manifest,
        config,
        metrics,
        np.zeros((1, blocks)),
        boundary_steps=tuple(changes),
    )
