"""freeze.pipeline.report.rows: a report built from a study's per-seed rows (the committed CSV) gives
the tables its run directories give, and a study's --from-rows runs only what the rows lack."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from freeze.pipeline import markdown
from freeze.pipeline.report import build_report, build_tables
from freeze.pipeline.report.cli import main as report_main
from freeze.pipeline.report.load import ReportInputError, Run, load_runs
from freeze.pipeline.report.per_seed import per_seed_table
from freeze.pipeline.report.rows import load_rows, load_sources
from freeze.pipeline.study.cli import main as study_main
from freeze.pipeline.study.committed_rows import check_from_rows, still_to_run
from freeze.pipeline.study.plan import main_specs, read_study
from freeze.pipeline.sweep import SweepError
from tests.pipeline.handmade_runs import handmade_run

RUNS = Path(__file__).parents[1] / "fixtures" / "runs"
SMOKE = Path(__file__).parents[2] / "experiments" / "configs" / "smoke.toml"
SEEDS = (0, 1, 2)


def _study() -> list[Run]:
    """A loopback frontier (budget f: 100 f s, 80 + 20 (f - 0.5) %), its baseline and control, and two
    arms that freeze, on 3 paired seeds with a spread they share."""
    runs = []
    for seed in SEEDS:
        wobble = (seed - 1) * 0.4
        for f in (0.5, 0.7, 0.9):
            acc_pct = 80 + 20 * (f - 0.5) + wobble
            runs.append(handmade_run("loopback", f"budget-{f}", seed, "none", 100 * f, acc_pct, 100 * f, fraction=f))
        runs += [
            handmade_run("loopback", "none", seed, "none", 100.0 + seed, 90 + wobble, 100),
            handmade_run("loopback", "control", seed, "none", 99.0 + 2 * seed, 90 + wobble, 100),
            handmade_run("loopback", "late", seed, "at:k=8,t=0.8", 85.0, 89.5 + wobble, 100, changes=((80, 8),)),
            handmade_run("loopback", "early", seed, "at:k=9,t=0.5", 60.0, 86 + wobble, 100, changes=((50, 9),)),
            handmade_run("cluster", "none", seed, "none", 200.0, 90 + wobble, 100),
            handmade_run("cluster", "control", seed, "none", 198.0 + 2 * seed, 90 + wobble, 100),
            handmade_run("cluster", "late", seed, "at:k=8,t=0.8", 150.0, 89.6 + wobble, 100, changes=((80, 8),)),
        ]
    return runs


def _write_rows(runs: list[Run], path: Path) -> Path:
    per_seed_table(runs).data.to_csv(path, index=False)
    return path


def _frames(runs: list[Run]) -> dict[str, pd.DataFrame]:
    return {t.name: t.data.reset_index(drop=True) for t in build_tables(runs, target_fraction=0.95)}


def test_every_table_from_the_rows_equals_the_table_from_the_runs(tmp_path):
    runs = _study()
    rows = load_rows(_write_rows(runs, tmp_path / "study.csv"))
    assert len(rows) == len(runs) and all(r.from_rows for r in rows)
    from_runs, from_rows = _frames(runs), _frames(rows)
    # hand-made runs record no start times: "when each block ran" is not made from their rows
    assert set(from_runs) - set(from_rows) == {"blocks"} and set(from_rows) < set(from_runs)
    for name, frame in from_rows.items():
        pd.testing.assert_frame_equal(from_runs[name], frame, check_dtype=False, obj=name)
    # not a vacuous equality: the study has a frontier, verdicts and a control
    iso = from_rows["iso_speedup"]
    assert set(iso["group"]) >= {"late", "early", "control"}
    assert from_rows["paired"]["control"].any()


def test_rows_of_run_directories_rebuild_their_report(tmp_path):
    """The fixture's real run directories (several epochs, phases, bytes, times): the report from their
    per-seed rows has the same main, paired, phase, blocks and per-seed tables."""
    runs = tmp_path / "runs"  # the fixture without its failed run (rows hold complete runs only)
    shutil.copytree(RUNS, runs, ignore=shutil.ignore_patterns("autofreeze-s2"))
    first = build_report(runs, tmp_path / "dirs", formats=("csv",))
    second = build_report(first["per_seed.csv"], tmp_path / "rows", formats=("csv",))
    for name in ("main", "paired", "phases", "convergence", "decisions", "per_seed", "summary"):
        left = pd.read_csv(first[f"{name}.csv"], keep_default_na=False)
        right = pd.read_csv(second[f"{name}.csv"], keep_default_na=False)
        pd.testing.assert_frame_equal(left, right, obj=name)
    pd.testing.assert_frame_equal(*(pd.read_csv(p["blocks.csv"]) for p in (first, second)))
    assert pd.read_csv(first["main.csv"])["allreduce_gb"].notna().all()


def _old_rows(runs: list[Run], path: Path) -> Path:
    """Rows as committed before they carried bytes, memory, phase times and start times."""
    frame = pd.read_csv(_write_rows(runs, path))
    newer = [
        c
        for c in frame.columns
        if c.startswith(("phase_", "load_avg", "frozen_", "machine_")) or c.endswith(("_bytes", "_time"))
    ]
    frame.drop(columns=newer).to_csv(path, index=False)
    return path


def test_rows_without_the_newer_columns_leave_bytes_unknown_and_phases_unmade(tmp_path):
    """Rows committed before they carried bytes, memory, phases and times: n/a in the main table; no
    phase or blocks table from them alone (a page keeps the ones its directories gave), and an earlier
    report's copies leave the output folder; beside run directories, the phase table says how many it
    left out."""
    study = _study()
    path = _old_rows(study, tmp_path / "old.csv")
    tables = {t.name: t for t in build_tables(load_rows(path))}
    main = tables["main"].data.set_index(["setting", "group"])
    assert main["allreduce_gb"].isna().all()
    # an unknown frozen fraction is no zero: the freezing arms froze, their fraction is n/a
    assert not main["froze_nothing"].any() and main["frozen_fraction"].isna()[("loopback", "late")]
    assert main.loc[("loopback", "control"), "frozen_fraction"] == 0.0
    assert "phases" not in tables and "blocks" not in tables
    out = tmp_path / "report"
    build_report(RUNS, out, formats=("md",))
    assert (out / "phases.md").is_file()
    build_report(path, out, formats=("md",))
    assert not (out / "phases.md").exists() and not (out / "blocks.md").exists()
    mixed = {t.name: t for t in build_tables([*load_runs(RUNS), *load_rows(path)], baseline="none")}
    assert f"Not in it: {len(study)} runs read back from per-seed rows" in mixed["phases"].caption


def test_a_run_directory_takes_the_place_of_its_row(tmp_path, capsys):
    dirs = load_runs(RUNS)
    path = _write_rows(dirs, tmp_path / "rows.csv")
    extra = _study()[:3]
    pd.concat([pd.read_csv(path), per_seed_table(extra).data]).to_csv(path, index=False)
    runs = load_sources([RUNS, path], log=print)
    assert len(runs) == len(dirs) + len(extra)
    assert sum(r.from_rows for r in runs) == len(extra)
    complete = sum(r.is_complete for r in dirs)  # the fixture's failed run has no row to leave out
    assert f"({complete} rows left out: their run directories are here)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda f: f.drop(columns="probes"), "not a per-seed table (missing columns: probes)"),
        (lambda f: f.assign(test_acc="high"), ":2: column test_acc must be a number in [0, 1], got 'high'"),
        (lambda f: f.assign(test_acc="1.7"), ":2: column test_acc must be a number in [0, 1], got '1.7'"),
        (lambda f: f.assign(val_acc_per_epoch="nan"), ":2: column val_acc_per_epoch must be a number in [0, 1]"),
        (lambda f: f.assign(epochs=2), ":2: column val_acc_per_epoch has 1 values for 2 epochs"),
        (lambda f: f.assign(boundary_steps="80-8"), ":2: column boundary_steps must be pairs a:b"),
        (lambda f: f.assign(boundary_steps="80:8.5"), ":2: column boundary_steps must be pairs a:b of whole numbers"),
        (lambda f: pd.concat([f, f.iloc[:1]]), "has two per-seed rows"),
    ],
)
def test_a_broken_row_is_one_line_naming_file_line_and_column(tmp_path, edit, message):
    path = _write_rows(_study()[:6], tmp_path / "rows.csv")
    edit(pd.read_csv(path, dtype=str, keep_default_na=False)).to_csv(path, index=False)
    with pytest.raises(ReportInputError, match=re.escape(message)):
        load_sources([path])


def test_the_report_command_reads_a_per_seed_csv(tmp_path, monkeypatch, capsys):
    path = _write_rows(_study(), tmp_path / "study.csv")
    monkeypatch.chdir(tmp_path)
    assert report_main([str(path), "--formats", "csv,md"]) == 0
    assert (tmp_path / "runs" / "study-report" / "iso_speedup.csv").is_file()  # not beside the committed rows
    assert "report: 30 runs read from per-seed rows, 0 from run directories" in capsys.readouterr().out


STUDY = """[study]
name = "tiny"
finetune = "{smoke}"
seeds = [0, 1]
report_md = "{page}"

