"""The planted-task score (freeze/pipeline/substrate/score.py): the score file, the boundary
trajectory read back from metrics records, each metric, the choice on validation, and the tables."""

import json
import math
from pathlib import Path

import pytest

from freeze.pipeline.substrate.gates import GateError
from freeze.pipeline.substrate.score import (
    BASELINE_ARM,
    ORACLE,
    RunNumbers,
    boundary_per_step,
    captured,
    choose,
    complete_runs,
    overshoot,
    read_score,
    same_policy,
    score_task,
    scores_markdown,
    search_arm,
    seed_major,
    task_study,
    time_to_boundary,
    tracking_slope,
)

SCORE = """
[score]
name = "s"
finetune = "experiments/configs/fdsl32_finetune.toml"
weights = "experiments/weights/fdsl32_resnet18.pt"
tasks = [3, 5]
seeds = [0, 1]
setting = ["dist.nproc=2"]
overrides = ["data.augment=none"]
[policies]
autofreeze = "autofreeze"
geometric = "geometric"
"""


def _write(tmp_path, text):
    path = tmp_path / "score.toml"
    path.write_text(text)
    return path


def test_a_score_file_is_read_and_every_task_becomes_an_interleaved_study(tmp_path):
    score = read_score(_write(tmp_path, SCORE))
    assert score.tasks == (3, 5) and score.seeds == (0, 1) and list(score.policies) == ["autofreeze", "geometric"]
    study = task_study(score, 5, "s-d5", score.seeds, score.policies)
    assert list(study.arms) == [BASELINE_ARM, ORACLE, "autofreeze", "geometric"]
    assert study.arms[ORACLE].overrides == ("freeze.policy=static:k=5", "freeze.cache=memory")
    assert "data.dataset=planted-d5" in study.overrides
    assert ORACLE not in task_study(score, 5, "x", (100,), {}, oracle=False).arms
    specs = seed_major([task_study(score, d, f"s-d{d}", score.seeds, score.policies) for d in score.tasks], "runs", ())
    # seeds first, then tasks: one block of every arm per (seed, task)
    keys = [(s.config.run.seed, s.config.run.study) for s in specs]
    assert keys == sorted(keys, key=lambda k: (k[0], k[1])) and len(specs) == 2 * 2 * 4


@pytest.mark.parametrize(
    "edit, message",
    [
        (("tasks = [3, 5]", "tasks = [3, 4]"), "no such planted task"),
        (('geometric = "geometric"', 'oracle = "static:k=3"'), "a name other than"),
        (("[policies]", "[polices]"), "unknown table(s) polices"),
        (("seeds = [0, 1]", "seeds = [0, 1]\nmargin = 1"), "unknown key(s) margin"),
        (("seeds = [0, 1]", "seeds = []"), "seeds must be a non-empty list"),
    ],
)
def test_a_bad_score_file_is_one_line_naming_the_key(tmp_path, edit, message):
    with pytest.raises(GateError, match="score file .*" + message.replace("(", r"\(").replace(")", r"\)")):
        read_score(_write(tmp_path, SCORE.replace(*edit)))


def test_search_seeds_may_not_be_scored_seeds(tmp_path):
    text = SCORE + '[search]\nseeds = [1]\n[search.candidates]\nautofreeze = ["autofreeze:percentile=20"]\n'
    with pytest.raises(GateError, match=r"search.seeds \[1\] are also scored seeds"):
        read_score(_write(tmp_path, text))
    with pytest.raises(GateError, match="no policy 'cs744'"):
        read_score(_write(tmp_path, text.replace("seeds = [1]", "seeds = [9]").replace("autofreeze = [", "cs744 = [")))


def _record(epoch, step, start, changes):
    return {"epoch": epoch, "step": step, "boundary_at_epoch_start": start, "boundary_steps": changes}


def test_the_boundary_of_every_step_is_read_back_from_the_epoch_records():
    # two epochs of 4 steps; an evaluation after step 2 freezes 3 blocks, after step 6 two more
    records = [_record(0, 4, 0, [[2, 3], [4, 3]]), _record(1, 8, 3, [[6, 5], [8, 5]])]
    assert boundary_per_step(records) == (0, 0, 3, 3, 3, 3, 5, 5)
    # a change lost to a resume is corrected at the next epoch's start
    assert boundary_per_step([_record(0, 4, 0, []), _record(1, 8, 3, [])]) == (0, 0, 0, 0, 3, 3, 3, 3)
    with pytest.raises(GateError, match="lacks boundary_steps"):
        boundary_per_step([{"epoch": 0, "step": 4, "boundary_at_epoch_start": 0}])


