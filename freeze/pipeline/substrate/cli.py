"""``python -m experiments.substrate``: the substrate's commands (docs/substrate.md).

    python -m experiments.substrate diagnose --weights W --dataset synthetic-target   # section 1.2
    python -m experiments.substrate pretrain      # once, resumable; exports the committed weights
    python -m experiments.substrate gates --study experiments/configs/substrate_gates.toml   # resumable
    python -m experiments.substrate gates --study S --seeds 0 --split val   # a first look, for choosing
    python -m experiments.substrate stability --runs RUN...   # per-stage weight change of full FT runs
    python -m experiments.substrate planted       # planted-boundary tasks + identifiability check
    python -m experiments.substrate planted-check --study experiments/configs/planted_d3.toml   # resumable
    python -m experiments.substrate score --config experiments/configs/planted_score.toml   # resumable
    python -m experiments.substrate report        # the tables above into report/substrate-study.md

Every command lowers its own priority to nice 19 (--no-nice keeps it): the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from freeze.pipeline.config import ConfigError
from freeze.pipeline.data import DataError
from freeze.pipeline.datasets.weights import WeightsError
from freeze.pipeline.markdown import MarkerError
from freeze.pipeline.models import ModelError
from freeze.pipeline.runs import RunError
from freeze.pipeline.substrate.gates import GateError
from freeze.pipeline.substrate.probe import ProbeError
from freeze.pipeline.sweep import INTERRUPTED_EXIT_CODE


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
    gates = sub.add_parser("gates", help="run a gate study (resumable) and write its gates table")
    gates.add_argument("--study", default="experiments/configs/substrate_gates.toml")
    gates.add_argument("--out-dir", default="report/substrate")
    gates.add_argument("--no-run", action="store_true", help="only tabulate the runs complete so far")
    gates.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="only these of the study's seeds (a cheap first look; the full command reuses them)",
    )
    gates.add_argument(
        "--split",
        choices=["test", "val"],
        default="test",
        help="val: tabulate final-epoch validation accuracy into <out-dir>/selection/, for choosing between recipes",
    )
    stab = sub.add_parser("stability", help="per-stage relative weight change of full fine-tuning runs")
    stab.add_argument("--weights", default="experiments/weights/fdsl32_resnet18.pt", help="the runs' initial weights")
    stab.add_argument("--runs", nargs="+", required=True, help="run directories of full fine-tuning runs")
    stab.add_argument("--out", default="report/substrate/stability.md")
    plant = sub.add_parser("planted", help="build the planted-boundary tasks and check their identifiability")
    plant.add_argument("--tasks", nargs="+", default=["d3", "d5", "d7"], choices=["d3", "d5", "d7"])
    plant.add_argument("--out", default="report/substrate/planted.md")
    check = sub.add_parser("planted-check", help="fine-tune a planted task's check arms (resumable) and tabulate")
    check.add_argument("--study", required=True, help="experiments/configs/planted_d<d>.toml")
    check.add_argument("--out-dir", default="report/substrate")
    check.add_argument("--no-run", action="store_true", help="only tabulate the runs complete so far")
    score = sub.add_parser("score", help="score freeze policies on the planted tasks (resumable) and tabulate")
    score.add_argument("--config", default="experiments/configs/planted_score.toml", help="a score file")
    score.add_argument("--out-dir", default="report/substrate")
    score.add_argument("--runs-dir", default="runs", help="where the run directories go")
    score.add_argument("--no-run", action="store_true", help="only tabulate the runs complete so far")
    rep = sub.add_parser(
        "report", help="copy the substrate's tables (report/substrate/) into report/substrate-study.md"
    )
    rep.add_argument("--report", default="report/substrate-study.md")
    rep.add_argument("--tables-dir", default="report/substrate")
    for p in (diag, pre, gates, stab, plant, check, score, rep):
        p.add_argument("--no-nice", action="store_true", help="keep this process's priority")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, or an interrupted run: everything complete is kept
        print("interrupted: re-run the same command to continue where it stopped", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    command = "python -m experiments.substrate " + shlex.join(sys.argv[1:] if argv is None else argv)
    if not args.no_nice:
        os.nice(max(0, 19 - os.nice(0)))
    # Runs start workers from a script path, where `import freeze` finds whatever the environment's
    # editable install points to (possibly another checkout): this checkout's code goes first.
    repo = str(Path(__file__).resolve().parents[3])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    try:
        if args.command == "pretrain":
            from freeze.pipeline.substrate.pretrain import pretrain

            return pretrain(args.config, Path(args.out), command)
        if args.command == "gates":
            from freeze.pipeline.substrate.gates import run_gates

            seeds = None if args.seeds is None else tuple(args.seeds)
            print(run_gates(args.study, Path(args.out_dir), command, not args.no_run, seeds, args.split))
            return 0
        if args.command == "stability":
            from freeze.pipeline.substrate.gates import stability_table

            print(stability_table(args.weights, args.runs, Path(args.out), command))
            return 0
        if args.command == "planted-check":
            from freeze.pipeline.substrate.gates import planted_check

            print(planted_check(args.study, Path(args.out_dir), command, run=not args.no_run))
            return 0
        if args.command == "score":
            from freeze.pipeline.substrate.score import run_score

            print(run_score(args.config, Path(args.out_dir), args.runs_dir, command, run=not args.no_run))
            return 0
        if args.command == "report":
            from freeze.pipeline.substrate.report import splice_tables

            try:
                written = splice_tables(Path(args.report), Path(args.tables_dir))
            except FileNotFoundError as e:
                raise GateError(f"{e.filename}: not written yet; run the command its span names first") from None
            print(f"{args.report}: spliced {', '.join(written)}")
            return 0
        if args.command == "planted":
            from freeze.pipeline.substrate.identifiability import identifiability

            print(identifiability(tuple(args.tasks), args.out, command))
            return 0
        from freeze.pipeline.substrate.diagnose import run_diagnostics

        print(run_diagnostics(args.weights, args.dataset, Path(args.out), args.data_root, command=command))
    except (ConfigError, DataError, GateError, ModelError, ProbeError, RunError, WeightsError, MarkerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
