"""Workers die with the process that started them.

torchrun's agent starts every worker in a session of its own (``start_new_session=True``), so
killing the launcher's process group does not reach the workers, and a launcher killed with SIGKILL
cannot stop them: they train on with no parent, and a resume or a re-run sweep then races them
(seen: epochs duplicated in runs marked complete). On Linux a worker therefore asks the kernel, as
its first act, to SIGKILL it when its parent dies (``prctl(PR_SET_PDEATHSIG)``, see prctl(2)). Its
parent is what started it: torchrun's agent (which ``python -m experiments.run`` and a sweep host in
their own process), or a sweep that runs a single-process run as a subprocess. A run started by hand
without a launcher is not bound to its shell, so ``nohup`` keeps working.

The request takes effect only once the worker runs it; a parent that died before then is caught by
comparing the parent pid with the one the launcher exported (:data:`PARENT_PID_ENV`). Our launchers
start the worker through this file run as a script (:func:`worker_argv`), which imports nothing
heavy before the request: ``import freeze`` alone imports torch, and under load (2 cores shared by
a dozen processes) that took over 10 s here, during which a worker of a killed launcher lived on.
Under a plain ``torchrun`` command the request comes first thing in ``main()``; the window
(interpreter start-up and imports) stays open there. The alternative, a thread in the worker that
polls its parent pid, would also need the imports first and costs a wake-up per poll.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PARENT_PID_ENV = "FREEZE_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def started_by_launcher() -> bool:
    """True in a process started by a launcher: our own (it exports its pid) or torchrun's agent."""
    return PARENT_PID_ENV in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def launcher_env() -> dict[str, str]:
    """What a launcher exports to the workers it starts itself, so that they can tell it died."""
    return {PARENT_PID_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies, if a launcher started it (Linux; elsewhere a
    no-op). Exits at once when the launcher that exported its pid is already gone."""
    if not started_by_launcher() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # the kernel refused (it never does on Linux >= 2.1.57); nothing more to be done
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and expected.isdigit() and os.getppid() != int(expected):
        print("error: the launcher that started this worker has exited; stopping", file=sys.stderr)
        os._exit(1)


def worker_argv(module: str) -> list[str]:
    """How a launcher runs ``python -m <module>`` so that the worker is bound to it before any
    import: ``[<this file>, <module>]`` (a script path for torchrun, or after ``sys.executable``)."""
    return [os.path.abspath(__file__), module]


if __name__ == "__main__":
    # python .../lifetime.py <module> <args>: bind to the launcher, then run <module> as __main__.
    die_with_parent()
    sys.path.pop(0)  # this file's directory: its modules (data, log, ...) must not shadow others
    # what `python -m` puts first: the folder it runs from, where a user's plugins.modules live
    sys.path.insert(0, os.getcwd())
    module = sys.argv.pop(1)
    sys.argv[0] = module
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        # Ctrl-C (the launcher passes it on) before the module handles it itself, e.g. while it
        # still imports torch: every worker printed a traceback. The launcher says "interrupted".
        sys.exit(130)
