"""The rendezvous store of a run over several nodes, a process apart from torchrun's agents: the
process itself (freeze.pipeline.rendezvous_store), and its SLURM entry, which the batch script runs on
the job's first node (freeze.pipeline.slurm.store). The emulated cluster's launcher around it:
tests/pipeline/test_cluster.py; the batch script around it: tests/pipeline/test_slurm.py, and a
two-node run on a real SLURM cluster: tests/pipeline/test_slurm_cluster.py."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
from datetime import timedelta

import pytest
import torch

from freeze.pipeline import rendezvous_store
from freeze.pipeline.slurm import Allocation, current_allocation
from freeze.pipeline.slurm import store as slurm_store
from freeze.pipeline.slurm.allocation import rendezvous_port
from tests.processes import python_env, run_python, start_python


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _running(args: list[str], env: dict[str, str] | None = None):
    """A store process, killed on the way out if the test left it running."""
    proc = start_python(args, env=env, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def _stops_quietly_on_sigterm(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert proc.stderr.read() == b""


@pytest.mark.processes
def test_the_store_serves_until_sigterm_then_exits_cleanly():
    port = _free_port()
    with _running(["-m", "freeze.pipeline.rendezvous_store", "127.0.0.1", str(port)]) as proc:
        client = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        client.set("rendezvous", "closed")
        assert client.get("rendezvous") == b"closed"
        del client
        # A second store on the same port cannot listen: one line and exit 1, which the launcher
        # turns into a stopped job instead of agents waiting 60 s for a store that is not there.
        taken = run_python(["-m", "freeze.pipeline.rendezvous_store", "127.0.0.1", str(port)], timeout_s=60)
        assert taken.returncode == 1
        assert taken.stderr.startswith(f"error: the rendezvous store cannot listen on 127.0.0.1:{port}: ")
        assert taken.stderr.count("\n") == 1, taken.stderr
        _stops_quietly_on_sigterm(proc)


def test_the_store_refuses_bad_arguments_in_one_line(capsys):
    assert rendezvous_store.main(["10.47.0.1", "port"]) == 2
    assert capsys.readouterr().err.strip() == "usage: python -m freeze.pipeline.rendezvous_store <address> <port>"


def _job_on_a_free_port() -> Allocation:
    """A two-node job whose batch shell runs on this host, with an id that maps to a free port."""
    for job_id in range(1000, 2000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", rendezvous_port(str(job_id))))
            except OSError:
                continue
        return Allocation(str(job_id), 0, ("127.0.0.1", "localhost"), 0, store_host="127.0.0.1")
    raise RuntimeError("no free port among the rendezvous ports of jobs 1000-1999")


def _store(job: Allocation, mark: str | None) -> torch.distributed.TCPStore:
    served = torch.distributed.TCPStore("127.0.0.1", job.rendezvous_port, is_master=True, wait_for_workers=False)
    if mark is not None:
        served.set(slurm_store.JOB_KEY, mark)
    return served


def test_node_0_waits_for_its_jobs_store_and_says_in_one_line_what_answered_instead(capfd):
    job = _job_on_a_free_port()
    # nothing listens: a line after the wait, and nothing from torch's client on the way
    with pytest.raises(slurm_store.StoreUnavailable) as info:
        slurm_store.await_store(job, timeout_s=1, poll_s=0.1)
    assert str(info.value).startswith(f"no rendezvous store of this job at 127.0.0.1:{job.rendezvous_port} within 1 s")
    assert "(nothing answered)" in str(info.value) and "\n" not in str(info.value)
    assert capfd.readouterr().err == ""
    # another job's store on the port (ports are derived from job ids): refused at once, never joined
    other = _store(job, mark="999")
    with pytest.raises(slurm_store.StoreUnavailable, match=r"holds the rendezvous store of SLURM job 999, not of"):
        slurm_store.await_store(job, timeout_s=30)
    del other
    # a store that is not marked (another program's, or ours before its mark): waited for, then named
    unmarked = _store(job, mark=None)
    with pytest.raises(slurm_store.StoreUnavailable, match=r"something that is not this job's store answered"):
        slurm_store.await_store(job, timeout_s=1, poll_s=0.1)
    unmarked.set(slurm_store.JOB_KEY, job.job_id)  # its mark arrives: node 0 goes on
    slurm_store.await_store(job, timeout_s=30)
    del unmarked


@pytest.mark.processes
def test_the_batch_shells_store_is_the_one_node_0_waits_for_and_stops_on_sigterm():
    job = _job_on_a_free_port()
    env = {
        "SLURM_JOB_ID": job.job_id,
        "SLURM_JOB_NODELIST": "127.0.0.1,localhost",
        "FREEZE_RDZV_STORE_HOST": "127.0.0.1",
    }
    with _running(["-m", "freeze.pipeline.slurm.store"], env=python_env(**env)) as proc:
        slurm_store.await_store(current_allocation({**env, "SLURM_NODEID": "0"}), timeout_s=60)
        _stops_quietly_on_sigterm(proc)


def test_the_slurm_entry_runs_inside_a_job_that_names_the_stores_node(monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert slurm_store.main([]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: slurm: SLURM_JOB_ID and FREEZE_RDZV_STORE_HOST must be set") and "\n" not in line
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n0,n1")
    monkeypatch.delenv("FREEZE_RDZV_STORE_HOST", raising=False)
    assert slurm_store.main([]) == 2 and "FREEZE_RDZV_STORE_HOST must be set" in capsys.readouterr().err
    assert slurm_store.main(["x"]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m freeze.pipeline.slurm.store")
