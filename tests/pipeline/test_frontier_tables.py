"""freeze.pipeline.report.frontier_tables on hand-made runs whose answer is known: a loopback
frontier where budget f takes 100 f s and reaches 80 + 10 (f - 0.5) / 0.5 %, a cluster setting with
no budgets of its own, and arms placed beyond, on and inside the frontier."""

from __future__ import annotations

import pytest

from freeze.pipeline.report import build_tables
from freeze.pipeline.report.frontier_tables import frontier_table, iso_speedup_table, iso_speedups, settle
from freeze.pipeline.report.load import Run
from freeze.pipeline.report.tables import Baseline, final_test_acc
from tests.pipeline.handmade_runs import handmade_run

SEEDS = (0, 1, 2, 3, 4)  # 5 paired seeds, as the studies (a verdict needs 3: report.frontier.MIN_VERDICT_SEEDS)
BASE = Baseline("none", "baseline: group 'none'")


def _run(setting, group, seed, policy, time_s, acc_pct, steps, fraction=1.0, hook="allreduce") -> Run:
    frozen = 0.0 if policy == "none" else 0.5
    return handmade_run(
        setting,
        group,
        seed,
        policy,
        time_s,
        acc_pct,
        steps,
        fraction=fraction,
        blocks=2,
        frozen_fraction=frozen,
        comm_hook=hook,
    )


def _study() -> list[Run]:
    runs = []
    for seed in SEEDS:
        wobble = (seed - (len(SEEDS) - 1) / 2) * 0.3  # seed-to-seed spread, mean 0, shared by every arm of the seed
        for f in (0.5, 0.6, 0.8):
            runs.append(
                _run("loopback", f"budget-{f}", seed, "none", 100 * f, 80 + 20 * (f - 0.5) + wobble, 100 * f, f)
            )
        runs.append(_run("loopback", "none", seed, "none", 100.0, 90 + wobble, 100))
        runs.append(_run("loopback", "fast", seed, "at:k=8,t=0.5", 60.0, 88 + wobble, 100))  # T_frontier(88) = 90 s
        runs.append(_run("loopback", "slow", seed, "at:k=8,t=0.8", 80.0, 84 + wobble, 100))  # T_frontier(84) = 70 s
        runs.append(_run("loopback", "poor", seed, "static:k=8", 40.0, 70 + wobble, 100))  # below the shortest budget
        # the cluster: twice as slow per step, no budgets of its own
        runs.append(_run("cluster", "none", seed, "none", 200.0, 90 + wobble, 100))
        runs.append(_run("cluster", "fast", seed, "at:k=8,t=0.5", 150.0, 88 + wobble, 100))  # 180 s / 150 s
    return runs


def _rows(table) -> dict[tuple[str, str], dict]:
    return {(r["setting"], r["group"]): r for r in table.data.to_dict("records")}


def test_the_frontier_table_pairs_each_budget_with_full_fine_tuning_by_seed():
    rows = _rows(frontier_table(_study(), BASE))
    assert set(rows) == {("loopback", g) for g in ("budget-0.5", "budget-0.6", "budget-0.8", "none")}
    half = rows[("loopback", "budget-0.5")]
    assert half["step_fraction"] == pytest.approx(0.5) and half["time_fraction"] == pytest.approx(0.5)
    assert half["test_acc_mean"] == pytest.approx(0.80)
    assert rows[("loopback", "none")]["budget_fraction"] == 1.0


def test_iso_accuracy_speedups_are_the_hand_computed_ones_and_the_cluster_borrows_the_loopback_frontier():
    rows = _rows(iso_speedup_table(iso_speedups(_study(), BASE)))
    fast = rows[("loopback", "fast")]
    assert fast["iso_speedup"] == pytest.approx(1.5) and fast["beyond_frontier"] and fast["bound"] == "exact"
    slow = rows[("loopback", "slow")]
    assert slow["iso_speedup"] == pytest.approx(70 / 80) and not slow["beyond_frontier"]
    poor = rows[("loopback", "poor")]
    assert poor["bound"] == "upper" and not poor["beyond_frontier"]
    assert rows[("loopback", "none")]["iso_speedup"] == pytest.approx(1.0)  # the frontier's own end
    # the cluster: the loopback accuracies at fraction x the cluster baseline's 200 s
    cluster = rows[("cluster", "fast")]
    assert cluster["frontier_setting"] == "loopback" and cluster["iso_speedup"] == pytest.approx(180 / 150)
    display = iso_speedup_table(iso_speedups(_study(), BASE)).display.set_index("group")
    assert display.loc["poor", "beyond the frontier"] == "no (less accurate than the shortest budget)"
    assert display.loc["poor", "iso-accuracy speedup [95% CI]"].startswith("<= ")


def test_without_budget_runs_or_a_baseline_the_tables_say_so_in_one_line():
    plain = [r for r in _study() if not r.group.startswith("budget-")]
    for table in (frontier_table(plain, BASE), iso_speedup_table(iso_speedups(plain, BASE))):
        assert table.data.empty and "no budget runs" in table.caption and "\n" not in table.caption
    assert iso_speedups(_study(), Baseline(None, "none")) == {}


