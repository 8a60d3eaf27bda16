"""Where a freezing step's time goes: the freeze engine against the other ways to freeze under DDP.

    .venv/bin/python -m experiments.bench            # default: ResNet-18, 2 gloo workers, k = 0..9
    .venv/bin/python -m experiments.bench --quick    # ~1-2 min smoke run
    .venv/bin/python -m experiments.bench --steps 40 --rounds 5
    .venv/bin/python -m experiments.bench --model bert-base   # BERT rows: k = 0,4,8,12, with and without the cache

For every boundary k and approach (freeze engine, static limit, find-unused, per-parameter) it
measures the median step time, the bytes all-reduced per step and the phase split, plus the
monitor's overhead, the re-wrap cost and a communication estimate against a no-communication run.
Writes ``<out-dir>/bench.csv`` and ``<out-dir>/BENCH.md``; no number in BENCH.md is typed by hand.

A text model (``--model bert-base``: a Hugging Face BertForSequenceClassification with random
weights from ``BertConfig()``) measures the engine with and without the activation cache, the
static limit and a control (a second static limit: true ratio 1.00) in the same rotation, and
writes ``<out-dir>/bench_<model>.csv`` and its own section of BENCH.md (between the bert-bench
markers; the rest of the file stays). The worker processes live in :mod:`experiments.bench_workers`.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torchvision

from experiments import bench_workers as bw
from freeze._atomic import atomic_write_text
from freeze.pipeline import markdown
from freeze.pipeline.runs import cpu_name

CSV_COLUMNS = (
    "approach",
    "k",
    "frozen_param_fraction",
    "median_ms",
    "iqr_ms",
    "p10_ms",
    "steps",
    "allreduce_bytes_per_step",
    "trainable_grad_bytes",
    "ratio_to_static",
    "forward_ms",
    "backward_ms",
    "monitor_ms",
    "optimizer_ms",
    "comm_est_ms",
    "bytes_match_trainable",
    "rounds",
    "cache_build_s",
    "cache_advance_s",
    "cache_bytes",
    "cache_hit_keys",
    "cache_miss_keys",
    "cache_cut",
)
QUICK_STEPS, QUICK_ROUNDS = 4, 1
BENCH_MODELS = bw.MODELS + bw.TEXT_MODELS
# The text models' defaults (a BERT-base step on one core takes seconds, a ResNet-18 one 1/4 s):
# 128 tokens (the usual GLUE fine-tuning length) x 2 sequences per worker keep a k=0 step at a few
# seconds, so one round over k = 0,4,8,12 with 4 approaches + the prefix takes a few minutes. No
# momentum: 4 BERT-base replicas per rank (engine, engine + cache, static, control) each hold the
# model, DDP's buckets and, with momentum, one more copy: ~1.75 GB per rank less without it.
TEXT_DEFAULTS = {
    "batch_size": 2,
    "steps": 4,
    "rounds": 2,
    "warmup": 1,
    "cache_keys": 64,
    "cache_chunk": 8,
    "momentum": 0.0,
}
TEXT_DEFAULT_KS = {"bert-base": (0, 4, 8, 12)}  # embeddings + 3, 7, 11 encoder layers frozen
TEXT_QUICK_STEPS, TEXT_QUICK_ROUNDS = 2, 1


@dataclass(frozen=True)
class BenchConfig:
    workers: int = 2
    model: str = "resnet18"
    batch_size: int = 64  # per worker
    image_size: int = 32
    steps: int = 7  # timed steps per approach per (round, k)
    rounds: int = 2  # passes over every k (up, then down); medians pool all rounds
    warmup: int = 2  # untimed steps per approach per (round, k): DDP rebuilds its buckets after the first iteration
    ks: tuple[int, ...] | None = None  # None: every boundary 0 .. blocks-1
    phase_ks: tuple[int, ...] | None = None  # no-comm runs here; None: 0, middle, the last two
    lr: float = 0.01
    momentum: float = 0.9  # SGD's
    seed: int = 0
    collective_timeout_s: float = 300.0
    cache_keys: int = 2048  # inputs the cache runner keys into: "one epoch" for the build target
    cache_chunk: int = 256  # rows per cache build chunk
    seq_len: int = 128  # text models: tokens per sequence (image models: unused)
    device: str = "cpu"  # "cuda": one NCCL rank per GPU, CUDA events for timing (experiments/gpu_check.py)

    @classmethod
    def for_model(cls, model: str, **overrides) -> BenchConfig:
        """The defaults of ``model`` (a text model's are smaller: see TEXT_DEFAULTS), then ``overrides``."""
        base = dict(TEXT_DEFAULTS, ks=TEXT_DEFAULT_KS.get(model)) if model in bw.TEXT_MODELS else {}
        return cls(model=model, **(base | overrides))

    @property
    def text(self) -> bool:
        return self.model in bw.TEXT_MODELS

    def validate(self) -> None:
        for name in ("workers", "batch_size", "image_size", "steps", "rounds", "warmup", "cache_keys", "cache_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench: {name} must be >= 1, got {getattr(self, name)}")
        if self.model not in BENCH_MODELS:
            raise ValueError(f"bench: model '{self.model}' is not accepted; accepted: {', '.join(BENCH_MODELS)}")
        if not self.lr > 0:
            raise ValueError(f"bench: lr must be > 0, got {self.lr}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"bench: device '{self.device}' is not accepted; accepted: cpu, cuda")
        if self.device == "cuda" and not torch.cuda.device_count() >= self.workers:
            raise ValueError(
                f"bench: device cuda needs one GPU per worker ({self.workers} workers, {torch.cuda.device_count()} "
                "GPUs visible; NCCL runs one rank per GPU)"
            )
        if not 0 <= self.momentum < 1:
            raise ValueError(f"bench: momentum must be in [0, 1), got {self.momentum}")
        if self.text:
            max_len = bw.bert_config(self.model).max_position_embeddings
            if not 2 <= self.seq_len <= max_len:
                raise ValueError(f"bench: seq_len must be 2..{max_len} for {self.model}, got {self.seq_len}")
            if self.phase_ks:
                raise ValueError(f"bench: phase_ks is for the image models; {self.model} has no no-comm run")

    def resolved(self, num_blocks: int) -> BenchConfig:
        """ks / phase_ks filled in and checked against the model's blocks."""
        ks = tuple(range(num_blocks)) if self.ks is None else tuple(sorted(set(self.ks)))
        for k in ks:
            if not 0 <= k <= num_blocks - 1:
                raise ValueError(f"bench: ks contains {k}; accepted: 0..{num_blocks - 1} for {self.model}")
        if self.text:
            return replace(self, ks=ks, phase_ks=())
        default_phase = {0, num_blocks // 2, num_blocks - 2, num_blocks - 1}
        phase = default_phase if self.phase_ks is None else set(self.phase_ks)
        stray = sorted(phase - set(ks)) if self.phase_ks is not None else []
        if stray:
            raise ValueError(f"bench: phase_ks {stray} are not among the measured ks {list(ks)}")
        return replace(self, ks=ks, phase_ks=tuple(sorted(phase & set(ks))))


# ---------------------------------------------------------------------------------------- analysis
def bootstrap_ci(stat, *samples: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of ``stat(median(a), median(b), ...)`` from resampling each cell's steps.
    Neighbouring steps share machine load, so this is if anything too narrow."""
    rng = np.random.default_rng(seed)
    medians = [np.median(rng.choice(s, (resamples, len(s))), axis=1) for s in samples]
    lo, hi = np.percentile(stat(*medians), [2.5, 97.5])
    return float(lo), float(hi)


def cache_medians(events: list[tuple[str, int, float, int]]) -> dict[tuple[str, int], tuple[float, int]]:
    """(build|advance, k) -> (median seconds, store bytes) over the rounds."""
    grouped: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for kind, k, seconds, nbytes in events:
        grouped.setdefault((kind, k), []).append((seconds, nbytes))
    return {key: (float(np.median([s for s, _ in v])), v[-1][1]) for key, v in grouped.items()}


def summarize(
    cells: dict[tuple[str, int], dict[str, np.ndarray]],
    block_bytes: list[int],
    cache_events: list[tuple[str, int, float, int]] = (),
    cache_served: dict[int, tuple[int, int, int | None]] | None = None,
) -> list[dict]:
    """One CSV row per (approach, k). ``cache_served``: k -> (keys served from the store, keys
    computed because it missed, the cut it served), all ranks together."""
    total_bytes = sum(block_bytes)
    cache = cache_medians(list(cache_events))
    served = cache_served or {}
    rows = []
    for (name, k), cell in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        hit, miss, cut = served.get(k, (None, None, None)) if name == bw.ENGINE_CACHE else (None, None, None)
        step = cell["step_ms"]
        trainable = sum(block_bytes[k:])
        sent = [b for b in cell["bytes"] if b is not None]
        static = cells.get((bw.STATIC, k))
        no_comm = cells.get((bw.NO_COMM, k))
        comm_est = None
        if no_comm is not None and name != bw.NO_COMM:
            comm_est = float(np.median(cell["backward_ms"]) - np.median(no_comm["backward_ms"]))
        rows.append(
            {
                "approach": name,
                "k": k,
                "frozen_param_fraction": (total_bytes - trainable) / total_bytes,
                "median_ms": float(np.median(step)),
                "iqr_ms": float(np.subtract(*np.percentile(step, [75, 25]))),
                "p10_ms": float(np.percentile(step, 10)),  # less sensitive to other jobs on the machine
                "steps": len(step),
                "allreduce_bytes_per_step": int(np.median(sent)) if sent else None,
                "trainable_grad_bytes": trainable,
                "ratio_to_static": float(np.median(step) / np.median(static["step_ms"]))
                if static is not None
                else None,
                "forward_ms": float(np.median(cell["forward_ms"])),
                "backward_ms": float(np.median(cell["backward_ms"])),
                "monitor_ms": float(np.median(cell["monitor_ms"])),
                "optimizer_ms": float(np.median(cell["optimizer_ms"])),
                "comm_est_ms": comm_est,
                # Every step, not just the median, and the same count on every rank.
                "bytes_match_trainable": (
                    all(b == trainable for b in sent) and bool(cell["bytes_agree"].all())
                    if sent and name != bw.NO_COMM
                    else None
                ),
                "rounds": len(set(cell["round"].tolist())),
                "cache_build_s": cache.get(("build", k), (None,))[0] if name == bw.ENGINE_CACHE else None,
                "cache_advance_s": cache.get(("advance", k), (None,))[0] if name == bw.ENGINE_CACHE else None,
                "cache_bytes": cache.get(("build", k), (None, None))[1] if name == bw.ENGINE_CACHE else None,
                "cache_hit_keys": hit,
                "cache_miss_keys": miss,
                "cache_cut": cut,
            }
        )
    return rows


def combine_served(ranks: list[dict]) -> dict[int, tuple[int, int, int | None]]:
    """k -> (keys served, keys computed, cut) summed over the ranks; the cut is rank 0's."""
    out = {}
    for k in ranks[0].get("cache_served", {}):
        per_rank = [r["cache_served"][k] for r in ranks]
        out[k] = (sum(s[0] for s in per_rank), sum(s[1] for s in per_rank), per_rank[0][2])
    return out


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)


def write_csv(rows: list[dict], path: Path, columns: tuple[str, ...] = CSV_COLUMNS) -> None:
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_fmt(row[c]) for c in columns])
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text.getvalue())


