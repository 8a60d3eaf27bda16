"""experiments.bench_integrations at a tiny size, on its real 2 spawned gloo ranks: it runs every
trainer's usual way, ours and the control, and writes its CSV and its table. Nothing is timed: what
must hold exactly is the shape of the files and the bytes each approach all-reduces per step."""

from __future__ import annotations

import csv

import pytest

from experiments import bench_integrations as bi
from tests.optional_packages import requires

pytestmark = requires("transformers", "accelerate", "lightning", "timm")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_integrations")
    argv = ["--tiny", "--rounds", "1", "--steps", "2", "--warmup", "0", "--allow-busy"]
    argv += ["--out-dir", str(tmp / "out"), "--work-dir", str(tmp / "work"), "--deadline-s", "240"]
    assert bi.main(argv) == 0
    with open(tmp / "out" / "bench_integrations.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return rows, (tmp / "out" / "BENCH_INTEGRATIONS.md").read_text(encoding="utf-8")


@pytest.mark.processes
def test_every_trainer_runs_every_approach_for_the_timed_steps(bench):
    rows, _ = bench
    seen = {(r["trainer"], r["approach"]): 0 for r in rows}
    for r in rows:
        seen[(r["trainer"], r["approach"])] += 1
    assert seen == {(t, a): 2 for t in bi.TRAINERS for a in bi.APPROACHES}


@pytest.mark.processes
def test_ours_sends_fewer_bytes_than_the_usual_way_and_the_control_the_same(bench):
    rows, _ = bench
    for t in bi.TRAINERS:
        sent = {a: {int(r["bytes"]) for r in rows if r["trainer"] == t and r["approach"] == a} for a in bi.APPROACHES}
        assert len(sent["usual"]) == 1 and sent["control"] == sent["usual"], (t, sent)
        assert len(sent["ours"]) == 1 and max(sent["ours"]) < min(sent["usual"]), (t, sent)


@pytest.mark.processes
def test_the_table_has_a_row_per_trainer_and_says_it_measured_nothing(bench):
    _, table = bench
    assert "TINY MODELS" in table and "--tiny" in table
    for t in bi.TRAINERS:
        assert sum(line.startswith(f"| {t} | {bi.BOUNDARY[t]} |") for line in table.splitlines()) == 1, t


def test_the_rotation_puts_each_approach_first_in_turn():
    assert [bi.rotation(r)[0] for r in range(3)] == list(bi.APPROACHES)
    assert all(sorted(bi.rotation(r)) == sorted(bi.APPROACHES) for r in range(6))
