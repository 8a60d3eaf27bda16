"""The emulated cluster (freeze.pipeline.cluster): settings and CPU split everywhere; real namespaces,
shaped links and torchrun agents where this machine allows them (root, iproute2), else skipped with
the reason printed (pytest -rs, and the summary line from conftest.py)."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from freeze.pipeline.cluster import launch, net, probe
from freeze.pipeline.cluster.launch import agent_argv, node_env, store_argv
from freeze.pipeline.cluster.net import unavailable_reason
from freeze.pipeline.cluster.spec import (
    CLUSTER_CORES_ENV,
    ClusterSpec,
    ClusterSpecError,
    parse_delay,
    parse_rate,
    plan_cpus,
    planned_cores,
    run_cores,
)
from freeze.pipeline.config import ConfigError, load_config
from tests.pipeline.tiny_runs import TINY_RUN
from tests.processes import REPO, python_env, start_python

SMOKE = REPO / "experiments" / "configs" / "smoke.toml"
# 2 nodes x 1 worker, 2 steps per epoch, a policy evaluation every step: autofreeze decides in-run.
TINY = TINY_RUN
CLUSTER = ["cluster.nodes=2", "cluster.bandwidth=1gbit"]
DEADLINE_S = 240

REASON = unavailable_reason()


def needs_cluster(test):
    """Real namespaces and shaped links: the test starts processes (ip, tc, the launcher and its
    agents), and is skipped where this machine cannot build them."""
    unavailable = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")
    return pytest.mark.processes(unavailable(test))


# ------------------------------------------------------------------------------ settings (no root)
@pytest.mark.parametrize(
    "text, bits", [("1gbit", 1e9), ("100mbit", 1e8), ("2.5Gbit", 2.5e9), ("uncapped", None), ("64kbit", 64e3)]
)
def test_rates_are_tc_units(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["1gb", "1000", "fast", "0gbit", "-1mbit", "1kbit"])
def test_bad_rate_is_one_line_naming_the_key(text):
    with pytest.raises(ClusterSpecError, match=r"^cluster\.bandwidth: .*accepted") as err:
        parse_rate(text)
    assert "\n" not in str(err.value)


def test_delays():
    assert (
        parse_delay("0") == 0.0
        and parse_delay("0.2ms") == pytest.approx(2e-4)
        and parse_delay("50us") == pytest.approx(5e-5)
    )
    with pytest.raises(ClusterSpecError, match="cluster.latency"):
        parse_delay("3")


@pytest.mark.parametrize(
    "override, key",
    [
        ("cluster.nodes=1", "cluster.nodes"),
        ("cluster.bandwidth=fast", "cluster.bandwidth"),
        ("cluster.latency=1", "cluster.latency"),
        ("cluster.subnet=10.0.0.1/24", "cluster.subnet"),
        ("cluster.subnet=fd00::/64", "cluster.subnet"),
    ],
)
def test_cluster_section_is_validated_like_every_section(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        load_config(SMOKE, ["cluster.nodes=2", override])


def test_default_is_no_cluster():
    assert load_config(SMOKE).cluster.nodes == 0


def test_subnet_must_hold_every_node():
    with pytest.raises(ClusterSpecError, match="2 host addresses, 3 nodes"):
        ClusterSpec.parse(3, "1gbit", "0", "10.9.0.0/30")
    assert ClusterSpec.parse(3, "1gbit", "0", "10.9.0.0/24").addresses() == ["10.9.0.1", "10.9.0.2", "10.9.0.3"]


def test_cpu_plan_disjoint_when_cores_suffice_shared_otherwise():
    two = plan_cpus(2, 1, [0, 1])
    assert [c.cores for c in two] == [(0,), (1,)] and all(c.threads_per_worker == 1 and not c.shared for c in two)
    assert [c.threads_per_worker for c in plan_cpus(2, 1, [0, 1, 2, 3])] == [2, 2]
    assert [c.threads_per_worker for c in plan_cpus(2, 2, [0, 1, 2, 3])] == [1, 1]
    four = plan_cpus(4, 1, [0, 1])
    assert [c.cores for c in four] == [(0,), (1,), (0,), (1,)] and all(c.shared for c in four)


@pytest.mark.parametrize(
    ("nodes", "cores"), [(2, [0, 1]), (2, [0, 1, 2]), (3, [0, 1, 2, 3]), (4, [0, 1]), (2, [2, 5, 7, 9])]
)
def test_every_node_is_told_the_cores_the_whole_cluster_was_planned_over(nodes, cores, monkeypatch):
    """A node's processes are pinned to their own slice, so inside one the cores no longer say how the
    run was laid out; the launcher names them, and the same plan is made again from them (what a
    horizon run's pricing checks its cost profile's layout against: tests/pipeline/test_pricing.py)."""
    plan = plan_cpus(nodes, 1, cores)
    cluster = net.Cluster(ClusterSpec.parse(nodes, "1gbit"), plan, log=lambda _: None)
    named = planned_cores([node.cpu for node in cluster.nodes])
    for node in cluster.nodes:  # inside each node, pinned to its own cores, with the launcher's environment
        monkeypatch.setattr("freeze.pipeline.cluster.spec.available_cores", lambda node=node: list(node.cpu.cores))
        monkeypatch.setenv(CLUSTER_CORES_ENV, node_env(node, named, {})[CLUSTER_CORES_ENV])
        assert plan_cpus(nodes, 1, run_cores()) == plan


def test_cores_named_badly_in_the_environment_are_one_line(monkeypatch):
    monkeypatch.setenv(CLUSTER_CORES_ENV, "0,one")
    with pytest.raises(ClusterSpecError, match=f"^{CLUSTER_CORES_ENV}='0,one': accepted: "):
        run_cores()


def test_no_agent_hosts_the_store_and_each_names_its_own_address():
    """Every namespace has the machine's hostname: by name each agent would think it hosts the store,
    so is_host=0 says none does (the store is its own process on node 0), and --local-addr tells the
    agents apart."""
    spec = ClusterSpec.parse(3, "1gbit")
    cluster = net.Cluster(spec, plan_cpus(3, 1, [0, 1]), log=lambda _: None)
    argvs = [agent_argv(cluster, node, ["-m", "x"]) for node in cluster.nodes]
    for node, argv in zip(cluster.nodes, argvs):
        assert "--rdzv-conf=is_host=0" in argv
        assert f"--local-addr={node.address}" in argv
        assert "--rdzv-endpoint=10.47.0.1:29400" in argv and "--rdzv-backend=c10d" in argv
        assert argv[:4] == ["unshare", "--pid", "--fork", "--kill-child"] and node.namespace in argv
    store = store_argv(cluster)
    assert store[:4] == ["ip", "netns", "exec", cluster.nodes[0].namespace]
    assert store[-3:] == ["freeze.pipeline.rendezvous_store", "10.47.0.1", "29400"]


class _FakeJob:
    """run_job's processes, faked: the store runs until stopped; agent i exits with ``exits[i]`` on
    its first poll, or runs until stopped when that is None. ``events`` is what happened, in order."""

    def __init__(self, monkeypatch, exits: list[int | None]):
        self.events: list[str] = []
        job = self

        class Process:
            def __init__(self, argv, **kwargs):
                self.name = "store" if "freeze.pipeline.rendezvous_store" in argv else f"agent{len(job.events)}"
                self.exit = None if self.name == "store" else exits[len(job.events) - 1]
                self.returncode = None
                job.events.append(f"start {self.name}")

            def poll(self):
                if self.returncode is None and self.exit is not None:
                    self.returncode = self.exit
                    job.events.append(f"exit {self.name}")
                return self.returncode

        def stop(procs):
            for p in procs:
                if p.poll() is None:
                    p.returncode = -signal.SIGTERM
                    job.events.append(f"stop {p.name}")

        monkeypatch.setattr(launch.subprocess, "Popen", Process)
        monkeypatch.setattr(launch, "_stop", stop)


def test_the_store_starts_before_the_agents_and_stops_after_the_last(monkeypatch):
    """An agent hosting the store ended the rendezvous for the others when it exited first ("failed
    to shutdown the rendezvous" and a C++ stack after a good run): the store's process is started
    first and stopped only once every agent has exited or been stopped, on every way out."""
    spec = ClusterSpec.parse(2, "1gbit")
    cluster = net.Cluster(spec, plan_cpus(2, 1, [0, 1]), log=lambda _: None)
    monkeypatch.setattr(cluster, "counters", lambda: [])

    ended = _FakeJob(monkeypatch, exits=[1, 0])  # one agent fails, the other ends
    result = launch.run_job(cluster, ["-m", "x"])
    assert ended.events == ["start store", "start agent1", "start agent2", "exit agent1", "exit agent2", "stop store"]
    assert result.node_returncodes == (1, 0) and result.returncode == 1

    hung = _FakeJob(monkeypatch, exits=[0, None])  # one agent never ends: the deadline stops it
    with pytest.raises(TimeoutError):
        launch.run_job(cluster, ["-m", "x"], deadline_s=0)
    assert hung.events == ["start store", "start agent1", "start agent2", "exit agent1", "stop agent2", "stop store"]


def test_a_namespace_deleted_by_a_concurrent_cleanup_is_not_an_error(tmp_path, monkeypatch):
    """Two launchers (or two test runs) starting at once both remove stale clusters: when the other
    deletes a namespace between this one's existence check and its `ip netns delete`, the delete
    fails with "No such file" and the namespace is gone, as wanted. A delete that fails while the
    namespace is still there is still an error."""
    monkeypatch.setattr(net, "NETNS_DIR", tmp_path)
    monkeypatch.setattr(net, "namespace_pids", lambda name: [])
    (tmp_path / "fzc-00000000-n1").touch()

    def other_cleanup_wins(argv, check=True):
        (tmp_path / argv[-1]).unlink()  # the concurrent clean-up, just before ours
        raise net.ClusterError(f"cluster: '{' '.join(argv)}' failed: Cannot remove namespace file")

    monkeypatch.setattr(net, "_run", other_cleanup_wins)
    net._kill_and_delete("fzc-00000000-n1")

    (tmp_path / "fzc-00000000-n2").touch()

    def delete_fails(argv, check=True):
        raise net.ClusterError(f"cluster: '{' '.join(argv)}' failed: Device or resource busy")

    monkeypatch.setattr(net, "_run", delete_fails)
    with pytest.raises(net.ClusterError, match="busy"):
        net._kill_and_delete("fzc-00000000-n2")


def test_without_root_or_tools_one_line_says_which(monkeypatch, capsys):
    from experiments.cluster import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["cleanup"]) == 2
    assert (
        capsys.readouterr().err.strip() == "error: cluster: needs root (network namespaces, veth and tc); run as root"
    )
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(net.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    assert main(["cleanup"]) == 2
    assert capsys.readouterr().err.strip() == "error: cluster: 'tc' not found; install it: apt-get install iproute2"


# ------------------------------------------------------------------------------ real namespaces
def _our_namespaces(cluster_id: str) -> list[str]:
    return [n for n in net.list_namespaces() if n.startswith(f"{net.PREFIX}-{cluster_id}-")]


def _cluster_id_of(pid: int, deadline: float) -> str:
    """The id of the cluster launcher ``pid`` created, from its owner record."""
    while time.monotonic() < deadline:
        for path in net.OWNER_DIR.glob("*.json") if net.OWNER_DIR.is_dir() else []:
            try:
                if json.loads(path.read_text())["pid"] == pid:
                    return path.stem
            except (OSError, ValueError, KeyError):
                continue
        time.sleep(0.05)
    raise AssertionError(f"launcher {pid} wrote no owner record in time")


def _launch(args: list[str], tmp_path: Path) -> subprocess.Popen:
    # The launcher's temp files in tmp_path: one this test SIGKILLs cannot remove its own.
    (tmp_path / "tmp").mkdir(exist_ok=True)
    with open(tmp_path / "launcher.log", "ab") as log:  # the child keeps its own copy of the fd
        return start_python(
            ["-m", "experiments.cluster", *args],
            env=python_env(TMPDIR=str(tmp_path / "tmp")),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # As from a terminal: a suite started in the background of a shell without job control
            # (make test &) inherits SIGINT ignored, and Python then installs no Ctrl-C handler.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def _run_args(tmp_path: Path, name: str) -> list[str]:
    return [
        "--nodes",
        "2",
        "--bandwidth",
        "1gbit",
        "--",
        "--config",
        str(SMOKE),
        f"run.out_dir={tmp_path / 'runs'}",
        f"run.name={name}",
        f"data.root={tmp_path / 'data'}",
        "run.keep_checkpoint=true",  # these tests compare the final resume state (Freezer decisions)
        *TINY,
    ]


def _wait(proc: subprocess.Popen, tmp_path: Path, deadline: float) -> str:
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher tears its cluster down on SIGTERM
            proc.wait(timeout=30)
    return (tmp_path / "launcher.log").read_text(errors="replace")


def _final(run_dir: Path) -> tuple[dict, list[dict], dict, list[dict]]:
    ckpt = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    links = [json.loads(line) for line in (run_dir / "cluster_links.jsonl").read_text().splitlines()]
    return ckpt, metrics, manifest, links


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("cluster")
    proc = _launch(_run_args(tmp_path, "straight"), tmp_path)
    cluster_id = _cluster_id_of(proc.pid, time.monotonic() + 60)
    out = _wait(proc, tmp_path, time.monotonic() + DEADLINE_S)
    assert proc.returncode == 0, out[-4000:]
    return tmp_path, cluster_id, out, _final(tmp_path / "runs" / "smoke" / "straight")


@needs_cluster
def test_two_node_run_crosses_the_shaped_links_and_leaves_nothing_behind(cluster_run):
    tmp_path, cluster_id, out, (ckpt, metrics, manifest, links) = cluster_run
    assert manifest["status"] == "complete" and manifest["world_size"] == 2
    assert "node 1: " in out and "10.47.0.2" in out  # the rendezvous joined both node addresses
    assert _our_namespaces(cluster_id) == [] and not (net.OWNER_DIR / f"{cluster_id}.json").exists()
    (record,) = links
    assert record["returncode"] == 0 and [link["cores"] for link in record["links"]] == [[0], [1]]
    # Ring all-reduce over 2 ranks: each rank sends the bucket once. The Freezer's constructor also
    # broadcasts parameters and buffers from rank 0 once: one model's worth more, sent by one node.
    allreduce = sum(m["allreduce_bytes"] for m in metrics)
    model_bytes = sum(manifest["block_param_bytes"])
    sent = sorted(link["tx_bytes"] for link in record["links"])
    receiver_ratio = sent[0] / allreduce
    sender_ratio = sent[1] / (allreduce + model_bytes)
    print(f"link bytes / engine bytes: {receiver_ratio:.4f} (all-reduce only), {sender_ratio:.4f} (+ broadcast)")
    # Overhead: headers (veth counts one per GSO segment), ACKs, gloo/store messages, eval reductions.
    assert 1.0 <= receiver_ratio < 1.05 and 1.0 <= sender_ratio < 1.05
    # Loopback inside the nodes stays tiny: gloo's traffic crossed the links.
    assert all(link["lo_tx_bytes"] < 0.01 * allreduce for link in record["links"])


def _is_agent(pid: int) -> bool:
    """Whether ``pid`` is a node's torchrun agent (ours, or torchrun's own module), not a worker."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    return b"freeze.pipeline.cluster.agent" in cmdline or b"torch.distributed.run" in cmdline


