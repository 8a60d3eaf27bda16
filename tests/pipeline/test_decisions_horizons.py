"""The decisions table (where adaptive rules froze, and their undos) and the horizons table (the
same arms at two horizons) on hand-made runs whose answers are known."""

import math

import pytest

from freeze.pipeline.report.decisions import decisions_table
from freeze.pipeline.report.horizons import horizons_table
from freeze.pipeline.report.tables import resolve_baseline
from tests.pipeline.handmade_runs import handmade_run


def test_decisions_list_every_adaptive_groups_moves_per_seed_and_count_its_undos():
    runs = [
        handmade_run("loopback", "none", 0, "none", 100.0, 90.0, 100),
        handmade_run("loopback", "at-k9", 0, "at:k=9,t=0.8", 90.0, 90.0, 100, changes=((80, 9),)),
        handmade_run("loopback", "linear", 0, "linear:freeze_start=0.5", 90.0, 90.0, 100, changes=((50, 1), (60, 2))),
        handmade_run(
            "loopback", "horizon", 0, "horizon:exchange=10", 80.0, 90.0, 100, changes=((40, 1), (50, 0), (70, 9))
        ),
        handmade_run("loopback", "horizon", 1, "horizon:exchange=10", 80.0, 90.0, 100, changes=((60, 9),)),
        handmade_run("loopback", "horizon", 2, "horizon:exchange=10", 100.0, 90.0, 100),
    ]
    table = decisions_table(runs, resolve_baseline(runs, None))
    assert list(table.data["group"]) == ["horizon"]  # none, the clock and the schedules decide from no signal
    row = table.data.iloc[0]
    assert row["unfreezes"] == 1 and row["froze_runs"] == 2 and row["n_runs"] == 3
    assert row["first_freeze_fraction"] == pytest.approx((0.4 + 0.6) / 2)
    assert row["final_boundaries"] == "9 9 0"
    assert row["moves"] == "s0: 40->1, 50->0, 70->9; s1: 60->9; s2: none"


def _study(steps: int, arm_acc: list[float], arm_time: float) -> list:
    runs = []
    for seed, acc in enumerate(arm_acc):
        runs.append(handmade_run("loopback", "none", seed, "none", 100.0, 90.0 + seed, steps))
        runs.append(
            handmade_run(
                "loopback",
                "at-k9-t0.8",
                seed,
                "at:k=9,t=0.8",
                arm_time,
                acc + seed,
                steps,
                changes=((int(0.8 * steps), 9),),
            )
        )
    runs.append(
        handmade_run("loopback", "only-short", 0, "at:k=9,t=0.5", 50.0, 85.0, steps, changes=((steps // 2, 9),))
    )
    return runs


def test_horizons_pair_each_study_with_its_own_baseline_and_give_the_unpaired_change():
    short = _study(170, [89.0, 89.2, 88.8], 90.0)  # -1.0 points on average at 1x
    long = _study(680, [89.8, 89.9, 89.7], 80.0)  # -0.2 points at 4x
    long = [r for r in long if r.group != "only-short"]
    table = horizons_table(short, long, "1x", "4x", 0.95, 0.5)
    assert list(table.data["group"]) == ["at-k9-t0.8"]  # in both studies, beside a baseline; none is not an arm
    row = table.data.iloc[0]
    assert row["short_diff_points"] == pytest.approx(-1.0) and row["long_diff_points"] == pytest.approx(-0.2)
    assert row["change_points"] == pytest.approx(0.8)
    half = math.hypot(
        row["short_diff_high"] - row["short_diff_points"], row["long_diff_high"] - row["long_diff_points"]
    )
    assert row["change_high"] - row["change_points"] == pytest.approx(half)
    assert row["short_speedup"] == pytest.approx(100 / 90) and row["long_speedup"] == pytest.approx(100 / 80)
    assert row["short_first_freeze"] == pytest.approx(136 / 170) and row["long_first_freeze"] == pytest.approx(0.8)
    assert (row["short_steps"], row["long_steps"]) == (170, 680)
    assert (
        "1x acc diff [95% CI]" in table.display.columns and "change 4x - 1x, points [95% CI]" in table.display.columns
    )


def test_shorter_horizon_must_name_another_study_in_one_line(tmp_path, capsys):
    from freeze.pipeline.study import cli
    from tests.pipeline.test_study_predict import STUDY

    path = tmp_path / "study.toml"
    name = next(line.split("=", 1)[1].strip().strip('"') for line in STUDY.splitlines() if line.startswith("name"))
    path.write_text(STUDY.replace("predict = true", f'predict = true\nshorter_horizon = "{name}"'))
    assert cli.main(["--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "shorter_horizon must name another study" in err and err.count("\n") == 1


def test_the_horizon_study_file_compares_with_the_frontier_study():
    from pathlib import Path

    from freeze.pipeline.study.plan import read_study

    study = read_study(Path(__file__).resolve().parents[2] / "experiments/configs/study_horizon.toml")
    assert study.shorter_horizon == "frontier" and study.report_md == "report/horizon-study.md"
    assert {"horizon", "horizon-bf16", "none", "control"} <= set(study.arms)


def test_an_arm_whose_policy_differs_between_the_studies_is_not_compared_and_said():
    short = _study(170, [89.0, 89.2, 88.8], 90.0)
    long = [
        r
        if r.group != "at-k9-t0.8"
        else handmade_run("loopback", "at-k9-t0.8", r.seed, "at:k=9,t=0.7", 80.0, 90.0, 680)
        for r in _study(680, [89.8, 89.9, 89.7], 80.0)
    ]
    table = horizons_table(short, long, "1x", "4x", 0.95, 0.5)
    assert "at-k9-t0.8" not in list(table.data.get("group", []))
    assert any("loopback/at-k9-t0.8 (at:k=9,t=0.8 against at:k=9,t=0.7)" in note for note in table.notes)
