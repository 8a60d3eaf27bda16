"""Issue 33 on 2 real gloo ranks: an fp64 model trains under DDP (D3), and a refused
load_training_state_dict leaves every rank as it was and still in step (D5)."""

import math

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, make_policy, split_blocks
from tests.distributed_harness import run_distributed
from tests.tiny_models import TinyNet, global_batch

pytestmark = pytest.mark.processes

GLOBAL_BATCH = 8


def _step(freezer, optimizer, rank: int, world_size: int, step: int, dtype=torch.float32) -> None:
    x, y = global_batch(step, GLOBAL_BATCH)
    local = GLOBAL_BATCH // world_size
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(
        freezer.module(x[rank * local : (rank + 1) * local].to(dtype)), y[rank * local : (rank + 1) * local]
    ).backward()
    freezer.after_backward()
    optimizer.step()


def fp64_run(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = TinyNet().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, split_blocks(model), make_policy("autofreeze"), optimizer=optimizer, epochs=4)
    for epoch in range(4):
        for step in range(2):
            _step(freezer, optimizer, rank, world_size, 2 * epoch + step, torch.float64)
        freezer.end_epoch(epoch)
        if epoch == 1:
            freezer.set_boundary(1)  # a re-wrap, and fp64 BatchNorm buffers broadcast as they freeze
    stats = [v for s in freezer.history for v in s.summed_grad_norm + s.mean_step_grad_norm if v is not None]
    out = {
        "decisions": [(d.epoch, d.boundary_after) for d in freezer.decisions],
        "boundary": freezer.boundary,
        "stats": stats,
        "weights": [p.detach().clone() for p in model.parameters()],
    }
    freezer.close()
    return out


def refused_load(rank: int, world_size: int) -> dict:
    torch.manual_seed(1)
    source_model = TinyNet()
    source = Freezer(source_model, split_blocks(source_model), make_policy("static:k=1"))
    saved = source.training_state_dict()
    source.close()
    torch.manual_seed(2)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    freezer = Freezer(model, split_blocks(model), make_policy("static:k=2"), optimizer=optimizer)
    _step(freezer, optimizer, rank, world_size, 0)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    saved["optimizer"] = optimizer.state_dict()
    try:
        freezer.load_training_state_dict(saved)
        message = None
    except ValueError as e:
        message = str(e)
    unchanged = all(torch.equal(model.state_dict()[k], t) for k, t in before.items())
    _step(freezer, optimizer, rank, world_size, 1)  # the ranks are still in step: no hang, same weights
    out = {"message": message, "unchanged": unchanged, "boundary": freezer.boundary}
    out["weights"] = [p.detach().clone() for p in model.parameters()]
    freezer.close()
    return out


def faults_worker(rank: int, world_size: int) -> dict:
    return {"fp64": fp64_run(rank, world_size), "refused_load": refused_load(rank, world_size)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(faults_worker, 2, tmp_path_factory.mktemp("ddp-faults"), deadline_s=240)


def test_an_fp64_model_trains_under_ddp_with_the_same_decisions_and_weights_on_every_rank(ranks):
    first = ranks[0]["fp64"]
    assert first["stats"] and all(math.isfinite(v) for v in first["stats"])
    for other in ranks[1:]:
        assert other["fp64"]["decisions"] == first["decisions"] and other["fp64"]["stats"] == first["stats"]
        assert other["fp64"]["boundary"] == first["boundary"] >= 1
        assert all(torch.equal(a, b) for a, b in zip(other["fp64"]["weights"], first["weights"]))


def test_a_refused_load_leaves_every_rank_unchanged_and_in_step(ranks):
    for r in ranks:
        out = r["refused_load"]
        assert "checkpoint policy 'static:k=1' differs from 'static:k=2'" in out["message"]
        assert out["unchanged"] and out["boundary"] == 2
    assert all(
        torch.equal(a, b) for a, b in zip(ranks[0]["refused_load"]["weights"], ranks[1]["refused_load"]["weights"])
    )