# ---------------------------------------------------------------------------------------- report
TARGET_RATIO_TO_STATIC = 1.05
TARGET_MONITOR_PCT = 2.0
TARGET_REWRAP_MS = 20.0
NAMES = {
    bw.ENGINE: "freeze engine",
    bw.STATIC: "static limit",
    bw.FIND_UNUSED: "find-unused",
    bw.PER_PARAMETER: "per-parameter",
    bw.NO_COMM: "no-comm",
    bw.ENGINE_NO_MONITOR: "freeze engine, no monitor",
    bw.ENGINE_CACHE: "engine + cache",
    bw.PREFIX_FORWARD: "prefix forward (no grad)",
    bw.CONTROL: "control",
}
TARGET_CACHE_RECOVERED = 0.90  # share of the prefix forward the cache must remove, at k >= 3
TARGET_CACHE_FROM_K = 3


def _get(rows: list[dict], name: str, k: int) -> dict | None:
    return next((r for r in rows if r["approach"] == name and r["k"] == k), None)


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    return f"{num_bytes / 1e6:.2f} MB" if num_bytes >= 1e5 else f"{num_bytes / 1e3:.1f} kB"


def _verdict(ok: bool, beyond_noise: bool = True) -> str:
    if ok:
        return "met"
    return "**MISSED**" if beyond_noise else "**MISSED** (within noise)"


