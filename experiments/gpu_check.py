"""The prepared GPU check: everything this project claims of its CUDA path, measured in one command.

    make gpu-check                                   # writes report/gpu/
    PYTHONPATH=. python3 -m experiments.gpu_check --out DIR   # the same with any python that has torch

Parts, run one after another, each in its own process with its own time limit (a hang costs that part,
not the machine's window; the whole check stays within --budget-s, 345 s by default):

- ``tests``: ``pytest -m cuda tests/gpu`` (the CUDA variants of the GPU claims) -> tests.csv
- ``sync``: the host-sync audit of steady-state training steps (experiments/sync_audit.py) -> sync_audit.csv
- ``bench``: the engine bench on CUDA (experiments.bench's workers, one NCCL rank): freeze engine,
  static limit, find-unused and engine + cache at several boundaries, CUDA events, peak memory -> bench.csv
- ``finetune-fp32``, ``finetune-fp16``: the quick study's recipe (experiments/configs/study_offline.toml)
  from the committed weights on one GPU -> finetune.csv, with the CPU reference beside it
- ``workload-resnet50``, ``workload-vit_b_16``, ``workload-bert-base``: what freezing can buy where users
  fine-tune (ResNet-50 and ViT-B/16 at 224 px, batch 64; BERT-base at 128 tokens, batch 32; random
  weights from their configs): the engine, the static limit and the engine with the cache at five
  boundaries, step time and peak memory, and the speedup bound 1 + backward/forward at k = 0 beside
  the measured one -> workloads.csv. Each fits its own limit; they run only when named (``--parts``,
  ``make gpu-workloads``), in a device window of their own
- ``anneal-contrast`` (issue 46): the annealing study's contrast at 10x its steps on one GPU
  (experiments/configs/study_anneal_gpu.toml: none, budget-0.5, hard and annealed freezes at t = 0.5),
  seed block after seed block, the per-seed rows copied out after each, beside the rows earlier
  windows committed in report/gpu/anneal_gpu.csv -> anneal_gpu.csv. Only when
  named (``make gpu-anneal``), in a window of its own; ``--anneal-seeds`` picks the blocks

Then ``summary.md`` (device, versions, every number) and ``log.txt`` (each part's output): at most 8
files, flat, within the device tool's limits. Nothing is installed; it runs with the python it is started with
(the GPU machine's python3: torch 2.11), the package from the checkout (PYTHONPATH=.).

Without a CUDA device it says so in one line, runs the CPU variants of the claims (unless
--no-cpu-claims), writes nothing, and exits with their outcome (0 when they pass).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUDY_CONFIG = ROOT / "experiments/configs/study_offline.toml"
BENCH_KS = (0, 3, 5, 7, 8)
# The quick study's recipe on one process: train.batch_size 128 keeps its global batch (2 workers x 64).
FINETUNE_OVERRIDES = ("dist.nproc=1", "train.batch_size=128", "run.seed=0")
# The same run on the CPU (fp32, seed 0, dist.nproc=1, train.batch_size=128; torch 2.14.1, 2-core Xeon,
# commit e6d7ba3, 6 min 33 s): the number the GPU runs' accuracy is compared with.
CPU_REFERENCE = {"test_acc": 0.814, "train_loss": 0.3455, "test_size": 1000, "where": "CPU, torch 2.14.1 (e6d7ba3)"}


@dataclass(frozen=True)
class Part:
    name: str
    limit_s: float
    command: list[str]
    default: bool = True  # run without --parts (the workloads need a device window of their own)


@dataclass
class Outcome:
    name: str
    status: str  # ok | failed (exit code) | timeout | skipped
    seconds: float
    limit_s: float
    returncode: int | None = None


# Realistic workloads (issue 49): the model, input and per-GPU batch users fine-tune with; weights are
# random (built from their configs: nothing to download, and the step costs the same).
WORKLOADS = {
    "resnet50": {"model": "resnet50", "image_size": 224, "batch_size": 64},
    "vit_b_16": {"model": "vit_b_16", "image_size": 224, "batch_size": 64},
    "bert-base": {"model": "bert-base", "seq_len": 128, "batch_size": 32},
}
WORKLOAD_LIMIT_S = 90
ANNEAL_CONFIG = ROOT / "experiments/configs/study_anneal_gpu.toml"
ANNEAL_LIMIT_S = 540  # within one device call of 10 minutes: one seed block took 350 s on an H200, its runs in turn
# A block's 4 runs side by side on the one GPU, each on its own 4 of the 16 cores: its steps are bound by
# the host's kernel launches (8-15 ms a step, the GPU mostly idle), and the contrast is read for accuracy
ANNEAL_SIDE_BY_SIDE = 4
ANNEAL_CONTRASTS = (("anneal-k9-t0.5", "at-k9-t0.5"), ("anneal-k9-t0.5", "budget-0.5"), ("at-k9-t0.5", "budget-0.5"),
                    ("none", "budget-0.5"))  # fmt: skip
WORKLOAD_APPROACHES = ("freeze_engine", "static_limit", "freeze_engine_cache")  # + prefix_forward at k >= 1


def workload_ks(num_blocks: int) -> tuple[int, ...]:
    """Five boundaries from none frozen to all but the head's input: 0, a quarter, half, three
    quarters of the way, and L-2."""
    last = num_blocks - 2
    return tuple(sorted({0, round(last / 4), round(last / 2), round(3 * last / 4), last}))


def parts(out: Path, work: Path, python: str, anneal_seeds: tuple[int, ...] = (0, 1)) -> list[Part]:
    me = [python, "-m", "experiments.gpu_check"]
    finetune = [python, "-m", "experiments.run", "--config", str(_study()["finetune"]), *_recipe_overrides()]
    return [
        Part(
            "tests",
            100,
            [
                python,
                "-m",
                "pytest",
                "-q",
                "-m",
                "cuda",
                "-p",
                "no:cacheprovider",
                "tests/gpu",
                f"--junitxml={work / 'junit.xml'}",
            ],
        ),  # fmt: skip
        Part("sync", 45, [*me, "--child", "sync", "--out", str(out)]),
        Part("bench", 90, [*me, "--child", "bench", "--out", str(out)]),
        *(
            Part(
                f"finetune-{p}",
                60,
                [
                    *finetune,
                    "dist.device=cuda",
                    f"train.precision={p}",
                    f"run.out_dir={work / 'runs'}",
                    f"run.name=gpu-{p}",
                    f"data.root={work / 'data'}",
                ],
            )  # fmt: skip
            for p in ("fp32", "fp16")
        ),
        *(
            Part(
                f"workload-{name}",
                WORKLOAD_LIMIT_S,
                [*me, "--child", "workload", "--workload", name, "--out", str(out)],
                default=False,
            )
            for name in WORKLOADS
        ),
        Part(
            "anneal-contrast",
            ANNEAL_LIMIT_S,
            [
                *me,
                "--child",
                "anneal",
                "--out",
                str(out),
                "--work",
                str(work),
                "--anneal-seeds",
                ",".join(map(str, anneal_seeds)),
            ],
            default=False,
        ),  # fmt: skip
    ]


def _study() -> dict:
    with open(STUDY_CONFIG, "rb") as f:
        return tomllib.load(f)["study"]


def _recipe_overrides() -> list[str]:
    study = _study()
    return [*study["overrides"], f"model.weights={study['weights']}", *FINETUNE_OVERRIDES]


def run_part(part: Part, limit_s: float, log) -> Outcome:
    """Run ``part`` in its own session; past ``limit_s`` its whole process group is killed."""
    log.write(f"\n===== {part.name} (limit {limit_s:.0f} s): {shlex.join(part.command)}\n")
    log.flush()
    if limit_s < min(5.0, part.limit_s):  # too little of the check's budget left to start it
        log.write("skipped: the check's budget is spent\n")
        return Outcome(part.name, "skipped", 0.0, limit_s)
    env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(
        part.command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        code = proc.wait(timeout=limit_s)
        status = "ok" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # spawned ranks, torchrun workers: the whole group
        code = proc.wait()
        status = "timeout"
    seconds = time.monotonic() - start
    log.write(f"===== {part.name}: {status} after {seconds:.1f} s\n")
    log.flush()
    return Outcome(part.name, status, seconds, limit_s, code)


# ---------------------------------------------------------------------------------------- children
def child_sync(out: Path) -> int:
    """The audit of every config alone, then of two under DDP (one NCCL rank): DDP's own syncs are
    torch's, named in the table with the line of ours that reached them."""
    from experiments.sync_audit import CONFIGS

    steps, rows = 4, []
    for config in CONFIGS:
        rows += _audit_rows(config, config, steps)
    with tempfile.TemporaryDirectory(prefix="gpu-check-nccl-") as tmp:
        import torch.distributed as dist

        from freeze.comm import end_process_group

        try:
            dist.init_process_group("nccl", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
            for config in DDP_SYNC_CONFIGS:
                rows += _audit_rows(f"ddp-nccl-{config}", config, steps)
        except Exception as e:  # the configs alone are already measured: keep them, name the failure
            rows.append(_error_row("ddp-nccl", e))
        finally:
            end_process_group()
    _write_csv(out / "sync_audit.csv", ("config", "owner", "where", "syncs_per_step", "stack"), rows)
    return 1 if any(row[1] == "error" for row in rows) else 0


DDP_SYNC_CONFIGS = ("fp32", "fp32-cache-device")


def _audit_rows(label: str, config: str, steps: int) -> list[tuple]:
    from experiments.sync_audit import audit, summarize

    try:
        found = summarize(audit(config, steps=steps), steps)
    except Exception as e:  # one config's failure must not lose the others' rows
        return [_error_row(label, e)]
    print(f"sync audit {label}: {len(found)} place(s)", flush=True)
    return [(label, *r) for r in found] or [(label, "-", "none", 0.0, "")]


def _error_row(label: str, error: Exception) -> tuple:
    print(f"sync audit {label} failed: {error!r}", flush=True)
    return (label, "error", f"{type(error).__name__}: {error}"[:300], "", "")


def child_bench(out: Path) -> int:
    from experiments.bench.config import BenchConfig
    from experiments.bench.rows import CSV_COLUMNS, write_csv

    cfg = BenchConfig(workers=1, device="cuda", steps=20, rounds=2, warmup=3, ks=BENCH_KS, phase_ks=())
    write_csv(bench_rows(cfg), out / "bench.csv", (*CSV_COLUMNS, "peak_mb"))
    return 0


def child_anneal(
    out: Path,
    work: Path,
    seeds: tuple[int, ...],
    config: Path = ANNEAL_CONFIG,
    overrides: tuple[str, ...] = (),
    earlier: Path = ROOT / "report" / "gpu" / "anneal_gpu.csv",
    side_by_side: int = ANNEAL_SIDE_BY_SIDE,
) -> int:
    """The annealing contrast's seed blocks one after another, each a study call of its own whose
    report covers every complete run so far: its per-seed rows go to ``out/anneal_gpu.csv`` after
    each block, so a window that ends mid-way keeps the blocks it finished.

    Args:
        out: the check's results folder.
        work: where the runs go (the check's scratch folder).
        seeds: the seed blocks to run, in order.
        config: the study file (a test's tiny CPU variant).
        overrides: applied to every run after the study file's (a test's).
        earlier: the rows of earlier device windows (the committed file), kept beside this window's.
        side_by_side: a block's runs at once, sharing the GPU (1: one after another, as a CPU test runs).
    """
    missing = [name for name in ("pandas", "scipy", "matplotlib") if importlib.util.find_spec(name) is None]
    if missing:  # the study's report needs them; the device's python had them when last listed
        print(f"anneal contrast: {sys.executable} lacks {', '.join(missing)}; carry them as wheels", flush=True)
        return 2
    runs = work / "anneal-runs"
    study = [sys.executable, "-m", "experiments.study", "--config", str(config), "--out-dir", str(runs)]
    if side_by_side > 1:
        study += ["--executor", "local", "--parallel", str(side_by_side), "--share-gpus"]
    name = tomllib.loads(config.read_text(encoding="utf-8"))["study"]["name"]
    failed = 0
    for seed in seeds:
        print(f"anneal contrast: seed block {seed}", flush=True)
        code = subprocess.run([*study, "--seeds", str(seed), *overrides], cwd=ROOT).returncode
        failed += code != 0
        per_seed = runs / f"{name}-report" / "per_seed.csv"
        if per_seed.is_file():  # the report of every complete run so far, also after a failed run
            _write_anneal_rows(out / "anneal_gpu.csv", _read_csv(per_seed), _read_csv(earlier))
    return 1 if failed else 0


def _write_anneal_rows(path: Path, rows: list[dict], earlier: list[dict]) -> None:
    """This window's rows after the earlier windows' (each window is a fresh machine: the committed
    file holds what the earlier ones measured); a run measured again keeps its new row."""
    if not rows and not earlier:
        return
    runs = {row["run"] for row in rows}
    kept = [row for row in earlier if row["run"] not in runs]
    columns = list(rows[0]) if rows else list(earlier[0])
    _write_csv(path, columns, [tuple(row.get(c, "") for c in columns) for row in (*kept, *rows)])


def anneal_lines(rows_csv: Path) -> list[str]:
    """The contrast's paired differences from the per-seed rows (experiments.per_seed_contrast's
    arithmetic), or why there are none."""
    if not rows_csv.is_file():
        return ["No annealing contrast in this check (its part runs only when named: make gpu-anneal)."]
    import pandas as pd

    from experiments.per_seed_contrast import contrast_row

    frame = pd.read_csv(rows_csv, keep_default_na=False, na_values=[""])
    groups = set(frame["group"])
    rows = [contrast_row(frame, a, b) for a, b in ANNEAL_CONTRASTS if a in groups and b in groups]
    table = [
        (r["contrast"], r["seeds"], f"{r['diff_points']:+.2f} [{r['low']:+.2f}, {r['high']:+.2f}]", r["per_seed"])
        for r in rows
    ]
    steps = frame.groupby("group")["steps"].mean()
    return [
        *_table(("contrast", "seeds", "test accuracy, points [95 % t]", "per seed"), table),
        "",
        "Steps per run: " + ", ".join(f"{g} {steps[g]:.0f}" for g in sorted(steps.index)) + ".",
    ]


def workload_config(name: str, device: str = "cuda", **overrides):
    """The bench config of workload ``name``: one rank on ``device``, its boundaries, a cache of 512
    inputs (the cache's rows are the prefix's output: a few GB at 224 px); ``overrides`` shrink it
    for a dry run on the CPU."""
    from experiments import bench_workers as bw
    from experiments.bench.config import BenchConfig

    spec = dict(WORKLOADS[name]) | {"workers": 1, "device": device, "steps": 8, "rounds": 1, "warmup": 3}
    spec |= {"phase_ks": (), "cache_keys": 512, "cache_chunk": 64, "momentum": 0.9} | overrides
    num_blocks = len(bw.split_blocks(bw.build_model(spec["model"], spec.get("image_size", 32))))
    return BenchConfig.for_model(spec.pop("model"), ks=workload_ks(num_blocks), **spec)


def workload_rows(name: str, cfg) -> list[dict]:
    """The bench's rows of the workload's approaches, each with its workload and peak memory."""
    rows = bench_rows(cfg, WORKLOAD_APPROACHES)
    return [{"workload": name, **row} for row in rows]


WORKLOAD_COLUMNS = ("workload", "approach", "k", "frozen_param_fraction", "median_ms", "iqr_ms", "forward_ms",
                    "backward_ms", "optimizer_ms", "ratio_to_static", "bytes_match_trainable", "peak_mb")  # fmt: skip


def child_workload(out: Path, name: str) -> int:
    from experiments.bench.rows import write_csv

    rows = workload_rows(name, workload_config(name))
    path = out / "workloads.csv"
    earlier = [r for r in _read_csv(path) if r["workload"] != name]  # each part adds its own rows
    write_csv(earlier + rows, path, WORKLOAD_COLUMNS)
    return 0


def bench_rows(cfg, approaches: tuple[str, ...] = ()) -> list[dict]:
    """The bench's CSV rows of the engine, the static limit, find-unused and engine + cache (with the
    prefix forward) under ``cfg``, each with its median peak memory above the step's start (MB)."""
    import numpy as np

    from experiments import bench_workers as bw
    from experiments.bench.rows import measure_rows

    cfg.validate()
    cfg = cfg.resolved(len(bw.split_blocks(bw.build_model(cfg.model, cfg.image_size))))
    approaches = approaches or (bw.ENGINE, bw.STATIC, bw.FIND_UNUSED, bw.ENGINE_CACHE)
    extra = {"approaches": approaches, "monitor_cell": False}
    rows, cells, _ = measure_rows(cfg, extra, None, deadline_s=600)
    for row in rows:
        row["peak_mb"] = float(np.median(cells[(row["approach"], row["k"])]["peak_mb"]))
    return rows


# ---------------------------------------------------------------------------------------- reading back
def _write_csv(path: Path, header: tuple[str, ...], rows: list) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def _read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def junit_rows(path: Path) -> list[tuple[str, str, float, str]]:
    """(test id, outcome, seconds, first line of the message) per test case of a junit file."""
    if not path.exists():
        return []
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or "").splitlines()[0][:200] if node.get("message") else ""
        rows.append((f"{case.get('classname')}::{case.get('name')}", outcome, float(case.get("time", 0)), message))
    return rows


