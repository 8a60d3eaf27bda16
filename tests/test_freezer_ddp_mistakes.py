"""The two mistakes that used to train one model per rank in silence (exit 0, 0 bytes all-reduced,
ranks diverged: a new user's trial under torchrun), each refused in one line on 2 gloo ranks: the
Freezer built before ``init_process_group``, and the loss computed from the bare model instead of
``freezer.module``. The right ways to train stay accepted: gradient accumulation with ``no_sync``
and evaluation forwards between steps. Also the activation cache's two augmentation mistakes,
refused on every rank before any freeze."""

import os

import pytest
import torch
import torch.nn.functional as F

from freeze import Freezer, make_policy, split_blocks
from freeze.testing import run_gloo_rank, spawn_and_collect
from tests.distributed_harness import run_distributed
from tests.tiny_models import TinyNet, global_batch


def _local_batch(rank: int, world_size: int, step: int):
    x, y = global_batch(step, 8)
    local = 8 // world_size
    return x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]


def _error_of(call) -> str | None:
    try:
        call()
    except RuntimeError as e:
        return str(e)
    return None


def _steps(freezer: Freezer, optimizer, rank: int, world_size: int, steps: int) -> None:
    """``steps`` training steps the right way: through freezer.module, after_backward before step."""
    for step in range(steps):
        x, y = _local_batch(rank, world_size, step)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(freezer.module(x), y).backward()
        freezer.after_backward()
        optimizer.step()


def _train_two_steps(rank: int, world_size: int) -> dict:
    """Built after init_process_group, as the error says: the ranks all-reduce and agree."""
    torch.manual_seed(rank)  # different initial weights: the Freezer must broadcast rank 0's
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer)
    _steps(freezer, optimizer, rank, world_size, 2)
    freezer.close()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"bytes": freezer.counters.allreduce_bytes_total, "params": params}


