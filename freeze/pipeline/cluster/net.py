"""Network namespaces, veth pairs, a bridge and tc: the emulated cluster's wiring.

Topology (nothing is created in the machine's own namespace, so no interface, address or route of
the host is ever touched)::

    fzc-<id>-n0 [fzc-n0] ==veth== [fzc-p0] \
    fzc-<id>-n1 [fzc-n1] ==veth== [fzc-p1] -- fzc-br (bridge)   in namespace fzc-<id>-sw
    ...

Each node's link is shaped in both directions, because a ring all-reduce sends and receives at
once and tc shapes egress only: a tbf on the node's end caps what it sends, a tbf on the bridge
port caps what it receives. Every namespace name carries :data:`PREFIX` and the cluster id; an
owner record under :data:`OWNER_DIR` names the process that created them. :func:`cleanup_stale`
removes namespaces of owners that are gone (a launcher killed with SIGKILL), and only those, so
clusters of concurrent runs never touch each other; each lives in its own namespaces, so they may
even use the same subnet.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from freeze._atomic import atomic_write_text
from freeze.pipeline.cluster.spec import ClusterSpec, NodeCpu

PREFIX = "fzc"
OWNER_DIR = Path("/run/freeze-cluster")
NETNS_DIR = Path("/run/netns")
BRIDGE = f"{PREFIX}-br"
RDZV_PORT = 29400
_NAME = re.compile(rf"^{PREFIX}-([0-9a-f]{{8}})-(sw|n\d+)$")

# tbf burst: Mininet uses 15000 B up to 1 Gbit/s. Measured here (veth + bridge, TSO/GRO left on,
# kernel HZ=250 with high-resolution timers), both directions loaded: 1 Gbit/s with 15000 B gave
# 764-801 Mbit/s of TCP payload, with 1 ms of tokens (125000 B) 954 Mbit/s (the payload line rate
# is 956: 1448 of 1514 bytes per frame); rate/HZ (tc-tbf(8), 4 ms = 500 kB) gave the same 951 but
# lets half a megabyte pass unshaped, which would flatter 1 MB messages.
_BURST_MIN_BYTES = 15000
_BURST_S = 1e-3
_QUEUE_S = 0.02  # tbf queue: 20 ms at the link rate before tail drop


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the cluster (not root, no ip/tc/unshare, no namespaces); one line."""