TARGET_HEADER = ("target", "verdict", "measured")  # a targets table's columns: Target without its key


class Target(NamedTuple):
    key: str  # what the other parts of the report look a target up by
    target: str
    verdict: str  # "met", "**MISSED**", "**MISSED** (within noise)" or "n/a"
    measured: str


@dataclass(frozen=True)
class _Measured:
    """What every target reads: the measured ks, the CSV rows, the engine's rows by k, and each
    cell's step times."""

    ks: list[int]
    rows: list[dict]
    engine: dict[int, dict]
    steps: dict[tuple[str, int], np.ndarray]


def _bytes_target(m: _Measured) -> Target:
    """Bytes all-reduced per step equal the trainable gradient bytes, every step."""
    ks, eng, rows = m.ks, m.engine, m.rows
    exact = {
        n: [k for k in ks if not _get(rows, n, k)["bytes_match_trainable"]]
        for n in (bw.ENGINE, bw.STATIC, bw.PER_PARAMETER)
    }
    fu_bytes = {_get(rows, bw.FIND_UNUSED, k)["allreduce_bytes_per_step"] for k in ks}
    measured = "; ".join(
        f"{NAMES[n]}: {'every step at every k' if not bad else f'differs at k={bad}'}" for n, bad in exact.items()
    )
    measured += f" (k={ks[0]}: {_size(eng[ks[0]]['trainable_grad_bytes'])}, k={ks[-1]}: {_size(eng[ks[-1]]['trainable_grad_bytes'])}); "
    measured += f"find-unused sends {', '.join(_size(b) for b in sorted(fu_bytes))} at every k"
    return Target(
        "bytes",
        "bytes all-reduced per step = trainable gradient bytes",
        _verdict(not any(exact.values())),
        measured,
    )


def _static_limit_target(m: _Measured) -> Target:
    """The engine within TARGET_RATIO_TO_STATIC of the static limit at every k."""
    ks, eng, steps, rows = m.ks, m.engine, m.steps, m.rows
    ratio_ci = {k: bootstrap_ci(np.divide, steps[(bw.ENGINE, k)], steps[(bw.STATIC, k)]) for k in ks}
    over = [k for k in ks if eng[k]["ratio_to_static"] > TARGET_RATIO_TO_STATIC]
    worst = max(ks, key=lambda k: eng[k]["ratio_to_static"])
    p10 = {k: eng[k]["p10_ms"] / _get(rows, bw.STATIC, k)["p10_ms"] for k in ks}
    text = (
        f"worst k={worst}: {eng[worst]['ratio_to_static']:.3f} (95% CI {ratio_ci[worst][0]:.3f}..{ratio_ci[worst][1]:.3f}; "
        f"{eng[worst]['median_ms']:.1f} vs {_get(rows, bw.STATIC, worst)['median_ms']:.1f} ms); over {TARGET_RATIO_TO_STATIC - 1:.0%} at "
        f"k={over}; ratio of 10th percentiles {min(p10.values()):.3f}..{max(p10.values()):.3f}"
    )
    return Target(
        "static_limit",
        f"freeze engine within {TARGET_RATIO_TO_STATIC - 1:.0%} of the static limit at every k",
        _verdict(not over, any(ratio_ci[k][0] > TARGET_RATIO_TO_STATIC for k in over)),
        text,
    )


def _per_parameter_target(m: _Measured) -> Target:
    """Faster than the per-parameter all-reduce at every k."""
    ks, eng, steps, rows = m.ks, m.engine, m.steps, m.rows
    speed = {k: _get(rows, bw.PER_PARAMETER, k)["median_ms"] / eng[k]["median_ms"] for k in ks}
    slow = [k for k in ks if speed[k] <= 1.0]
    diff_ci = {k: bootstrap_ci(np.subtract, steps[(bw.ENGINE, k)], steps[(bw.PER_PARAMETER, k)]) for k in slow}
    text = f"per-parameter / engine = {min(speed.values()):.2f}..{max(speed.values()):.2f}"
    text += "".join(
        f"; k={k}: engine {eng[k]['median_ms'] - _get(rows, bw.PER_PARAMETER, k)['median_ms']:+.1f} ms "
        f"(95% CI {diff_ci[k][0]:+.1f}..{diff_ci[k][1]:+.1f})"
        for k in slow
    )
    return Target(
        "per_parameter",
        "faster than per-parameter at every k",
        _verdict(not slow, any(diff_ci[k][0] > 0 for k in slow)),
        text,
    )


def _find_unused_target(m: _Measured) -> Target:
    """Faster than find-unused where half is frozen, not slower beyond noise elsewhere."""
    ks, eng, steps, rows = m.ks, m.engine, m.steps, m.rows
    half = [k for k in ks if eng[k]["frozen_param_fraction"] >= 0.5]
    rest = [k for k in ks if k not in half]
    fu = {k: _get(rows, bw.FIND_UNUSED, k)["median_ms"] for k in ks}
    diff_ci = {k: bootstrap_ci(np.subtract, steps[(bw.ENGINE, k)], steps[(bw.FIND_UNUSED, k)]) for k in ks}
    not_faster = [k for k in half if eng[k]["median_ms"] >= fu[k]]
    slower = [k for k in rest if diff_ci[k][0] > 0]  # the rule for "slower beyond noise"
    ratios = ", ".join(f"{fu[k] / eng[k]['median_ms']:.2f}" for k in half)
    text = f"k={half}: find-unused / engine = {ratios}" if half else "no k with >= half frozen"
    if rest:
        w = max(rest, key=lambda k: eng[k]["median_ms"] - fu[k])
        text += (
            f"; elsewhere worst k={w}: engine {eng[w]['median_ms'] - fu[w]:+.1f} ms vs find-unused "
            f"(95% CI {diff_ci[w][0]:+.1f}..{diff_ci[w][1]:+.1f})"
        ) + (f"; slower beyond noise at k={slower}" if slower else "")
    text += f"; not faster at k={not_faster}" if not_faster else ""
    return Target(
        "find_unused",
        "faster than find-unused where >= half the parameters are frozen, not slower beyond noise elsewhere",
        _verdict(not not_faster and not slower, bool(slower) or any(diff_ci[k][0] > 0 for k in not_faster)),
        text,
    )


