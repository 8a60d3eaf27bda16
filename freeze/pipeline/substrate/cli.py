"""``python -m experiments.substrate``: the substrate's commands (docs/substrate.md).

python -m experiments.substrate diagnose --weights W --dataset synthetic-target   # section 1.2
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from freeze.pipeline.config import ConfigError
from freeze.pipeline.data import DataError
from freeze.pipeline.models import ModelError
from freeze.pipeline.runs import RunError
from freeze.pipeline.substrate.probe import ProbeError
from freeze.pipeline.substrate.weights import WeightsError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments.substrate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    diag = sub.add_parser("diagnose", help="zero-training diagnostics of a pretrained model on a target task")
    diag.add_argument("--weights", required=True, help="pretrained checkpoint or state dict (model.weights)")
    diag.add_argument("--dataset", default="synthetic-target", help="target dataset name (data.dataset)")
    diag.add_argument("--data-root", default="data")
    diag.add_argument("--out", default="report/substrate/diagnostics.md")
    pre = sub.add_parser("pretrain", help="pretrain the substrate once (resumable) and export fp16 weights + sha256")
    pre.add_argument("--config", default="experiments/configs/fdsl32_pretrain.toml")
    pre.add_argument("--out", default="experiments/weights/fdsl32_resnet18.pt")
    for p in (diag, pre):
        p.add_argument("--no-nice", action="store_true", help="keep this process's priority")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = "python -m experiments.substrate " + shlex.join(sys.argv[1:] if argv is None else argv)
    if not args.no_nice:
        os.nice(max(0, 19 - os.nice(0)))
    try:
        if args.command == "pretrain":
            from freeze.pipeline.substrate.pretrain import pretrain

            return pretrain(args.config, Path(args.out), command)
        if args.command == "diagnose":
            from freeze.pipeline.substrate.diagnose import run_diagnostics

            print(run_diagnostics(args.weights, args.dataset, Path(args.out), args.data_root, command=command))
    except (ConfigError, DataError, ModelError, ProbeError, RunError, WeightsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
