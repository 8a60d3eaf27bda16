"""A training run (or any torchrun entry) on an emulated cluster, from a ``[cluster]`` config section.

``experiments.run``, sweeps and the study call :func:`run_on_cluster` when ``cluster.nodes >= 2``;
it builds the cluster, runs one agent per node, appends what the links carried to
``<run dir>/cluster_links.jsonl`` (one line per launch) and removes the cluster again.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from freeze.pipeline.cluster.launch import JobResult, run_job, sigterm_as_interrupt
from freeze.pipeline.cluster.net import Cluster, ClusterError, ClusterUnavailable
from freeze.pipeline.cluster.spec import ClusterSpec, ClusterSpecError, plan_cpus

LINKS_FILE = "cluster_links.jsonl"


def spec_from_config(cluster_cfg) -> ClusterSpec:
    """``cluster_cfg``: the config's ClusterConfig section (nodes >= 2)."""
    return ClusterSpec.parse(cluster_cfg.nodes, cluster_cfg.bandwidth, cluster_cfg.latency, cluster_cfg.subnet)


def links_record(cluster: Cluster, result: JobResult, nproc_per_node: int) -> dict:
    """What one launch did on the links: per node, bytes sent/received and loopback bytes."""
    spec = cluster.spec
    return {
        "cluster_id": cluster.id,
        "nodes": spec.nodes,
        "procs_per_node": nproc_per_node,
        "bandwidth": spec.bandwidth,
        "bandwidth_bits_per_s": spec.bandwidth_bits_per_s,
        "latency_s": spec.latency_s,
        "returncode": result.returncode,
        "wall_s": result.wall_s,
        "links": [
            {
                "node": node.index,
                "address": node.address,
                "cores": list(node.cpu.cores),
                "threads_per_worker": node.cpu.threads_per_worker,
                "tx_bytes": c.tx_bytes,
                "rx_bytes": c.rx_bytes,
                "lo_tx_bytes": c.lo_tx_bytes,
                "qdisc_drops": c.qdisc_drops,
            }
            for node, c in zip(cluster.nodes, result.counters)
        ],
    }


def describe_links(record: dict) -> str:
    parts = [
        f"node {link['node']} sent {link['tx_bytes'] / 1e6:.1f} MB, received {link['rx_bytes'] / 1e6:.1f} MB "
        f"(loopback {link['lo_tx_bytes'] / 1e6:.2f} MB, {link['qdisc_drops']} drops)"
        for link in record["links"]
    ]
    return f"cluster: links in {record['wall_s']:.1f} s: " + "; ".join(parts)


def append_links_record(run_dir: Path, record: dict) -> None:
    """Append one line to ``run_dir/cluster_links.jsonl``, atomically (the whole file is rewritten
    through a temp file: a crash leaves the previous version)."""
    from freeze.pipeline.runs import atomic_write_text  # deferred: runs imports torch

    if not run_dir.is_dir():
        return  # the run failed before creating its directory: nothing to attach the record to
    path = run_dir / LINKS_FILE
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    atomic_write_text(path, old + json.dumps(record) + "\n")


def run_on_cluster(
    cluster_cfg,
    entry: list[str],
    nproc_per_node: int = 1,
    max_restarts: int = 0,
    run_dir: Path | None = None,
    log=print,
) -> int:
    """Build the cluster, run ``entry`` (torchrun's target, e.g. ``["-m", "freeze.pipeline.run",
    "--config", path, ...]``) with one agent per node, tear the cluster down; return the exit code.

    Args:
        cluster_cfg: the ``[cluster]`` section (nodes, bandwidth, latency, subnet).
        entry: what follows torchrun's options on every node.
        nproc_per_node: workers per node (``dist.nproc``).
        max_restarts: torchrun's ``--max-restarts`` on every node.
        run_dir: where to append the links record, if the run created it.
        log: one-line messages.

    Returns 2 with one line on stderr when this machine cannot host the cluster (not root, no
    ip/tc, no namespaces) or a setting is refused; 1 when building it failed; else the job's code.
    """

    def work() -> int:
        spec = spec_from_config(cluster_cfg)
        with sigterm_as_interrupt(), Cluster(spec, plan_cpus(spec.nodes, nproc_per_node), log) as cluster:
            log(cluster.describe())
            result = run_job(cluster, entry, nproc_per_node, max_restarts)
        record = links_record(cluster, result, nproc_per_node)
        log(describe_links(record))
        if run_dir is not None:
            append_links_record(Path(run_dir), record)
        return result.returncode

    return exit_code(work, "cluster")


def exit_code(work: Callable[[], int], name: str) -> int:
    """``work()``'s exit code, with the cluster's failures turned into one line on stderr: 2 when
    this machine cannot host the cluster or a setting or output path is refused, 1 when building
    it failed, 130 when interrupted (Ctrl-C or SIGTERM; the cluster is gone by then)."""
    try:
        return work()
    except (ClusterUnavailable, ClusterSpecError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted; agents stopped and namespaces removed", file=sys.stderr)
        return 130


def run_config_entry(config_path: str | os.PathLike, resume: bool) -> list[str]:
    """torchrun's target for one ``freeze.pipeline.run`` run of a resolved config file."""
    return ["-m", "freeze.pipeline.run", "--config", str(config_path), *(["--resume"] if resume else [])]
