"""The forward path (freeze.freezer.engine) and the cache's correctness outside the happy path, one process.

Each test reproduces a defect of issue 21 (the review in shared/research/correctness.md, with the
experiment it names) and checks what must hold instead. Multi-rank cases: tests/test_freezer_engine_ddp.py.
"""

import random

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from freeze import CacheConfig, CacheSource, Freezer, make_policy, split_blocks
from freeze.cache import CacheError
from tests.tiny_models import TinyNet

N_KEYS = 16


def images(seed: int = 0, n: int = N_KEYS, shape=(3, 8, 8)) -> torch.Tensor:
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


def cached(model, x, config="memory", **kwargs) -> Freezer:
    source = CacheSource(lambda k: x[k], x.shape[0])
    return Freezer(model, split_blocks(model), cache=config, cache_source=source, **kwargs)


def step(freezer: Freezer, x: torch.Tensor, keys: torch.Tensor, optimizer=None) -> torch.Tensor:
    freezer.train()
    out = freezer.module(x[keys], sample_ids=keys)
    F.cross_entropy(out, torch.zeros(len(keys), dtype=torch.long)).backward()
    freezer.after_backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out.detach()


def served_error(freezer: Freezer, x: torch.Tensor) -> float:
    """Largest difference between what the store holds and what the current prefix computes."""
    held = freezer.cache.store.keys
    served = freezer.cache.store.read(held, torch.device("cpu"))  # not counted as a hit
    return (served - freezer.cache.compute_prefix(x[held], freezer.cache.level)).abs().max().item()


# ------------------------------------------------------------------ item 5: evaluation through freezer.module
def test_evaluation_through_the_module_runs_the_model_on_its_inputs_while_the_cache_serves():
    x, held_out = images(0), images(1, n=4)
    freezer = cached(TinyNet(), x, policy=make_policy("static", k=2))
    step(freezer, x, torch.arange(4))
    assert freezer.cache_active
    freezer.eval()
    with torch.no_grad():
        out = freezer.module(held_out)  # the README's evaluate(model, ...) with model = freezer.module
        # keys of TRAINING samples must not make an evaluation read the training rows
        with_keys = freezer.module(held_out, sample_ids=torch.arange(4))
    assert torch.equal(out, freezer.model(held_out)) and torch.equal(with_keys, out)


