"""Link probe: gloo all-reduce of 1-64 MiB between the nodes (the path DDP's buckets take), plus a
tiny-message latency probe, with the interface byte counters read around each size.

    python -m experiments.cluster probe --nodes 2 --bandwidth 1gbit --out runs/probe.json

Result file (``format: freeze-cluster-probe/1``; the cost model fits ring all-reduce alpha,
bandwidth and gamma from it)::

    nodes, procs_per_node, world_size        one worker per node
    bandwidth, bandwidth_bits_per_s          the cap as given and in bit/s (null: uncapped)
    latency, latency_s                       the one-way delay setting
    load                                     true: a busy process ran on every node's cores
    host                                     cpu, cores, load_avg_1min [before, after], torch
    latency_probe                            {bytes, seconds: [...], median_s}
    sizes: [{bytes, repeats,
             seconds: [...],                 each repeat's all-reduce time (slowest rank), s
             median_s,
             link_bits_per_s,                2(N-1)/N * bytes * 8 / median_s (what each link carried)
             ratio_to_cap,                   link_bits_per_s / cap (null when uncapped)
             expected_tx_bytes_per_rank,     2(N-1)/N * bytes: what a ring all-reduce sends
             iface_tx_bytes_per_rank: [...], link tx counter delta per all-reduce, per rank
             iface_over_expected,            mean over ranks: protocol overhead (>= 1)
             lo_tx_bytes_per_rank: [...]}]   loopback delta per all-reduce (should be ~0)

Each timed all-reduce starts after a barrier; its time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from freeze._atomic import atomic_write_text
from freeze.pipeline import markdown

# The probe file's format, owned by its writer; the cost model (freeze.pipeline.costmodel.link) reads it.
PROBE_FORMAT = "freeze-cluster-probe/1"
DEFAULT_SIZES_MIB = (1, 2, 4, 8, 16, 32, 64)
LATENCY_BYTES = 4
LATENCY_REPEATS = 50


def _ring_bytes_per_rank(size_bytes: int, world_size: int) -> float:
    return 2 * (world_size - 1) / world_size * size_bytes


def _iface_bytes(dev: str) -> int:
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


def _timed_allreduces(tensor, repeats: int, warmup: int, dev: str) -> dict:
    import torch.distributed as dist

    for _ in range(warmup):
        dist.all_reduce(tensor)
    dist.barrier()
    tx0, lo0 = _iface_bytes(dev), _iface_bytes("lo")
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        seconds.append(time.perf_counter() - start)
    # A rank's all-reduce returns once it has received everything; its own last bytes may still sit
    # in its socket. Once every rank reached the barrier they have left it.
    dist.barrier()
    tx1, lo1 = _iface_bytes(dev), _iface_bytes("lo")
    return {"seconds": seconds, "tx_per_op": (tx1 - tx0) / repeats, "lo_per_op": (lo1 - lo0) / repeats}


def worker_main(argv: list[str] | None = None) -> int:
    """One rank under torchrun (one per node): measure, gather on rank 0, rank 0 writes ``--out``."""
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes-mib", required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--load", action="store_true")
    args = parser.parse_args(argv)
    dev = os.environ["GLOO_SOCKET_IFNAME"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    busy = None
    if args.load:  # compute on the node's own cores, as a backward pass would be while DDP sends
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        tiny = torch.ones(LATENCY_BYTES // 4)
        measured = {"latency": _timed_allreduces(tiny, LATENCY_REPEATS, 5, dev), "sizes": []}
        for mib in (float(m) for m in args.sizes_mib.split(",")):
            tensor = torch.ones(int(mib * 2**20) // 4)
            m = _timed_allreduces(tensor, args.repeats, 1, dev)
            measured["sizes"].append({"bytes": tensor.numel() * 4, **m})
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(measured, gathered, dst=0)
        if dist.get_rank() == 0:
            atomic_write_text(args.out, json.dumps(gathered))
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
        dist.destroy_process_group()
    return 0


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def summarize(ranks: list[dict], spec, load: bool, host: dict) -> dict:
    """The result file's content from every rank's measurements (rank order)."""
    world = len(ranks)
    latency = [max(r["latency"]["seconds"][i] for r in ranks) for i in range(len(ranks[0]["latency"]["seconds"]))]
    sizes = []
    for i, first in enumerate(ranks[0]["sizes"]):
        seconds = [max(r["sizes"][i]["seconds"][j] for r in ranks) for j in range(len(first["seconds"]))]
        median_s = _median(seconds)
        expected = _ring_bytes_per_rank(first["bytes"], world)
        link = expected * 8 / median_s
        tx = [r["sizes"][i]["tx_per_op"] for r in ranks]
        sizes.append(
            {
                "bytes": first["bytes"],
                "repeats": len(seconds),
                "seconds": seconds,
                "median_s": median_s,
                "link_bits_per_s": link,
                "ratio_to_cap": None if spec.bandwidth_bits_per_s is None else link / spec.bandwidth_bits_per_s,
                "expected_tx_bytes_per_rank": expected,
                "iface_tx_bytes_per_rank": tx,
                "iface_over_expected": sum(tx) / len(tx) / expected,
                "lo_tx_bytes_per_rank": [r["sizes"][i]["lo_per_op"] for r in ranks],
            }
        )
    return {
        "format": PROBE_FORMAT,
        "nodes": spec.nodes,
        "procs_per_node": 1,
        "world_size": world,
        "bandwidth": spec.bandwidth,
        "bandwidth_bits_per_s": spec.bandwidth_bits_per_s,
        "latency": spec.latency,
        "latency_s": spec.latency_s,
        "load": load,
        "backend": "gloo",
        "dtype": "float32",
        "host": host,
        "latency_probe": {"bytes": LATENCY_BYTES, "seconds": latency, "median_s": _median(latency)},
        "sizes": sizes,
    }


def table(result: dict) -> str:
    cap = result["bandwidth_bits_per_s"]
    lines = [
        f"probe: {result['nodes']} nodes, links {result['bandwidth']}, delay {result['latency']}, "
        f"{'with' if result['load'] else 'without'} CPU load on the nodes; tiny all-reduce "
        f"{result['latency_probe']['median_s'] * 1e6:.0f} us median, {min(result['latency_probe']['seconds']) * 1e6:.0f} "
        f"us min (of {len(result['latency_probe']['seconds'])}); load average {result['host']['load_avg_1min'][0]:.2f}",
    ]
    header = ("MiB", "median s", "link Mbit/s", "of cap", "iface bytes / ring bytes", "loopback bytes")
    rows = [
        (
            f"{s['bytes'] / 2**20:g}",
            f"{s['median_s']:.4f}",
            f"{s['link_bits_per_s'] / 1e6:.0f}",
            "-" if cap is None else f"{s['ratio_to_cap']:.1%}",
            f"{s['iface_over_expected']:.4f}",
            f"{max(s['lo_tx_bytes_per_rank']):.0f}",
        )
        for s in result["sizes"]
    ]
    return "\n".join(lines + markdown.table(header, rows))


def compare_table(results: list[dict]) -> str:
    """One markdown row per probe result: link rate per size (share of the cap) and the tiny
    all-reduce's minimum and median."""
    sizes = sorted({s["bytes"] for r in results for s in r["sizes"]})
    header = ["nodes", "cap", "node cores", "load avg", "tiny all-reduce min / median"]
    header += [f"{b / 2**20:g} MiB" for b in sizes]
    rows = []
    for r in results:
        by_size = {s["bytes"]: s for s in r["sizes"]}
        cells = []
        for b in sizes:
            s = by_size.get(b)
            if s is None:
                cells.append("-")
                continue
            share = "" if s["ratio_to_cap"] is None else f" ({s['ratio_to_cap']:.0%})"
            cells.append(f"{s['link_bits_per_s'] / 1e6:.0f}{share}")
        tiny = r["latency_probe"]["seconds"]
        rows.append(
            [
                r["nodes"],
                r["bandwidth"],
                "busy" if r["load"] else "idle",
                f"{r['host']['load_avg_1min'][0]:.1f}",
                f"{min(tiny) * 1e6:.0f} / {_median(tiny) * 1e6:.0f} us",
                *cells,
            ]
        )
    return "\n".join(markdown.table(header, rows))


