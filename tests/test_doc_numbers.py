"""The counts the README and the docs state are computed from the files they describe, so they are
never stale again (issue 47: a new user's trial found five stale numbers). A study's run counts are
its study file's plan; a finished study's count is its committed per-seed table's rows. Measured
times (the suite, a seed block) are measurements and live in one table each (docs/experiments.md,
the study pages' "What ran when"), which the other pages link instead of restating."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from freeze.pipeline.study.plan import main_specs, read_study, search_specs

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "experiments" / "configs"


def _plan_counts(study_file: str) -> tuple[int, int]:
    """(search runs, grid runs) of a study file, as its --dry-run counts them."""
    study = read_study(CONFIGS / study_file)
    chosen = {arm: values[0] for arm, values in (study.search.candidates if study.search else {}).items()}
    grid = main_specs(study, study.search.choices_for(chosen) if study.search else chosen, None)
    search = search_specs(study, None) if study.search else []
    return len(search), len(grid)


def _text(page: str) -> str:
    return (REPO / page).read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("page", "pattern", "study_file"),
    [
        ("docs/study.md", r'"0 pretraining, (\d+) search and (\d+) study runs"', "study_cifar10.toml"),
        (
            "docs/study.md",
            r"the search \((\d+) runs\) as one job array.*?the grid \((\d+) runs\)",
            "study_cifar10.toml",
        ),
        ("docs/study.md", r"`make study-full`: (\d+) search runs and (\d+) study runs", "study_fdsl32.toml"),
    ],
)
def test_stated_search_and_grid_counts_are_the_study_files_plans(page, pattern, study_file):
    match = re.search(pattern, _text(page), re.S)
    assert match, f"{page}: no sentence matching {pattern}"
    assert tuple(map(int, match.groups())) == _plan_counts(study_file), f"{page} states {match.group(0)!r}"


@pytest.mark.parametrize(
    ("page", "pattern", "study_file"),
    [
        ("docs/study.md", r"\n(\d+) runs, which `python -m experiments.study --config experiments/configs/study_cifar10", "study_cifar10.toml"),
        ("docs/frontier.md", r"study_frontier.toml --dry-run +# (\d+) runs", "study_frontier.toml"),
    ],
)  # fmt: skip
def test_stated_run_totals_are_the_study_files_plans(page, pattern, study_file):
    match = re.search(pattern, _text(page))
    assert match, f"{page}: no sentence matching {pattern}"
    assert int(match.group(1)) == sum(_plan_counts(study_file)), f"{page} states {match.group(0)!r}"


@pytest.mark.parametrize("study", ["anneal", "frontier"])
def test_the_readmes_count_of_a_finished_study_is_its_per_seed_table(study):
    with open(REPO / f"report/per-seed/{study}.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    match = re.search(rf"report/{study}-study.md\), (\d+) runs\)", _text("README.md"))
    assert match and int(match.group(1)) == len(rows) == sum(_plan_counts(f"study_{study}.toml"))
    assert len({row["seed"] for row in rows}) == len(read_study(CONFIGS / f"study_{study}.toml").seeds)


def test_the_readmes_times_of_the_two_commands_are_the_measured_table_rounded():
    """README rounds what docs/experiments.md measured; a new measurement in the table must move it."""
    readme = " ".join(_text("README.md").split())
    said = re.search(r"`make test` takes about (\d+) minutes and `make study` about (\d+)", readme)
    table = _text("docs/experiments.md")
    suite = re.search(r"\| `\.ci/run` = `make lint` \+ `make test` \([^)]*\) \| (\d+) min (\d+) s \|", table)
    study = re.search(r"\| `make study` \([^)]*\) \| (\d+) min (\d+) s \|", table)
    assert said and suite and study
    for stated, (minutes, seconds) in zip(said.groups(), (suite.groups(), study.groups())):
        assert abs(int(stated) - (int(minutes) + int(seconds) / 60)) <= 1.0, (stated, minutes, seconds)


def test_the_reports_table_of_studies_counts_what_their_files_plan_and_their_per_seed_tables_hold():
    """REPORT.md's "The studies": each row's runs are its study file's plan, and where the study's
    per-seed table is committed (the studies under the calibrated statistic), its rows and seeds."""
    rows = re.findall(
        r"^\| \[(\w+)-study\.md\]\(\1-study\.md\) \|.*?\| (\d+) \((\d+) seeds\) \| [^|]+ \| ([^|]+) \|",
        _text("report/REPORT.md"),
        re.M,
    )
    assert {name for name, *_ in rows} == {"frontier", "anneal", "horizon"}, rows
    for name, runs, seeds, per_seed in rows:
        study = read_study(CONFIGS / f"study_{name}.toml")
        assert int(runs) == sum(_plan_counts(f"study_{name}.toml")) and int(seeds) == len(study.seeds), name
        if per_seed.strip().startswith("["):  # else a rerun in progress, said in words
            assert per_seed.strip() == f"[{name}.csv](per-seed/{name}.csv)", per_seed
            with open(REPO / "report" / "per-seed" / f"{name}.csv", newline="", encoding="utf-8") as f:
                table = list(csv.DictReader(f))
            assert len(table) == int(runs) and len({row["seed"] for row in table}) == int(seeds), name
