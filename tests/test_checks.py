"""freeze/checks.py: a bool is an int in Python; these checks say it is not."""

from __future__ import annotations

import numpy as np
import pytest

from freeze import CacheConfig, Freezer, split_blocks
from freeze.cache import CacheError
from freeze.checks import is_int, is_number
from tests.tiny_models import TinyNet


def test_ints_and_numbers_never_include_bools():
    assert is_int(3) and is_int(np.int64(3)) and not is_int(True) and not is_int(3.0) and not is_int("3")
    assert is_number(3) and is_number(2.5) and is_number(np.float32(2.5)) and not is_number(False)
    assert not is_number(None) and not is_number("2.5")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"epochs": -3}, "epochs"),
        ({"epochs": True}, "epochs"),
        ({"steps_per_epoch": -1}, "steps_per_epoch"),
        ({"interval_steps": 2.5}, "interval_steps"),
        ({"interval_steps": True}, "interval_steps"),
    ],
)
def test_the_run_length_is_refused_when_the_freezer_is_built(kwargs, field):
    model = TinyNet()
    with pytest.raises(ValueError, match=f"Freezer: {field} must be >= .*accepted: an integer") as err:
        Freezer(model, split_blocks(model), **kwargs)
    assert "\n" not in str(err.value)


def test_a_bool_budget_is_not_a_one_byte_budget():
    with pytest.raises(CacheError, match="budget_bytes must be an integer >= 0"):
        CacheConfig("memory", budget_bytes=True)
    with pytest.raises(CacheError, match="chunk_samples must be an integer >= 2"):
        CacheConfig("memory", chunk_samples=True)