def run_probe(
    spec,
    out: Path,
    sizes_mib: tuple[float, ...] = DEFAULT_SIZES_MIB,
    repeats: int = 5,
    load: bool = False,
    deadline_s: float = 1800.0,
    log=print,
) -> dict:
    """Build the cluster, probe its links, write ``out`` (JSON, atomically), return the result.

    Args:
        spec: a ClusterSpec (nodes, cap, delay, subnet).
        out: the result file; an existing file is refused.
        sizes_mib: all-reduce sizes in MiB (float32 tensors).
        repeats: timed all-reduces per size (after one untimed).
        load: run a busy process on each node's cores while probing.
        deadline_s: kill the agents after this long.
        log: one-line messages.
    """
    from freeze.pipeline.cluster.launch import run_job, sigterm_as_interrupt
    from freeze.pipeline.cluster.net import Cluster, ClusterError
    from freeze.pipeline.cluster.spec import plan_cpus

    if out.exists():
        raise FileExistsError(f"probe: {out} exists; results are never overwritten: choose another --out")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fzc-probe-") as tmp:
        raw = Path(tmp) / "ranks.json"
        entry = ["-m", __name__, "--out", str(raw), "--sizes-mib", ",".join(f"{m:g}" for m in sizes_mib)]
        entry += ["--repeats", str(repeats)] + (["--load"] if load else [])
        with sigterm_as_interrupt(), Cluster(spec, plan_cpus(spec.nodes, 1), log) as cluster:
            log(cluster.describe())
            result = run_job(cluster, entry, 1, 0, deadline_s)
        if result.returncode != 0 or not raw.exists():
            raise ClusterError(f"probe: the probe workers failed (exit codes {list(result.node_returncodes)})")
        ranks = json.loads(raw.read_text())
    host = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "load_avg_1min": [load_before, os.getloadavg()[0]],
        "torch": _torch_version(),
        "kernel": platform.release(),
        "qdisc_drops": [c.qdisc_drops for c in result.counters],
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    summary = summarize(ranks, spec, load, host)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(summary, indent=1) + "\n")
    return summary


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    sys.exit(worker_main())
