"""experiments.per_seed_contrast: the pre-registered contrasts and the iso-accuracy speedups,
recomputed from a committed per-seed CSV alone (issue 46), on hand-made rows whose answer is known."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments.per_seed_contrast import main

SEEDS = (0, 1, 2)


def _csv(tmp_path, control_train_s: float | None = None):
    rows = []
    for seed in SEEDS:
        wobble = 0.001 * seed
        for f in (0.5, 0.75):
            rows.append(("loopback", f"budget-{f}", seed, "none", f, 100 * f, 0.80 + 0.2 * (f - 0.5) + wobble))
        rows.append(("loopback", "none", seed, "none", 1.0, 100.0, 0.90 + wobble))
        rows.append(("loopback", "hard", seed, "at:k=9,t=0.5", 1.0, 75.0, 0.84 + wobble))
        rows.append(("loopback", "annealed", seed, "at:k=9,t=0.5,anneal=0.15", 1.0, 70.0, 0.86 + wobble + 0.002 * seed))
        if control_train_s is not None:  # the baseline run again: its accuracy, at the time given
            rows.append(("loopback", "control", seed, "none", 1.0, control_train_s, 0.90 + wobble))
    frame = pd.DataFrame(rows, columns=["setting", "group", "seed", "policy", "budget_fraction", "train_s", "test_acc"])
    path = tmp_path / "per_seed.csv"
    frame.to_csv(path, index=False)
    return path


def test_the_contrast_and_the_frontier_come_from_the_csv_alone(tmp_path, capsys):
    path = _csv(tmp_path)
    assert main([str(path), "--contrast", "annealed=hard", "--frontier"]) == 0
    out = capsys.readouterr().out
    # annealed - hard: +2.0, +2.2, +2.4 points
    assert "| annealed - hard | 3 | +2.20 | +1.70 | +2.70 | +2.00 +2.20 +2.40 |" in out
    # hard at 84 %: each seed's frontier reaches it at 70 s (4/5 of the way from 50 s to 75 s), against its 75 s
    assert "| hard | 3 | 0.93x [0.93, 0.93] | no (below the frontier) |" in out


def test_the_control_checks_the_statistic_as_the_reports_table_does(tmp_path, capsys):
    assert main([str(_csv(tmp_path)), "--frontier"]) == 0
    assert "No control group in this setting" in capsys.readouterr().out
    assert main([str(_csv(tmp_path, control_train_s=100.0)), "--frontier"]) == 0
    out = capsys.readouterr().out
    assert "| control | 3 | 1.00x [1.00, 1.00] | no (not by 1.05x) |" in out and "the check passed" in out
    # timed 20 % fast, the baseline run again reads beyond the frontier it lies on: no verdict stands
    assert main([str(_csv(tmp_path, control_train_s=80.0)), "--frontier"]) == 0
    out = capsys.readouterr().out
    assert "| hard | 3 | 0.93x [0.93, 0.93] | invalid: the control loopback/control reads beyond |" in out
    assert "CALIBRATION FAILED: the control (control) reads beyond" in out
    # timed 20 % slow, it reads below: a warning, the verdicts stand
    assert main([str(_csv(tmp_path, control_train_s=120.0)), "--frontier"]) == 0
    out = capsys.readouterr().out
    assert "| hard | 3 | 0.93x [0.93, 0.93] | no (below the frontier) |" in out and "WARNING: the control" in out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--contrast", "annealed=nope"], "--contrast 'annealed=nope'; accepted: A=B with A and B among"),
        (["--setting", "cluster"], "--setting 'cluster'; accepted: one of loopback"),
        (["--frontier", "--baseline", "full"], "--baseline 'full' is not a group"),
        (["--frontier", "--control", "twice"], "--control 'twice' is not a group"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, words):
    assert main([str(_csv(tmp_path)), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err
