"""What installing and importing freeze costs: the dependency closure and installed bytes of the
library alone (``pip install .``) and with the study extra (``pip install .[study]``), read off the
installed distributions of this environment; and the wall time of importing the modules a user
or the report starts from, each in a fresh interpreter, median of N.

    python -m experiments.install_footprint                     # this checkout
    python -m experiments.install_footprint --repeats 7 --json out.json

Sizes are the files each distribution's RECORD lists (what pip installed), so they hold for the
versions in requirements.txt on this platform; a CUDA build of torch is several GB larger.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from freeze._atomic import atomic_write_json

LIBRARY = ("torch", "numpy")
STUDY_EXTRA = ("torchvision", "scipy", "pandas", "matplotlib")
# What a user, the report and the training loop start from.
IMPORTS = (
    "import freeze",
    "import freeze.pipeline.schema",
    "import freeze.pipeline.report",
    "from freeze import Freezer",
)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str | None:
    """The distribution a ``Requires-Dist`` line names, or None when it applies only under an extra."""
    if "extra ==" in requirement:
        return None
    return _canonical(re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0])


def closure(roots: tuple[str, ...]) -> dict[str, int]:
    """Every installed distribution ``roots`` need (markers of this platform taken as met), with its bytes."""
    dists = {_canonical(d.metadata["Name"]): d for d in metadata.distributions()}
    seen: dict[str, int] = {}
    todo = [_canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name not in dists:
            continue
        dist = dists[name]
        seen[name] = sum(f.size or 0 for f in dist.files or [] if f.size is not None)
        for requirement in dist.requires or []:
            marker = requirement.split(";", 1)[1] if ";" in requirement else ""
            if "platform_system" in marker and "Linux" not in marker and "==" in marker:
                continue  # e.g. a Windows-only dependency
            dep = _requirement_name(requirement)
            if dep is not None:
                todo.append(dep)
    return seen


def import_seconds(statement: str, checkouts: list[Path], repeats: int) -> list[float]:
    """Per checkout, the median wall seconds of ``python -c statement`` run in it (its ``freeze``
    comes first on the path) minus that of ``python -c pass``; the runs of all checkouts and of the
    bare interpreter are interleaved, so drift of this shared machine hits them alike."""

    def once(code: str, cwd: Path) -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, cwd=cwd)
        return time.perf_counter() - start

    base: list[float] = []
    runs: list[list[float]] = [[] for _ in checkouts]
    for _ in range(repeats):
        base.append(once("pass", checkouts[0]))
        for times, cwd in zip(runs, checkouts, strict=True):
            times.append(once(statement, cwd))
    return [statistics.median(times) - statistics.median(base) for times in runs]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.install_footprint", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=5, help="fresh interpreters per import (default 5)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="another checkout of this repository (e.g. a git worktree of an older commit): its import times too, interleaved",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: expected an integer >= 1, got {args.repeats}")
    library, study = closure(LIBRARY), closure(LIBRARY + STUDY_EXTRA)
    extra = {name: size for name, size in study.items() if name not in library}
    result = {
        "library": {"distributions": sorted(library), "bytes": sum(library.values())},
        "study_extra_adds": {"distributions": sorted(extra), "bytes": sum(extra.values())},
        "import_s": {},
    }
    checkouts = [Path(__file__).resolve().parents[1]] + ([args.compare.resolve()] if args.compare else [])
    for checkout in checkouts[1:]:
        if not (checkout / "freeze" / "__init__.py").is_file():
            parser.error(f"--compare: {checkout} is not a checkout of this repository (no freeze/__init__.py)")
    for stmt in IMPORTS:
        seconds = import_seconds(stmt, checkouts, args.repeats)
        result["import_s"][stmt] = {str(c): round(t, 3) for c, t in zip(checkouts, seconds, strict=True)}
    mb = 1e6
    print(f"library (pip install .): {len(library)} distributions, {result['library']['bytes'] / mb:.0f} MB")
    print(f"  {', '.join(sorted(library))}")
    print(f"study extra adds: {len(extra)} distributions, {result['study_extra_adds']['bytes'] / mb:.0f} MB")
    print(f"  {', '.join(sorted(extra))}")
    print(f"import wall time, median of {args.repeats} fresh interpreters, a bare interpreter's subtracted:")
    for stmt, per_checkout in result["import_s"].items():
        print(f"  {stmt}: " + ", ".join(f"{t:.2f} s ({c})" for c, t in per_checkout.items()))
    if args.json is not None:
        atomic_write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
