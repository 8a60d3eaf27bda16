"""Annealing before freezing (issue 46): the per-block learning-rate factors a policy asks for
reach the optimizer as the spec says, on one process and on 2 gloo ranks with exact bytes, the
run's scheduler never sees them, and a run resumed mid-anneal is bit-identical."""

import math

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, make_policy, split_blocks
from freeze.blocks import block_param_groups
from freeze.policies import PolicyError, Progress
from tests.distributed_harness import run_distributed
from tests.tiny_models import TinyNet, global_batch

EPOCHS, STEPS_PER_EPOCH, BASE_LR = 2, 8, 0.1
TOTAL = EPOCHS * STEPS_PER_EPOCH
ANNEAL = "at:k=2,t=0.5,anneal=0.25"  # blocks 0-1 anneal over steps 4..8 and freeze at step 8


def cosine(x: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * min(max(x, 0.0), 1.0)))


def build(spec: str, seed: int = 0, optimizer: str = "sgd"):
    torch.manual_seed(seed)
    model = TinyNet()
    blocks = split_blocks(model)
    groups = block_param_groups(blocks)
    if optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=BASE_LR, momentum=0.9, weight_decay=1e-4)
    else:
        opt = torch.optim.AdamW(groups, lr=BASE_LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s / TOTAL))
    freezer = Freezer(
        model,
        blocks,
        make_policy(spec),
        optimizer=opt,
        epochs=EPOCHS,
        steps_per_epoch=STEPS_PER_EPOCH,
        interval_steps=2,
    )
    return model, freezer, opt, sched


def train(model, freezer, opt, sched, steps: range, *, backward_first: bool = True, rank=0, world=1):
    """Train ``steps``; returns the learning rates each group stepped with, per step."""
    stepped: list[list[float]] = []
    hook = opt.register_step_pre_hook(lambda o, a, k: stepped.append([g["lr"] for g in o.param_groups]))
    local = 8 // world
    for step in steps:
        freezer.train()
        x, y = global_batch(step, 8)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(
            freezer.module(x[rank * local : (rank + 1) * local]), y[rank * local : (rank + 1) * local]
        ).backward()
        if backward_first:
            freezer.after_backward()
            opt.step()
        else:  # the documented alternative position: after the optimizer step
            opt.step()
            freezer.after_backward()
        sched.step()
        freezer.after_step()
        if (step + 1) % STEPS_PER_EPOCH == 0:
            freezer.end_epoch(step // STEPS_PER_EPOCH)
    hook.remove()
    return stepped


def expected_at_anneal(step: int) -> list[float]:
    run = BASE_LR * cosine(step / TOTAL)
    fraction = step / TOTAL
    body = 0.0 if fraction >= 0.5 else cosine((fraction - 0.25) / 0.25)
    return [run * body, run * body, run, run]


@pytest.mark.parametrize("backward_first", [True, False])
def test_anneal_then_freeze_steps_each_group_at_the_schedule_times_the_window(backward_first):
    model, freezer, opt, sched = build(ANNEAL)
    stepped = train(model, freezer, opt, sched, range(TOTAL), backward_first=backward_first)
    for step, lrs in enumerate(stepped):
        expected = expected_at_anneal(step)
        # blocks 0-1 are frozen from step 8: no parameter of theirs steps, whatever the group's lr
        assert lrs[2:] == pytest.approx(expected[2:], rel=1e-12, abs=0), step
        if step < 8:
            assert lrs[:2] == pytest.approx(expected[:2], rel=1e-12, abs=1e-15), step
    # the window in numbers: steps 3..7 at fractions 3/16..7/16, the window [0.25, 0.5]
    body_factors = [lrs[0] / (BASE_LR * cosine(s / TOTAL)) for s, lrs in enumerate(stepped[3:8], 3)]
    assert body_factors == pytest.approx([1.0, 1.0, cosine(0.25), cosine(0.5), cosine(0.75)], rel=1e-12)
    assert freezer.boundary == 2 and freezer.decisions[0].step == 8  # the freeze step is the hard clock's
    # the scheduler never saw a scaled value: every group holds the schedule's learning rate between steps
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([BASE_LR * cosine(1.0)] * 4, abs=1e-15)


def test_the_hard_clock_and_the_annealed_one_freeze_at_the_same_step():
    hard = build("at:k=2,t=0.5")
    annealed = build(ANNEAL)
    train(*hard, range(TOTAL))
    train(*annealed, range(TOTAL))
    assert [d.step for d in hard[1].decisions] == [d.step for d in annealed[1].decisions] == [8]
    assert hard[1].block_lr_scales() == [1.0] * 4


def test_freezeout_as_published_gives_block_i_its_own_cosine_to_zero_at_t_i():
    spec = "freezeout:t0=0.5,scale=linear,anneal=true,scale_lr=true"
    model, freezer, opt, sched = build(spec)
    stepped = train(model, freezer, opt, sched, range(TOTAL))
    t_i = make_policy(spec).freeze_fractions(4)
    assert t_i == pytest.approx([0.5, 2 / 3, 5 / 6, 1.0])
    for step, lrs in enumerate(stepped):
        for block in range(3):
            # Brock et al. 2017: lr_i(t) = (lr / t_i) * 0.5 (1 + cos(pi t / t_i)), zero from t_i on
            published = BASE_LR / t_i[block] * cosine(step / TOTAL / t_i[block])
            assert lrs[block] == pytest.approx(published, rel=1e-9, abs=1e-15), (step, block)
        assert lrs[3] == pytest.approx(BASE_LR * cosine(step / TOTAL), rel=1e-12)  # the head: the run's cosine


def test_a_resume_mid_anneal_is_bit_identical():
    straight = build(ANNEAL, optimizer="adamw")
    train(*straight, range(TOTAL))
    first = build(ANNEAL, optimizer="adamw")
    train(*first, range(6))  # steps 4..5 of the window done, 6..7 to come
    state = first[1].training_state_dict()
    state["scheduler"] = first[3].state_dict()
    second = build(ANNEAL, seed=1, optimizer="adamw")  # other weights: everything must come from the state
    second[1].load_training_state_dict(state)
    second[3].load_state_dict(state["scheduler"])
    second[1].clock.epochs_completed = 0  # mid-epoch: the loop's own epoch bookkeeping
    train(*second, range(6, TOTAL))
    for a, b in zip(straight[0].state_dict().values(), second[0].state_dict().values()):
        assert torch.equal(a, b)
    assert [d.step for d in second[1].decisions] == [8]


def test_one_group_over_several_blocks_is_refused_in_one_line():
    model = TinyNet()
    blocks = split_blocks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="one group per block") as err:
        Freezer(model, blocks, make_policy(ANNEAL), optimizer=opt, epochs=2, steps_per_epoch=8)
    assert "\n" not in str(err.value)
    # the hard clock does not touch the optimizer: one group is fine
    other = TinyNet()
    Freezer(
        other,
        split_blocks(other),
        make_policy("at:k=2,t=0.5"),
        optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
        epochs=2,
    ).close()


