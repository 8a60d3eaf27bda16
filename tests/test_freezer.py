"""Freezer behaviour in one process (no process group): the same object serves debugging."""

import copy
import dataclasses
import io
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, make_policy, split_blocks
from freeze.checkpointing import is_checkpointed
from freeze.steering import BlockOrderError
from tests.tiny_models import InstanceNormNet, SharedLayerNet, TinyNet, global_batch


def _step(freezer, optimizer, step, batch=8):
    x, y = global_batch(step, batch)
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(freezer.module(x), y)
    loss.backward()
    freezer.after_backward()
    optimizer.step()
    return loss


def test_frozen_block_is_frozen_for_real():
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer)
    _step(freezer, optimizer, 0)
    assert model.stem[0].weight in optimizer.state  # momentum buffer exists
    freezer.set_boundary(2)
    assert model.stem[0].weight not in optimizer.state  # dropped on freezing
    assert model.stem[0].weight.grad is None and not model.stem[0].weight.requires_grad
    model.train()  # a plain train() call must not wake frozen BN up
    stem_bn = model.stem[1]
    before = copy.deepcopy(model.stem.state_dict())
    _step(freezer, optimizer, 1)
    assert not stem_bn.training
    for k, v in model.stem.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.block2[1].training  # trainable BN still trains
    assert freezer.counters.allreduce_bytes_last_step == 0  # single process: nothing on the wire
    assert freezer.frozen_blocks == ["stem", "block1"]
    total = sum(p.numel() for p in model.parameters())
    frozen = sum(p.numel() for p in list(model.stem.parameters()) + list(model.block1.parameters()))
    assert freezer.frozen_param_fraction == pytest.approx(frozen / total)


def test_frozen_prefix_runs_without_autograd_and_grad_mode_is_restored():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model))
    freezer.set_boundary(2)
    seen = {}
    # observed from inside the frozen block (the Freezer's own hooks wrap the block itself)
    model.block1[0].register_forward_hook(
        lambda m, a, out: seen.update(prefix=out.grad_fn, mode=torch.is_grad_enabled())
    )
    out = model(torch.randn(2, 3, 8, 8))
    assert seen["prefix"] is None and seen["mode"] is False
    assert torch.is_grad_enabled() and out.requires_grad
    # an exception inside the frozen prefix must not leave grad mode disabled
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5, 8, 8))
    assert torch.is_grad_enabled()


def test_unfreezing_restores_training():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer)
    freezer.set_boundary(3)
    freezer.set_boundary(0)
    freezer.train()
    assert all(p.requires_grad for p in model.parameters())
    assert model.stem[1].training
    _step(freezer, optimizer, 0)
    assert model.stem[0].weight.grad is not None


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


@pytest.mark.parametrize("bad", [-1, 4, 10])
def test_set_boundary_out_of_range(bad):
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model))
    with pytest.raises(ValueError, match=r"accepted: 0\.\.3"):
        freezer.set_boundary(bad)


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