def test_each_metric_on_a_known_trajectory():
    steps = (0, 0, 3, 5, 7, 7, 7, 7, 7, 7)
    assert time_to_boundary(steps, 5) == 0.3 and time_to_boundary(steps, 8) is None
    assert overshoot(steps, 5) == pytest.approx((2 * 6) / 10)
    assert captured(100.0, 80.0, 60.0) == 0.5 and math.isnan(captured(1.0, 1.0, 1.0))
    assert tracking_slope([(3, 3), (5, 5), (7, 7)]) == pytest.approx(1.0)
    assert tracking_slope([(3, 6), (5, 6), (7, 6)]) == pytest.approx(0.0)
    assert math.isnan(tracking_slope([(3, 6), (3, 7)]))


def _numbers(acc, seconds, traffic, boundaries, val=None):
    return RunNumbers(acc, acc if val is None else val, seconds, traffic, tuple(boundaries))


def test_a_policy_is_scored_against_full_fine_tuning_and_the_oracle_of_its_seed():
    by_arm = {
        BASELINE_ARM: {0: _numbers(90.0, 100.0, 1000.0, [0] * 4), 1: _numbers(91.0, 110.0, 1000.0, [0] * 4)},
        ORACLE: {0: _numbers(92.0, 60.0, 400.0, [5] * 4), 1: _numbers(93.0, 70.0, 400.0, [5] * 4)},
        "late": {0: _numbers(91.0, 80.0, 700.0, [0, 0, 5, 5]), 1: _numbers(92.0, 90.0, 700.0, [0, 0, 5, 7])},
        "missing": {0: _numbers(90.0, 50.0, 100.0, [9] * 4)},
    }
    (late, missing) = score_task(5, by_arm, {"late": "x", "missing": "y"}, margin=0.5)
    assert late.regret.mean == pytest.approx(1.0) and late.regret.n == 2 and late.verdict == "non-inferior"
    assert late.final_boundaries == (5, 7)
    assert late.time_captured.mean == pytest.approx(0.5)  # (100-80)/(100-60) and (110-90)/(110-70)
    assert late.bytes_captured.mean == pytest.approx(0.5)
    assert late.time_to_d == (0.5, 0.5) and late.overshoot == pytest.approx((0 + 2 / 4) / 2)
    assert missing.seeds == (0,) and missing.regret.n == 1 and missing.verdict == "undecided"
    text = scores_markdown([late, missing], {"late": 1.0, "missing": 0.0}, "caption")
    assert text.startswith("caption\n\n| policy |") and "+0 +2" in text and "never" not in text


def test_the_choice_on_validation_is_one_spec_per_policy_for_every_task(tmp_path):
    text = SCORE + (
        "[search]\nseeds = [100]\n[search.candidates]\n"
        'autofreeze = ["autofreeze:percentile=50", "autofreeze:percentile=20", "autofreeze:percentile=90"]\n'
    )
    score = read_score(_write(tmp_path, text))
    base = _numbers(90.0, 100.0, 1.0, [0], val=90.0)

    def arm(val, seconds):
        return {100: _numbers(0.0, seconds, 1.0, [0], val=val)}

    numbers = {
        # percentile 90 is fastest but loses 2 points on d=5: not qualified; 20 beats 50 on speed
        3: {
            BASELINE_ARM: {100: base},
            search_arm("autofreeze", "autofreeze:percentile=50"): arm(90.0, 90.0),
            search_arm("autofreeze", "autofreeze:percentile=20"): arm(89.8, 80.0),
            search_arm("autofreeze", "autofreeze:percentile=90"): arm(90.0, 50.0),
        },
        5: {
            BASELINE_ARM: {100: base},
            search_arm("autofreeze", "autofreeze:percentile=50"): arm(90.0, 90.0),
            search_arm("autofreeze", "autofreeze:percentile=20"): arm(89.6, 85.0),
            search_arm("autofreeze", "autofreeze:percentile=90"): arm(88.0, 50.0),
        },
    }
    chosen, rows = choose(score, numbers)
    assert chosen == {"autofreeze": "autofreeze:percentile=20"}
    assert [r.chosen for r in rows] == [False, True, False] and [r.qualifies for r in rows] == [True, True, False]
    # none qualifies: the one whose worst task loses least
    for d in (3, 5):
        numbers[d][search_arm("autofreeze", "autofreeze:percentile=50")] = arm(85.0, 90.0)
        numbers[d][search_arm("autofreeze", "autofreeze:percentile=20")] = arm(88.5, 90.0)
    assert choose(score, numbers)[0] == {"autofreeze": "autofreeze:percentile=20"}
    del numbers[5][search_arm("autofreeze", "autofreeze:percentile=90")]
    with pytest.raises(GateError, match="not complete"):
        choose(score, numbers)
    assert same_policy("autofreeze", "autofreeze:percentile=50") and not same_policy("autofreeze", "cs744")


