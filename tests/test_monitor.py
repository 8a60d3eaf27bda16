import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freeze import Freezer, GradNormMonitor, make_policy, split_blocks
from freeze.policies import POLICIES, Pricing
from tests.tiny_models import TinyNet, global_batch


def _model():
    return nn.Sequential(nn.Linear(3, 2, bias=False), nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False))


def _set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = None if g is None else torch.full_like(p, g)


def test_summed_and_mean_norms_match_hand_computation():
    model = _model()
    mon = GradNormMonitor(split_blocks(model))
    _set_grads(model, [1.0, 2.0, 3.0])
    mon.observe()
    _set_grads(model, [-1.0, 2.0, 1.0])
    mon.observe()
    s = mon.close_interval(epoch=0, boundary=0, end_step=2)
    n = [6, 4, 2]  # elements per block
    # block 0: grads cancel -> summed norm 0; mean per-step norm = sqrt(6)
    assert s.summed_grad_norm[0] == 0.0
    assert math.isclose(s.mean_step_grad_norm[0], math.sqrt(n[0]), rel_tol=1e-6)
    assert math.isclose(s.summed_grad_norm[1], 4.0 * math.sqrt(n[1]), rel_tol=1e-6)
    assert math.isclose(s.summed_grad_norm[2], 4.0 * math.sqrt(n[2]), rel_tol=1e-6)
    assert math.isclose(s.mean_step_grad_norm[2], 2.0 * math.sqrt(n[2]), rel_tol=1e-6)
    # L1 of the summed gradient: |sum| per element times the elements (AutoFreeze's statistic)
    assert s.summed_grad_l1_norm == (0.0, 4.0 * n[1], 4.0 * n[2])
    assert (s.steps, s.skipped_steps, s.end_step, s.index) == (2, 0, 2, 0)
    # the next interval starts from zero
    _set_grads(model, [1.0, 1.0, 1.0])
    mon.observe()
    s2 = mon.close_interval(epoch=1, boundary=0, end_step=3)
    assert math.isclose(s2.summed_grad_norm[0], math.sqrt(6), rel_tol=1e-6)


def test_frozen_blocks_are_not_observed():
    model = _model()
    mon = GradNormMonitor(split_blocks(model))
    mon.set_first_active(1)
    _set_grads(model, [5.0, 1.0, 1.0])
    mon.observe()
    s = mon.close_interval(epoch=0, boundary=1, end_step=1)
    assert s.summed_grad_norm[0] is None and s.summed_grad_l1_norm[0] is None and s.mean_step_grad_norm[0] is None
    assert s.summed_grad_norm[1] is not None


def test_state_round_trip_mid_interval_gives_identical_statistics():
    model = _model()
    mon = GradNormMonitor(split_blocks(model))
    _set_grads(model, [1.0, 2.0, 3.0])
    mon.observe()
    mon.close_interval(0, 0, end_step=1)
    mon.observe()  # one step into the next interval
    restored = GradNormMonitor(split_blocks(model))
    restored.load_state_dict(mon.state_dict())
    _set_grads(model, [0.5, 0.5, 0.5])
    mon.observe()
    restored.observe()
    assert mon.close_interval(1, 0, end_step=3) == restored.close_interval(1, 0, end_step=3)
    assert len(restored.history) == 2


def test_observe_copies_no_host_data_per_step(monkeypatch):
    """Per-step work is device kernels only: the block index is built once per boundary change."""
    model = _model()
    mon = GradNormMonitor(split_blocks(model))
    _set_grads(model, [1.0, 2.0, 3.0])
    mon.observe()
    built = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **kw: built.append(a) or real_tensor(*a, **kw))
    for _ in range(3):
        mon.observe()
    assert built == []
    mon.set_first_active(1)
    for _ in range(3):
        mon.observe()
    assert len(built) == 1  # the new active set's index, once


