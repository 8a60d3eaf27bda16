"""The monitor's per-step cost, this tree against an earlier commit's, interleaved in one process.

    python -m experiments.bench.monitor_ab --baseline-rev a09804c --device cuda --out DIR

The first GPU check (docs/benchmarks.md) found the engine 1.08-1.21x slower than the static limit on
an H200, the monitor's ``after_backward`` taking 0.8-1.2 ms of a 7-15 ms step. This measures that
phase alone, on ResNet-18's real gradients (32x32, batch 64): per variant, intervals of ``--steps``
calls of ``observe()`` and one ``close_interval()`` (where a fold of pending steps lands), timed by
the wall clock from a synchronised start to a synchronised end, divided by the steps. Variants, in a
shuffled order each round: this tree's monitor, the same again (the control: its true ratio to the
first is 1.00) and the baseline commit's (``git show REV:freeze/monitor.py``), each with and without
the summed gradient (``track_summed``). It writes ``monitor_ab.csv`` (every interval) and
``monitor_ab.md`` (medians, and each ratio's 95 % bootstrap interval over rounds).
"""

from __future__ import annotations

import argparse
import csv
import importlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision

from experiments.bench.devices import add_device_argument, device_name, parsed_device
from freeze import split_blocks
from freeze.monitor import GradNormMonitor

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("this", "this-again", "baseline")


def baseline_monitor_class(rev: str) -> type:
    """``GradNormMonitor`` as commit ``rev`` had it, or as the file ``rev`` holds when it names one (a
    shallow clone, as on the GPU machine, lacks old commits). Before fef8643 the monitor was one
    module, freeze/monitor.py; since, a package of the monitor and its trackers, loaded whole from
    ``rev`` under another name so that none of this tree's trackers stands in for the commit's."""
    if Path(rev).is_file():
        return _module_from_text(Path(rev).read_text(), rev).GradNormMonitor
    single = _git_show(f"{rev}:freeze/monitor.py")
    if single is not None:
        return _module_from_text(single, f"{rev}:freeze/monitor.py").GradNormMonitor
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{rev}:freeze/monitor"], cwd=ROOT, capture_output=True, text=True
    )
    if listing.returncode != 0:
        sys.exit(f"--baseline-rev: {rev} has neither freeze/monitor.py nor freeze/monitor/: {listing.stderr.strip()}")
    with tempfile.TemporaryDirectory() as tmp:  # the package is imported from here, then the files go
        package = Path(tmp) / BASELINE_PACKAGE
        package.mkdir()
        for name in listing.stdout.split():
            if name.endswith(".py"):
                text = _git_show(f"{rev}:freeze/monitor/{name}") or ""
                (package / name).write_text(text.replace("freeze.monitor.", f"{BASELINE_PACKAGE}."))
        for loaded in [m for m in sys.modules if m.split(".")[0] == BASELINE_PACKAGE]:
            del sys.modules[loaded]  # another revision's, loaded before in this process
        sys.path.insert(0, tmp)
        try:
            return importlib.import_module(f"{BASELINE_PACKAGE}.monitor").GradNormMonitor
        finally:
            sys.path.remove(tmp)


BASELINE_PACKAGE = "monitor_baseline"


def _git_show(where: str) -> str | None:
    shown = subprocess.run(["git", "show", where], cwd=ROOT, capture_output=True, text=True, check=False)
    return shown.stdout if shown.returncode == 0 else None


def _module_from_text(text: str, where: str) -> types.ModuleType:
    module = types.ModuleType(f"{BASELINE_PACKAGE}_module")  # built in memory: no file left behind
    sys.modules[module.__name__] = module  # its dataclasses look their module up while being built
    exec(compile(text, where, "exec"), module.__dict__)
    return module


def real_gradients(device: torch.device) -> tuple[torch.nn.Module, list]:
    """ResNet-18 (10 classes) with the gradients of one batch of 64 random 32x32 images."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    x = torch.randn(64, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    F.cross_entropy(model(x), y).backward()
    return model, split_blocks(model)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interval(monitor, steps: int, device: torch.device) -> float:
    """Milliseconds per step of ``steps`` observes and one close, synchronised at both ends."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        monitor.observe()
    monitor.close_interval(epoch=0, boundary=0, end_step=steps)
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / steps


def measure(device: torch.device, baseline_cls: type, rounds: int, steps: int, seed: int) -> list[dict]:
    model, blocks = real_gradients(device)
    classes = {"this": GradNormMonitor, "this-again": GradNormMonitor, "baseline": baseline_cls}
    monitors = {
        (variant, summed): classes[variant](blocks, track_summed=summed)
        for variant in VARIANTS
        for summed in (False, True)
    }
    for monitor in monitors.values():  # warm-up: buffers, the block index, cuDNN/cuBLAS handles
        time_interval(monitor, steps, device)
    order = list(monitors)
    rng = random.Random(seed)
    rows = []
    for r in range(rounds):
        rng.shuffle(order)
        for variant, summed in order:
            ms = time_interval(monitors[(variant, summed)], steps, device)
            rows.append({"round": r, "variant": variant, "track_summed": summed, "ms_per_step": ms})
    return rows


def ratio_interval(num: list[float], den: list[float], seed: int = 0, draws: int = 2000) -> tuple[float, float, float]:
    """Median(num) / median(den) and its 95 % bootstrap interval (rounds resampled, paired)."""
    a, b = np.asarray(num), np.asarray(den)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(draws, len(a)))
    boot = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    return float(np.median(a) / np.median(b)), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def write(rows: list[dict], out: Path, header: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "monitor_ab.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        *header,
        "",
        "| track_summed | variant | median ms/step | ratio to `this` | 95 % interval |",
        "| --- | --- | --- | --- | --- |",
    ]
    for summed in (False, True):
        series = {
            v: [r["ms_per_step"] for r in rows if r["variant"] == v and r["track_summed"] == summed] for v in VARIANTS
        }
        for variant in VARIANTS:
            ratio, lo, hi = ratio_interval(series[variant], series["this"])
            lines.append(
                f"| {summed} | {variant} | {statistics.median(series[variant]):.3f} | {ratio:.2f} | [{lo:.2f}, {hi:.2f}] |"
            )
    (out / "monitor_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline-rev",
        required=True,
        help="the commit whose freeze/monitor.py is the baseline, or a file holding that module",
    )
    add_device_argument(parser)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="observes per timed interval (then one close)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = parsed_device(parser, args.device)
    if args.rounds < 2 or args.steps < 1:
        parser.error("--rounds must be >= 2 and --steps >= 1")
    baseline_cls = baseline_monitor_class(args.baseline_rev)
    rows = measure(device, baseline_cls, args.rounds, args.steps, seed=0)
    name = device_name(device)
    header = [
        f"# Monitor A/B: this tree against {args.baseline_rev}",
        "",
        f"`python -m experiments.bench.monitor_ab --baseline-rev {args.baseline_rev} --device {args.device} "
        f"--rounds {args.rounds} --steps {args.steps}` on {name}, torch {torch.__version__}; ResNet-18 (32x32, "
        f"batch 64) gradients; ms per step of {args.steps} observes + 1 close, {args.rounds} interleaved rounds.",
    ]
    write(rows, args.out, header)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
