"""report/: tables and figures from the hand-written fixture under tests/fixtures/runs.

Expected numbers are computed here from the fixture's literal values (plain arithmetic + scipy's t
distribution), never by calling the report's own statistics.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from scipy import stats

from freeze.pipeline.report import build_report
from freeze.pipeline.report.cli import main
from freeze.pipeline.report.paired import is_control
from freeze.pipeline.report.tables import ReportInputError, resolve_baseline
from tests.processes import run_python

FIXTURES = Path(__file__).parents[1] / "fixtures"
RUNS = FIXTURES / "runs"
STUDY = RUNS / "fixture_study"
AF = "autofreeze:percentile=50"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Final-epoch values of the fixture (see the metrics.jsonl files).
NONE_FINAL_TEST = [0.70, 0.72]  # none-s1's best epoch is 0.74 (epoch 1): must NOT be used
AF_FINAL_TEST = [0.66, 0.69]
STATIC_FINAL_TEST = [0.55]
NONE_WALL_S = [300.0, 330.0]
AF_WALL_S = [240.0, 270.0]
STATIC_WALL_S = [180.0]
TARGET_VAL_ACC = 0.95 * (0.72 + 0.74) / 2  # 0.6935


def _ci95(values: list[float]) -> float:
    return stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return out, build_report(RUNS, out)


def _rows(path: Path) -> dict[str, dict]:
    # Empty CSV cells are missing numbers; the literal "n/a" is a value (e.g. "no test possible").
    frame = pd.read_csv(path, keep_default_na=False, na_values=[""])
    return {row["group"]: row for row in frame.to_dict("records")}


def _copy_study(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    shutil.copytree(RUNS, runs)
    return runs


def _edit_manifest(runs: Path, run_name: str, **changes) -> None:
    path = runs / "fixture_study" / run_name / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


def test_main_table_numbers_match_hand_computation(report):
    out, _ = report
    rows = _rows(out / "main.csv")
    none, af, static = rows["none"], rows[AF], rows["static:k=2"]
    assert (none["n_runs"], af["n_runs"], static["n_runs"]) == (2, 2, 1)
    assert none["test_acc_mean"] == pytest.approx(0.71, abs=1e-12)
    assert af["test_acc_mean"] == pytest.approx(0.675, abs=1e-12)
    assert none["test_acc_ci95"] == pytest.approx(_ci95(NONE_FINAL_TEST), rel=1e-9)
    assert none["test_acc_ci95"] == pytest.approx(12.706204736 * 0.01, rel=1e-8)  # t(0.975, 1) * sd / sqrt(2)
    assert af["test_acc_ci95"] == pytest.approx(12.706204736 * 0.015, rel=1e-8)
    assert math.isnan(static["test_acc_ci95"])  # one seed: no CI
    assert af["diff_points"] == pytest.approx(-3.5, abs=1e-9)
    assert static["diff_points"] == pytest.approx(-16.0, abs=1e-9)
    # Paired over seeds 0 and 1: differences -0.04, -0.03 -> t = -0.035 / (0.00707107 / sqrt 2) = -7, 1 dof.
    diffs = [a - b for a, b in zip(AF_FINAL_TEST, NONE_FINAL_TEST)]
    t_stat = statistics.mean(diffs) / (statistics.stdev(diffs) / math.sqrt(2))
    assert t_stat == pytest.approx(-7.0, rel=1e-9)
    assert af["p_value"] == pytest.approx(2 * stats.t.sf(abs(t_stat), 1), rel=1e-9)
    assert af["p_value"] == pytest.approx(1 - 2 * math.atan(7) / math.pi, rel=1e-9)  # closed form for 1 dof
    assert af["test"] == "paired"
    assert static["test"] == "n/a" and math.isnan(static["p_value"])  # one pair, one run: no test
    assert none["wall_min"] == pytest.approx(315 / 60)
    # One speedup, the paired table's: geometric mean of baseline / arm over the shared seeds (0 and 1).
    assert af["speedup"] == pytest.approx(math.sqrt(300.0 / 240.0 * 330.0 / 270.0), rel=1e-12)
    assert static["speedup"] == pytest.approx(300 / 180)  # its one seed, 0, against the baseline's seed 0
    # Time to target 0.6935: none reaches at 300 s and 220 s, autofreeze at 240 s and 270 s, static never.
    assert none["ttt_target_val_acc"] == pytest.approx(TARGET_VAL_ACC)
    assert none["ttt_min"] == pytest.approx((300 + 220) / 2 / 60)
    assert af["ttt_min"] == pytest.approx((240 + 270) / 2 / 60)
    assert (af["ttt_reached"], static["ttt_reached"]) == (2, 0) and math.isnan(static["ttt_min"])
    assert none["allreduce_gb"] == pytest.approx(3.0)
    assert af["allreduce_gb"] == pytest.approx(((1.0 + 0.9 + 0.7) + (1.0 + 0.9 + 0.9)) / 2)
    assert af["frozen_fraction"] == pytest.approx(((0 + 0.1 + 0.3) / 3 + (0 + 0.1 + 0.1) / 3) / 2)
    assert static["frozen_fraction"] == pytest.approx(0.3)


def test_accuracy_is_final_epoch_not_best(report):
    out, _ = report
    none = _rows(out / "main.csv")["none"]
    best_epoch_mean = (0.70 + 0.74) / 2
    assert none["test_acc_mean"] == pytest.approx(statistics.mean(NONE_FINAL_TEST))
    assert abs(none["test_acc_mean"] - best_epoch_mean) > 0.005


def test_failed_run_only_in_incomplete_table(report):
    out, _ = report
    incomplete = pd.read_csv(out / "incomplete.csv")
    assert incomplete["run"].tolist() == ["autofreeze-s2"]
    assert incomplete["status"].tolist() == ["failed"]
    assert "gloo timeout" in incomplete["reason"][0]
    af = _rows(out / "main.csv")[AF]
    assert str(af["seeds"]) == "0 1"  # seed 2 (test_acc 0.99) stayed out of the mean
    for name in ("main.md", "static_sweep.md", "phases.md"):
        assert "autofreeze-s2" not in (out / name).read_text()
    assert "| autofreeze-s2 | autofreeze:percentile=50 | 2 | 2 | failed | 1/3 |" in (out / "incomplete.md").read_text()


def test_main_markdown_matches_stored_expected_file(report):
    out, _ = report
    expected = (FIXTURES / "expected_main_table.md").read_text(encoding="utf-8")
    assert (out / "main.md").read_text(encoding="utf-8") == expected


def test_static_sweep_and_phase_tables(report):
    out, _ = report
    sweep = pd.read_csv(out / "static_sweep.csv")
    assert sweep["k"].tolist() == [0, 2] and sweep["group"].tolist() == ["none", "static:k=2"]
    assert sweep["epoch_wall_s"].tolist() == pytest.approx([105.0, 60.0])
    assert sweep["speedup_per_epoch"].tolist() == pytest.approx([1.0, 105.0 / 60.0])
    phases = _rows(out / "phases.csv")
    af_backward_s = ((50 + 32 + 16) / 3 + (55 + 38 + 20) / 3) / 2
    assert phases[AF]["backward_s"] == pytest.approx(af_backward_s)
    assert phases[AF]["backward_speedup"] == pytest.approx(52.5 / af_backward_s)
    assert phases[AF]["total_s"] == pytest.approx(85.0)
    assert math.isnan(phases[AF]["freezer_speedup"])  # baseline freezer time is 0: no ratio


def test_combined_markdown_and_latex(report):
    out, written = report
    tables_md = (out / "tables.md").read_text(encoding="utf-8")
    assert "5 complete runs in 3 groups (1 incomplete run excluded" in tables_md
    assert "final-epoch test accuracy" in tables_md
    assert tables_md.count("\n## ") == 13  # the summary and the per-seed rows among them
    main_tex = (out / "main.tex").read_text(encoding="utf-8")
    assert r"\toprule" in main_tex and r"\bottomrule" in main_tex and r"test acc \% (final epoch)" in main_tex
    assert r"67.50 $\pm$ 19.06" in main_tex
    assert r"epoch\_wall\_s" in (out / "phases.tex").read_text(encoding="utf-8")
    for name in (
        "main",
        "paired",
        "frontier",
        "iso_speedup",
        "atlas",
        "convergence",
        "static_sweep",
        "phases",
        "incomplete",
        "blocks",
    ):
        assert {f"{name}.md", f"{name}.tex", f"{name}.csv"} <= set(written)


def test_pngs_are_written_and_valid(report):
    out, written = report
    pngs = sorted(name for name in written if name.endswith(".png"))
    assert pngs == sorted(
        [
            "accuracy_vs_epoch.png",
            "accuracy_vs_time.png",
            "freeze_boundary.png",
            "pareto.png",
            "phase_times.png",
            "eta_autofreeze_percentile_50_ws2.png",
            "eta_none_ws2.png",
            "eta_static_k_2_ws2.png",
        ]
    )
    for name in pngs:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name


def _figures(tmp_path, monkeypatch, runs: Path) -> dict:
    """Every figure write_plots draws, by file name, kept as matplotlib Figures to inspect."""
    from freeze.pipeline.report import load_runs, plots

    figures = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.setdefault(path.name, fig) and path)
    plots.write_plots(load_runs(runs), tmp_path / "figs")
    return figures


def test_accuracy_figures_draw_validation_per_epoch_when_test_is_final_only(tmp_path, monkeypatch):
    """A study with train.test_eval = final drew one dot per group at x = 3: the figures now draw
    validation accuracy, which exists at every epoch, and say so on the axis."""
    runs = _copy_study(tmp_path)
    for metrics in (runs / "fixture_study").glob("*/metrics.jsonl"):
        lines = [json.loads(line) for line in metrics.read_text().splitlines()]
        for line in lines[:-1]:
            line["test_acc"] = line["test_loss"] = None
        metrics.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    figures = _figures(tmp_path, monkeypatch, runs)
    for name in ("accuracy_vs_epoch.png", "accuracy_vs_time.png"):
        ax = figures[name].axes[0]
        assert ax.get_ylabel() == "validation accuracy (%)", name
        assert all(len(line.get_xdata()) == 3 for line in ax.lines), name  # a curve over 3 epochs, not a dot
    figures = _figures(tmp_path, monkeypatch, RUNS)  # test accuracy at every epoch: drawn as before
    assert figures["accuracy_vs_epoch.png"].axes[0].get_ylabel() == "test accuracy (%)"


def test_groups_that_draw_the_same_line_stay_visible(tmp_path, monkeypatch):
    """The control's boundary line lay exactly on the baseline's and hid it: every group has its own
    dash pattern and marker."""
    runs = _copy_study(tmp_path)
    _copy_group(runs, "none", "control")
    ax = _figures(tmp_path, monkeypatch, runs)["freeze_boundary.png"].axes[0]
    styles = {line.get_label(): (line.get_linestyle(), line.get_marker()) for line in ax.lines}
    assert set(styles) == {AF, "control", "none", "static:k=2"}
    assert len(set(styles.values())) == len(styles)
    control, none = ax.lines[list(styles).index("control")], ax.lines[list(styles).index("none")]
    assert list(control.get_ydata()) == list(none.get_ydata())  # the same numbers, drawn differently


def test_no_static_arm_is_one_line_not_a_table_of_k0_rows(tmp_path):
    """A study without a static:k=K arm printed a "Static-k sweep" of its k = 0 (policy none) rows
    alone: one line now says there is nothing to sweep, in every format (and so does any table
    without rows)."""
    runs = _copy_study(tmp_path)
    shutil.rmtree(runs / "fixture_study" / "static-k2-s0")
    shutil.rmtree(runs / "fixture_study" / "autofreeze-s2")  # the one incomplete run
    build_report(runs, tmp_path / "out", formats=("md", "tex", "csv"))
    out = tmp_path / "out"
    line = "No static arm in these runs (no complete group with policy static:k=K, K > 0): no static-k sweep to show."
    assert (out / "static_sweep.md").read_text(encoding="utf-8") == line + "\n"
    tex = (out / "static_sweep.tex").read_text(encoding="utf-8")
    assert "tabular" not in tex and tex.count("\n") == 1 and "static:k=K" in tex
    assert pd.read_csv(out / "static_sweep.csv").empty  # the header alone: the columns, no rows
    tables_md = (out / "tables.md").read_text(encoding="utf-8")
    assert f"## Static-k sweep\n\n{line}\n" in tables_md and tables_md.count(line) == 1
    assert "| k |" not in tables_md
    # Likewise no incomplete runs: one sentence, not a header over "Note: none".
    assert (out / "incomplete.md").read_text(encoding="utf-8") == (
        "No incomplete runs: every run finished the epochs it planned.\n"
    )


def _pareto_title(tmp_path, monkeypatch, baseline: str | None = None) -> str:
    from freeze.pipeline.report import build_tables, load_runs, plots

    figures = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.setdefault(path.name, fig) and path)
    runs = load_runs(RUNS)
    plots.write_plots(runs, tmp_path / "figs", build_tables(runs, baseline))
    return figures["pareto.png"].axes[0].get_title()


def test_pareto_title_names_the_baseline(tmp_path, monkeypatch):
    """Every point of the Pareto figure is a comparison with one group, chosen by the report among
    the policy-none groups or given by --baseline: the title says which."""
    assert "against baseline 'none'" in _pareto_title(tmp_path, monkeypatch)
    assert "against baseline 'static:k=2'" in _pareto_title(tmp_path, monkeypatch, baseline="static:k=2")
    paired = pd.read_csv(build_report(RUNS, tmp_path / "out", formats=("csv",))["paired.csv"])
    assert set(paired["baseline"]) == {"none"}


def test_welch_when_no_shared_seeds(tmp_path):
    runs = _copy_study(tmp_path)
    _edit_manifest(runs, "autofreeze-s0", seed=5)
    _edit_manifest(runs, "autofreeze-s1", seed=6)
    build_report(runs, tmp_path / "out", formats=("csv",))
    af = _rows(tmp_path / "out" / "main.csv")[AF]
    v1, v2 = statistics.variance(AF_FINAL_TEST) / 2, statistics.variance(NONE_FINAL_TEST) / 2
    t_stat = (statistics.mean(AF_FINAL_TEST) - statistics.mean(NONE_FINAL_TEST)) / math.sqrt(v1 + v2)
    dof = (v1 + v2) ** 2 / (v1**2 + v2**2)  # Welch-Satterthwaite with n - 1 = 1 on both sides
    assert af["test"] == "welch"
    assert af["p_value"] == pytest.approx(2 * stats.t.sf(abs(t_stat), dof), rel=1e-9)


def test_baseline_within_world_size_and_missing_baseline(tmp_path):
    runs = _copy_study(tmp_path)
    _edit_manifest(runs, "static-k2-s0", world_size=4)
    build_report(runs, tmp_path / "out", formats=("md", "csv"))
    static = _rows(tmp_path / "out" / "main.csv")["static:k=2"]
    assert static["test"] == "n/a" and math.isnan(static["speedup"]) and math.isnan(static["diff_points"])
    assert "no complete baseline runs with world_size 4" in (tmp_path / "out" / "main.md").read_text()
    for name in ("none-s0", "none-s1"):
        shutil.rmtree(runs / "fixture_study" / name)
    build_report(runs, tmp_path / "out2", formats=("md", "csv"))
    assert "diff_points" not in pd.read_csv(tmp_path / "out2" / "main.csv").columns
    assert "comparison columns omitted" in (tmp_path / "out2" / "main.md").read_text()


def test_explicit_baseline_and_short_run_is_incomplete(tmp_path):
    runs = _copy_study(tmp_path)
    _edit_manifest(runs, "none-s1", epochs_done=2)  # "complete" but short: must not be averaged
    build_report(runs, tmp_path / "out", baseline="static:k=2", formats=("csv",))
    rows = _rows(tmp_path / "out" / "main.csv")
    assert rows["none"]["n_runs"] == 1 and rows["none"]["test_acc_mean"] == pytest.approx(0.70)
    assert rows[AF]["speedup"] == pytest.approx(180 / 240)  # seed 0, the one seed both sides have
    assert rows[AF]["test"] == "n/a"  # one shared seed and a one-run baseline
    incomplete = pd.read_csv(tmp_path / "out" / "incomplete.csv")
    assert incomplete["run"].tolist() == ["autofreeze-s2", "none-s1"]
    assert "epochs_done 2 < epochs_planned 3" in incomplete["reason"][1]


def test_main_default_out_dir_is_where_the_readme_says(tmp_path, capsys):
    """README: `python -m report runs/<study>` writes runs/<study>-report/ (as the study command does)."""
    runs = _copy_study(tmp_path)
    assert main([str(runs), "--formats", "md"]) == 0
    out = runs.with_name(f"{runs.name}-report")
    assert (out / "main.md").read_text() == (FIXTURES / "expected_main_table.md").read_text()
    assert not (out / "main.csv").exists() and not (runs / "report").exists()
    assert str(out) in capsys.readouterr().out
    assert "runs/<study>-report/" in (Path(__file__).parents[2] / "README.md").read_text()


def test_the_command_prints_the_main_table(tmp_path, capsys):
    """`python -m report` printed only "wrote 24 files": the main table now reaches the terminal."""
    assert main([str(RUNS), "--out", str(tmp_path / "out"), "--formats", "md"]) == 0
    out = capsys.readouterr().out
    assert (FIXTURES / "expected_main_table.md").read_text(encoding="utf-8") in out
    assert out.splitlines()[-1].startswith("report: wrote ")


def _assert_one_line_error(capsys, argv: list[str], *fragments: str) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and err.startswith("report: error:"), err
    for fragment in fragments:
        assert fragment in err, err


def test_error_missing_and_empty_dir(tmp_path, capsys):
    _assert_one_line_error(capsys, [str(tmp_path / "nope")], "not found", "nope")
    (tmp_path / "empty").mkdir()
    _assert_one_line_error(capsys, [str(tmp_path / "empty")], "no run directories")


def test_error_corrupt_manifest(tmp_path, capsys):
    runs = _copy_study(tmp_path)
    manifest = runs / "fixture_study" / "none-s0" / "manifest.json"
    manifest.write_text('{"group": "none", ')
    _assert_one_line_error(capsys, [str(runs)], str(manifest), "not valid JSON")


def test_error_malformed_metrics_line(tmp_path, capsys):
    runs = _copy_study(tmp_path)
    metrics = runs / "fixture_study" / "autofreeze-s1" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[1] = lines[1][:40]  # a truncated line 2
    metrics.write_text("\n".join(lines) + "\n")
    _assert_one_line_error(capsys, [str(runs)], f"{metrics}:2", "malformed metrics line")


def test_error_bad_arguments(tmp_path, capsys):
    _assert_one_line_error(capsys, [str(RUNS), "--out", str(tmp_path), "--formats", "md,pdf"], "pdf", "accepted")
    _assert_one_line_error(capsys, [str(RUNS), "--out", str(tmp_path), "--baseline", "nope"], "nope", "groups:")
    _assert_one_line_error(capsys, [str(RUNS), "--bogus"], "unrecognized arguments")


@pytest.mark.processes
def test_module_entry_point_exit_code(tmp_path):
    result = run_python(["-m", "report", str(tmp_path / "missing")], timeout_s=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "not found" in result.stderr


def test_no_eta_heatmap_for_a_group_that_recorded_no_summed_gradients(tmp_path):
    study = tmp_path / "runs"
    shutil.copytree(STUDY, study)
    for run in ("none-s0", "none-s1"):  # what a run without freeze.track_summed_grads writes
        path = study / run / "metrics.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        for line in lines:
            line["grad_norm"] = {key: [None] * len(value) for key, value in line["grad_norm"].items()}
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    written = build_report(study, tmp_path / "out", formats=("png",))
    heatmaps = sorted(name for name in written if name.startswith("eta_"))
    assert heatmaps == ["eta_autofreeze_percentile_50_ws2.png", "eta_static_k_2_ws2.png"]


def test_a_crash_while_writing_the_report_keeps_the_previous_files(tmp_path, monkeypatch):
    import freeze._atomic

    out = tmp_path / "report"
    build_report(RUNS, out, formats=("md",))
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def dying_fsync(fd):
        raise KeyboardInterrupt  # the process is killed after writing, before the data is durable

    monkeypatch.setattr(freeze._atomic.os, "fsync", dying_fsync)
    with pytest.raises(KeyboardInterrupt):
        build_report(RUNS, out, baseline="static:k=2", formats=("md",))
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no half file, no temp file


def _log_ratio_interval(ratios: list[float]) -> tuple[float, float, float]:
    logs = [math.log(r) for r in ratios]
    mean, half = statistics.mean(logs), _ci95(logs)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def test_paired_table_numbers_match_hand_computation(report):
    out, _ = report
    paired = _rows(out / "paired.csv")
    af = paired[AF]
    # Seeds 0 and 1 on both sides (autofreeze-s2 has no baseline partner and failed anyway).
    assert af["n_pairs"] == 2
    speedup, low, high = _log_ratio_interval([300.0 / 240.0, 330.0 / 270.0])
    assert (af["speedup"], af["speedup_low"], af["speedup_high"]) == pytest.approx((speedup, low, high), rel=1e-9)
    diffs = [100 * (0.66 - 0.70), 100 * (0.69 - 0.72)]  # -4 and -3 points
    half = _ci95(diffs)
    assert af["diff_points"] == pytest.approx(-3.5)
    assert (af["diff_low"], af["diff_high"]) == pytest.approx((-3.5 - half, -3.5 + half))
    assert af["verdict"] == "undecided"  # [-9.85, 2.85] straddles -0.5
    # A single pair: a speedup but no interval, and no verdict.
    static = paired["static:k=2"]
    assert static["n_pairs"] == 1 and static["speedup"] == pytest.approx(300.0 / 180.0)
    assert math.isnan(static["speedup_low"]) and static["verdict"] == "n/a"
    assert "none" not in paired  # the baseline is not compared with itself


def test_main_and_paired_tables_report_one_speedup_under_one_name(report):
    """A reader saw 0.93x in one table and 0.94x in the other for the same arm (ratio of means vs
    geometric mean of paired ratios): both tables now give the paired one, and both captions say so."""
    out, _ = report
    main_rows, paired_rows = _rows(out / "main.csv"), _rows(out / "paired.csv")
    for group in (AF, "static:k=2"):
        assert main_rows[group]["speedup"] == pytest.approx(paired_rows[group]["speedup"], rel=1e-12)
    captions = {line for line in (out / "tables.md").read_text().splitlines() if "speedup = geometric" in line}
    assert len(captions) == 2  # the main and the paired table's captions, each naming both definitions
    for caption in captions:
        assert "speedup = geometric mean over seeds of baseline train time / arm train time" in caption
        assert "time to target = the first cumulative train time at which val accuracy reaches 0.95 x" in caption


def test_paired_verdicts_at_the_margin():
    from freeze.pipeline.report.paired import non_inferiority

    assert non_inferiority(-0.4, 0.3, 0.5) == "non-inferior"
    assert non_inferiority(-0.6, 0.3, 0.5) == "undecided"
    assert non_inferiority(-2.0, -0.6, 0.5) == "inferior"
    assert non_inferiority(math.nan, 0.3, 0.5) == "n/a"


def test_control_group_shows_its_speedup_against_one(tmp_path):
    runs = _copy_study(tmp_path)
    study = runs / "fixture_study"
    for seed, wall_scale in ((0, 1.02), (1, 0.99)):  # a control timed 2 % slower and 1 % faster
        dst = study / f"control-s{seed}"
        shutil.copytree(study / f"none-s{seed}", dst)
        _edit_manifest(runs, dst.name, group="control")
        lines = [json.loads(line) for line in (dst / "metrics.jsonl").read_text().splitlines()]
        for line in lines:
            line["cumulative_wall_s"] *= wall_scale
        (dst / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    build_report(runs, tmp_path / "out", formats=("md", "csv"))
    control = _rows(tmp_path / "out" / "paired.csv")["control"]
    speedup, low, high = _log_ratio_interval([1 / 1.02, 1 / 0.99])
    assert control["speedup"] == pytest.approx(speedup) and low < 1.0 < high
    assert control["diff_points"] == 0.0
    assert "control control (policy none" in (tmp_path / "out" / "paired.md").read_text()
    assert "holds 1.00x" in (tmp_path / "out" / "paired.md").read_text()


def _copy_group(runs: Path, source_group: str, group: str, config_edit=lambda text: text) -> None:
    """Copies of the fixture's ``source_group`` runs as ``group``, their config.toml passed through ``config_edit``."""
    study = runs / "fixture_study"
    for src in sorted(study.glob(f"{source_group}-s*")):
        dst = study / src.name.replace(source_group, group, 1)
        shutil.copytree(src, dst)
        _edit_manifest(runs, dst.name, group=group)
        config = (dst / "config.toml").read_text().replace(f'name = "{src.name}"', f'name = "{dst.name}"')
        (dst / "config.toml").write_text(config_edit(config.replace(f'group = "{source_group}"', f'group = "{group}"')))


