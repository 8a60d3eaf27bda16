"""`make lint`'s import contracts (pyproject.toml, [tool.importlinter]) hold on this tree, and each
one fails on a planted wrong-way import, naming the import: the arrows of docs/architecture.md are
checked, not hoped for."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # lint-imports runs in a process of its own

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    # PYTHONPATH first: grimp reads the tree's own `freeze`, not the one installed in the venv.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    args = [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(tree / "pyproject.toml")]
    return subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def test_this_tree_keeps_every_import_contract():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


PLANTED = [
    # (module, the import planted at its end, the contract that must break, how it names the import)
    (
        "freeze/names.py",
        "import freeze.pipeline.config",
        "The library never imports the application BROKEN",
        "freeze.names -> freeze.pipeline.config",
    ),
    (
        "freeze/names.py",
        "import freeze.comm",
        "No import cycle between sibling modules or packages BROKEN",
        ".names -> .comm",
    ),
    (
        "freeze/pipeline/config.py",
        "import freeze.pipeline.train",
        "The application's layers import downward only BROKEN",
        "freeze.pipeline.config -> freeze.pipeline.train",
    ),
]


@pytest.mark.parametrize("module,line,broken,named", PLANTED, ids=[f"{m}: {line}" for m, line, _, _ in PLANTED])
def test_a_planted_wrong_way_import_breaks_its_contract(tmp_path, module, line, broken, named):
    shutil.copytree(REPO / "freeze", tmp_path / "freeze", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / module, "a", encoding="utf-8") as f:
        f.write(f"\n{line}  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode == 1, result.stdout[-3000:]
    assert broken in result.stdout
    assert named in result.stdout, result.stdout[-3000:]
