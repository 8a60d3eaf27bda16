"""Predict step and run time of data-parallel training with a frozen prefix on a cluster you do not have.

    # step time at every boundary k for 2..64 workers on 1 and 10 Gbit/s links (profiles this machine first)
    python -m experiments.predict --model resnet18 --batch-size 64 --workers 2,4,16,64 --bandwidth 1gbit,10gbit
    # reuse a profile, fit the link from cluster probes, include the activation cache
    python -m experiments.predict --profile runs/predict/x/profile.json --probe report/costmodel/probe-2x1gbit.json \\
        --probe report/costmodel/probe-2xuncapped.json --workers 16 --bandwidth 1gbit --cache
    # a finished run's boundary trajectory (its metrics.jsonl) on another cluster
    python -m experiments.predict --profile P.json --workers 16 --bandwidth 1gbit --run runs/study/autofreeze-s0
    # 2 nodes x 8 workers each (one ring of 16, paced by the link between the nodes)
    python -m experiments.predict --profile P.json --workers 2 --workers-per-node 8 --bandwidth 10gbit

A profile whose step times spread more than 10 % at some boundary over its timed steps is reported
as too noisy to rank boundaries (a warning on stderr and in predict.md).

Writes ``predict.md`` (tables), ``predict.csv`` and ``predict.png`` (stacked compute / exposed
communication / optimizer per k, one panel per workers x bandwidth) to ``--out-dir`` (a new
directory; never overwritten), and the profile it measured as ``profile.json`` there.

The link: alpha (per ring step) and gamma (CPU s per byte) are fitted from an uncapped probe, the
payload share of a cap from a capped probe, both at one node count (``python -m experiments.cluster
probe``; freeze.pipeline.costmodel.link). They are taken to hold at every node count and cap: on a real
cluster with its own NICs gamma is smaller than on an emulated one, whose forwarding shares the
training cores. Default probes: the cost model's validation's (report/costmodel/probe-2xuncapped.json
and probe-2x1gbit.json); default comm_cpu_share: its fit (report/costmodel/calibration.json), as the
study's prediction stage uses (freeze.pipeline.study.predict).
Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import os
import sys
import tomllib
from pathlib import Path

from freeze.pipeline import markdown as md
from freeze.pipeline.costmodel import (
    CALIBRATION_FILE,
    ClusterModel,
    Link,
    LinkError,
    Profile,
    ProfileError,
    link_from_probes,
    load_profile,
    noise_warnings,
    predict_run,
    predict_step,
    save_profile,
    scaled_link,
)
from freeze.pipeline.costmodel.setting import PROBE_DIR, comm_cpu_share
from freeze.pipeline.schema import CONFIG_FILE

DEFAULT_PROBES = (PROBE_DIR / "probe-2xuncapped.json", PROBE_DIR / "probe-2x1gbit.json")
CSV_COLUMNS = (
    "workers",
    "nodes",
    "bandwidth",
    "cache",
    "k",
    "compute_ms",
    "exposed_comm_ms",
    "optimizer_ms",
    "step_ms",
    "speedup_vs_k0",
    "allreduce_bytes",
)


class InputError(ValueError):
    """Bad command-line input: one line, exit 2."""


# ------------------------------------------------------------------------------------ the inputs
def cap_bits(text: str) -> float | None:
    """bit/s of "1gbit", "100mbit", ... or None for "uncapped" (the cluster's own parser)."""
    from freeze.pipeline.cluster.spec import ClusterSpecError, parse_rate

    try:
        return parse_rate(text, "--bandwidth")
    except ClusterSpecError as e:
        raise InputError(str(e)) from None


def make_profile(model: str, batch_size: int, image_size: int, steps: int, layout=None) -> Profile:
    """Profile ``model`` on this machine; default layout: one process on every core this process may use.

    Args:
        model: a model name experiments.bench_workers builds.
        batch_size: per worker.
        image_size: input height and width.
        steps: timed steps per boundary.
        layout: NodeCores per profiled process (None: one process, all cores).
    """
    from experiments import bench_workers as bw
    from freeze.pipeline.costmodel.profiler import NodeCores, ProfileSpec, profile_model

    if layout is None:
        cores = tuple(sorted(os.sched_getaffinity(0)))
        layout = [NodeCores(cores, len(cores))]
    spec = ProfileSpec(
        model_name=model,
        make_model=functools.partial(bw.build_model, model, image_size),
        input_shape=(3, image_size, image_size),
        num_classes=bw.NUM_CLASSES,
        batch_size=batch_size,
        steps=steps,
    )
    return profile_model(spec, layout)


def run_segments(run_dir: Path) -> tuple[list[tuple[int, int]], dict]:
    """(steps, k) per epoch of a run directory's metrics.jsonl (freeze.pipeline.trajectory), and
    what the run says about itself.

    Args:
        run_dir: a run directory (metrics.jsonl; config.toml read for model and batch size if present).
    """
    from freeze.pipeline.trajectory import TrajectoryError, read_trajectory

    try:
        trajectory = read_trajectory(run_dir)
    except TrajectoryError as e:
        raise InputError(f"--run {e}") from None
    info = {"measured_wall_s": trajectory.train_s, "steps": trajectory.steps}
    config = run_dir / CONFIG_FILE
    if config.is_file():
        c = tomllib.loads(config.read_text(encoding="utf-8"))
        info["arch"] = c.get("model", {}).get("arch")
        info["batch_size"] = c.get("train", {}).get("batch_size")
    return list(trajectory.segments), info


def check_segments(segments: list[tuple[int, int]], profile: Profile) -> None:
    """A run's boundaries must exist in the profile (the same model's block split)."""
    bad = sorted({k for _, k in segments if not 0 <= k < profile.num_blocks})
    if bad:
        raise InputError(
            f"--run: boundaries {bad} are not in the profile's 0..{profile.num_blocks - 1} ({profile.model}): "
            "profile the run's model"
        )


# ------------------------------------------------------------------------------------ the outputs
def prediction_rows(
    profile: Profile,
    links: dict[str, Link],
    workers: list[int],
    ks: list[int],
    cache: bool,
    share: float,
    workers_per_node: int = 1,
) -> list[dict]:
    """One row per node count x link x cache x boundary; ``workers``: node counts."""
    rows = []
    for n in workers:
        for name, link in links.items():
            cluster = ClusterModel(nodes=n, link=link, comm_cpu_share=share, workers_per_node=workers_per_node)
            for use_cache in (False, True) if cache else (False,):
                base = predict_step(profile, cluster, 0).step_ms
                for k in ks:
                    p = predict_step(profile, cluster, k, cache=use_cache)
                    rows.append(
                        {
                            "workers": n * workers_per_node,
                            "nodes": n,
                            "bandwidth": name,
                            "cache": use_cache,
                            "k": k,
                            "compute_ms": p.compute_ms,
                            "exposed_comm_ms": p.exposed_comm_ms,
                            "optimizer_ms": p.optimizer_ms,
                            "step_ms": p.step_ms,
                            "speedup_vs_k0": base / p.step_ms,
                            "allreduce_bytes": p.allreduce_bytes,
                        }
                    )
    return rows


def markdown(rows: list[dict], header: str) -> str:
    columns = ["workers", "link", "cache", "k", "compute ms", "exposed comm ms", "optimizer ms", "step ms"]
    columns += ["x vs k=0", "MB/step"]
    cells = [
        [
            r["workers"],
            r["bandwidth"],
            "on" if r["cache"] else "off",
            r["k"],
            *(f"{r[key]:.1f}" for key in ("compute_ms", "exposed_comm_ms", "optimizer_ms", "step_ms")),
            f"{r['speedup_vs_k0']:.2f}",
            f"{r['allreduce_bytes'] / 1e6:.1f}",
        ]
        for r in rows
    ]
    return "\n".join([header, "", *md.table(columns, cells)])


def write_csv(rows: list[dict], path: Path, columns=CSV_COLUMNS) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def figure(rows: list[dict], workers: list[int], bandwidths: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(bandwidths), len(workers), figsize=(3.2 * len(workers), 2.6 * len(bandwidths)), squeeze=False, sharey="row"
    )
    for i, name in enumerate(bandwidths):
        for j, n in enumerate(workers):
            ax = axes[i][j]
            cell = [r for r in rows if r["nodes"] == n and r["bandwidth"] == name and not r["cache"]]
            ks = [r["k"] for r in cell]
            bottom = [0.0] * len(cell)
            for part, color in (
                ("compute_ms", "tab:blue"),
                ("exposed_comm_ms", "tab:red"),
                ("optimizer_ms", "tab:gray"),
            ):
                values = [r[part] for r in cell]
                ax.bar(ks, values, bottom=bottom, color=color, label=part.removesuffix("_ms").replace("_", " "))
                bottom = [b + v for b, v in zip(bottom, values)]
            cached = [r for r in rows if r["nodes"] == n and r["bandwidth"] == name and r["cache"]]
            if cached:
                ax.plot([r["k"] for r in cached], [r["step_ms"] for r in cached], "k.--", label="step, cache on")
            total = cell[0]["workers"] if cell else n
            ax.set_title(f"{total} workers" + (f" ({n} nodes)" if total != n else "") + f", {name}", fontsize=9)
            ax.set_xlabel("boundary k")
            if j == 0:
                ax.set_ylabel("predicted ms / step")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_report(
    profile: Profile,
    links: dict[str, Link],
    workers: list[int],
    share: float,
    run_dir: Path,
    cache: bool,
    workers_per_node: int = 1,
) -> str:
    segments, info = run_segments(run_dir)
    lines = [f"## Run {run_dir}", ""]
    if info.get("arch") not in (None, profile.model) or info.get("batch_size") not in (None, profile.batch_size):
        lines.append(
            f"Note: the run used {info.get('arch')} at batch {info.get('batch_size')}; the profile is "
            f"{profile.model} at batch {profile.batch_size}: the prediction is for the profile's model and batch."
        )
    steps = sum(s for s, _ in segments)
    lines += [
        f"{steps} optimizer steps in {len(segments)} epochs; boundaries per epoch: {[k for _, k in segments]}; "
        f"measured training time where it ran: {info['measured_wall_s']:.1f} s.",
        "",
    ]
    cells = []
    for n in workers:
        for name, link in links.items():
            cluster = ClusterModel(nodes=n, link=link, comm_cpu_share=share, workers_per_node=workers_per_node)
            run = predict_run(profile, cluster, segments, cache=cache)
            base = predict_run(profile, cluster, [(steps, 0)])
            cells.append(
                [cluster.workers, name, f"{run.wall_s:.1f}", f"{base.wall_s:.1f}", f"{base.wall_s / run.wall_s:.2f}x"]
            )
    header = ("workers", "link", "predicted s (this trajectory)", "predicted s (k=0 throughout)", "saving")
    return "\n".join(lines + md.table(header, cells))


# ------------------------------------------------------------------------------------ the command
def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got '{text}'")
    return values


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.predict", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet18", help="model to profile (ignored with --profile)")
    p.add_argument("--batch-size", type=int, default=64, help="per worker (ignored with --profile)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--workers", type=_ints, default=[2, 4, 16, 64], help="node counts, e.g. 2,4,16,64")
    p.add_argument(
        "--workers-per-node",
        type=int,
        default=1,
        help="workers (GPUs) on each node, e.g. 8 for 2 nodes x 8 GPUs with --workers 2; the ring spans them all",
    )
    p.add_argument("--bandwidth", default="1gbit,10gbit", help="link caps, e.g. 100mbit,1gbit,uncapped")
    p.add_argument("--cache", action="store_true", help="also predict with the activation cache serving the prefix")
    p.add_argument("--profile", type=Path, help="a profile JSON (freeze-costmodel-profile/1); default: profile now")
    p.add_argument("--profile-steps", type=int, default=5, help="timed steps per boundary when profiling")
    p.add_argument("--probe", type=Path, action="append", help="probe JSON (repeat: one uncapped, one capped)")
    p.add_argument(
        "--comm-cpu-share",
        type=float,
        help=f"CPU share of an all-reduce during the backward (default: the fit in {PROBE_DIR / CALIBRATION_FILE})",
    )
    p.add_argument("--run", type=Path, help="a run directory: predict its boundary trajectory's wall time")
    p.add_argument("--out-dir", type=Path, help="new directory for the outputs (default runs/predict/<time>)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or Path("runs/predict") / f"{args.model}-b{args.batch_size}-{stamp}"
    try:
        if out_dir.exists():
            raise InputError(f"--out-dir {out_dir} exists; outputs are never overwritten: choose another")
        if args.comm_cpu_share is None:
            args.comm_cpu_share, share_note = comm_cpu_share(PROBE_DIR)
            print(f"predict: {share_note}", flush=True)
        if not 0 <= args.comm_cpu_share <= 1:
            raise InputError(f"--comm-cpu-share: {args.comm_cpu_share} is not in [0, 1]")
        if args.batch_size < 1 or args.profile_steps < 1 or args.workers_per_node < 1:
            raise InputError("--batch-size, --profile-steps and --workers-per-node: expected integers >= 1")
        names = [b.strip() for b in args.bandwidth.split(",") if b.strip()]
        caps = {name: cap_bits(name) for name in names}
        probes = args.probe or [p for p in DEFAULT_PROBES if p.is_file()]
        if not probes:
            raise InputError(
                f"--probe: none given and {PROBE_DIR} has no probes; run python -m experiments.cluster probe"
            )
        base, efficiency = link_from_probes(probes)
        links = {name: scaled_link(base, cap, efficiency) for name, cap in caps.items()}
        segments = run_segments(args.run)[0] if args.run is not None else []  # fail before any profiling
        profile = load_profile(args.profile) if args.profile else None
        if profile is not None:
            check_segments(segments, profile)
    except (InputError, LinkError, ProfileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True)
    if profile is None:
        print(f"predict: profiling {args.model} at batch {args.batch_size} on this machine ...", flush=True)
        profile = make_profile(args.model, args.batch_size, args.image_size, args.profile_steps)
        save_profile(profile, out_dir / "profile.json")
        try:
            check_segments(segments, profile)
        except InputError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    warnings = noise_warnings(profile, str(args.profile or out_dir / "profile.json"))
    for line in warnings:
        print(f"predict: warning: {line}", file=sys.stderr, flush=True)
    ks = list(range(profile.num_blocks))
    rows = prediction_rows(profile, links, args.workers, ks, args.cache, args.comm_cpu_share, args.workers_per_node)
    per_node = f", {args.workers_per_node} workers per node" if args.workers_per_node > 1 else ""
    header = (
        f"# Predicted step time: {profile.model}, batch {profile.batch_size} per worker{per_node}\n\n"
        f"Link fitted from {', '.join(str(p) for p in probes)}: alpha {base.alpha_s * 1e6:.0f} us per ring step, "
        f"gamma {base.gamma_s_per_byte * 1e9:.2f} ns/B, payload {efficiency:.0%} of a cap; comm_cpu_share "
        f"{args.comm_cpu_share}. Profile: {args.profile or out_dir / 'profile.json'} ({profile.threads} thread(s))."
        + "".join(f"\n\n**Warning**: {line}." for line in warnings)
    )
    text = markdown(rows, header)
    if args.run is not None:
        text += "\n\n" + run_report(
            profile, links, args.workers, args.comm_cpu_share, args.run, args.cache, args.workers_per_node
        )
    (out_dir / "predict.md").write_text(text + "\n", encoding="utf-8")
    write_csv(rows, out_dir / "predict.csv")
    figure(rows, args.workers, names, out_dir / "predict.png", f"{profile.model}, batch {profile.batch_size}")
    print(text)
    print(f"predict: wrote {out_dir}/predict.md, predict.csv, predict.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