def finetune_row(work: Path, precision: str) -> tuple | None:
    """(precision, epochs, steps, steps/s over all epochs, steps/s after the first, final train loss,
    loss finite, test accuracy, vs the CPU reference, within noise) from the run's metrics.jsonl."""
    path = work / "runs" / _study()["name"] / f"gpu-{precision}" / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        return None
    last = records[-1]
    steps_per_epoch = last["step"] / len(records)
    walls = [r["epoch_wall_s"] for r in records]
    later = steps_per_epoch * (len(walls) - 1) / sum(walls[1:]) if len(walls) > 1 else None
    acc, ref = last["test_acc"], CPU_REFERENCE["test_acc"]
    # Noise: 3 standard errors of the difference of two accuracies on the same test set (binomial).
    tolerance = 3 * math.sqrt(2 * ref * (1 - ref) / CPU_REFERENCE["test_size"])
    diff = None if acc is None else acc - ref
    finite = math.isfinite(last["train_loss"])
    within = None if diff is None else abs(diff) <= tolerance
    return (precision, len(records), last["step"], last["step"] / sum(walls), later, last["train_loss"], finite, acc,
            diff, within, tolerance)  # fmt: skip


FINETUNE_HEADER = ("precision", "epochs", "steps", "steps_per_s", "steps_per_s_after_epoch_1", "final_train_loss",
                   "loss_finite", "test_acc", "test_acc_minus_cpu", "within_noise", "noise_tolerance")  # fmt: skip


