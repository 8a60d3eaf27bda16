"""The Freezer under real DDP (2 gloo ranks): traffic, replica consistency, frozen means frozen.

One schedule of boundaries freezes and later unfreezes blocks; every step records what the tests
compare, so a single pair of processes per optimizer covers every claim.
"""

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, split_blocks
from freeze.blocks import frozen_names
from tests.distributed_harness import run_distributed
from tests.tiny_models import TinyNet, global_batch

pytestmark = pytest.mark.processes

# Boundary in force for each optimizer step: freeze 1, 2, 3 blocks, then unfreeze back to 0.
SCHEDULE = [0, 0, 1, 1, 2, 3, 3, 1, 0, 2]
GLOBAL_BATCH = 8


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def flat_params(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def named_tensors(module):
    return {n: t.detach().clone() for n, t in list(module.named_parameters()) + list(module.named_buffers())}


def ddp_worker(rank: int, world_size: int, optimizer_name: str) -> dict:
    torch.manual_seed(rank)  # different init per rank: the Freezer must sync it from rank 0
    model = TinyNet()
    blocks = split_blocks(model)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    freezer = Freezer(model, blocks, optimizer=optimizer)
    seen_at_forward: list[dict] = []
    model.register_forward_pre_hook(lambda m, a: seen_at_forward.append({n: b.clone() for n, b in m.named_buffers()}))
    out = {"bytes": [], "expected_bytes": [], "params": [], "buffers": [], "frozen_moved": [], "rewrap_s": []}
    local = GLOBAL_BATCH // world_size
    for step, k in enumerate(SCHEDULE):
        freezer.set_boundary(k)
        freezer.train()
        model.train()  # a user's plain train() must not wake frozen BN up
        frozen = frozen_names(blocks, k)
        before = named_tensors(model)
        x, y = global_batch(step, GLOBAL_BATCH)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(
            freezer.module(x[rank * local : (rank + 1) * local]), y[rank * local : (rank + 1) * local]
        )
        loss.backward()
        freezer.after_backward()
        optimizer.step()
        after = named_tensors(model)
        out["frozen_moved"].append([n for n in frozen if not torch.equal(before[n], after[n])])
        out["bytes"].append(freezer.counters.allreduce_bytes_last_step)
        out["expected_bytes"].append(freezer.trainable_grad_bytes)
        out["params"].append(flat_params(model))
        out["buffers"].append({n: b.clone() for n, b in model.named_buffers()})
    out["buffers_at_forward"] = seen_at_forward
    out["rewraps"] = freezer.counters.rewraps
    out["rewrap_s_total"] = freezer.counters.rewrap_s_total
    return out


def reference_run(optimizer_name: str, world_size: int) -> dict:
    """Single process, same global batches, emulating DDP exactly: gradient = mean of the ranks'
    local-batch gradients, each rank's BN using its own batch statistics, buffers ending as rank 0's
    (DDP broadcasts rank 0's buffers before the next forward)."""
    torch.manual_seed(0)
    model = TinyNet()
    blocks = split_blocks(model)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    freezer = Freezer(model, blocks, optimizer=optimizer)
    local = GLOBAL_BATCH // world_size
    params, buffers = [], []
    for step, k in enumerate(SCHEDULE):
        freezer.set_boundary(k)
        freezer.train()
        x, y = global_batch(step, GLOBAL_BATCH)
        optimizer.zero_grad(set_to_none=True)
        start = {n: b.clone() for n, b in model.named_buffers()}
        for r in reversed(range(world_size)):  # rank 0 last, so its buffer update is what remains
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(start[n])
            loss = F.cross_entropy(model(x[r * local : (r + 1) * local]), y[r * local : (r + 1) * local])
            (loss / world_size).backward()  # gradients accumulate: the mean over ranks, as DDP's
        freezer.after_backward()
        optimizer.step()
        params.append(flat_params(model))
        buffers.append({n: b.clone() for n, b in model.named_buffers()})
    return {"params": params, "buffers": buffers}


@pytest.fixture(scope="module", params=["sgd", "adamw"])
def ddp_run(request, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(f"ddp-{request.param}")
    ranks = run_distributed(ddp_worker, 2, workdir, request.param, deadline_s=240)
    return request.param, ranks


def test_allreduced_bytes_equal_trainable_gradient_bytes(ddp_run):
    _, ranks = ddp_run
    for r in ranks:
        assert r["bytes"] == r["expected_bytes"]
    # And the schedule really exercised different amounts of traffic.
    assert len(set(ranks[0]["bytes"])) == len(set(SCHEDULE))


def test_parameters_identical_across_ranks_every_step(ddp_run):
    _, (r0, r1) = ddp_run
    for step, (p0, p1) in enumerate(zip(r0["params"], r1["params"])):
        assert torch.equal(p0, p1), f"step {step}: parameters differ across ranks"


def test_buffers_identical_across_ranks(ddp_run):
    """Frozen BN buffers match after every step; trainable ones match at every forward (DDP
    broadcasts rank 0's buffers before each forward, so between steps they are rank-local)."""
    _, (r0, r1) = ddp_run
    for step, (b0, b1) in enumerate(zip(r0["buffers_at_forward"], r1["buffers_at_forward"])):
        for name in b0:
            assert torch.equal(b0[name], b1[name]), f"step {step}: buffer {name} differs at forward"
    for step, k in enumerate(SCHEDULE):
        model = TinyNet()
        frozen = {n for b in split_blocks(model)[:k] for n, _, _ in b.buffers()}
        for name in frozen:
            assert torch.equal(r0["buffers"][step][name], r1["buffers"][step][name]), f"step {step}: frozen {name}"


def test_frozen_tensors_do_not_change_by_a_single_bit(ddp_run):
    optimizer_name, ranks = ddp_run
    for r in ranks:
        assert all(moved == [] for moved in r["frozen_moved"]), (optimizer_name, r["frozen_moved"])


def test_ddp_equals_single_process_over_same_global_batches(ddp_run):
    optimizer_name, (r0, _) = ddp_run
    ref = reference_run(optimizer_name, world_size=2)
    for step, (p_ddp, p_ref) in enumerate(zip(r0["params"], ref["params"])):
        torch.testing.assert_close(p_ddp, p_ref, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    for step, (b_ddp, b_ref) in enumerate(zip(r0["buffers"], ref["buffers"])):
        for name in b_ref:
            torch.testing.assert_close(
                b_ddp[name].double(), b_ref[name].double(), rtol=1e-5, atol=1e-6, msg=f"step {step} {name}"
            )


def test_rewrap_counted(ddp_run):
    _, ranks = ddp_run
    changes = sum(1 for a, b in zip(SCHEDULE, SCHEDULE[1:]) if a != b)
    for r in ranks:
        assert r["rewraps"] == changes
        assert r["rewrap_s_total"] > 0
