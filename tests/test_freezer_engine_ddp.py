"""The forward path on real gloo ranks: what users froze, weights loaded late, rank divergence,
Hugging Face BERT and torchvision ViT served from the cache, and placements agreed by every rank."""

import os

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel

from freeze import CacheConfig, CacheSource, Freezer, split_blocks
from freeze.cache import CacheError
from freeze.freezer.engine import RankMismatchError
from tests.distributed_harness import run_distributed
from tests.tiny_models import TinyNet, global_batch

pytestmark = pytest.mark.processes

N_KEYS = 16


def _images(n: int = N_KEYS, shape=(3, 8, 8)) -> torch.Tensor:
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(0))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(freezer, optimizer, batches, schedule, rank, world):
    """One step per entry of ``schedule`` (the boundary before it); returns bytes per step."""
    sent = []
    for step, k in enumerate(schedule):
        freezer.set_boundary(k)
        freezer.train()
        inputs, y, keys = batches(step)
        local = slice(rank * len(keys) // world, (rank + 1) * len(keys) // world)
        args = inputs(keys[local])  # a dict: keyword arguments (a Hugging Face model); else positional
        if isinstance(args, dict):
            out = freezer.module(**args, sample_ids=keys[local])
        else:
            out = freezer.module(*args, sample_ids=keys[local])
        logits = out.logits if hasattr(out, "logits") else out
        F.cross_entropy(logits, y[keys[local]]).backward()
        freezer.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sent.append((freezer.counters.allreduce_bytes_last_step, freezer.trainable_grad_bytes))
    return sent


def _image_batches(x: torch.Tensor, classes: int = 5):
    y = torch.randint(0, classes, (x.shape[0],), generator=torch.Generator().manual_seed(1))

    def batches(step):
        keys = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(step))[:8]
        return (lambda k: (x[k],)), y, keys

    return batches


def user_frozen(rank, world) -> dict:
    torch.manual_seed(0)
    model = TinyNet()
    model.stem.requires_grad_(False)
    stem = _flat(model.stem).clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer)
    sent = _train(freezer, optimizer, _image_batches(_images()), [0, 0, 2, 2, 1, 0], rank, world)
    freezer.close()
    return {"sent": sent, "stem_same": torch.equal(stem, _flat(model.stem)), "params": _flat(model)}


def loaded_late(rank, world) -> dict:
    """The same training, weights loaded before Freezer(...) and after it (every rank loads)."""
    x = _images()
    torch.manual_seed(1)
    pretrained = TinyNet().state_dict()
    out = {}
    for order in ("before", "after"):
        torch.manual_seed(2)
        model = TinyNet()
        if order == "before":
            model.load_state_dict(pretrained)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        source = CacheSource(lambda k: x[k], N_KEYS)
        freezer = Freezer(model, split_blocks(model), optimizer=optimizer, cache="memory", cache_source=source)
        if order == "after":
            model.load_state_dict(pretrained)
        _train(freezer, optimizer, _image_batches(x), [2, 2, 2], rank, world)
        held = freezer.cache.store.keys
        served = freezer.cache.store.read(held, torch.device("cpu"))
        out[order] = {
            "params": _flat(model),
            "served_error": (served - freezer.cache.compute_prefix(x[held], 2)).abs().max().item(),
        }
        freezer.close()
    return out


def loaded_on_rank0_only(rank, world) -> dict:
    torch.manual_seed(0)
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model))
    if rank == 0:
        torch.manual_seed(7)
        model.load_state_dict(TinyNet().state_dict())
    x, _ = global_batch(0, 4)
    try:
        freezer.module(x)
        return {"error": None}
    except RankMismatchError as e:
        return {"error": str(e)}
    finally:
        freezer.close()


def wrapped(rank, world) -> dict:
    ddp = DistributedDataParallel(TinyNet())
    try:
        Freezer(ddp, split_blocks(ddp))
        return {"error": None}
    except ValueError as e:
        return {"error": str(e)}