def test_a_policy_none_arm_that_computes_something_else_is_no_control(tmp_path):
    """Policy none on other augmentations (the views study's arms) trains other numbers: no control note.
    The same config under another group name, run name and output path is the control."""
    runs = _copy_study(tmp_path)
    _copy_group(
        runs,
        "none",
        "views-1",
        lambda t: t.replace('dataset = "synthetic-target"\n', 'dataset = "synthetic-target"\naugment = "views:1"\n'),
    )
    _copy_group(runs, "none", "control", lambda t: t.replace("[run]\n", '[run]\nout_dir = "elsewhere"\n'))
    build_report(runs, tmp_path / "out", formats=("md", "csv"))
    rows = _rows(tmp_path / "out" / "paired.csv")
    assert rows["views-1"]["policy"] == "none" and not rows["views-1"]["control"]
    assert rows["control"]["control"] and not rows[AF]["control"]
    paired_md = (tmp_path / "out" / "paired.md").read_text()
    assert "control control (policy none, computes what the baseline computes)" in paired_md
    assert "views-1 (policy none" not in paired_md and paired_md.count("holds 1.00x") == 1


def test_of_several_policy_none_groups_the_one_at_the_defaults_is_the_baseline(tmp_path, capsys):
    """A policy x cache sweep has none_cache=off and none_cache=memory: the report compared every arm
    with the cache-on group (alphabetical). It takes the group whose differing keys hold the
    defaults (the cache is off by default); when none does, it asks for --baseline in one line."""
    runs = _copy_study(tmp_path)
    study = runs / "fixture_study"
    _copy_group(runs, "none", "none_cache=off", lambda t: t.replace("[freeze]\n", '[freeze]\ncache = "off"\n'))
    _copy_group(runs, "none", "none_cache=memory", lambda t: t.replace("[freeze]\n", '[freeze]\ncache = "memory"\n'))
    for name in ("none-s0", "none-s1"):
        shutil.rmtree(study / name)
    build_report(runs, tmp_path / "out", formats=("md",))
    main_md = (tmp_path / "out" / "main.md").read_text()
    assert (
        "baseline: group 'none_cache=off' (policy none); other policy-none groups not used: none_cache=memory"
        in main_md
    )
    _copy_group(runs, "none_cache=off", "none_lr=1", lambda t: t.replace("lr = 0.1\n", "lr = 1.0\n"))
    shutil.rmtree(study / "none_cache=off-s0"), shutil.rmtree(study / "none_cache=off-s1")
    assert main([str(runs), "--out", str(tmp_path / "out2"), "--formats", "md"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "several policy-none groups (none_cache=memory, none_lr=1) differ in" in err
    assert "freeze.cache" in err and "optim.lr" in err and err.endswith("choose the baseline with --baseline GROUP")


def test_is_control_compares_resolved_configs_apart_from_run_identity():
    base = {
        "run": {"name": "none_seed=0", "group": "none", "seed": 0, "checkpoint_every_epochs": 1},
        "data": {"augment": "views:4"},
        "freeze": {"policy": "none"},
    }
    renamed = {**base, "run": {**base["run"], "name": "control_seed=0", "group": "control", "out_dir": "x"}}
    assert is_control(renamed, base)
    assert not is_control({**base, "data": {"augment": "views:1"}}, base)
    assert not is_control({**base, "run": {**base["run"], "checkpoint_every_epochs": 2}}, base)  # writes more
    assert not is_control({}, base) and not is_control(base, {})  # no config.toml: cannot be shown


def test_convergence_of_the_baseline(report):
    out, _ = report
    row = _rows(out / "convergence.csv")["none"]
    # 3 epochs: the last fifth is the final epoch, compared with epoch 2 (row 1).
    changes = [100 * (0.72 - 0.62), 100 * (0.74 - 0.70)]  # 10 and 4 points
    assert row["val_change_points"] == pytest.approx(statistics.mean(changes))
    assert row["val_change_ci95"] == pytest.approx(_ci95(changes))
    assert not row["flat"] and row["from_epoch"] == 2
    assert row["state"] == "undecided"  # +7 points, but two seeds: a t interval of [-31, +45]


def test_settings_are_compared_only_within_themselves(tmp_path):
    runs = _copy_study(tmp_path)
    study = runs / "fixture_study"
    # The same runs again as a second setting whose autofreeze is twice as fast: its speedup must be
    # taken against that setting's own baseline, and the first setting must be unchanged.
    for run_dir in sorted(study.iterdir()):
        shutil.copytree(run_dir, study / f"{run_dir.name}-cluster")
        _edit_manifest(runs, f"{run_dir.name}-cluster", setting="cluster")
    for seed in (0, 1):
        path = study / f"autofreeze-s{seed}-cluster" / "metrics.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        for line in lines:
            line["cumulative_wall_s"] /= 2
        path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    build_report(runs, tmp_path / "out", formats=("md", "csv"))
    frame = pd.read_csv(tmp_path / "out" / "paired.csv", keep_default_na=False)  # setting "" stays ""
    af = {row["setting"]: row for row in frame.to_dict("records") if row["group"] == AF}
    loopback, _, _ = _log_ratio_interval([300.0 / 240.0, 330.0 / 270.0])
    cluster, _, _ = _log_ratio_interval([300.0 / 120.0, 330.0 / 135.0])
    assert af[""]["speedup"] == pytest.approx(loopback) and af["cluster"]["speedup"] == pytest.approx(cluster)
    main = pd.read_csv(tmp_path / "out" / "main.csv", keep_default_na=False)
    assert sorted(main["setting"]) == sorted(["", "", "", "cluster", "cluster", "cluster"])


def test_two_runs_of_one_group_and_seed_name_the_way_round(tmp_path, capsys):
    """A run re-made under another name leaves two complete runs of (none, seed 0): the report stops
    with one line naming both and the command that keeps the newest, and that command works."""
    runs = _copy_study(tmp_path)
    again = runs / "fixture_study" / "none-s0-again"
    shutil.copytree(runs / "fixture_study" / "none-s0", again)
    _edit_manifest(runs, "none-s0-again", end_time="2025-01-02T00:00:00+00:00")
    lines = (again / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1]) | {"test_acc": 0.9}
    (again / "metrics.jsonl").write_text("\n".join(lines[:-1] + [json.dumps(last)]) + "\n")

    _assert_one_line_error(
        capsys, [str(runs)], "seed 0", "none-s0-again", f"python -m report {runs} --on-duplicate newest"
    )
    assert main([str(runs), "--on-duplicate", "newest", "--formats", "csv"]) == 0
    assert f"left out {runs / 'fixture_study' / 'none-s0'}:" in capsys.readouterr().out
    none = _rows(runs.with_name("runs-report") / "main.csv")["none"]
    assert none["n_runs"] == 2 and none["test_acc_mean"] == pytest.approx((0.9 + 0.72) / 2)
    _assert_one_line_error(capsys, [str(runs), "--on-duplicate", "oldest"], "newest")


def test_seeds_to_decide_the_verdict():
    from freeze.pipeline.report.paired import seeds_to_decide

    diffs = [0.0, 0.5, 1.0, -0.5, -1.0]  # mean 0, sd = sqrt(2.5 / 4) = 0.79: |0 + 0.5| is the distance
    # t(0.975, n-1) * 0.79 / sqrt(n) < 0.5 first at n = 13 (0.481); n = 12 gives 0.502
    assert seeds_to_decide(diffs, 0.5) == 13
    assert seeds_to_decide(diffs, 2.0) == 3  # distance 2: 4.303 * 0.79 / 1.73 = 1.96
    shifted = [d - 0.4 for d in diffs]  # mean -0.4: distance 0.1 needs many more
    assert seeds_to_decide(shifted, 0.5) == 243  # 1.970 * 0.79 / 15.59 = 0.0999 < 0.1
    assert seeds_to_decide([d - 0.5 for d in diffs], 0.5) is None  # the mean on -margin: no n decides
    assert seeds_to_decide([-1.5 + d for d in diffs], 0.5) == 5  # inferior side, distance 1: 2.776 * 0.79 / 2.24 = 0.98
    assert seeds_to_decide([1.0], 0.5) is None  # one pair: no spread to read
    assert seeds_to_decide([1.0, 1.0], 0.5) is None
    assert seeds_to_decide(diffs, 0.5, most=10) is None


def test_pareto_draws_one_panel_per_setting_and_one_legend_entry_per_group(tmp_path, monkeypatch):
    """A study of a dozen arms in two settings: a panel per setting on one speedup axis, and each
    group one legend entry with the same colour in both panels (no per-point labels to overlap)."""
    from freeze.pipeline.report import plots

    figures = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.setdefault(path.name, fig) and path)
    rows = [
        {
            "setting": setting,
            "group": group,
            "baseline": "none",
            "diff_points": d,
            "diff_low": d - 0.5,
            "diff_high": d + 0.5,
            "speedup": x,
            "speedup_low": x - 0.1,
            "speedup_high": x + 0.1,
        }
        for setting in ("cluster", "loopback")
        for group, d, x in (("payoff", -0.7, 1.3), ("static-k8", -6.8, 2.1), ("control", 0.0, 1.0))
    ]
    plots.plot_pareto(pd.DataFrame(rows), 0.5, tmp_path / "pareto.png")
    panels = figures["pareto.png"].axes
    assert [ax.get_title().split(":")[0] for ax in panels] == ["cluster", "loopback"]
    assert panels[0].get_shared_y_axes().joined(panels[0], panels[1])
    labels = [t.get_text() for t in panels[-1].get_legend().get_texts()]
    assert labels == ["control", "payoff", "static-k8", "-0.5 point margin"]
    colours = [[c.lines[0].get_color() for c in ax.containers] for ax in panels]
    assert colours[0] == colours[1] and len(set(colours[0])) == 3
    assert not any(ax.texts for ax in panels)