# ---------------------------------------------------------------------------------------- the summary
def device_lines() -> list[str]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return [
        f"- Device: {torch.cuda.get_device_name(0)}, {props.total_memory / 2**30:.1f} GiB, "
        f"{props.multi_processor_count} multiprocessors, compute capability {props.major}.{props.minor}",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPU cores",
        f"- Tree: {_commit()}",
    ]


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "not a git checkout (commit unknown)"
    if out.returncode != 0:
        return "not a git checkout (commit unknown)"
    return out.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def _table(header, rows) -> list[str]:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(cell(v) for v in row) + " |" for row in rows
    ]


def bench_lines(rows: list[dict]) -> list[str]:
    """Per k: the engine against the static limit and find-unused, the cache's share of the prefix
    forward recovered, bytes, peak memory; all from bench.csv (median step, CUDA events)."""
    if not rows:
        return ["No bench results (see the parts table and log.txt)."]
    by = {(r["approach"], int(r["k"])): r for r in rows}
    table = []
    for k in sorted({int(r["k"]) for r in rows}):
        eng, static, fu = by.get(("freeze_engine", k)), by.get(("static_limit", k)), by.get(("find_unused", k))
        cache, prefix = by.get(("freeze_engine_cache", k)), by.get(("prefix_forward", k))
        ms = lambda r: float(r["median_ms"]) if r else None  # noqa: E731
        recovered = (ms(eng) - ms(cache)) / ms(prefix) if eng and cache and prefix else None
        table.append([k, ms(eng), ms(static), ms(eng) / ms(static) if eng and static else None, ms(fu),
                      ms(cache), ms(prefix), recovered, eng and eng["bytes_match_trainable"],
                      *(r and r["peak_mb"] for r in (eng, static, fu, cache))])  # fmt: skip
    header = ("k", "engine ms", "static ms", "engine/static", "find-unused ms", "engine+cache ms", "prefix ms",
              "cache recovered", "bytes = trainable", "peak MB engine", "static", "find-unused", "engine+cache")  # fmt: skip
    return [
        *_table(header, table),
        "",
        "ms: the median step (2 rounds x 20 steps, CUDA events); engine/static: the engine over the static limit "
        "(DDP built once over the frozen model); cache recovered = (engine - engine+cache) / prefix, the share of "
        "the frozen prefix's forward the cache removes; peak MB: the step's peak allocated memory above its start.",
    ]


