"""freeze.freezer.steering: what a boundary does to the model's parameters and modules (frozen blocks record
no autograd graph and run in eval, the user's frozen parameters stay frozen), the block-order check, the
no-step warnings, and hooks that leave copies of the model alone and come off at close."""

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, make_policy, split_blocks
from freeze.blocks import Block
from freeze.freezer.steering import BlockOrderError
from tests.tiny_models import InstanceNormNet, SharedLayerNet, TiedLM, TinyNet, global_batch
from tests.tiny_models import freezer_step as _step


def _hooks(module: torch.nn.Module) -> int:
    return len(module._forward_pre_hooks) + len(module._forward_hooks)


def test_frozen_prefix_records_no_graph_and_carries_no_hook_pair():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model))
    freezer.set_boundary(2)
    seen = {}
    model.block1[0].register_forward_hook(lambda m, a, out: seen.update(prefix=out.grad_fn))
    out = model(torch.randn(2, 3, 8, 8))
    assert seen["prefix"] is None  # no graph inside the frozen prefix
    assert torch.is_grad_enabled() and out.requires_grad
    # Issue 49: autograd records nothing where neither input nor parameters require grad, so the
    # frozen modules carry no hooks of their own (a pre/post pair each cost host time every forward);
    # only the prefix's first block holds its modules in eval (the order check is gone after one forward).
    assert _hooks(model.stem) == 1 and _hooks(model.block1) == 0
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5, 8, 8))
    assert torch.is_grad_enabled()


def test_a_frozen_module_holding_a_trained_tied_weight_adds_no_gradient_to_it():
    """Blocks made by hand: the embedding is frozen, the weight it shares with the head is held (and
    trained) by the head's block. The frozen use must not add to its gradient: as if its output were
    detached."""
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    found = split_blocks(model)  # embed (with the tied weight), layers.0 .. layers.2
    weight = model.embed.weight
    blocks = [Block("embed", ("embed",), (model.embed,), (), ())] + found[1:]
    blocks.append(Block("head", ("head",), (model.head,), ("head.weight",), (weight,)))
    freezer = Freezer(model, blocks)
    freezer.set_boundary(1)
    tokens = torch.randint(0, 11, (4, 5))
    freezer.module(tokens).sum().backward()
    # after the first forward (the order check is gone): eval at the prefix's start, grad pre/post
    assert weight.requires_grad and _hooks(model.embed) == 3

    x = reference.embed(tokens).detach()
    for layer in reference.layers:
        x = layer(x)
    reference.head(x).sum().backward()
    torch.testing.assert_close(weight.grad, reference.embed.weight.grad)
    assert torch.is_grad_enabled()


def test_a_submodule_called_instead_of_the_model_still_runs_its_frozen_blocks_in_eval():
    """A trainer that calls a child of the model the Freezer steers (Lightning's training_step calling
    self.net) never runs the model's own forward hook: the prefix's first block holds them in eval."""

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = TinyNet()

    wrapper = Wrapper()
    freezer = Freezer(wrapper, split_blocks(wrapper, names=["net.stem", "net.block1", "net.block2", "net.head"]))
    freezer.set_boundary(2)
    wrapper.train()  # as Lightning does after each validation
    assert wrapper.net.block1[1].training
    before = wrapper.net.block1[1].running_mean.clone()
    wrapper.net(torch.randn(4, 3, 8, 8))
    assert not wrapper.net.stem[1].training and not wrapper.net.block1[1].training
    assert torch.equal(wrapper.net.block1[1].running_mean, before)
    assert wrapper.net.block2[1].training


def test_frozen_instance_norm_with_running_stats_is_frozen_like_batchnorm():
    torch.manual_seed(0)
    model = InstanceNormNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer)
    freezer.set_boundary(1)
    model.train()  # a plain train() must not wake it up either
    frozen_norm, trainable_norm = model[0][1], model[1][1]
    before = {n: b.clone() for n, b in model.named_buffers()}
    _step(freezer, optimizer, 0)
    assert not frozen_norm.training and trainable_norm.training
    assert torch.equal(frozen_norm.running_mean, before["0.1.running_mean"])
    assert torch.equal(frozen_norm.running_var, before["0.1.running_var"])
    assert not torch.equal(trainable_norm.running_mean, before["1.1.running_mean"])


def test_frozen_module_called_after_a_trainable_one_passes_the_gradient_through():
    torch.manual_seed(0)
    model = SharedLayerNet()
    reference = copy.deepcopy(model)
    freezer = Freezer(model, split_blocks(model))
    freezer.set_boundary(1)  # proj frozen; it also runs after the trainable mid
    reference.proj.requires_grad_(False)
    x, y = global_batch(0, 8)
    for net in (freezer.module, reference):
        F.cross_entropy(net(x), y).backward()
    assert model.proj.weight.grad is None
    for name in ("mid.weight", "mid.bias", "head.weight"):
        got, want = model.get_parameter(name).grad, reference.get_parameter(name).grad
        assert got is not None, name
        torch.testing.assert_close(got, want, msg=name)


