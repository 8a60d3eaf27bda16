"""What `horizon` costs a training step (issue 37 asks for under 1 %), interleaved in one process.

    python -m experiments.bench.horizon_overhead --out report/horizon/overhead

ResNet-18 (32x32, batch 64, AdamW) trained through a Freezer on this machine, one process, four
variants with their own copy of the same model, each timed over intervals of ``--steps`` optimizer
steps and the policy evaluation that closes them (wall clock, synchronised on CUDA), in a shuffled
order each round:

- ``none``: no policy (the monitor reads per-step norms only);
- ``none-again``: the same again, the control whose true ratio to ``none`` is 1.00;
- ``payoff``: a gradient rule (the summed gradient per step, the statistic every gradient rule reads),
  its exchange set so high that it never freezes;
- ``horizon``: the summed gradient plus the descent (two parameter copies, a pass at two of every
  span + 1 closes) and the pricing; its exchange is set so high that it never freezes, so every
  variant trains the whole model and the steps compare like for like.

The rule's own work is then timed apart, where a step's noise cannot hide it: the monitor alone on
ResNet-18's real gradients (experiments.bench.monitor_ab's method), ``--steps`` observes and one
close per interval, as ``none`` configures it, as ``horizon`` does (the descent, and the summed
gradient in one of every span + 1 intervals) and as a gradient rule does (the summed gradient in
every interval); its difference over the step time above is the share of a step the rule costs.

The held-out check is timed apart (it runs off the training clock, and only around a freeze): one
evaluation of ``--probe-images`` images. Writes ``horizon_overhead.csv`` (every interval) and
``horizon_overhead.md`` (medians, each ratio's 95 % bootstrap interval over rounds, the probe's seconds).
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

from experiments.bench.devices import add_device_argument, device_name, parsed_device
from experiments.bench.monitor_ab import ratio_interval, real_gradients
from experiments.bench.monitor_ab import time_interval as time_monitor_interval
from freeze import Freezer, split_blocks
from freeze.monitor import GradNormMonitor
from freeze.policies import Pricing, make_policy

VARIANTS = ("none", "none-again", "payoff:exchange=1000000", "horizon:exchange=1000000,probation=0")
LABELS = {v: v.split(":")[0] for v in VARIANTS}
LABELS["none-again"] = "none-again"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(variant: str, steps_total: int, interval: int, device: torch.device):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    blocks = split_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    policy = make_policy("none" if variant == "none-again" else variant)
    extra = {}
    if policy.needs().pricing:
        step_time_s = [1.0 - 0.05 * k for k in range(len(blocks))]
        extra["pricing"] = Pricing(step_time_s=step_time_s, lr_per_step=[1e-3] * steps_total)
    freezer = Freezer(
        model,
        blocks,
        policy,
        optimizer=optimizer,
        epochs=1,
        steps_per_epoch=steps_total,
        interval_steps=interval,
        **extra,
    )
    return model, optimizer, freezer


def time_interval(run, steps: int, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> float:
    """Milliseconds per step of ``steps`` training steps, the last closing an interval."""
    model, optimizer, freezer = run
    x, y = batch
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(freezer.module(x), y).backward()
        freezer.after_backward()
        optimizer.step()
        freezer.after_step()
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / steps


def probe_seconds(images: int, device: torch.device, repeats: int = 3) -> float:
    """Median seconds of one held-out evaluation of ``images`` images (batch 256, no gradients)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(device).eval()
    x = torch.randn(images, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (images,), device=device)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            for i in range(0, images, 256):
                F.cross_entropy(model(x[i : i + 256]), y[i : i + 256])
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(device: torch.device, rounds: int, steps: int, seed: int) -> list[dict]:
    steps_total = steps * max(rounds + 1, 10)  # enough evaluations for horizon's first rates (it never freezes)
    runs = {v: build(v, steps_total, steps, device) for v in VARIANTS}
    g = torch.Generator().manual_seed(seed)
    batch = (torch.randn(64, 3, 32, 32, generator=g).to(device), torch.randint(0, 10, (64,), generator=g).to(device))
    for run in runs.values():  # warm-up: one interval each (buffers, the first DDP-free forward)
        time_interval(run, steps, batch, device)
    order = list(VARIANTS)
    rng = random.Random(seed)
    rows = []
    for r in range(rounds):
        rng.shuffle(order)
        for variant in order:
            rows.append(
                {
                    "round": r,
                    "variant": LABELS[variant],
                    "ms_per_step": time_interval(runs[variant], steps, batch, device),
                }
            )
    return rows