def test_the_main_and_paired_tables_carry_the_iso_accuracy_speedup_beside_the_speedup():
    tables = {t.name: t for t in build_tables(_study(), "none")}
    for name in ("main", "paired"):
        display = tables[name].display.set_index(["setting", "group"])
        columns = list(display.columns)
        assert (
            columns.index("iso-accuracy speedup [95% CI]")
            == columns.index(next(c for c in columns if c.startswith("speedup"))) + 1
        )
        assert display.loc[("loopback", "fast"), "iso-accuracy speedup [95% CI]"] == "1.50x [1.50, 1.50]"
        assert "iso" not in tables[name].data.columns and "iso_speedup" in tables[name].data.columns
    assert (
        tables["main"].display.set_index(["setting", "group"]).loc[("cluster", "none"), "peak memory (MB, rank 0)"]
        == "2000"
    )


def test_the_pareto_figure_draws_the_frontier_as_a_curve_and_a_setting_without_budgets_borrows_it(
    tmp_path, monkeypatch
):
    from freeze.pipeline.report import plots

    drawn = []
    original = plots._draw_frontier

    def record(ax, rows, label):
        drawn.append((ax.get_title().split(":")[0], sorted(rows["group"]), label))
        return original(ax, rows, label)

    monkeypatch.setattr(plots, "_draw_frontier", record)
    paired = next(t for t in build_tables(_study(), "none") if t.name == "paired")
    path = plots.plot_pareto(paired.data, 0.5, tmp_path / "pareto.png")
    assert path.stat().st_size > 0
    budgets = ["budget-0.5", "budget-0.6", "budget-0.8"]
    # panels in setting order (cluster, loopback); the cluster has no budgets and borrows loopback's
    assert [(groups, label) for _, groups, label in drawn] == [
        (budgets, "budget frontier (from loopback)"),
        (budgets, "budget frontier"),
    ]


def test_the_plain_sentences_read_budgets_as_the_frontier_and_say_where_each_arm_lies_against_it(tmp_path):
    from freeze.pipeline.report.verdict import verdict_lines

    for table in build_tables(_study(), "none"):
        if table.name in ("paired", "main"):
            table.data.to_csv(tmp_path / f"{table.name}.csv", index=False)
    lines = {line.split(":")[0]: line for line in verdict_lines(tmp_path, 0.5)}
    assert "full fine-tuning on 0.5 of the steps (a point of the budget frontier" in lines["loopback/budget-0.5"]
    assert "no finding" not in lines["loopback/budget-0.5"]  # it froze nothing by design
    assert (
        "Its iso-accuracy speedup is 1.50x (95% CI [1.50, 1.50]): beyond the budget frontier" in lines["loopback/fast"]
    )
    assert "not beyond the budget frontier: training fewer steps does as well or better" in lines["loopback/slow"]


def test_a_borrowed_frontier_is_read_by_step_and_by_time_fraction_and_decides_only_where_both_agree():
    """The cluster's frontier times are its baseline's x a fraction carried over from loopback: the
    step fraction, and the measured time fraction. Here budget 0.8 takes 90 s for 0.8 of the steps,
    so an arm at 88 % reads T_frontier = 0.9 x 200 s by steps and 0.95 x 200 s by time."""
    runs = []
    for r in _study():
        if r.group == "budget-0.8":
            r = _run(r.setting, r.group, r.seed, r.policy, 90.0, 100 * final_test_acc(r), 80, 0.8)
        runs.append(r)
    for seed in SEEDS:
        wobble = (seed - (len(SEEDS) - 1) / 2) * 0.3
        runs.append(_run("cluster", "between", seed, "at:k=8,t=0.6", 175.0, 88 + wobble, 100))
    frontier = _rows(frontier_table(runs, BASE))
    assert frontier[("loopback", "budget-0.8")]["time_per_step_ratio"] == pytest.approx(90 / 80)
    readings = iso_speedups(runs, BASE)
    fast = readings[("cluster", "fast", 2)]
    assert fast.iso.speedup == pytest.approx(180 / 150) and fast.by_time.speedup == pytest.approx(190 / 150)
    assert fast.verdict() == "yes"  # beyond by both readings
    between = readings[("cluster", "between", 2)]
    assert between.iso.speedup == pytest.approx(180 / 175) and between.by_time.speedup == pytest.approx(190 / 175)
    # 1.03x by steps is not beyond by the 1.05x margin; 1.09x by time is
    assert (between.iso.verdict(), between.by_time.verdict(), between.verdict()) == (
        "no (not by 1.05x)",
        "yes",
        "undecided",
    )
    assert readings[("loopback", "fast", 2)].by_time is None  # its own frontier: one reading
    display = iso_speedup_table(readings).display.set_index(["setting", "group"])
    assert display.loc[("cluster", "between"), "beyond the frontier"] == "undecided"
    # the paired and main tables (and the sentences read from them) say what this table says
    for table in build_tables(runs, "none"):
        if table.name in ("paired", "main"):
            assert _rows(table)[("cluster", "between")]["iso_verdict"] == "undecided", table.name


