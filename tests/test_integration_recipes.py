"""The recipes of docs/integrations/accelerate.md and timm.md, executed as written (rebuilt from
their diff blocks) on 2 gloo ranks in one spawn: exact bytes at every step with gradient
accumulation (``accelerator.accumulate`` and timm's ``model.no_sync()`` reach
``freezer.module.no_sync()``), frozen blocks and their BatchNorm statistics unmoved, ranks
identical, the boundary moving every epoch. The same spawn also checks the core's load-order
guarantee (a separate spawn would cost the suite another process start-up)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, make_policy, split_blocks
from tests import doc_scripts
from tests.distributed_harness import run_distributed
from tests.optional_packages import requires
from tests.tiny_models import TinyNet, global_batch

pytestmark = [requires("accelerate", "timm"), pytest.mark.processes]


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
        returned = doc_scripts.load(doc, "after", workdir)["main"]()  # the pages' scripts return freezer.module
    finally:
        Freezer.after_backward = after_backward
    f = freezers[0]
    return {
        # the pages' saving note: the wrapper's keys carry "module.", the bare model's do not
        "saved_keys": {"wrapper": list(returned.state_dict()), "bare": list(f.model.state_dict())},
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
    out = {doc: _run_doc(doc, workdir) for doc in ("accelerate.md", "timm.md")}
    out["load_order"] = load_order_worker(rank, world, f"{workdir}/ckpt.pt")  # shares this spawn
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("recipes")
    return run_distributed(recipes_worker, 2, workdir, str(workdir), deadline_s=180)


DOCS = ["accelerate.md", "timm.md"]


# ----------------------------------------------------------------------- load order, 2 gloo ranks
SCHEDULE = [0, 1, 2, 2, 1, 3]  # the boundary per step: freezes, then moves back (unfreezing), then on
SAVE_AT = 4  # the checkpoint is written after this many steps (boundary 1, after an unfreeze)


def _train(freezer, optimizer, model, steps, rank, world):
    local = 8 // world
    for step in steps:
        freezer.set_boundary(SCHEDULE[step])
        freezer.train()
        x, y = global_batch(step, 8)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(
            freezer.module(x[rank * local : (rank + 1) * local]), y[rank * local : (rank + 1) * local]
        ).backward()
        freezer.after_backward()
        optimizer.step()


def _snapshot(model, optimizer):
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()},
    }


def load_order_worker(rank, world, ckpt_path):
    def build():
        torch.manual_seed(0)
        model = TinyNet()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        return model, optimizer, Freezer(model, split_blocks(model), make_policy("none"), optimizer=optimizer)

    model, optimizer, freezer = build()
    _train(freezer, optimizer, model, range(SAVE_AT), rank, world)
    if rank == 0:
        torch.save(freezer.training_state_dict(), ckpt_path)
    torch.distributed.barrier()
    freezer.close()
    results = {}
    for order in ("documented", "optimizer_first"):
        model, optimizer, freezer = build()
        state = torch.load(ckpt_path, weights_only=True)
        if order == "documented":
            freezer.load_training_state_dict(state)
        else:  # accelerate's load_state and timm's resume: model, optimizer, then the Freezer
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            freezer.load_state_dict(state["freezer"])
        loaded = _snapshot(model, optimizer)
        _train(freezer, optimizer, model, range(SAVE_AT, len(SCHEDULE)), rank, world)
        results[order] = {"loaded": loaded, "end": _snapshot(model, optimizer), "boundary": freezer.boundary}
        freezer.close()
    return results


def test_loading_the_freezer_after_the_optimizer_gives_the_same_bits_as_the_documented_order(runs):
    """Accelerate's load_state and timm's resume load the optimizer before the Freezer: the same
    bits as the documented order (model, Freezer, optimizer), through an unfreeze before the save."""
    ranks = [r["load_order"] for r in runs]
    for r in ranks:
        doc, other = r["documented"], r["optimizer_first"]
        assert doc["boundary"] == other["boundary"] == SCHEDULE[-1]
        for when in ("loaded", "end"):
            assert doc[when]["model"].keys() == other[when]["model"].keys()
            for k in doc[when]["model"]:
                assert torch.equal(doc[when]["model"][k], other[when]["model"][k]), (when, k)
            assert doc[when]["optimizer"].keys() == other[when]["optimizer"].keys(), when
            for i, s in doc[when]["optimizer"].items():
                for k in s:
                    assert torch.equal(s[k], other[when]["optimizer"][i][k]), (when, i, k)
    for k, v in ranks[0]["documented"]["end"]["model"].items():
        assert torch.equal(v, ranks[1]["documented"]["end"]["model"][k]), k


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


@pytest.mark.parametrize("doc", DOCS)
def test_saving_the_returned_module_prefixes_every_key_and_freezer_model_saves_the_bare_keys(runs, doc):
    """A user who saved `model.state_dict()` after `model = freezer.module` got keys that a bare model
    does not load (issue 32); the pages say to save `freezer.model.state_dict()`."""
    keys = runs[0][doc]["saved_keys"]
    assert keys["bare"] and all(k.startswith("module.") for k in keys["wrapper"])
    assert [k.removeprefix("module.") for k in keys["wrapper"]] == keys["bare"]
    assert not any(k.startswith("module.") for k in keys["bare"])
    page = (Path(__file__).parents[1] / "docs" / "integrations" / doc).read_text()
    assert "freezer.model.state_dict()" in page
