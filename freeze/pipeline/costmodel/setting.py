"""Which cost model describes a configured run: its processes on the cores (the profile's layout),
the link fitted from the probes at its node count and cap, and the fitted CPU share of communication.
Shared by the study's prediction stage (freeze.pipeline.study.predict) and the pricing a ``horizon``
run trains with (freeze.pipeline.pricing), so both predict a run alike.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from freeze.pipeline.cluster import plan_cpus
from freeze.pipeline.cluster.spec import parse_rate, run_cores
from freeze.pipeline.config import Config
from freeze.pipeline.costmodel.calibration import CALIBRATION_FILE, CalibrationError, load_calibration
from freeze.pipeline.costmodel.link import Link, link_from_probes, scaled_link
from freeze.pipeline.costmodel.model import ClusterModel
from freeze.pipeline.costmodel.profiler import NodeCores

# The cost model's validation (python -m experiments.validate_costmodel): its probes at 2-4 nodes and
# its fitted comm_cpu_share, so runs are predicted with the configuration BENCH.md validates.
PROBE_DIR = Path("report/costmodel")
DEFAULT_COMM_CPU_SHARE = next(f.default for f in dataclasses.fields(ClusterModel) if f.name == "comm_cpu_share")
MIB = 1 << 20


def process_layout(config: Config) -> list[NodeCores]:
    """The cores and threads of each of the run's processes (freeze.pipeline.study.predict's docstring: profile).

    Args:
        config: the run's resolved config.
    """
    processes = config.cluster.nodes or config.dist.nproc
    # 0: derived, which is plan_cpus' share of the cores
    return one_process_per_node(processes, config.dist.threads_per_worker)


def one_process_per_node(processes: int, threads: int = 0) -> list[NodeCores]:
    """``processes`` profiled processes laid on the cores as the emulated cluster lays its nodes
    (plan_cpus, one worker each); ``threads`` 0 takes plan_cpus' threads per worker.

    Args:
        processes: node (or worker) count.
        threads: torch threads per process; 0 for plan_cpus' share of the cores.
    """
    plan = plan_cpus(processes, 1, run_cores())  # inside a cluster's node too, the whole cluster's cores
    return [NodeCores(tuple(c.cores), threads or c.threads_per_worker) for c in plan]


def layout_name(layout: list[NodeCores]) -> str:
    """e.g. "c0t1-c1t1": process 1 on core 0 with 1 thread, process 2 on core 1 with 1 thread."""
    return "-".join(f"c{'.'.join(map(str, node.cores))}t{node.threads}" for node in layout)


def probe_files(config: Config, probe_dir: Path) -> tuple[Path, ...]:
    """The probes the run's link is fitted from: uncapped, plus the run's cap on a capped cluster;
    none for a single worker, which communicates with nobody."""
    nodes = config.cluster.nodes or config.dist.nproc
    if nodes < 2:
        return ()
    files = (probe_dir / f"probe-{nodes}xuncapped.json",)
    if config.cluster.nodes and parse_rate(config.cluster.bandwidth) is not None:
        files += (probe_dir / f"probe-{nodes}x{config.cluster.bandwidth.strip().lower()}.json",)
    return files


def run_link(probes: tuple[Path, ...], config: Config) -> Link:
    """The run's link from its probe files (:func:`probe_files`), scaled to its cap.

    Raises:
        LinkError, OSError: a probe file is missing or unreadable.
    """
    if not probes:
        return Link(alpha_s=0.0, bandwidth_bytes_per_s=None, gamma_s_per_byte=0.0)  # one worker: never used
    base, efficiency = link_from_probes(probes)
    cap = parse_rate(config.cluster.bandwidth) if config.cluster.nodes else None
    return scaled_link(base, cap, efficiency)


def comm_cpu_share(probe_dir: Path) -> tuple[float, str]:
    """The fitted comm_cpu_share in probe_dir's calibration file (assumption 3), and a note saying
    where it came from; ClusterModel's default when the file is absent or unusable."""
    path = probe_dir / CALIBRATION_FILE
    if not path.exists():
        return DEFAULT_COMM_CPU_SHARE, f"comm_cpu_share {DEFAULT_COMM_CPU_SHARE} (ClusterModel's default: no {path})"
    try:
        fit = load_calibration(path)
    except CalibrationError as e:
        return DEFAULT_COMM_CPU_SHARE, f"comm_cpu_share {DEFAULT_COMM_CPU_SHARE} (ClusterModel's default: {e})"
    where = ", ".join(f"{key} {value}" for key, value in fit.fitted_at.items())
    return fit.comm_cpu_share, f"comm_cpu_share {fit.comm_cpu_share} (fitted in {path} at {where})"


def run_cluster(config: Config, link: Link, comm_cpu_share: float) -> ClusterModel:
    """The ClusterModel of a configured run: its node (or loopback worker) count and DDP bucket size."""
    return ClusterModel(
        nodes=config.cluster.nodes or config.dist.nproc,
        link=link,
        comm_cpu_share=comm_cpu_share,
        bucket_cap_bytes=int(config.freeze.bucket_cap_mb * MIB),
    )
