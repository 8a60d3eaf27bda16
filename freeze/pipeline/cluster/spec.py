"""What an emulated cluster is: node count, link cap, delay, subnet; and how nodes share the cores.

Pure parsing and arithmetic (no system calls besides reading the CPU affinity), so the config can
validate a ``[cluster]`` section without touching the network.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass

from freeze.checks import is_int

# tc(8) units: decimal multiples of bits per second ("1gbit" = 1e9 bit/s).
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
UNCAPPED = "uncapped"
RATE_ACCEPTED = f"a rate such as 100mbit, 1gbit, 10gbit (units: {', '.join(_RATE_UNITS)}) or '{UNCAPPED}'"
TIME_ACCEPTED = "a delay such as 0.2ms, 50us or 0 (units: us, ms, s)"
DEFAULT_SUBNET = "10.47.0.0/24"  # RFC 1918; refused at start-up if it overlaps a route of this machine


class ClusterSpecError(ValueError):
    """A cluster setting that is not accepted; the message is one line naming the setting."""


def parse_rate(text: str, name: str = "cluster.bandwidth") -> float | None:
    """Bits per second of a tc-style rate ("1gbit"), or None for "uncapped"."""
    value = text.strip().lower()
    if value == UNCAPPED:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]+)", value)
    if not match or match.group(2) not in _RATE_UNITS or float(match.group(1)) <= 0:
        raise ClusterSpecError(f"{name}: {text!r} is not accepted; accepted: {RATE_ACCEPTED}")
    bits_per_s = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if bits_per_s < 8000:  # below one 1500-byte frame per 1.5 s nothing useful runs
        raise ClusterSpecError(f"{name}: {text!r} is below 8kbit; accepted: {RATE_ACCEPTED}")
    return bits_per_s


def parse_delay(text: str, name: str = "cluster.latency") -> float:
    """Seconds of a delay such as "0.2ms"; "0" is no delay."""
    value = text.strip().lower()
    if value in ("0", ""):
        return 0.0
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(us|ms|s)", value)
    if not match:
        raise ClusterSpecError(f"{name}: {text!r} is not accepted; accepted: {TIME_ACCEPTED}")
    seconds = float(match.group(1)) * _TIME_UNITS[match.group(2)]
    if seconds > 10:
        raise ClusterSpecError(f"{name}: {text!r} is more than 10 s; accepted: {TIME_ACCEPTED}")
    return seconds


def parse_subnet(text: str, nodes: int, name: str = "cluster.subnet") -> ipaddress.IPv4Network:
    """An IPv4 network with room for ``nodes`` host addresses."""
    try:
        net = ipaddress.ip_network(text.strip(), strict=True)
    except ValueError:
        raise ClusterSpecError(
            f"{name}: {text!r} is not accepted; accepted: an IPv4 network such as {DEFAULT_SUBNET} (host bits zero)"
        ) from None
    if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen > 30:
        raise ClusterSpecError(f"{name}: {text!r} is not accepted; accepted: an IPv4 network of /30 or larger")
    if net.num_addresses - 2 < nodes:
        raise ClusterSpecError(
            f"{name}: {text} has {net.num_addresses - 2} host addresses, {nodes} nodes need one each"
        )
    return net


@dataclass(frozen=True)
class ClusterSpec:
    """A validated cluster: ``nodes`` namespaces, each link capped at ``bandwidth_bits_per_s`` in
    both directions (None = uncapped) with ``latency_s`` of one-way delay between two nodes."""

    nodes: int
    bandwidth_bits_per_s: float | None
    latency_s: float
    subnet: ipaddress.IPv4Network
    bandwidth: str  # as given, for logs and result files
    latency: str

    @classmethod
    def parse(cls, nodes: int, bandwidth: str, latency: str = "0", subnet: str = DEFAULT_SUBNET) -> ClusterSpec:
        if not is_int(nodes) or nodes < 2:
            raise ClusterSpecError(f"cluster.nodes: expected an integer >= 2 for a cluster, got {nodes!r}")
        return cls(
            nodes,
            parse_rate(bandwidth),
            parse_delay(latency),
            parse_subnet(subnet, nodes),
            bandwidth.strip().lower(),
            latency.strip().lower() or "0",
        )

    def addresses(self) -> list[str]:
        hosts = self.subnet.hosts()
        return [str(next(hosts)) for _ in range(self.nodes)]


# Set by the launcher in every node's environment: the cores the cluster's plan was laid over. A
# node's processes are pinned to their own slice, so inside one ``available_cores`` no longer says
# how the whole run was laid out (what a cost profile must have been measured in).
CLUSTER_CORES_ENV = "FREEZE_CLUSTER_CORES"


def available_cores() -> list[int]:
    """The cores this process may run on (taskset/cgroup aware), in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class NodeCpu:
    cores: tuple[int, ...]
    threads_per_worker: int
    shared: bool  # the node's cores are also another node's


def plan_cpus(nodes: int, procs_per_node: int, cores: list[int] | None = None) -> list[NodeCpu]:
    """Disjoint cores per node when there are enough (node i gets the i-th equal slice, threads =
    slice // workers per node, at least 1); with more nodes than cores, node i gets core i mod cores
    and shares it with the nodes that wrap onto it (1 thread each). torchrun sets OMP_NUM_THREADS=1
    only with several workers per node, so without a plan one worker per node would take every
    core and the nodes would fight over them."""
    cores = list(cores if cores is not None else available_cores())
    if nodes <= len(cores):
        per_node = len(cores) // nodes
        slices = [tuple(cores[i * per_node : (i + 1) * per_node]) for i in range(nodes)]
        return [NodeCpu(s, max(1, len(s) // procs_per_node), False) for s in slices]
    return [NodeCpu((cores[i % len(cores)],), 1, True) for i in range(nodes)]


def run_cores() -> list[int]:
    """The cores the run's processes were planned over: inside an emulated cluster's node, the
    cluster's (its launcher names them in :data:`CLUSTER_CORES_ENV`), else this process's."""
    named = os.environ.get(CLUSTER_CORES_ENV, "")
    if not named:
        return available_cores()
    # Only the form is checked here: inside a node the cores named are not this process's to run on,
    # and a well-formed foreign list is named by the pricing's layout check (freeze.pipeline.pricing).
    accepted = "distinct core numbers separated by commas, as the cluster launcher sets it"
    parts = named.split(",")
    if not all(c.isdigit() for c in parts) or len(set(parts)) != len(parts):
        raise ClusterSpecError(f"{CLUSTER_CORES_ENV}={named!r}: accepted: {accepted}")
    return [int(c) for c in parts]


def planned_cores(plan: list[NodeCpu]) -> list[int]:
    """The cores a plan from :func:`plan_cpus` uses; the same plan is made again from them."""
    return sorted({core for node in plan for core in node.cores})
