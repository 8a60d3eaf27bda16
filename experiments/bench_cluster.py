"""What freezing buys on a cluster: the engine benchmark across emulated nodes with capped links.

    .venv/bin/python -m experiments.bench_cluster            # 2 and 4 nodes, 1 Gbit/s and uncapped
    .venv/bin/python -m experiments.bench_cluster --quick    # a few minutes: k = 0, 8, 9, 2 steps
    .venv/bin/python -m experiments.bench_cluster --nodes 2 --bandwidths 100mbit,1gbit --ks 0,8

For every (nodes, link cap) it builds an emulated cluster (freeze.pipeline.cluster: one network
namespace per node, tbf-capped veth links, one torchrun agent per node, one worker each) and runs
the engine benchmark's step loop there (experiments.bench_workers.measure): freeze engine,
find-unused and the static limit at each boundary k, plus a no-communication run at a few k, so
that bytes per step turn into wall time. Writes ``<out-dir>/bench_cluster.csv`` and replaces the
cluster section of ``<out-dir>/BENCH.md`` (appended when absent; ``make bench`` runs
experiments.bench first, which rewrites BENCH.md). Exit 2 with one line where no cluster can be built.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments import bench_workers as bw
from experiments.bench import rows as bench_rows
from experiments.bench.sections import splice_section, spliced_sections
from freeze._atomic import atomic_write_text
from freeze.pipeline import markdown

SECTION = "cluster-bench"  # the span of BENCH.md this command owns (freeze.pipeline.markdown)
APPROACHES = (bw.ENGINE, bw.STATIC, bw.FIND_UNUSED)
CSV_COLUMNS = ("nodes", "bandwidth", *bench_rows.CSV_COLUMNS)


@dataclass(frozen=True)
class ClusterBenchConfig:
    nodes: tuple[int, ...] = (2, 4)
    bandwidths: tuple[str, ...] = ("1gbit", "uncapped")
    model: str = "resnet18"
    batch_size: int = 64  # per worker
    image_size: int = 32
    steps: int = 5  # timed steps per approach per (round, k)
    rounds: int = 1
    warmup: int = 1
    ks: tuple[int, ...] | None = None  # None: every boundary
    phase_ks: tuple[int, ...] = (0, 8)  # no-comm runs: what communication costs in wall time
    lr: float = 0.01
    seed: int = 0
    collective_timeout_s: float = 600.0
    # The engine + cache runner (experiments.validate_costmodel measures it): as experiments.bench.
    cache_keys: int = 2048
    cache_chunk: int = 256


QUICK = {"ks": (0, 8, 9), "phase_ks": (8,), "steps": 2, "warmup": 1, "rounds": 1}


# ------------------------------------------------------------------------------------- worker side
def worker_main(cfg_path: str, workdir: str) -> int:
    """One rank under torchrun on a cluster node: bench_workers.measure, gathered on rank 0."""
    import torch
    import torch.distributed as dist

    from freeze.comm import end_process_group
    from freeze.pipeline.log import get_logger
    from freeze.testing import write_payload

    cfg = json.loads(Path(cfg_path).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # the node's share of the cores
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["collective_timeout_s"]))
    try:
        rank = dist.get_rank()
        result = bw.measure(cfg, rank, get_logger(rank))
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if rank == 0:
            write_payload(workdir, 0, {"ok": True, "result": gathered})
    finally:
        # Not dist.destroy_process_group(): the runners' DDP wrappers sit in reference cycles
        # (a Freezer and its module) until a collection, and a wrapper alive at destroy leaves gloo
        # threads running into interpreter shutdown, where one aborts the rank ("terminate called
        # without an active exception": seen once in five fresh-clone suites, and its peer then
        # waited out the job's deadline).
        end_process_group()
    return 0


# ------------------------------------------------------------------------------------- parent side
def measure_cluster(
    cfg: ClusterBenchConfig, nodes: int, bandwidth: str, ks, deadline_s: float, approaches: tuple[str, ...] = APPROACHES
) -> dict:
    """One (nodes, cap) cell: the per-rank measurements and the link counters. ``approaches``: the
    step loops to measure (experiments.validate_costmodel measures the engine alone)."""
    import pickle

    from freeze.pipeline.cluster import Cluster, ClusterError, ClusterSpec, plan_cpus
    from freeze.pipeline.cluster.launch import run_job, sigterm_as_interrupt
    from freeze.testing import payload_path

    worker_cfg = {
        **asdict(cfg),
        "workers": nodes,
        "ks": list(ks),
        "phase_ks": [k for k in cfg.phase_ks if k in ks],
        "approaches": list(approaches),
        "monitor_cell": False,
    }
    spec = ClusterSpec.parse(nodes, bandwidth)
    with tempfile.TemporaryDirectory(prefix="fzc-bench-") as tmp:
        cfg_path = Path(tmp) / "cfg.json"
        cfg_path.write_text(json.dumps(worker_cfg))
        entry = ["-m", "experiments.bench_cluster", "--worker", str(cfg_path), tmp]
        with sigterm_as_interrupt(), Cluster(spec, plan_cpus(nodes, 1)) as cluster:
            print(cluster.describe(), flush=True)
            result = run_job(cluster, entry, 1, 0, deadline_s)
        if result.returncode != 0 or not payload_path(tmp, 0).exists():
            raise ClusterError(f"bench_cluster: workers failed (exit codes {list(result.node_returncodes)})")
        with open(payload_path(tmp, 0), "rb") as f:
            ranks = pickle.load(f)["result"]
    return {
        "ranks": ranks,
        "threads": ranks[0]["threads"],
        "cores": [list(n.cpu.cores) for n in cluster.nodes],
        "tx_bytes": [c.tx_bytes for c in result.counters],
        "drops": sum(c.qdisc_drops for c in result.counters),
        "wall_s": result.wall_s,
    }


def _ms(row: dict | None) -> str:
    return "-" if row is None else f"{row['median_ms']:.0f}"


TABLE_HEADER = (
    "k",
    "engine ms",
    "static ms",
    "find-unused ms",
    "find-unused / engine",
    "engine MB/step",
    "find-unused MB/step",
    "no-comm ms",
)


def section(cfg: ClusterBenchConfig, results: list[tuple[int, str, list[dict], dict]], run: dict) -> str:
    lines = [
        "## On an emulated cluster (experiments/bench_cluster.py)",
        "",
        f"Generated by `{run['command']}` in {run['wall_s']:.0f} s. One network namespace per node joined by a bridge, "
        "each node's link capped in both directions with tbf (or uncapped: veth at memory speed), one torchrun agent "
        "and one gloo worker per node (c10d rendezvous on node 0). "
        f"Load average (1 min) before / after: {run['load_avg'][0]:.2f} / {run['load_avg'][1]:.2f}. "
        f"{cfg.model}, batch {cfg.batch_size} per worker, {cfg.rounds} round(s) x {cfg.steps} timed steps per cell after "
        f"{cfg.warmup} warm-up step(s); ms = median step time of the slowest rank. The forwarding of the emulated links "
        "runs on the same cores as training.",
        "",
    ]
    for nodes, bandwidth, rows, meta in results:
        get = {(r["approach"], r["k"]): r for r in rows}
        ks = sorted({r["k"] for r in rows})
        cores = ", ".join(str(c) for c in meta["cores"])
        shared = " (nodes share cores)" if nodes > len({c for cs in meta["cores"] for c in cs}) else ""
        lines += [
            f"### {nodes} nodes, links {bandwidth}",
            "",
            f"Cores per node {cores}{shared}, {meta['threads']} thread(s) per worker; bytes sent per node over the "
            f"whole cell: {', '.join(f'{b / 1e9:.2f} GB' for b in meta['tx_bytes'])}; tbf drops {meta['drops']}.",
            "",
        ]
        table = []
        for k in ks:
            e, s, f = get.get((bw.ENGINE, k)), get.get((bw.STATIC, k)), get.get((bw.FIND_UNUSED, k))
            table.append(
                [
                    k,
                    _ms(e),
                    _ms(s),
                    _ms(f),
                    f"{f['median_ms'] / e['median_ms']:.2f}" if e and f else "-",
                    f"{e['allreduce_bytes_per_step'] / 1e6:.2f}",
                    f"{f['allreduce_bytes_per_step'] / 1e6:.2f}",
                    _ms(get.get((bw.NO_COMM, k))),
                ]
            )
        lines += [*markdown.table(TABLE_HEADER, table), ""]
    return "\n".join(lines)


def resolve_ks(cfg: ClusterBenchConfig) -> tuple[int, ...]:
    num_blocks = len(bw.split_blocks(bw.build_model(cfg.model, cfg.image_size)))
    if cfg.ks is None:
        return tuple(range(num_blocks))
    bad = sorted(k for k in set(cfg.ks) if not 0 <= k < num_blocks)
    if bad:
        raise ValueError(f"bench_cluster: --ks {bad} not accepted; accepted: 0..{num_blocks - 1} for {cfg.model}")
    return tuple(sorted(set(cfg.ks)))


def run(cfg: ClusterBenchConfig, out_dir: Path, deadline_s: float, command: str) -> list[dict]:
    start_s, load_before = time.perf_counter(), os.getloadavg()[0]
    ks = resolve_ks(cfg)
    results, csv_rows = [], []
    for nodes in cfg.nodes:
        for bandwidth in cfg.bandwidths:
            print(f"bench_cluster: {nodes} nodes, links {bandwidth}", flush=True)
            meta = measure_cluster(cfg, nodes, bandwidth, ks, deadline_s)
            rows = bench_rows.summarize(bw.combine_ranks(meta["ranks"]), meta["ranks"][0]["block_param_bytes"])
            results.append((nodes, bandwidth, rows, meta))
            csv_rows += [{"nodes": nodes, "bandwidth": bandwidth, **r} for r in rows]
    run_info = {
        "command": command,
        "wall_s": time.perf_counter() - start_s,
        "load_avg": (load_before, os.getloadavg()[0]),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_csv(csv_rows, out_dir / "bench_cluster.csv")
    splice_section(out_dir / "BENCH.md", SECTION, section(cfg, results, run_info), before_others=False)
    return csv_rows


def _write_csv(rows: list[dict], path: Path) -> None:
    import csv

    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow([bench_rows.format_value(row[c]) for c in CSV_COLUMNS])
    atomic_write_text(path, text.getvalue())


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def _words(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def preflight(prog: str, nodes, bandwidths, check: Callable[[], None]) -> int | None:
    """Refuse a grid before anything runs: every (node count, link cap) must parse, ``check()`` must
    not raise ValueError (the caller's own input checks), and this machine must be able to build an
    emulated cluster. Returns 2 after printing one line to stderr, or None when the run may start.

    Args:
        prog: the command's name, for the "not run" line.
        nodes: the node counts of the grid.
        bandwidths: the link caps of the grid.
        check: the caller's input checks; a ValueError's message is the line printed.
    """
    from freeze.pipeline.cluster import ClusterSpec
    from freeze.pipeline.cluster.net import unavailable_reason

    try:
        for n in nodes:
            for bandwidth in bandwidths:
                ClusterSpec.parse(n, bandwidth)
        check()
    except ValueError as e:  # ClusterSpecError is one
        print(f"error: {e}", file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason is not None:
        print(f"{prog}: not run: {reason}", file=sys.stderr)
        return 2
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1], argv[2])
    d = ClusterBenchConfig()
    p = argparse.ArgumentParser(prog="python -m experiments.bench_cluster", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=_ints, default=d.nodes, help="node counts, e.g. 2,4")
    p.add_argument("--bandwidths", type=_words, default=d.bandwidths, help="link caps, e.g. 1gbit,uncapped")
    p.add_argument("--ks", type=_ints, default=None, help="boundaries (default: all)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--model", default=d.model, choices=bw.MODELS)
    p.add_argument("--quick", action="store_true", help=f"k {QUICK['ks']}, {QUICK['steps']} steps: a few minutes")
    p.add_argument("--out-dir", type=Path, default=Path("report"))
    p.add_argument("--deadline-s", type=float, default=7200.0, help="per (nodes, cap): kill the agents after this")
    args = p.parse_args(argv)
    base = {**asdict(d), **(QUICK if args.quick else {})}
    for key in ("ks", "steps", "rounds", "warmup"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    cfg = ClusterBenchConfig(
        **{**base, "nodes": args.nodes, "bandwidths": args.bandwidths, "batch_size": args.batch_size}
    )
    from freeze.pipeline.cluster import ClusterError

    def check() -> None:
        if min(cfg.steps, cfg.rounds, cfg.warmup, cfg.batch_size) < 1:
            raise ValueError("bench_cluster: --steps, --rounds, --warmup and --batch-size must be >= 1")
        resolve_ks(cfg)
        spliced_sections(args.out_dir / "BENCH.md")  # a broken span now, not after the run

    refused = preflight("bench_cluster", cfg.nodes, cfg.bandwidths, check)
    if refused is not None:
        return refused
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, "-m", "experiments.bench_cluster", *argv]))
    try:
        run(cfg, args.out_dir, args.deadline_s, command)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"bench_cluster: wrote {args.out_dir / 'bench_cluster.csv'} and the cluster section of {args.out_dir / 'BENCH.md'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
