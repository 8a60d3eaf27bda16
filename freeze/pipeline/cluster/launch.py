"""One torchrun agent per node of an emulated cluster, with a c10d rendezvous on node 0's address.

The rendezvous store runs first, in a process of its own in node 0's namespace
(:mod:`freeze.pipeline.rendezvous_store`), and stops after the last agent: an agent hosting it would
end the rendezvous for the others whenever it exited first. Each agent runs ``unshare --pid --fork
--kill-child ip netns exec <node> python -m freeze.pipeline.cluster.agent --nnodes=N
--rdzv-backend=c10d --rdzv-endpoint=<node 0>:29400 --rdzv-conf=is_host=0 --local-addr=<node
address> ...`` (torchrun's own agent, :mod:`freeze.pipeline.cluster.agent`, ending in one line
instead of torchrun's tracebacks):

- ``ip netns exec`` does not change the hostname, so every node has the same one and the c10d
  backend would guess by name that every node hosts the store: ``is_host=0`` says none does, and
  ``--local-addr`` makes each agent publish its own address instead of the shared hostname.
- ``GLOO_SOCKET_IFNAME`` binds gloo to the node's link (by default it resolves the hostname).
- CPU: the agent and its workers are pinned to the node's cores (:func:`plan_cpus`) and
  ``OMP_NUM_THREADS`` is the node's thread budget (torchrun sets it only for several workers).
- Clean-up without help from the launcher: the agent is PID 1 of its own PID namespace, and
  ``unshare`` gets SIGKILL when the launcher dies (PR_SET_PDEATHSIG) and passes it on
  (``--kill-child``); when PID 1 of a PID namespace dies the kernel kills every process in it,
  so no worker outlives a launcher killed with SIGKILL. The store, which has no children, gets
  the same SIGKILL directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from freeze.pipeline.cluster.net import RDZV_PORT, Cluster, ClusterError, LinkCounters, Node
from freeze.pipeline.cluster.spec import CLUSTER_CORES_ENV, planned_cores

_PR_SET_PDEATHSIG = 1
_FAILURE_GRACE_S = 60.0  # after one node fails, how long the others get to notice and exit
_TERM_GRACE_S = 5.0


def agent_argv(
    cluster: Cluster,
    node: Node,
    entry: list[str],
    nproc_per_node: int = 1,
    max_restarts: int = 0,
) -> list[str]:
    """The command that runs node ``node``'s torchrun agent; ``entry`` is what follows torchrun's
    own options (e.g. ``["-m", "freeze.pipeline.run", "--config", path]``)."""
    head = cluster.nodes[0]
    torchrun = [
        sys.executable,
        "-m",
        "freeze.pipeline.cluster.agent",  # torchrun's agent, ending in one line (no tracebacks)
        f"--nnodes={cluster.spec.nodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={head.address}:{RDZV_PORT}",
        f"--rdzv-id={cluster.id}",
        "--rdzv-conf=is_host=0",  # the store is its own process (store_argv)
        f"--local-addr={node.address}",
        f"--max-restarts={max_restarts}",
        *entry,
    ]
    return ["unshare", "--pid", "--fork", "--kill-child", *cluster.exec_argv(node, torchrun)]


def store_argv(cluster: Cluster) -> list[str]:
    """The command that hosts the cluster's rendezvous store on node 0's address, in its namespace."""
    head = cluster.nodes[0]
    store = [sys.executable, "-m", "freeze.pipeline.rendezvous_store", head.address, str(RDZV_PORT)]
    return cluster.exec_argv(head, store)


def node_env(node: Node, cluster_cores: list[int], base: dict | None = None) -> dict:
    """The environment of a node's agent and workers; ``cluster_cores``: the cores of the whole
    cluster's plan (:func:`planned_cores`), which a pinned node cannot see for itself."""
    env = dict(os.environ if base is None else base)
    env.update(
        GLOO_SOCKET_IFNAME=node.ifname,
        OMP_NUM_THREADS=str(node.cpu.threads_per_worker),
        # the cores the run was laid out over, from which a horizon run's pricing lays out the layout
        # its cost profile must have been measured in
        **{CLUSTER_CORES_ENV: ",".join(map(str, cluster_cores))},
        PYTHONUNBUFFERED="1",
        # A fresh store per rendezvous round, hosted by the rank-0 worker. With torchrun's shared
        # agent store, workers of a restarted round could not meet across nodes (seen here): the
        # node whose worker failed counts a restart, the others only see a membership change,
        # which torchrun does not count, so TORCHELASTIC_RESTART_COUNT differs between nodes and
        # with it the per-attempt key prefix of freeze.pipeline.distributed.
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    return env


def _child_setup(cores: tuple[int, ...]):
    launcher_pid = os.getpid()

    def setup() -> None:
        os.sched_setaffinity(0, cores)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher_pid:  # the launcher died before prctl: nobody will send the signal
            os._exit(1)

    return setup


@dataclass(frozen=True)
class JobResult:
    returncode: int  # 0 when every agent succeeded, else the first failing agent's code
    node_returncodes: tuple[int, ...]
    wall_s: float
    counters: tuple[LinkCounters, ...]  # per node, read after the agents exited


def _stop(procs: list[subprocess.Popen]) -> None:
    for sig, grace in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, _TERM_GRACE_S)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)  # each agent leads its own session
        end = time.monotonic() + grace
        while any(p.poll() is None for p in alive) and time.monotonic() < end:
            time.sleep(0.05)