def _monitor_target(m: _Measured) -> Target:
    """The monitor's share of a step at k=0."""
    eng, steps, rows = m.engine, m.steps, m.rows
    without = _get(rows, bw.ENGINE_NO_MONITOR, 0)
    if without is None or eng.get(0) is None:
        return Target("monitor", f"monitor overhead < {TARGET_MONITOR_PCT:g}% of step time", "n/a", "k=0 not measured")
    # The i-th step of each ran in the same rotation cycle: paired differences cancel load drift.
    diff = steps[(bw.ENGINE, 0)] - steps[(bw.ENGINE_NO_MONITOR, 0)]
    lo, hi = (v / without["median_ms"] * 100 for v in bootstrap_ci(lambda d: d, diff))
    pct = float(np.median(diff)) / without["median_ms"] * 100
    direct = eng[0]["monitor_ms"] / eng[0]["median_ms"] * 100
    # after_backward is timed inside every engine step, so its share is precise; the paired
    # with/without difference also catches indirect costs but is as noisy as the machine.
    return Target(
        "monitor",
        f"monitor overhead < {TARGET_MONITOR_PCT:g}% of step time (k=0)",
        _verdict(direct < TARGET_MONITOR_PCT and lo < TARGET_MONITOR_PCT),
        f"after_backward takes {eng[0]['monitor_ms']:.2f} ms = {direct:.1f}% of the {eng[0]['median_ms']:.1f} ms step; "
        f"with vs. without after_backward (paired steps): {pct:+.1f}% (95% CI {lo:+.1f}..{hi:+.1f}%)",
    )


def _rewrap_target(rewrap_ms: list[float]) -> Target:
    """The median re-wrap time over boundary changes."""
    if rewrap_ms:
        return Target(
            "rewrap",
            f"re-wrap < {TARGET_REWRAP_MS:g} ms (median over boundary changes)",
            _verdict(float(np.median(rewrap_ms)) < TARGET_REWRAP_MS),
            f"median {np.median(rewrap_ms):.1f} ms, max {max(rewrap_ms):.1f} ms over {len(rewrap_ms)} re-wraps",
        )
    return Target("rewrap", f"re-wrap < {TARGET_REWRAP_MS:g} ms", "n/a", "no boundary change measured (one k only)")


def cache_section(cfg: BenchConfig, rows: list[dict], cells: dict) -> list[str]:
    """The "engine + cache" table beside the engine, and its two targets."""
    ks = [k for k in cfg.ks if k >= 1 and _get(rows, bw.PREFIX_FORWARD, k) is not None]
    if not ks:
        return []
    steps_per_epoch = cfg.cache_keys / (cfg.workers * cfg.batch_size)
    lines = [
        "## Activation cache (engine + cache)",
        "",
        f"The engine with a memory cache of the frozen prefix's output over {cfg.cache_keys} fixed images "
        f"(`Freezer(cache=...)`, fp32, chunks of {cfg.cache_chunk}): each step reads {cfg.batch_size} random keys and "
        "runs only the tail. prefix = the frozen prefix's no-grad forward alone on a batch, measured in the same "
        "rotation; limit = engine - prefix; recovered = (engine - engine+cache) / prefix. Build: from the images at "
        "every k (slowest rank, median over rounds); advance: from k-1 on the way up. One epoch = "
        f"{cfg.cache_keys} images = {steps_per_epoch:g} steps of {cfg.workers} x {cfg.batch_size}; its prefix "
        "forward = steps x prefix.",
        "",
    ]
    header = ["k", "engine", "engine + cache", "prefix", "limit", "recovered (95% CI)", "build s", "advance s"]
    header += ["epoch's prefix fwd s", "build / epoch prefix", "cache MB per rank"]
    steps = {key: cell["step_ms"] for key, cell in cells.items()}
    missed_recovery, missed_build, table = [], [], []
    for k in ks:
        eng, cached = _get(rows, bw.ENGINE, k), _get(rows, bw.ENGINE_CACHE, k)
        prefix = _get(rows, bw.PREFIX_FORWARD, k)["median_ms"]
        recovered = (eng["median_ms"] - cached["median_ms"]) / prefix
        lo, hi = bootstrap_ci(
            lambda a, b, c: (a - b) / c,
            steps[(bw.ENGINE, k)],
            steps[(bw.ENGINE_CACHE, k)],
            steps[(bw.PREFIX_FORWARD, k)],
        )
        epoch_prefix_s = steps_per_epoch * prefix / 1e3
        build, advance = cached["cache_build_s"], cached["cache_advance_s"]
        ratio = build / epoch_prefix_s if build is not None else None
        if k >= TARGET_CACHE_FROM_K and recovered < TARGET_CACHE_RECOVERED:
            missed_recovery.append(f"k={k}: {recovered:.0%} (95% CI {lo:.0%}..{hi:.0%})")
        if ratio is not None and ratio > 1.0:
            missed_build.append(f"k={k}: {ratio:.2f}x")
        table.append(
            [
                k,
                f"{eng['median_ms']:.1f}",
                f"{cached['median_ms']:.1f}",
                f"{prefix:.1f}",
                f"{eng['median_ms'] - prefix:.1f}",
                f"{recovered:.0%} ({lo:.0%}..{hi:.0%})",
                _fmt(build),
                _fmt(advance),
                f"{epoch_prefix_s:.3f}",
                _fmt(ratio),
                f"{(cached['cache_bytes'] or 0) / 1e6:.2f}",
            ]
        )
    targets = [
        (
            f"the cache recovers >= {TARGET_CACHE_RECOVERED:.0%} of the prefix forward at every k >= {TARGET_CACHE_FROM_K}",
            _verdict(not missed_recovery),
            "; ".join(missed_recovery) or "every k",
        ),
        (
            f"a build costs <= one epoch's prefix forward ({cfg.cache_keys} images)",
            _verdict(not missed_build),
            "; ".join(missed_build) or "every k",
        ),
    ]
    return [*lines, *markdown.table(header, table), "", *markdown.table(TARGET_HEADER, targets), ""]