class ClusterError(RuntimeError):
    """A command that builds or tears down the cluster failed; one line with its stderr."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        detail = " ".join((proc.stderr or proc.stdout).split()) or f"exit code {proc.returncode}"
        raise ClusterError(f"cluster: '{' '.join(argv)}' failed: {detail}")
    return proc


def check_host() -> None:
    """Raise ClusterUnavailable with one line saying what is missing."""
    if not os.path.isdir("/proc/self/ns") or not os.path.exists("/proc/self/ns/net"):
        raise ClusterUnavailable("cluster: needs Linux network namespaces (/proc/self/ns/net is missing)")
    if os.geteuid() != 0:
        raise ClusterUnavailable("cluster: needs root (network namespaces, veth and tc); run as root")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"cluster: '{tool}' not found; install it: apt-get install {package}")


def unavailable_reason() -> str | None:
    """Why this machine cannot host a cluster (one line), or None: checks the tools and root, then
    creates and deletes one namespace (a container may forbid it even to root)."""
    try:
        check_host()
    except ClusterUnavailable as e:
        return str(e)
    probe = f"{PREFIX}-{secrets.token_hex(4)}-sw"  # no owner record: stale at once if left behind
    proc = _run(["ip", "netns", "add", probe], check=False)
    if proc.returncode != 0:
        return f"cluster: cannot create network namespaces here ({' '.join(proc.stderr.split())})"
    _run(["ip", "netns", "delete", probe], check=False)
    return None


def check_subnet_free(subnet: ipaddress.IPv4Network) -> None:
    """Refuse a subnet that overlaps a route of this machine (the default route excepted). The
    cluster's addresses live only in its own namespaces, but a subnet the host also reaches would
    make addresses in logs and results ambiguous, and a later bridge to the host unsafe."""
    routes = json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]")
    for route in routes:
        dst = route.get("dst", "default")
        if dst == "default" or route.get("type") == "multicast":
            continue
        try:
            net = ipaddress.ip_network(dst, strict=False)
        except ValueError:
            continue
        if net.version == 4 and net.overlaps(subnet):
            raise ClusterUnavailable(
                f"cluster.subnet: {subnet} overlaps this machine's route {dst} (dev {route.get('dev', '?')}); "
                "choose another private subnet, e.g. cluster.subnet=10.199.0.0/24"
            )


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat), None if gone.
    Pid plus start time names a process uniquely even when pids are reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _owner_alive(record: dict) -> bool:
    pid = record.get("pid")
    return isinstance(pid, int) and process_start_ticks(pid) == record.get("start_ticks")


def list_namespaces() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def namespace_pids(namespace: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _kill_and_delete(namespace: str) -> None:
    """Kill every process in our namespace (our own agents and workers), then delete it."""
    for attempt in range(50):
        pids = namespace_pids(namespace)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02 * (attempt + 1) ** 0.5)
    if (NETNS_DIR / namespace).exists():
        try:
            _run(["ip", "netns", "delete", namespace])
        except ClusterError:
            # Two launchers starting at once both clean up stale clusters: the other one may delete
            # the namespace between the check above and this delete. Gone is what was wanted.
            if (NETNS_DIR / namespace).exists():
                raise


def cleanup_stale(log=None) -> list[str]:
    """Delete namespaces (and owner records) of clusters whose owner process is gone. Touches only
    names matching ``fzc-<8 hex>-(sw|n<i>)``; returns the namespaces deleted."""
    by_id: dict[str, list[str]] = {}
    for name in list_namespaces():
        match = _NAME.match(name)
        if match:
            by_id.setdefault(match.group(1), []).append(name)
    records = {p.stem: p for p in OWNER_DIR.glob("*.json")} if OWNER_DIR.is_dir() else {}
    deleted = []
    for cluster_id in sorted(set(by_id) | set(records)):
        record = {}
        if cluster_id in records:
            try:
                record = json.loads(records[cluster_id].read_text())
            except (OSError, ValueError):
                record = {}
        if record and _owner_alive(record):
            continue
        # Node namespaces first: the switch goes last, so a half-removed cluster never keeps
        # nodes whose links lead nowhere.
        for name in sorted(by_id.get(cluster_id, []), key=lambda n: n.endswith("-sw")):
            _kill_and_delete(name)
            deleted.append(name)
        if cluster_id in records:
            records[cluster_id].unlink(missing_ok=True)
    if deleted and log:
        log(f"cluster: removed {len(deleted)} stale namespace(s) of dead launchers: {', '.join(deleted)}")
    return deleted


@dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    ifname: str  # the node's end of its veth pair (inside its namespace)
    port: str  # the bridge's end (inside the switch namespace)
    address: str
    cpu: NodeCpu


@dataclass(frozen=True)
class LinkCounters:
    """Bytes through one node's link, read from the kernel's interface statistics."""

    tx_bytes: int
    rx_bytes: int
    lo_tx_bytes: int  # the node's loopback: traffic that did NOT cross the link
    qdisc_drops: int  # tbf drops on both ends of the link


def _burst_bytes(bits_per_s: float) -> int:
    return max(_BURST_MIN_BYTES, int(bits_per_s / 8 * _BURST_S))


def _shape(namespace: str, dev: str, spec: ClusterSpec) -> None:
    """tbf (rate) at the root, netem (half the one-way node-to-node delay) below it."""
    tc = ["tc", "-n", namespace, "qdisc", "add", "dev", dev]
    parent = ["root"]
    if spec.bandwidth_bits_per_s is not None:
        rate = int(spec.bandwidth_bits_per_s)
        limit = max(2 * _burst_bytes(rate), int(rate / 8 * _QUEUE_S))
        _run([*tc, "root", "handle", "1:", "tbf", "rate", f"{rate}bit", "burst", str(_burst_bytes(rate)),
              "limit", str(limit)])  # fmt: skip
        parent = ["parent", "1:1"]
    if spec.latency_s > 0:
        # Each packet crosses two shaped ends (sender's uplink, receiver's downlink): half each.
        delay_us = max(1, round(spec.latency_s / 2 * 1e6))
        rate = spec.bandwidth_bits_per_s or 10e9
        limit = max(1000, int(2 * rate / 8 * spec.latency_s / 1500))  # > bandwidth-delay product in packets
        _run([*tc, *parent, "handle", "10:", "netem", "delay", f"{delay_us}us", "limit", str(limit)])


class Cluster:
    """``spec.nodes`` network namespaces joined by a bridge over shaped veth pairs.

    Use as a context manager (``with Cluster(spec) as cluster:``): ``__enter__`` removes stale
    clusters, then builds this one; ``__exit__`` kills what still runs inside and deletes every
    namespace, on normal exit, on an exception and on KeyboardInterrupt.
    """

    def __init__(self, spec: ClusterSpec, cpus: list[NodeCpu], log=print):
        if len(cpus) != spec.nodes:
            raise ValueError(f"cluster: {len(cpus)} CPU plans for {spec.nodes} nodes")
        self.spec = spec
        self.id = secrets.token_hex(4)
        self.log = log
        self.switch = f"{PREFIX}-{self.id}-sw"
        self.nodes = [
            Node(i, f"{PREFIX}-{self.id}-n{i}", f"{PREFIX}-n{i}", f"{PREFIX}-p{i}", addr, cpus[i])
            for i, addr in enumerate(spec.addresses())
        ]
        self._record = OWNER_DIR / f"{self.id}.json"
        self._up = False

    @property
    def namespaces(self) -> list[str]:
        return [n.namespace for n in self.nodes] + [self.switch]

    def _write_owner_record(self) -> None:
        # Before the first namespace exists: a namespace without a live owner is always stale.
        OWNER_DIR.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid()), "namespaces": self.namespaces}
        atomic_write_text(self._record, json.dumps(record) + "\n")

    def up(self) -> Cluster:
        check_host()
        check_subnet_free(self.spec.subnet)
        cleanup_stale(self.log)
        self._write_owner_record()
        self._up = True
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        proc = _run(["ip", "netns", "add", self.switch], check=False)
        if proc.returncode != 0:
            detail = " ".join(proc.stderr.split())
            raise ClusterUnavailable(f"cluster: cannot create network namespaces here ({detail})")
        if self.spec.latency_s > 0 and not netem_available(self.switch):
            raise ClusterUnavailable(
                "cluster.latency: needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM); use latency 0"
            )
        sw = ["ip", "-n", self.switch]
        _run([*sw, "link", "add", BRIDGE, "type", "bridge"])
        _run([*sw, "link", "set", BRIDGE, "up"])
        prefixlen = self.spec.subnet.prefixlen
        for node in self.nodes:
            ns = ["ip", "-n", node.namespace]
            _run(["ip", "netns", "add", node.namespace])
            # Both ends are created directly inside our namespaces, never in the host's.
            _run(["ip", "link", "add", node.ifname, "netns", node.namespace, "type", "veth",
                  "peer", "name", node.port, "netns", self.switch])  # fmt: skip
            _run([*sw, "link", "set", node.port, "master", BRIDGE])
            _run([*sw, "link", "set", node.port, "up"])
            _run([*ns, "link", "set", "lo", "up"])
            _run([*ns, "addr", "add", f"{node.address}/{prefixlen}", "dev", node.ifname])
            _run([*ns, "link", "set", node.ifname, "up"])
            _shape(node.namespace, node.ifname, self.spec)  # what the node sends
            _shape(self.switch, node.port, self.spec)  # what the node receives

    def down(self) -> None:
        if not self._up:
            return
        for name in self.namespaces:
            try:
                _kill_and_delete(name)
            except ClusterError as e:  # go on: leave as little behind as possible
                self.log(str(e))
        self._record.unlink(missing_ok=True)
        self._up = False

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def exec_argv(self, node: Node, argv: list[str]) -> list[str]:
        """``argv`` run inside ``node``'s network namespace (and with its own /sys view)."""
        return ["ip", "netns", "exec", node.namespace, *argv]

    def counters(self) -> list[LinkCounters]:
        """Per node: bytes its link sent and received, its loopback bytes, tbf drops on the link."""
        out = []
        for node in self.nodes:
            link = _link_stats(node.namespace, node.ifname)
            lo = _link_stats(node.namespace, "lo")
            drops = _qdisc_drops(node.namespace, node.ifname) + _qdisc_drops(self.switch, node.port)
            out.append(LinkCounters(link["tx"]["bytes"], link["rx"]["bytes"], lo["tx"]["bytes"], drops))
        return out

    def describe(self) -> str:
        cap = "uncapped" if self.spec.bandwidth_bits_per_s is None else self.spec.bandwidth
        lines = [
            f"cluster {PREFIX}-{self.id}: {self.spec.nodes} nodes on {self.spec.subnet}, links {cap} each way, "
            f"one-way delay {self.spec.latency}"
        ]
        for n in self.nodes:
            shared = " (shared with other nodes)" if n.cpu.shared else ""
            lines.append(
                f"  node {n.index}: {n.namespace} {n.address} dev {n.ifname}, cores {list(n.cpu.cores)}{shared}, "
                f"{n.cpu.threads_per_worker} thread(s) per worker"
            )
        return "\n".join(lines)


def _link_stats(namespace: str, dev: str) -> dict:
    data = json.loads(_run(["ip", "-n", namespace, "-s", "-j", "link", "show", "dev", dev]).stdout)
    return data[0]["stats64"]


def _qdisc_drops(namespace: str, dev: str) -> int:
    data = json.loads(_run(["tc", "-n", namespace, "-s", "-j", "qdisc", "show", "dev", dev]).stdout or "[]")
    return sum(int(q.get("drops", 0)) for q in data)


def netem_available(namespace: str) -> bool:
    """Whether this kernel has the netem qdisc (tried on the loopback of one of our namespaces)."""
    proc = _run(["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us"], check=False)
    if proc.returncode == 0:
        _run(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"], check=False)
    return proc.returncode == 0
