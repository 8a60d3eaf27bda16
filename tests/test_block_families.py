"""The default split on a tiny instance of every family (tests/block_families.py): a partition of the
parameters, forward order on a real forward, a head that is the classifier, gradients reaching
exactly the unfrozen blocks at every boundary, and a freeze/unfreeze schedule on 2 gloo ranks with
exact bytes and no drift. All families share one pair of spawned processes."""

import hashlib

import pytest
import torch

from freeze import Freezer, split_blocks
from tests.block_families import FAMILIES, batch, loss
from tests.distributed_harness import run_distributed

NAMES = list(FAMILIES)
DDP_NAMES = [n for n, f in FAMILIES.items() if f.ddp]
LOCAL_BATCH = 4  # BatchNorm needs more than one value per channel at the 1x1 maps of the deepest layers


def schedule(num_blocks: int) -> list[int]:
    """Boundary per optimizer step: none frozen, freeze half, all but the head, unfreeze back to 1."""
    return [0, num_blocks // 2, num_blocks - 1, 1]


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name):
        if name not in cache:
            torch.manual_seed(0)
            model = FAMILIES[name].build()
            cache[name] = (model, split_blocks(model))
        return cache[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_default_split_is_a_partition_of_more_than_three_blocks_ending_in_the_classifier(name, built):
    model, blocks = built(name)
    owned = [id(p) for b in blocks for p in b.params]
    assert len(owned) == len(set(owned)), "a parameter is in two blocks"
    assert set(owned) == {id(p) for p in model.parameters()}, "a parameter is in no block"
    assert len(blocks) > 3
    assert blocks[-1].module_names == FAMILIES[name].head
    for param, module in FAMILIES[name].parent_params:
        (holder,) = [b for b in blocks if param in b.param_names]
        assert module in holder.module_names, f"{param} is in block {holder.name}"


@pytest.mark.parametrize("name", NAMES)
def test_blocks_run_in_forward_order(name, built):
    """Forward pre-hooks on every block module record which block runs, call by call."""
    model, blocks = built(name)
    calls: list[int] = []
    handles = [
        m.register_forward_pre_hook(lambda *_, i=i: calls.append(i)) for i, b in enumerate(blocks) for m in b.modules
    ]
    try:
        x, y = batch(FAMILIES[name], LOCAL_BATCH, seed=0)
        loss(FAMILIES[name], model, x, y)
    finally:
        for h in handles:
            h.remove()
    assert calls == sorted(calls), f"block order {calls}"
    assert set(calls) == set(range(len(blocks)))


@pytest.mark.parametrize("name", [n if n == "resnet" else pytest.param(n, marks=pytest.mark.slow) for n in NAMES])
def test_every_boundary_trains_exactly_the_unfrozen_blocks(name, built):
    """A parameter placed in a block after its first user would get no gradient once that user is
    frozen (it runs under no_grad): every boundary must leave every trainable parameter a gradient."""
    model, blocks = built(name)
    freezer = Freezer(model, blocks)
    x, y = batch(FAMILIES[name], LOCAL_BATCH, seed=1)
    for k in range(len(blocks)):
        freezer.set_boundary(k)
        freezer.train()
        model.zero_grad(set_to_none=True)
        loss(FAMILIES[name], freezer.module, x, y).backward()
        missing = [n for b in blocks[k:] for n, p in zip(b.param_names, b.params) if p.grad is None]
        frozen_with_grad = [n for b in blocks[:k] for n, p in zip(b.param_names, b.params) if p.grad is not None]
        assert missing == [], f"k={k}: trainable parameters without a gradient"
        assert frozen_with_grad == [], f"k={k}: frozen parameters with a gradient"
    freezer.set_boundary(0)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _frozen_tensors(blocks, k: int) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for b in blocks[:k] for n, p in zip(b.param_names, b.params)}
    out.update({n: getattr(mod, attr).clone() for b in blocks[:k] for n, mod, attr in b.buffers()})
    return out


def families_worker(rank: int, world_size: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        family = FAMILIES[name]
        torch.manual_seed(rank)  # different init per rank: the Freezer starts every rank from rank 0's
        model = family.build()
        blocks = split_blocks(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        freezer = Freezer(model, blocks, optimizer=optimizer)
        record = {"bytes": [], "expected_bytes": [], "params": [], "frozen_buffers": [], "frozen_moved": []}
        for step, k in enumerate(schedule(len(blocks))):
            freezer.set_boundary(k)
            freezer.train()
            before = _frozen_tensors(blocks, k)
            x, y = batch(family, LOCAL_BATCH, seed=100 * step + rank)
            optimizer.zero_grad(set_to_none=True)
            loss(family, freezer.module, x, y).backward()
            freezer.after_backward()
            optimizer.step()
            after = _frozen_tensors(blocks, k)
            record["frozen_moved"].append([n for n in before if not torch.equal(before[n], after[n])])
            record["bytes"].append(freezer.counters.allreduce_bytes_last_step)
            record["expected_bytes"].append(freezer.trainable_grad_bytes)
            record["params"].append(_digest(model.parameters()))
            record["frozen_buffers"].append(_digest(t for n, t in sorted(after.items())))
        out[name] = record
    return out


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    ranks = run_distributed(families_worker, 2, tmp_path_factory.mktemp("families"), DDP_NAMES, deadline_s=420)
    return ranks


@pytest.mark.processes
@pytest.mark.parametrize("name", DDP_NAMES)
def test_allreduced_bytes_equal_trainable_gradient_bytes(name, ddp_runs):
    for rank in ddp_runs:
        record = rank[name]
        assert record["bytes"] == record["expected_bytes"]
        assert len(set(record["bytes"])) == len(set(record["expected_bytes"])) > 1


@pytest.mark.processes
@pytest.mark.parametrize("name", DDP_NAMES)
def test_no_drift_across_ranks_and_frozen_tensors_keep_every_bit(name, ddp_runs):
    r0, r1 = (rank[name] for rank in ddp_runs)
    assert r0["params"] == r1["params"], "parameters differ across ranks"
    assert r0["frozen_buffers"] == r1["frozen_buffers"], "frozen buffers differ across ranks"
    assert r0["frozen_moved"] == r1["frozen_moved"] == [[]] * len(r0["frozen_moved"])