def test_skipped_steps_move_the_clock_not_the_statistics():
    model = _model()
    mon = GradNormMonitor(split_blocks(model))
    _set_grads(model, [1.0, 2.0, 3.0])
    mon.observe()
    _set_grads(model, [float("inf"), 2.0, 3.0])  # an fp16 overflow: not read
    mon.skip_step()
    s = mon.close_interval(epoch=0, boundary=0, end_step=2)
    assert (s.steps, s.skipped_steps, s.end_step) == (2, 1, 2)  # the Freezer's count: test_integration_core
    assert math.isclose(s.mean_step_grad_norm[0], math.sqrt(6), rel_tol=1e-6)  # one observed step
    assert math.isclose(s.summed_grad_l1_norm[0], 6.0, rel_tol=1e-6)


# ------------------------------------------------------------------------------ fp64 parameters (issue 33, D3)
def _train_fp64(model: nn.Module, policy: str, epochs: int = 3, steps: int = 2) -> Freezer:
    blocks, chosen = split_blocks(model), make_policy(policy)
    priced = {}
    if chosen.uses_pricing:  # step times falling with the boundary, a constant LR, a flat held-out loss
        chosen = make_policy(policy, window=1, span=1)  # its first rates within the 6 evaluations
        step_time_s = [1.0 - 0.1 * k for k in range(len(blocks))]
        priced = {
            "steps_per_epoch": steps,
            "interval_steps": 1,
            "pricing": Pricing(step_time_s, [0.05] * epochs * steps),
            "probe": lambda: 1.0,
        }
    freezer = Freezer(model, blocks, chosen, epochs=epochs, **priced)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(epochs):
        for step in range(steps):
            x, y = global_batch(epoch * steps + step, 8)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(freezer.module(x.double()), y).backward()
            freezer.after_backward()
            opt.step()
            freezer.after_step()  # evaluates only with interval_steps (horizon's)
        freezer.end_epoch(epoch)
    return freezer


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_an_fp64_model_trains_under_every_policy_with_finite_fp64_statistics(policy):
    torch.manual_seed(0)
    freezer = _train_fp64(TinyNet().double(), policy)
    observed = [v for s in freezer.history for v in s.mean_step_grad_norm + s.summed_grad_norm if v is not None]
    # a policy that reads no gradient statistic gets none (its monitor only counts steps)
    assert bool(observed) == freezer.policy.needs().gradient_norms
    assert all(math.isfinite(v) for v in observed)
    assert freezer.monitor.norm_dtype == torch.float64


def test_one_fp64_block_among_fp32_ones_is_read_in_fp64_and_equals_the_fp64_reference():
    mixed = _model()
    mixed[1].double()
    reference = _model().double()
    mon, ref = GradNormMonitor(split_blocks(mixed)), GradNormMonitor(split_blocks(reference))
    for values in ([1.0, 2.0, 3.0], [0.5, -1.0, 0.25]):
        _set_grads(mixed, values)
        _set_grads(reference, values)
        mon.observe()
        ref.observe()
    s, r = mon.close_interval(0, 0, end_step=2), ref.close_interval(0, 0, end_step=2)
    assert s.summed_grad_norm == r.summed_grad_norm and s.mean_step_grad_norm == r.mean_step_grad_norm


# ---------------------------------------------------------------- pending rows (GPU check: launch-bound steps)
def _deep(width: int = 3, depth: int = 4) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


def _reference_stats(blocks, steps, first_active_at):
    """The per-step fold the monitor had before pending rows (each step's block norms added as it
    came, its summed gradient added per tensor): the sums must be these, bit for bit."""
    params = [p for b in blocks for p in b.params]
    block_of = [i for i, b in enumerate(blocks) for _ in b.params]
    norm_sum = torch.zeros(len(blocks))
    summed = {}
    finite_steps = [0] * len(blocks)
    for step, (grads, scale) in enumerate(steps):
        first = first_active_at(step)
        positions = [i for i, g in enumerate(grads) if g is not None and block_of[i] >= first]
        tensors = [grads[i] for i in positions]
        per_tensor = torch.stack(list(torch._foreach_norm(tensors, 2, dtype=torch.float32)))
        ids = torch.tensor([block_of[i] for i in positions])
        block = torch.zeros(len(blocks)).index_add_(0, ids, per_tensor.square()).sqrt()
        finite = torch.isfinite(block.sum())
        if scale is not None:
            block = block * (1.0 / scale)
        norm_sum.add_(torch.where(finite, block, 0.0))
        for b in range(first, len(blocks)):
            finite_steps[b] += int(finite)
        for i in positions:
            summed.setdefault(i, torch.zeros_like(params[i]))
            summed[i].add_(torch.where(finite, grads[i], 0.0), alpha=1.0 if scale is None else 1.0 / scale)
    mean = [s / n if n else None for s, n in zip(norm_sum.tolist(), finite_steps)]
    return mean, summed


