"""Activation caching of the frozen prefix: exact, never stale, resumable (2 gloo ranks, TinyNet).

One pair of processes trains the same schedule (freeze, freeze further, unfreeze, refreeze) with the
cache off, in memory and on disk, and checks at every step that whatever the cache holds equals a
fresh forward of the current frozen prefix.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freeze import Freezer, split_blocks
from freeze.cache import CacheConfig, CacheError, CacheSource
from tests.cache_harness import N_KEYS
from tests.cache_harness import cache_step as _step
from tests.cache_harness import cached_freezer as _freezer
from tests.distributed_harness import run_distributed
from tests.tiny_models import TinyNet

GLOBAL_BATCH = 8
# Boundary per step: freeze 1, advance to 2 and 3, unfreeze everything, refreeze at 2, move back to 1.
SCHEDULE = [0, 1, 1, 2, 2, 3, 3, 0, 0, 2, 2, 1, 1]


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(N_KEYS, 3, 8, 8, generator=g), torch.randint(0, 5, (N_KEYS,), generator=g)


def step_keys(step: int) -> torch.Tensor:
    return torch.randperm(N_KEYS, generator=torch.Generator().manual_seed(100 + step))[:GLOBAL_BATCH]


def fresh_prefix(model: TinyNet, level: int, x: torch.Tensor) -> torch.Tensor:
    """The frozen prefix computed by hand from the images, up to the cut before block ``level``."""
    with torch.no_grad():
        h = model.stem(x)
        if level >= 2:
            h = model.block1(h)
        if level >= 3:
            h = model.flatten(model.pool(model.block2(h)))
        return h


def train(rank: int, world: int, config: CacheConfig | None, schedule=SCHEDULE, state=None, start=0) -> dict:
    """Train ``schedule`` from step ``start`` (after loading ``state``); record params and what the
    cache serves against a fresh prefix."""
    x, y = dataset()
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    source = CacheSource(inputs=lambda keys: x[keys], num_keys=N_KEYS)
    freezer = Freezer(
        model, split_blocks(model), optimizer=optimizer, cache=config, cache_source=source if config else None
    )
    if state is not None:
        model.load_state_dict(state["model"])
        freezer.load_state_dict(state["freezer"])
        optimizer.load_state_dict(state["optimizer"])
    out = {"params": [], "served_max_diff": [], "levels": [], "placement": [], "statuses": []}
    local = GLOBAL_BATCH // world
    for step in range(start, len(schedule)):
        freezer.set_boundary(schedule[step])
        freezer.train()
        keys = step_keys(step)[rank * local : (rank + 1) * local]
        optimizer.zero_grad(set_to_none=True)
        # The cache builds what a boundary change planned in the step's training forward.
        F.cross_entropy(freezer.module(x[keys], sample_ids=keys), y[keys]).backward()
        freezer.after_backward()
        optimizer.step()
        if freezer.cache_active:  # every entry the cache holds, against the current weights
            held = freezer.cache.store.keys
            served = freezer.cache.store.read(held, torch.device("cpu"))
            out["served_max_diff"].append(
                (served - fresh_prefix(model, freezer.cache.level, x[held])).abs().max().item()
            )
            out["placement"].append(freezer.cache.store.placement)
        out["levels"].append(None if freezer.cache is None else freezer.cache.level)
        out["params"].append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        if freezer.cache is not None:
            out["statuses"].append(freezer.cache.status)
    out["state"] = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "freezer": freezer.state_dict()}
    out["counters"] = None if freezer.cache is None else freezer.cache.counters
    return out


def schedule_worker(rank: int, world: int, directory: str) -> dict:
    return {
        "off": train(rank, world, None),
        "memory": train(rank, world, CacheConfig("memory")),  # one copy in /dev/shm for both ranks
        "private": train(rank, world, CacheConfig("memory", node_shared=False)),  # a copy each, all_gather
        # budget 1 byte: every store spills to a node-local file, written by both ranks directly
        "disk": train(rank, world, CacheConfig("disk", budget_bytes=1, directory=directory)),
        "leftover_files": sorted(p.name for p in __import__("pathlib").Path(directory).iterdir()),
    }


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache-schedule")
    (tmp / "files").mkdir()
    return run_distributed(schedule_worker, 2, tmp, str(tmp / "files"))


@pytest.mark.processes
def test_parameters_equal_with_and_without_the_cache(schedule_runs):
    for rank_out in schedule_runs:
        off = rank_out["off"]["params"]
        for mode in ("memory", "private", "disk"):
            got = rank_out[mode]["params"]
            assert all(torch.equal(a, b) for a, b in zip(off, got)), mode
    assert torch.equal(schedule_runs[0]["memory"]["params"][-1], schedule_runs[1]["memory"]["params"][-1])


@pytest.mark.processes
def test_cache_follows_the_boundary_and_serves_only_fresh_activations(schedule_runs):
    memory = schedule_runs[0]["memory"]
    # built at 1, advanced to 2 and 3, dropped by the unfreeze, rebuilt at 2, dropped again at 1
    # (the unfreeze to 1 invalidates the cut at 2) and rebuilt at 1
    assert memory["levels"] == [None, 1, 1, 2, 2, 3, 3, None, None, 2, 2, 1, 1]
    counters = memory["counters"]
    assert (counters.builds, counters.advances, counters.drops) == (3, 2, 2)
    assert counters.miss_keys == 0 and counters.hit_keys == 4 * 10
    for mode in ("memory", "private", "disk"):
        diffs = [d for r in schedule_runs for d in r[mode]["served_max_diff"]]
        assert len(diffs) == 2 * 10 and max(diffs) == 0.0, (mode, diffs)


@pytest.mark.processes
def test_stores_are_placed_as_configured_and_no_file_is_left_behind(schedule_runs):
    placements = {mode: set(schedule_runs[0][mode]["placement"]) for mode in ("memory", "private", "disk")}
    assert placements == {"memory": {"shm"}, "private": {"private"}, "disk": {"disk"}}
    assert schedule_runs[0]["leftover_files"] == []
    # within one node a shared store exchanges nothing; private copies receive the other rank's rows
    assert schedule_runs[0]["memory"]["counters"].exchanged_bytes_total == 0
    assert schedule_runs[0]["private"]["counters"].exchanged_bytes_total > 0


def resume_worker(rank: int, world: int) -> dict:
    """bf16 storage: an advanced entry (rounded twice) differs from one built at its cut, so only a
    replay of the lineage gives back the bits the uninterrupted run served."""
    config = CacheConfig("memory", storage_dtype="bf16")
    schedule = [0, 1, 1, 2, 2, 3, 3, 3]
    whole = train(rank, world, config, schedule)
    first = train(rank, world, config, schedule[:5])
    resumed = train(rank, world, config, schedule, state=first["state"], start=5)
    rebuilt_state = dict(first["state"], freezer=dict(first["state"]["freezer"], cache=None))
    rebuilt = train(rank, world, config, schedule, state=rebuilt_state, start=5)  # no lineage: built afresh
    return {"whole": whole["params"][-1], "resumed": resumed["params"][-1], "rebuilt": rebuilt["params"][-1]}


@pytest.mark.processes
def test_resume_with_the_cache_is_bit_identical(tmp_path):
    for out in run_distributed(resume_worker, 2, tmp_path):
        assert torch.equal(out["resumed"], out["whole"])
        assert not torch.equal(out["rebuilt"], out["whole"])  # the lineage replay is what makes it exact


# --------------------------------------------------------------------------- single-process refusals


def test_memory_cache_over_budget_is_refused_in_one_line():
    freezer = _freezer(TinyNet(), CacheConfig("memory", budget_bytes=1000))
    cuts = [freezer.cache.cuts.best(k)[0] for k in range(4)]  # known up front: fp32 bytes of one key's entry
    assert [None if c is None else freezer.cache.cuts.sample_meta[c][0].numel() * 4 for c in cuts] == [
        None,
        2048,
        2048,
        64,
    ]
    with pytest.raises(CacheError) as err:
        freezer.set_boundary(1)
    message = str(err.value)
    # stem output: 8 channels x 8 x 8 fp32 = 2048 bytes per key
    assert "\n" not in message and "1,000 bytes" in message and f"{N_KEYS * 2048:,} bytes" in message
    # refused before anything changed: nothing is frozen
    assert freezer.boundary == 0 and all(p.requires_grad for p in freezer.model.parameters())


def test_forward_without_sample_ids_runs_the_model_and_wrong_keys_are_refused_in_one_line():
    freezer = _freezer(TinyNet(), CacheConfig("memory"))
    freezer.set_boundary(2)
    _step(freezer)
    assert freezer.cache_active
    x = torch.randn(2, 3, 8, 8)
    with pytest.warns(RuntimeWarning, match="pass freezer.module\\(x, sample_ids=keys\\)"):
        out = freezer.module(x)
    assert torch.equal(out, freezer.model(x))  # computed from x, not from any stored row
    with pytest.raises(CacheError, match="sample_ids holds 3 keys for a batch of 2") as err:
        freezer.module(x, sample_ids=torch.tensor([0, 1, 2]))
    assert "\n" not in str(err.value)


def test_inputs_other_than_the_sources_are_refused_at_the_first_served_forward():
    """Random augmentation outside cache_source.inputs (or keys that are not the source's numbering)
    would make every served row the activation of another input: refused in one line, once per store."""
    freezer = _freezer(TinyNet(), CacheConfig("memory"))
    freezer.set_boundary(2)
    keys = torch.arange(4)
    augmented = freezer.cache.source.inputs(keys).flip(-1)  # what a RandomHorizontalFlip would hand over
    freezer.train()
    with pytest.raises(CacheError, match="not cache_source.inputs\\(sample_ids\\)") as err:
        freezer.module(augmented, sample_ids=keys)
    assert "\n" not in str(err.value)
    # the source's own inputs are served; and the next store is checked again
    _step(freezer, keys)
    freezer.set_boundary(3)
    with pytest.raises(CacheError, match="not cache_source.inputs"):
        freezer.module(freezer.cache.source.inputs(keys + 1), sample_ids=keys)  # keys of other samples


def test_augmentation_outside_the_source_is_refused_at_the_first_training_step():
    """Not at the first freeze, which a freezeout:t0=0.8 run reaches 80 % of the way in: the first
    training forward given sample_ids compares its inputs with the source's, store or not."""
    freezer = _freezer(TinyNet(), CacheConfig("memory"))
    keys = torch.arange(4)
    freezer.train()
    with pytest.raises(CacheError, match="not cache_source.inputs\\(sample_ids\\)") as err:
        freezer.module(freezer.cache.source.inputs(keys).flip(-1), sample_ids=keys)
    assert "\n" not in str(err.value) and freezer.boundary == 0 and freezer.cache.level is None


def test_source_that_augments_randomly_is_refused_at_construction_in_one_line():
    """A source reading a dataset with RandomCrop (a new user's trial): the cache used to be skipped
    in silence, its status blaming 'batch statistics'. Fetching the same keys twice shows it."""
    from torchvision.transforms import RandomCrop

    torch.manual_seed(0)
    images = torch.randn(N_KEYS, 3, 8, 8)
    crop = RandomCrop(8, padding=2)
    source = CacheSource(lambda keys: torch.stack([crop(images[int(k)]) for k in keys]), N_KEYS)
    model = TinyNet()
    rng_before = torch.get_rng_state()
    with pytest.raises(CacheError, match="returned other inputs when called again with the same keys") as err:
        Freezer(model, split_blocks(model), cache="memory", cache_source=source)
    message = str(err.value)
    assert "\n" not in message and "random augmentation" in message and "batch statistics" not in message
    assert torch.equal(torch.get_rng_state(), rng_before)  # the probe drew from a forked random state


def test_a_source_whose_keys_are_out_of_range_is_refused_at_construction_or_the_first_step():
    x = torch.randn(N_KEYS, 3, 8, 8)
    model = TinyNet()
    source = CacheSource(lambda k: x[k], N_KEYS, epoch_keys=lambda epoch: torch.arange(N_KEYS + 1))
    with pytest.raises(CacheError, match=f"epoch_keys\\(0\\) holds keys outside 0..{N_KEYS - 1}"):
        Freezer(model, split_blocks(model), cache="memory", cache_source=source, epochs=2)
    freezer = _freezer(TinyNet(), CacheConfig("memory"))
    freezer.train()
    with pytest.raises(CacheError, match=f"sample_ids holds keys outside 0..{N_KEYS - 1}"):
        freezer.module(x[:2], sample_ids=torch.tensor([0, N_KEYS]))


def test_a_source_that_fails_is_named_in_one_line_at_construction():
    model = TinyNet()
    source = CacheSource(lambda keys: torch.load("/nonexistent/images.pt"), N_KEYS)
    with pytest.raises(CacheError, match="cache_source.inputs\\(keys 0..7\\) failed \\(FileNotFoundError") as err:
        Freezer(model, split_blocks(model), cache="memory", cache_source=source)
    assert "\n" not in str(err.value)


def test_a_model_no_boundary_of_which_can_be_served_is_said_at_construction():
    model = TinyNet()
    model.stem.append(nn.Dropout(0.5))  # frozen_mode="train" keeps it on: no prefix has one output
    with pytest.warns(RuntimeWarning, match="can serve no boundary of this model exactly") as warned:
        freezer = _freezer(model, CacheConfig("memory"), frozen_mode="train")
    assert warned[0].filename.endswith("cache_harness.py")  # the line that built the Freezer
    assert freezer.explain().splitlines()[-1].startswith("cache (memory): refused: no exact cut at any boundary")


def test_explain_shows_the_caches_state_and_why():
    freezer = _freezer(TinyNet(), CacheConfig("memory"))
    assert freezer.explain().splitlines()[-1] == "cache (memory): waiting: no frozen prefix"
    freezer.set_boundary(2)
    assert "cache (memory): waiting: building the cache before block 2" in freezer.explain()
    _step(freezer)
    assert "cache (memory): active: serving the activations before block 2" in freezer.explain()
    never = _freezer(TinyNet(), CacheConfig("auto", rule=lambda e: False), epochs=3)
    never.set_boundary(2)
    _step(never)
    assert never.explain().splitlines()[-1].startswith("cache (auto): refused: auto: building the cache")
    model = TinyNet()
    assert "cache" not in Freezer(model, split_blocks(model)).explain()


def test_auto_caches_only_where_it_pays():
    never = _freezer(TinyNet(), CacheConfig("auto", rule=lambda e: False), epochs=3)
    never.set_boundary(2)
    _step(never)
    assert never.cache.level is None and "does not pay" in never.cache.status
    seen = []
    always = _freezer(TinyNet(), CacheConfig("auto", rule=lambda e: seen.append(e) or True), epochs=3)
    always.set_boundary(2)
    _step(always)
    assert always.cache.level == 2 and seen[0].keys == N_KEYS and seen[0].reads_remaining_per_rank == 3 * N_KEYS


class _TwoExtras(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, labels=None, **extra):
        return self.head(self.b(self.a(x) + extra["u"] - extra["v"]))


def test_the_input_check_compares_what_the_source_supplies_by_name():
    """Keyword arguments in another order than the source's, and a batch's labels the source does
    not supply, are the same inputs: served, not refused (found in review)."""
    x, u, v = torch.randn(16, 4), torch.randn(16, 4), torch.randn(16, 4)
    model = _TwoExtras()
    source = CacheSource(lambda k: {"x": x[k], "u": u[k], "v": v[k]}, 16)
    freezer = Freezer(model, split_blocks(model), cache=CacheConfig("memory"), cache_source=source)
    freezer.set_boundary(1)
    freezer.train()
    keys = torch.arange(4)
    freezer.module(x[keys], v=v[keys], u=u[keys], labels=torch.zeros(4), sample_ids=keys)
    assert freezer.cache.counters.hit_keys == 4
    freezer.set_boundary(2)
    with pytest.raises(CacheError, match="not cache_source.inputs"):
        freezer.module(x[keys], v=u[keys], u=v[keys], sample_ids=keys)  # u and v swapped: other inputs
