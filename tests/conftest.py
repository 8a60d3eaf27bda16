"""Shared pytest setup: the CI machine has 2 cores shared by everything, so tests use one thread."""

import torch

torch.set_num_threads(1)


def pytest_terminal_summary(terminalreporter):
    """Say whether the emulated-cluster tests could run here (they skip otherwise); printed under
    -q too, where pytest hides the report header."""
    from freeze.pipeline.cluster.net import unavailable_reason

    reason = unavailable_reason()
    terminalreporter.write_line(
        "emulated cluster: available here" if reason is None else f"emulated cluster: tests SKIPPED ({reason})"
    )