def test_an_arm_that_compresses_is_read_against_training_less_with_the_same_compression():
    """payoff + bf16 on the cluster is compared with full fine-tuning on fewer steps WITH the bf16 hook
    (the cluster's policy-none bf16 group anchors the frontier's times), so the hook's own saving is
    not credited to freezing; without such a group the arm has no frontier."""
    runs = _study()
    for seed in SEEDS:
        wobble = (seed - (len(SEEDS) - 1) / 2) * 0.3
        runs.append(_run("cluster", "bf16", seed, "none", 120.0, 90 + wobble, 100, hook="bf16"))
        runs.append(_run("cluster", "fast-bf16", seed, "at:k=8,t=0.5", 100.0, 88 + wobble, 100, hook="bf16"))
        runs.append(_run("cluster", "fast-psgd", seed, "at:k=8,t=0.5", 100.0, 88 + wobble, 100, hook="powersgd4"))
    readings = iso_speedups(runs, BASE)
    stacked = readings[("cluster", "fast-bf16", 2)]
    assert stacked.iso.speedup == pytest.approx(0.9 * 120 / 100)  # not 0.9 x 200 s / 100 s
    assert stacked.source == "loopback, times of bf16"
    assert ("cluster", "fast-psgd", 2) not in readings  # no policy-none powersgd4 run to anchor on
    # compression alone is what a user could do instead: read against the plain frontier (200 s / 120 s)
    assert readings[("cluster", "bf16", 2)].iso.speedup == pytest.approx(200 / 120)
    assert readings[("cluster", "bf16", 2)].source == "loopback"


def test_a_control_that_reads_beyond_the_frontier_fails_every_table_loudly(tmp_path):
    """Issue 46: the horizon study's 4x control, which computes what the baseline computes, read
    "beyond the frontier: yes". A control is the statistic's calibration: if it reads beyond, no verdict
    of the report stands, and every table says so (the iso table, and the iso-accuracy verdict the main,
    paired, atlas and summary tables and the printed sentences carry); one that does not is named as
    the check passed; one that reads below gets a warning, not a voided table: the running maximum
    only lifts the frontier, so below can be that bias rather than drift."""

    def study(control_time_s: float) -> list[Run]:
        runs = _study()
        for seed in SEEDS:
            wobble = (seed - (len(SEEDS) - 1) / 2) * 0.3
            runs.append(_run("loopback", "control", seed, "none", control_time_s, 90 + wobble, 100))
        return runs

    sound = iso_speedup_table(iso_speedups(study(100.0), BASE))
    rows = _rows(sound)
    assert rows[("loopback", "fast")]["verdict"] == "yes" and rows[("loopback", "control")]["verdict"].startswith("no")
    assert any("control loopback/control" in n and "as a calibrated statistic must" in n for n in sound.notes)
    # the same control timed 20 % fast (a machine that drifted): it reads beyond, and every verdict goes
    invalid = "invalid: the control loopback/control reads beyond"
    tables = {t.name: t for t in build_tables(study(80.0), "none")}
    assert any("CALIBRATION FAILED: it reads beyond the frontier" in n for n in tables["iso_speedup"].notes)
    assert {r["verdict"] for r in _rows(tables["iso_speedup"]).values()} == {invalid}
    assert not any(r["beyond_frontier"] for r in _rows(tables["iso_speedup"]).values())
    for name in ("main", "paired"):
        assert {r["iso_verdict"] for r in _rows(tables[name]).values() if r["iso_verdict"]} == {invalid}, name
    summary = tables["summary"].display
    assert set(summary.loc[summary["iso-accuracy speedup [95% CI]"] != "", "beyond frontier"]) == {invalid}
    from freeze.pipeline.report.verdict import verdict_lines

    for name in ("main", "paired"):
        tables[name].data.to_csv(tmp_path / f"{name}.csv", index=False)
    lines = {line.split(":")[0]: line for line in verdict_lines(tmp_path, 0.5)}
    assert (
        "no verdict against the budget frontier stands (the control loopback/control reads beyond"
        in lines["loopback/fast"]
    )
    control = next(line for line in lines.values() if line.startswith("The control loopback/control"))
    assert "No verdict against the budget frontier in this report stands" in control
    # timed 20 % slow, it reads below the frontier it lies on: named with a warning, the verdicts stand
    slow = {t.name: t for t in build_tables(study(120.0), "none")}
    assert any("WARNING: it reads below the frontier" in n for n in slow["iso_speedup"].notes)
    assert _rows(slow["iso_speedup"])[("loopback", "fast")]["verdict"] == "yes"
    assert _rows(slow["paired"])[("loopback", "control")]["iso_verdict"] == "no (below the frontier)"


def test_settling_the_verdicts_twice_changes_nothing_and_keeps_the_readings_raw():
    readings = iso_speedups(_study(), BASE)
    once = settle(readings)
    assert settle(once) == once
    fast = once[("cluster", "fast", 2)]
    assert fast.iso.settled == fast.verdict() == readings[("cluster", "fast", 2)].verdict()
    assert fast.iso.interval_verdict() == readings[("cluster", "fast", 2)].iso.interval_verdict()
