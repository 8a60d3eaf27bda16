"""What the trainer integrations need from the core: overflow detection without a host sync, the
loss scale, an optimizer attached later (and unwrapped), load order, one-line refusals."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freeze import Freezer, GradNormMonitor, make_policy, split_blocks
from freeze.monitor import IntervalStats, relative_change
from tests.processes import run_python
from tests.tiny_models import TinyNet, global_batch


def _model():
    return nn.Sequential(nn.Linear(3, 2, bias=False), nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False))


def _set_grads(model, values, dtype=torch.float32):
    for p, v in zip(model.parameters(), values):
        p.grad = torch.full(p.shape, v, dtype=dtype)


@pytest.fixture
def no_host_sync(monkeypatch):
    """Any read of a tensor's value on the host raises inside the block."""

    def refuse(*a, **k):
        raise AssertionError("host sync in the per-step path")

    for name in ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    yield
    monkeypatch.undo()


@pytest.mark.parametrize("on_device", [True, False], ids=["as on a GPU: no host read", "on the host: read"])
def test_an_overflowed_step_is_masked_and_counted_without_a_host_sync(monkeypatch, on_device):
    """As on a GPU (the summed gradient masked through staging) no step reads a value on the host; on
    the host, where a read costs nothing, the step's finiteness is read and the sums are the same."""
    if on_device:
        monkeypatch.setattr("freeze.monitor.grad_sums._FREE_TO_READ_DEVICE_TYPES", frozenset())
    model, clean = _model(), _model()
    mon, ref = GradNormMonitor(split_blocks(model)), GradNormMonitor(split_blocks(clean))
    steps = [[1.0, 2.0, 3.0], [math.inf, 2.0, 3.0], [-1.0, math.nan, 1.0], [0.5, 0.5, 0.5]]
    for values in steps:
        _set_grads(model, values)
        with monkeypatch.context() as m:
            if on_device:
                for name in ("item", "tolist", "cpu", "__bool__", "__float__", "__int__"):
                    m.setattr(torch.Tensor, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("host sync")))
            mon.observe()
        if all(math.isfinite(v) for v in values):
            _set_grads(clean, values)
            ref.observe()
    s, r = mon.close_interval(0, 0, end_step=4), ref.close_interval(0, 0, end_step=2)
    assert s.summed_grad_norm == r.summed_grad_norm and s.summed_grad_l1_norm == r.summed_grad_l1_norm
    assert s.mean_step_grad_norm == r.mean_step_grad_norm
    assert all(math.isfinite(v) for v in s.summed_grad_norm + s.mean_step_grad_norm)
    assert (s.steps, s.skipped_steps) == (4, 2) and mon.overflow_steps_total == 2
    # the next interval starts clean
    _set_grads(model, [1.0, 1.0, 1.0])
    mon.observe()
    assert mon.close_interval(1, 0, end_step=5).skipped_steps == 0


def test_an_interval_of_overflowed_steps_only_has_no_statistic():
    model = _model()
    mon = GradNormMonitor(split_blocks(model))
    _set_grads(model, [math.inf, 1.0, 1.0])
    mon.observe()
    s = mon.close_interval(0, 0, end_step=1)
    assert s.summed_grad_norm == (None, None, None) and s.mean_step_grad_norm == (None, None, None)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_grad_scale_gives_the_statistics_of_the_unscaled_gradients(as_tensor):
    model = _model()
    mon, ref = GradNormMonitor(split_blocks(model)), GradNormMonitor(split_blocks(model))
    scale = 2.0**16
    for values in ([1.0, 2.0, 3.0], [0.25, -1.0, 4.0]):
        _set_grads(model, [v * scale for v in values])
        mon.observe(grad_scale=torch.tensor(scale) if as_tensor else scale)
        _set_grads(model, values)
        ref.observe()
    s, r = mon.close_interval(0, 0, end_step=2), ref.close_interval(0, 0, end_step=2)
    for a, b in zip(s.summed_grad_norm + s.mean_step_grad_norm, r.summed_grad_norm + r.mean_step_grad_norm):
        assert math.isclose(a, b, rel_tol=1e-6)


def test_a_finite_fp16_block_whose_norm_exceeds_the_fp16_range_is_not_an_overflow():
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 1, bias=False)).half()
    mon = GradNormMonitor(split_blocks(model))
    _set_grads(model, [30000.0, 1.0], dtype=torch.float16)  # norm 64 * 30000, beyond 65504
    mon.observe()
    s = mon.close_interval(0, 0, end_step=1)
    assert s.skipped_steps == 0
    assert math.isclose(s.mean_step_grad_norm[0], 64 * 30000.0, rel_tol=1e-3)