def _cell(by: dict, approach: str, k: int, column: str = "median_ms") -> float | None:
    row = by.get((approach, k))
    return float(row[column]) if row is not None and row[column] not in ("", None) else None


def workload_lines(rows: list[dict]) -> list[str]:
    """Per workload and k: the engine against the static limit, the cache, peak memory; then what
    freezing can buy there: the bound 1 + backward/forward (at k = 0, every backward skipped and
    the forward kept) beside the measured k = 0 step over the deepest boundary's, with and without
    the cache (the cache also skips the frozen forward)."""
    if not rows:
        return ["No workload results (see the parts table and log.txt)."]
    table, bounds = [], []
    for name in dict.fromkeys(r["workload"] for r in rows):
        by = {(r["approach"], int(r["k"])): r for r in rows if r["workload"] == name}
        ks = sorted({k for _, k in by})
        for k in ks:
            eng, static, cache, prefix = (_cell(by, a, k) for a in (*WORKLOAD_APPROACHES, "prefix_forward"))
            recovered = (eng - cache) / prefix if eng and cache and prefix else None
            peaks = [_cell(by, a, k, "peak_mb") for a in WORKLOAD_APPROACHES]
            table.append([name, k, eng, static, eng / static if eng and static else None, cache, prefix, recovered,
                          *peaks])  # fmt: skip
        forward, backward = (
            _cell(by, "freeze_engine", ks[0], "forward_ms"),
            _cell(by, "freeze_engine", ks[0], "backward_ms"),
        )
        step0, deepest = _cell(by, "freeze_engine", ks[0]), _cell(by, "freeze_engine", ks[-1])
        cached = _cell(by, "freeze_engine_cache", ks[-1])
        bounds.append([
            name,
            1 + backward / forward if forward and backward is not None else None,
            ks[-1],
            step0 / deepest if step0 and deepest else None,
            step0 / cached if step0 and cached else None,
        ])  # fmt: skip
    return [
        *_table(
            (
                "workload",
                "k",
                "engine ms",
                "static ms",
                "engine/static",
                "engine+cache ms",
                "prefix ms",
                "cache recovered",
                "peak MB engine",
                "static",
                "engine+cache",
            ),
            table,
        ),  # fmt: skip
        "",
        *_table(
            ("workload", "bound 1 + bwd/fwd at k=0", "deepest k", "measured k=0 / deepest", "with the cache"), bounds
        ),  # fmt: skip
        "",
        "ms: the median step (1 round x 8 steps after 3 warm-up, CUDA events, one NCCL rank); the bound is what "
        "skipping every backward would give with the forward kept; the cache also skips the frozen forward.",
    ]


