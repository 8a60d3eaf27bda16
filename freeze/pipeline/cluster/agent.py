"""One node's torchrun agent on the emulated cluster: torchrun's own launcher, ending in one line.

    python -m freeze.pipeline.cluster.agent <torchrun's options> -m freeze.pipeline.run --config ...

The same agent as ``python -m torch.distributed.run`` (its argument parser and ``run``), but a
stopped or failed job ends without torchrun's tracebacks: the launcher stopping a node with SIGTERM
(Ctrl-C, a failure elsewhere) printed a SignalException traceback per agent (64 lines for 2 nodes
before the launcher's one line), and a failed worker a ChildFailedError report per agent. Exit
codes: 0 done, 130 stopped by a signal, else the failing worker's (:func:`worker_failure`).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from freeze.pipeline.failures import INTERRUPTED_EXIT_CODE, worker_failure
    from freeze.pipeline.run import quiet_torchrun_logs

    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with quiet_torchrun_logs():
            run(args)
    except SignalException:
        return INTERRUPTED_EXIT_CODE  # its launcher stopped it, and says so in one line
    except ChildFailedError as e:
        code, line, _ = worker_failure(e.failures.values())
        if line is not None:
            print(f"error: node at {args.local_addr}: {line}", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
