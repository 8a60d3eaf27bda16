"""Check the cost model against the emulated cluster: predicted vs measured step time, cache off and on.

    # the full grid (the integrator's run, on a quiet machine), its section spliced into BENCH.md
    .venv/bin/python -m experiments.validate_costmodel --bench-md report/BENCH.md
    # a reduced grid (minutes)
    .venv/bin/python -m experiments.validate_costmodel --nodes 2 --bandwidths 1gbit,uncapped --ks 0,8 --steps 3
    # splice an earlier run's table and figure into BENCH.md again (experiments.bench rewrites it)
    .venv/bin/python -m experiments.validate_costmodel --splice-only --out-dir report/costmodel --bench-md report/BENCH.md

For every node count N it (1) profiles the model with one process per node pinned to that node's
cores (freeze.pipeline.cluster.plan_cpus: where nodes share a core the profile measures the sharing),
(2) probes the links at every cap and uncapped (``python -m experiments.cluster probe``'s code, a few
sizes), fits the link per cap (freeze.pipeline.costmodel.link.fit_link), and (3) measures the engine's median
step at each k on the cluster (experiments.bench_cluster's step loop). With ``--cache on`` the same
loop also runs experiments.bench's "engine + cache" at every k >= 1, in the same rotation as the
engine: the Freezer with a memory activation cache (``Freezer(cache=...)``, built at each k over
``cache_keys`` fixed images, as training builds it) whose forward reads the batch's keys and runs only
the tail; it is predicted with ``predict_step(..., cache=True)``, whose cache read is the profile's
``cache_read_ms`` (the store's own read, timed by freeze.pipeline.costmodel.profiler). The frozen prefix's
no-grad forward alone is measured in the same rotation (``measured_prefix_ms``): what the cache can
save at most.

The one fitted factor, ``comm_cpu_share``, is fitted at one point (``--fit-at``, default the first
node count, 1gbit if measured, the first k, cache off if measured) and the others are predictions.
Errors are (predicted - measured) / measured; median and worst |error| exclude the fitted point and
are reported for cache off, cache on and all points.

Writes to ``--out-dir`` (default report/costmodel, files never overwritten): validation.md (table,
errors, load average, command), validation.csv, validation.png (predicted vs measured, diagonal
drawn, cache on hollow), calibration.json (the fitted comm_cpu_share, freeze.pipeline.costmodel.calibration:
the study's prediction stage reads it), profile-N<n>.json and probe-<n>x<cap>.json (both reused when present);
with ``--bench-md`` also the table and a link to the figure between the costmodel-validation markers
of that file. Exit 2 with one line on bad input or where no cluster can be built.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from experiments import bench_cluster as bc
from experiments import bench_workers as bw
from experiments.bench.rows import summarize
from experiments.bench.sections import spliced_sections
from experiments.predict import InputError, make_profile, write_csv
from experiments.validate_costmodel_report import PHASES, figure, summary, write_bench_section
from freeze._atomic import atomic_write_text
from freeze.pipeline.costmodel import (
    CALIBRATION_FILE,
    Calibration,
    ClusterModel,
    fit_comm_cpu_share,
    fit_link,
    load_profile,
    predict_step,
    read_probe,
    save_calibration,
)
from freeze.pipeline.markdown import MarkerError

CACHES = ("off", "on")
APPROACH_OF = {"off": bw.ENGINE, "on": bw.ENGINE_CACHE}
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
    "measured_prefix_ms",
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
    from freeze.pipeline.costmodel import save_profile
    from freeze.pipeline.costmodel.setting import one_process_per_node

    path = out_dir / f"profile-N{nodes}.json"
    if path.exists():
        return load_profile(path)
    profile = make_profile(cfg.model, cfg.batch_size, cfg.image_size, steps, one_process_per_node(nodes))
    save_profile(profile, path)
    return profile


def measured_points(rows: list[dict], caches: tuple[str, ...]) -> list[dict]:
    """The measured points of one (N, cap) from experiments.bench's summary rows: per k, the engine
    (cache off) and the engine + cache (cache on, k >= 1 only: at k = 0 nothing is frozen, so nothing
    is cached), in k order, off before on.

    Args:
        rows: experiments.bench.rows.summarize's rows of one cluster cell.
        caches: the cache settings asked for ("off", "on").
    """
    prefix = {r["k"]: r["median_ms"] for r in rows if r["approach"] == bw.PREFIX_FORWARD}
    by_key = {(r["approach"], r["k"]): r for r in rows}
    points = []
    for k in sorted({r["k"] for r in rows}):
        for cache in caches:
            r = by_key.get((APPROACH_OF[cache], k))
            if r is None or (cache == "on" and k < 1):
                continue
            points.append(
                {
                    "k": k,
                    "cache": cache,
                    "measured_ms": r["median_ms"],
                    "measured_forward_ms": r["forward_ms"],
                    "measured_backward_ms": r["backward_ms"],
                    "measured_after_ms": r["monitor_ms"] + r["optimizer_ms"],
                    "measured_prefix_ms": prefix.get(k) if k >= 1 else None,
                }
            )
    return points


def _measured(cfg: bc.ClusterBenchConfig, nodes: int, bandwidth: str, ks, deadline_s: float, caches) -> list[dict]:
    """One (N, cap) on the cluster: the engine, and with cache on the engine + cache and the prefix
    forward (experiments.bench_workers adds it beside the cache runner), in one rotation."""
    approaches = (bw.ENGINE,) + ((bw.ENGINE_CACHE,) if "on" in caches else ())  # the worker needs the engine
    meta = bc.measure_cluster(cfg, nodes, bandwidth, ks, deadline_s, approaches=approaches)
    rows = summarize(bw.combine_ranks(meta["ranks"]), meta["ranks"][0]["block_param_bytes"])
    return measured_points(rows, caches)


def _key(p: dict) -> tuple:
    return p["nodes"], p["bandwidth"], p["k"], p["cache"]


def predict_points(points: list[dict], profiles: dict, links: dict, fit: tuple[int, str, int, str]) -> float:
    """Fit ``comm_cpu_share`` at the point ``fit`` = (N, cap, k, cache) and predict every point with
    it (fills predicted_* , error and fitted). Returns the fitted share.

    Args:
        points: measured points (nodes, bandwidth, k, cache "off"|"on", measured_ms).
        profiles: node count -> its Profile.
        links: (node count, cap) -> its fitted Link.
        fit: the point the share is fitted at.
    """
    target = next((p for p in points if _key(p) == fit), None)
    if target is None:
        raise ValueError(f"validate_costmodel: the fit point {fit} was not measured")
    n, bandwidth, k, cache = fit
    share = fit_comm_cpu_share(
        profiles[n], ClusterModel(n, links[(n, bandwidth)]), k, target["measured_ms"], cache=cache == "on"
    )
    for p in points:
        cluster = ClusterModel(p["nodes"], links[(p["nodes"], p["bandwidth"])], comm_cpu_share=share)
        step = predict_step(profiles[p["nodes"]], cluster, p["k"], cache=p["cache"] == "on")
        p["predicted_ms"] = step.step_ms
        p["predicted_forward_ms"] = step.broadcast_ms + step.forward_ms  # the cache read is in forward_ms
        p["predicted_after_ms"] = step.optimizer_ms
        p["predicted_backward_ms"] = step.step_ms - p["predicted_forward_ms"] - step.optimizer_ms
        p["error"] = (p["predicted_ms"] - p["measured_ms"]) / p["measured_ms"]
        p["fitted"] = _key(p) == fit
    return share


def validate(args: argparse.Namespace, cfg: bc.ClusterBenchConfig) -> list[dict]:
    """Profile, probe and measure every (N, cap, k, cache); predict each; fit the CPU share at one point."""
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
            print(
                f"validate: N={n}, {bandwidth}: measuring k={list(args.ks)}, cache {','.join(args.cache)}", flush=True
            )
            for m in _measured(cfg, n, bandwidth, args.ks, args.deadline_s, args.cache):
                points.append({"nodes": n, "bandwidth": bandwidth, **m})
    args.fitted_share = predict_points(points, profiles, links, args.fit_at_used)
    return points


def _fit_at(text: str) -> tuple:
    parts = [v.strip() for v in text.split(",")]
    try:
        if len(parts) not in (3, 4):
            raise ValueError
        return (int(parts[0]), parts[1], int(parts[2]), *parts[3:])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,CAP,K[,off|on] e.g. 2,1gbit,0; got '{text}'") from None


def _check(args: argparse.Namespace, cfg: bc.ClusterBenchConfig) -> None:
    """Every input check before anything runs (bench_cluster.preflight prints the ValueError's line)."""
    bad = [c for c in args.cache if c not in CACHES]
    if bad or not args.cache:
        raise InputError(f"--cache {','.join(args.cache)!r}: not accepted; accepted: off, on or off,on")
    if "on" in args.cache and not any(k >= 1 for k in args.ks):
        raise InputError("--cache on: needs a k >= 1 in --ks (at k = 0 nothing is frozen, nothing is cached)")
    bc.resolve_ks(cfg)
    if min(args.steps, args.warmup, args.batch_size, args.profile_steps, args.probe_repeats, args.cache_keys) < 1:
        raise InputError(
            "--steps, --warmup, --batch-size, --profile-steps, --probe-repeats, --cache-keys: expected >= 1"
        )
    n, bandwidth, k, cache = args.fit_at_used
    if n not in args.nodes or bandwidth not in args.bandwidths or k not in args.ks or cache not in args.cache:
        raise InputError(f"--fit-at {','.join(map(str, args.fit_at_used))}: not a point of the grid")
    if cache == "on" and k < 1:
        raise InputError(f"--fit-at {','.join(map(str, args.fit_at_used))}: cache on needs k >= 1")
    if args.bench_md is not None and not args.bench_md.parent.is_dir():
        raise InputError(f"--bench-md {args.bench_md}: its directory does not exist")
    if args.bench_md is not None:  # a broken span (markdown.MarkerError) now, not after the measurement
        spliced_sections(args.bench_md)
    _check_reused(args)
    written = [args.out_dir / f"validation.{ext}" for ext in ("md", "csv", "png")] + [args.out_dir / CALIBRATION_FILE]
    if any(w.exists() for w in written):
        raise InputError(f"--out-dir {args.out_dir}: validation results exist; never overwritten: choose another")


def _check_reused(args: argparse.Namespace) -> None:
    """Profiles and probes in --out-dir are reused by name: refuse one that measured something else
    (another model or batch, another node count or cap) instead of predicting from it silently."""
    import json

    from freeze.pipeline.cluster.spec import parse_rate
    from freeze.pipeline.costmodel import ProfileError

    for n in args.nodes:
        path = args.out_dir / f"profile-N{n}.json"
        if path.exists():
            try:
                profile = load_profile(path)
            except ProfileError as e:
                raise InputError(f"--out-dir: {e}") from None
            if (profile.model, profile.batch_size) != (args.model, args.batch_size):
                raise InputError(
                    f"--out-dir: {path} profiles {profile.model} at batch {profile.batch_size}, not {args.model} at "
                    f"batch {args.batch_size}: choose another --out-dir"
                )
        for bandwidth in {*args.bandwidths, "uncapped"}:
            path = args.out_dir / f"probe-{n}x{bandwidth}.json"
            if not path.exists():
                continue
            try:
                probe = read_probe(json.loads(path.read_text(encoding="utf-8")), str(path))
            except (OSError, ValueError) as e:  # LinkError included
                raise InputError(f"--out-dir: {path} is not a readable probe ({e})") from None
            found = (probe.nodes, probe.cap_bits_per_s)
            if found != (n, parse_rate(bandwidth)):
                raise InputError(
                    f"--out-dir: {path} was probed at {found[0]} nodes, {found[1]} bit/s, not {n} nodes, {bandwidth}: "
                    "choose another --out-dir"
                )


def _default_fit(args: argparse.Namespace) -> tuple[int, str, int, str]:
    """--fit-at as given (cache: off if measured), else the first node count, 1gbit if measured,
    the first k, cache off if measured (else on, at the first k >= 1)."""
    cache = "off" if "off" in args.cache else "on"
    if args.fit_at:
        return (*args.fit_at[:3], args.fit_at[3] if len(args.fit_at) == 4 else cache)
    ks = args.ks if cache == "off" else [k for k in args.ks if k >= 1] or args.ks
    return args.nodes[0], "1gbit" if "1gbit" in args.bandwidths else args.bandwidths[0], ks[0], cache


def _splice_only(args: argparse.Namespace) -> int:
    """--splice-only: an earlier run's table and figure link into --bench-md, nothing measured."""
    missing = [f for f in ("validation.md", "validation.png") if not (args.out_dir / f).exists()]
    if args.bench_md is None:
        problem = "--splice-only needs --bench-md (the file to write the section into)"
    elif missing:
        problem = f"--out-dir {args.out_dir}: no {', '.join(missing)} (run the validation there first)"
    elif not args.bench_md.parent.is_dir():
        problem = f"--bench-md {args.bench_md}: its directory does not exist"
    else:
        try:
            write_bench_section(args.out_dir, args.bench_md)
        except MarkerError as e:
            problem = str(e)
        else:
            print(f"validate_costmodel: wrote the costmodel-validation section of {args.bench_md}")
            return 0
    print(f"error: {problem}", file=sys.stderr)
    return 2


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.validate_costmodel", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=bc._ints, default=(2, 3, 4))
    p.add_argument("--bandwidths", type=bc._words, default=("100mbit", "1gbit", "uncapped"))
    p.add_argument("--ks", type=bc._ints, default=(0, 5, 7, 8))
    p.add_argument(
        "--cache", type=bc._words, default=CACHES, help="off, on or off,on (default): with and without the cache"
    )
    p.add_argument("--model", default="resnet18", choices=bw.MODELS)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="timed steps per k on the cluster")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per k (the first has one bucket)")
    p.add_argument("--cache-keys", type=int, default=bc.ClusterBenchConfig.cache_keys, help="images the cache holds")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--probe-repeats", type=int, default=3)
    p.add_argument("--fit-at", type=_fit_at, help="N,CAP,K[,off|on] where comm_cpu_share is fitted")
    p.add_argument("--out-dir", type=Path, default=Path("report/costmodel"))
    p.add_argument("--bench-md", type=Path, help="also write the table and figure link into this file's section")
    p.add_argument("--splice-only", action="store_true", help="only write --out-dir's results into --bench-md")
    p.add_argument("--deadline-s", type=float, default=3600.0)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = get_args_parser().parse_args(argv)
    if args.splice_only:
        return _splice_only(args)
    cfg = bc.ClusterBenchConfig(
        nodes=tuple(args.nodes),
        bandwidths=tuple(args.bandwidths),
        model=args.model,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup=args.warmup,
        ks=tuple(args.ks),
        phase_ks=(),
        cache_keys=args.cache_keys,
    )
    args.fit_at_used = _default_fit(args)
    refused = bc.preflight("validate_costmodel", args.nodes, args.bandwidths, lambda: _check(args, cfg))
    if refused is not None:
        return refused
    args.out_dir.mkdir(parents=True, exist_ok=True)
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
    write_csv(points, args.out_dir / "validation.csv", CSV_COLUMNS)
    figure(points, args.out_dir / "validation.png", f"{args.model}, batch {args.batch_size}: predicted vs measured")
    atomic_write_text(args.out_dir / "validation.md", text + "\n")
    n, bandwidth, k, cache = args.fit_at_used
    fitted_at = {"nodes": n, "bandwidth": bandwidth, "k": k, "cache": cache}
    save_calibration(Calibration(args.fitted_share, fitted_at, run["command"]), args.out_dir / CALIBRATION_FILE)
    if args.bench_md is not None:
        write_bench_section(args.out_dir, args.bench_md)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