[arms]
none = []
late = ["freeze.policy=at:k=2,t=0.8"]
"""


def test_from_rows_runs_only_what_neither_a_directory_nor_a_row_holds(tmp_path):
    page = tmp_path / "report" / "tiny-study.md"
    page.parent.mkdir()
    page.write_text("<!-- main:start -->\n<!-- main:end -->\n")
    config = tmp_path / "tiny.toml"
    config.write_text(STUDY.format(page=page, smoke=SMOKE))
    study = read_study(config)
    with pytest.raises(SweepError, match="--from-rows: no committed per-seed rows at .*tiny.csv"):
        check_from_rows(study)
    specs = main_specs(study, {}, str(tmp_path / "runs"), ())
    rows = page.parent / "per-seed" / "tiny.csv"
    rows.parent.mkdir()
    rows.write_text("setting,group,seed,run\n" + "".join(f",x,0,{s.name}\n" for s in specs[:3]))
    assert check_from_rows(study) == rows
    assert [s.name for s in still_to_run(specs, rows)] == [s.name for s in specs[3:]]
    Path(specs[0].config.run_dir()).mkdir(parents=True)  # a directory, complete or not, is the executor's
    assert [s.name for s in still_to_run(specs, rows)] == [specs[0].name] + [s.name for s in specs[3:]]


REPO = Path(__file__).parents[2]
# study -> (its study file, the spans its rows cannot give): the frontier and anneal rows were committed
# before rows carried bytes, memory and frozen fractions, so their pages' main and summary tables (from
# the run directories: all-reduced GB, frozen fraction) are not what the rows give; every other span is.
PAGES = {
    "frontier": ("study_frontier.toml", {"main", "summary"}),
    "horizon": ("study_horizon.toml", set()),
    "anneal": ("study_anneal.toml", {"main", "summary"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("study", sorted(PAGES))
def test_every_table_on_a_study_page_is_what_its_committed_rows_give(study, tmp_path, capsys):
    """The page's spans equal the tables `--from-rows` builds from report/per-seed/<study>.csv: every
    number on it is regenerated by one command (`--from-rows --update-report`) from what is committed."""
    config, not_from_rows = PAGES[study]
    args = ["--config", str(REPO / "experiments" / "configs" / config), "--from-rows", "--out-dir", str(tmp_path)]
    assert study_main([*args, "--dry-run"]) == 0  # never trains: the committed rows hold every run
    assert " and 0 study runs" in capsys.readouterr().out
    assert study_main(args) == 0, capsys.readouterr().err
    assert "nothing to run" in capsys.readouterr().out
    page = (REPO / "report" / f"{study}-study.md").read_text(encoding="utf-8")
    built = tmp_path / f"{study}-report"
    compared = []
    for name, _ in markdown.spans(page):
        if (built / f"{name}.md").is_file() and name not in not_from_rows:
            assert markdown.read(page, name) == (built / f"{name}.md").read_text(encoding="utf-8").strip(), name
            compared.append(name)
    assert {"paired", "iso_speedup"} <= set(compared)