def evaluate_targets(cfg: BenchConfig, rows: list[dict], cells: dict, rewrap_ms: list[float]) -> list[Target]:
    """One :class:`Target` per target, in report order. A miss whose 95% interval still reaches the
    target is marked "within noise": on a shared machine that is a different finding."""
    ks = list(cfg.ks)
    m = _Measured(
        ks, rows, {k: _get(rows, bw.ENGINE, k) for k in ks}, {key: cell["step_ms"] for key, cell in cells.items()}
    )
    return [
        _bytes_target(m),
        _static_limit_target(m),
        _per_parameter_target(m),
        _find_unused_target(m),
        _monitor_target(m),
        _rewrap_target(rewrap_ms),
    ]


def write_markdown(
    path: Path, cfg: BenchConfig, rows: list[dict], cells: dict, rewrap_ms: list[float], run: dict
) -> None:
    ks = list(cfg.ks)
    main = (bw.ENGINE, bw.STATIC, bw.FIND_UNUSED, bw.PER_PARAMETER)
    lines = [
        "# Freezing under DDP: where a step's time goes",
        "",
        f"Generated by `{run['command']}` in {run['wall_s']:.0f} s wall time. Every number comes from that run "
        "(also in `bench.csv`); nothing is typed by hand.",
        "",
        "## Setup",
        f"- Hardware: {cpu_name()}, {os.cpu_count()} cores; {cfg.workers} gloo workers x {run['threads']} thread(s), one machine."
        if cfg.device == "cpu"
        else f"- Hardware: {torch.cuda.get_device_name()}; {cfg.workers} NCCL worker(s), one per GPU; CUDA events time each phase.",
        f"- Load average (1 min) before / after: {run['load_avg'][0]:.2f} / {run['load_avg'][1]:.2f}. The machine may have been "
        "shared with other jobs during the run: read differences of a few percent as noise.",
        f"- Versions: torch {torch.__version__}, torchvision {torchvision.__version__}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}.",
        f"- Model: {cfg.model} ({bw.NUM_CLASSES} classes), input 3x{cfg.image_size}x{cfg.image_size}, batch {cfg.batch_size} per worker, "
        f"SGD lr {cfg.lr} momentum {cfg.momentum:g}, fresh synthetic random batch each step (generated outside the clock).",
        f"- Blocks (split_blocks default, k freezes blocks 0..k-1): {', '.join(run['block_names'])}.",
        f"- Per cell (approach x k): {cfg.rounds} round(s) x {cfg.steps} timed steps = {cfg.rounds * cfg.steps} steps, after "
        f"{cfg.warmup} untimed warm-up steps per round. Rounds visit k up, then down; at each k the approaches take turns "
        "step by step (order rotating every cycle), so all of them see the same machine load.",
        "- A step = zero_grad, forward, loss, backward (+ blocking comm), after_backward (engine only), SGD step; the clock "
        "starts after `dist.barrier()`; a step's time is the slowest rank's. ms = median over all timed steps, +- = half the IQR.",
        "",
        "## Approaches",
        "- **freeze engine**: `Freezer.set_boundary(k)` (re-wrapped DDP), `freezer.after_backward()` every step.",
        "- **static limit**: a DDP built once per k over a model whose prefix was frozen before wrapping (frozen BN in eval, "
        "frozen buffers ignored, as in the engine); the best any dynamic scheme can do.",
        "- **find-unused**: ONE DDP built before freezing with `find_unused_parameters=True`, then `requires_grad=False` "
        "on the prefix (BN left in train mode): what most trainers do.",
        "- **per-parameter**: plain model, backward, then one blocking `dist.all_reduce` per trainable gradient, divided by world size.",
        "- **no-comm** (phase table only): plain model, same frozen prefix, no communication.",
        "",
        "## Main table (ms per step)",
        "",
    ]
    header = ["k", "frozen params", "trainable grads", *(NAMES[n] for n in main), "engine / static"]
    header += ["same, 10th pct.", "engine bytes/step", "find-unused bytes/step"]
    table = []
    for k in ks:
        r = {n: _get(rows, n, k) for n in main}
        e = r[bw.ENGINE]
        table.append(
            [
                k,
                f"{e['frozen_param_fraction']:.1%}",
                _size(e["trainable_grad_bytes"]),
                *(f"{r[n]['median_ms']:.1f} +-{r[n]['iqr_ms'] / 2:.1f}" for n in main),
                f"{e['ratio_to_static']:.3f}",
                f"{e['p10_ms'] / r[bw.STATIC]['p10_ms']:.3f}",
                _size(e["allreduce_bytes_per_step"]),
                _size(r[bw.FIND_UNUSED]["allreduce_bytes_per_step"]),
            ]
        )
    lines += markdown.table(header, table)
    targets = evaluate_targets(cfg, rows, cells, rewrap_ms)
    lines += ["", "## Targets", "", *markdown.table(TARGET_HEADER, [t[1:] for t in targets])]
    measured = {t.key: t.measured for t in targets}
    lines += [
        "",
        'Noise: 95% intervals come from resampling each cell\'s steps (bootstrap of the median). "Slower beyond noise" '
        'means the interval of the difference lies above 0; a miss marked "within noise" has an interval that still '
        "reaches the target. Neighbouring steps share machine load, so the intervals are if anything too narrow. "
        "10th percentiles are shown because other jobs only ever add time.",
        "",
        "## Overheads",
        "",
        f"- Monitor (`freezer.after_backward()`): {measured['monitor']}.",
        f"- Re-wrap (`freezer.counters.rewrap_s_last` after each `set_boundary` that changed k, slowest rank): {measured['rewrap']}"
        + (f"; all: {', '.join(f'{ms:.1f}' for ms in rewrap_ms)} ms." if rewrap_ms else "."),
        "- Communication not hidden behind backward (freeze engine, comm est. below): "
        + ", ".join(f"k={k}: {_get(rows, bw.ENGINE, k)['comm_est_ms']:.1f} ms" for k in cfg.phase_ks)
        + ".",
        "",
        "## Phase split (ms, medians per phase; they need not add up to the step median)",
        "",
        "comm est. = backward of the approach minus backward of the no-comm run at the same k "
        "(communication not hidden behind the backward pass).",
        "",
    ]
    header = ["approach", "k", "step", "forward", "backward (incl. comm)", "after_backward", "optimizer", "comm est."]
    table = []
    for k in cfg.phase_ks:
        for n in main + (bw.NO_COMM,):
            r = _get(rows, n, k)
            table.append(
                [
                    NAMES[n],
                    k,
                    f"{r['median_ms']:.1f}",
                    f"{r['forward_ms']:.1f}",
                    f"{r['backward_ms']:.1f}",
                    f"{r['monitor_ms']:.2f}",
                    f"{r['optimizer_ms']:.1f}",
                    "-" if r["comm_est_ms"] is None else f"{r['comm_est_ms']:.1f}",
                ]
            )
    lines += [*markdown.table(header, table), ""]
    lines += cache_section(cfg, rows, cells)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines)
    kept = spliced_sections(path)
    atomic_write_text(path, text + ("\n" + kept if kept else ""))