def test_restored_freezer_makes_the_same_next_decision():
    """Run autofreeze for a few epochs; checkpoint; continue the original and a restored copy."""

    def build(seed=0):
        torch.manual_seed(seed)
        model = TinyNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        fr = Freezer(model, split_blocks(model), make_policy("autofreeze", percentile=50), optimizer=opt, epochs=6)
        return model, opt, fr

    model, opt, freezer = build()
    step = 0
    for epoch in range(3):
        freezer.train()
        for _ in range(3):
            _step(freezer, opt, step)
            step += 1
        freezer.end_epoch(epoch)
    buffer = io.BytesIO()
    torch.save(freezer.training_state_dict() | {"epoch": 3}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain containers, numbers, strings, tensors only

    model2, opt2, freezer2 = build(seed=1)  # different init: everything must come from the checkpoint
    freezer2.load_training_state_dict(saved)  # model, then Freezer, then optimizer
    assert freezer2.boundary == freezer.boundary
    assert freezer2.counters == freezer.counters
    boundaries = []
    for f, o in ((freezer, opt), (freezer2, opt2)):
        s = step
        for epoch in range(3, 6):
            f.train()
            for _ in range(3):
                _step(f, o, s)
                s += 1
            f.end_epoch(epoch)
        boundaries.append([d.boundary_after for d in f.decisions])
    assert boundaries[0] == boundaries[1]
    assert freezer.history == freezer2.history
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_interval_policy_decides_in_after_step():
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    freezer = Freezer(model, split_blocks(model), make_policy("geometric", alpha=0.5), interval_steps=2)
    for s in range(4):
        _step(freezer, opt, s)
        freezer.after_step()
    assert len(freezer.history) == 2
    assert freezer.end_epoch(0) is False  # per-epoch evaluation is off when interval_steps > 0


def test_blocks_of_another_model_are_refused():
    with pytest.raises(ValueError, match="'stem.0.weight', which is not a parameter of this model"):
        Freezer(TinyNet(), split_blocks(TinyNet()))


def test_run_length_policies_require_epochs():
    model = TinyNet()
    with pytest.raises(ValueError, match="needs the run length"):
        Freezer(model, split_blocks(model), make_policy("freezeout"))


def test_step_level_epoch_schedules_wait_for_the_epoch_to_complete():
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    geometric = Freezer(model, split_blocks(model), make_policy("geometric", alpha=0.5), interval_steps=2)
    other = TinyNet()
    unfreeze = Freezer(other, split_blocks(other), make_policy("gradual-unfreeze"), interval_steps=2)
    for s in range(4):  # two evaluations inside the first epoch
        _step(geometric, opt, s)
        geometric.after_step()
        unfreeze.after_backward()  # no gradients needed: the schedule reads only the clock
        unfreeze.after_step()
    assert (geometric.boundary, unfreeze.boundary) == (0, 3)
    geometric.end_epoch(0)
    unfreeze.end_epoch(0)
    for s in range(4, 6):
        _step(geometric, opt, s)
        geometric.after_step()
        unfreeze.after_backward()  # no gradients needed: the schedule reads only the clock
        unfreeze.after_step()
    assert (geometric.boundary, unfreeze.boundary) == (2, 2)  # floor(4 * (1 - 0.5^1)); one block back


def test_run_length_policy_evaluated_per_step_needs_the_run_length_in_steps():
    model = TinyNet()
    with pytest.raises(ValueError, match="interval_steps=2 steps needs the run length in steps: pass steps_per_epoch"):
        Freezer(model, split_blocks(model), make_policy("freezeout"), epochs=10, interval_steps=2)
    freezer = Freezer(
        model, split_blocks(model), make_policy("freezeout", t0=0.5), epochs=10, steps_per_epoch=10, interval_steps=2
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for s in range(2):
        _step(freezer, opt, s)
        freezer.after_step()
    assert freezer.boundary == 0  # 2 of 100 steps done: block 0 is due at half of the run


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
    with pytest.raises(AttributeError, match="call freezer.module"):
        freezer.ddp  # noqa: B018
    with pytest.raises(TypeError, match="copy freezer.model"):
        copy.deepcopy(module)


def test_accumulation_with_static_graph_is_refused_in_one_line():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model), ddp_kwargs={"static_graph": True})
    with pytest.raises(ValueError, match="drop static_graph=True") as info, freezer.module.no_sync():
        pass
    assert "\n" not in str(info.value)


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


def test_training_state_needs_the_optimizer_on_both_sides():
    model = TinyNet()
    with_opt = Freezer(model, split_blocks(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    other = TinyNet()
    without = Freezer(other, split_blocks(other))
    with pytest.raises(ValueError, match="has an 'optimizer' entry and this Freezer has no optimizer"):
        without.load_training_state_dict(with_opt.training_state_dict())
    with pytest.raises(ValueError, match="lacks an 'optimizer' entry and this Freezer has an optimizer"):
        with_opt.load_training_state_dict(without.training_state_dict())


def test_closed_freezer_refuses_to_run_and_leaves_the_model_usable():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model))
    x, _ = global_batch(0, 4)
    freezer.module(x)
    freezer.close()
    freezer.close()  # twice is harmless: an end-of-script call after an error path's
    with pytest.raises(RuntimeError, match="closed"):
        freezer.module(x)
    assert model(x).shape == (4, 5)


