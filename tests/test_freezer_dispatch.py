"""freeze.freezer.dispatch: freezer.module, the one module a script calls, without a process group (the
multi-rank cases, a rewrap and a replaced wrapper, are in tests/test_freezer_ddp_edges.py)."""

import copy

import pytest
import torch

from freeze import Freezer, split_blocks
from tests.tiny_models import TinyNet, global_batch


def test_freezer_module_is_the_model_without_a_process_group():
    torch.manual_seed(0)
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model))
    freezer.set_boundary(1)
    module = freezer.module
    assert module.module is model and freezer.model is model  # `model_without_ddp`
    assert list(module.state_dict()) == [f"module.{n}" for n in model.state_dict()]  # keys as DDP's
    x, _ = global_batch(0, 4)
    module.eval()
    assert torch.equal(module(x), model(x))
    module.train()  # as freezer.train(): the frozen stem's BN stays in eval
    assert model.block1[1].training and not model.stem[1].training
    with module.no_sync():  # a no-op without DDP
        module(x).sum().backward()
    assert model.head.weight.grad is not None
    with pytest.raises(TypeError, match="copy freezer.model"):
        copy.deepcopy(module)


def test_accumulation_with_static_graph_is_refused_in_one_line():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model), ddp_kwargs={"static_graph": True})
    with pytest.raises(ValueError, match="drop static_graph=True") as info, freezer.module.no_sync():
        pass
    assert "\n" not in str(info.value)
