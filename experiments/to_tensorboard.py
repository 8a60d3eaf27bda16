"""TensorBoard event files for run directories that already exist, from their metrics.jsonl.

    python -m experiments.to_tensorboard runs/<study>      # then: tensorboard --logdir runs/<study>

Each run directory gets ``tensorboard/`` with one scalar per number of its epoch records (losses,
accuracies, the boundary, bytes per step, times, the LR, each block's gradient-norm change), at
its optimizer step; a run that trains with ``log.trackers = ["tensorboard"]`` writes the same
while it trains (freeze.pipeline.trackers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from freeze.pipeline.config import ConfigError
from freeze.pipeline.runs import RunError
from freeze.pipeline.schema import MANIFEST_FILE, find_run_dirs
from freeze.pipeline.trackers import check_trackers, write_tensorboard


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.to_tensorboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", type=Path, help="a run directory or a folder of them (searched recursively)")
    args = parser.parse_args(argv)
    if not args.runs_dir.is_dir():
        print(f"error: {args.runs_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        check_trackers(["tensorboard"])
        run_dirs = find_run_dirs(args.runs_dir)
        if not run_dirs:
            print(f"error: no run directory (a folder with {MANIFEST_FILE}) under {args.runs_dir}", file=sys.stderr)
            return 2
        count = write_tensorboard(run_dirs)
    except (ConfigError, RunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"to_tensorboard: wrote {count} run(s); view them with: tensorboard --logdir {args.runs_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
