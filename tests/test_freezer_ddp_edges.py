"""Freezer corner cases under real DDP (2 gloo ranks), all in one pair of processes: each scenario
builds its own model and Freezer in the same process group and records what the tests check."""

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, split_blocks
from freeze.freezer.engine import StaleWrapperError
from tests.distributed_harness import run_distributed
from tests.tiny_models import InstanceNormNet, SharedLayerNet, TinyNet, global_batch

pytestmark = pytest.mark.processes

GLOBAL_BATCH = 8


def _local_batch(rank: int, world_size: int, step: int):
    x, y = global_batch(step, GLOBAL_BATCH)
    local = GLOBAL_BATCH // world_size
    return x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]


def _step(freezer, optimizer, rank, world_size, step, forward=None):
    x, y = _local_batch(rank, world_size, step)
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy((forward or freezer.module)(x), y).backward()
    freezer.after_backward()
    optimizer.step()


def stable_module(rank: int, world_size: int) -> dict:
    """A script keeps freezer.module from the start; the boundary moves under it."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer)
    module = freezer.module
    old_wrapper = freezer.engine.wrapper
    out = {"bytes": [], "expected": []}
    for step, k in enumerate([0, 2, 1]):
        freezer.set_boundary(k)
        _step(freezer, optimizer, rank, world_size, step, forward=module)
        out["bytes"].append(freezer.counters.allreduce_bytes_last_step)
        out["expected"].append(freezer.trainable_grad_bytes)
    try:
        old_wrapper(_local_batch(rank, world_size, 0)[0])
        out["stale_error"] = None
    except StaleWrapperError as e:
        out["stale_error"] = str(e)
    out["same_object"] = module is freezer.module and module.module is model
    return out


def static_graph(rank: int, world_size: int) -> dict:
    """static_graph=True works across re-wraps without accumulation; accumulation is refused."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer, ddp_kwargs={"static_graph": True})
    out = {"bytes": [], "expected": []}
    for step, k in enumerate([0, 0, 2, 2]):
        freezer.set_boundary(k)
        _step(freezer, optimizer, rank, world_size, step)
        out["bytes"].append(freezer.counters.allreduce_bytes_last_step)
        out["expected"].append(freezer.trainable_grad_bytes)
    try:
        with freezer.module.no_sync():
            pass
        out["no_sync_error"] = None
    except ValueError as e:
        out["no_sync_error"] = str(e)
    return out


def shared_layer(rank: int, world_size: int) -> dict:
    """A frozen layer called again after a trainable one: the gradient passes through it (without
    pass-through DDP fails with 'Expected to have finished reduction')."""
    torch.manual_seed(rank)  # the Freezer syncs rank 0's weights
    model = SharedLayerNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer)
    freezer.set_boundary(1)
    proj_before = model.proj.weight.detach().clone()
    for step in range(2):
        _step(freezer, optimizer, rank, world_size, step)
    return {
        "params": torch.cat([p.detach().flatten() for p in model.parameters()]),
        "proj_moved": not torch.equal(model.proj.weight, proj_before),
        "bytes": freezer.counters.allreduce_bytes_last_step,
        "expected": freezer.trainable_grad_bytes,
    }


def instance_norm(rank: int, world_size: int) -> dict:
    """Frozen InstanceNorm with running statistics: broadcast once, then unchanged on every rank
    (each rank sees its own data, so any update would drift apart)."""
    torch.manual_seed(0)
    model = InstanceNormNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer)
    for step in range(2):
        _step(freezer, optimizer, rank, world_size, step)
    freezer.set_boundary(1)
    at_freeze = {n: b.clone() for n, b in model[0].named_buffers()}
    for step in range(2, 4):
        freezer.train()
        _step(freezer, optimizer, rank, world_size, step)
    return {"at_freeze": at_freeze, "after": {n: b.clone() for n, b in model[0].named_buffers()}}


SCENARIOS = {
    "stable_module": stable_module,
    "static_graph": static_graph,
    "shared_layer": shared_layer,
    "instance_norm": instance_norm,
}


def edge_worker(rank: int, world_size: int) -> dict:
    return {name: scenario(rank, world_size) for name, scenario in SCENARIOS.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(edge_worker, 2, tmp_path_factory.mktemp("ddp-edges"), deadline_s=240)


def test_stable_module_follows_every_rewrap(ranks):
    for r in ranks:
        out = r["stable_module"]
        assert out["same_object"]
        assert out["bytes"] == out["expected"] and len(set(out["bytes"])) == 3


def test_replaced_wrapper_refuses_to_run_and_names_the_fix(ranks):
    for r in ranks:
        message = r["stable_module"]["stale_error"]
        assert message is not None and "\n" not in message and "call freezer.module" in message


def test_static_graph_rewraps_and_refuses_accumulation_in_one_line(ranks):
    for r in ranks:
        out = r["static_graph"]
        assert out["bytes"] == out["expected"]
        message = out["no_sync_error"]
        assert message is not None and "\n" not in message and "static_graph=True" in message


def test_frozen_layer_used_after_a_trainable_one_trains_the_trainable_one(ranks):
    (r0, r1) = (r["shared_layer"] for r in ranks)
    assert torch.equal(r0["params"], r1["params"])
    for out in (r0, r1):
        assert not out["proj_moved"] and out["bytes"] == out["expected"]


def test_frozen_instance_norm_statistics_identical_across_ranks_and_unchanged(ranks):
    (r0, r1) = (r["instance_norm"] for r in ranks)
    for name, value in r0["after"].items():
        assert torch.equal(value, r1["after"][name]), name
        assert torch.equal(value, r0["at_freeze"][name]) and torch.equal(r1["after"][name], r1["at_freeze"][name]), name
