"""The image models' cache rows: the engine with the activation cache beside the engine without
it, against the frozen prefix's forward (what the cache can save), and the two cache targets."""

from __future__ import annotations

from experiments import bench_workers as bw
from experiments.bench.config import BenchConfig
from experiments.bench.labels import TARGET_HEADER, verdict_of
from experiments.bench.rows import bootstrap_ci, format_value, row_at
from freeze.pipeline import markdown

TARGET_CACHE_RECOVERED = 0.90  # share of the prefix forward the cache must remove, at k >= 3
TARGET_CACHE_FROM_K = 3


def cache_section(cfg: BenchConfig, rows: list[dict], cells: dict) -> list[str]:
    """The "engine + cache" table beside the engine, and its two targets."""
    ks = [k for k in cfg.ks if k >= 1 and row_at(rows, bw.PREFIX_FORWARD, k) is not None]
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
        eng, cached = row_at(rows, bw.ENGINE, k), row_at(rows, bw.ENGINE_CACHE, k)
        prefix = row_at(rows, bw.PREFIX_FORWARD, k)["median_ms"]
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
                format_value(build),
                format_value(advance),
                f"{epoch_prefix_s:.3f}",
                format_value(ratio),
                f"{(cached['cache_bytes'] or 0) / 1e6:.2f}",
            ]
        )
    targets = [
        (
            f"the cache recovers >= {TARGET_CACHE_RECOVERED:.0%} of the prefix forward at every k >= {TARGET_CACHE_FROM_K}",
            verdict_of(not missed_recovery),
            "; ".join(missed_recovery) or "every k",
        ),
        (
            f"a build costs <= one epoch's prefix forward ({cfg.cache_keys} images)",
            verdict_of(not missed_build),
            "; ".join(missed_build) or "every k",
        ),
    ]
    return [*lines, *markdown.table(header, table), "", *markdown.table(TARGET_HEADER, targets), ""]