def test_complete_runs_reads_only_complete_run_directories(tmp_path):
    for name, status in (("a", "complete"), ("b", "running")):
        run = tmp_path / name
        run.mkdir()
        (run / "manifest.json").write_text(json.dumps({"status": status, "group": name, "seed": 0}))
        record = {
            "epoch": 0,
            "step": 2,
            "boundary_at_epoch_start": 0,
            "boundary_steps": [[2, 1]],
            "test_acc": 0.5,
            "val_acc": 0.4,
            "cumulative_wall_s": 3.0,
            "allreduce_bytes": 10,
        }
        (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    found = complete_runs(tmp_path)
    assert list(found) == ["a"] and found["a"][0] == RunNumbers(50.0, 40.0, 3.0, 10.0, (0, 0))


def test_the_report_carries_each_table_file_and_is_left_alone_when_one_is_missing(tmp_path):
    from freeze.pipeline.substrate.report import SPANS, splice_file, splice_tables

    tables = tmp_path / "report" / "substrate"
    tables.mkdir(parents=True)
    report = tmp_path / "report" / "REPORT.md"
    report.write_text("# R\n" + "".join(f"<!-- {n}:start -->\nold\n<!-- {n}:end -->\n" for n in SPANS))
    for name, (table, _) in list(SPANS.items())[:-1]:
        (tables / table).write_text(f"table {name}\n")
    before = report.read_text()
    with pytest.raises(FileNotFoundError, match="planted-score.md"):
        splice_tables(report, tables)
    assert report.read_text() == before  # nothing spliced when one file is missing
    (tables / "planted-score.md").write_text("scores\n")
    (tables / "planted-score-tracking.png").write_bytes(b"png")
    assert splice_tables(report, tables) == list(SPANS)
    text = report.read_text()
    assert "old" not in text and "table substrate-gates" in text
    assert "scores\n\n![planted-score-tracking.png](substrate/planted-score-tracking.png)" in text
    from freeze.pipeline.markdown import MarkerError

    with pytest.raises(MarkerError, match="no-such-span"):
        splice_file(report, "no-such-span", tables / "planted-score.md")


def _write_run(folder, arm, seed, policy, start, test_acc, val_acc, seconds, changes=(), steps=4, traffic=100.0):
    run = folder / f"loopback_{arm}_seed={seed}"
    run.mkdir(parents=True)
    manifest = {"status": "complete", "group": arm, "seed": seed, "policy": policy, "start_time": start}
    (run / "manifest.json").write_text(json.dumps(manifest))
    record = {
        "epoch": 0,
        "step": steps,
        "boundary_at_epoch_start": 0,
        "boundary_steps": [list(c) for c in changes],
        "test_acc": test_acc,
        "val_acc": val_acc,
        "cumulative_wall_s": seconds,
        "allreduce_bytes": traffic,
    }
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")


def test_the_score_command_tabulates_chooses_and_splices_from_run_directories(tmp_path):
    from freeze.pipeline.substrate.score import run_score

    repo = Path(__file__).resolve().parents[2]
    report = tmp_path / "REPORT.md"
    report.write_text("# R\n<!-- t:start -->\nold\n<!-- t:end -->\n")
    path = _write(
        tmp_path,
        f"""
[score]
name = "t"
finetune = "{repo / "experiments/configs/fdsl32_finetune.toml"}"
weights = "{repo / "experiments/weights/fdsl32_resnet18.pt"}"
tasks = [3]
seeds = [0, 1]
setting = ["dist.nproc=2"]
overrides = ["data.augment=none"]
report_md = "{report}"
[policies]
autofreeze = "autofreeze"
[search]
seeds = [100]
[search.candidates]
autofreeze = ["autofreeze:percentile=50", "autofreeze:percentile=20"]
""",
    )
    runs = tmp_path / "runs"
    search = runs / "t-search-d3"
    _write_run(search, "none", 100, "none", "2026-01-01T00:00", 0.9, 0.90, 100.0)
    _write_run(search, "autofreeze@autofreeze:percentile=50", 100, "autofreeze", "2026-01-01T00:01", 0.9, 0.88, 50.0)
    _write_run(
        search,
        "autofreeze@autofreeze:percentile=20",
        100,
        "autofreeze:percentile=20",
        "2026-01-01T00:02",
        0.9,
        0.90,
        80.0,
    )
    grid = runs / "t-d3"
    for seed in (0, 1):
        t = f"2026-01-01T0{seed + 1}"
        _write_run(grid, "none", seed, "none", t + ":00", 0.90, 0.9, 100.0, traffic=100.0)
        _write_run(grid, "oracle", seed, "static:k=3", t + ":01", 0.92, 0.9, 60.0, [(0, 3)], traffic=40.0)
        _write_run(grid, "autofreeze", seed, "autofreeze", t + ":02", 0.91, 0.9, 80.0, [(2, 3)], traffic=70.0)
    # autofreeze-val (percentile 20, chosen on validation) ran after both blocks: timed apart
    for seed in (0, 1):
        _write_run(
            grid,
            "autofreeze-val",
            seed,
            "autofreeze:percentile=20",
            f"2026-01-01T09:0{seed}",
            0.91,
            0.9,
            70.0,
            [(1, 4)],
        )
    text = run_score(path, tmp_path / "out", str(runs), "cmd", run=False)
    assert "| autofreeze | `autofreeze` | 3 | 2 | +1.00" in text and "(not interleaved)" in text
    rows = {r["policy"]: r for r in json.loads((tmp_path / "out" / "t.json").read_text())["scores"]}
    assert rows["autofreeze"]["time_captured"][0] == pytest.approx(0.5)  # (100-80)/(100-60)
    assert rows["autofreeze"]["bytes_captured"][0] == pytest.approx(0.5)  # (100-70)/(100-40)
    assert rows["autofreeze-val"]["final_boundaries"] == [4, 4] and rows["autofreeze-val"]["time_to_d"] == [0.25, 0.25]
    assert "**chosen**" in text and (tmp_path / "out" / "t-tracking.png").stat().st_size > 0
    assert "old" not in report.read_text() and "![t-tracking.png](out/t-tracking.png)" in report.read_text()
    # a run left by another spec under the same arm name is refused, not scored under the new label
    path.write_text(path.read_text().replace('autofreeze = "autofreeze"', 'autofreeze = "cs744"'))
    with pytest.raises(GateError, match="ran policy 'autofreeze', but the score file now gives autofreeze = 'cs744'"):
        run_score(path, tmp_path / "out", str(runs), "cmd", run=False)


@pytest.mark.parametrize(
    "edit, message",
    [
        (('name = "s"', 'name = "planted"'), "taken by the planted checks"),
        (("seeds = [0, 1]", "seeds = [0, 1]\nreport_md = 3"), "report_md must be a path"),
    ],
)
def test_names_that_collide_and_bad_report_paths_are_refused(tmp_path, edit, message):
    with pytest.raises(GateError, match=message):
        read_score(_write(tmp_path, SCORE.replace(*edit)))
    text = SCORE + "[search]\nseeds = [9]\n[search.candidates]\nautofreeze = []\n"
    with pytest.raises(GateError, match="search.candidates.autofreeze is empty"):
        read_score(_write(tmp_path, text))


def test_a_saving_the_oracle_did_not_make_is_not_divided_by():
    assert math.isnan(captured(100.0, 99.0, 99.0)) and math.isnan(captured(100.0, 90.0, 101.0))
    assert captured(100.0, 95.0, 90.0) == 0.5
