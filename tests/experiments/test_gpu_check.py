"""The prepared GPU check (experiments/gpu_check.py) where no GPU is: its dry run, its per-part time
limits, its readers and the bench rows it measures (on the CPU here, the same code path as on CUDA)."""

import csv
import json
import os
import sys
import time

import pytest
import torch

from experiments import gpu_check as gc
from experiments.bench.config import BenchConfig
from experiments.bench.rows import CSV_COLUMNS, write_csv


def test_without_cuda_it_says_so_in_one_line_writes_nothing_and_exits_0(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu"
    assert gc.main(["--out", str(out), "--no-cpu-claims"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device visible" in lines[0] and "nothing written" in lines[0]
    assert not out.exists()


def test_an_unknown_part_is_refused_in_one_line(tmp_path, capsys):
    assert gc.main(["--out", str(tmp_path / "gpu"), "--parts", "tests,benchh"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "benchh" in err[0] and "accepted: tests, sync, bench" in err[0]
    assert not (tmp_path / "gpu").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.processes
def test_a_hanging_part_costs_its_own_limit_and_its_children_die(tmp_path, monkeypatch):
    pid_file = tmp_path / "grandchild.pid"
    hang = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    fake = [gc.Part("tests", 3, [sys.executable, "-c", hang]), gc.Part("sync", 30, [sys.executable, "-c", "print(1)"])]
    monkeypatch.setattr(gc, "parts", lambda out, work, python, anneal_seeds=(): fake)
    monkeypatch.setattr(gc, "device_lines", lambda: ["- Device: none (test)"])
    start = time.monotonic()
    assert gc.gpu_check(tmp_path / "out", budget_s=60, only=None, command="test") == 1
    assert time.monotonic() - start < 30
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| tests | timeout |" in summary and "| sync | ok |" in summary
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "finetune.csv",
        "log.txt",
        "summary.md",
        "tests.csv",
    ]
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the hung part's child outlived its time limit"


def test_junit_and_metrics_are_read_back(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.t" name="a[cuda]" time="1.5"/>'
        '<testcase classname="tests.gpu.t" name="b[cuda]" time="0.2"><failure message="AssertionError: x&#10;more"/>'
        "</testcase></testsuite></testsuites>"
    )
    assert gc.junit_rows(junit) == [
        ("tests.gpu.t::a[cuda]", "passed", 1.5, ""),
        ("tests.gpu.t::b[cuda]", "failed", 0.2, "AssertionError: x"),
    ]
    run = tmp_path / "runs" / "offline" / "gpu-fp16"
    run.mkdir(parents=True)
    records = [
        {"step": 12 * (e + 1), "epoch_wall_s": w, "train_loss": 0.3, "test_acc": None} for e, w in enumerate([4, 1, 1])
    ]
    records[-1]["test_acc"] = 0.8
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    row = dict(zip(gc.FINETUNE_HEADER, gc.finetune_row(tmp_path, "fp16")))
    assert row["steps"] == 36 and row["steps_per_s"] == 6.0 and row["steps_per_s_after_epoch_1"] == 12.0
    assert row["loss_finite"] and row["test_acc_minus_cpu"] == pytest.approx(0.8 - gc.CPU_REFERENCE["test_acc"])
    assert row["within_noise"] is True
    assert gc.finetune_row(tmp_path, "fp32") is None


@pytest.mark.processes
def test_bench_rows_measure_the_four_approaches_on_one_rank_and_the_summary_reads_them(tmp_path, monkeypatch):
    cfg = BenchConfig(
        workers=1, model="mlp", batch_size=8, steps=2, rounds=1, warmup=1, ks=(0, 2), phase_ks=(), cache_keys=32
    )
    rows = gc.bench_rows(cfg)
    assert {(r["approach"], r["k"]) for r in rows} == {
        *((a, k) for a in ("freeze_engine", "static_limit", "find_unused", "freeze_engine_cache") for k in (0, 2)),
        ("prefix_forward", 2),
    }
    engine = [r for r in rows if r["approach"] == "freeze_engine"]
    assert all(r["bytes_match_trainable"] for r in engine)
    assert all(r["peak_mb"] == 0.0 for r in rows)  # no CUDA allocator on the CPU
    write_csv(rows, tmp_path / "bench.csv", (*CSV_COLUMNS, "peak_mb"))
    gc._write_csv(
        tmp_path / "tests.csv", ("test", "outcome", "seconds", "message"), [("t::a[cuda]", "failed", 1.0, "boom")]
    )
    gc._write_csv(tmp_path / "sync_audit.csv", ("config", "owner", "where", "syncs_per_step", "stack"), [])
    monkeypatch.setattr(gc, "device_lines", lambda: ["- Device: none (test)"])
    gc.write_summary(tmp_path, [gc.Outcome("bench", "ok", 1.0, 90)], tmp_path, "test")
    summary = (tmp_path / "summary.md").read_text()
    # the engine's median at k=2 as bench.csv stored it (the summary reads the file, whose rounding
    # can differ from the in-memory value's in the last digit: 2.11349 is written 2.1135)
    with (tmp_path / "bench.csv").open() as f:
        stored = next(r for r in csv.DictReader(f) if r["approach"] == "freeze_engine" and r["k"] == "2")
    line = next(line for line in summary.splitlines() if line.startswith("| 2 |"))
    assert f"| {float(stored['median_ms']):.4g} |" in line
    assert "- FAILED: `t::a[cuda]`: boom" in summary and "No fine-tune results." in summary


@pytest.mark.parametrize("budget", ["-5", "0", "nan", "inf"])
def test_a_budget_that_is_no_time_limit_is_refused_in_one_line(tmp_path, capsys, budget):
    """Reliability.md case 28: -5 skipped every part on a GPU and nan disabled the limit."""
    assert gc.main(["--out", str(tmp_path / "gpu"), "--budget-s", budget]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --budget-s") and "accepted: seconds > 0" in err[0]


def test_workload_boundaries_run_from_none_frozen_to_all_but_the_heads_input():
    assert gc.workload_ks(18) == (0, 4, 8, 12, 16)  # ResNet-50: stem, 16 bottlenecks, head
    assert gc.workload_ks(4) == (0, 1, 2)


@pytest.mark.processes
@pytest.mark.parametrize(
    "name, overrides",
    [
        ("resnet50", {"image_size": 32}),
        ("bert-base", {"model": "bert-tiny", "seq_len": 16}),  # the same code path in seconds
        ("vit_b_16", {"model": "vit-tiny", "image_size": 32}),  # torchvision's ViT class at 2 layers
    ],
)
def test_each_workload_dry_runs_on_the_cpu_and_the_summary_reads_it(tmp_path, monkeypatch, name, overrides):
    small = {"batch_size": 2, "steps": 1, "warmup": 1, "cache_keys": 8, "cache_chunk": 4} | overrides
    cfg = gc.workload_config(name, device="cpu", **small)
    rows = gc.workload_rows(name, cfg)
    ks = cfg.ks
    assert len(ks) >= 3 and ks[0] == 0
    assert {(r["approach"], r["k"]) for r in rows} == {
        *((a, k) for a in gc.WORKLOAD_APPROACHES for k in ks),
        *(("prefix_forward", k) for k in ks if k > 0),
    }
    assert all(r["bytes_match_trainable"] for r in rows if r["approach"] == "freeze_engine")
    write_csv(rows, tmp_path / "workloads.csv", gc.WORKLOAD_COLUMNS)
    lines = gc.workload_lines(gc._read_csv(tmp_path / "workloads.csv"))
    bound = next(line for line in lines if line.startswith(f"| {name} | ") and line.count("|") == 6)
    assert float(bound.split("|")[2]) > 1  # 1 + backward / forward


def test_the_annealing_contrasts_study_file_plans_its_four_arms_on_every_seed():
    from freeze.pipeline.study.plan import main_specs, read_study

    study = read_study(gc.ANNEAL_CONFIG)
    specs = main_specs(study, {}, None)
    assert sorted({s.group for s in specs}) == ["anneal-k9-t0.5", "at-k9-t0.5", "budget-0.5", "none"]
    assert len(specs) == 4 * len(study.seeds)
    config = specs[0].config
    assert (config.train.epochs, config.train.batch_size, config.dist.device) == (50, 128, "cuda")
    for a, b in gc.ANNEAL_CONTRASTS:
        assert {a, b} <= {s.group for s in specs}


@pytest.mark.processes
def test_the_annealing_contrast_copies_its_rows_out_after_each_seed_block(tmp_path):
    """The part's child on the CPU with a tiny variant of the study: after each block the per-seed rows
    of every complete run so far are in out/anneal_gpu.csv, and the summary's section reads them."""
    smoke = gc.ROOT / "experiments" / "configs" / "smoke.toml"
    tiny = tmp_path / "study_anneal_tiny.toml"
    tiny.write_text(
        f'[study]\nname = "anneal-tiny"\nfinetune = "{smoke}"\nseeds = [0, 1]\n'
        'overrides = ["train.epochs=2", "data.train_size=128", "data.test_size=64", "train.batch_size=32", '
        f'"dist.nproc=1", "freeze.interval_steps=1", "data.root={tmp_path / "data"}"]\n'
        "[frontier]\nfractions = [0.5]\n"
        '[arms]\nnone = []\n"at-k9-t0.5" = ["freeze.policy=at:k=9,t=0.5"]\n'
        '"anneal-k9-t0.5" = ["freeze.policy=at:k=9,t=0.5,anneal=0.15"]\n'
    )
    first, second = tmp_path / "window1", tmp_path / "window2"  # each device window: a fresh machine
    first.mkdir()
    second.mkdir()
    # the first window's block side by side (as on the GPU, here on the 2 cores), the second's in turn
    work = tmp_path / "work1"
    two = min(2, len(os.sched_getaffinity(0)))
    assert gc.child_anneal(first, work, (0,), config=tiny, earlier=tmp_path / "none.csv", side_by_side=two) == 0
    assert (
        two == 1 or "2 runs side by side" in (work / "anneal-runs" / "anneal-tiny-report" / "per_seed.csv").read_text()
    )
    assert {r["seed"] for r in gc._read_csv(first / "anneal_gpu.csv")} == {"0"}
    committed = tmp_path / "committed.csv"  # what the first window's rows became in the repository
    committed.write_bytes((first / "anneal_gpu.csv").read_bytes())
    assert gc.child_anneal(second, tmp_path / "work2", (1,), config=tiny, earlier=committed, side_by_side=1) == 0
    out = second
    rows = gc._read_csv(out / "anneal_gpu.csv")
    assert sorted((r["group"], r["seed"]) for r in rows) == sorted(
        (g, s) for g in ("anneal-k9-t0.5", "at-k9-t0.5", "budget-0.5", "none") for s in ("0", "1")
    )
    lines = "\n".join(gc.anneal_lines(out / "anneal_gpu.csv"))
    assert "| anneal-k9-t0.5 - at-k9-t0.5 | 2 |" in lines and "budget-0.5 4" in lines and "none 8" in lines
    assert "No annealing contrast" in gc.anneal_lines(tmp_path / "missing.csv")[0]
