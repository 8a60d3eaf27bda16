"""The study: file checks, the interleaved order, the search's choice on validation, and the command
end to end with the training replaced by run directories written here (the runs' contents are
chosen so that the expected choice and the report's numbers are known)."""

from __future__ import annotations

import json
import math
import tomllib
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from freeze.pipeline.config import config_to_toml
from freeze.pipeline.report.load import load_runs
from freeze.pipeline.report.paired import is_control
from freeze.pipeline.study import cli, stages
from freeze.pipeline.study.plan import main_specs, read_study, search_specs
from freeze.pipeline.study.search import SearchError, choose
from freeze.pipeline.sweep import SweepError, SweepSummary

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "experiments" / "configs" / "smoke.toml"

STUDY = f"""
[study]
name = "tiny"
finetune = "{SMOKE}"
seeds = [0, 1, 2]
order_seed = 7
[settings]
loopback = ["dist.nproc=2"]
single = ["dist.nproc=1"]
[arms]
none = ["freeze.policy=none"]
control = ["freeze.policy=none"]
static-k2 = ["freeze.policy=static:k=2"]
autofreeze = []
[search]
setting = "single"
seeds = [100]
qualify_margin_points = 0.5
[search.candidates]
autofreeze = ["autofreeze:percentile=50", "autofreeze:percentile=80"]
"""


FRONTIER = """
[frontier]
fractions = [0.5, 0.8]
settings = ["loopback"]
"""


def _study(tmp_path: Path, text: str = STUDY) -> Path:
    path = tmp_path / "study.toml"
    path.write_text(text)
    return path


def test_every_seed_block_holds_every_cell_once_in_its_own_order(tmp_path):
    study = read_study(_study(tmp_path))
    specs = main_specs(study, {"autofreeze": "autofreeze:percentile=80"}, str(tmp_path / "runs"))
    assert len(specs) == 3 * 2 * 4
    blocks = [specs[i : i + 8] for i in range(0, 24, 8)]
    orders = []
    for seed, block in zip((0, 1, 2), blocks):
        assert {s.config.run.seed for s in block} == {seed}  # one block per seed: drift falls within blocks
        cells = [(s.config.run.setting, s.group) for s in block]
        assert Counter(cells) == Counter((st, arm) for st in ("loopback", "single") for arm in study.arms)
        orders.append(cells)
    assert len({tuple(o) for o in orders}) == 3  # shuffled differently per seed
    again = main_specs(study, {"autofreeze": "autofreeze:percentile=80"}, str(tmp_path / "runs"))
    assert [s.name for s in again] == [s.name for s in specs]  # deterministic: a re-run resumes the same plan
    by_name = {s.name: s.config for s in specs}
    af = by_name["single_autofreeze_seed=1"]
    assert af.freeze.policy == "autofreeze:percentile=80" and af.dist.nproc == 1 and af.run.group == "autofreeze"
    assert by_name["loopback_static-k2_seed=2"].dist.nproc == 2
    assert by_name["loopback_control_seed=0"].run.study == "tiny"


def test_the_frontier_adds_a_full_fine_tuning_arm_per_budget_fraction_in_its_settings(tmp_path):
    study = read_study(_study(tmp_path, STUDY + FRONTIER))
    assert study.frontier == {"budget-0.5": 0.5, "budget-0.8": 0.8}
    specs = main_specs(study, {"autofreeze": "autofreeze:percentile=80"}, str(tmp_path / "runs"))
    budget = [s.config for s in specs if s.config.run.group.startswith("budget-")]
    assert len(specs) == 3 * (2 * 4 + 2) and len(budget) == 3 * 2
    assert {(c.run.setting, c.run.group, c.train.budget_fraction, c.freeze.policy) for c in budget} == {
        ("loopback", "budget-0.5", 0.5, "none"),
        ("loopback", "budget-0.8", 0.8, "none"),
    }
    # each seed's block holds every budget once, shuffled in with the other arms (paired and interleaved)
    blocks = [[s.config.run.group for s in specs[i : i + 10]] for i in range(0, 30, 10)]
    assert all(Counter(b)["budget-0.5"] == Counter(b)["budget-0.8"] == 1 for b in blocks)
    assert len({tuple(b) for b in blocks}) == 3