def _bert_inputs():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    ids = torch.randint(0, 64, (N_KEYS, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, 7:] = 0
    y = torch.randint(0, 3, (N_KEYS,), generator=torch.Generator().manual_seed(1))

    def batches(step):
        keys = torch.randperm(N_KEYS, generator=torch.Generator().manual_seed(step))[:8]
        return (lambda k: {"input_ids": ids[k], "attention_mask": mask[k]}), y, keys

    return (
        (lambda: BertForSequenceClassification(config)),
        batches,
        (lambda k: {"input_ids": ids[k], "attention_mask": mask[k]}),
    )


def _vit_inputs():
    x = _images(shape=(3, 16, 16))

    def build():
        return torchvision.models.VisionTransformer(16, 4, 2, 2, 16, 32, num_classes=5)

    return build, _image_batches(x), (lambda k: x[k])


def served_models(rank, world) -> dict:
    """BERT (dropout 0.1 everywhere) and ViT, 6 steps through freeze, advance and unfreeze, with the
    cache and without it: the same parameters, bit for bit."""
    out = {}
    for name, inputs in (("bert", _bert_inputs), ("vit", _vit_inputs)):
        build, batches, source_inputs = inputs()
        runs = {}
        for cache in ("off", "memory"):
            torch.manual_seed(0)
            model = build()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            source = CacheSource(lambda k, f=source_inputs: f(k), N_KEYS) if cache != "off" else None
            freezer = Freezer(model, split_blocks(model), optimizer=optimizer, cache=cache, cache_source=source)
            torch.manual_seed(10 + rank)  # the tail's dropout draws, the same in both runs
            _train(freezer, optimizer, batches, [0, 2, 2, 3, 3, 1], rank, world)
            runs[cache] = {"params": _flat(model), "levels": None}
            if freezer.cache is not None:
                runs[cache]["hits"] = freezer.cache.counters.hit_keys
            freezer.close()
        out[name] = runs
    return out


def budget_per_node(rank, world) -> dict:
    """Two private copies on one node count twice against the node's budget."""
    x = _images()
    store_bytes = N_KEYS * 8 * 8 * 8 * 4  # the stem's output, fp32
    out = {}
    for mode in ("memory", "disk"):
        model = TinyNet()
        config = CacheConfig(mode, budget_bytes=int(1.5 * store_bytes), node_shared=False)
        freezer = Freezer(model, split_blocks(model), cache=config, cache_source=CacheSource(lambda k: x[k], N_KEYS))
        try:
            freezer.set_boundary(1)
            freezer.train()
            freezer.module(x[:4], sample_ids=torch.arange(4))
            out[mode] = freezer.cache.store.placement
        except CacheError as e:
            out[mode] = str(e)
        freezer.close()
    return out


SCENARIOS = {
    "user_frozen": user_frozen,
    "loaded_late": loaded_late,
    "loaded_on_rank0_only": loaded_on_rank0_only,
    "wrapped": wrapped,
    "served_models": served_models,
    "budget_per_node": budget_per_node,
}


def worker(rank: int, world: int) -> dict:
    return {name: fn(rank, world) for name, fn in SCENARIOS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(worker, 2, tmp_path_factory.mktemp("engine-ddp"), deadline_s=300)


def test_user_frozen_parameters_are_not_trained_sent_or_counted(runs):
    for r in runs:
        out = r["user_frozen"]
        assert out["stem_same"]
        assert all(sent == trainable for sent, trainable in out["sent"]), out["sent"]
    assert torch.equal(runs[0]["user_frozen"]["params"], runs[1]["user_frozen"]["params"])


def test_weights_loaded_after_the_freezer_train_as_if_loaded_before(runs):
    for r in runs:
        out = r["loaded_late"]
        assert out["after"]["served_error"] == 0.0
        assert torch.equal(out["after"]["params"], out["before"]["params"])


def test_ranks_that_loaded_different_weights_are_refused_at_the_first_step(runs):
    for r in runs:
        message = r["loaded_on_rank0_only"]["error"]
        assert message is not None and "\n" not in message and "rank 1 holds other weights than rank 0" in message


def test_a_model_already_wrapped_in_ddp_is_refused_in_one_line(runs):
    message = runs[0]["wrapped"]["error"]
    assert message is not None and "\n" not in message and "pass the bare model" in message


@pytest.mark.parametrize("name", ["bert", "vit"])
def test_hugging_face_bert_and_torchvision_vit_train_bitwise_alike_with_the_cache(runs, name):
    for r in runs:
        out = r["served_models"][name]
        assert out["memory"]["hits"] > 0
        assert torch.equal(out["memory"]["params"], out["off"]["params"])
    assert torch.equal(
        runs[0]["served_models"][name]["memory"]["params"], runs[1]["served_models"][name]["memory"]["params"]
    )


def test_the_budget_is_per_node_and_counts_every_private_copy(runs):
    for r in runs:
        out = r["budget_per_node"]
        assert "2 copies, one per local rank" in out["memory"] and "\n" not in out["memory"]
        assert out["disk"] == "disk"


def uneven_nodes(rank: int, world: int) -> dict:
    os.environ["GROUP_RANK"] = "0" if rank < 2 else "1"  # node 0: ranks 0 and 1; node 1: rank 2
    x = _images()
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model), cache="memory", cache_source=CacheSource(lambda k: x[k], N_KEYS))
    freezer.set_boundary(2)
    freezer.train()
    freezer.module(x[:3], sample_ids=torch.arange(3))
    out = {"placement": freezer.cache.store.placement, "node_of": freezer.cache.topology.node_of}
    freezer.close()
    return out


def test_uneven_ranks_per_node_agree_on_one_placement_instead_of_hanging(tmp_path):
    outs = run_distributed(uneven_nodes, 3, tmp_path, deadline_s=120, collective_timeout_s=30)
    assert [o["node_of"] for o in outs] == [(0, 0, 1)] * 3
    assert len({o["placement"] for o in outs}) == 1
