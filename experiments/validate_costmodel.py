"""Check the cost model against the emulated cluster: predicted vs measured step time.

    # the full grid (the integrator's run, on a quiet machine)
    .venv/bin/python -m experiments.validate_costmodel
    # a reduced grid (minutes)
    .venv/bin/python -m experiments.validate_costmodel --nodes 2 --bandwidths 1gbit,uncapped --ks 0,8 --steps 3

For every node count N it (1) profiles the model with one process per node pinned to that node's
cores (freeze.pipeline.cluster.plan_cpus: where nodes share a core the profile measures the sharing),
(2) probes the links at every cap and uncapped (``python -m experiments.cluster probe``'s code, a few
sizes), fits the link per cap (freeze.costmodel.link.fit_link), and (3) measures the engine's median
step at each k on the cluster (experiments.bench_cluster's step loop, the engine alone). The one
fitted factor, ``comm_cpu_share``, is fitted at one point (``--fit-at``, default the first node
count, 1gbit if measured, the first k) and the others are predictions. Errors are (predicted -
measured) / measured; median and worst |error| exclude the fitted point.

Writes to ``--out-dir`` (default report/costmodel, files never overwritten): validation.md (table,
errors, load average, command), validation.csv, validation.png (predicted vs measured, diagonal
drawn), profile-N<n>.json and probe-<n>x<cap>.json. The activation cache is not on this branch:
every point is cache off. Exit 2 with one line on bad input or where no cluster can be built.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from experiments import bench_cluster as bc
from experiments import bench_workers as bw
from experiments.predict import InputError, make_profile, write_csv
from freeze.costmodel import ClusterModel, fit_comm_cpu_share, fit_link, load_profile, predict_step, read_probe

PHASES = ("forward", "backward", "after")  # zero_grad+forward+loss | backward incl. DDP wait | monitor+optimizer
CSV_COLUMNS = (
    "nodes",
    "bandwidth",
    "k",
    "cache",
    "measured_ms",
    "predicted_ms",
    "error",
    "fitted",
    *(f"{w}_{phase}_ms" for w in ("measured", "predicted") for phase in PHASES),
)
PROBE_SIZES_MIB = (1.0, 4.0, 16.0)


def _probe(nodes: int, bandwidth: str, out_dir: Path, repeats: int) -> dict:
    import json

    from freeze.pipeline.cluster import ClusterSpec
    from freeze.pipeline.cluster.probe import run_probe

    path = out_dir / f"probe-{nodes}x{bandwidth}.json"
    if path.exists():  # probes already taken for this grid are reused, never overwritten
        return json.loads(path.read_text())
    return run_probe(ClusterSpec.parse(nodes, bandwidth), path, PROBE_SIZES_MIB, repeats, log=lambda m: None)


def _profile(nodes: int, cfg: bc.ClusterBenchConfig, steps: int, out_dir: Path):
    from freeze.costmodel import save_profile
    from freeze.costmodel.profiler import NodeCores
    from freeze.pipeline.cluster import plan_cpus

    path = out_dir / f"profile-N{nodes}.json"
    if path.exists():
        return load_profile(path)
    layout = [NodeCores(tuple(c.cores), c.threads_per_worker) for c in plan_cpus(nodes, 1)]
    profile = make_profile(cfg.model, cfg.batch_size, cfg.image_size, steps, layout)
    save_profile(profile, path)
    return profile


def _measured(cfg: bc.ClusterBenchConfig, nodes: int, bandwidth: str, ks, deadline_s: float) -> dict[int, dict]:
    """Per k: the engine's median step and the medians of its phases (experiments.bench's split)."""
    from experiments import bench as bench_main

    meta = bc.measure_cluster(cfg, nodes, bandwidth, ks, deadline_s, approaches=(bw.ENGINE,))
    rows = bench_main.summarize(bw.combine_ranks(meta["ranks"]), meta["ranks"][0]["block_param_bytes"])
    return {
        r["k"]: {
            "measured_ms": r["median_ms"],
            "measured_forward_ms": r["forward_ms"],
            "measured_backward_ms": r["backward_ms"],
            "measured_after_ms": r["monitor_ms"] + r["optimizer_ms"],
        }
        for r in rows
        if r["approach"] == bw.ENGINE
    }


def validate(args: argparse.Namespace, cfg: bc.ClusterBenchConfig) -> list[dict]:
    """Profile, probe and measure every (N, cap, k); predict each; fit the CPU share at one point."""
    points, links, profiles = [], {}, {}
    for n in args.nodes:
        print(f"validate: N={n}: profiling", flush=True)
        profiles[n] = _profile(n, cfg, args.profile_steps, args.out_dir)
        print(f"validate: N={n}: probing", flush=True)
        uncapped = read_probe(_probe(n, "uncapped", args.out_dir, args.probe_repeats))
        for bandwidth in args.bandwidths:
            capped = (
                None if bandwidth == "uncapped" else read_probe(_probe(n, bandwidth, args.out_dir, args.probe_repeats))
            )
            links[(n, bandwidth)] = fit_link(capped, uncapped)
            print(f"validate: N={n}, {bandwidth}: measuring k={list(args.ks)}", flush=True)
            for k, measured in sorted(_measured(cfg, n, bandwidth, args.ks, args.deadline_s).items()):
                points.append({"nodes": n, "bandwidth": bandwidth, "k": k, "cache": False, **measured})
    fit = args.fit_at or (args.nodes[0], "1gbit" if "1gbit" in args.bandwidths else args.bandwidths[0], args.ks[0])
    n, bandwidth, k = fit
    target = next(p for p in points if (p["nodes"], p["bandwidth"], p["k"]) == fit)
    share = fit_comm_cpu_share(profiles[n], ClusterModel(n, links[(n, bandwidth)]), k, target["measured_ms"])
    for p in points:
        cluster = ClusterModel(p["nodes"], links[(p["nodes"], p["bandwidth"])], comm_cpu_share=share)
        step = predict_step(profiles[p["nodes"]], cluster, p["k"])
        p["predicted_ms"] = step.step_ms
        p["predicted_forward_ms"] = step.broadcast_ms + step.forward_ms
        p["predicted_after_ms"] = step.optimizer_ms
        p["predicted_backward_ms"] = step.step_ms - p["predicted_forward_ms"] - step.optimizer_ms
        p["error"] = (p["predicted_ms"] - p["measured_ms"]) / p["measured_ms"]
        p["fitted"] = (p["nodes"], p["bandwidth"], p["k"]) == fit
    args.fitted_share = share
    return points


def summary(points: list[dict], args, run: dict) -> str:
    errors = [abs(p["error"]) for p in points if not p["fitted"]]
    median = statistics.median(errors) if errors else float("nan")
    worst = max(errors) if errors else float("nan")
    lines = [
        "## Cost model: predicted vs measured step time (experiments/validate_costmodel.py)",
        "",
        f"Generated by `{run['command']}` in {run['wall_s']:.0f} s; load average (1 min) before / after "
        f"{run['load'][0]:.2f} / {run['load'][1]:.2f}. {args.model}, batch {args.batch_size} per worker, "
        f"{args.steps} timed steps per k after {args.warmup} warm-up; measured = median step of the slowest "
        f"rank. comm_cpu_share fitted at N={args.fit_at_used[0]}, {args.fit_at_used[1]}, k={args.fit_at_used[2]}: "
        f"{args.fitted_share:.2f}. Cache off everywhere (the activation cache is not on this branch).",
        "",
        f"Median |error| {median:.1%}, worst {worst:.1%} over {len(errors)} predicted points (the fitted point excluded).",
        "",
        "Phases (ms, measured / predicted): forward = zero_grad + forward + loss; backward = the backward with "
        "DDP's wait for its all-reduces; after = monitor + optimizer step.",
        "",
        "| N | link | k | measured ms | predicted ms | error | forward | backward | after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        mark = " (fitted)" if p["fitted"] else ""
        phases = " | ".join(
            f"{p.get(f'measured_{ph}_ms', float('nan')):.0f} / {p.get(f'predicted_{ph}_ms', float('nan')):.0f}"
            for ph in PHASES
        )
        lines.append(
            f"| {p['nodes']} | {p['bandwidth']} | {p['k']} | {p['measured_ms']:.0f} | {p['predicted_ms']:.0f} | "
            f"{p['error']:+.1%}{mark} | {phases} |"
        )
    return "\n".join(lines)


def figure(points: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    markers = dict(zip(sorted({p["nodes"] for p in points}), "os^Dv"))
    colors = dict(zip(sorted({p["bandwidth"] for p in points}), ("tab:red", "tab:blue", "tab:green", "k")))
    for p in points:
        ax.scatter(p["measured_ms"], p["predicted_ms"], marker=markers[p["nodes"]], color=colors[p["bandwidth"]])
        ax.annotate(
            str(p["k"]), (p["measured_ms"], p["predicted_ms"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    top = max(max(p["measured_ms"], p["predicted_ms"]) for p in points) * 1.1
    ax.plot([0, top], [0, top], "k-", lw=0.8, label="predicted = measured")
    for n, m in markers.items():
        ax.scatter([], [], marker=m, color="gray", label=f"N={n}")
    for b, c in colors.items():
        ax.scatter([], [], marker="o", color=c, label=b)
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured ms / step")
    ax.set_ylabel("predicted ms / step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _words(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _fit_at(text: str) -> tuple[int, str, int]:
    parts = text.split(",")
    try:
        return int(parts[0]), parts[1].strip(), int(parts[2])
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected N,CAP,K e.g. 2,1gbit,0; got '{text}'") from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.validate_costmodel", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=bc._ints, default=(2, 3, 4))
    p.add_argument("--bandwidths", type=_words, default=("100mbit", "1gbit", "uncapped"))
    p.add_argument("--ks", type=bc._ints, default=(0, 5, 7, 8))
    p.add_argument("--model", default="resnet18", choices=bw.MODELS)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="timed steps per k on the cluster")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per k (the first has one bucket)")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--probe-repeats", type=int, default=3)
    p.add_argument("--fit-at", type=_fit_at, help="N,CAP,K where comm_cpu_share is fitted")
    p.add_argument("--out-dir", type=Path, default=Path("report/costmodel"))
    p.add_argument("--deadline-s", type=float, default=3600.0)
    args = p.parse_args(argv)
    from freeze.pipeline.cluster import ClusterSpec, ClusterSpecError
    from freeze.pipeline.cluster.net import unavailable_reason

    cfg = bc.ClusterBenchConfig(
        nodes=tuple(args.nodes),
        bandwidths=tuple(args.bandwidths),
        model=args.model,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup=args.warmup,
        ks=tuple(args.ks),
        phase_ks=(),
    )
    try:
        for n in args.nodes:
            for bandwidth in args.bandwidths:
                ClusterSpec.parse(n, bandwidth)
        bc.resolve_ks(cfg)
        if min(args.steps, args.warmup, args.batch_size, args.profile_steps, args.probe_repeats) < 1:
            raise InputError("--steps, --warmup, --batch-size, --profile-steps, --probe-repeats: expected >= 1")
        if args.fit_at and (
            args.fit_at[0] not in args.nodes or args.fit_at[1] not in args.bandwidths or args.fit_at[2] not in args.ks
        ):
            raise InputError(f"--fit-at {args.fit_at}: not a point of the grid")
        written = [args.out_dir / f"validation.{ext}" for ext in ("md", "csv", "png")]
        if any(w.exists() for w in written):
            raise InputError(f"--out-dir {args.out_dir}: validation results exist; never overwritten: choose another")
    except (ClusterSpecError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason is not None:
        print(f"validate_costmodel: not run: {reason}", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.fit_at_used = args.fit_at or (
        args.nodes[0],
        "1gbit" if "1gbit" in args.bandwidths else args.bandwidths[0],
        args.ks[0],
    )
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    points = validate(args, cfg)
    run = {
        "command": shlex.join(
            getattr(sys, "orig_argv", [sys.executable, "-m", "experiments.validate_costmodel", *argv])
        ),
        "wall_s": time.perf_counter() - start,
        "load": (load_before, os.getloadavg()[0]),
    }
    text = summary(points, args, run)
    write_csv(points, written[1], CSV_COLUMNS)
    figure(points, written[2], f"{args.model}, batch {args.batch_size}: predicted vs measured")
    written[0].write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
