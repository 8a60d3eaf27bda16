"""The ``horizon`` rule's undo, end to end in the Freezer: a freeze whose held-out check fails is
undone on 2 gloo ranks with the ranks bit-equal and every step's bytes those of its trainable
gradients, and a run resumed from a checkpoint taken on probation ends bit for bit as the
uninterrupted one, the undo included."""

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, split_blocks
from freeze.policies import Pricing, make_policy
from tests.distributed_harness import run_distributed
from tests.tiny_models import TinyNet, global_batch

EPOCHS, STEPS_PER_EPOCH, INTERVAL = 2, 12, 2
GLOBAL_BATCH = 8
# Freezing saves much and the tiny model's blocks learn little: the rule freezes as soon as its rates
# exist; the scripted held-out loss then rises with the boundary, so the probation undoes it.
PRICING = Pricing(step_time_s=(1.0, 0.6, 0.3, 0.1), lr_per_step=(0.01,) * (EPOCHS * STEPS_PER_EPOCH))
POLICY = "horizon:exchange=0.01,span=1,probation=2,tolerance=0.05,hold_off=2"


def make_run(rank: int = 0, device: str = "cpu", measured_loss=None):
    """The run on ``device``; ``measured_loss(model)``, when given, is measured on the held-out check
    too (tests/gpu: the check's evaluation on the device), and the scripted rise added to it."""
    torch.manual_seed(rank)  # different init per rank: the Freezer syncs it from rank 0
    model = TinyNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    holder = {}

    def held_out_loss() -> float:
        # a scripted check: the loss a broken freeze would show (it rises with the frozen blocks)
        measured = 0.0 if measured_loss is None else measured_loss(model)
        return 1.0 + measured + 0.5 * holder["freezer"].boundary

    freezer = Freezer(
        model,
        split_blocks(model),
        make_policy(POLICY),
        optimizer=optimizer,
        epochs=EPOCHS,
        steps_per_epoch=STEPS_PER_EPOCH,
        interval_steps=INTERVAL,
        pricing=PRICING,
        probe=held_out_loss,
    )
    holder["freezer"] = freezer
    return model, optimizer, freezer


def train_steps(model, optimizer, freezer, steps, rank=0, world_size=1, record=None):
    local = GLOBAL_BATCH // world_size
    device = next(model.parameters()).device
    for step in steps:
        x, y = (t.to(device) for t in global_batch(step, GLOBAL_BATCH))
        optimizer.zero_grad(set_to_none=True)
        freezer.train()
        F.cross_entropy(
            freezer.module(x[rank * local : (rank + 1) * local]), y[rank * local : (rank + 1) * local]
        ).backward()
        freezer.after_backward()
        if record is not None:
            record["bytes"].append(freezer.counters.allreduce_bytes_last_step)
            record["expected"].append(freezer.trainable_grad_bytes)
        optimizer.step()
        freezer.after_step()
        if (step + 1) % STEPS_PER_EPOCH == 0:
            freezer.end_epoch(step // STEPS_PER_EPOCH)


def undo_worker(rank: int, world_size: int) -> dict:
    model, optimizer, freezer = make_run(rank)
    record = {"bytes": [], "expected": []}
    train_steps(model, optimizer, freezer, range(EPOCHS * STEPS_PER_EPOCH), rank, world_size, record)
    record["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    record["decisions"] = [(d.step, d.boundary_before, d.boundary_after) for d in freezer.decisions]
    freezer.close()
    return record


@pytest.mark.processes
def test_an_undo_on_two_gloo_ranks_keeps_ranks_bit_equal_and_bytes_exact(tmp_path):
    ranks = run_distributed(undo_worker, 2, tmp_path)
    decisions = ranks[0]["decisions"]
    frozen = [d for d in decisions if d[2] > d[1]]
    undone = [d for d in decisions if d[2] < d[1]]
    assert frozen and undone, decisions  # froze, was undone on probation (and may freeze again after the hold-off)
    assert ranks[1]["decisions"] == decisions
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    for r in ranks:
        assert r["bytes"] == r["expected"]
    # bytes followed the boundary down and up again: fewer while frozen, all of them after the undo
    assert min(ranks[0]["bytes"]) < ranks[0]["bytes"][0] == max(ranks[0]["bytes"])


def test_a_run_resumed_on_probation_undoes_and_ends_bit_for_bit_as_the_uninterrupted_one():
    model, optimizer, freezer = make_run()
    train_steps(model, optimizer, freezer, range(EPOCHS * STEPS_PER_EPOCH))
    whole = ([(d.step, d.boundary_before, d.boundary_after) for d in freezer.decisions], list(model.parameters()))
    first_freeze = next(d.step for d in freezer.decisions if d.boundary_after > d.boundary_before)
    first_undo = next(d.step for d in freezer.decisions if d.boundary_after < d.boundary_before)

    model, optimizer, freezer = make_run()
    train_steps(model, optimizer, freezer, range(first_freeze + 1))  # one step into the probation
    saved = freezer.training_state_dict()
    model, optimizer, freezer = make_run()
    freezer.load_training_state_dict(saved)
    train_steps(model, optimizer, freezer, range(first_freeze + 1, EPOCHS * STEPS_PER_EPOCH))
    resumed = [(d.step, d.boundary_before, d.boundary_after) for d in freezer.decisions]
    assert first_freeze < first_undo
    assert resumed == whole[0]
    assert all(torch.equal(a, b) for a, b in zip(whole[1], model.parameters()))
