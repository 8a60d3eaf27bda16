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
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser

    from freeze.pipeline.failures import INTERRUPTED_EXIT_CODE, record_failure, worker_failure
    from freeze.pipeline.torchrun_agent import run_agent

    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run_agent(args)
    except SignalException:
        return INTERRUPTED_EXIT_CODE  # its launcher stopped it, and says so in one line
    except ChildFailedError as e:
        code, line, killed = worker_failure(e.failures.values())
        if line is not None:
            line = f"node at {args.local_addr}: {line}"
            print(f"error: {line}", file=sys.stderr)
            run_dir = _run_dir(args.training_script_args)
            if killed and run_dir is not None:  # the killed worker recorded nothing; its launcher sees only "1"
                record_failure(run_dir, line, replace_failed=True)
        return code
    return 0


def _run_dir(script_args: list[str]) -> Path | None:
    """The run directory of a ``freeze.pipeline.run`` entry: its resolved config lies in it."""
    if "--config" not in script_args[:-1]:
        return None
    return Path(script_args[script_args.index("--config") + 1]).parent


if __name__ == "__main__":
    sys.exit(main())