def _sigkill_node1_worker_once(proc: subprocess.Popen, tmp_path: Path, deadline: float, ready, late: str) -> None:
    """Once ``ready()`` holds, SIGKILL node 1's one worker (not its agent), as the out-of-memory
    killer would; the launcher must still be running until then. Any failure stops the launcher."""
    try:
        cluster_id = _cluster_id_of(proc.pid, deadline)
        while not ready():
            assert proc.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, late
            time.sleep(0.05)
        workers = [pid for pid in net.namespace_pids(f"{net.PREFIX}-{cluster_id}-n1") if not _is_agent(pid)]
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        raise


@needs_cluster
def test_killed_worker_on_one_node_restarts_and_resumes_to_the_same_result(cluster_run):
    """torchrun --max-restarts 1 on every node: node 1's worker is SIGKILLed after the first
    checkpoint; every node restarts its workers, they resume, and the result is bit-identical."""
    tmp_path, _, _, (ref_ckpt, ref_metrics, _, _) = cluster_run
    proc = _launch(_run_args(tmp_path, "killed") + ["--max-restarts", "1"], tmp_path)
    deadline = time.monotonic() + DEADLINE_S
    ckpt_path = tmp_path / "runs" / "smoke" / "killed" / "checkpoint.pt"
    _sigkill_node1_worker_once(proc, tmp_path, deadline, ckpt_path.exists, "no checkpoint within the deadline")
    out = _wait(proc, tmp_path, deadline)
    assert proc.returncode == 0, out[-4000:]
    assert "resumed" in out
    ckpt, metrics, manifest, _ = _final(tmp_path / "runs" / "smoke" / "killed")
    assert manifest["status"] == "complete"
    assert [m["epoch"] for m in metrics] == [0, 1]
    assert [m["boundary"] for m in metrics] == [m["boundary"] for m in ref_metrics]
    assert ckpt["freezer"]["decisions"] == ref_ckpt["freezer"]["decisions"]
    for name, ref in ref_ckpt["model"].items():
        assert torch.equal(ckpt["model"][name], ref), name


