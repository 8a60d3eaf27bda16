"""freeze.freezer.recompute: a checkpointed module recomputes its activations in backward with the
gradients and running statistics of a plain backward, and copies of it run plainly."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freeze import Freezer, split_blocks
from freeze.freezer.recompute import disable_checkpointing, enable_checkpointing, is_checkpointed
from tests.tiny_models import InstanceNormNet, TinyNet, global_batch


@pytest.mark.parametrize("net", [TinyNet, InstanceNormNet])
def test_grad_checkpointing_matches_plain_backward_including_running_statistics(net):
    torch.manual_seed(0)
    plain = net()
    ckpt = copy.deepcopy(plain)
    fp = Freezer(plain, split_blocks(plain))
    fc = Freezer(ckpt, split_blocks(ckpt), grad_checkpointing=True)
    for f in (fp, fc):
        f.set_boundary(1)  # the first trainable block follows a frozen prefix (the reentrant-variant bug)
        f.train()
    assert is_checkpointed(fc.blocks[1].modules[0]) and not is_checkpointed(fc.blocks[0].modules[0])
    x, y = global_batch(0, 8)
    for model in (plain, ckpt):
        F.cross_entropy(model(x), y).backward()
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        if p.requires_grad:
            assert q.grad is not None, n
            torch.testing.assert_close(p.grad, q.grad, msg=n)
    for (n, b), c in zip(plain.named_buffers(), ckpt.buffers()):
        assert torch.equal(b, c), f"{n}: running statistics updated twice under checkpointing"


# ------------------------------------------------------------------------------ the module wrapper
def test_enabling_is_idempotent_and_disabling_restores_the_class_forward():
    block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    keys = list(block.state_dict())
    assert not is_checkpointed(block)
    enable_checkpointing(block)
    wrapper = block.__dict__["forward"]
    enable_checkpointing(block)  # no wrapper around the wrapper
    assert is_checkpointed(block) and block.__dict__["forward"] is wrapper
    assert list(block.state_dict()) == keys  # state_dict keys untouched
    disable_checkpointing(block)
    disable_checkpointing(block)  # harmless twice
    assert not is_checkpointed(block) and "forward" not in block.__dict__


def test_without_autograd_the_original_forward_runs_once_and_with_it_again_in_backward():
    calls = []
    block = nn.Linear(3, 3)
    original = block.forward

    def counting(x):
        calls.append(torch.is_grad_enabled())
        return original(x)

    block.forward = counting  # the instance forward that checkpointing wraps
    enable_checkpointing(block)
    x = torch.randn(2, 3, requires_grad=True)
    with torch.no_grad():
        block(x)
    assert calls == [False]
    calls.clear()
    block(x).sum().backward()
    assert len(calls) == 2 and x.grad is not None  # the forward, then its recomputation in backward


def test_recomputation_neither_moves_running_statistics_nor_counts_the_batch_twice():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU())  # cumulative average
    ckpt = copy.deepcopy(plain)
    enable_checkpointing(ckpt)
    x = torch.randn(4, 3, 6, 6, requires_grad=True)
    for model in (plain, ckpt):
        model(x).sum().backward()
    assert ckpt[1].momentum is None and ckpt[1].num_batches_tracked.item() == 1
    for (n, b), c in zip(plain.named_buffers(), ckpt.buffers()):
        assert torch.equal(b, c), n


def test_a_deepcopy_of_a_checkpointed_module_runs_its_own_weights():
    block = nn.Linear(2, 2)
    enable_checkpointing(block)
    twin = copy.deepcopy(block)
    assert not is_checkpointed(twin)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    x = torch.randn(3, 2, requires_grad=True)
    assert torch.count_nonzero(twin(x)) == 0 and torch.count_nonzero(block(x)) > 0
