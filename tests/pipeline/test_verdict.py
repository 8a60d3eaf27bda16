"""The few sentences a study ends with say what its tables mean (freeze/pipeline/report/verdict.py)."""

import math

import pandas as pd
import pytest

from freeze.pipeline.report.verdict import verdict_lines

NAN = math.nan


def _paired_row(group, speedup, low, high, diff=-0.4, diff_low=-1.2, diff_high=0.4, verdict="undecided", control=False):
    return {
        "setting": "",
        "group": group,
        "speedup": speedup,
        "speedup_low": low,
        "speedup_high": high,
        "diff_points": diff,
        "diff_low": diff_low,
        "diff_high": diff_high,
        "verdict": verdict,
        "control": control,
    }


def _write(tmp_path, paired_rows, convergence_rows):
    pd.DataFrame(paired_rows).to_csv(tmp_path / "paired.csv", index=False)
    pd.DataFrame(convergence_rows).to_csv(tmp_path / "convergence.csv", index=False)
    return tmp_path


def test_the_quick_study_that_the_newcomer_read_says_it_is_too_short(tmp_path):
    """The numbers the newcomer saw: autofreeze 0.94x [0.56, 1.57], control 1.08x, baseline +9.67."""
    report = _write(
        tmp_path,
        [_paired_row("autofreeze", 0.94, 0.56, 1.57), _paired_row("control", 1.08, 0.80, 1.45, control=True)],
        [{"setting": "", "group": "none", "val_change_points": 9.67, "flat": False}],
    )
    lines = verdict_lines(report, 0.5)
    assert lines[0] == (
        "autofreeze: no measurable speedup over the whole run, 0.94x (95% CI [0.56, 1.57]) includes 1.0. Its test "
        "accuracy differs "
        "by -0.40 points (95% CI [-1.20, +0.40]): too uncertain to tell whether it loses more than 0.5 points."
    )
    assert lines[1].startswith("The control control (the baseline run again) reads 1.08x") and "sound" in lines[1]
    assert lines[2] == (
        "The baseline none was still improving (+9.67 points of validation accuracy over the last fifth of "
        "training): these runs are too short to show a speedup at equal accuracy."
    )


def test_a_measured_speedup_an_inferior_arm_a_drifting_control_and_a_converged_baseline(tmp_path):
    report = _write(
        tmp_path,
        [
            _paired_row("static-k8", 2.57, 2.40, 2.75, diff=-35.0, diff_low=-36.0, diff_high=-34.0, verdict="inferior"),
            _paired_row("slow", 0.80, 0.75, 0.85, verdict="non-inferior"),
            _paired_row("one-seed", 1.30, NAN, NAN, diff_low=NAN, diff_high=NAN, verdict="n/a"),
            _paired_row("control", 1.20, 1.10, 1.30, control=True),
        ],
        [{"setting": "", "group": "none", "val_change_points": 0.2, "flat": True}],
    )
    lines = verdict_lines(report, 0.5)
    assert lines[0].startswith("static-k8: trained faster than the baseline, 2.57x (95% CI [2.40, 2.75]).")
    assert lines[0].endswith("it loses more than 0.5 points.")
    assert lines[1].startswith("slow: trained slower than the baseline") and "loses no more than 0.5" in lines[1]
    assert "one pair of runs: no interval" in lines[2] and "run more seeds" in lines[2]
    assert "not 1.00x" in lines[3] and "no speedup here can be trusted" in lines[3]
    assert lines[4].startswith("The baseline none had converged")


def test_a_control_of_one_pair_is_not_read_as_drift(tmp_path):
    """The probe's case 38: with one seed the control read "0.90x (one pair of runs: no interval), not
    1.00x: the machine's timing drifted more than the intervals allow", a line that contradicts itself."""
    report = _write(
        tmp_path,
        [_paired_row("control", 0.90, NAN, NAN, diff_low=NAN, diff_high=NAN, verdict="n/a", control=True)],
        [{"setting": "", "group": "none", "val_change_points": 0.2, "flat": True}],
    )
    line = verdict_lines(report, 0.5)[0]
    assert line.startswith("The control control (the baseline run again) reads 0.90x (one pair of runs: no interval)")
    assert "cannot be judged" in line and "run more seeds" in line and "drifted" not in line


def test_no_tables_no_sentences(tmp_path):
    assert verdict_lines(tmp_path, 0.5) == []


def test_an_arm_that_froze_almost_nothing_says_so(tmp_path):
    """The quick study's autofreeze froze only ResNet-18's stem, in two of three seeds (0.02 % of the
    weights on average): "no measurable speedup" alone left out that it had nothing to skip."""
    report = _write(
        tmp_path,
        [_paired_row("autofreeze", 0.88, 0.65, 1.19), _paired_row("static-k5", 1.30, 1.20, 1.40)],
        [{"setting": "", "group": "none", "val_change_points": 14.8, "flat": False}],
    )
    pd.DataFrame(
        [
            {"setting": "", "group": "autofreeze", "frozen_fraction": 0.00018951698785483486},
            {"setting": "", "group": "static-k5", "frozen_fraction": 0.2114},
            {"setting": "", "group": "none", "frozen_fraction": 0.0},
        ]
    ).to_csv(tmp_path / "main.csv", index=False)
    lines = verdict_lines(report, 0.5)
    assert lines[0].endswith(
        "points. It froze 0.019 % of the parameters (mean over epochs): almost nothing to skip."
    ), lines[0]
    assert lines[1].endswith("points. It froze 21 % of the parameters (mean over epochs)."), lines[1]


@pytest.mark.parametrize(
    "change, half, state, words",
    [
        (NAN, NAN, "no validation data", "has no validation accuracy (data.val_size = 0)"),
        (-3.12, 0.8, "falling", "was losing accuracy (-3.12 points"),
        (0.46, 0.32, "still improving", "was still improving (+0.46 points"),
        (0.2, 0.2, "converged", "had converged (+0.20 points"),
        (0.3, 0.5, "undecided", "is undecided (+0.30 points"),
    ],
)
def test_the_baseline_s_convergence_is_decided_by_its_interval_and_said_as_it_is(tmp_path, change, half, state, words):
    """Reliability.md case 41: "still improving (+nan points)" for a baseline without validation and for
    one whose accuracy fell; science.md 1b.4: +0.46 ± 0.32 (a 95 % half-width) read "flat"."""
    from freeze.pipeline.report.paired import convergence_state

    assert convergence_state(change, half, 0.5) == state
    report = _write(tmp_path, [], [{"setting": "", "group": "none", "val_change_points": change, "state": state}])
    assert any(words in line for line in verdict_lines(report, 0.5))


def test_a_time_to_target_that_excludes_one_is_said_beside_no_measurable_speedup(tmp_path):
    """Issue 48: "no measurable speedup" sat beside a time-to-target interval of [1.05, 1.40], unremarked."""
    row = {
        **_paired_row("clock", 1.02, 0.97, 1.08),
        "ttt_speedup": 1.2,
        "ttt_speedup_low": 1.05,
        "ttt_speedup_high": 1.4,
    }
    quiet = {
        **_paired_row("other", 1.02, 0.97, 1.08),
        "ttt_speedup": 1.1,
        "ttt_speedup_low": 0.9,
        "ttt_speedup_high": 1.3,
    }
    lines = verdict_lines(_write(tmp_path, [row, quiet], []), 0.5)
    assert (
        "includes 1.0; it reached the target accuracy sooner, time to target 1.20x (95% CI [1.05, 1.40])." in lines[0]
    )
    assert "time to target" not in lines[1]
