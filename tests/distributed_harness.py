"""Run a function on N real gloo ranks from a test.

Spawned (not forked) processes, a ``file://`` rendezvous under the test's tmp_path (no port clashes),
a collective timeout so a mismatched collective raises instead of hanging, one thread per rank, and a
deadline in the parent after which every worker is killed: a broken test fails, it never hangs CI.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from freeze.testing import SpawnError, run_gloo_rank, spawn_and_collect


def _worker(rank: int, fn: Callable, world_size: int, workdir: str, args: tuple, collective_timeout_s: float) -> None:
    torch.set_num_threads(1)
    run_gloo_rank(rank, world_size, workdir, collective_timeout_s, lambda: fn(rank, world_size, *args))


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
    try:
        payloads = spawn_and_collect(
            _worker, (fn, world_size, str(workdir), args, collective_timeout_s), world_size, workdir, deadline_s
        )
    except SpawnError as e:  # a worker crashed outside our try (e.g. unpicklable fn)
        raise AssertionError(str(e)) from None
    results = []
    for r, payload in enumerate(payloads):
        if not payload["ok"]:
            raise AssertionError(f"rank {r} failed:\n{payload['error']}")
        results.append(payload["result"])
    return results
