"""Shared pytest setup: the CI machine has 2 cores shared by everything, so tests use one thread."""

import torch

torch.set_num_threads(1)


def pytest_report_header(config):
    """Say up front whether the emulated-cluster tests can run here (they skip otherwise)."""
    from freeze.pipeline.cluster.net import unavailable_reason

    reason = unavailable_reason()
    return "emulated cluster: available" if reason is None else f"emulated cluster: tests SKIPPED ({reason})"