def write_summary(out: Path, outcomes: list[Outcome], work: Path, command: str) -> None:
    tests = _read_csv(out / "tests.csv")
    counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
    lines = ["# GPU check", "", f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
             "Every number below was measured by that run; nothing is typed by hand.", "", *device_lines(), "",
             "## Parts", "", *_table(("part", "status", "seconds", "limit s"),
                                     [(o.name, o.status, o.seconds, o.limit_s) for o in outcomes]), "",
             "## GPU claims (pytest -m cuda tests/gpu; tests.csv)", "",
             ", ".join(f"{n} {o}" for o, n in counts.items()) or "no test results"]  # fmt: skip
    lines += [
        f"- {t['outcome'].upper()}: `{t['test']}`: {t['message']}" for t in tests if t["outcome"] in ("failed", "error")
    ]
    audit = _read_csv(out / "sync_audit.csv")
    lines += ["", "## Host syncs in steady-state steps (sync_audit.csv)", "",
              *(_table(("config", "owner", "where", "syncs per step"), [(a["config"], a["owner"], a["where"],
                                                                         a["syncs_per_step"]) for a in audit])
                if audit else ["No audit results."]), "",
              "owner: freeze = a line of this project synchronised; torch = torch's own code did (reached from the "
              "line in 'where'); caller = the training loop itself; none = no sync at all.",
              "", "## Engine bench on CUDA (bench.csv; ResNet-18 32x32, batch 64, one NCCL rank)", "",
              *bench_lines(_read_csv(out / "bench.csv")), "",
              "## Realistic workloads (workloads.csv; ResNet-50 and ViT-B/16 at 224 px, batch 64; BERT-base, 128 "
              "tokens, batch 32)", "", *workload_lines(_read_csv(out / "workloads.csv")), "",
              f"## Fine-tune, the quick study's recipe on one GPU (finetune.csv; CPU reference: test accuracy "
              f"{CPU_REFERENCE['test_acc']}, final train loss {CPU_REFERENCE['train_loss']}, {CPU_REFERENCE['where']})",
              ""]  # fmt: skip
    finetune = _read_csv(out / "finetune.csv")
    lines += _table(FINETUNE_HEADER, [tuple(r.values()) for r in finetune]) if finetune else ["No fine-tune results."]
    lines += ["", "## Annealed against hard freezing at 10x the annealing study's steps (anneal_gpu.csv; "
              "experiments/configs/study_anneal_gpu.toml)", "", *anneal_lines(out / "anneal_gpu.csv")]  # fmt: skip
    (out / "summary.md").write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------- main
