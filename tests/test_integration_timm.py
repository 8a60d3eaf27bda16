"""blocks_from_timm follows timm's group_matcher: forward order, a partition, gradients reaching
exactly the unfrozen blocks; and distribute_bn leaves frozen BatchNorm statistics alone.

The suite checks timm's tiny ``test_*`` models (12 families). ``FREEZE_TIMM_ALL=1`` checks one small
model of EVERY timm family that defines ``group_matcher`` (87 in timm 1.0.31; minutes, not seconds).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from freeze import Freezer, make_policy
from freeze.blocks import check_partition
from tests.optional_packages import installed, package_dir, requires

pytestmark = requires("timm")

ALL = os.environ.get("FREEZE_TIMM_ALL") == "1"
_SIZE_WORDS = ["atto", "femto", "pico", "nano", "tiny", "xxs", "xs", "small", "s", "b0", "18"]


def _families() -> list[str]:
    root = package_dir("timm") / "models"
    return sorted(p.stem for p in root.glob("*.py") if "def group_matcher" in p.read_text())


def _registered_test_models() -> list[str]:
    """timm's ``test_*`` models, read from its sources: the suite's cases are known without
    importing timm at collection (test_the_cases_are_the_test_models_timm_registers checks them)."""
    pattern = re.compile(r"^@register_model\s*\ndef (test_\w+)\(", re.M)
    return sorted(
        name for path in (package_dir("timm") / "models").glob("*.py") for name in pattern.findall(path.read_text())
    )


def _smallest_name(family: str) -> str | None:
    import timm

    names = timm.list_models(module=family)
    if not names:
        return None

    def rank(n):
        size = next((i for i, w in enumerate(_SIZE_WORDS) if w in n), 99)
        return (0 if n.startswith("test_") else 1, size, len(n))

    return sorted(names, key=rank)[0]


def _cases():
    if not installed("timm"):
        return []
    if ALL:  # asked for: timm is imported at collection
        return [(f, _smallest_name(f)) for f in _families() if _smallest_name(f)]
    return [(n.split("_", 1)[1], n) for n in _registered_test_models()]


def _build(name):
    """The model at 64 x 64 inputs where it accepts them (a probe forward decides), else at its
    configured input size."""
    import timm

    for kwargs in ({"img_size": 64}, {}):
        torch.manual_seed(0)
        try:
            model = timm.create_model(name, pretrained=False, num_classes=5, **kwargs)
        except TypeError:
            continue
        size = 64 if kwargs else model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
        if kwargs:
            try:
                with torch.no_grad():
                    model.eval()(torch.randn(1, 3, size, size))
            except (RuntimeError, AssertionError, ValueError):
                continue
        return model, size
    raise AssertionError(f"{name}: cannot be built")


def _grads_of(model, x, run=None):
    model.zero_grad(set_to_none=True)
    out = (run or model)(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.float().sum().backward()
    return {n for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,name", _cases(), ids=[f for f, _ in _cases()])
def test_blocks_follow_group_matcher_in_forward_order_and_gradients_reach_exactly_the_unfrozen_blocks(family, name):
    from freeze.integrations.timm import blocks_from_timm

    model, size = _build(name)
    blocks = blocks_from_timm(model)
    check_partition(model, blocks)  # every parameter in exactly one block
    assert len(blocks) >= 3, [b.name for b in blocks]
    # running statistics belong to the block of their norm layer's weights (kept in eval when frozen)
    in_blocks = {n for b in blocks for n, _, _ in b.buffers()}
    assert {n for n, _ in model.named_buffers() if "running_" in n} <= in_blocks
    model.train()
    x = torch.randn(2, 3, size, size)
    used = _grads_of(model, x)  # parameters this forward uses at all (some models hold unused ones)
    freezer = Freezer(model, blocks, make_policy("none"))
    names = {id(p): n for n, p in model.named_parameters()}
    for k in (1, len(blocks) // 2, len(blocks) - 1):
        freezer.set_boundary(k)  # the next forward checks that blocks run in list order
        got = _grads_of(model, x, run=freezer.module)
        trainable = {names[id(p)] for b in blocks[k:] for p in b.params}
        assert got == used & trainable, (k, sorted(got ^ (used & trainable))[:5])
    freezer.close()


def test_the_cases_are_the_test_models_timm_registers():
    import timm

    assert _registered_test_models() == sorted(timm.list_models("test_*"))


def test_blocks_from_timm_refuses_a_model_without_group_matcher_in_one_line():
    from torch import nn

    from freeze.integrations.timm import blocks_from_timm

    with pytest.raises(ValueError, match="split_blocks") as e:
        blocks_from_timm(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert "\n" not in str(e.value)


def test_distribute_bn_reduces_trainable_statistics_and_never_touches_frozen_ones(monkeypatch):
    """timm's --dist-bn reduce averages every running statistic, frozen ones included (which
    changes their bits beyond 2 ranks); this one sends only the trainable blocks' statistics."""
    import timm.utils

    from freeze.integrations.timm import blocks_from_timm, distribute_bn

    model, _ = _build("test_resnet")
    freezer = Freezer(model, blocks_from_timm(model), make_policy("none"))
    freezer.set_boundary(3)
    frozen = {id(getattr(m, a)) for b in freezer.blocks[:3] for _, m, a in b.buffers()}
    stats = {id(t) for n, t in model.named_buffers() if "running_" in n}
    sent = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None, group=None: sent.append(id(t)))
    distribute_bn(freezer, world_size=3, reduce=True)
    assert set(sent) == stats - frozen and frozen & stats
    sent.clear()
    timm.utils.distribute_bn(model, 3, reduce=True)  # timm's own: frozen statistics averaged too
    assert frozen & stats <= set(sent)