def test_annealing_without_an_optimizer_or_the_run_in_steps_is_refused():
    model = TinyNet()
    with pytest.raises(ValueError, match="steps_per_epoch=N"):
        Freezer(model, split_blocks(model), make_policy(ANNEAL), epochs=2)
    freezer = Freezer(model, split_blocks(model), make_policy(ANNEAL), epochs=2, steps_per_epoch=8)
    x, y = global_batch(0, 8)
    F.cross_entropy(freezer.module(x), y).backward()
    with pytest.raises(RuntimeError, match="attach_optimizer"):
        freezer.after_backward()
    freezer.attach_optimizer(torch.optim.SGD(block_param_groups(freezer.blocks), lr=0.1))
    freezer.after_backward()  # attached later, as trainers do: accepted
    with pytest.warns(RuntimeWarning, match="end_epoch"):
        freezer.close()


@pytest.mark.parametrize(
    "spec, words",
    [
        ("at:k=2,t=0.3,anneal=0.4", "0 <= anneal <= t"),
        ("freezeout:scale_lr=true", "scale_lr with anneal=true"),
        ("freezeout:t0=0,anneal=true", "t0 in (0, 1]"),
    ],
)
def test_impossible_anneals_are_refused_at_parse(spec, words):
    with pytest.raises(PolicyError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        make_policy(spec)


def test_a_checkpoint_written_before_anneal_existed_loads_under_the_hard_clock():
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model), make_policy("at:k=2,t=0.5"), epochs=2)
    state = freezer.state_dict()
    state["policy_spec"] = "at:k=2,t=0.5"  # as written before the anneal parameter
    freezer.load_state_dict(state)
    state["policy_spec"] = "at:k=2,t=0.5,anneal=0.1"
    with pytest.raises(ValueError, match="differs"):
        freezer.load_state_dict(state)


def test_scales_are_a_pure_function_of_progress():
    policy = make_policy(ANNEAL)
    p = Progress(epochs_completed=0, epochs_total=2, steps_completed=6, steps_total=16)
    assert policy.block_lr_scales(p, 4) == policy.block_lr_scales(p, 4) == [0.5, 0.5, 1.0, 1.0]
    assert make_policy("at:k=2,t=0.5").block_lr_scales(p, 4) == [1.0] * 4


# ------------------------------------------------------------------ 2 gloo ranks
def ddp_worker(rank: int, world_size: int) -> dict:
    model, freezer, opt, sched = build(ANNEAL, seed=rank)  # rank 0's weights are broadcast
    out = {"bytes": [], "expected": [], "params": []}

    stepped = []
    for step in range(TOTAL):
        out["expected"].append(freezer.trainable_grad_bytes)  # the boundary in force for this step
        stepped += train(model, freezer, opt, sched, range(step, step + 1), rank=rank, world=world_size)
        out["bytes"].append(freezer.counters.allreduce_bytes_last_step)
        out["params"].append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    out["lrs"] = stepped
    out["boundary"] = freezer.boundary
    freezer.close()
    return out


@pytest.mark.processes
def test_on_two_ranks_the_anneal_is_the_spec_and_bytes_are_trainable_bytes(tmp_path):
    ranks = run_distributed(ddp_worker, 2, tmp_path, deadline_s=180)
    for out in ranks:
        assert out["bytes"] == out["expected"]
        assert out["boundary"] == 2
        for step, lrs in enumerate(out["lrs"][:8]):
            assert lrs == pytest.approx(expected_at_anneal(step), rel=1e-12, abs=1e-15)
    assert out["bytes"][8] < out["bytes"][7]  # the freeze cut the traffic
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))