@needs_cluster
def test_sigkilled_launcher_leaves_no_process_and_next_start_removes_its_namespaces(tmp_path):
    proc, cluster_id = _probe_until_running(tmp_path, time.monotonic() + 120)
    os.killpg(proc.pid, signal.SIGKILL)  # launcher only: it leads its session, agents lead theirs
    proc.wait()
    names = _our_namespaces(cluster_id)
    assert len(names) == 3  # two nodes and the switch outlive a SIGKILL...
    end = time.monotonic() + 20
    while any(net.namespace_pids(n) for n in names) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(net.namespace_pids(n) for n in names)  # ...but no agent or worker does
    net.cleanup_stale()  # (a concurrent test run's clean-up may have removed them first: same code)
    assert _our_namespaces(cluster_id) == []
    assert not (net.OWNER_DIR / f"{cluster_id}.json").exists()


def _probe_until_running(tmp_path: Path, deadline: float) -> tuple[subprocess.Popen, str]:
    """A probe launcher that runs until killed, once its node 0 has the store, an agent and a worker."""
    proc = _launch(
        ["probe", "--nodes", "2", "--bandwidth", "uncapped", "--out", str(tmp_path / "p.json"), "--repeats", "100000"],
        tmp_path,
    )
    try:
        cluster_id = _cluster_id_of(proc.pid, deadline)
        while len(net.namespace_pids(f"{net.PREFIX}-{cluster_id}-n0")) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "launcher.log").read_text()
            time.sleep(0.1)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc, cluster_id


