"""freeze.records: the checks a saved Freezer state passes before it is loaded, and the line an
evaluation explains itself in."""

import pytest
import torch

from freeze import Freezer, split_blocks
from freeze.records import Decision, Evaluation, FreezerCounters, check_saved_freezer, check_saved_training_state
from tests.tiny_models import TinyNet


def test_training_state_needs_the_optimizer_on_both_sides():
    model = TinyNet()
    with_opt = Freezer(model, split_blocks(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    other = TinyNet()
    without = Freezer(other, split_blocks(other))
    with pytest.raises(ValueError, match="has an 'optimizer' entry and this Freezer has no optimizer"):
        without.load_training_state_dict(with_opt.training_state_dict())
    with pytest.raises(ValueError, match="lacks an 'optimizer' entry and this Freezer has an optimizer"):
        with_opt.load_training_state_dict(without.training_state_dict())


# ------------------------------------------------------------------------------ the checks on their own
def test_a_saved_freezer_state_for_other_blocks_or_another_policy_is_refused_naming_both():
    saved = {"block_names": ["stem", "block1", "head"], "policy_spec": "static:k=1"}
    check_saved_freezer(saved, ["stem", "block1", "head"], "static:k=1")  # the same: accepted
    with pytest.raises(
        ValueError, match=r"checkpoint blocks \['stem', 'block1', 'head'\] differ from this model's"
    ) as e:
        check_saved_freezer(saved, ["stem", "head"], "static:k=1")
    assert "['stem', 'head']" in str(e.value)
    with pytest.raises(ValueError, match="checkpoint policy 'static:k=1' differs from 'static:k=2'"):
        check_saved_freezer(saved, ["stem", "block1", "head"], "static:k=2")
    with pytest.raises(ValueError, match="checkpoint blocks"):  # blocks are checked first
        check_saved_freezer(saved, ["head"], "none")


def test_a_training_state_passes_only_when_it_has_an_optimizer_entry_iff_the_freezer_has_an_optimizer():
    check_saved_training_state({"freezer": {}, "optimizer": {}}, has_optimizer=True)
    check_saved_training_state({"freezer": {}}, has_optimizer=False)
    with pytest.raises(ValueError, match="the state has an 'optimizer' entry and this Freezer has no optimizer"):
        check_saved_training_state({"optimizer": None}, has_optimizer=False)  # the key decides, not its value
    with pytest.raises(ValueError, match="lacks an 'optimizer' entry and this Freezer has an optimizer; build it as"):
        check_saved_training_state({}, has_optimizer=True)


def test_an_evaluation_line_says_whether_the_boundary_moved():
    moved = Evaluation(interval=3, epoch=1, step=40, boundary_before=1, boundary_after=2, signal="eta 0.1")
    assert moved.line() == "interval 3 (epoch 1, step 40): eta 0.1; boundary 1 -> 2"
    stays = Evaluation(interval=0, epoch=0, step=5, boundary_before=2, boundary_after=2)
    assert stays.line() == "interval 0 (epoch 0, step 5): ; boundary stays 2"
    assert isinstance(moved, Decision)
    with pytest.raises(AttributeError):
        moved.boundary_after = 0  # recorded decisions are immutable  # type: ignore[misc]
    assert FreezerCounters() == FreezerCounters(steps=0, skipped_steps=0, rewraps=0)
