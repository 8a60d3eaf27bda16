"""The rendezvous store of a run over several nodes, in a process of its own that outlives the agents.

    python -m freeze.pipeline.rendezvous_store <address> <port>

With the store inside node 0's torchrun agent (torchrun's ``is_host``), whichever agent ended first
decided whether the others could close the rendezvous: when node 0's agent exited before node 1's
had closed it, node 1 printed "failed to shutdown the rendezvous" and a C++ stack of 30 frames from
TCPStore (a known race of torchrun with a hosting agent; seen once here in about 300 cluster runs,
harmless, and read by a user as a failed run). So the store runs apart, started before the agents
(every agent ``is_host=0``, a client) and stopped only after the last agent has exited, by whatever
sees them all end: the emulated cluster's launcher (:func:`freeze.pipeline.cluster.launch.run_job`)
or a SLURM job's batch shell once ``srun`` returns (:mod:`freeze.pipeline.slurm.store`).
Runs until SIGTERM or SIGINT and prints nothing, or exits 1 with one line when it cannot listen.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping


def serve(address: str, port: int, marks: Mapping[str, str] | None = None) -> int:
    """Host a TCPStore on ``address:port`` until SIGTERM or SIGINT arrives; 0, or 1 with one line
    when the store cannot be hosted there. ``marks``: keys set once it listens, by which a client
    tells this store from another process on the same port."""
    stop = (signal.SIGTERM, signal.SIGINT)
    # Blocked before torch is imported and the store's threads exist, so every thread inherits the
    # mask and a stop sent while it starts waits for sigwait instead of killing it half-started.
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    from torch.distributed import TCPStore

    try:
        store = TCPStore(address, port, is_master=True, wait_for_workers=False)
    except (RuntimeError, OSError) as e:  # the address is not this node's, or the port is taken
        lines = str(e).strip().splitlines()  # torch's message goes on with hints and a C++ stack
        reason = lines[0] if lines else type(e).__name__
        print(f"error: the rendezvous store cannot listen on {address}:{port}: {reason}", file=sys.stderr)
        return 1
    for key, value in (marks or {}).items():
        store.set(key, value)
    signal.sigwait(stop)
    del store
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m freeze.pipeline.rendezvous_store <address> <port>", file=sys.stderr)
        return 2
    return serve(args[0], int(args[1]))


if __name__ == "__main__":
    sys.exit(main())
