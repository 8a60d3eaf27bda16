"""freeze.comm without a process group: the same code runs in one process (one rank, collectives
that do nothing), and an unknown comm hook is refused before DDP is built. (What crosses the wire
on 2 ranks: tests/test_freezer_ddp.py.)"""

import pytest
import torch

from freeze import comm
from freeze.names import COMM_HOOKS


def test_without_a_process_group_there_is_one_rank_and_collectives_change_nothing():
    assert not comm.is_distributed() and comm.world_size() == 1 and comm.rank() == 0
    t = torch.arange(4.0)
    comm.broadcast_from_rank0([t, t[::2]])  # a non-contiguous view too
    assert torch.equal(t, torch.arange(4.0))
    assert comm.broadcast_int_from_rank0(7) == 7
    token = object()
    assert comm.broadcast_object_from_rank0(token) is token
    assert comm.any_rank(True) and not comm.any_rank(False)
    comm.end_process_group()  # nothing to end: no error


def test_an_unknown_comm_hook_is_one_line_listing_the_accepted_ones():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError) as err:
        comm.build_ddp(model, [], comm.CommCounter(), comm_hook="fp16")
    assert str(err.value) == f"comm_hook: 'fp16' is not accepted; accepted: {', '.join(COMM_HOOKS)}"
    assert model.weight.requires_grad and not hasattr(model, "_ddp_params_and_buffers_to_ignore")  # untouched


def test_a_counter_starts_at_zero_on_the_default_group():
    counter = comm.CommCounter()
    assert (counter.process_group, counter.allreduce_bytes_total, counter.buckets_total) == (None, 0, 0)


@pytest.mark.parametrize("world", [None, "1", " 1 ", "", "auto"])
def test_one_process_without_a_group_is_accepted(monkeypatch, world):
    # No launcher, a launcher of one process, or a value that is no count: nothing to refuse.
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    comm.check_launch("Freezer")


def test_a_launcher_of_several_processes_without_a_group_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4") as err:
        comm.check_launch("Freezer")
    assert "\n" not in str(err.value) and "init_process_group" in str(err.value)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(RuntimeError, match="process_group is given but torch.distributed is not initialised"):
        comm.check_launch("Freezer", process_group=object())
