"""A single-process Freezer with an activation cache over random inputs, and the training step in
which the cache builds: shared by tests/test_cache.py, test_cache_cuts.py and test_cache_config.py."""

import torch

from freeze import Freezer, split_blocks
from freeze.cache import CacheSource

N_KEYS = 24


def cached_freezer(model, config, keys=N_KEYS, **kwargs):
    x = torch.randn(keys, 3, 8, 8)
    return Freezer(model, split_blocks(model), cache=config, cache_source=CacheSource(lambda k: x[k], keys), **kwargs)


def cache_step(freezer, keys=None) -> torch.Tensor:
    """One training forward and backward with the batch's keys: where the cache builds what the last
    boundary change planned."""
    keys = torch.arange(4) if keys is None else keys
    freezer.train()
    out = freezer.module(freezer.cache.source.inputs(keys), sample_ids=keys)
    out.sum().backward()
    freezer.after_backward()
    return out
