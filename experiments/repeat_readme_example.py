"""Run the README's own-loop example N times under torchrun (2 local ranks) and count clean exits.

Issue: the example used to abort at exit on one rank ("terminate called without an active
exception", SIGABRT) in part of the runs, so one passing run shows little; this counts them.

    python -m experiments.repeat_readme_example --runs 20
    python -m experiments.repeat_readme_example --runs 20 --script my_variant.py  # another script

Prints one line per run (exit code, wall seconds, the abort line if any) and a final
``clean=C aborted=A other_failures=F of N`` line; exits 1 unless every run was clean.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from freeze.pipeline import markdown
from freeze.testing import local_torchrun_command

REPO = Path(__file__).resolve().parents[1]
ABORT_MARK = "terminate called"


def readme_example() -> str:
    """The python block of the README's span ``example`` (freeze.pipeline.markdown)."""
    path = REPO / "README.md"
    try:
        span = markdown.read(path.read_text(encoding="utf-8"), "example", path)
    except markdown.MarkerError as e:
        raise SystemExit(str(e)) from None
    block = re.fullmatch(r"\s*```python\n(.*?)```\s*", span, re.S)
    if block is None:
        raise SystemExit(f"{path}: the example span holds no single python block")
    return block.group(1)


def run_once(script: Path, workdir: Path, timeout_s: float) -> tuple[int, str]:
    """One torchrun launch with 2 ranks; returns (exit code, all output of launcher and ranks)."""
    cmd = local_torchrun_command(script, workdir / "logs", redirects=3)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    rank_logs = [p.read_text(errors="replace") for p in sorted((workdir / "logs").glob("**/std*.log"))]
    return proc.returncode, "\n".join([proc.stdout, proc.stderr, *rank_logs])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="torchrun launches (default 20)")
    parser.add_argument("--script", type=Path, help="run this script instead of the README example")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per launch (default 300)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    source = args.script.read_text() if args.script else readme_example()
    clean = aborted = other = 0
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="readme_example_") as tmp:
            workdir = Path(tmp)
            script = workdir / "example.py"
            script.write_text(source)
            t0 = time.perf_counter()
            code, output = run_once(script, workdir, args.timeout_s)
            wall_s = time.perf_counter() - t0
        abort_line = next((line for line in output.splitlines() if ABORT_MARK in line), "")
        if code == 0 and not abort_line:
            clean += 1
        elif abort_line or "SIGABRT" in output:
            aborted += 1
        else:
            other += 1
        print(f"run {i + 1:2d}: exit={code} wall_s={wall_s:.1f} {abort_line}".rstrip(), flush=True)
    print(f"clean={clean} aborted={aborted} other_failures={other} of {args.runs}")
    return 0 if clean == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
