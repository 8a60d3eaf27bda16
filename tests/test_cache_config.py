"""freeze.cache.config: what the cache is told (one-line refusals naming the field and the accepted
values) and the default rule of mode "auto"."""

import dataclasses

import pytest

from freeze.cache import CacheConfig, CacheError
from freeze.cache.config import CacheEstimate, default_budget_bytes, pays
from tests.cache_harness import cache_step as _step
from tests.cache_harness import cached_freezer as _freezer
from tests.tiny_models import TinyNet


@pytest.mark.parametrize(("epochs", "caches"), [(1, False), (3, True)])
def test_default_auto_rule_caches_when_later_reads_outnumber_the_build(epochs, caches):
    # One rank, 24 keys, no epoch_keys: a build computes 24 rows; every epoch left reads 24. With one
    # epoch left the build costs what it saves (not strictly more: no cache); with three it saves 48.
    freezer = _freezer(TinyNet(), CacheConfig("auto"), epochs=epochs)
    freezer.set_boundary(2)
    _step(freezer)
    assert (freezer.cache.level == 2) is caches, freezer.cache.status
    assert caches or "does not pay" in freezer.cache.status


# ------------------------------------------------------------------------------ the config on its own
@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"mode": "ram"}, "mode 'ram' is not accepted; accepted: off, memory, disk, auto"),
        ({"storage_dtype": "int8"}, "storage_dtype 'int8' is not accepted; accepted: fp32, bf16, fp16"),
        ({"budget_bytes": -1}, "budget_bytes must be an integer >= 0 (0 = a quarter of RAM), got -1"),
        ({"budget_bytes": 1.5e9}, "budget_bytes must be an integer >= 0 (0 = a quarter of RAM), got 1500000000.0"),
        ({"chunk_samples": 1}, "chunk_samples must be an integer >= 2, got 1"),
        ({"chunk_samples": "64"}, "chunk_samples must be an integer >= 2, got '64'"),
    ],
)
def test_a_refused_setting_is_one_line_naming_the_field_and_the_accepted_values(kwargs, needle):
    with pytest.raises(CacheError) as err:
        CacheConfig(**kwargs)
    assert "\n" not in str(err.value) and needle in str(err.value)


def test_the_budget_is_the_given_bytes_or_a_quarter_of_ram():
    assert CacheConfig("memory", budget_bytes=12345).budget == 12345
    assert CacheConfig("memory").budget == default_budget_bytes() > 0
    assert CacheConfig().mode == "off" and CacheConfig().storage_dtype == "fp32"  # the defaults


def _estimate(**kwargs) -> CacheEstimate:
    fields = {"boundary": 2, "level": 2, "from_level": None, "keys": 100, "store_bytes": 0}
    fields |= {
        "forwards_per_rank": 100,
        "reads_remaining_per_rank": 100.0,
        "compute_s_per_row": 0.01,
        "exchange_s": 0.0,
        "saved_s_per_read": 0.01,  # the cache's own estimate: a read saves the segment's forward
    }
    return CacheEstimate(**(fields | kwargs))


def test_the_default_rule_caches_iff_the_forwards_saved_exceed_those_spent_and_the_exchange():
    assert not pays(_estimate())  # saves exactly what it costs: not strictly more
    assert pays(_estimate(reads_remaining_per_rank=101.0))
    assert not pays(_estimate(reads_remaining_per_rank=200.0, exchange_s=1.0))  # 2 s saved, 1 s + 1 s spent
    assert pays(_estimate(reads_remaining_per_rank=200.0, exchange_s=0.99))
    free = dataclasses.replace(_estimate(reads_remaining_per_rank=1e6), compute_s_per_row=0.0, saved_s_per_read=0.0)
    assert not pays(free)
    # the cost model's estimate: a read saves less than the forward (its read cost, the overlap)
    assert not pays(_estimate(reads_remaining_per_rank=150.0, saved_s_per_read=0.005))  # 0.75 s < 1 s
    assert pays(_estimate(reads_remaining_per_rank=250.0, saved_s_per_read=0.005))
