"""The profiler on a tiny model in one spawned process: the profile's structure (bytes, nulls,
one after-backward time per boundary) and that it round-trips through its file. No time is
asserted beyond being a finite number >= 0 (Profile checks that itself)."""

import pytest

from freeze.pipeline.costmodel import load_profile, save_profile
from freeze.pipeline.costmodel.profiler import NodeCores, ProfileSpec, profile_model
from tests.tiny_models import TinyNet


@pytest.mark.processes
def test_profile_of_a_tiny_model_round_trips(tmp_path):
    spec = ProfileSpec(
        "tinynet", TinyNet, (3, 8, 8), num_classes=5, batch_size=4, steps=1, warmup=1, cache_keys=16, cache_reads=2
    )
    profile = profile_model(spec, [NodeCores((0,), 1)], deadline_s=120, workdir=tmp_path)
    model = TinyNet()
    assert [b.name for b in profile.blocks] == ["stem", "block1", "block2", "head"]
    assert profile.blocks[0].param_bytes == tuple(p.numel() * 4 for p in model.stem.parameters())
    assert profile.blocks[0].buffer_bytes == sum(b.numel() * b.element_size() for b in model.stem.buffers())
    # the input of block1 is the stem's output: 8 channels x 8 x 8 fp32
    assert profile.blocks[1].activation_bytes_per_sample == 8 * 8 * 8 * 4
    assert profile.blocks[0].backward_ms is None and profile.blocks[0].cache_read_ms is None
    assert profile.blocks[-1].forward_frozen_ms is None
    assert len(profile.after_backward_ms) == 4 and profile.nodes_per_core == 1
    spreads = profile.meta["step_ms"]  # the whole step at each boundary: what the noise check reads
    assert len(spreads) == 4 and all(0 < s["low"] <= s["q1"] <= s["median"] <= s["q3"] <= s["high"] for s in spreads)
    path = tmp_path / "p.json"
    save_profile(profile, path)
    assert load_profile(path) == profile and load_profile(path).meta["step_ms"] == spreads
    with pytest.raises(FileExistsError):
        save_profile(profile, path)


def test_cache_read_is_timed_on_the_caches_own_store(monkeypatch):
    """The profile's cache_read_ms times the activation cache's store read (what the cached step
    runs), not a copy of it: every timed read goes through ActivationStore.read."""
    import torch

    from freeze.cache.store import ActivationStore
    from freeze.pipeline.costmodel.profiler import _time_cache_read

    shapes = []
    real_read = ActivationStore.read

    def counting_read(self, keys, device):
        out = real_read(self, keys, device)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(ActivationStore, "read", counting_read)
    spec = ProfileSpec("tinynet", TinyNet, (3, 8, 8), num_classes=5, batch_size=4, cache_keys=16, cache_reads=3)
    ms = _time_cache_read((8, 8, 8), spec, torch.Generator().manual_seed(0))
    assert shapes == [(4, 8, 8, 8)] * 3 and ms >= 0


def test_the_profiled_step_is_the_runs_optimizer():
    """An AdamW run is predicted from AdamW steps (its after-backward time is the optimizer's); a name
    the profiler cannot build is refused in one line."""
    import torch

    model = TinyNet()
    adamw = ProfileSpec("t", TinyNet, (3, 8, 8), num_classes=5, batch_size=4, optimizer="adamw", weight_decay=0.01)
    assert isinstance(adamw.make_optimizer(model), torch.optim.AdamW)
    assert adamw.optimizer_label() == "adamw(weight_decay=0.01)"
    sgd = ProfileSpec("t", TinyNet, (3, 8, 8), num_classes=5, batch_size=4)
    assert isinstance(sgd.make_optimizer(model), torch.optim.SGD) and sgd.optimizer_label() == "sgd(momentum=0.9)"
    with pytest.raises(ValueError, match="accepted: sgd, adamw"):
        ProfileSpec("t", TinyNet, (3, 8, 8), num_classes=5, batch_size=4, optimizer="lamb")