# Sections other commands splice into BENCH.md (the BERT rows, the cluster benchmark, the cost
# model's validation) are spans (freeze.pipeline.markdown); the main table owns only what comes before the first.
TEXT_SECTION = "bert-bench"


def spliced_sections(path: Path) -> str:
    """Everything of ``path`` from its first span on ("" when none or no file): what the main
    table's rewrite keeps.

    Raises:
        markdown.MarkerError: a span's marker is missing or doubled.
    """
    if not path.exists():
        return ""
    old = path.read_text(encoding="utf-8")
    found = markdown.spans(old, path)
    return old[found[0][1] :] if found else ""


def splice_section(path: Path, name: str, body: str, *, before_others: bool) -> None:
    """Replace span ``name`` of ``path`` by ``body``; a file without it gets it before its first
    other span (``before_others``: right after the main table) or at its end. The rest stays as it was.

    Args:
        path: the markdown file (created with the main table's title when missing).
        name: the span (markers as freeze.pipeline.markdown writes them).
        body: the section's lines, without the markers.
        before_others: where a new span goes: before the other spans, else at the end.

    Raises:
        markdown.MarkerError: the span's start or end marker is missing or doubled.
    """
    old = path.read_text(encoding="utf-8") if path.exists() else "# Freezing under DDP: where a step's time goes\n"
    others = markdown.spans(old, path)
    if markdown.has(old, name, path):
        new = markdown.splice(old, name, body, path)
    elif before_others and others:
        new = old[: others[0][1]] + markdown.span(name, body) + "\n\n" + old[others[0][1] :]
    else:
        new = old.rstrip("\n") + "\n\n" + markdown.span(name, body) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, new)


def _median_ci(samples: np.ndarray) -> str:
    lo, hi = bootstrap_ci(lambda m: m, samples)
    return f"{np.median(samples):.0f} ({lo:.0f}..{hi:.0f})"