def test_freezer_after_backward_takes_the_scale_and_keeps_skipped():
    torch.manual_seed(0)
    model = TinyNet()
    # the overflow check rides on the statistics: asked for, since policy none reads none
    freezer = Freezer(model, split_blocks(model), make_policy("none"), track_summed_grads=True)
    x, y = global_batch(0, 4)
    F.cross_entropy(freezer.module(x), y).backward()
    freezer.after_backward(grad_scale=torch.tensor(4.0))
    next(model.parameters()).grad[0] = math.inf
    freezer.after_backward()
    freezer.after_backward(skipped=True)
    stats = freezer.monitor.close_interval(0, 0, freezer.counters.steps)
    assert (stats.steps, stats.skipped_steps, freezer.counters.skipped_steps) == (3, 2, 1)
    assert freezer.counters.steps == 3  # skipped steps move the step count (its one owner)
    assert all(v is not None and math.isfinite(v) for v in stats.mean_step_grad_norm)


def _accelerated(optimizer):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    try:
        return accelerate.Accelerator(cpu=True).prepare_optimizer(optimizer, device_placement=False)
    finally:
        AcceleratorState._reset_state(True)  # a process-wide singleton: leave none behind


@pytest.mark.parametrize("wrap", ["plain", "accelerate", "lightning"])
def test_attach_optimizer_unwraps_and_drops_the_state_of_frozen_blocks(wrap):
    torch.manual_seed(0)
    model = TinyNet()
    blocks = split_blocks(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = global_batch(0, 4)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()  # momentum buffers for every parameter
    freezer = Freezer(model, blocks, make_policy("none"))
    freezer.set_boundary(2)
    if wrap == "lightning":
        from lightning.pytorch.core.optimizer import LightningOptimizer

        wrapped = LightningOptimizer(optimizer)
    else:
        wrapped = {"plain": lambda o: o, "accelerate": _accelerated}[wrap](optimizer)
    freezer.attach_optimizer(wrapped)
    assert freezer.optimizer is optimizer
    frozen = [p for b in blocks[:2] for p in b.params]
    assert all(p not in optimizer.state for p in frozen)
    assert all(p in optimizer.state for b in blocks[2:] for p in b.params)
    freezer.set_boundary(3)  # later freezes drop through the attached optimizer
    assert all(p not in optimizer.state for b in blocks[:3] for p in b.params)


def test_attach_optimizer_refuses_another_models_optimizer_in_one_line():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model))
    with pytest.raises(ValueError, match="not the model's.*freezer.model.parameters") as e:
        freezer.attach_optimizer(torch.optim.SGD(TinyNet().parameters(), lr=0.1))
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        freezer.attach_optimizer(object())


def test_compiled_and_deepspeed_models_are_refused_in_one_line():
    model = TinyNet()
    with pytest.raises(ValueError, match="torch.compile.*uncompiled") as e:
        Freezer(torch.compile(model), split_blocks(model))
    assert "\n" not in str(e.value)
    model.compile()  # in place: the modules stay the same, their calls go through dynamo
    with pytest.raises(ValueError, match="torch.compile"):
        Freezer(model, split_blocks(model))

    class DeepSpeedEngine(nn.Module):  # the class deepspeed.initialize returns (deepspeed is not installed)
        def __init__(self):
            super().__init__()
            self.module = TinyNet()

    engine = DeepSpeedEngine()
    with pytest.raises(ValueError, match="DeepSpeed.*DDP") as e:
        Freezer(engine, split_blocks(engine))
    assert "\n" not in str(e.value)