# ------------------------------------------------------------------ item 4: control flow is not frozen
class LayerDrop(nn.Module):
    """Layer drop decided in the model's own forward with Python's random (correctness.md E8)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            if self.training and random.random() < 0.5:
                continue
            x = x + layer(x)
        return self.head(F.dropout(x, 0.3, self.training))  # glue dropout: on in training only


def test_layer_drop_in_the_glue_is_decided_at_every_step_and_eval_applies_no_dropout():
    random.seed(3)
    x = torch.randn(N_KEYS, 4)
    model = LayerDrop()
    freezer = cached(model, x, policy=make_policy("static", k=1))
    got_grad = dict.fromkeys(range(4), 0)
    for _ in range(20):
        model.zero_grad(set_to_none=True)
        step(freezer, x, torch.arange(N_KEYS))
        for i, layer in enumerate(model.layers):
            got_grad[i] += layer.weight.grad is not None
    assert freezer.cache.level == 1 and freezer.cache.counters.hit_keys > 0
    assert all(0 < n < 20 for n in got_grad.values()), got_grad  # each layer trained in some steps, skipped in others
    freezer.eval()
    with torch.no_grad():
        assert torch.equal(freezer.module(x), freezer.module(x))  # no dropout in evaluation


# ------------------------------------------------------------------ item 3: randomness inside blocks
class FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return F.dropout(self.lin(x), 0.5, self.training)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class Seq(nn.Module):
    """embed, two random blocks, head: a frozen prefix that draws random numbers inside its blocks."""

    def __init__(self, block: type[nn.Module]):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([block(), block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean(1))


@pytest.mark.parametrize("block", [FunctionalDropout, Attention])
def test_random_operations_inside_a_block_are_refused_in_train_mode_and_cached_exactly_in_eval_mode(block):
    x = torch.randn(N_KEYS, 5, 4)
    train_mode = cached(Seq(block), x, policy=make_policy("static", k=2), frozen_mode="train")
    step(train_mode, x, torch.arange(4))
    # only the embedding's output is one value per input
    assert train_mode.cache.level == 1 and "random in training" in train_mode.cache.cuts.why_not(2)
    torch.manual_seed(0)
    model = Seq(block)
    freezer = cached(model, x, policy=make_policy("static", k=2))  # frozen blocks run like inference
    step(freezer, x, torch.arange(4))
    assert freezer.cache.level == 2 and served_error(freezer, x) == 0.0
    keys = torch.tensor([3, 8, 1])
    torch.manual_seed(5)
    served = freezer.module(x[keys], sample_ids=keys)
    torch.manual_seed(5)
    assert torch.equal(served, model(x[keys]))


def test_densenet_drop_rate_prefix_is_cached_exactly_with_frozen_blocks_in_eval():
    x = images(0, n=8, shape=(3, 32, 32))
    model = torchvision.models.DenseNet(growth_rate=4, block_config=(1, 1), num_init_features=8, drop_rate=0.5)
    train_mode = cached(model, x, policy=make_policy("static", k=4), frozen_mode="train")
    step(train_mode, x, torch.arange(4))
    assert train_mode.cache.level is None or "random" in train_mode.cache.cuts.why_not(train_mode.cache.level + 1)
    assert all("random" in train_mode.cache.cuts.why_not(k) for k in (2, 3, 4) if k > 1)
    freezer = cached(torchvision.models.DenseNet(4, (1, 1), 8, drop_rate=0.5), x, policy=make_policy("static", k=4))
    step(freezer, x, torch.arange(4))
    assert freezer.cache.level is not None and served_error(freezer, x) == 0.0


# ------------------------------------------------------------------ item 6: mixed precision
def test_under_autocast_the_cache_serves_what_the_forward_without_it_computes():
    x = images(0)
    outs = {}
    for config in ("off", "memory"):
        torch.manual_seed(0)
        model = TinyNet()
        freezer = cached(model, x, config) if config != "off" else Freezer(model, split_blocks(model))
        freezer.set_boundary(2)
        freezer.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            keys = torch.arange(4)
            freezer.module(x[keys], sample_ids=keys)  # the cache builds here, under bf16
            outs[config] = [freezer.module(x[k], sample_ids=k) for k in (torch.tensor([1, 2]), torch.tensor([2, 9]))]
        if config == "memory":
            assert freezer.cache.store.compute_dtype == torch.bfloat16 and freezer.cache.counters.hit_keys >= 4
    assert all(torch.equal(a, b) for a, b in zip(outs["off"], outs["memory"]))
    with pytest.raises(CacheError, match="autocast changed") as err:
        freezer.module(x[:2], sample_ids=torch.arange(2))  # fp32 now: the store holds bf16 activations
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ item 2: weights the cache never saw
def test_weights_loaded_after_the_freezer_are_the_ones_the_cache_serves():
    x = images(0)
    torch.manual_seed(1)
    pretrained = TinyNet().state_dict()
    torch.manual_seed(2)
    model = TinyNet()
    freezer = cached(model, x, policy=make_policy("static", k=2))  # builds from nothing yet: lazily
    model.load_state_dict(pretrained)  # the order DDP users follow: build, then load
    step(freezer, x, torch.arange(4))
    assert freezer.cache.level == 2 and served_error(freezer, x) == 0.0
    with torch.no_grad():
        model.stem[0].weight.mul_(2)  # frozen weights changed behind the cache's back
    with pytest.warns(RuntimeWarning, match="frozen weights changed after the activation cache was built"):
        freezer.end_epoch(0)
    step(freezer, x, torch.arange(4))
    assert served_error(freezer, x) == 0.0


def test_resume_serves_what_the_loaded_weights_compute_whatever_the_constructed_ones_were():
    x = images(0)

    def run(seed: int, state=None, steps=range(4)):
        torch.manual_seed(seed)
        model = TinyNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        freezer = cached(model, x, optimizer=optimizer, policy=make_policy("static", k=2), epochs=3)
        if state is not None:
            freezer.load_training_state_dict(state)
        for i in steps:
            step(freezer, x, torch.arange(4) + 4 * (i % 4), optimizer)
        return freezer

    whole = run(0, steps=range(8))
    first = run(0, steps=range(4))
    resumed = run(1, first.training_state_dict(), steps=range(4, 8))  # constructed from other weights
    assert served_error(resumed, x) == 0.0
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    timing = ("build_s_total", "advance_s_total")
    counts = [{k: v for k, v in vars(f.cache.counters).items() if k not in timing} for f in (resumed, whole)]
    assert counts[0] == counts[1] and resumed.cache.status == whole.cache.status


def test_resume_under_another_storage_dtype_is_refused_in_one_line():
    x = images(0)
    freezer = cached(TinyNet(), x, CacheConfig("memory", storage_dtype="bf16"), policy=make_policy("static", k=2))
    step(freezer, x, torch.arange(4))
    other = cached(TinyNet(), x, CacheConfig("memory"), policy=make_policy("static", k=2))
    with pytest.raises(CacheError, match="resume with storage_dtype='bf16'") as err:
        other.load_state_dict(freezer.state_dict())
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ item 9: inputs the model takes
class DictModel(TinyNet):
    def forward(self, batch):
        return super().forward(batch["image"] * batch["scale"][:, None, None, None])


def test_a_dict_input_model_is_probed_at_construction_and_served_exactly():
    x, scale = images(0), torch.rand(N_KEYS)
    model = DictModel()
    source = CacheSource(lambda k: ({"image": x[k], "scale": scale[k]},), N_KEYS)  # a tuple: model(*inputs)
    freezer = Freezer(model, split_blocks(model), make_policy("static", k=2), cache="memory", cache_source=source)
    keys = torch.tensor([0, 4, 5])
    freezer.train()
    freezer.module(*source.inputs(torch.arange(4)), sample_ids=torch.arange(4))
    assert freezer.cache.level == 2
    assert torch.equal(freezer.module(*source.inputs(keys), sample_ids=keys), model(*source.inputs(keys)))
    wrong = CacheSource(lambda k: {"image": x[k]}, N_KEYS)  # the model needs "scale" too
    other = DictModel()
    with pytest.raises(CacheError, match="the model's forward failed on cache_source.inputs") as err:
        Freezer(other, split_blocks(other), cache="memory", cache_source=wrong)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ item 13: a forgotten after_backward
def test_a_forgotten_after_backward_is_reported_while_the_cache_serves():
    x = images(0)
    freezer = cached(TinyNet(), x, policy=make_policy("static", k=2), epochs=2)
    step(freezer, x, torch.arange(4))
    freezer.end_epoch(0)
    assert freezer.cache_active
    for _ in range(3):
        freezer.module(x[:4], sample_ids=torch.arange(4)).sum().backward()
    with pytest.warns(RuntimeWarning, match="after_backward\\(\\) was never called"):
        freezer.end_epoch(1)


# ------------------------------------------------------------------ item 14: unfreezing policies and auto
def test_auto_does_not_build_for_an_unfreezing_policy_whose_next_step_drops_the_store():
    x = images(0)
    seen = []
    config = CacheConfig("auto", rule=lambda e: seen.append(e) or False)
    freezer = cached(TinyNet(), x, config, policy=make_policy("gradual-unfreeze"), epochs=10)
    step(freezer, x, torch.arange(4))
    # one epoch of reads (16 keys), not ten: the next unfreeze drops the store
    assert seen and seen[0].reads_remaining_per_rank == N_KEYS
    plain = cached(TinyNet(), x, CacheConfig("auto"), policy=make_policy("gradual-unfreeze"), epochs=10)
    step(plain, x, torch.arange(4))
    assert plain.cache.level is None and "does not pay" in plain.cache.status


# ------------------------------------------------------------------ item 16: small things
def test_a_decision_that_cannot_be_applied_is_not_recorded():
    x = images(0)
    config = CacheConfig("memory", budget_bytes=100)
    freezer = cached(TinyNet(), x, config, policy=make_policy("freezeout", t0=0.1), epochs=2)
    step(freezer, x, torch.arange(4))
    with pytest.raises(CacheError, match="over the per-node budget"):
        freezer.end_epoch(0)  # freezeout moves the boundary; the cache refuses it
    assert freezer.decisions == [] and freezer.boundary == 0


def test_budget_refusal_happens_at_construction_for_an_initial_boundary():
    x, model = images(0), TinyNet()
    with pytest.raises(CacheError, match="over the per-node budget"):
        Freezer(
            model,
            split_blocks(model),
            make_policy("static", k=2),
            cache=CacheConfig("memory", budget_bytes=100),
            cache_source=CacheSource(lambda k: x[k], N_KEYS),
        )


def test_an_evaluation_that_forgot_eval_is_said_once_and_a_proper_one_is_silent():
    import warnings

    model = TinyNet()
    freezer = Freezer(model, split_blocks(model))
    x = torch.randn(2, 3, 8, 8)
    freezer.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            freezer.module(x)  # eval mode under no_grad: an evaluation done right
    freezer.train()
    with (
        pytest.warns(RuntimeWarning, match="call freezer.eval\\(\\) before and freezer.train\\(\\) after"),
        torch.no_grad(),
    ):
        freezer.module(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            freezer.module(x)  # said once


def test_the_engines_warnings_point_at_the_users_line():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model))
    freezer.train()
    with pytest.warns(RuntimeWarning, match="freezer.eval") as caught, torch.no_grad():
        freezer.module(torch.randn(2, 3, 8, 8))
    assert caught[0].filename == __file__  # not torch's module.py nor freeze/freezer/engine.py