def _ratio_ci(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """median(a) / median(b) and its 95% interval."""
    lo, hi = bootstrap_ci(np.divide, a, b)
    return float(np.median(a) / np.median(b)), lo, hi


def text_section(cfg: BenchConfig, rows: list[dict], cells: dict, run: dict) -> str:
    """The BERT rows: engine with and without the cache, static limit and control at each k: the
    body of BENCH.md's span TEXT_SECTION."""
    import transformers

    ks, names = list(cfg.ks), run["block_names"]
    steps = {key: cell["step_ms"] for key, cell in cells.items()}
    step_approaches = (bw.ENGINE, bw.ENGINE_CACHE, bw.STATIC, bw.CONTROL)
    total_bytes = sum(run["block_param_bytes"])
    bert = bw.bert_config(cfg.model)
    epoch_steps = cfg.cache_keys / (cfg.workers * cfg.batch_size)
    gpu = "no GPU" if not torch.cuda.is_available() else f"{torch.cuda.device_count()} GPU(s), unused"
    lines = [
        f"## {cfg.model}: a Hugging Face encoder with and without the activation cache",
        "",
        f"Generated by `{run['command']}` in {run['wall_s']:.0f} s wall time. Every number comes from that run "
        f"(also in `bench_{cfg.model}.csv`); nothing is typed by hand.",
        "",
        f"- Hardware: {cpu_name()}, {os.cpu_count()} CPU cores, {gpu}; {cfg.workers} gloo workers x {run['threads']} "
        "thread(s), one machine.",
        f"- Load average (1 min) before / after: {run['load_avg'][0]:.2f} / {run['load_avg'][1]:.2f}.",
        f"- Versions: torch {torch.__version__}, transformers {transformers.__version__}, Python "
        f"{platform.python_version()}.",
        f"- Model: `BertForSequenceClassification` ({bw.NUM_CLASSES} labels), random weights from a `BertConfig` "
        f"(hidden {bert.hidden_size}, {bert.num_hidden_layers} layers, {bert.num_attention_heads} heads, vocabulary "
        f"{bert.vocab_size}; {total_bytes / 4e6:.3g} M parameters), no download. Frozen blocks run in eval (dropout "
        f"off), in every approach, as the engine runs them by default. SGD lr {cfg.lr} momentum {cfg.momentum:g}"
        + (
            " (momentum buffers would add a model's size per replica: 4 replicas per rank)."
            if not cfg.momentum
            else "."
        ),
        f"- Data: {cfg.cache_keys} fixed sequences of {cfg.seq_len} tokens (random ids; each sequence's length drawn "
        f"from {cfg.seq_len // 2}..{cfg.seq_len}, the rest padding with attention_mask 0). A step reads "
        f"{cfg.batch_size} random keys per worker, and every approach runs that batch "
        "(`freezer.module(**batch, sample_ids=keys)` with the cache).",
        f"- Blocks (split_blocks default, k freezes blocks 0..k-1): {', '.join(names)}.",
        f"- Per cell (approach x k): {cfg.rounds} round(s) x {cfg.steps} timed steps = {cfg.rounds * cfg.steps} steps, "
        f"after {cfg.warmup} untimed warm-up step(s) per round; at each k the approaches take turns step by step "
        "(order rotating every cycle). A step as in the main table (zero_grad .. SGD step, the slowest rank's time).",
        "- Approaches: **engine** = `Freezer.set_boundary(k)`, no cache; **engine + cache** = the same with "
        f'`cache=CacheConfig("memory")` over the {cfg.cache_keys} sequences (fp32; built before the timed steps, '
        "at every k from the inputs); **static** = the static limit of the main table; **control** = a second "
        "static limit, its own replica and DDP, in the same rotation: it computes what the static limit computes, "
        "so its true ratio to it is 1.00 and its interval says how far the machine alone moves a ratio; "
        "**prefix** = the frozen prefix's no-grad forward alone (what the cache can save per step).",
        "- ms = median over the cell's steps (all rounds), 95% CI = bootstrap of that median over the steps; a "
        "ratio's interval resamples both cells. vs. k=0 = the engine at k=0 (every block trained, no cache) over "
        "engine + cache at k: the per-step speedup over full fine-tuning (cells measured at different times).",
        "",
    ]
    header = ["k", "frozen", "trainable grads", "bytes/step = trainable", "engine ms", "engine + cache ms"]
    header += ["static ms", "control ms", "engine / static", "control / static", "engine / (engine + cache)", "vs. k=0"]
    bad_bytes, control_off, table = [], [], []
    for k in ks:
        r = {n: _get(rows, n, k) for n in step_approaches}
        exact = [n for n in step_approaches if not r[n]["bytes_match_trainable"]]
        bad_bytes += [f"{NAMES[n]} at k={k}" for n in exact]
        frozen = "-" if k == 0 else (names[0] if k == 1 else f"{names[0]} .. {names[k - 1]}")
        ratios = {
            "es": _ratio_ci(steps[(bw.ENGINE, k)], steps[(bw.STATIC, k)]),
            "cs": _ratio_ci(steps[(bw.CONTROL, k)], steps[(bw.STATIC, k)]),
            "ec": _ratio_ci(steps[(bw.ENGINE, k)], steps[(bw.ENGINE_CACHE, k)]),
            "e0": _ratio_ci(steps[(bw.ENGINE, ks[0])], steps[(bw.ENGINE_CACHE, k)]) if ks[0] == 0 else None,
        }
        if not ratios["cs"][1] <= 1.0 <= ratios["cs"][2]:
            control_off.append(k)
        shown = {key: "-" if v is None else f"{v[0]:.2f} ({v[1]:.2f}..{v[2]:.2f})" for key, v in ratios.items()}
        table.append(
            [
                k,
                f"{frozen} ({r[bw.ENGINE]['frozen_param_fraction']:.0%})",
                _size(r[bw.ENGINE]["trainable_grad_bytes"]),
                "every step" if not exact else "NO: " + ", ".join(NAMES[n] for n in exact),
                *(_median_ci(steps[(n, k)]) for n in step_approaches),
                *(shown[key] for key in ("es", "cs", "ec", "e0")),
            ]
        )
    cache_ks = [k for k in ks if k >= 1]
    lines += [
        *markdown.table(header, table),
        "",
        f"The cache at each k: the cut it serves (the stored tensor enters block `cut`), keys served from the store "
        "and keys computed because a batch missed (all ranks, warm-up included), the build from the inputs and the "
        f"advance from the previous k (slowest rank, median over rounds); recovered = (engine - engine + cache) / "
        f"prefix; one epoch = {cfg.cache_keys} sequences = {epoch_steps:g} steps.",
        "",
    ]
    header = ["k", "cut", "keys served / computed", "prefix ms", "recovered (95% CI)", "build s", "advance s"]
    header += ["build / epoch's prefix fwd", "cache MB per rank"]
    not_served, table = [], []
    for k in cache_ks:
        c = _get(rows, bw.ENGINE_CACHE, k)
        prefix = _get(rows, bw.PREFIX_FORWARD, k)
        if not c["cache_hit_keys"] or c["cache_miss_keys"] or c["cache_cut"] != k:
            not_served.append(k)
        recovered, build_ratio = "-", "-"
        prefix_ms = "-" if prefix is None else f"{prefix['median_ms']:.0f}"
        if prefix is not None:
            rec = (_get(rows, bw.ENGINE, k)["median_ms"] - c["median_ms"]) / prefix["median_ms"]
            lo, hi = bootstrap_ci(
                lambda a, b, p: (a - b) / p,
                steps[(bw.ENGINE, k)],
                steps[(bw.ENGINE_CACHE, k)],
                steps[(bw.PREFIX_FORWARD, k)],
            )
            recovered = f"{rec:.0%} ({lo:.0%}..{hi:.0%})"
            if c["cache_build_s"] is not None:
                build_ratio = f"{c['cache_build_s'] / (epoch_steps * prefix['median_ms'] / 1e3):.2f}"
        table.append(
            [
                k,
                "-" if c["cache_cut"] is None else c["cache_cut"],
                f"{c['cache_hit_keys'] or 0} / {c['cache_miss_keys'] or 0}",
                prefix_ms,
                recovered,
                _fmt(c["cache_build_s"]) or "-",
                _fmt(c["cache_advance_s"]) or "-",
                build_ratio,
                f"{(c['cache_bytes'] or 0) / 1e6:.2f}",
            ]
        )
    checks = [
        (
            "bytes all-reduced per step = trainable gradient bytes (every step, every rank, all four approaches)",
            _verdict(not bad_bytes),
            "; ".join(bad_bytes) or "every k",
        ),
        (
            "the control holds 1.00 (its 95% CI contains 1.00) at every k",
            "holds" if not control_off else "**DOES NOT HOLD**",
            "every k"
            if not control_off
            else f"k={control_off}: the intervals understate the machine's noise there; read the other ratios at "
            "those k as no more precise than the control's distance from 1.00",
        ),
        (
            "the cache serves every key at the cut k, at every k >= 1",
            _verdict(not not_served),
            f"not at k={not_served}" if not_served else "every k",
        ),
    ]
    lines += [*markdown.table(header, table), "", *markdown.table(("check", "verdict", "measured"), checks)]
    return "\n".join(lines)


def measure_rows(
    cfg: BenchConfig, extra: dict, workdir: Path | None, deadline_s: float
) -> tuple[list[dict], dict, list[dict]]:
    """Run the workers on a resolved ``cfg`` (``extra``: worker settings beyond it, e.g. the
    approaches); return the CSV rows, the cells (per approach and k: every step's times) and the
    ranks' own results."""
    worker_cfg = asdict(cfg) | extra
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="bench-rdzv-") as tmp:
            ranks = bw.launch(worker_cfg, Path(tmp), deadline_s)
    else:
        ranks = bw.launch(worker_cfg, Path(workdir), deadline_s)
    cells = bw.combine_ranks(ranks)
    # Each build happened on every rank; the slowest rank's time is the one training waits for.
    cache_events = [
        (evs[0][0], evs[0][1], max(e[2] for e in evs), evs[0][3]) for evs in zip(*(r["cache_events"] for r in ranks))
    ]
    rows = summarize(cells, ranks[0]["block_param_bytes"], cache_events, combine_served(ranks))
    return rows, cells, ranks