def test_parameters_the_user_froze_stay_frozen_at_every_boundary_and_are_not_counted():
    torch.manual_seed(0)
    model = TinyNet()
    model.stem.requires_grad_(False)  # frozen by the user before the Freezer
    stem = [p.detach().clone() for p in model.stem.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer)
    stem_bytes = sum(p.numel() * p.element_size() for p in model.stem.parameters())
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert freezer.trainable_grad_bytes == all_bytes - stem_bytes
    per_block = freezer._steering.block_grad_bytes  # what a policy pricing bytes (payoff) is given
    assert per_block[0] == 0 and sum(per_block) == all_bytes - stem_bytes
    for k in (0, 2, 1, 0):  # freeze past it and unfreeze below it again
        freezer.set_boundary(k)
        assert not any(p.requires_grad for p in model.stem.parameters())
        x, y = global_batch(k, 4)
        F.cross_entropy(freezer.module(x), y).backward()
        freezer.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(stem, model.stem.parameters()))
    assert model.block1[0].weight.grad is None and not torch.equal(model.head.weight, TinyNet().head.weight)


def test_blocks_out_of_forward_order_raise_one_line_naming_both():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model, names=["block1", "stem", "block2", "head"]))
    x, _ = global_batch(0, 4)
    with pytest.raises(BlockOrderError) as info:
        freezer.module(x)
    message = str(info.value)
    assert "\n" not in message and "'block1' (block 0) ran after block 'stem' (block 1)" in message
    assert torch.is_grad_enabled()


class _BlockOneFirst(TinyNet):
    """When ``swap`` is set, its forward runs block1 (on a zero input) before stem."""

    swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swap:
            self.block1(torch.zeros(x.shape[0], 8, x.shape[2], x.shape[3]))
        return super().forward(x)


def test_order_is_checked_on_the_first_model_forward_after_each_boundary_change_only():
    model = _BlockOneFirst()
    freezer = Freezer(model, split_blocks(model))
    x, _ = global_batch(0, 4)
    freezer.module(x)  # checked: in order
    model.swap = True
    freezer.module(x)  # not the first forward after a change: not checked
    model.block1(model.stem(x))  # blocks called outside a model forward (as a cache's tail does): not checked
    freezer.set_boundary(2)
    with pytest.raises(BlockOrderError, match="'stem' \\(block 0\\) ran after block 'block1'"):
        freezer.module(x)


def test_deepcopy_made_after_the_freezer_is_not_steered_by_it():
    """An EMA copy (torchvision's reference makes one after wrapping) runs as a plain model."""
    torch.manual_seed(0)
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model), grad_checkpointing=True)
    freezer.set_boundary(2)  # stem, block1 frozen; block2 checkpointed
    ema = copy.deepcopy(model)
    x, _ = global_batch(0, 4)
    h = ema.stem(x)
    freezer.set_boundary(1)  # moves only the original's boundary, and arms its block-order check
    ema.block1(h)  # the copy's calls, out of order, do not feed the original's check
    ema.stem(x)
    ema.train()
    out = ema(x)
    assert ema.stem[1].training and ema.block1[1].training  # no frozen-BN steering
    assert out.requires_grad and ema.stem[0].weight.requires_grad is False  # copied flags, own autograd
    ema.stem[0].weight.requires_grad_(True)
    ema(x).sum().backward()
    assert ema.stem[0].weight.grad is not None  # its stem no longer runs under no_grad
    with torch.no_grad():  # the copy's checkpointed block runs the copy's own weights
        for p in ema.block2.parameters():
            p.zero_()
        assert torch.count_nonzero(ema.block2(model.block1(model.stem(x)))) == 0
    freezer.module(x)  # the original's check sees only the original's forward
    restored = pickle.loads(pickle.dumps(model))  # torch.save(model) pickles the hooks: inert ones
    restored.train()
    restored(x)
    assert restored.stem[1].training


def test_forgotten_after_backward_is_reported_once_at_the_end_of_the_epoch():
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    freezer = Freezer(model, split_blocks(model), make_policy("autofreeze"), optimizer=optimizer)
    x, y = global_batch(0, 4)
    freezer.train()
    for _ in range(2):
        optimizer.zero_grad()
        F.cross_entropy(freezer.module(x), y).backward()
        optimizer.step()
    with pytest.warns(RuntimeWarning, match="epoch 0 ran 2 training forward passes but after_backward"):
        freezer.end_epoch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(freezer, optimizer, 1)
        with torch.no_grad():
            freezer.eval()
            model(x)  # evaluation forwards do not count
        freezer.end_epoch(1)


def test_close_takes_the_freezers_hooks_off_the_model_so_a_second_freezer_steers_alone():
    model = TinyNet()
    first = Freezer(model, split_blocks(model), make_policy("static", k=2))
    hooks = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())  # noqa: E731
    assert hooks() > 0
    first.close()
    assert hooks() == 0
    second = Freezer(model, split_blocks(model))
    x, y = global_batch(0, 4)
    F.cross_entropy(second.module(x), y).backward()  # boundary 0: nothing of the first Freezer runs
    assert model.stem[0].weight.grad is None  # requires_grad as the first Freezer left it (frozen)
    with pytest.raises(RuntimeError, match="closed"):
        first.module(x)
