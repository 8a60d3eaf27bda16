"""PowerSGD under real DDP (2 gloo ranks), with a policy that freezes mid-run: the bytes it sends
(hand-computed), replicas bit-equal, its state carried across the re-wrap, a resume bitwise equal
to the uninterrupted run, and its arithmetic equal to torch's own ``powerSGD_hook``.

One spawn per hook runs every scenario; the tests read its results.
"""

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from freeze import Freezer, comm, make_policy, split_blocks
from freeze.powersgd import ORTHOGONALIZATION_EPSILON, WARMUP_ITERATIONS, PowerSGDState
from tests.distributed_harness import run_distributed

pytestmark = pytest.mark.processes

STEPS = 28  # one epoch; the policy freezes block 0 at 75 % of it (step 22) and block 1 at 87.5 % (step 26)
SAVE_AT = WARMUP_ITERATIONS + 3  # past the warm-up, before the freeze: the resume must carry both
GLOBAL_BATCH = 8
FLOAT = 4  # bytes

# Hand-computed floats per step for the model below (Linear 32x32, Linear 32x32, Linear 32x4, with
# biases), by boundary. A weight n x m is sent as P (n x r) and Q (m x r) when (n + m) r 2 < n m
# (torch's min_compression_rate 2), else whole; biases always whole.
# warm-up: everything, (1024 + 32) * 2 + 128 + 4
WARMUP_FLOATS = 2244
EXPECTED_FLOATS = {
    # rank 1: biases 32+32+4; P 32+32+4; Q 32+32+32 | biases 32+4; P 32+4; Q 32+32 | bias 4; P 4; Q 32
    "powersgd1": {0: 68 + 68 + 96, 1: 36 + 36 + 64, 2: 4 + 4 + 32},
    # rank 4: the 4x32 head is sent whole ((4+32)*4*2 >= 128): biases + head 32+32+128+4; P 128+128;
    # Q 128+128 | 32+128+4; 128; 128 | 128+4
    "powersgd4": {0: 196 + 256 + 256, 1: 164 + 128 + 128, 2: 132},
}


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, 32, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
    local = GLOBAL_BATCH // world_size
    return x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]


def build(comm_hook: str):
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    policy = make_policy("freezeout:t0=0.75,scale=linear")
    freezer = Freezer(
        model,
        split_blocks(model),
        policy,
        optimizer=optimizer,
        epochs=1,
        steps_per_epoch=STEPS,
        interval_steps=2,
        comm_hook=comm_hook,
    )
    return model, optimizer, freezer


