"""Shared pytest setup: the CI machine has 2 cores shared by everything, so tests use one thread.

The fast tier (``make test-fast``, FREEZE_TEST_FAST=1) skips every test at the moment it would start
a process (a gloo rank, torchrun, a subprocess, the emulated cluster), and the single-process tests
marked ``slow`` (several seconds each, e.g. every boundary of every torchvision family): what is left
runs in one process, for the edit-test loop. ``make test`` and CI run everything.
"""

import multiprocessing.process
import os
import subprocess

import pytest
import torch

torch.set_num_threads(1)

# Helper modules that assert on behalf of test files: pytest's rewriting explains their failures too.
pytest.register_assert_rewrite("tests.policy_histories")

FAST = os.environ.get("FREEZE_TEST_FAST") == "1"


def _no_processes(*args, **kwargs):
    pytest.skip("fast tier: this test starts processes (make test runs it)")


@pytest.fixture(autouse=True, scope="module")
def _fast_tier():
    """Module-scoped, and autouse so it comes first: a module's own fixtures that spawn ranks are covered too."""
    if not FAST:
        yield
        return
    saved = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start
    subprocess.Popen.__init__ = _no_processes
    multiprocessing.process.BaseProcess.start = _no_processes
    try:
        yield
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = saved


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: several seconds in one process; the fast tier skips it")
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA device, skipped without one (tests/gpu; make gpu-check runs them on a GPU)"
    )


def pytest_collection_modifyitems(config, items):
    if FAST:
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(pytest.mark.skip(reason="fast tier: slow (make test runs it)"))


def pytest_terminal_summary(terminalreporter):
    """Say whether the emulated-cluster tests could run here (they skip otherwise); printed under
    -q too, where pytest hides the report header."""
    from freeze.pipeline.cluster.net import unavailable_reason

    reason = unavailable_reason()
    terminalreporter.write_line(
        "emulated cluster: available here" if reason is None else f"emulated cluster: tests SKIPPED ({reason})"
    )
