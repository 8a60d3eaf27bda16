"""The Accelerate recipe of docs/integrations/accelerate.md, executed as written on 2 gloo ranks:
exact bytes at every step (accumulation included: ``accelerator.accumulate`` reaches
``freezer.module.no_sync()``), frozen blocks unmoved, ranks identical, the boundary moving."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("accelerate")

import torch

from tests import doc_scripts
from tests.distributed_harness import run_distributed


def accelerate_worker(rank, world, workdir):
    for k, v in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}.items():
        os.environ[k] = str(v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from freeze.freezer import Freezer

    steps, params, freezers = [], [], []
    after_backward = Freezer.after_backward

    def recording(self, *args, **kwargs):  # the doc's call, observed from outside
        after_backward(self, *args, **kwargs)
        freezers[:] = [self]
        steps.append((self.counters.allreduce_bytes_last_step, self.trainable_grad_bytes, self.boundary))
        params.append([p.detach().clone() for p in self.model.parameters()])

    Freezer.after_backward = recording
    try:
        doc = doc_scripts.load("accelerate.md", "after", workdir)
        doc["main"]()
    finally:
        Freezer.after_backward = after_backward
    f = freezers[0]
    return {
        "steps": steps,
        "params": params,
        "block_of_param": [
            next(i for i, b in enumerate(f.blocks) if any(p is q for q in b.params)) for p in f.model.parameters()
        ],
        "decisions": [(d.epoch, d.boundary_before, d.boundary_after) for d in f.decisions],
        "interval_steps": [s.steps for s in f.history],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("accelerate")
    return run_distributed(accelerate_worker, 2, workdir, str(workdir), deadline_s=180)


def test_the_documented_recipe_moves_the_boundary_with_accumulation(runs):
    r0 = runs[0]
    assert r0["decisions"] == [(0, 3, 2), (1, 2, 1), (2, 1, 0)]  # gradual-unfreeze over 4 blocks
    assert r0["interval_steps"] == [4, 4, 4, 4]  # 8 micro-batches per rank and epoch, 2 per step


def test_bytes_sent_per_step_equal_the_trainable_gradient_bytes(runs):
    for r in runs:
        assert all(sent == trainable for sent, trainable, _ in r["steps"]), r["steps"]
        assert len({k for _, _, k in r["steps"]}) == 4


def test_frozen_blocks_do_not_move_and_ranks_are_identical(runs):
    r0, r1 = runs
    for t in range(1, len(r0["steps"])):
        k = r0["steps"][t - 1][2]  # the boundary of the optimizer step between snapshots t-1 and t
        for i, block in enumerate(r0["block_of_param"]):
            if block < k:
                assert torch.equal(r0["params"][t][i], r0["params"][t - 1][i]), (t, i)
        for a, b in zip(r0["params"][t], r1["params"][t]):
            assert torch.equal(a, b), t
