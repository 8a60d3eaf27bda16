"""From the workers' samples to the CSV rows: one row per (approach, k) with its medians, bytes and
cache counts, written as ``bench.csv``; the bootstrap every report's intervals come from."""

from __future__ import annotations

import csv
import io
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from experiments import bench_workers as bw
from experiments.bench.config import BenchConfig
from freeze._atomic import atomic_write_text

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


def format_value(value) -> str:
    """A CSV cell: empty for None, 4 decimals below 10 and 2 above for a float."""
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
        writer.writerow([format_value(row[c]) for c in columns])
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text.getvalue())


def row_at(rows: list[dict], name: str, k: int) -> dict | None:
    """The row of approach ``name`` at boundary ``k`` (None where that cell was not measured)."""
    return next((r for r in rows if r["approach"] == name and r["k"] == k), None)


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