@needs_cluster
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_launcher_removes_its_cluster(tmp_path, sig):
    proc, cluster_id = _probe_until_running(tmp_path, time.monotonic() + 120)
    os.kill(proc.pid, sig)  # Ctrl-C reaches the launcher as SIGINT
    try:
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert _our_namespaces(cluster_id) == [] and not (net.OWNER_DIR / f"{cluster_id}.json").exists()
    log = (tmp_path / "launcher.log").read_text()
    assert "interrupted; agents stopped and namespaces removed" in log
    # Was: 64 lines of the agents' SignalException tracebacks before that line.
    assert "Traceback" not in log and "SignalException" not in log, log


@needs_cluster
def test_stale_cleanup_spares_a_live_cluster():
    spec = ClusterSpec.parse(2, "100mbit")
    with net.Cluster(spec, plan_cpus(2, 1), log=lambda _: None) as cluster:
        net.cleanup_stale()
        assert sorted(_our_namespaces(cluster.id)) == sorted(cluster.namespaces)
        qdiscs = subprocess.run(
            ["tc", "-n", cluster.nodes[0].namespace, "qdisc", "show", "dev", cluster.nodes[0].ifname],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in qdiscs and "rate 100Mbit" in qdiscs
    assert _our_namespaces(cluster.id) == []


@needs_cluster
def test_subnet_overlapping_a_route_of_this_machine_is_refused():
    spec = ClusterSpec.parse(2, "1gbit", "0", "127.0.0.0/24")
    with pytest.raises(net.ClusterUnavailable, match=r"^cluster\.subnet: 127\.0\.0\.0/24 overlaps"):
        net.check_subnet_free(spec.subnet)


@needs_cluster
def test_latency_is_netem_where_the_kernel_has_it_else_refused_in_one_line():
    spec = ClusterSpec.parse(2, "1gbit", "0.2ms")
    cluster = net.Cluster(spec, plan_cpus(2, 1), log=lambda _: None)
    try:
        cluster.up()
    except net.ClusterUnavailable as e:  # this machine's kernel: CONFIG_NET_SCH_NETEM unset
        assert str(e).startswith("cluster.latency: needs the netem qdisc") and "\n" not in str(e)
        assert _our_namespaces(cluster.id) == []  # nothing half-built is left
        return
    try:  # half the one-way delay on each shaped end, below the tbf
        for ns, dev in ((cluster.nodes[0].namespace, cluster.nodes[0].ifname), (cluster.switch, cluster.nodes[0].port)):
            qdiscs = subprocess.run(
                ["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True
            ).stdout
            assert "tbf" in qdiscs and "netem" in qdiscs and "delay 100us" in qdiscs
    finally:
        cluster.down()


@needs_cluster
def test_stale_cleanup_touches_only_its_own_name_pattern():
    """A namespace without the fzc-<8 hex>-(sw|n<i>) pattern is never removed, even ownerless."""
    other = f"freeze-test-{os.getpid()}-{time.monotonic_ns() % 10**6}"  # made by this test, removed below
    subprocess.run(["ip", "netns", "add", other], check=True)
    try:
        net.cleanup_stale()
        assert other in net.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", other], check=True)


def test_probe_tables_bytes():
    """The probe's two tables, pinned as they were when written by hand (before freeze.pipeline.markdown)."""
    size = {"bytes": 2**20, "median_s": 0.0123, "link_bits_per_s": 4.2e8, "ratio_to_cap": 0.42}
    size |= {"iface_over_expected": 1.0123, "lo_tx_bytes_per_rank": [10, 20]}
    result = {"nodes": 2, "bandwidth": "1gbit", "bandwidth_bits_per_s": 1e9, "latency": "0ms", "load": False}
    result |= {"latency_probe": {"seconds": [1e-4, 3e-4, 2e-4], "median_s": 2e-4}, "host": {"load_avg_1min": [1.25]}}
    result["sizes"] = [size]
    assert probe.table(result).splitlines()[1:] == [
        "| MiB | median s | link Mbit/s | of cap | iface bytes / ring bytes | loopback bytes |",
        "|---|---|---|---|---|---|",
        "| 1 | 0.0123 | 420 | 42.0% | 1.0123 | 20 |",
    ]
    assert probe.compare_table([result]) == (
        "| nodes | cap | node cores | load avg | tiny all-reduce min / median | 1 MiB |\n"
        "|---|---|---|---|---|---|\n"
        "| 2 | 1gbit | idle | 1.2 | 100 / 200 us | 420 (42%) |"
    )


@needs_cluster
def test_a_sigkilled_worker_on_one_node_fails_the_run_naming_the_node_and_the_signal(tmp_path):
    """Without restarts: node 1's worker is SIGKILLed (the out-of-memory killer). The run is failed,
    the manifest names the node and the signal (the launcher saw only the agent's exit code 1)."""
    proc = _launch(_run_args(tmp_path, "oom"), tmp_path)
    deadline = time.monotonic() + DEADLINE_S
    metrics = tmp_path / "runs" / "smoke" / "oom" / "metrics.jsonl"

    def has_epoch() -> bool:
        return metrics.exists() and bool(metrics.read_text().strip())

    _sigkill_node1_worker_once(proc, tmp_path, deadline, has_epoch, "no epoch within the deadline")
    out = _wait(proc, tmp_path, deadline)
    assert proc.returncode == 1, out[-4000:]
    manifest = json.loads((tmp_path / "runs" / "smoke" / "oom" / "manifest.json").read_text())
    assert manifest["status"] == "failed", manifest
    assert manifest["error"].startswith("node at 10.") and "signal SIGKILL" in manifest["error"], manifest
    assert "Traceback" not in out, out[-4000:]