def train(freezer, optimizer, steps: range, rank: int, world_size: int, log: dict) -> None:
    for step in steps:
        log["boundary"].append(freezer.boundary)
        x, y = batch(step, rank, world_size)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(freezer.module(x), y)
        loss.backward()
        freezer.after_backward()
        optimizer.step()
        error = freezer.engine.comm.powersgd.error
        log["errors"].append(sorted(error))
        before_rewrap = {n: t.clone() for n, t in error.items()}
        if freezer.after_step():  # a re-wrap: what is kept must be kept exactly
            kept = freezer.engine.comm.powersgd.error
            log["carried"].append((sorted(kept), all(torch.equal(before_rewrap[n], t) for n, t in kept.items())))
        log["bytes"].append(freezer.counters.allreduce_bytes_last_step)
        log["loss"].append(loss.item())


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gathered(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    every = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(every, tensor)
    return every


def uninterrupted(comm_hook: str, rank: int, world_size: int) -> dict:
    model, optimizer, freezer = build(comm_hook)
    log = {"boundary": [], "bytes": [], "loss": [], "errors": [], "carried": []}
    train(freezer, optimizer, range(STEPS), rank, world_size, log)
    log["params_every_rank"] = gathered(flat(model), world_size)
    log["final"] = flat(model).clone()
    log["bytes_total"] = freezer.counters.allreduce_bytes_total
    freezer.close()
    return log


def resumed(comm_hook: str, rank: int, world_size: int, forget_error: bool = False) -> dict:
    """SAVE_AT steps, a checkpoint through torch.save / torch.load(weights_only=True), a fresh
    model, optimizer and Freezer that load it, the remaining steps."""
    model, optimizer, freezer = build(comm_hook)
    log = {"boundary": [], "bytes": [], "loss": [], "errors": [], "carried": []}
    train(freezer, optimizer, range(SAVE_AT), rank, world_size, log)
    buffer = io.BytesIO()
    torch.save(freezer.training_state_dict(), buffer)
    freezer.close()
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    if forget_error:
        state["freezer"]["powersgd"]["error"] = {}
    model, optimizer, freezer = build(comm_hook)
    freezer.load_training_state_dict(state)
    train(freezer, optimizer, range(SAVE_AT, STEPS), rank, world_size, log)
    log["final"] = flat(model).clone()
    log["bytes_total"] = freezer.counters.allreduce_bytes_total
    freezer.close()
    return log


def against_torch(comm_hook: str, rank: int, world_size: int) -> dict:
    """The same bias-free model (every weight compressed, one bucket) under torch's powerSGD_hook
    and under ours, both with a warm-up of 2 iterations: the parameters after each step."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
    from torch.nn.parallel import DistributedDataParallel

    matrix_rank = 1 if comm_hook == "powersgd1" else 4
    # Shapes 64x32, 64x64, 32x64, 64x32, 10x64: one shape twice, apart, so the grouping by shape counts.
    widths = [32, 64, 64, 32, 64, 10]
    results = {}
    for which in ("torch", "ours"):
        torch.manual_seed(0)
        layers = [nn.Linear(a, b, bias=False) for a, b in zip(widths[:-1], widths[1:])]
        model = nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())][:-1])
        if which == "torch":
            ddp = DistributedDataParallel(model)
            state = torch_psgd.PowerSGDState(
                None,
                matrix_approximation_rank=matrix_rank,
                start_powerSGD_iter=2,
                orthogonalization_epsilon=ORTHOGONALIZATION_EPSILON,
            )
            ddp.register_comm_hook(state, torch_psgd.powerSGD_hook)
        else:
            counter = comm.make_counter(comm_hook)
            counter.powersgd = PowerSGDState(matrix_rank, warmup_iterations=2)
            ddp = comm.build_ddp(model, [], counter, comm_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        params = []
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(2 * world_size, 32, generator=g)[rank * 2 : rank * 2 + 2]
            optimizer.zero_grad(set_to_none=True)
            ddp(x).square().mean().backward()
            optimizer.step()
            params.append(flat(model).clone())
        results[which] = params
        del ddp
    return results


def overflow(comm_hook: str, rank: int, world_size: int) -> dict:
    """Past the warm-up, one step whose gradient on rank 1 only is not finite (an fp16 overflow),
    skipped as GradScaler skips it; then 3 ordinary steps."""
    model, optimizer, freezer = build(comm_hook)
    first_bad = WARMUP_ITERATIONS + 2
    for step in range(first_bad + 4):
        x, y = batch(step, rank, world_size)
        optimizer.zero_grad(set_to_none=True)
        scale = float("inf") if step == first_bad and rank == 1 else 1.0
        (scale * F.cross_entropy(freezer.module(x), y)).backward()
        freezer.after_backward(skipped=step == first_bad)
        if step != first_bad:
            optimizer.step()
    state = freezer.engine.comm.powersgd
    out = {
        "params_every_rank": gathered(flat(model), world_size),
        "state_finite": all(torch.isfinite(t).all() for t in [*state.error.values(), *state.q_memory.values()]),
        "errors": sorted(state.error),
    }
    freezer.close()
    return out


def worker(rank: int, world_size: int, comm_hook: str) -> dict:
    return {
        "overflow": overflow(comm_hook, rank, world_size),
        "run": uninterrupted(comm_hook, rank, world_size),
        "resumed": resumed(comm_hook, rank, world_size),
        "resumed_without_error": resumed(comm_hook, rank, world_size, forget_error=True),
        "torch": against_torch(comm_hook, rank, world_size),
    }


@pytest.fixture(scope="module", params=["powersgd1", "powersgd4"])
def ranks(request, tmp_path_factory):
    return request.param, run_distributed(worker, 2, tmp_path_factory.mktemp(request.param), request.param)


def test_the_policy_freezes_mid_run_after_the_warm_up(ranks):
    _, (r0, _) = ranks
    first_frozen = r0["run"]["boundary"].index(1)
    assert WARMUP_ITERATIONS < first_frozen < r0["run"]["boundary"].index(2) < STEPS, r0["run"]["boundary"]
    assert first_frozen > SAVE_AT  # the resume below re-wraps after loading the state


def test_bytes_are_the_hand_computed_factors_and_tensors(ranks):
    hook, (r0, r1) = ranks
    expected = [
        FLOAT * (WARMUP_FLOATS if step < WARMUP_ITERATIONS else EXPECTED_FLOATS[hook][k])
        for step, k in enumerate(r0["run"]["boundary"])
    ]
    assert r0["run"]["bytes"] == expected and r1["run"]["bytes"] == expected
    assert r0["run"]["bytes_total"] == sum(expected)


def test_ranks_are_bit_equal_and_the_run_trains(ranks):
    _, (r0, r1) = ranks
    every = r0["run"]["params_every_rank"]
    assert torch.equal(every[0], every[1]) and torch.equal(r0["run"]["final"], r1["run"]["final"])
    losses = r0["run"]["loss"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_error_feedback_of_trainable_parameters_survives_the_rewrap_and_frozen_ones_is_dropped(ranks):
    hook, (r0, _) = ranks
    run = r0["run"]
    compressed = {
        "powersgd1": {0: ["0.weight", "2.weight", "4.weight"], 1: ["2.weight", "4.weight"], 2: ["4.weight"]},
        "powersgd4": {0: ["0.weight", "2.weight"], 1: ["2.weight"], 2: []},
    }[hook]
    for step, k in enumerate(run["boundary"]):
        if step >= WARMUP_ITERATIONS:
            assert run["errors"][step] == compressed[k], (step, k)
    assert run["carried"] == [(compressed[1], True), (compressed[2], True)]


def test_a_resumed_run_is_bitwise_the_uninterrupted_one(ranks):
    _, ranks_ = ranks
    for r in ranks_:
        assert torch.equal(r["resumed"]["final"], r["run"]["final"])
        assert r["resumed"]["bytes"] == r["run"]["bytes"] and r["resumed"]["bytes_total"] == r["run"]["bytes_total"]
        # the check has teeth: the same resume without the saved error feedback ends elsewhere
        assert not torch.equal(r["resumed_without_error"]["final"], r["run"]["final"])


def test_the_arithmetic_is_torchs_powersgd_hook(ranks):
    _, ranks_ = ranks
    for r in ranks_:
        for step, (theirs, ours) in enumerate(zip(r["torch"]["torch"], r["torch"]["ours"])):
            assert torch.equal(theirs, ours), step


def test_a_skipped_overflow_step_does_not_poison_later_steps(ranks):
    hook, ranks_ = ranks
    for r in ranks_:
        every = r["overflow"]["params_every_rank"]
        assert torch.isfinite(every[0]).all() and torch.equal(every[0], every[1])
        assert r["overflow"]["state_finite"] and r["overflow"]["errors"]  # compressing again, with error feedback
