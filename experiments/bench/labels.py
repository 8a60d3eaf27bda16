"""The words every BENCH.md section shares: the approaches' names, byte sizes, verdicts."""

from __future__ import annotations

from experiments import bench_workers as bw

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
TARGET_HEADER = ("target", "verdict", "measured")  # a targets table's columns: Target without its key


def size_text(num_bytes: int | None) -> str:
    """Bytes as MB from 100 kB up, else as kB; "-" for None."""
    if num_bytes is None:
        return "-"
    return f"{num_bytes / 1e6:.2f} MB" if num_bytes >= 1e5 else f"{num_bytes / 1e3:.1f} kB"


def verdict_of(ok: bool, beyond_noise: bool = True) -> str:
    """A target's verdict; a miss whose 95% interval still reaches the target is "within noise"."""
    if ok:
        return "met"
    return "**MISSED**" if beyond_noise else "**MISSED** (within noise)"
