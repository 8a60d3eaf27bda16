"""Shared pytest setup: the CI machine has 2 cores shared by everything, so tests use one thread.

Two declared tiers. A test that starts a process (a gloo rank, torchrun, a subprocess, git, the
emulated cluster) carries the ``processes`` marker; the single-process tests of several seconds
carry ``slow``. ``make test-fast`` runs ``-m "not processes and not slow"``, the edit-test loop;
``make test`` and CI run everything. A test's tier is read before anything runs:
``pytest -m "not processes and not slow" --collect-only -q`` lists the fast tier.

The marker is checked in every run: a test without it that starts a process fails, so the tier
cannot drift when a code path learns to shell out.
"""

import contextlib
import multiprocessing.process
import subprocess

import pytest
import torch

torch.set_num_threads(1)

# Helper modules that assert on behalf of test files: pytest's rewriting explains their failures too.
pytest.register_assert_rewrite("tests.policy_histories")

PROCESSES = "processes"
SLURM = "slurm"


class _ProcessGuard:
    """Lets a process start only while a test marked ``processes`` sets up, runs or tears down.

    Set per test phase by the hooks below rather than by a fixture: a module-scoped fixture that
    spawns ranks is set up inside the first test that asks for it, before any function fixture, and
    that test's marker decides. Outside test phases (collection, the summary) nothing is checked."""

    def __init__(self):
        self.item = None  # the test now in a phase that may not start processes, else None
        self.saved = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def install(self) -> None:
        popen_init, process_start = self.saved
        guard = self

        def checked_popen_init(popen, *args, **kwargs):
            guard.check("subprocess.Popen")
            popen_init(popen, *args, **kwargs)

        def checked_process_start(process):
            guard.check("multiprocessing Process.start")
            process_start(process)

        subprocess.Popen.__init__ = checked_popen_init
        multiprocessing.process.BaseProcess.start = checked_process_start

    def uninstall(self) -> None:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = self.saved

    def check(self, what: str) -> None:
        if self.item is not None:
            # pytest.fail raises a BaseException: library code that catches OSError or Exception
            # around its own subprocess call (runs.git_commit) cannot swallow it.
            pytest.fail(
                f"{self.item.nodeid} starts a process ({what}) but is not marked "
                f"'{PROCESSES}': mark it (pytestmark = pytest.mark.{PROCESSES} for a whole file), "
                "or check the claim in-process",
                pytrace=False,
            )


_GUARD = _ProcessGuard()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{PROCESSES}: starts processes (gloo ranks, torchrun, a subprocess, git, the emulated cluster); "
        "the fast tier deselects it, and an unmarked test that starts one fails",
    )
    config.addinivalue_line("markers", "slow: several seconds in one process; the fast tier deselects it")
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA device, skipped without one (tests/gpu; make gpu-check runs them on a GPU)"
    )
    config.addinivalue_line(
        "markers",
        f"{SLURM}: needs the two-node SLURM cluster on this host (tests/slurm_cluster.py), skipped with one line where "
        "it cannot start (no root)",
    )
    _build_matplotlib_font_cache()
    _GUARD.install()


def _build_matplotlib_font_cache() -> None:
    """On a fresh machine matplotlib's first figure asks fontconfig (``fc-list``, a process) for the
    fonts and caches them; inside a test unmarked 'processes' the guard refuses that, so the cache was
    never written and every figure test of the fast tier failed there. Built here, before any test."""
    with contextlib.suppress(ImportError):
        import matplotlib.font_manager  # noqa: F401  (importing it builds the cache when missing)


def pytest_unconfigure(config):
    _GUARD.uninstall()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield from _guarded(item))


def _guarded(item):
    _GUARD.item = None if item.get_closest_marker(PROCESSES) else item
    try:
        return (yield)
    finally:
        _GUARD.item = None


def pytest_terminal_summary(terminalreporter):
    """Say whether the emulated-cluster tests could run here (they skip otherwise); printed under
    -q too, where pytest hides the report header."""
    from freeze.pipeline.cluster.net import unavailable_reason

    reason = unavailable_reason()
    terminalreporter.write_line(
        "emulated cluster: available here" if reason is None else f"emulated cluster: tests SKIPPED ({reason})"
    )
