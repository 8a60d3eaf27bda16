"""A two-node SLURM cluster on this host, for the scheduler tests (tests/pipeline/test_slurm_*.py).

    python -m tests.slurm_cluster up DIR     # install (root, apt) if missing, start, wait for idle nodes
    python -m tests.slurm_cluster down DIR   # stop the daemons it started, by pid

Real daemons, not mocks: munged, slurmctld and one slurmd per node, from Debian's slurm-wlm packages
(installed with apt when they are missing and this process is root). The two nodes are named after
host names that resolve to 127.0.0.1 here (this machine's name and ``localhost``): torchrun's c10d
rendezvous resolves a node's name, and a made-up name (``n1``) makes it retry for minutes
(../shared/research/scale.md, section 2, snag 1). Everything lives under DIR except munged's socket
directory (/run/munge). Each node has one CPU, so two single-process runs fit side by side and a
request for more waits: tests submit with a deadline.

Why not systemd units: PID 1 here is not systemd, and CI must stop exactly what it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMON_BINARIES = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")
PARTITION = "debug"
START_DEADLINE_S = 60.0


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the test cluster (not root, no apt, a daemon would not start)."""


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ensure_installed() -> None:
    """Install the packages with apt when a daemon binary is missing (root only)."""
    if all(Path(b).exists() for b in DAEMON_BINARIES) and shutil.which("sbatch"):
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable("slurm-wlm is not installed and installing it needs root (apt-get)")
    if not shutil.which("apt-get"):
        raise ClusterUnavailable("slurm-wlm is not installed and this machine has no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)  # stale or empty lists
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise ClusterUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr.strip()[-300:]}")


@dataclass(frozen=True)
class LocalSlurm:
    """A started cluster: its folder (slurm.conf, logs, pid files) and node names."""

    root: Path
    nodes: tuple[str, str]

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, our driver) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}


def _config(root: Path, nodes: tuple[str, str], ports: list[int]) -> str:
    ctld_port, node_ports = ports[0], ports[1:]
    lines = [
        "ClusterName=freezeci",
        f"SlurmctldHost={nodes[0]}",
        f"SlurmctldPort={ctld_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        "SlurmUser=root",
        "SlurmdUser=root",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "SwitchType=switch/none",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2",
        "MailProg=/bin/true",
        "KillWait=10",
        "MinJobAge=600",
    ]
    for name, port in zip(nodes, node_ports):
        lines.append(f"NodeName={name} NodeAddr=127.0.0.1 Port={port} CPUs=1 RealMemory=4000 State=UNKNOWN")
    lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _start_munged(root: Path) -> None:
    """Start munged unless one runs (one per machine: its socket is /run/munge's); when this call
    started it, its pid goes beside the cluster's so that :func:`down` stops it too."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    done = subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterUnavailable(f"munged did not start: {done.stderr.strip()}")
    with contextlib.suppress(OSError):
        (root / "munged.pid").write_text(Path("/run/munge/munged.pid").read_text())


def _idle_nodes(env: dict[str, str]) -> set[str]:
    done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True)
    return {line.split()[0] for line in done.stdout.splitlines() if line.split()[1:] == ["idle"]}


def up(root: Path) -> LocalSlurm:
    """Install if needed, write slurm.conf under ``root``, start the daemons, wait for idle nodes."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("starting slurmd needs root")
    ensure_installed()
    root.mkdir(parents=True, exist_ok=True)
    nodes = (socket.gethostname(), "localhost")
    if nodes[0] == "localhost" or socket.gethostbyname(nodes[0]) != "127.0.0.1":
        raise ClusterUnavailable(f"this host's name {nodes[0]!r} does not resolve to 127.0.0.1 apart from localhost")
    for sub in ("state", "log", *(f"spool/{n}" for n in nodes)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    cluster = LocalSlurm(root, nodes)
    cluster.conf.write_text(_config(root, nodes, _free_ports(3)), encoding="utf-8")
    _start_munged(root)
    env = {**os.environ, **cluster.env()}
    for argv in (["/usr/sbin/slurmctld", "-f", str(cluster.conf)],) + tuple(
        ["/usr/sbin/slurmd", "-f", str(cluster.conf), "-N", n] for n in nodes
    ):
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            down(root)
            raise ClusterUnavailable(f"{Path(argv[0]).name} did not start: {done.stderr.strip()}")
    deadline = time.monotonic() + START_DEADLINE_S
    while _idle_nodes(env) != set(nodes):
        if time.monotonic() > deadline:
            down(root)
            raise ClusterUnavailable(f"the nodes were not idle within {START_DEADLINE_S:.0f} s (logs: {root}/log)")
        time.sleep(0.3)
    return cluster


def down(root: Path) -> None:
    """Stop the daemons whose pid files are under ``root`` (never any other), and wait for them."""
    pids = []
    for pid_file in sorted(root.glob("*.pid")):
        try:
            pids.append(int(pid_file.read_text().strip()))
        except (OSError, ValueError):
            continue
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10.0
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print("usage: python -m tests.slurm_cluster up|down DIR", file=sys.stderr)
        return 2
    root = Path(argv[1]).resolve()
    if argv[0] == "down":
        down(root)
        return 0
    try:
        cluster = up(root)
    except ClusterUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
