"""torchrun's agent as our launchers run it (the local launcher, :mod:`freeze.pipeline.run`, and each
emulated node's agent, :mod:`freeze.pipeline.cluster.agent`): quiet where the launcher says the
outcome in one line itself, leaving no log folder behind, and giving back the signal handlers it
takes over."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import tempfile
import threading
from collections.abc import Iterator

_WORKER_EXIT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


class _DropDeathSignalLine(logging.Filter):
    """torchrun's agent logs "Received 2 death signal, shutting down workers" on Ctrl-C; the
    launcher says "interrupted" itself, in one line with the command that resumes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "death signal" not in record.getMessage()


@contextlib.contextmanager
def quiet_torchrun_logs() -> Iterator[None]:
    """torchrun's agent without its per-worker exit lines and its "death signal" line."""
    # torchrun logs every worker's exit in two lines ("failed (exitcode: 2) local_rank: 0 ...",
    # "Sending process N closing signal SIGTERM"): a refused run has said why in one line already,
    # and a failed one is summed up by its launcher in one.
    exit_log = logging.getLogger(_WORKER_EXIT_LOGGER)
    was_disabled, exit_log.disabled = exit_log.disabled, True
    agent_log, death_line = logging.getLogger(_AGENT_LOGGER), _DropDeathSignalLine()
    agent_log.addFilter(death_line)
    try:
        yield
    finally:
        exit_log.disabled = was_disabled
        agent_log.removeFilter(death_line)


def run_agent(args: argparse.Namespace) -> None:
    """torchrun's ``run(args)``, quiet (:func:`quiet_torchrun_logs`), with its workers' log folder
    (their error files, from which a failure's one line is read) made here and removed after it:
    without ``--log-dir`` the agent makes a ``torchelastic_*`` folder in the temp dir per launch and
    never removes it (one per run; a sweep left hundreds)."""
    from torch.distributed.run import run

    with contextlib.ExitStack() as stack:
        if args.log_dir is None:
            args.log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="freeze-agent-"))
        stack.enter_context(quiet_torchrun_logs())
        # A failure's ChildFailedError has read the error files by the time it leaves run().
        run(args)


_LAUNCHER_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")


def signal_handlers() -> dict:
    """This process's handlers of the signals torchrun's agent takes over (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for name in _LAUNCHER_SIGNALS if (sig := getattr(signal, name, None))}


def restore_signal_handlers(saved: dict) -> None:
    for sig, handler in saved.items():
        if handler is not None:  # None: installed from C, cannot be put back from Python
            signal.signal(sig, handler)
