"""Skip marks for tests of optional packages (transformers, lightning, timm, accelerate), decided
without importing them: an import at collection costs seconds in every run, of any test."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def requires(*packages: str) -> pytest.MarkDecorator:
    """Skip where one of ``packages`` is not installed; the test imports what it uses itself."""
    missing = [p for p in packages if not installed(p)]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


def package_dir(package: str) -> Path:
    """Where an installed package's sources are, found without importing it."""
    return Path(importlib.util.find_spec(package).submodule_search_locations[0])
