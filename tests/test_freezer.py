"""Freezer behaviour in one process (no process group): the same object serves debugging."""

import copy
import dataclasses
import io

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, make_policy, split_blocks
from tests.processes import run_python
from tests.tiny_models import TinyNet, global_batch
from tests.tiny_models import freezer_step as _step


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


@pytest.mark.parametrize("bad", [-1, 4, 10])
def test_set_boundary_out_of_range(bad):
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model))
    with pytest.raises(ValueError, match=r"accepted: 0\.\.3"):
        freezer.set_boundary(bad)


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


@pytest.mark.processes
def test_importing_the_torch_free_parts_of_the_package_does_not_import_torch():
    # A subprocess: this one has torch loaded already.
    # freeze.policies too (issue 47): a config, a sweep and the report read policies without torch
    code = (
        "import sys, freeze, freeze.pipeline.schema, freeze.policies, freeze.intervals; print('torch' in sys.modules)"
    )
    child = run_python(["-c", code])
    assert child.returncode == 0, child.stderr
    assert child.stdout.split()[0] == "False"
    import freeze

    assert sorted(freeze.__all__) == sorted(freeze._OWNER)  # the literal list ruff needs names the same set
    assert all(getattr(freeze, name) is not None for name in freeze.__all__)