def _before_init_worker(rank: int, world_size: int, workdir: str) -> None:
    # What torchrun puts in every process's environment before the script runs.
    os.environ.update({"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)})
    model = TinyNet()
    early = _error_of(lambda: Freezer(model, split_blocks(model)))
    group = _error_of(lambda: Freezer(model, split_blocks(model), process_group=object()))
    run_gloo_rank(
        rank,
        world_size,
        workdir,
        60.0,
        lambda: {"early": early, "explicit_group": group, "after_init": _train_two_steps(rank, world_size)},
    )


@pytest.fixture(scope="module")
def before_init(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("before-init")
    payloads = spawn_and_collect(_before_init_worker, (2, str(workdir)), 2, workdir, deadline_s=120)
    for r, payload in enumerate(payloads):
        assert payload["ok"], f"rank {r} failed:\n{payload.get('error')}"
    return [p["result"] for p in payloads]


@pytest.mark.processes
def test_freezer_built_before_init_process_group_is_refused_in_one_line(before_init):
    for r in before_init:
        message = r["early"]
        assert message is not None and "\n" not in message
        assert "WORLD_SIZE=2" in message and "init_process_group" in message


@pytest.mark.processes
def test_explicit_process_group_without_torch_distributed_is_refused(before_init):
    for r in before_init:
        message = r["explicit_group"]
        assert message is not None and "\n" not in message and "init_process_group" in message


@pytest.mark.processes
def test_freezer_built_after_init_process_group_trains_one_model(before_init):
    r0, r1 = (r["after_init"] for r in before_init)
    assert r0["bytes"] > 0 and r0["bytes"] == r1["bytes"]
    assert torch.equal(r0["params"], r1["params"])


def test_world_size_one_without_a_group_is_one_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    model = TinyNet()
    Freezer(model, split_blocks(model)).close()


# ---------------------------------------------------------------------- the bare model's forward
def _bare_model_step(rank: int, world_size: int) -> dict:
    """The loss computed from the bare model: after_backward refuses at the first step, before
    counting it."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer)
    x, y = _local_batch(rank, world_size, 0)
    F.cross_entropy(model(x), y).backward()
    error = _error_of(freezer.after_backward)
    steps = freezer.counters.steps
    freezer.close()
    return {"error": error, "steps": steps}


def _eval_forward_is_not_a_step(rank: int, world_size: int) -> dict:
    """A correct step, then an evaluation through freezer.module under no_grad, then a bare-model
    step: the evaluation does not stand in for the missing training forward."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer)
    x, y = _local_batch(rank, world_size, 0)
    F.cross_entropy(freezer.module(x), y).backward()
    freezer.after_backward()
    optimizer.zero_grad(set_to_none=True)
    freezer.eval()
    with torch.no_grad():
        freezer.module(x)
    freezer.train()
    F.cross_entropy(model(x), y).backward()
    error = _error_of(freezer.after_backward)
    freezer.close()
    return {"error": error}


def _accumulation(rank: int, world_size: int) -> dict:
    """Two micro-batches per step, the first under no_sync: accepted; both under no_sync (nothing
    all-reduced): refused."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, split_blocks(model), optimizer=optimizer)
    (x0, y0), (x1, y1) = (_local_batch(rank, world_size, s) for s in (0, 1))
    with freezer.module.no_sync():
        F.cross_entropy(freezer.module(x0), y0).backward()
    F.cross_entropy(freezer.module(x1), y1).backward()
    freezer.after_backward()
    accumulated_bytes = freezer.counters.allreduce_bytes_last_step
    optimizer.zero_grad(set_to_none=True)
    with freezer.module.no_sync():
        F.cross_entropy(freezer.module(x0), y0).backward()
        F.cross_entropy(freezer.module(x1), y1).backward()
    error = _error_of(freezer.after_backward)
    freezer.close()
    return {"bytes": accumulated_bytes, "expected": freezer.trainable_grad_bytes, "all_no_sync_error": error}


def _cache_mistakes(rank: int, world_size: int) -> dict:
    """The cache's two augmentation mistakes, on every rank alike and without a hang: a source that
    augments randomly (refused at construction) and inputs augmented outside the source (refused at
    the first training step, long before the first freeze)."""
    from freeze.cache import CacheError, CacheSource

    torch.manual_seed(0)
    images = torch.randn(16, 3, 8, 8)
    noisy = CacheSource(lambda keys: images[keys] + 0.01 * torch.randn(len(keys), 3, 8, 8), 16)
    fixed = CacheSource(lambda keys: images[keys], 16)
    out = {}
    model = TinyNet()
    try:
        Freezer(model, split_blocks(model), cache="memory", cache_source=noisy)
    except CacheError as e:
        out["random_source"] = str(e)
    freezer = Freezer(model, split_blocks(model), cache="memory", cache_source=fixed)
    keys = torch.arange(rank * 4, rank * 4 + 4)
    try:
        freezer.module(images[keys].flip(-1), sample_ids=keys)
    except CacheError as e:
        out["outside_source"] = str(e)
    out["boundary"] = freezer.boundary
    freezer.close()
    return out


def _silent_mistakes(rank: int, world_size: int) -> dict:
    """The two mistakes that once gave a wrong result with no word (a new user's trial): a loop that
    never calls end_epoch (a per-epoch policy never froze, exit 0), and a checkpoint of a Freezer
    built without optimizer= (the README's resume then trained differently). Each warns on every rank."""
    import warnings

    out = {}
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    freezer = Freezer(model, split_blocks(model), policy=make_policy("geometric:alpha=0.5"), epochs=2)  # no optimizer=
    _steps(freezer, optimizer, rank, world_size, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        freezer.training_state_dict()
        freezer.close()  # two steps, no end_epoch(): the geometric policy never decided
    out["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    out["boundary"] = freezer.boundary
    # the right loop (optimizer given, end_epoch called) warns about neither
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    freezer = Freezer(
        model, split_blocks(model), policy=make_policy("geometric:alpha=0.5"), epochs=2, optimizer=optimizer
    )
    _steps(freezer, optimizer, rank, world_size, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        freezer.end_epoch(0)
        freezer.training_state_dict()
        freezer.close()
    out["right_loop_warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    return out


def _mistakes_worker(rank: int, world_size: int) -> dict:
    return {
        "bare": _bare_model_step(rank, world_size),
        "eval": _eval_forward_is_not_a_step(rank, world_size),
        "accumulation": _accumulation(rank, world_size),
        "cache": _cache_mistakes(rank, world_size),
        "silent": _silent_mistakes(rank, world_size),
    }


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory):
    return run_distributed(_mistakes_worker, 2, tmp_path_factory.mktemp("bare-model"), deadline_s=120)


@pytest.mark.processes
def test_bare_model_forward_is_refused_at_the_first_after_backward(mistakes):
    for r in mistakes:
        message = r["bare"]["error"]
        assert message is not None and "\n" not in message and "freezer.module" in message
        assert r["bare"]["steps"] == 0  # refused before the step was counted


@pytest.mark.processes
def test_evaluation_forward_does_not_count_as_the_training_forward(mistakes):
    for r in mistakes:
        assert r["eval"]["error"] is not None and "freezer.module" in r["eval"]["error"]


@pytest.mark.processes
def test_accumulation_with_no_sync_is_accepted_and_all_no_sync_refused(mistakes):
    for r in mistakes:
        out = r["accumulation"]
        assert out["bytes"] == out["expected"] > 0
        assert out["all_no_sync_error"] is not None and "no_sync()" in out["all_no_sync_error"]


@pytest.mark.processes
def test_cache_augmentation_mistakes_are_refused_on_every_rank_before_any_freeze(mistakes):
    for r in mistakes:
        out = r["cache"]
        assert "random augmentation inside the source" in out.get("random_source", "")
        assert "not cache_source.inputs(sample_ids)" in out.get("outside_source", "")
        assert out["boundary"] == 0


@pytest.mark.processes
def test_no_end_epoch_and_no_optimizer_state_are_said_on_every_rank(mistakes):
    for r in mistakes:
        no_optimizer, no_epoch = r["silent"]["warnings"]
        assert "holds no optimizer state" in no_optimizer and "optimizer=" in no_optimizer
        assert "after 2 optimizer steps and end_epoch() was never called" in no_epoch
        assert "boundary stayed at 0" in no_epoch and r["silent"]["boundary"] == 0
        assert r["silent"]["right_loop_warnings"] == []


def test_bare_model_forward_in_one_process_is_accepted():
    # Without a process group the bare model computes the same gradients: nothing to refuse
    # (and Lightning's single-device strategy calls the LightningModule itself).
    torch.manual_seed(0)
    model = TinyNet()
    freezer = Freezer(model, split_blocks(model))
    x, y = global_batch(0, 4)
    F.cross_entropy(model(x), y).backward()
    freezer.after_backward()
    assert freezer.counters.steps == 1