def run_job(
    cluster: Cluster,
    entry: list[str],
    nproc_per_node: int = 1,
    max_restarts: int = 0,
    deadline_s: float | None = None,
    stdout=None,
    stderr=None,
    env: dict | None = None,
) -> JobResult:
    """Start the rendezvous store and one agent per node, wait for all agents, stop the store, return
    their exit codes and link counters.

    A node that fails gives the others :data:`_FAILURE_GRACE_S` to exit (gloo notices a dead peer's
    closed sockets at once); after that, or after ``deadline_s``, every agent is killed.
    """
    start_s = time.perf_counter()
    cluster_cores = planned_cores([node.cpu for node in cluster.nodes])

    def start_on(node: Node, argv: list[str]) -> subprocess.Popen:
        # its own session (the launcher stops it with killpg), pinned to the node, dying with the launcher
        return subprocess.Popen(
            argv,
            env=node_env(node, cluster_cores, env),
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_child_setup(node.cpu.cores),
        )

    store: subprocess.Popen | None = None
    procs: list[subprocess.Popen] = []
    try:  # the store started inside it: a Ctrl-C just after its start still stops it
        store = start_on(cluster.nodes[0], store_argv(cluster))
        for node in cluster.nodes:
            procs.append(start_on(node, agent_argv(cluster, node, entry, nproc_per_node, max_restarts)))
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        failed_at = None
        while any(p.poll() is None for p in procs):
            if store.poll() is not None:  # it said why in one line; the agents would wait 60 s
                raise ClusterError(f"cluster: the rendezvous store exited with code {store.returncode}")
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if deadline is not None and now > deadline:
                raise TimeoutError(f"cluster: the job did not finish within {deadline_s:.0f} s")
            if failed_at is not None and now - failed_at > _FAILURE_GRACE_S:
                break
            time.sleep(0.1)
    finally:
        try:
            _stop(procs)
        finally:  # after the agents (the last may still be closing the rendezvous), even on a 2nd Ctrl-C
            _stop([store] if store is not None else [])
    codes = tuple(p.returncode if p.returncode is not None else -signal.SIGKILL for p in procs)
    first_bad = next((c for c in codes if c != 0), 0)
    return JobResult(first_bad, codes, time.perf_counter() - start_s, tuple(cluster.counters()))


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt, so `kill <launcher>` cleans up like Ctrl-C does."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
