"""Where a freezing step's time goes: the freeze engine against the other ways to freeze under DDP.

    .venv/bin/python -m experiments.bench            # default: ResNet-18, 2 gloo workers, k = 0..9
    .venv/bin/python -m experiments.bench --quick    # ~1-2 min smoke run
    .venv/bin/python -m experiments.bench --steps 40 --rounds 5
    .venv/bin/python -m experiments.bench --model bert-base   # BERT rows: k = 0,4,8,12, with and without the cache

For every boundary k and approach (freeze engine, static limit, find-unused, per-parameter) it
measures the median step time, the bytes all-reduced per step and the phase split, plus the
monitor's overhead, the re-wrap cost and a communication estimate against a no-communication run.
Writes ``<out-dir>/bench.csv`` and ``<out-dir>/BENCH.md``; no number in BENCH.md is typed by hand.

A text model (``--model bert-base``: a Hugging Face BertForSequenceClassification with random
weights from ``BertConfig()``) measures the engine with and without the activation cache, the
static limit and a control (a second static limit: true ratio 1.00) in the same rotation, and
writes ``<out-dir>/bench_<model>.csv`` and its own section of BENCH.md (between the bert-bench
markers; the rest of the file stays). The worker processes live in :mod:`experiments.bench_workers`;
what each part of the report measures, in the other modules of :mod:`experiments.bench`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from experiments import bench_workers as bw
from experiments.bench.config import (
    BENCH_MODELS,
    QUICK_ROUNDS,
    QUICK_STEPS,
    TEXT_DEFAULTS,
    TEXT_QUICK_ROUNDS,
    TEXT_QUICK_STEPS,
    BenchConfig,
)
from experiments.bench.engine_report import write_markdown
from experiments.bench.rows import measure_rows, write_csv
from experiments.bench.sections import splice_section, spliced_sections
from experiments.bench.text_report import TEXT_SECTION, text_section


def run_benchmark(
    cfg: BenchConfig,
    out_dir: Path,
    *,
    workdir: Path | None = None,
    deadline_s: float = 3600.0,
    command: str = "",
) -> list[dict]:
    """Measure, then write ``out_dir/bench.csv`` and ``out_dir/BENCH.md``; returns the CSV rows."""
    cfg.validate()
    start_s = time.perf_counter()
    load_before = os.getloadavg()
    cfg = cfg.resolved(len(bw.split_blocks(bw.build_model(cfg.model, cfg.image_size))))
    extra = {"approaches": bw.TEXT_APPROACHES, "monitor_cell": False} if cfg.text else {}
    rows, cells, ranks = measure_rows(cfg, extra, workdir, deadline_s)
    out_dir = Path(out_dir)
    run = {
        "command": command or "(called from Python)",
        "wall_s": time.perf_counter() - start_s,
        "load_avg": (load_before[0], os.getloadavg()[0]),
        "threads": ranks[0]["threads"],
        "block_names": ranks[0]["block_names"],
    }
    if cfg.text:
        write_csv(rows, out_dir / f"bench_{cfg.model}.csv")
        run["block_param_bytes"] = ranks[0]["block_param_bytes"]
        splice_section(out_dir / "BENCH.md", TEXT_SECTION, text_section(cfg, rows, cells, run), before_others=True)
        return rows
    write_csv(rows, out_dir / "bench.csv")
    # Each re-wrap happened on every rank; the slowest rank's time is the one training waits for.
    rewrap_ms = [max(ms) for ms in zip(*(r["rewrap_ms"] for r in ranks))]
    write_markdown(out_dir / "BENCH.md", cfg, rows, cells, rewrap_ms, run)
    return rows


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def get_args_parser() -> argparse.ArgumentParser:
    d, t = BenchConfig(), TEXT_DEFAULTS
    p = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.split("\n")[0])

    def per_model(flag: str, kind: type, what: str) -> None:
        """A flag whose default depends on the model (BenchConfig.for_model fills it when not given)."""
        name = flag.removeprefix("--").replace("-", "_")
        p.add_argument(flag, type=kind, default=None, help=f"{what} (default {getattr(d, name)}, BERT {t[name]})")

    p.add_argument("--workers", type=int, default=d.workers, help="gloo ranks on this machine")
    p.add_argument(
        "--model", default=d.model, choices=BENCH_MODELS, help="bert-base / bert-tiny: the BERT rows (own section)"
    )
    per_model("--batch-size", int, "per worker")
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="BERT: tokens per sequence")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed steps per block (default {d.steps}, --quick {QUICK_STEPS}; BERT {t['steps']}, {TEXT_QUICK_STEPS})",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"rounds over all blocks (default {d.rounds}, --quick {QUICK_ROUNDS}; BERT {t['rounds']}, {TEXT_QUICK_ROUNDS})",
    )
    per_model("--warmup", int, "untimed steps per block")
    p.add_argument(
        "--ks",
        type=_int_list,
        default=None,
        help="boundaries to measure, e.g. 0,5,9 (default: all; bert-base 0,4,8,12)",
    )
    p.add_argument(
        "--phase-ks", type=_int_list, default=None, help="boundaries with a no-comm run (default: 0, middle, last two)"
    )
    p.add_argument("--lr", type=float, default=d.lr)
    per_model("--momentum", float, "SGD's")
    per_model("--cache-keys", int, "inputs the cache runner keys into")
    per_model("--cache-chunk", int, "rows per cache build chunk")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, choices=("cpu", "cuda"), help="cuda: one NCCL worker per GPU")
    p.add_argument("--quick", action="store_true", help="a ~1-2 minute run: fewer steps, one round")
    p.add_argument("--out-dir", type=Path, default=Path("report"))
    p.add_argument("--deadline-s", type=float, default=3600.0, help="kill the workers after this long")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The model's defaults (BenchConfig.for_model), then every flag given. --quick only changes
    the defaults: an explicit --steps / --rounds still wins."""
    d = BenchConfig.for_model(args.model)
    quick_steps, quick_rounds = (TEXT_QUICK_STEPS, TEXT_QUICK_ROUNDS) if d.text else (QUICK_STEPS, QUICK_ROUNDS)

    def given(value, default):
        return default if value is None else value

    return replace(
        d,
        workers=args.workers,
        batch_size=given(args.batch_size, d.batch_size),
        image_size=args.image_size,
        seq_len=args.seq_len,
        steps=given(args.steps, quick_steps if args.quick else d.steps),
        rounds=given(args.rounds, quick_rounds if args.quick else d.rounds),
        warmup=given(args.warmup, d.warmup),
        ks=given(args.ks, d.ks),
        phase_ks=args.phase_ks,
        lr=args.lr,
        momentum=given(args.momentum, d.momentum),
        seed=args.seed,
        cache_keys=given(args.cache_keys, d.cache_keys),
        cache_chunk=given(args.cache_chunk, d.cache_chunk),
        device=args.device,
    )


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    cfg = config_from_args(args)
    try:
        cfg.validate()
        spliced_sections(args.out_dir / "BENCH.md")  # a broken span (markdown.MarkerError) now, not after the run
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, "-m", "experiments.bench", *(argv or [])]))
    run_benchmark(cfg, args.out_dir, deadline_s=args.deadline_s, command=command)
    csv_name = f"bench_{cfg.model}.csv" if cfg.text else "bench.csv"
    print(f"bench: wrote {args.out_dir / csv_name} and {args.out_dir / 'BENCH.md'}")
    return 0
