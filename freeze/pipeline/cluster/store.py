"""The emulated cluster's rendezvous store, in a process of its own on node 0 that outlives the agents.

    python -m freeze.pipeline.cluster.store <address> <port>

With the store inside node 0's agent (torchrun's ``is_host``), whichever agent ended first decided
whether the others could close the rendezvous: when node 0's agent exited before node 1's had
closed it, node 1 printed "failed to shutdown the rendezvous" and a C++ stack of 30 frames from
TCPStore (a known race of torchrun with a hosting agent; seen once here in about 300 cluster runs,
harmless, and read by a user as a failed run). The launcher (:func:`freeze.pipeline.cluster.launch.
run_job`) starts this process before the agents, every agent connects to it as a client, and the
launcher stops it only after the last agent has exited. Runs until SIGTERM or SIGINT and prints
nothing, or exits 1 with one line when it cannot listen (the launcher then stops the job with it).
"""

from __future__ import annotations

import signal
import sys


def serve(address: str, port: int) -> int:
    """Host a TCPStore on ``address:port`` until SIGTERM or SIGINT arrives; 0, or 1 with one line
    when the store cannot be hosted there."""
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
        print(f"error: cluster: the rendezvous store cannot listen on {address}:{port}: {reason}", file=sys.stderr)
        return 1
    signal.sigwait(stop)
    del store
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m freeze.pipeline.cluster.store <address> <port>", file=sys.stderr)
        return 2
    return serve(args[0], int(args[1]))


if __name__ == "__main__":
    sys.exit(main())