def run_benchmark(
    cfg: BenchConfig,
    out_dir: Path,
    *,
    workdir: Path | None = None,
    deadline_s: float = 3600.0,
    command: str = "",
) -> list[dict]:
    """Measure, then write ``out_dir/bench.csv`` and ``out_dir/BENCH.md``; returns the CSV rows."""
    cfg.validate()
    start_s = time.perf_counter()
    load_before = os.getloadavg()
    cfg = cfg.resolved(len(bw.split_blocks(bw.build_model(cfg.model, cfg.image_size))))
    extra = {"approaches": bw.TEXT_APPROACHES, "monitor_cell": False} if cfg.text else {}
    rows, cells, ranks = measure_rows(cfg, extra, workdir, deadline_s)
    out_dir = Path(out_dir)
    run = {
        "command": command or "(called from Python)",
        "wall_s": time.perf_counter() - start_s,
        "load_avg": (load_before[0], os.getloadavg()[0]),
        "threads": ranks[0]["threads"],
        "block_names": ranks[0]["block_names"],
    }
    if cfg.text:
        write_csv(rows, out_dir / f"bench_{cfg.model}.csv")
        run["block_param_bytes"] = ranks[0]["block_param_bytes"]
        splice_section(out_dir / "BENCH.md", TEXT_SECTION, text_section(cfg, rows, cells, run), before_others=True)
        return rows
    write_csv(rows, out_dir / "bench.csv")
    # Each re-wrap happened on every rank; the slowest rank's time is the one training waits for.
    rewrap_ms = [max(ms) for ms in zip(*(r["rewrap_ms"] for r in ranks))]
    write_markdown(out_dir / "BENCH.md", cfg, rows, cells, rewrap_ms, run)
    return rows


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def get_args_parser() -> argparse.ArgumentParser:
    d, t = BenchConfig(), TEXT_DEFAULTS
    p = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.split("\n")[0])

    def per_model(flag: str, kind: type, what: str) -> None:
        """A flag whose default depends on the model (BenchConfig.for_model fills it when not given)."""
        name = flag.removeprefix("--").replace("-", "_")
        p.add_argument(flag, type=kind, default=None, help=f"{what} (default {getattr(d, name)}, BERT {t[name]})")

    p.add_argument("--workers", type=int, default=d.workers, help="gloo ranks on this machine")
    p.add_argument(
        "--model", default=d.model, choices=BENCH_MODELS, help="bert-base / bert-tiny: the BERT rows (own section)"
    )
    per_model("--batch-size", int, "per worker")
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="BERT: tokens per sequence")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed steps per block (default {d.steps}, --quick {QUICK_STEPS}; BERT {t['steps']}, {TEXT_QUICK_STEPS})",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"rounds over all blocks (default {d.rounds}, --quick {QUICK_ROUNDS}; BERT {t['rounds']}, {TEXT_QUICK_ROUNDS})",
    )
    per_model("--warmup", int, "untimed steps per block")
    p.add_argument(
        "--ks",
        type=_int_list,
        default=None,
        help="boundaries to measure, e.g. 0,5,9 (default: all; bert-base 0,4,8,12)",
    )
    p.add_argument(
        "--phase-ks", type=_int_list, default=None, help="boundaries with a no-comm run (default: 0, middle, last two)"
    )
    p.add_argument("--lr", type=float, default=d.lr)
    per_model("--momentum", float, "SGD's")
    per_model("--cache-keys", int, "inputs the cache runner keys into")
    per_model("--cache-chunk", int, "rows per cache build chunk")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, choices=("cpu", "cuda"), help="cuda: one NCCL worker per GPU")
    p.add_argument("--quick", action="store_true", help="a ~1-2 minute run: fewer steps, one round")
    p.add_argument("--out-dir", type=Path, default=Path("report"))
    p.add_argument("--deadline-s", type=float, default=3600.0, help="kill the workers after this long")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The model's defaults (BenchConfig.for_model), then every flag given. --quick only changes
    the defaults: an explicit --steps / --rounds still wins."""
    d = BenchConfig.for_model(args.model)
    quick_steps, quick_rounds = (TEXT_QUICK_STEPS, TEXT_QUICK_ROUNDS) if d.text else (QUICK_STEPS, QUICK_ROUNDS)

    def given(value, default):
        return default if value is None else value

    return replace(
        d,
        workers=args.workers,
        batch_size=given(args.batch_size, d.batch_size),
        image_size=args.image_size,
        seq_len=args.seq_len,
        steps=given(args.steps, quick_steps if args.quick else d.steps),
        rounds=given(args.rounds, quick_rounds if args.quick else d.rounds),
        warmup=given(args.warmup, d.warmup),
        ks=given(args.ks, d.ks),
        phase_ks=args.phase_ks,
        lr=args.lr,
        momentum=given(args.momentum, d.momentum),
        seed=args.seed,
        cache_keys=given(args.cache_keys, d.cache_keys),
        cache_chunk=given(args.cache_chunk, d.cache_chunk),
        device=args.device,
    )


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    cfg = config_from_args(args)
    try:
        cfg.validate()
        spliced_sections(args.out_dir / "BENCH.md")  # a broken span (markdown.MarkerError) now, not after the run
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, "-m", "experiments.bench", *(argv or [])]))
    run_benchmark(cfg, args.out_dir, deadline_s=args.deadline_s, command=command)
    csv_name = f"bench_{cfg.model}.csv" if cfg.text else "bench.csv"
    print(f"bench: wrote {args.out_dir / csv_name} and {args.out_dir / 'BENCH.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
