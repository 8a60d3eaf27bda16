"""Time to target on probes (issue 35): the target is the baseline's last-probe accuracy minus the
margin, read at every probe, so a freeze late in an epoch shows; runs without probes keep the
epoch-end rule. Hand-made runs whose answer is known."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from freeze.pipeline.report.load import Run
from freeze.pipeline.report.paired import paired_row
from freeze.pipeline.report.tables import time_to_target_s, ttt_definition, ttt_target


def _run(group, seed, probes=(), val_accs=(0.5, 0.9), ends_s=(50.0, 100.0)) -> Run:
    manifest = {
        "group": group, "policy": "none", "seed": seed, "setting": "", "world_size": 2, "status": "complete",
        "epochs_done": 2, "epochs_planned": 2, "block_names": ["a"],
    }  # fmt: skip
    metrics = pd.DataFrame(
        [
            {"epoch": e, "val_acc": v, "test_acc": v, "cumulative_wall_s": s}
            for e, (v, s) in enumerate(zip(val_accs, ends_s))
        ]
    )
    return Run(Path(f"/r/{group}{seed}"), manifest, {}, metrics, np.zeros((2, 1)), tuple(probes))


BASE_PROBES = ((25.0, 0.70), (50.0, 0.85), (75.0, 0.895), (100.0, 0.900))


def test_with_probes_the_target_is_the_baseline_s_last_probe_minus_the_margin_and_read_at_every_probe():
    base = [_run("none", s, BASE_PROBES) for s in (0, 1)]
    assert ttt_target(base, 0.95, 0.5) == pytest.approx(0.895)
    assert time_to_target_s(base[0], 0.895) == 75.0  # between epoch ends: the epoch end says 100
    # an arm that freezes late and gets there in the second half of its second epoch, sooner in time
    arm = [_run("late", s, ((20.0, 0.72), (40.0, 0.86), (60.0, 0.896), (80.0, 0.899))) for s in (0, 1)]
    row = paired_row(arm, base, 0.95, 0.5)
    assert row["ttt_target_val_acc"] == pytest.approx(0.895) and row["ttt_speedup"] == pytest.approx(75 / 60)
    assert "reaches the baseline's mean last-probe accuracy minus 0.5 points" in ttt_definition(0.95, 0.5, True)


def test_without_probes_the_epoch_end_rule_of_older_run_directories_holds():
    base = [_run("none", s) for s in (0, 1)]
    assert ttt_target(base, 0.95, 0.5) == pytest.approx(0.95 * 0.9)
    assert time_to_target_s(base[0], 0.855) == 100.0
    assert "0.95 x the baseline's mean final val accuracy" in ttt_definition(0.95, 0.5)