def test_search_runs_use_search_seeds_and_setting(tmp_path):
    specs = search_specs(read_study(_study(tmp_path)), str(tmp_path / "runs"))
    assert sorted(s.group for s in specs) == [
        "autofreeze@autofreeze:percentile=50",
        "autofreeze@autofreeze:percentile=80",
        "none",
    ]
    assert {(s.config.run.seed, s.config.run.setting, s.config.run.study) for s in specs} == {
        (100, "single", "tiny-search")
    }


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace("[search]\n", "[serch]\n"), "unknown table(s) serch"),
        (lambda t: t.replace("seeds = [100]", "seeds = [1]"), "search.seeds [1] are also study seeds"),
        (lambda t: t.replace('none = ["freeze.policy=none"]\n', ""), "needs the baseline arm 'none'"),
        (lambda t: t.replace("autofreeze = []", 'autofreeze = ["freeze.policy=cs744"]'), "[search] chooses it"),
        (lambda t: t.replace("order_seed = 7", "order_seed = 7\nmargin = 1"), "unknown key(s) margin; accepted:"),
        (lambda t: t.replace('setting = "single"', 'setting = "cluster"'), "search.setting 'cluster' is not"),
        (lambda t: t.replace("seeds = [0, 1, 2]", "seeds = [0, 0]"), "seeds must be a non-empty list of distinct"),
        (lambda t: t.replace('"dist.nproc=1"]', '"dist.nprocs=1"]'), "nprocs"),
        (lambda t: t + FRONTIER.replace("0.5, 0.8", "0, 0.8"), "frontier.fractions = [0, 0.8]; accepted:"),
        (lambda t: t + FRONTIER.replace("0.5, 0.8", "0.5, 1.0"), "(1.0 is the baseline arm 'none'"),
        (lambda t: t + FRONTIER.replace("0.5, 0.8", "0.5, 1.5"), "a non-empty list of distinct numbers in (0, 1)"),
        (lambda t: t + FRONTIER.replace('"loopback"', '"cluster"'), "frontier.settings ['cluster']: not settings"),
        (lambda t: t + FRONTIER.replace("fractions", "fraction"), "[frontier]: fraction; accepted keys"),
        (lambda t: t.replace("[arms]\n", '[arms]\n"budget-0.5" = []\n') + FRONTIER, "the names of [frontier]'s arms"),
    ],
)
def test_bad_study_files_are_one_line_errors(tmp_path, edit, message, capsys):
    path = _study(tmp_path, edit(STUDY))
    assert cli.main(["--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_key_error_names_the_file_it_came_from(tmp_path, capsys):
    """A typo in the finetune or pretrain config names that file and the study file; a typo in an
    arm's table or in [search] names the key, not only the keys accepted."""
    finetune = tmp_path / "finetune.toml"
    finetune.write_text(SMOKE.read_text().replace("[optim]", "[optim]\nlrr = 0.1", 1))
    cases = [
        (STUDY.replace(str(SMOKE), str(finetune)), [f"config {finetune}: unknown key 'optim.lrr'", "keys in [optim]"]),
        (
            STUDY.replace("[study]\n", f'[study]\npretrain = "{finetune}"\n'),
            ["pretrain: ", f"config {finetune}: unknown key 'optim.lrr' (did you mean 'optim.lr'?)"],
        ),
        (
            STUDY.replace("autofreeze = []", 'autofreeze = { overides = ["freeze.cache=memory"] }'),
            ["arms.autofreeze: unknown key(s) overides; accepted: overrides, settings"],
        ),
        (
            STUDY.replace('setting = "single"', 'setting = "single"\nseed = [5]'),
            ["[search]: unknown key(s) seed; accepted: candidates, qualify_margin_points, same_as, seeds, setting"],
        ),
    ]
    for text, parts in cases:
        path = _study(tmp_path, text)
        assert cli.main(["--config", str(path), "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: study file {path}: ") and err.count("\n") == 1, err
        for part in parts:
            assert part in err, (part, err)


def test_dry_run_lists_runs_in_order(tmp_path, capsys):
    assert cli.main(["--config", str(_study(tmp_path)), "--dry-run", "--out-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "0 pretraining, 3 search and 24 study runs"
    assert sum(line.startswith("search ") for line in out) == 3
    assert "single_autofreeze_seed=0  (policy chosen by the search)" in "\n".join(out)


def test_same_as_best_runs_the_fastest_qualifying_choice_of_every_searched_arm(tmp_path):
    from freeze.pipeline.study.search import Candidate, best_arm

    text = STUDY.replace("autofreeze = []\n", "autofreeze = []\nlinear = []\nbest-nocache = []\n").replace(
        'autofreeze = ["autofreeze:percentile=50", "autofreeze:percentile=80"]\n',
        'autofreeze = ["autofreeze:percentile=50"]\nlinear = ["linear", "linear:freeze_start=0.25"]\n'
        '[search.same_as]\nbest-nocache = "best"\n',
    )
    search = read_study(_study(tmp_path, text)).search
    chosen = {"autofreeze": "autofreeze:percentile=50", "linear": "linear:freeze_start=0.25"}
    table = [
        Candidate("autofreeze", "autofreeze:percentile=50", 1, 0.80, 1.3, True, True),
        Candidate("linear", "linear", 1, 0.80, 1.9, False, False),  # fastest, but does not qualify
        Candidate("linear", "linear:freeze_start=0.25", 1, 0.80, 1.5, True, True),
    ]
    assert best_arm(table) == "linear"
    assert search.choices_for(chosen, best_arm(table))["best-nocache"] == "linear:freeze_start=0.25"
    # none qualifies: the most accurate chosen one
    table = [
        Candidate("autofreeze", "a", 1, 0.70, 1.3, False, True),
        Candidate("linear", "l", 1, 0.75, 1.1, False, True),
    ]
    assert best_arm(table) == "linear"
    with pytest.raises(SweepError, match="or 'best'"):
        read_study(_study(tmp_path, text.replace('best-nocache = "best"', 'best-nocache = "fastest"')))


def test_a_long_study_runs_in_parts_of_whole_seed_blocks(tmp_path, capsys):
    path = _study(tmp_path)
    assert cli.main(["--config", str(path), "--dry-run", "--out-dir", str(tmp_path / "r"), "--seeds", "1"]) == 0
    study_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("study ")]
    assert study_lines and all(line.split()[1].endswith("_seed=1") for line in study_lines)
    full = main_specs(read_study(path), {}, str(tmp_path / "r"))
    assert len(study_lines) == sum(spec.config.run.seed == 1 for spec in full)  # the whole block of seed 1
    assert cli.main(["--config", str(path), "--dry-run", "--seeds", "9"]) == 2
    err = capsys.readouterr().err
    assert "--seeds must be a non-empty subset of the study's seeds" in err and err.count("\n") == 1


# --- the command end to end, with run directories written instead of trained ---------------------

# search: percentile=50 is fast but loses 2 points of val accuracy (beyond the 0.5 margin);
# percentile=80 is slower but within the margin -> 80 must be chosen.
WALL_S = {"none": 100.0, "autofreeze:percentile=50": 40.0, "autofreeze:percentile=80": 60.0, "static:k=2": 80.0}
VAL = {"none": 0.80, "autofreeze:percentile=50": 0.78, "autofreeze:percentile=80": 0.797, "static:k=2": 0.79}


def complete_manifest(config, epochs: int, block_names: list[str]) -> dict:
    """manifest.json of a complete run of ``config`` (world size: its cluster's nodes, else its workers)."""
    return {
        "run_name": config.run.name,
        "group": config.run_group(),
        "setting": config.run.setting,
        "policy": config.freeze.policy,
        "seed": config.run.seed,
        "world_size": config.cluster.nodes or config.dist.nproc,
        "status": "complete",
        "epochs_planned": epochs,
        "epochs_done": epochs,
        "block_names": block_names,
    }


def _write_run(config, wall_s: float, val: float, test: float) -> None:
    run_dir = config.run_dir()
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps(complete_manifest(config, 2, ["a", "b"])))
    (run_dir / "config.toml").write_text(config_to_toml(config))
    lines = []
    for epoch in range(2):
        lines.append(
            {
                "epoch": epoch,
                "boundary": 0,
                # a freezing arm froze something (one that froze nothing is no finding in the report)
                "frozen_param_fraction": 0.0 if config.freeze.policy == "none" else 0.1 * epoch,
                "val_acc": val - 0.1 * (1 - epoch),
                "test_acc": test if epoch == 1 else None,
                "epoch_wall_s": wall_s / 2,
                "cumulative_wall_s": wall_s / 2 * (epoch + 1),
                "phase_s": {"data": 0, "forward": 0, "backward": wall_s / 2, "optimizer": 0, "freezer": 0, "eval": 1},
                "allreduce_bytes": 1000,
                "grad_norm": {"eta": [None, None]},
            }
        )
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def _fake_runner(specs, log=print, eta=None):
    """Stands in for training: writes each run's directory with the numbers above (test acc depends
    on the seed so intervals are finite; the control is timed 1 % off the baseline, alternately; the
    chosen autofreeze loses 0.4 validation points from search to study, as searched arms did)."""
    for spec in specs:
        c = spec.config
        wall = WALL_S[c.freeze.policy] * (1.01 if c.run.group == "control" and c.run.seed % 2 else 1.0)
        if c.run.group == "control" and not c.run.seed % 2:
            wall *= 0.99
        drop = 0.004 if "80" in c.freeze.policy and not c.run.study.endswith("-search") else 0.0
        val = VAL[c.freeze.policy] - drop
        # seeds 100-103 (the search's) as 0-3: an accuracy above 1 is refused by the report
        _write_run(c, wall, val, 0.7 + 0.01 * (c.run.seed % 100) - (0.002 if "80" in c.freeze.policy else 0))
    return SweepSummary(ran=[s.name for s in specs])


def test_study_chooses_on_validation_runs_interleaved_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(stages, "run_specs", _fake_runner)
    report_md = tmp_path / "REPORT.md"
    report_md.write_text("before\n<!-- paired:start -->\nold\n<!-- paired:end -->\n")
    text = STUDY.replace("order_seed = 7", f'order_seed = 7\nreport_md = "{report_md}"')
    path = _study(tmp_path, text.replace('"dist.nproc=2"', '"dist.nproc=1"'))
    out_dir = tmp_path / "runs"
    assert cli.main(["--config", str(path), "--out-dir", str(out_dir)]) == 0
    search_md = (out_dir / "tiny-report" / "search.md").read_text()
    assert "| autofreeze | autofreeze:percentile=80 | 1 | 79.70 | -0.30 | 1.67x | yes | **chosen** |" in search_md
    assert "| autofreeze | autofreeze:percentile=50 | 1 | 78.00 | -2.00 | 2.50x | no |  |" in search_md
    # and how the choice fared on the study's seeds (issue 35: the search-to-study shift per arm)
    assert "| autofreeze | autofreeze:percentile=80 | -0.30 | -0.70 (3 seeds) | -0.40 |" in search_md
    assert "Mean shift -0.40 points over 1 arm." in search_md
    chosen = json.loads((out_dir / "tiny" / "single_autofreeze_seed=2" / "manifest.json").read_text())
    assert chosen["policy"] == "autofreeze:percentile=80"
    paired = pd.read_csv(out_dir / "tiny-report" / "paired.csv", keep_default_na=False)
    af = paired[(paired["group"] == "autofreeze") & (paired["setting"] == "single")].iloc[0]
    assert af["speedup"] == pytest.approx(100 / 60) and af["n_pairs"] == 3
    assert af["diff_points"] == pytest.approx(-0.2) and af["verdict"] == "non-inferior"  # identical diffs: CI 0
    control = paired[(paired["group"] == "control") & (paired["setting"] == "single")].iloc[0]
    assert control["speedup_low"] < 1.0 < control["speedup_high"] and control["control"]
    assert "control single/control (policy none" in (out_dir / "tiny-report" / "paired.md").read_text()
    assert "\nold\n" in report_md.read_text()  # not rewritten without --update-report
    out = capsys.readouterr().out
    assert "left as it is" in out
    # it ends by saying what the tables mean, and where the full study's answer is
    meaning = out.split("== what this means\n", 1)[1].splitlines()
    assert "single/autofreeze: trained faster than the baseline, 1.67x (95% CI [1.67, 1.67])." in " ".join(meaning)
    assert any(line.startswith("The control single/control (the baseline run again) reads") for line in meaning)
    assert f"The measured answer is in {report_md} (docs/study.md)." in meaning
    # --update-report splices the generated tables in; complete runs are skipped, not re-made
    monkeypatch.setattr(
        stages, "run_specs", lambda specs, log=print, eta=None: SweepSummary(skipped=[s.name for s in specs])
    )
    assert cli.main(["--config", str(path), "--out-dir", str(out_dir), "--update-report"]) == 0
    assert "\nold\n" not in report_md.read_text() and "non-inferior" in report_md.read_text()
    # issue 46: the per-seed numbers are committed beside the report, one row per complete run
    per_seed = pd.read_csv(tmp_path / "per-seed" / "tiny.csv", keep_default_na=False)
    row = per_seed[(per_seed["group"] == "autofreeze") & (per_seed["setting"] == "single")]
    assert sorted(row["seed"]) == [0, 1, 2] and set(row["policy"]) == {"autofreeze:percentile=80"}
    assert {"train_s", "test_acc", "val_acc", "steps", "boundary_steps", "probes", "timed_on"} <= set(per_seed)
    paired_again = (
        row["test_acc"].mean()
        - per_seed[(per_seed["group"] == "none") & (per_seed["setting"] == "single")]["test_acc"].mean()
    )
    assert 100 * paired_again == pytest.approx(af["diff_points"])  # a paired number, recomputed from the CSV


def test_a_study_without_prediction_or_search_leaves_no_stale_table(tmp_path, monkeypatch):
    """predict = false and no [search]: a predicted or search span of REPORT.md (and its .md in the
    report folder) left by an earlier invocation must not pass for this study's result."""
    monkeypatch.setattr(stages, "run_specs", _fake_runner)
    report_md = tmp_path / "REPORT.md"
    old = "| setting | group | predicted s |\n| old | table | 1.0 |"
    report_md.write_text(
        f"a\n<!-- predicted:start -->\n{old}\n<!-- predicted:end -->\nb\n"
        f"<!-- search:start -->\n{old}\n<!-- search:end -->\n"
    )
    report_dir = tmp_path / "runs" / "tiny-report"
    report_dir.mkdir(parents=True)
    for suffix in (".md", ".csv", ".tex"):
        (report_dir / f"predicted{suffix}").write_text(old)
    (report_dir / "search.md").write_text(old)
    text = STUDY.split("[search]")[0].replace("autofreeze = []\n", "")
    path = _study(tmp_path, text.replace("order_seed = 7", f'order_seed = 7\nreport_md = "{report_md}"'))
    assert cli.main(["--config", str(path), "--out-dir", str(tmp_path / "runs"), "--update-report"]) == 0
    assert not list(report_dir.glob("predicted.*")) and not (report_dir / "search.md").exists()
    assert report_md.read_text() == (
        "a\n<!-- predicted:start -->\n"
        f"The cost model's prediction was not run for study tiny (`[study] predict = false` in {path}).\n"
        "<!-- predicted:end -->\nb\n"
        f"<!-- search:start -->\nNo parameter search in study tiny ({path} has no [search]).\n"
        "<!-- search:end -->\n"
    )


def test_the_search_qualifies_at_half_the_study_margin_unless_told(tmp_path, capsys):
    """Chosen at the margin it is then tested at, a search picks the candidate its noise favoured
    most (issue 35): by default a candidate qualifies at half of margin_points."""
    default = STUDY.replace("qualify_margin_points = 0.5\n", "")
    assert read_study(_study(tmp_path, default)).search.qualify_margin_points == 0.25
    assert read_study(_study(tmp_path, STUDY)).search.qualify_margin_points == 0.5
    for bad in ("0", "0.75", "true"):
        path = _study(tmp_path, STUDY.replace("qualify_margin_points = 0.5", f"qualify_margin_points = {bad}"))
        assert cli.main(["--config", str(path), "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert "search.qualify_margin_points" in err and "accepted: a number in (0, margin_points = 0.5]" in err
    # the runs of the end-to-end test below: percentile=80 is 0.30 points below the baseline
    runs_dir = tmp_path / "runs"
    _fake_runner(search_specs(read_study(_study(tmp_path, default)), str(runs_dir)))
    chosen, candidates, _ = choose(read_study(_study(tmp_path, default)).search, load_runs(runs_dir / "tiny-search"))
    assert not any(c.qualifies for c in candidates) and chosen == {"autofreeze": "autofreeze:percentile=80"}


def test_search_refuses_incomplete_runs(tmp_path):
    study = read_study(_study(tmp_path))
    with pytest.raises(SearchError, match="no complete run for seed"):
        choose(study.search, [])
    assert math.isfinite(study.margin_points)


def test_study_files_in_the_repo_dry_run():
    names = (
        "study_offline.toml",
        "study_offline_full.toml",
        "study_cifar10.toml",
        "study_views.toml",
        "study_fdsl32.toml",
        "study_frontier.toml",
    )
    for name in names:
        study = read_study(REPO / "experiments" / "configs" / name)
        assert len(study.seeds) >= 3, name
        chosen = {a: c[0] for a, c in (study.search.candidates if study.search else {}).items()}
        try:
            main_specs(study, study.search.choices_for(chosen) if study.search else chosen, None)
        except SweepError as e:  # pragma: no cover - the message is the failure
            pytest.fail(f"{name}: {e}")


def _resolved(spec) -> dict:
    """A run's config as the report reads it back from its config.toml."""
    return tomllib.loads(config_to_toml(spec.config))


def test_controls_of_the_repo_studies_are_the_arms_that_change_nothing():
    """study_offline_full's control arm (the same overrides as none) is a control; the views study's
    policy-none arms train on other augmentations and are not."""
    for name, controls in (("study_offline_full.toml", {"control"}), ("study_views.toml", set())):
        study = read_study(REPO / "experiments" / "configs" / name)
        chosen = {a: c[0] for a, c in (study.search.candidates if study.search else {}).items()}
        specs = main_specs(study, chosen, None)
        base = {(s.config.run.setting, s.config.run.seed): _resolved(s) for s in specs if s.group == "none"}
        found = {
            s.group
            for s in specs
            if s.group != "none" and is_control(_resolved(s), base[s.config.run.setting, s.config.run.seed])
        }
        assert found == controls, name


def test_same_as_arm_runs_the_policy_chosen_for_its_source(tmp_path):
    text = STUDY.replace("autofreeze = []", 'autofreeze = []\nautofreeze-nocache = ["freeze.cache=off"]')
    text += '[search.same_as]\nautofreeze-nocache = "autofreeze"\n'
    study = read_study(_study(tmp_path, text))
    chosen = study.search.choices_for({"autofreeze": "autofreeze:percentile=80"})
    specs = {s.name: s.config for s in main_specs(study, chosen, str(tmp_path / "runs"))}
    assert specs["single_autofreeze-nocache_seed=0"].freeze.policy == "autofreeze:percentile=80"
    bad = _study(tmp_path, text.replace('autofreeze-nocache = "autofreeze"', 'autofreeze-nocache = "none"'))
    with pytest.raises(SweepError, match="search.same_as.autofreeze-nocache = 'none'"):
        read_study(bad)


def test_a_study_whose_runs_all_refused_ends_with_one_line(tmp_path, monkeypatch, capsys):
    """Runs refused before writing their directory (e.g. weights that do not load): no traceback."""
    monkeypatch.setattr(
        stages, "run_specs", lambda specs, log=print, eta=None: SweepSummary(failed=[(s.name, "x") for s in specs])
    )
    path = _study(tmp_path, STUDY.split("[search]")[0])
    assert cli.main(["--config", str(path), "--out-dir", str(tmp_path / "runs")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: report: runs directory not found") and err.count("\n") == 1


def test_update_report_with_a_broken_span_stops_before_any_run(tmp_path, monkeypatch, capsys):
    """A REPORT.md span without its end marker is one line naming the file and the marker, up front,
    not after the study's runs (nor a silent skip of that table)."""
    monkeypatch.setattr(stages, "run_specs", lambda *a, **k: pytest.fail("ran before checking REPORT.md"))
    report_md = tmp_path / "REPORT.md"
    report_md.write_text("before\n<!-- paired:start -->\nold\n")
    path = _study(tmp_path, STUDY.replace("order_seed = 7", f'order_seed = 7\nreport_md = "{report_md}"'))
    assert cli.main(["--config", str(path), "--out-dir", str(tmp_path / "runs"), "--update-report"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {report_md}: <!-- paired:end --> is on 0 lines, expected on exactly one\n"


def test_update_report_into_a_page_without_spans_stops_before_any_run(tmp_path, monkeypatch, capsys):
    """A page with no table span (report/REPORT.md, the headline, has none) would take nothing and
    the study would still publish figures and per-seed rows beside it: refused up front, one line."""
    monkeypatch.setattr(stages, "run_specs", lambda *a, **k: pytest.fail("ran before checking the page"))
    report_md = tmp_path / "REPORT.md"
    report_md.write_text("# the headline\nno tables here\n")
    path = _study(tmp_path, STUDY.replace("order_seed = 7", f'order_seed = 7\nreport_md = "{report_md}"'))
    assert cli.main(["--config", str(path), "--out-dir", str(tmp_path / "runs"), "--update-report"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: study file {path}: --update-report: report_md {report_md} has no table span")
    assert err.count("\n") == 1 and report_md.read_text() == "# the headline\nno tables here\n"
    assert not (tmp_path / "runs").exists() and not (tmp_path / "per-seed").exists()


def test_a_bool_is_not_a_margin_nor_a_target_fraction(tmp_path):
    for key in ("margin_points", "target_fraction"):
        text = STUDY.replace("order_seed = 7", f"order_seed = 7\n{key} = true")
        with pytest.raises(SweepError, match=f"{key} must be .*got True"):
            read_study(_study(tmp_path, text))


def test_workers_follow_the_machine_from_the_command_line_without_editing_the_study(tmp_path, capsys):
    """One machine with 8 GPUs: `python -m experiments.study --config study.toml dist.nproc=8` (issue 32:
    the study took no overrides, and the settings fix dist.nproc)."""
    from freeze.pipeline.study.plan import with_command_line_overrides

    path = _study(tmp_path)
    study = with_command_line_overrides(read_study(path), ("dist.nproc=8",))
    specs = main_specs(study, {}, str(tmp_path / "r")) + search_specs(study, str(tmp_path / "r"))
    assert {spec.config.dist.nproc for spec in specs} == {8}  # over both settings' own dist.nproc
    assert cli.main(["--config", str(path), "--dry-run", "dist.nproc=8"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "0 pretraining, 3 search and 24 study runs"
    for override, fragments in (
        ("run.seed=3", ("the study sets run.seed for every run itself", "--seeds")),
        # reliability probe case 15: once silently ignored (runs and report went to ./runs)
        ("run.out_dir=elsewhere", ("the study sets run.out_dir for every run itself", "--out-dir")),
        # case 17: once turned every arm, the baseline included, into one policy and exited 0
        ("freeze.policy=geometric:alpha=0.5", ("the study sets freeze.policy for every run itself", "[arms]")),
        ("dist.nproc=many", ("dist.nproc",)),
        ("nproc=8", ("expected section.key=value",)),
        # case 16: a missing weights file passed the up-front check and every run was refused in turn
        (f"model.weights={tmp_path / 'missing.pt'}", ("model.weights: file", "does not exist")),
    ):
        assert cli.main(["--config", str(path), "--dry-run", override]) == 2, override
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(f in err for f in fragments), err
