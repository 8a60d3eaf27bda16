"""PowerSGD in one process: the hook names, refusals in one line that change nothing, and a saved
state that only the same hook resumes. (Under DDP on 2 ranks: tests/test_powersgd_ddp.py.)"""

import pytest
import torch
from torch import nn

from freeze import Freezer, split_blocks
from freeze.names import COMM_HOOKS, POWERSGD_RANKS
from freeze.powersgd import PowerSGDState


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def test_the_powersgd_hooks_are_rank_1_and_4():
    assert POWERSGD_RANKS == {"powersgd1": 1, "powersgd4": 4} and set(POWERSGD_RANKS) < set(COMM_HOOKS)
    freezer = Freezer(m := model(), split_blocks(m), comm_hook="powersgd4")
    assert freezer.engine.comm.powersgd.matrix_rank == 4 and freezer.state_dict()["powersgd"]["iteration"] == 0
    plain = Freezer(m2 := model(), split_blocks(m2), comm_hook="bf16")
    assert plain.engine.comm.powersgd is None and plain.state_dict()["powersgd"] is None


@pytest.mark.parametrize("hook", ["powersgd2", "powersgd", "PowerSGD1", 4])
def test_an_unknown_hook_or_rank_is_one_line_listing_the_accepted_ones_and_touches_nothing(hook):
    m = model()
    with pytest.raises(ValueError) as err:
        Freezer(m, split_blocks(m), comm_hook=hook)
    assert str(err.value) == f"comm_hook: '{hook}' is not accepted; accepted: {', '.join(COMM_HOOKS)}"
    assert all(p.requires_grad for p in m.parameters())
    assert not any(mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks for mod in m.modules())


@pytest.mark.parametrize(
    ("saved_hook", "hook"), [("allreduce", "powersgd1"), ("powersgd1", "bf16"), ("powersgd4", "powersgd1")]
)
def test_a_state_saved_under_another_hook_is_refused_in_one_line_changing_nothing(saved_hook, hook):
    m = model()
    saver = Freezer(m, split_blocks(m), comm_hook=saved_hook)
    saver.set_boundary(1)
    saved = saver.training_state_dict()
    freezer = Freezer(m2 := model(), split_blocks(m2), comm_hook=hook)
    weights = {n: t.clone() for n, t in m2.state_dict().items()}
    for load in (lambda: freezer.load_state_dict(saved["freezer"]), lambda: freezer.load_training_state_dict(saved)):
        with pytest.raises(ValueError) as err:
            load()
        assert "\n" not in str(err.value) and "resume with the saving run's comm_hook" in str(err.value)
        assert freezer.boundary == 0 and all(torch.equal(t, weights[n]) for n, t in m2.state_dict().items())


def test_the_state_round_trips_its_generator_and_memories():
    state = PowerSGDState(1, seed=3)
    state.rng.randint(1_000_000_000)  # moved on from its seed
    state.iteration, state.error, state.q_memory = 40, {"w": torch.ones(2, 3)}, {"w": torch.zeros(3, 1)}
    other = PowerSGDState(1)
    other.load_state_dict(state.state_dict())
    assert (other.iteration, other.seed) == (40, 3)
    assert torch.equal(other.error["w"], state.error["w"]) and torch.equal(other.q_memory["w"], state.q_memory["w"])
    assert other.rng.randint(1_000_000_000) == state.rng.randint(1_000_000_000)  # the same next draw


def test_a_state_saved_before_the_powersgd_hooks_still_loads_under_allreduce():
    m = model()
    saved = Freezer(m, split_blocks(m), comm_hook="allreduce").state_dict()
    del saved["powersgd"]  # checkpoints written before this entry existed
    freezer = Freezer(m2 := model(), split_blocks(m2))
    freezer.load_state_dict(saved)
    assert freezer.state_dict()["powersgd"] is None
