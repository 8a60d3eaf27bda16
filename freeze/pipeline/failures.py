"""How a run ended, told apart and said in one line: stopped, refused, a worker killed by a signal
nobody of ours sent, a worker's own error, a collective past ``dist.timeout_s``.

torchrun reports one exit code per worker. When one worker fails, its agent stops every other one
with SIGTERM (they exit 130 through their interrupt handler), and their collectives break ("Connection
closed by peer"): those are consequences, and blaming them called a crash an interruption (a
sweep then stopped). A worker that died of a signal is the cause: the out-of-memory killer's
SIGKILL is the common one. Used by the local launcher (:mod:`freeze.pipeline.run`), a sweep's
single-process runs and each emulated node's agent (:mod:`freeze.pipeline.cluster.agent`).
"""

from __future__ import annotations

import signal
from pathlib import Path

from freeze.pipeline.runs import RunDir

# What a run exits with when Ctrl-C or SIGTERM stopped it: the shell's 128 + SIGINT. Sweeps and
# studies stop on it instead of starting the next run.
INTERRUPTED_EXIT_CODE = 130


def collective_timeout_line(error: BaseException, timeout_s: int) -> str | None:
    """One line for a collective that ran past ``dist.timeout_s`` (gloo: "Timed out waiting
    20000ms for recv operation to complete"), or None for any other error. The limit bounds each
    gloo send or receive, not a collective or the run: a broadcast of a large tensor over a slow
    link is many such operations, so it can fail only after several times the limit."""
    if "Timed out" not in str(error):
        return None
    detail = " ".join(str(error).split())
    detail = detail.split("] ", 1)[-1]  # drop gloo's source-file prefix
    return (
        f"a collective operation exceeded dist.timeout_s = {timeout_s} s ({detail}): a peer stopped "
        "answering, or the link is too slow for one send; the limit applies to each gloo operation, "
        "not to the run (raise dist.timeout_s for slow links)"
    )


# gloo's words for a peer whose process is gone (killed, or stopped by its agent).
_PEER_LOST_MARKERS = ("closed by peer", "reset by peer", "Broken pipe")


def peer_lost_line(error: BaseException) -> str | None:
    """One line for a collective that broke because a peer's process is gone, or None for any other
    error: a consequence, whose cause the worker that stopped first (or its node's agent) names."""
    text = " ".join(str(error).split())
    if not any(marker in text for marker in _PEER_LOST_MARKERS):
        return None
    detail = text.split("] ", 1)[-1].split(". ")[0]  # gloo's first sentence, without its source file
    return f"a peer worker's connection was lost ({detail}): the worker that stopped first, or its node, says why"


# What a worker exits with when it was stopped, not when it failed: 130 (its SIGINT/SIGTERM handler,
# _Interrupt), or death by SIGINT/SIGTERM before that handler was installed. torchrun's agent stops
# every other worker with SIGTERM once one has failed, so these are the consequence of a failure.
_STOPPED_EXIT_CODES = (INTERRUPTED_EXIT_CODE, -signal.SIGINT, -signal.SIGTERM)


def signal_name(signum: int) -> str:
    """``9`` -> ``"SIGKILL"`` (the number when the platform has no name for it)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def killed_line(who: str, signum: int) -> str:
    """The one line for a process that died of a signal its launcher did not send."""
    hint = " (the kernel's out-of-memory killer sends SIGKILL: see dmesg)" if signum == signal.SIGKILL else ""
    return f"{who} was killed by signal {signal_name(signum)}, which this launcher did not send{hint}"


def worker_failure(failures) -> tuple[int, str | None, bool]:
    """(exit code, one-line cause, whether a signal killed a worker) of a run from torchrun's
    per-worker failures (an exit code < 0: killed by that signal). A worker killed by a signal is
    the cause (its peers' collective errors and the agent's SIGTERMs follow from it), else the
    first worker that failed on its own; when every worker was only stopped (SIGINT/SIGTERM sent
    to the workers, e.g. by a scheduler), the run was interrupted. A cause of None: nothing to
    print (interrupted, or refused with its own line)."""
    ordered = sorted(failures, key=lambda f: f.timestamp)
    causes = [f for f in ordered if f.exitcode not in _STOPPED_EXIT_CODES]
    if not causes:
        return INTERRUPTED_EXIT_CODE, None, False
    first = next((f for f in causes if f.exitcode < 0), causes[0])
    who = f"worker {first.local_rank} (pid {first.pid})"
    if first.exitcode < 0:
        return 1, killed_line(who, -first.exitcode), True
    if first.exitcode == 2:  # the worker refused the run and printed why
        return 2, None, False
    return first.exitcode, f"{who} exited with code {first.exitcode}", False


def record_failure(run_dir: Path, message: str, replace_failed: bool = False) -> None:
    """Mark the run in ``run_dir`` failed with ``message`` when it is still "running" (or, with
    ``replace_failed``, also when a worker marked it failed with an error that followed from this
    one). A run that never started, completed or was interrupted is left as it is."""
    RunDir(run_dir).finish_if(("running", "failed") if replace_failed else ("running",), "failed", message)
