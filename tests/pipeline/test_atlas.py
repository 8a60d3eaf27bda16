"""freeze.pipeline.report.atlas on hand-made runs whose answer is known: 170 steps a run, clock arms
that froze after a step each seed states (the first policy evaluation at or after T, every 6 steps),
and a loopback frontier where budget f takes 100 f s and reaches 80 + 20 (f - 0.5) %."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from freeze.pipeline.report import build_tables
from freeze.pipeline.report.atlas import atlas_table, clock_arm, freeze_step
from freeze.pipeline.report.load import ReportInputError, Run, read_metrics
from freeze.pipeline.report.tables import Baseline
from freeze.pipeline.report.writers import to_markdown
from tests.pipeline.handmade_runs import epoch_record, handmade_run

SEEDS = (0, 1, 2)
STEPS = 170
BASE = Baseline("none", "baseline: group 'none'")
FIXTURE_METRICS = Path(__file__).parents[1] / "fixtures" / "runs" / "fixture_study" / "autofreeze-s0" / "metrics.jsonl"


def _run(group, seed, policy, time_s, acc_pct, changes=(), steps=STEPS, fraction=1.0, setting="loopback") -> Run:
    """One single-epoch run of ``steps`` steps whose boundary changed after the given (step, boundary)."""
    return handmade_run(setting, group, seed, policy, time_s, acc_pct, steps, fraction=fraction, changes=tuple(changes))


def _study(with_budgets: bool = False) -> list[Run]:
    runs = []
    for seed in SEEDS:
        wobble = (seed - 1) * 0.3  # seed-to-seed accuracy spread, shared by every arm of the seed
        runs.append(_run("none", seed, "none", 100.0, 90 + wobble))
        # t = 0.5 of 170 steps is 85: the next evaluation (every 6) is after step 90
        runs.append(_run("at-k9-t0.5", seed, "at:k=9,t=0.5", 60.0, 88 + wobble, [(90, 9)]))
        # t = 0.8 is 136 -> 138; and a late arm whose seeds froze at different steps
        runs.append(_run("at-k9-t0.8", seed, "at:k=9,t=0.8", 80.0, 89 + wobble, [(138, 9)]))
        runs.append(_run("at-k8-t0.6", seed, "at:k=8,t=0.6", 75.0, 89.5 + wobble, [(102 + 6 * seed, 8)]))
        runs.append(_run("payoff", seed, "payoff:exchange=3", 70.0, 88 + wobble, [(30, 2), (60, 9)]))
        if with_budgets:
            for f in (0.5, 0.6, 0.8):
                acc = 80 + 20 * (f - 0.5) + wobble
                runs.append(_run(f"budget-{f}", seed, "none", 100 * f, acc, steps=int(STEPS * f), fraction=f))
    return runs


def _rows(table) -> dict[str, dict]:
    return {r["group"]: r for r in table.data.to_dict("records")}


def test_a_clock_arm_is_read_from_its_policy_spec_and_no_other_policy_is():
    assert clock_arm("at:k=9,t=0.6") == (9, 0.6)
    assert clock_arm(" at : k=8 , t=0.45") == (8, 0.45)
    assert clock_arm("at:k=9,t=0.6,anneal=0") == (9, 0.6)  # the canonical spec of the hard clock
    assert clock_arm("at:k=9,t=0.6,anneal=0.15") is None  # annealed: another arm, not the atlas's
    for other in ("none", "static:k=9", "payoff:exchange=3", "at:k=9", "at:k=x,t=0.5", "at:k=9,t=soon"):
        assert clock_arm(other) is None


def test_the_freeze_step_and_run_fraction_are_the_recorded_ones_not_the_nominal_t():
    rows = _rows(atlas_table(_study(), BASE, 0.95, 0.5))
    assert set(rows) == {"at-k9-t0.5", "at-k9-t0.8", "at-k8-t0.6"}  # payoff and the baseline are no clock
    half = rows["at-k9-t0.5"]
    assert (half["k"], half["t"]) == (9, 0.5)
    assert half["freeze_step_mean"] == half["freeze_step_min"] == half["freeze_step_max"] == 90
    assert half["run_fraction_mean"] == pytest.approx(90 / 170)  # 0.529, not 0.5
    spread = rows["at-k8-t0.6"]  # seeds froze after 102, 108, 114
    assert (spread["freeze_step_mean"], spread["freeze_step_min"], spread["freeze_step_max"]) == (108, 102, 114)
    assert spread["run_fraction_min"] == pytest.approx(102 / 170)
    assert spread["run_fraction_max"] == pytest.approx(114 / 170)


def test_the_paired_columns_are_the_paired_tables_numbers():
    rows = _rows(atlas_table(_study(), BASE, 0.95, 0.5))
    half = rows["at-k9-t0.5"]
    assert half["n_pairs"] == 3
    assert half["diff_points"] == pytest.approx(-2.0) and half["diff_low"] == pytest.approx(-2.0)
    assert half["speedup"] == pytest.approx(100 / 60)
    assert half["verdict"] == "inferior"  # -2 points, every seed, against a margin of 0.5
    paired_table = next(t for t in build_tables(_study(), "none") if t.name == "paired")
    paired = {r["group"]: r for r in paired_table.data.to_dict("records")}
    for group, row in rows.items():
        assert row["verdict"] == paired[group]["verdict"]
        for key in ("diff_points", "diff_low", "diff_high", "speedup", "speedup_low", "speedup_high"):
            assert row[key] == pytest.approx(paired[group][key])


def test_rows_are_sorted_by_k_then_t_and_the_display_gives_min_max_only_where_seeds_differ():
    table = atlas_table(_study(), BASE, 0.95, 0.5)
    assert list(table.data["group"]) == ["at-k8-t0.6", "at-k9-t0.5", "at-k9-t0.8"]
    display = table.display.set_index("group")
    assert display.loc["at-k9-t0.5", "froze after step"] == "90"
    assert display.loc["at-k9-t0.5", "run fraction"] == "0.529"
    assert display.loc["at-k8-t0.6", "froze after step"] == "108 (102-114)"
    assert display.loc["at-k8-t0.6", "run fraction"] == "0.635 (0.600-0.671)"
    assert display.loc["at-k9-t0.5", "speedup [95% CI]"] == "1.67x [1.67, 1.67]"
    assert "iso-accuracy speedup [95% CI]" not in display.columns  # no frontier: no column
    assert "boundary_steps" in table.caption and "first evaluation at or after" in table.caption


def test_the_iso_accuracy_speedup_is_read_where_the_frontier_exists():
    tables = {t.name: t for t in build_tables(_study(with_budgets=True), "none")}
    display = tables["atlas"].display.set_index("group")
    # 88 % sits at 90 s on the frontier (80 + 20 (0.9 - 0.5)), the arm took 60 s
    assert display.loc["at-k9-t0.5", "iso-accuracy speedup [95% CI]"] == "1.50x [1.50, 1.50]"
    assert "budget-0.5" not in display.index


def test_a_run_directory_without_boundary_steps_is_read_from_its_epoch_records():
    old = _run("at-k9-t0.5", 0, "at:k=9,t=0.5", 60.0, 88.0)
    epochs = pd.DataFrame([epoch_record(85, 0, 30.0, 80.0, 0.0), epoch_record(170, 9, 60.0, 88.0, 0.5)])
    old = Run(old.run_dir, old.manifest, old.config, epochs, np.zeros((2, 10)))
    assert freeze_step(old, 9) == 170  # the end of the first epoch whose boundary reached 9
    assert np.isnan(freeze_step(old, 10))  # never reached
    assert freeze_step(_run("x", 0, "at:k=9,t=0.5", 1.0, 1.0, [(90, 9)]), 9) == 90


def test_without_clock_arms_the_table_says_so_in_one_line():
    plain = [r for r in _study() if not r.policy.startswith("at:")]
    table = atlas_table(plain, BASE, 0.95, 0.5)
    assert table.data.empty and "no clock arms" in table.caption and "\n" not in table.caption
    assert to_markdown(table).strip() == table.caption
    assert atlas_table(_study(), Baseline(None, "no baseline"), 0.95, 0.5).data.empty
    assert "atlas" in {t.name for t in build_tables(plain, "none")}


def test_the_report_reads_boundary_steps_from_metrics_jsonl_and_refuses_malformed_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    shutil.copy(FIXTURE_METRICS, path)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[0]["boundary_steps"] = [[60, 1]]
    records[1]["boundary_steps"] = [[130, 2], [190, 3]]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    *_, boundary_steps = read_metrics(path, n_blocks=4)
    assert boundary_steps == ((60, 1), (130, 2), (190, 3))
    records[1]["boundary_steps"] = [[130]]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ReportInputError, match=r"metrics.jsonl:2: malformed metrics line \(boundary_steps must be"):
        read_metrics(path, n_blocks=4)