# ------------------------------------------------------------------ issue 21/25: what the Freezer refuses or keeps
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


def test_blocks_that_do_not_partition_the_model_are_refused_in_one_line():
    model = TinyNet()
    blocks = split_blocks(model)
    with pytest.raises(ValueError, match="blocks do not partition TinyNet") as err:
        Freezer(model, blocks[1:])  # the stem's parameters are in no block
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="is in block 'stem' and in block"):
        head = blocks[-1]
        twice = dataclasses.replace(
            head, param_names=head.param_names + blocks[0].param_names[:1], params=head.params + blocks[0].params[:1]
        )
        Freezer(model, [*blocks[:-1], twice])


def test_end_epoch_called_twice_or_with_a_skipped_epoch_is_refused_in_one_line():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model), make_policy("autofreeze"))
    x, y = global_batch(0, 4)
    F.cross_entropy(freezer.module(x), y).backward()
    freezer.after_backward()
    freezer.end_epoch(0)
    for wrong in (0, 2):  # a second call for epoch 0, or a skipped epoch 1
        with pytest.raises(ValueError, match=f"end_epoch\\({wrong}\\): the epoch that just ended is 1") as err:
            freezer.end_epoch(wrong)
        assert "\n" not in str(err.value)
    with pytest.warns(RuntimeWarning, match="epoch 1 ended without a training step"):
        freezer.end_epoch(1)


def test_the_monitor_keeps_a_bounded_history_and_counts_every_interval():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model), make_policy("autofreeze", percentile=0), interval_steps=1)
    freezer.monitor.history_kept = 4
    for step in range(10):
        x, y = global_batch(step, 4)
        F.cross_entropy(freezer.module(x), y).backward()
        freezer.after_backward()
        freezer.after_step()
    assert len(freezer.history) == 4 and [s.index for s in freezer.history] == [6, 7, 8, 9]
    other = TinyNet()
    restored = Freezer(other, split_blocks(other), make_policy("autofreeze", percentile=0), interval_steps=1)
    restored.load_state_dict(freezer.state_dict())
    assert restored.monitor.intervals_closed == 10 and len(restored.history) == 4


def test_explain_says_what_each_evaluation_read_and_chose():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model), make_policy("autofreeze", percentile=50))
    assert "no evaluation yet" in freezer.explain()
    for epoch in range(3):
        for step in range(2):
            x, y = global_batch(10 * epoch + step, 4)
            F.cross_entropy(freezer.module(x), y).backward()
            freezer.after_backward()
        freezer.end_epoch(epoch)
    lines = freezer.explain().splitlines()
    assert len(lines) == 3 and all(line.startswith("autofreeze:percentile=50") for line in lines)
    assert "eta compares two" in lines[0] and "eta per block [" in lines[2] and "threshold" in lines[2]
    assert lines[2].endswith(f"boundary {freezer.evaluations[-1].boundary_before} -> {freezer.boundary}") or (
        "stays" in lines[2]
    )


def test_importing_the_torch_free_parts_of_the_package_does_not_import_torch():
    # A subprocess: this one has torch loaded already.
    code = "import sys, freeze, freeze.pipeline.schema; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False"
    import freeze

    assert sorted(freeze.__all__) == sorted(freeze._OWNER)  # the literal list ruff needs names the same set
    assert all(getattr(freeze, name) is not None for name in freeze.__all__)


def test_every_accepted_name_has_its_implementation():
    from freeze import comm
    from freeze.cache.store import STORAGE_DTYPES
    from freeze.names import COMM_HOOKS, STORAGE_DTYPE_NAMES

    assert tuple(comm._HOOKS) == COMM_HOOKS and tuple(STORAGE_DTYPES) == STORAGE_DTYPE_NAMES


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