def gpu_check(
    out: Path, budget_s: float, only: set[str] | None, command: str, anneal_seeds: tuple[int, ...] = (0, 1)
) -> int:
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, open(out / "log.txt", "w") as log:
        work = Path(tmp)
        for part in parts(out, work, sys.executable, anneal_seeds):
            if (part.name not in only) if only is not None else not part.default:
                continue
            outcomes.append(run_part(part, min(part.limit_s, deadline - time.monotonic()), log))
            print(f"gpu-check: {part.name}: {outcomes[-1].status} ({outcomes[-1].seconds:.0f} s)", flush=True)
        _write_csv(out / "tests.csv", ("test", "outcome", "seconds", "message"), junit_rows(work / "junit.xml"))
        finetune = [r for p in ("fp32", "fp16") if (r := finetune_row(work, p)) is not None]
        _write_csv(out / "finetune.csv", FINETUNE_HEADER, finetune)
        write_summary(out, outcomes, work, command)
    print(f"gpu-check: wrote {out}/summary.md", flush=True)
    tests = _read_csv(out / "tests.csv")
    return (
        0
        if all(o.status == "ok" for o in outcomes) and not any(t["outcome"] in ("failed", "error") for t in tests)
        else 1
    )


def dry_run(torch_version: str, cpu_claims: bool) -> int:
    print(
        f"gpu-check: no CUDA device visible (torch {torch_version}): nothing measured, nothing written; "
        + ("running the CPU variants of the GPU claims (pytest -m 'not cuda' tests/gpu)" if cpu_claims else "done"),
        flush=True,
    )
    if not cpu_claims:
        return 0
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not cuda", "-p", "no:cacheprovider", "tests/gpu"]
    return subprocess.run(cmd, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)}, timeout=600).returncode


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "report" / "gpu", help="where the 6 result files go")
    p.add_argument("--budget-s", type=float, default=345.0, help="the whole check's time limit")
    p.add_argument(
        "--parts",
        default=None,
        help="comma-separated parts (default: tests,sync,bench,finetune-fp32,finetune-fp16; the workloads: "
        "workload-resnet50,workload-vit_b_16,workload-bert-base, make gpu-workloads; anneal-contrast, make gpu-anneal)",
    )
    p.add_argument("--no-cpu-claims", action="store_true", help="without CUDA: only say so (the suite's dry run)")
    p.add_argument(
        "--anneal-seeds",
        default="0,1",
        help="the annealing contrast's seed blocks, in order (default 0,1; seed 0 ran on 2026-11-29: make "
        "gpu-anneal names the next)",
    )
    p.add_argument("--child", choices=("sync", "bench", "workload", "anneal"), help=argparse.SUPPRESS)
    p.add_argument("--workload", choices=tuple(WORKLOADS), help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    if not (math.isfinite(args.budget_s) and args.budget_s > 0):  # -5 skipped every part; nan disabled the limit
        print(f"error: --budget-s {args.budget_s:g}; accepted: seconds > 0", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError as e:
        print(
            f"error: {sys.executable} cannot import torch ({e}); run with one that can: make gpu-check GPU_PYTHON=...",
            file=sys.stderr,
        )
        return 2

    try:
        anneal_seeds = tuple(int(part) for part in args.anneal_seeds.split(","))
    except ValueError:
        anneal_seeds = ()
    if not anneal_seeds or any(seed < 0 for seed in anneal_seeds):
        print(f"error: --anneal-seeds {args.anneal_seeds!r}; accepted: seeds >= 0 separated by commas", file=sys.stderr)
        return 2
    if args.child:
        if args.child == "workload":
            return child_workload(args.out, args.workload)
        if args.child == "anneal":
            return child_anneal(args.out, args.work, anneal_seeds)
        return {"sync": child_sync, "bench": child_bench}[args.child](args.out)
    names = [p.name for p in parts(args.out, Path("."), sys.executable)]
    only = None if args.parts is None else {n.strip() for n in args.parts.split(",") if n.strip()}
    if only is not None and (only - set(names) or not only):
        print(
            f"error: --parts: {sorted(only - set(names))} not accepted; accepted: {', '.join(names)}", file=sys.stderr
        )
        return 2
    if not torch.cuda.is_available():
        return dry_run(torch.__version__, not args.no_cpu_claims)
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, "-m", "experiments.gpu_check"]))
    return gpu_check(args.out, args.budget_s, only, command, anneal_seeds)


if __name__ == "__main__":
    raise SystemExit(main())
