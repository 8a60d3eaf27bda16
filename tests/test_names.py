"""freeze.names: every name a setting accepts has its implementation, and a refused name is one
line listing the accepted ones."""

from pathlib import Path
from typing import get_args

import pytest

from freeze import names


def test_every_accepted_name_has_its_implementation():
    from freeze import comm
    from freeze.cache.store import STORAGE_DTYPES
    from freeze.names import COMM_HOOKS, STORAGE_DTYPE_NAMES

    assert tuple(comm._HOOKS) == COMM_HOOKS and tuple(STORAGE_DTYPES) == STORAGE_DTYPE_NAMES


def test_each_tuple_is_its_literal_and_its_names_are_distinct():
    for literal, accepted in (
        (names.CommHook, names.COMM_HOOKS),
        (names.CacheMode, names.CACHE_MODES),
        (names.StorageDtype, names.STORAGE_DTYPE_NAMES),
        (names.FrozenMode, names.FROZEN_MODES),
    ):
        assert accepted == get_args(literal) and len(set(accepted)) == len(accepted) > 1
    assert names.CACHE_MODES[0] == "off" and names.STORAGE_DTYPE_NAMES[0] == "fp32"  # the defaults come first


def test_a_refused_name_is_one_line_listing_every_accepted_one():
    import torch

    from freeze import Freezer, split_blocks
    from freeze.cache import CacheConfig, CacheError
    from freeze.comm import CommCounter, build_ddp

    cases = [
        (ValueError, lambda: build_ddp(torch.nn.Linear(2, 2), [], CommCounter(), comm_hook="fp8"), names.COMM_HOOKS),
        (CacheError, lambda: CacheConfig("ram"), names.CACHE_MODES),
        (CacheError, lambda: CacheConfig("memory", storage_dtype="int8"), names.STORAGE_DTYPE_NAMES),
    ]
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    cases.append((ValueError, lambda: Freezer(model, split_blocks(model), frozen_mode="none"), names.FROZEN_MODES))
    for error, call, accepted in cases:
        with pytest.raises(error) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and f"accepted: {', '.join(accepted)}" in message, message


def test_the_names_module_imports_only_the_standard_library():
    """freeze.pipeline.config validates a TOML file against these names without loading torch."""
    import ast
    import sys

    tree = ast.parse(Path(names.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported and all(m.split(".")[0] in sys.stdlib_module_names for m in imported), imported
