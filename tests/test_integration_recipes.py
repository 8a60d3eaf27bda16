"""The recipes of docs/integrations/accelerate.md and timm.md, executed as written (rebuilt from
their diff blocks) on 2 gloo ranks in one spawn: exact bytes at every step with gradient
accumulation (``accelerator.accumulate`` and timm's ``model.no_sync()`` reach
``freezer.module.no_sync()``), frozen blocks and their BatchNorm statistics unmoved, ranks
identical, the boundary moving every epoch."""

from __future__ import annotations

import os

import pytest
import torch

from tests import doc_scripts
from tests.distributed_harness import run_distributed

pytest.importorskip("accelerate")
pytest.importorskip("timm")


def _run_doc(doc, workdir):
    from freeze.freezer import Freezer

    steps, params, buffers, freezers = [], [], [], []
    after_backward = Freezer.after_backward

    def recording(self, *args, **kwargs):  # the page's call, observed from outside
        after_backward(self, *args, **kwargs)
        freezers[:] = [self]
        steps.append((self.counters.allreduce_bytes_last_step, self.trainable_grad_bytes, self.boundary))
        params.append([p.detach().clone() for p in self.model.parameters()])
        buffers.append({n: b.detach().clone() for n, b in self.model.named_buffers()})

    Freezer.after_backward = recording
    try:
        doc_scripts.load(doc, "after", workdir)["main"]()
    finally:
        Freezer.after_backward = after_backward
    f = freezers[0]
    return {
        "steps": steps,
        "params": params,
        "buffers": buffers,
        "block_of_param": [
            next(i for i, b in enumerate(f.blocks) if any(p is q for q in b.params)) for p in f.model.parameters()
        ],
        "block_buffers": [[n for n, _, _ in b.buffers()] for b in f.blocks],
        "decisions": [(d.epoch, d.boundary_before, d.boundary_after) for d in f.decisions],
        "interval_steps": [s.steps for s in f.history],
    }


def recipes_worker(rank, world, workdir):
    for k, v in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}.items():
        os.environ[k] = str(v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    return {doc: _run_doc(doc, workdir) for doc in ("accelerate.md", "timm.md")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("recipes")
    return run_distributed(recipes_worker, 2, workdir, str(workdir), deadline_s=180)


DOCS = ["accelerate.md", "timm.md"]


def test_the_documented_recipes_move_the_boundary_every_epoch_with_accumulation(runs):
    # gradual-unfreeze: all but the head frozen, one block unfrozen per epoch
    assert runs[0]["accelerate.md"]["decisions"] == [(0, 3, 2), (1, 2, 1), (2, 1, 0)]  # 4 blocks
    assert runs[0]["timm.md"]["decisions"] == [(0, 5, 4), (1, 4, 3), (2, 3, 2), (3, 2, 1)]  # test_resnet: 6 groups
    for doc in DOCS:
        assert runs[0][doc]["interval_steps"] == [4, 4, 4, 4]  # 8 micro-batches per rank and epoch, 2 per step


@pytest.mark.parametrize("doc", DOCS)
def test_bytes_sent_per_step_equal_the_trainable_gradient_bytes(runs, doc):
    for r in runs:
        steps = r[doc]["steps"]
        assert all(sent == trainable for sent, trainable, _ in steps), steps
        assert len({k for _, _, k in steps}) == 4


@pytest.mark.parametrize("doc", DOCS)
def test_frozen_blocks_and_their_statistics_do_not_move_and_ranks_are_identical(runs, doc):
    r0, r1 = runs[0][doc], runs[1][doc]
    for t in range(1, len(r0["steps"])):
        k = min(r0["steps"][t - 1][2], r0["steps"][t][2])  # blocks frozen from snapshot t-1 to snapshot t
        for i, block in enumerate(r0["block_of_param"]):
            if block < k:
                assert torch.equal(r0["params"][t][i], r0["params"][t - 1][i]), (t, i)
        for name in (n for b in r0["block_buffers"][:k] for n in b):
            assert torch.equal(r0["buffers"][t][name], r0["buffers"][t - 1][name]), (t, name)
            assert torch.equal(r0["buffers"][t][name], r1["buffers"][t][name]), (t, name)
        for a, b in zip(r0["params"][t], r1["params"][t]):
            assert torch.equal(a, b), t
