"""freeze.freezer.records: the checks a saved Freezer state passes before it is loaded, and the line an
evaluation explains itself in."""

import copy

import pytest
import torch

from freeze import Freezer, make_policy, split_blocks
from freeze.freezer.records import (
    Decision,
    Evaluation,
    FreezerCounters,
    check_saved_freezer,
    check_saved_training_state,
)
from freeze.policies import parse_policy
from tests.tiny_models import TinyNet, freezer_step


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
def _saved(block_names: list[str], policy_spec: str, **entries) -> dict:
    """A Freezer state with every entry check_saved_freezer reads (the monitor's is checked by the monitor)."""
    state = {"block_names": block_names, "policy_spec": policy_spec, "boundary": 0, "epochs_completed": 0}
    return {**state, "monitor": {}, "decisions": [], "counters": {}, **entries}


def test_a_saved_freezer_state_for_other_blocks_or_another_policy_is_refused_naming_both():
    saved = _saved(["stem", "block1", "head"], "static:k=1")
    check_saved_freezer(saved, ["stem", "block1", "head"], parse_policy("static:k=1"))  # the same: accepted
    with pytest.raises(
        ValueError, match=r"checkpoint blocks \['stem', 'block1', 'head'\] differ from this model's"
    ) as e:
        check_saved_freezer(saved, ["stem", "head"], parse_policy("static:k=1"))
    assert "['stem', 'head']" in str(e.value)
    with pytest.raises(ValueError, match="checkpoint policy 'static:k=1' differs from 'static:k=2'"):
        check_saved_freezer(saved, ["stem", "block1", "head"], parse_policy("static:k=2"))
    with pytest.raises(ValueError, match="checkpoint blocks"):  # blocks are checked first
        check_saved_freezer(saved, ["head"], parse_policy("none"))
    # equal as policies, not as strings: a spec written before a parameter existed names the policy
    # whose new parameter is at its default (issue 46's at:anneal)
    check_saved_freezer(
        _saved(["stem", "block1", "head"], "at:k=1,t=0.5"),
        ["stem", "block1", "head"],
        parse_policy("at:k=1,t=0.5,anneal=0"),
    )


def test_a_training_state_passes_only_when_it_has_an_optimizer_entry_iff_the_freezer_has_an_optimizer():
    base = {"model": {}, "freezer": {}}
    check_saved_training_state({**base, "optimizer": {}}, has_optimizer=True)
    check_saved_training_state(base, has_optimizer=False)
    with pytest.raises(ValueError, match="the state has an 'optimizer' entry and this Freezer has no optimizer"):
        check_saved_training_state({**base, "optimizer": None}, has_optimizer=False)  # the key decides, not its value
    with pytest.raises(ValueError, match="lacks an 'optimizer' entry and this Freezer has an optimizer; build it as"):
        check_saved_training_state(base, has_optimizer=True)


def test_an_evaluation_line_says_whether_the_boundary_moved():
    moved = Evaluation(interval=3, epoch=1, step=40, boundary_before=1, boundary_after=2, signal="eta 0.1")
    assert moved.line() == "interval 3 (epoch 1, step 40): eta 0.1; boundary 1 -> 2"
    stays = Evaluation(interval=0, epoch=0, step=5, boundary_before=2, boundary_after=2)
    assert stays.line() == "interval 0 (epoch 0, step 5): ; boundary stays 2"
    assert isinstance(moved, Decision)
    with pytest.raises(AttributeError):
        moved.boundary_after = 0  # recorded decisions are immutable  # type: ignore[misc]
    assert FreezerCounters() == FreezerCounters(steps=0, skipped_steps=0, rewraps=0)


# ------------------------------------------------------------------------------ a refused load changes nothing (issue 33, D5)
def _freezer(
    policy: str = "static:k=1", width: int = 8, seed: int = 0, head_only: bool = False, end_epoch: bool = True
) -> Freezer:
    torch.manual_seed(seed)
    model = TinyNet(width=width)
    params = model.head.parameters() if head_only else model.parameters()
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    freezer = Freezer(model, split_blocks(model), make_policy(policy), optimizer=optimizer, epochs=2)
    for step in range(2):
        freezer_step(freezer, optimizer, step + seed)
    if end_epoch:
        freezer.end_epoch(0)
    return freezer


