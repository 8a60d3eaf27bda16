"""experiments.bench_host: a smoke run writes the table and the CSV; the operation counts are
deterministic (the static limit and its control dispatch the same operations); nothing is timed."""

import csv

import pytest

from experiments import bench_host
from experiments import bench_workers as bw
from freeze import split_blocks
from tests.processes import run_python


def test_the_tiny_resnet_is_resnet18s_tree_at_a_few_channels():
    tiny, full = bw.build_model(bw.TINY_RESNET, 8), bw.build_model("resnet18", 32)
    assert [b.name for b in split_blocks(tiny)] == [b.name for b in split_blocks(full)]
    assert [n for n, _ in tiny.named_parameters()] == [n for n, _ in full.named_parameters()]  # 62 tensors
    assert sum(p.numel() for p in tiny.parameters()) < 10_000


@pytest.mark.processes
def test_a_quick_run_counts_operations_and_writes_its_report(tmp_path):
    out = tmp_path / "host"
    proc = run_python(["-m", "experiments.bench_host", "--quick", "--ks", "0,8", "--out-dir", str(out)], timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader((out / "host.csv").open()))
    assert [(r["approach"], r["k"]) for r in rows] == [(a, k) for k in ("0", "8") for a in bench_host.APPROACHES]
    by = {(r["approach"], r["k"]): r for r in rows}
    for k in ("0", "8"):
        assert by[(bw.STATIC, k)]["ops_per_step"] == by[(bw.CONTROL, k)]["ops_per_step"]  # the same step, counted
        assert int(by[(bw.ENGINE, k)]["ops_per_step"]) >= int(by[(bw.STATIC, k)]["ops_per_step"]) > 0
    # a frozen prefix leaves operations out of the step
    assert int(by[(bw.STATIC, "8")]["ops_per_step"]) < int(by[(bw.STATIC, "0")]["ops_per_step"])
    text = (out / "HOST.md").read_text()
    assert "x static [95 % CI]" in text and "control at k=0" in text


@pytest.mark.parametrize(
    "args, message",
    [(["--ks", "0,99"], "--ks: [99] out of range; accepted: 0..9"), (["--rounds", "1"], "--rounds: 1; accepted: 2")],
)
def test_bad_arguments_are_one_line(tmp_path, capsys, args, message):
    assert bench_host.main([*args, "--out-dir", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and not (tmp_path / "h").exists()
