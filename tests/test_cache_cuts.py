"""freeze.cache.cuts: where the frozen prefix ends, found by running the model: a cut is served
only where serving it is exact (one value crosses it, one value per sample, not random), and the
model's own forward runs around it."""

import pytest
import torch
import torchvision
from torch import nn

from freeze.cache import CacheConfig
from tests.cache_harness import cache_step as _step
from tests.cache_harness import cached_freezer as _freezer
from tests.tiny_models import TinyNet


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.c, self.head = nn.Conv2d(4, 4, 3, padding=1), nn.Linear(4, 5)

    def forward(self, x):
        a = self.a(x)
        h = self.c(self.b(a)) + a  # a skip over two blocks: a is still needed after c starts
        return self.head(h.mean((2, 3)))


def test_a_cut_crossed_by_two_values_falls_back_to_the_valid_cut_below():
    freezer = _freezer(_Branchy(), CacheConfig("memory"))
    freezer.set_boundary(2)
    _step(freezer)
    assert freezer.cache.level == 1 and "serving" in freezer.cache.status
    assert "reads more of the prefix than the output of block 'b'" in freezer.cache.cuts.why_not(2)
    x = torch.randn(3, 3, 8, 8)
    keys = torch.tensor([0, 1, 2])
    expected = freezer.cache.compute_prefix(freezer.cache.source.inputs(keys), 1)
    assert torch.equal(freezer.cache.read(keys, torch.device("cpu")), expected)
    assert freezer.module(x, sample_ids=keys).shape == (3, 5)


class _Untraceable(TinyNet):
    def forward(self, x):
        h = self.block2(self.block1(self.stem(x)))
        if h.sum() > 0:  # control flow on tensor values: torch.fx could not trace it
            h = -h
        return self.head(self.flatten(self.pool(h)))


def test_a_forward_with_data_dependent_control_flow_is_served_exactly():
    # Nothing is traced: the model's own forward runs, its branches on the batch's values included.
    # (A branch on the whole batch BEFORE the cut would make a sample's entry depend on its batch,
    # which the cache refuses; see test_a_batch_dependent_prefix_is_not_cached.)
    freezer = _freezer(_Untraceable(), CacheConfig("memory"))
    freezer.set_boundary(2)
    _step(freezer)
    assert freezer.cache.level == 2
    keys = torch.tensor([3, 1, 7])
    x = freezer.cache.source.inputs(keys)
    assert torch.equal(freezer.module(x, sample_ids=keys), freezer.model(x))
    assert freezer.cache.counters.hit_keys == 4 + 3


class _BatchCentered(TinyNet):
    def forward(self, x):
        h = self.stem(x)
        h = h - h.mean(0, keepdim=True)  # glue: every sample's value depends on its batch
        return self.head(self.flatten(self.pool(self.block2(self.block1(h)))))


class _Center(nn.Module):
    def forward(self, h):
        return h - h.mean(0, keepdim=True)


def test_batch_dependent_glue_runs_live_and_a_batch_dependent_block_is_not_cached():
    glue = _freezer(_BatchCentered(), CacheConfig("memory"))
    glue.set_boundary(1)
    _step(glue)
    # the entry of block1 mixes samples; the stem's output does not, and the centering runs live
    assert glue.cache.level == 1 and glue.cache.cuts.cut[1].kind == "exit"
    keys = torch.tensor([2, 7, 4])
    x = glue.cache.source.inputs(keys)
    assert torch.equal(glue.module(x, sample_ids=keys), glue.model(x))
    inside = TinyNet()
    inside.stem.append(_Center())  # inside a frozen block: no cut at 1 holds one value per sample
    freezer = _freezer(inside, CacheConfig("memory"))
    freezer.set_boundary(1)
    _step(freezer)
    assert freezer.cache.level is None and "mixes the samples of a batch" in freezer.cache.status


class _RandomStem(TinyNet):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.stem.append(module)


@pytest.mark.parametrize("module", [nn.Dropout(0.5), torchvision.ops.StochasticDepth(0.2, "row")])
def test_random_prefix_is_not_cached(module):
    # frozen_mode="train" keeps dropout on in frozen blocks: the prefix has no single output
    freezer = _freezer(_RandomStem(module), CacheConfig("memory"), frozen_mode="train")
    freezer.set_boundary(2)
    _step(freezer)
    assert freezer.cache.level is None and "is random in training" in freezer.cache.status


@pytest.mark.parametrize("module", [nn.Dropout(0.5), torchvision.ops.StochasticDepth(0.2, "row")])
def test_frozen_blocks_run_like_inference_so_their_dropout_is_cached(module):
    freezer = _freezer(_RandomStem(module), CacheConfig("memory"))  # frozen_mode="eval", the default
    freezer.set_boundary(2)
    _step(freezer)
    assert freezer.cache.level == 2
    keys = torch.tensor([0, 5, 9])
    x = freezer.cache.source.inputs(keys)
    torch.manual_seed(0)
    served = freezer.module(x, sample_ids=keys)
    torch.manual_seed(0)
    assert torch.equal(served, freezer.model(x))


class _Token(nn.Module):
    """A parameter the model owns itself, read between two blocks (ViT's class_token, pos_embedding):
    split_blocks gives it to the block that first uses it, so it trains with that block."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.token = nn.Parameter(torch.zeros(1, 4, 1, 1))
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        return self.head(self.b(self.a(x) + self.token).mean((2, 3)))


def test_a_block_parameter_read_outside_its_module_stays_in_the_tail():
    model = _Token()
    freezer = _freezer(model, CacheConfig("memory"))
    assert "token" in freezer.blocks[1].param_names
    freezer.set_boundary(1)  # the token trains: the cut must sit before it, not after the addition
    _step(freezer)
    cut = freezer.cache.cuts.cut[1]  # a's output: the addition of the token runs live
    assert freezer.cache.level == 1 and (cut.kind, cut.module) == ("exit", model.a)
    keys = torch.tensor([0, 1, 2])
    x = freezer.cache.source.inputs(keys)
    with torch.no_grad():
        model.token.add_(1.0)  # what a training step does to it
        assert torch.equal(freezer.module(x, sample_ids=keys), model(x))