def _snapshot(freezer: Freezer) -> dict:
    return copy.deepcopy(
        {
            "model": freezer.model.state_dict(),
            "freezer": freezer.state_dict(),
            "optimizer": freezer.optimizer.state_dict(),
        }
    )


def _unchanged(freezer: Freezer, before: dict) -> bool:
    now = _snapshot(freezer)
    same_model = all(torch.equal(now["model"][k], t) for k, t in before["model"].items())
    same_momentum = (
        all(
            torch.equal(now["optimizer"]["state"][i]["momentum_buffer"], s["momentum_buffer"])
            for i, s in before["optimizer"]["state"].items()
        )
        and now["optimizer"]["state"].keys() == before["optimizer"]["state"].keys()
    )
    mine, theirs = now["freezer"], before["freezer"]
    same_freezer = (mine["boundary"], mine["counters"], mine["decisions"], mine["epochs_completed"]) == (
        theirs["boundary"],
        theirs["counters"],
        theirs["decisions"],
        theirs["epochs_completed"],
    ) and mine["monitor"]["history"] == theirs["monitor"]["history"]
    return same_model and same_momentum and same_freezer


def _broken(change):
    def make(state: dict) -> dict:
        state = copy.deepcopy(state)
        change(state)
        return state

    return make


_SAVED_BY_ANOTHER_RUN = {
    "another policy": (
        {"policy": "static:k=2"},
        lambda s: s,
        "checkpoint policy 'static:k=1' differs from 'static:k=2'",
    ),
    "another optimizer": (
        {"head_only": True},
        lambda s: s,
        "parameter groups of \\[11\\] parameters, this one \\[2\\]",
    ),
    "another architecture": ({"width": 4}, lambda s: s, "16 tensors differ in shape from this model's"),
    "boundary at the head": ({}, _broken(lambda s: s["freezer"].update(boundary=4)), "boundary = 4; accepted: 0..3"),
    "boundary past the head": ({}, _broken(lambda s: s["freezer"].update(boundary=9)), "boundary = 9; accepted: 0..3"),
    "negative boundary": ({}, _broken(lambda s: s["freezer"].update(boundary=-1)), "boundary = -1; accepted: 0..3"),
    "no monitor": ({}, _broken(lambda s: s["freezer"].pop("monitor")), "the state lacks 'monitor'"),
    "no model": ({}, _broken(lambda s: s.pop("model")), "the state lacks 'model'"),
    "a model key missing": ({}, _broken(lambda s: s["model"].pop("head.bias")), "model lacks 1 keys \\(head.bias\\)"),
    "a monitor for other blocks": (
        {},
        _broken(lambda s: s["freezer"]["monitor"].update(block_steps=[0, 0])),
        "block_steps do not hold one count per block",
    ),
    "a summed gradient of another shape": (
        {},
        _broken(lambda s: s["freezer"]["monitor"].update(summed={0: torch.zeros(2)})),
        "the monitor's summed gradient of parameter 0 does not fit this model's",
    ),
    "decisions of another version": (
        {},
        _broken(lambda s: s["freezer"]["decisions"].append({"epoch": 0})),
        "its decisions or counters cannot be read",
    ),
}


@pytest.mark.parametrize("case", sorted(_SAVED_BY_ANOTHER_RUN))
def test_a_refused_training_state_changes_nothing_and_says_why_in_one_line(case):
    target_kwargs, corrupt, message = _SAVED_BY_ANOTHER_RUN[case]
    saved = corrupt(_freezer(width=target_kwargs.get("width", 8), seed=1).training_state_dict())
    target = _freezer(**{k: v for k, v in target_kwargs.items() if k != "width"}, seed=2)
    before = _snapshot(target)
    with pytest.raises(ValueError, match=message) as err:
        target.load_training_state_dict(saved)
    assert "\n" not in str(err.value)
    assert _unchanged(target, before)


def test_a_boundary_just_below_the_head_is_restored():
    saved = _freezer("gradual-unfreeze", seed=1, end_epoch=False).training_state_dict()
    assert saved["freezer"]["boundary"] == 3  # every block but the head frozen, as gradual-unfreeze starts
    target = _freezer("gradual-unfreeze", seed=2)  # boundary 2 after its epoch
    target.load_training_state_dict(saved)
    assert target.boundary == 3 and all(
        torch.equal(a, b) for a, b in zip(target.model.state_dict().values(), saved["model"].values())
    )