MONITORS = {
    "none": {"track_summed": False},
    "horizon": {"track_summed": False, "track_descent": True, "descent_span": 3},
    "gradient rule": {"track_summed": True},
}


def measure_monitor(device: torch.device, rounds: int, steps: int, seed: int) -> list[dict]:
    """ms per step of the monitor alone, per configuration, interleaved (module docstring)."""
    _, blocks = real_gradients(device)
    monitors = {name: GradNormMonitor(blocks, **kwargs) for name, kwargs in MONITORS.items()}
    for monitor in monitors.values():
        for _ in range(4):  # warm-up, and through a whole span of the descent
            time_monitor_interval(monitor, steps, device)
    order, rng, rows = list(monitors), random.Random(seed), []
    for r in range(rounds):
        rng.shuffle(order)
        for name in order:
            for _ in range(4):  # one span + 1: the descent's work falls in two of these closes
                rows.append(
                    {"round": r, "monitor": name, "ms_per_step": time_monitor_interval(monitors[name], steps, device)}
                )
    return rows


def monitor_lines(rows: list[dict], step_ms: float) -> list[str]:
    per_round = {
        name: [
            statistics.mean(x["ms_per_step"] for x in rows if x["monitor"] == name and x["round"] == r)
            for r in sorted({x["round"] for x in rows})
        ]
        for name in MONITORS
    }
    lines = [
        "",
        f"The monitor alone (ms per step over intervals of observes and a close, a span + 1 of them per round; "
        f"share of the {step_ms:.1f} ms step of `none` above):",
        "",
        "| monitor as | median ms/step | more than `none`, ms/step | share of a step |",
        "| --- | --- | --- | --- |",
    ]
    base = statistics.median(per_round["none"])
    for name, values in per_round.items():
        extra = statistics.median(values) - base
        lines.append(f"| {name} | {statistics.median(values):.2f} | {extra:+.2f} | {100 * extra / step_ms:+.2f} % |")
    return lines


def write(rows: list[dict], probe_s: float, out: Path, header: list[str], extra: list[str] = ()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "horizon_overhead.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    series = {label: [r["ms_per_step"] for r in rows if r["variant"] == label] for label in LABELS.values()}
    lines = [
        *header,
        "",
        "| variant | median ms/step | ratio to `none` | 95 % interval | ratio to `payoff` | 95 % interval |",
    ]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for label in LABELS.values():
        to_none = ratio_interval(series[label], series["none"])
        to_payoff = ratio_interval(series[label], series["payoff"])
        lines.append(
            f"| {label} | {statistics.median(series[label]):.1f} | {to_none[0]:.3f} | [{to_none[1]:.3f}, {to_none[2]:.3f}] "
            f"| {to_payoff[0]:.3f} | [{to_payoff[1]:.3f}, {to_payoff[2]:.3f}] |"
        )
    lines += list(extra)
    lines += [
        "",
        f"One held-out check: {probe_s:.2f} s (off the training clock; only at a proposed freeze and its probation).",
    ]
    (out / "horizon_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--steps", type=int, default=24, help="optimizer steps per timed interval (one policy evaluation)"
    )
    parser.add_argument("--probe-images", type=int, default=1000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = parsed_device(parser, args.device)
    if args.rounds < 2 or args.steps < 1 or args.probe_images < 1:
        parser.error("--rounds must be >= 2, --steps >= 1 and --probe-images >= 1")
    rows = measure(device, args.rounds, args.steps, seed=0)
    monitor_rows = measure_monitor(device, args.rounds, args.steps, seed=0)
    probe_s = probe_seconds(args.probe_images, device)
    name = device_name(device)
    header = [
        "# What horizon costs a training step",
        "",
        f"`python -m experiments.bench.horizon_overhead --device {args.device} --rounds {args.rounds} --steps {args.steps}` "
        f"on {name}, torch {torch.__version__}; ResNet-18 (32x32, batch 64, AdamW), one process; ms per step of "
        f"{args.steps} steps and the evaluation closing them, {args.rounds} interleaved rounds.",
    ]
    step_ms = statistics.median(r["ms_per_step"] for r in rows if r["variant"] == "none")
    write(rows, probe_s, args.out, header, monitor_lines(monitor_rows, step_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
