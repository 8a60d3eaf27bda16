"""Spawn N local processes, wait with a deadline, and collect one pickled payload per rank.

Used where torchrun is not: the engine benchmark and the multi-process tests. Spawn (not fork)
start method, OMP_NUM_THREADS set for the children, a deadline after which every child is killed
(a hang fails instead of blocking CI), and no child left running on any exit path.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from freeze._atomic import atomic_write
from freeze.comm import end_process_group


class SpawnError(RuntimeError):
    """A child died outside its own error handling (crash, kill, unpicklable function)."""


def payload_path(workdir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its pickled payload (a dict with at least ``"ok"``).

    Args:
        workdir: the directory shared by the parent and its spawned ranks.
        rank: the writing rank.
    """
    return Path(workdir) / f"rank{rank}.pkl"


def write_payload(workdir: str | Path, rank: int, payload: dict) -> None:
    """Write atomically: a rank killed mid-write leaves no half payload for the parent to misread.

    Args:
        workdir: the directory shared by the parent and its spawned ranks.
        rank: the writing rank.
        payload: a picklable dict with at least ``"ok"``.
    """
    atomic_write(payload_path(workdir, rank), lambda f: pickle.dump(payload, f))


def spawn_and_collect(
    fn: Callable[..., None], args: tuple, nprocs: int, workdir: str | Path, deadline_s: float, threads_per_proc: int = 1
) -> list[dict]:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; return their payloads in rank order.

    Args:
        fn: importable (module-level) function; it must write its payload with :func:`write_payload`.
        args: the arguments after ``rank`` (picklable).
        nprocs: number of processes, ranks ``0 .. nprocs-1``.
        workdir: where the payloads (and any ``file://`` rendezvous) go; created if missing.
        deadline_s: wall time after which every child is killed.
        threads_per_proc: OMP_NUM_THREADS of the children.

    Raises:
        TimeoutError: the children did not finish within ``deadline_s``.
        SpawnError: a child died without writing its payload.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads_per_proc)  # inherited by the spawned children
    # The children start with Ctrl-C blocked (the mask is kept across exec): the parent alone answers it
    # and kills them below, so a terminal's Ctrl-C to the group prints no traceback per child while they
    # import. Blocked in the parent too while they start, not ignored: a Ctrl-C meanwhile waits, and is
    # raised once the mask is lifted, inside the try that kills them.
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        raise
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    deadline = time.monotonic() + deadline_s
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{nprocs} spawned processes did not finish within {deadline_s:.0f} s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        raise SpawnError(f"a spawned process died: {e}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    payloads = []
    for rank in range(nprocs):
        with open(payload_path(workdir, rank), "rb") as f:
            payloads.append(pickle.load(f))
    return payloads


def run_gloo_rank(
    rank: int,
    world_size: int,
    workdir: str | Path,
    collective_timeout_s: float,
    body: Callable[[], object],
    backend: str = "gloo",
) -> None:
    """Inside a spawned process: join a gloo group through ``file://<workdir>/rendezvous`` (no port
    clashes), run ``body()``, leave the group, and write ``{"ok": True, "result": ...}`` or
    ``{"ok": False, "error": traceback}``. The collective timeout makes a mismatched collective
    raise instead of hanging until the parent's deadline.

    Args:
        rank: this process's rank.
        world_size: number of ranks in the group.
        workdir: the directory shared with the parent (rendezvous file and payloads).
        collective_timeout_s: timeout of every collective in the group.
        body: the work; its return value (picklable) becomes the payload's ``"result"``.
        backend: "gloo", or "nccl" for ranks that each own a GPU (the GPU benchmark's one rank).
    """
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{workdir}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        payload = {"ok": True, "result": body()}
    except BaseException:
        payload = {"ok": False, "error": traceback.format_exc()}
    finally:
        end_process_group()  # body's DDP wrappers are garbage by now: its threads stop here
    write_payload(workdir, rank, payload)


def local_torchrun_command(script: str | Path, log_dir: str | Path, *script_args: str, redirects: int = 1) -> list[str]:
    """The command that runs ``script`` under torchrun with 2 local ranks, one log folder per rank.

    Args:
        script: the Python file each rank runs.
        log_dir: torchrun's ``--log-dir``; rank r's output lands in ``<log_dir>/**/attempt_0/r/``.
        script_args: passed to the script.
        redirects: torchrun's ``--redirects`` (1: stdout to a file per rank, 3: stdout and stderr).
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--log-dir={log_dir}",
        f"--redirects={redirects}",
        str(script),
        *script_args,
    ]
