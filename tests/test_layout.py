"""Each library module has a test file named after it (issue 26), so that the tests of a module are
found by its name and a new module cannot arrive without tests.

The names: ``freeze/<module>.py`` -> ``tests/test_<module>.py``; ``freeze/<package>/<module>.py`` ->
``tests/test_<package>_<module>.py``, and the module named after its package ->
``tests/test_<package>.py`` (``freeze/cache/cache.py`` -> ``tests/test_cache.py``); the trainer
integrations -> ``tests/test_integration_<module>.py``. ``__init__.py`` files only re-export. The
application (``freeze/pipeline``, the cost model included) keeps its own layout.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APPLICATION = {"pipeline"}
PACKAGE_PREFIX = {"integrations": "integration"}
# A module whose tests carry another name, and why.
NAMED_OTHERWISE = {
    "freeze/integrations/_common.py": "test_integration_core.py",  # what every integration needs from the core
}


def library_modules(root: Path = ROOT) -> list[Path]:
    package = root / "freeze"
    found = [p for p in package.glob("*.py") if p.name != "__init__.py"]
    for sub in sorted(p for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        if sub.name not in APPLICATION:
            found += [p for p in sub.glob("*.py") if p.name != "__init__.py"]
    return sorted(found)


def expected_test_file(module: Path, root: Path = ROOT) -> str:
    relative = module.relative_to(root).as_posix()
    if relative in NAMED_OTHERWISE:
        return NAMED_OTHERWISE[relative]
    parts = module.relative_to(root / "freeze").with_suffix("").parts
    if len(parts) == 1:
        return f"test_{parts[0]}.py"
    package, name = parts
    prefix = PACKAGE_PREFIX.get(package, package)
    return f"test_{prefix}.py" if name == package else f"test_{prefix}_{name}.py"


def missing_test_files(root: Path = ROOT) -> list[str]:
    return [
        f"{m.relative_to(root).as_posix()} -> tests/{expected_test_file(m, root)}"
        for m in library_modules(root)
        if not (root / "tests" / expected_test_file(m, root)).is_file()
    ]


def test_every_library_module_has_a_test_file_named_after_it():
    missing = missing_test_files()
    assert not missing, "library modules without their test file:\n" + "\n".join(missing)


def test_the_rule_finds_the_library_and_a_module_without_its_file(tmp_path):
    for path in (
        "freeze/__init__.py",
        "freeze/core.py",
        "freeze/new.py",
        "freeze/cache/__init__.py",
        "freeze/cache/cache.py",
        "freeze/cache/store.py",
        "freeze/integrations/__init__.py",
        "freeze/integrations/timm.py",
        "freeze/pipeline/__init__.py",
        "freeze/pipeline/run.py",
        "tests/test_core.py",
        "tests/test_cache.py",
        "tests/test_integration_timm.py",
    ):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert [m.relative_to(tmp_path).as_posix() for m in library_modules(tmp_path)] == [
        "freeze/cache/cache.py",
        "freeze/cache/store.py",
        "freeze/core.py",
        "freeze/integrations/timm.py",
        "freeze/new.py",
    ]
    assert missing_test_files(tmp_path) == [
        "freeze/cache/store.py -> tests/test_cache_store.py",
        "freeze/new.py -> tests/test_new.py",
    ]
