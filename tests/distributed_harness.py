"""Run a function on N real gloo ranks from a test.

Spawned (not forked) processes, a ``file://`` rendezvous under the test's tmp_path (no port clashes),
a collective timeout so a mismatched collective raises instead of hanging, one thread per rank, and a
deadline in the parent after which every worker is killed: a broken test fails, it never hangs CI.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, fn: Callable, world_size: int, workdir: str, args: tuple, collective_timeout_s: float) -> None:
    torch.set_num_threads(1)
    out = Path(workdir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        result = fn(rank, world_size, *args)
        payload = {"ok": True, "result": result}
    except BaseException:  # noqa: BLE001 - the parent re-raises with the traceback
        payload = {"ok": False, "error": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(out, "wb") as f:
        pickle.dump(payload, f)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    workdir: Path,
    *args: Any,
    deadline_s: float = 180.0,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be importable (module level). Raises AssertionError with the worker traceback if any
    rank failed, or TimeoutError after ``deadline_s``.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    env_backup = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        ctx = mp.start_processes(
            _worker,
            args=(fn, world_size, str(workdir), args, collective_timeout_s),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
    finally:
        if env_backup is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_backup
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test did not finish within {deadline_s:.0f} s")
    except mp.ProcessRaisedException as e:  # a worker crashed outside our try (e.g. unpicklable fn)
        raise AssertionError(str(e)) from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    results = []
    for r in range(world_size):
        with open(workdir / f"rank{r}.pkl", "rb") as f:
            payload = pickle.load(f)
        if not payload["ok"]:
            raise AssertionError(f"rank {r} failed:\n{payload['error']}")
        results.append(payload["result"])
    return results
