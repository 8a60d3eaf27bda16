import math
from dataclasses import dataclass

import pytest
import torch

from freeze.pipeline.optim import build_optimizer, build_scheduler, lr_factor, run_lr
from tests.tiny_models import TinyNet


@dataclass(frozen=True)
class Sched:
    name: str
    warmup_epochs: float = 0.0
    step_size_epochs: int = 2
    gamma: float = 0.5
    min_lr: float = 0.0


@dataclass(frozen=True)
class Opt:
    name: str
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 1e-4
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    lr_reference_batch: int = 0


STEPS_PER_EPOCH, TOTAL = 10, 100


def test_linear_warmup_then_constant():
    cfg = Sched("constant", warmup_epochs=0.5)
    assert [lr_factor(s, STEPS_PER_EPOCH, TOTAL, cfg, 0.1) for s in range(6)] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]


def test_step_and_exponential_count_epochs():
    assert lr_factor(19, STEPS_PER_EPOCH, TOTAL, Sched("step"), 0.1) == 1.0
    assert lr_factor(20, STEPS_PER_EPOCH, TOTAL, Sched("step"), 0.1) == 0.5
    assert lr_factor(45, STEPS_PER_EPOCH, TOTAL, Sched("step"), 0.1) == 0.25
    assert lr_factor(15, STEPS_PER_EPOCH, TOTAL, Sched("exponential"), 0.1) == pytest.approx(0.5**1.5)


def test_cosine_after_warmup_reaches_min_lr():
    cfg = Sched("cosine", warmup_epochs=1.0, min_lr=0.01)
    assert lr_factor(9, STEPS_PER_EPOCH, TOTAL, cfg, 0.1) == 1.0  # last warm-up step
    assert lr_factor(10, STEPS_PER_EPOCH, TOTAL, cfg, 0.1) == pytest.approx(1.0)
    mid = 10 + 45
    assert lr_factor(mid, STEPS_PER_EPOCH, TOTAL, cfg, 0.1) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))
    )
    assert lr_factor(TOTAL, STEPS_PER_EPOCH, TOTAL, cfg, 0.1) == pytest.approx(0.1)


@pytest.mark.parametrize("name, cls", [("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW)])
def test_optimizers_and_scheduler_drive_the_lr(name, cls):
    model = TinyNet()
    opt = build_optimizer(model, Opt(name))
    assert isinstance(opt, cls) and opt.param_groups[0]["weight_decay"] == 1e-4
    sched = build_scheduler(opt, Sched("constant", warmup_epochs=0.5), STEPS_PER_EPOCH, TOTAL, 0.1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.04)


def test_the_lr_scales_with_the_global_batch_only_when_a_reference_batch_is_named():
    """Issue 46: study_cifar10 on dist.nproc=8 doubled the global batch and kept the LR: another recipe."""
    assert run_lr(Opt("sgd"), 512) == 0.1  # as given
    assert run_lr(Opt("sgd", lr_reference_batch=256), 512) == pytest.approx(0.2)
    assert run_lr(Opt("sgd", lr_reference_batch=256), 128) == pytest.approx(0.05)


def test_one_group_per_block_when_asked():
    from freeze import split_blocks

    model = TinyNet()
    blocks = split_blocks(model)
    optimizer = build_optimizer(model, Opt("sgd"), blocks)
    assert [len(g["params"]) for g in optimizer.param_groups] == [len(b.params) for b in blocks]
    assert len(build_optimizer(model, Opt("sgd")).param_groups) == 1
