"""The rendezvous store of a run over several nodes of a SLURM job, hosted by the job's batch shell.

    python -m freeze.pipeline.slurm.store     # the batch script runs it before srun (script.py)

The batch shell exports its node's name (``FREEZE_RDZV_STORE_HOST``), starts this store, then
``srun`` (one torchrun agent per node, each a client of the store, ``is_host=0``: freeze.pipeline.run),
and stops the store once ``srun`` has returned, that is after every node's agent has exited. The
batch shell is the one process of a job that sees every node's end; hosted by node 0's agent
instead, the store went away whenever that agent exited first and the other nodes printed torch's
"failed to shutdown the rendezvous" with a C++ stack (:mod:`freeze.pipeline.rendezvous_store`).

The store marks itself with the job's id, and node 0 waits for that mark before its agent starts
(:func:`await_store`): the port is derived from the job id, so another process may hold it, and an
agent that met another job's store would fail when that job ended.
"""

from __future__ import annotations

import socket
import sys
import time
from datetime import timedelta

from freeze.pipeline.rendezvous_store import serve
from freeze.pipeline.slurm.allocation import STORE_HOST_ENV, Allocation, SlurmEnvError, current_allocation

JOB_KEY = "freeze.slurm.store.job"  # the store's mark: the id of the job whose batch shell hosts it

# How long node 0 waits for the store: it imports torch first, which a shared file system may make slow.
STORE_WAIT_S = 120.0


class StoreUnavailable(RuntimeError):
    """This job's rendezvous store did not answer; the message is one line saying what answered."""


def await_store(allocation: Allocation, timeout_s: float = STORE_WAIT_S, poll_s: float = 0.5) -> None:
    """Return once the store of this job answers at its endpoint; StoreUnavailable when another
    process holds the port or nothing answers within ``timeout_s``. Polls in short steps, quietly
    (torch's client logs every failed connect) and so that SIGTERM stops the wait at once."""
    host, port = allocation.rendezvous_host, allocation.rendezvous_port
    deadline = time.monotonic() + timeout_s
    answered = False
    while True:
        mark = _mark_at(host, port)
        if mark == allocation.job_id:
            return
        if mark:
            raise StoreUnavailable(
                f"{host}:{port} holds the rendezvous store of SLURM job {mark}, not of this job "
                f"({allocation.job_id}): its port is derived from the job id; submit again to get another id"
            )
        answered = answered or mark is not None
        if time.monotonic() > deadline:
            what = "something that is not this job's store answered" if answered else "nothing answered"
            raise StoreUnavailable(
                f"no rendezvous store of this job at {host}:{port} within {timeout_s:.0f} s ({what}): the batch "
                f"shell starts it (python -m freeze.pipeline.slurm.store); its log says why it did not listen"
            )
        time.sleep(poll_s)


def _mark_at(host: str, port: int) -> str | None:
    """The job id a store at ``host:port`` is marked with; "" for a listener without the mark (yet);
    None when nothing listens."""
    try:
        socket.create_connection((host, port), timeout=2.0).close()
    except OSError:
        return None
    from torch.distributed import TCPStore

    try:
        client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
    except RuntimeError:  # listens, but is no TCPStore
        return ""
    return client.get(JOB_KEY).decode() if client.check([JOB_KEY]) else ""


def main(argv: list[str] | None = None) -> int:
    if sys.argv[1:] if argv is None else argv:
        print("usage: python -m freeze.pipeline.slurm.store   (in a SLURM job's batch script)", file=sys.stderr)
        return 2
    try:
        allocation = current_allocation()
    except SlurmEnvError as e:
        print(f"error: slurm: {e}", file=sys.stderr)
        return 2
    if allocation is None or allocation.store_host is None:
        print(
            f"error: slurm: SLURM_JOB_ID and {STORE_HOST_ENV} must be set: the store runs in a SLURM job's batch "
            f"script, which names its node",
            file=sys.stderr,
        )
        return 2
    return serve(allocation.store_host, allocation.rendezvous_port, marks={JOB_KEY: allocation.job_id})


if __name__ == "__main__":
    sys.exit(main())