def _random_steps(model, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for step in range(n):
        grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
        if step == 2:
            grads[4][0, 0] = float("nan")  # a NaN step (block 2): masked
        if step == 4:
            grads[6][1] = float("inf")  # an overflow: masked
        if step == 5:
            grads[3] = None  # a parameter without a gradient this step
        scale = 8.0 if step in (6, 7) else None  # read before unscaling, with grad_scale=
        steps.append((grads, scale))
    return steps


# The monitor's two ways of summing a step's gradients: in place where the host reads for free, through
# staging elsewhere (freeze.monitor.grad_sums._FREE_TO_READ_DEVICE_TYPES); a test given ``free_to_read`` sets it.
_BOTH_SUM_PATHS = pytest.mark.parametrize("free_to_read", [{"cpu"}, set()], ids=["added in place", "through staging"])


@_BOTH_SUM_PATHS
@pytest.mark.parametrize("chunk_elements", [1 << 23, 10])
def test_folding_pending_steps_gives_the_per_step_sums_bit_for_bit(monkeypatch, chunk_elements, free_to_read):
    """Steps are folded in rows (at close, at a boundary move, at a checkpoint); the statistics are
    those of a fold per step, bitwise: NaN and inf steps masked, a missing gradient, a float scale, a
    boundary moved mid-interval, a checkpoint mid-interval, the summed gradient in flat chunks and,
    with tiny chunks, tensor by tensor (a transposed, non-contiguous gradient among them); summed in
    place as on the host, and through the staging buffer as on a GPU (masked without a host read)."""
    monkeypatch.setattr("freeze.monitor.grad_sums._FLAT_CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr("freeze.monitor.grad_sums._FREE_TO_READ_DEVICE_TYPES", frozenset(free_to_read))
    model = _deep()
    blocks = split_blocks(model)
    steps = _random_steps(model, 10, seed=0)
    steps[1][0][2] = steps[1][0][2].t().contiguous().t()  # same values, column-major
    mon = GradNormMonitor(blocks)
    for step, (grads, scale) in enumerate(steps):
        if step == 3:
            mon.set_first_active(1)
        if step == 8:  # a checkpoint with pending steps, resumed in a new monitor
            state = mon.state_dict()
            mon = GradNormMonitor(blocks)
            mon.load_state_dict(state)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        mon.observe(grad_scale=scale)
    sums_at_close = {pos: t.clone() for pos, t in mon.grad_sums.sums.items()}
    stats = mon.close_interval(epoch=0, boundary=1, end_step=len(steps))
    mean, summed = _reference_stats(blocks, steps, lambda step: 1 if step >= 3 else 0)
    assert list(stats.mean_step_grad_norm[1:]) == mean[1:]  # exact: same operations, same order
    assert stats.skipped_steps == 2
    positions = sorted(p for p in summed if p >= len(blocks[0].params))
    ref_tensors = [summed[p] for p in positions]
    ref = torch.stack(list(torch._foreach_norm(ref_tensors, 2, dtype=torch.float32)))
    block_of = [i for i, b in enumerate(blocks) for _ in b.params]
    ids = torch.tensor([block_of[p] for p in positions])
    ref_blocks = torch.zeros(len(blocks)).index_add_(0, ids, ref.square()).sqrt().tolist()
    assert list(stats.summed_grad_norm[1:]) == ref_blocks[1:]
    assert all(torch.equal(sums_at_close[p], summed[p]) for p in positions)  # the tensors, bit for bit


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_sum_alike_in_place_and_through_staging(monkeypatch, dtype):
    """fp16 and bf16 gradients (an inf step among them) give the same summed tensors on both paths."""
    model = _deep().to(dtype)
    steps = [g for g, _ in _random_steps(model, 6, seed=1)]

    def sums(free_to_read):
        monkeypatch.setattr("freeze.monitor.grad_sums._FREE_TO_READ_DEVICE_TYPES", frozenset(free_to_read))
        mon = GradNormMonitor(split_blocks(model))
        for grads in steps:
            for p, g in zip(model.parameters(), grads):
                p.grad = None if g is None else g.to(dtype)
            mon.observe()
        return {pos: t.clone() for pos, t in mon.grad_sums.sums.items()}

    in_place, staged = sums({"cpu"}), sums(set())
    assert in_place.keys() == staged.keys() and all(torch.equal(in_place[p], staged[p]) for p in in_place)


def test_on_the_host_a_finite_unscaled_step_is_summed_in_place(monkeypatch):
    """The host's one-pass sum is the path a CPU step takes (one foreach add per flat buffer, not a
    copy, mask and add through staging): fewer operations than the staging path for the same step."""
    in_place = _ops_per_step(40, track_summed=True)
    monkeypatch.setattr("freeze.monitor.grad_sums._FREE_TO_READ_DEVICE_TYPES", frozenset())
    assert in_place < _ops_per_step(40, track_summed=True)


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(depth: int, track_summed: bool) -> int:
    model = _deep(depth=depth)
    mon = GradNormMonitor(split_blocks(model), track_summed=track_summed)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    mon.observe()  # the first step builds the buffers
    with _CountOps() as count:
        mon.observe()
    return count.ops


@_BOTH_SUM_PATHS
@pytest.mark.parametrize("track_summed", [False, True])
def test_the_operations_a_step_launches_do_not_grow_with_the_parameters(monkeypatch, track_summed, free_to_read):
    """On a GPU a small model's step is bound by launching kernels (the first GPU check: the monitor
    took 0.8-1.2 ms a step, ~15 operations of a per-step fold, 2P more with the summed gradient)."""
    monkeypatch.setattr("freeze.monitor.grad_sums._FREE_TO_READ_DEVICE_TYPES", frozenset(free_to_read))
    few, many = _ops_per_step(4, track_summed), _ops_per_step(40, track_summed)
    assert few == many  # 8 parameters or 80: the same operations
    # the row (select, foreach norm, stack); with the summed gradient, the step's finiteness (9: isfinite
    # alone is 4 operations), its host read and one foreach add per flat buffer on the host (one copy,
    # mask and add per flat buffer through staging on a GPU: 17 in torch 2.14)
    assert many <= (20 if track_summed else 3)


def test_a_policy_that_reads_no_gradient_statistic_costs_no_norm_unless_asked():
    """Issue 49: the per-step norms were most of the engine's host work over the static limit, read
    by nothing under policy none; track_summed_grads=True still records every statistic."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    quiet = Freezer(model, split_blocks(model), make_policy("static:k=1"), optimizer=optimizer, epochs=1)
    other = TinyNet()
    recorded = Freezer(other, split_blocks(other), make_policy("static:k=1"), epochs=1, track_summed_grads=True)
    for freezer in (quiet, recorded):
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
        F.cross_entropy(freezer.module(x), y).backward()
        freezer.after_backward()
        freezer.end_epoch(0)
    (quiet_stats,), (recorded_stats,) = quiet.history, recorded.history
    assert quiet_stats.steps == 1 and set(quiet_stats.mean_step_grad_norm) == {None}
    assert all(v is not None for v in recorded_stats.mean_step_grad_norm[1:])  # block 0 frozen from the start
    quiet.close()
    recorded.close()