def test_pareto_colours_of_a_dozen_groups_are_distinct_hues_first():
    """Beyond 10 groups the first ten take tab20's dark shades, one per hue, before any light one."""
    from matplotlib import colormaps

    from freeze.pipeline.report.plots import _group_colour

    colours = [_group_colour(i, 13) for i in range(13)]
    assert len(set(colours)) == 13
    assert colours[:10] == [colormaps["tab20"](2 * i) for i in range(10)]


def _set_frozen_fraction(runs: Path, run_name: str, fraction: float) -> None:
    path = runs / "fixture_study" / run_name / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps({**line, "frozen_param_fraction": fraction}) + "\n" for line in lines))


def _record_classes(runs: Path, num_classes: int, test_images: int) -> None:
    """What a run's manifest records since issue 32 (the fixture predates it)."""
    for manifest in (runs / "fixture_study").glob("*/manifest.json"):
        _edit_manifest(runs, manifest.parent.name, num_classes=num_classes, test_images=test_images)


def test_an_arm_that_froze_nothing_is_no_finding(tmp_path, capsys):
    """The newcomer's smoke ablation: autofreeze froze nothing, computed what the baseline computed and
    was printed "non-inferior" with a zero-width interval, as if it were a result."""
    runs = _copy_study(tmp_path)
    _record_classes(runs, num_classes=10, test_images=1000)  # 70 % is far above chance (10 % + 2.8)
    for seed in (0, 1, 2):
        _set_frozen_fraction(runs, f"autofreeze-s{seed}", 0.0)
    out = tmp_path / "report"
    assert main([str(runs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    af = _rows(out / "paired.csv")[AF]
    assert af["verdict"] == "froze nothing, no test" and af["froze_nothing"] and not af["arm_at_chance"]
    assert _rows(out / "main.csv")[AF]["froze_nothing"] and not _rows(out / "main.csv")["none"]["froze_nothing"]
    assert f"{AF} FROZE NOTHING" in (out / "main.md").read_text()
    assert "AT CHANCE" not in (out / "main.md").read_text()
    # python -m report ends with the sentences make study ends with, and this one names no finding
    meaning = printed.split("== what this means\n", 1)[1]
    assert f"{AF}: no finding: it froze nothing" in meaning
    assert "static:k=2: " in meaning and "Its test accuracy differs" in meaning  # a real arm keeps its sentence


def test_arms_at_chance_are_flagged_and_decide_nothing(tmp_path, capsys):
    """Two classes, 20 test images: 50 % is chance and a guesser reaches 83.5 % (3 SDs); every arm is there."""
    runs = _copy_study(tmp_path)
    _record_classes(runs, num_classes=2, test_images=20)
    out = tmp_path / "report"
    assert main([str(runs), "--out", str(out), "--formats", "md,csv"]) == 0
    rows = _rows(out / "paired.csv")
    assert {rows[g]["verdict"] for g in (AF, "static:k=2")} == {"at chance, no test"}
    assert rows[AF]["arm_at_chance"] and rows[AF]["base_at_chance"]
    main_md = (out / "main.md").read_text()
    assert "none is AT CHANCE: test acc 71.00 % against 1/2 = 50.00 % (within noise up to 83.54 %" in main_md
    assert "its baseline scored at chance level" in capsys.readouterr().out


def test_an_undecided_verdict_is_called_undecided(report):
    out, _ = report
    assert _rows(out / "paired.csv")[AF]["verdict"] == "undecided"
    assert "not shown" not in (out / "paired.md").read_text()


def test_policy_none_groups_are_compared_within_each_study_setting():
    """The frontier study: none and control in both settings, budget arms on loopback only, the
    compression hooks on the cluster only. Compared across settings, every group differed in
    dist.nproc and cluster.nodes and the study's report asked for --baseline; within a setting
    only none and control hold the defaults."""

    def run(group: str, setting: str, **edits) -> SimpleNamespace:
        config = {
            "dist": {"nproc": 2 if setting == "loopback" else 1},
            "cluster": {"nodes": 0 if setting == "loopback" else 2},
        }
        for dotted, value in edits.items():
            section, key = dotted.split("__")
            config.setdefault(section, {})[key] = value
        return SimpleNamespace(
            group=group, setting=setting, is_complete=True, policy="none", config=config, from_rows=False
        )

    runs = [
        *(run(g, s) for g in ("none", "control") for s in ("loopback", "cluster-1gbit")),
        run("budget-0.5", "loopback", train__budget_fraction=0.5),
        run("bf16", "cluster-1gbit", freeze__comm_hook="bf16"),
    ]
    chosen = resolve_baseline(runs, None)
    assert chosen.group == "none"
    assert "other policy-none groups not used: bf16, budget-0.5, control" in chosen.note
    # two computations, neither at the defaults: the report cannot choose, and says so in one line
    ambiguous = [run("lr=1", "loopback", optim__lr=1.0), run("lr=2", "loopback", optim__lr=2.0)]
    with pytest.raises(ReportInputError, match="several policy-none groups .* differ in optim.lr; choose"):
        resolve_baseline(ambiguous, None)


def test_a_speedup_is_timed_on_like_hardware_and_the_pairs_left_out_are_named():
    """A cluster's nodes differ: a seed whose arm and baseline ran on other processors, or whose arm
    shared its machine with other runs, is left out of the speedup (its accuracy still pairs) and
    named in the table's notes; a manifest from before placements were recorded pairs by processor."""
    from freeze.pipeline.report.paired import paired_table
    from freeze.pipeline.report.tables import Baseline
    from tests.pipeline.handmade_runs import handmade_run

    def run(group, seed, policy, time_s, acc, gpu="H100", side_by_side=None):
        r = handmade_run("", group, seed, policy, time_s, acc, 100, changes=((50, 2),) if policy != "none" else ())
        r.manifest["hardware"] = {"gpus": [gpu], "cpu": "x"}
        if side_by_side is not None:
            r.manifest["placement"] = {"cores_allowed": 8, "runs_side_by_side": side_by_side}
        return r

    runs = [
        *(run("none", s, "none", 100.0, 80.0, side_by_side=1) for s in (0, 1, 2)),
        run("k2", 0, "static:k=2", 50.0, 80.0, side_by_side=1),  # 2.00x, like hardware
        run("k2", 1, "static:k=2", 50.0, 80.0),  # an older manifest, same GPU: pairs by processor
        run("k2", 2, "static:k=2", 10.0, 80.0, gpu="H200", side_by_side=1),  # another GPU: left out
    ]
    table = paired_table(runs, Baseline("none", "baseline: none"), target_fraction=0.95)
    row = table.data.iloc[0]
    assert row["n_pairs"] == 3 and row["speedup"] == pytest.approx(2.0)  # 2 timed pairs, both 2.00x
    assert row["arm_train_min"] == pytest.approx(50 / 60) and row["mixed_timing"].startswith("seed 2 (H200")
    assert any(n.startswith("k2: timed on other hardware than its baseline") and "seed 2" in n for n in table.notes)
    # runs side by side on one machine are not timed like a run that had it alone
    shared = [*runs[:3], *(run("k2", s, "static:k=2", 50.0, 80.0, side_by_side=2) for s in (0, 1, 2))]
    row = paired_table(shared, Baseline("none", "baseline: none"), target_fraction=0.95).data.iloc[0]
    assert row["mixed_timing"].count("seed") == 3 and "2 runs side by side" in row["mixed_timing"]


def test_a_report_rerun_into_its_folder_keeps_no_earlier_figure_and_zero_complete_runs_is_an_error(tmp_path, capsys):
    """Reliability.md cases 39-40: an earlier report's figures stayed beside tables that contradict them,
    and a report of runs of which none completed exited 0 without saying so."""
    runs = _copy_study(tmp_path)
    out = tmp_path / "rep"
    build_report(runs, out)
    (out / "from-an-earlier-report.png").write_bytes(b"\x89PNG old")
    for manifest in (runs / "fixture_study").glob("*/manifest.json"):
        data = json.loads(manifest.read_text())
        data["status"] = "failed"
        manifest.write_text(json.dumps(data))
    _assert_one_line_error(capsys, [str(runs), "--out", str(out)], "none of the", "is complete", "incomplete.md")
    assert not list(out.glob("*.png"))  # no figure of the complete runs that are no more, nor the planted one
    assert (out / "incomplete.md").is_file()


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("test_acc", 1.7, "test_acc = 1.7 is impossible; accepted: a fraction in [0, 1]"),
        ("epoch_wall_s", -5, "epoch_wall_s = -5 is impossible; accepted: a number >= 0"),
        ("boundary", 99, "boundary = 99 is impossible with"),
    ],
)
def test_impossible_values_are_refused_naming_the_line(tmp_path, capsys, key, value, words):
    """Reliability.md case 25: a test accuracy of 1.7 read as +160.62 points in the paired table."""
    runs = _copy_study(tmp_path)
    metrics = runs / "fixture_study" / "autofreeze-s0" / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    lines[-1][key] = value
    metrics.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    _assert_one_line_error(capsys, [str(runs)], f"metrics.jsonl:{len(lines)}: {words}")


def test_the_summary_is_one_row_per_arm_with_every_interval_named_in_its_header(report):
    """Issue 48: the table a researcher pastes; its numbers are the main and paired tables' own."""
    out, _ = report
    frame = pd.read_csv(out / "summary.csv", keep_default_na=False, na_values=[""])
    summary = {row["arm"]: row for row in frame.to_dict("records")}
    paired, main_rows = _rows(out / "paired.csv"), _rows(out / "main.csv")
    assert set(summary) == set(main_rows)
    group = next(g for g in summary if g in paired)
    arm = summary[group]
    assert arm["diff_points"] == pytest.approx(paired[group]["diff_points"])
    assert arm["speedup_low"] == pytest.approx(paired[group]["speedup_low"])
    assert arm["test_acc_pct"] == pytest.approx(100 * main_rows[group]["test_acc_mean"])
    header = (out / "summary.md").read_text()
    assert "test acc % [95% CI]" in header and "speedup [95% CI]" in header
    assert "95 % t intervals" in (out / "tables.md").read_text()  # the caption, in the combined tables


def test_an_eta_heatmap_says_whether_its_policy_decides_from_eta():
    """The payoff heatmap showed eta, a signal payoff does not compare (research note newcomer.md,
    F-C9): the title says which policies freeze on eta and which only recorded it."""
    from freeze.pipeline.report.plots import _eta_role

    def run(policy):
        return SimpleNamespace(manifest={"policy": policy})

    assert "falls below the threshold" in _eta_role(run("autofreeze:percentile=50"))
    assert "falls below the threshold" in _eta_role(run("cs744"))
    assert _eta_role(run("payoff")).startswith("recorded only: payoff does not decide from eta")
    assert _eta_role(run("static:k=2")).startswith("recorded only: static")
    assert "unknown" in _eta_role(run("my-plugin-policy"))  # a plugin not imported here: no guess
