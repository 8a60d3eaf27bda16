"""Checkpoints written by an earlier version load, and the run goes on to the same statistics,
decisions and weights, bit for bit (tests/golden_runs.py; files in tests/fixtures/golden, written by
the commit named in their README). A refactor of the monitor or the Freezer that changes one number
of what a policy reads, or a checkpoint format that no longer loads, fails here."""

from pathlib import Path

import pytest
import torch

from tests.golden_runs import EPOCHS, HALFWAY_EPOCHS, POLICIES, STEPS_PER_EPOCH, build, outcome, train_epochs

GOLDEN = Path(__file__).parent / "fixtures" / "golden"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_earlier_versions_checkpoint_continues_to_its_recorded_outcome(name):
    recorded = torch.load(GOLDEN / f"{name}.pt", weights_only=True)
    model, freezer, optimizer = build(name)
    freezer.load_training_state_dict(recorded["halfway"])
    train_epochs(freezer, optimizer, range(HALFWAY_EPOCHS, EPOCHS))
    now, then = outcome(model, freezer), recorded["outcome"]
    assert now["history"] == then["history"]  # every statistic, as exact floats
    assert now["decisions"] == then["decisions"] and now["boundary"] == then["boundary"]
    assert now["model"].keys() == then["model"].keys()
    for key, tensor in then["model"].items():
        assert torch.equal(now["model"][key], tensor), key
    freezer.close()


def test_the_golden_runs_decide_something():
    """The traces are worth replaying: a gradient rule froze within them, after the checkpoint."""
    recorded = torch.load(GOLDEN / "autofreeze.pt", weights_only=True)
    halfway_steps = HALFWAY_EPOCHS * STEPS_PER_EPOCH
    assert any(
        d["step"] > halfway_steps and d["boundary_after"] > d["boundary_before"]
        for d in recorded["outcome"]["decisions"]
    )
