"""Every interpreter a test starts, in one place (gloo ranks: tests/distributed_harness.py).

A child runs this checkout's code with one thread, unbuffered output and a deadline: the CI
machine's 2 cores are shared by everything, a progress line must reach a test that waits for it,
and a broken child fails its test instead of hanging the suite. Tests that start processes carry
the ``processes`` marker (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 240.0


def python_env(**extra: str) -> dict[str, str]:
    """os.environ for a child: one thread, unbuffered, this checkout first on PYTHONPATH."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_command(
    argv: Sequence[str], *, cwd: Path | str = REPO, env: dict[str, str] | None = None, timeout_s: float = DEADLINE_S
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end within ``timeout_s``; its exit code, stdout and stderr as text."""
    return subprocess.run(
        list(argv), cwd=cwd, env=python_env() if env is None else env, capture_output=True, text=True, timeout=timeout_s
    )


def run_python(
    args: Sequence[str], *, cwd: Path | str = REPO, env: dict[str, str] | None = None, timeout_s: float = DEADLINE_S
) -> subprocess.CompletedProcess[str]:
    """``python <args>`` with this interpreter, as :func:`run_command`."""
    return run_command([sys.executable, *args], cwd=cwd, env=env, timeout_s=timeout_s)


def start_python(
    args: Sequence[str], *, cwd: Path | str = REPO, env: dict[str, str] | None = None, **popen_kwargs
) -> subprocess.Popen:
    """``python <args>`` started and left running, for a test that signals or watches it; the
    caller waits for it (its own deadline) and picks the streams (``popen_kwargs``)."""
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=python_env() if env is None else env, **popen_kwargs)