@pytest.mark.processes
def test_import_freeze_imports_no_trainer():
    code = "import sys, freeze, freeze.integrations; print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'timm') if m in sys.modules))"
    child = run_python(["-c", code], timeout_s=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "[]"


def test_a_trainers_communication_hook_is_refused_and_ddp_kwargs_are_filtered():
    from freeze.integrations._common import ddp_kwargs_of

    kwargs = {"find_unused_parameters": True, "bucket_cap_mb": 10, "comm_hook": "no", "comm_wrapper": "no"}
    assert ddp_kwargs_of("T", kwargs) == {"find_unused_parameters": True, "bucket_cap_mb": 10}
    with pytest.raises(ValueError, match="comm_hook='bf16'") as e:
        ddp_kwargs_of("T", {"comm_hook": "fp16"})
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------ masked steps and bad scales (issue 33, D8)
def _five_block_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(4):
        layers += [nn.Linear(8 if i else 6, 8), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(8, 3))


def _decisions(policy: str, nan_steps: frozenset = frozenset(), epochs: int = 6, steps: int = 6) -> list[tuple]:
    """The decisions on a 5-block MLP whose weights stay put (no optimizer) and whose epochs each
    repeat one batch: every finite step of an epoch has the same gradient, so an epoch's per-step
    gradient is the same with or without its NaN steps - and so must the decisions be."""
    model = _five_block_mlp()
    freezer = Freezer(model, split_blocks(model), make_policy(policy), epochs=epochs)
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(epoch)
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(freezer.module(x), y)
            (loss * math.nan if (epoch, step) in nan_steps else loss).backward()
            freezer.after_backward()
        freezer.end_epoch(epoch)
    return [(d.epoch, d.boundary_before, d.boundary_after) for d in freezer.decisions]


@pytest.mark.parametrize("policy", ["autofreeze", "autofreeze:norm=l2", "cs744"])
def test_two_nan_steps_in_an_epoch_leave_the_decisions_of_every_gradient_policy_as_they_are(policy):
    clean = _decisions(policy)
    assert clean  # the pattern makes every policy move
    assert _decisions(policy, nan_steps=frozenset({(1, 2), (1, 4)})) == clean


def test_eta_compares_sums_per_finite_step_and_the_raw_sums_when_the_counts_are_equal():
    def stats(steps, skipped, norms):
        return IntervalStats(0, 0, steps, steps, skipped, 0, tuple(norms), tuple(norms), tuple(norms))

    # 10 finite steps summing to 10, then 8 finite (2 masked) summing to 8: the same per step
    assert relative_change(stats(10, 0, [10.0, 5.0]), stats(10, 2, [8.0, 6.0])) == [0.0, 0.5]
    prev, cur = stats(10, 0, [3.0, 7.0]), stats(10, 0, [1.1, 9.3])
    assert relative_change(prev, cur) == [abs(3.0 - 1.1) / 3.0, abs(7.0 - 9.3) / 7.0]  # bit for bit, as before


@pytest.mark.parametrize("bad", [math.nan, 0.0, -1.0, math.inf])
def test_a_bad_float_grad_scale_is_refused_at_the_call_before_the_step_counts(bad):
    model = _model()
    mon = GradNormMonitor(split_blocks(model))
    _set_grads(model, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="grad_scale = .*; accepted: the loss scale, a finite number > 0"):
        mon.observe(grad_scale=bad)
    assert mon.interval_steps == 0
    freezer = Freezer(model, split_blocks(model))  # the step count's owner: the Freezer's counters
    with pytest.raises(ValueError, match="grad_scale = .*; accepted: the loss scale, a finite number > 0"):
        freezer.after_backward(grad_scale=bad)
    assert freezer.counters.steps == 0 and freezer.monitor.interval_steps == 0


@pytest.mark.parametrize("bad", [math.nan, 0.0, -1.0, math.inf])
def test_a_bad_grad_scale_tensor_is_masked_on_the_device_and_refused_when_the_epoch_ends(
    bad, no_host_sync, monkeypatch
):
    torch.manual_seed(0)
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model), make_policy("autofreeze"))
    x, y = global_batch(0, 4)
    F.cross_entropy(freezer.module(x), y).backward()
    freezer.after_backward(grad_scale=torch.tensor(bad))  # on the device: no_host_sync raises on any read
    freezer.after_backward(grad_scale=torch.tensor(2.0))
    monkeypatch.undo()  # the refusal reads the count once, as the interval closes
    with pytest.raises(ValueError, match=r"grad_scale: .* NaN, inf, 0 or negative at 1 step\(s\)") as err:
        freezer.end_epoch(0)
    assert "\n" not in str(err.value)
    assert (freezer.clock.epochs_completed, freezer.monitor.intervals_closed) == (
        0,
        0,
    )  # refused before the clock moved
    with pytest.raises(ValueError, match="grad_scale"):  # and again: the bad step stays in the interval
        freezer.monitor.close_interval(0, 0, freezer.counters.steps)
    norm_sum = freezer.monitor.step_norms.norm_sum
    assert bool(torch.isfinite(norm_sum).all()) and bool((norm_sum >= 0).all())  # nothing poisoned the sums
