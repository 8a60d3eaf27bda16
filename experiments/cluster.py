"""An emulated cluster on this machine: a run across N network namespaces, or a probe of its links.

    # one run of experiments.run on 2 nodes with 1 Gbit/s links (same as cluster.* config keys)
    python -m experiments.cluster --nodes 2 --bandwidth 1gbit -- --config experiments/configs/smoke.toml
    # all-reduce probe of the links (1-64 MiB and a tiny message), raw results as JSON
    python -m experiments.cluster probe --nodes 2 --bandwidth 1gbit --out runs/probe/2x1gbit.json
    # probe results side by side (markdown)
    python -m experiments.cluster table runs/probe/*.json
    # remove namespaces left by a launcher that was killed (also done at every start)
    python -m experiments.cluster cleanup

Needs root, iproute2 and util-linux. Exit codes: 0 done, 2 bad input or this machine cannot host
the cluster (one line on stderr), 1 the run or the probe failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from freeze.pipeline.cluster import ClusterError, ClusterSpec, ClusterUnavailable, check_host, cleanup_stale
from freeze.pipeline.cluster.jobs import exit_code
from freeze.pipeline.cluster.probe import DEFAULT_SIZES_MIB, PROBE_FORMAT, compare_table, run_probe, table
from freeze.pipeline.cluster.spec import DEFAULT_SUBNET


def _cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, required=True, help="network namespaces, one torchrun agent each")
    parser.add_argument("--bandwidth", required=True, help="each node's link, each direction: 100mbit, 1gbit, uncapped")
    parser.add_argument("--latency", default="0", help="one-way node-to-node delay, e.g. 0.2ms (needs netem)")
    parser.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"node addresses (default {DEFAULT_SUBNET})")


def _sizes(text: str) -> tuple[float, ...]:
    try:
        sizes = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated MiB, e.g. 1,8,64; got '{text}'") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"expected positive sizes in MiB, got '{text}'")
    return sizes


def run_main(argv: list[str]) -> int:
    before, sep, after = _split(argv)
    parser = argparse.ArgumentParser(
        prog="python -m experiments.cluster",
        description="Run experiments.run on an emulated cluster.",
        epilog="Everything after -- goes to experiments.run (--config FILE, overrides, --resume, --max-restarts).",
    )
    _cluster_args(parser)
    args = parser.parse_args(before)
    if not sep or not after:
        parser.error("give the arguments of experiments.run after --, e.g. -- --config experiments/configs/smoke.toml")
    from freeze.pipeline.run import main as run

    cluster = [
        f"cluster.nodes={args.nodes}",
        f"cluster.bandwidth={args.bandwidth}",
        f"cluster.latency={args.latency}",
        f"cluster.subnet={args.subnet}",
    ]
    return run(after + cluster)


def _split(argv: list[str]) -> tuple[list[str], bool, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], True, argv[i + 1 :]
    return argv, False, []


def probe_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.cluster probe", description=run_probe.__doc__)
    _cluster_args(parser)
    parser.add_argument("--out", type=Path, required=True, help="result JSON (never overwritten)")
    parser.add_argument("--sizes-mib", type=_sizes, default=DEFAULT_SIZES_MIB, help="all-reduce sizes, MiB")
    parser.add_argument("--repeats", type=int, default=5, help="timed all-reduces per size")
    parser.add_argument("--load", action="store_true", help="keep every node's cores busy while probing")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: expected an integer >= 1, got {args.repeats}")

    def work() -> int:
        spec = ClusterSpec.parse(args.nodes, args.bandwidth, args.latency, args.subnet)
        result = run_probe(spec, args.out, args.sizes_mib, args.repeats, args.load)
        print(table(result))
        print(f"probe: wrote {args.out}")
        return 0

    return exit_code(work, "probe")


def table_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.cluster table", description="Probe results side by side."
    )
    parser.add_argument("files", nargs="+", type=Path, help="probe JSON files")
    args = parser.parse_args(argv)
    results = []
    for path in args.files:
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            print(f"error: {path}: not a readable probe result ({e})", file=sys.stderr)
            return 2
        if result.get("format") != PROBE_FORMAT:
            print(f"error: {path}: format {result.get('format')!r}, expected {PROBE_FORMAT!r}", file=sys.stderr)
            return 2
        results.append(result)
    print(compare_table(results))
    return 0


def cleanup_main(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="python -m experiments.cluster cleanup").parse_args(argv)
    try:
        check_host()
        deleted = cleanup_stale()
    except (ClusterUnavailable, ClusterError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"cleanup: removed {len(deleted)} stale namespace(s)" + (f": {', '.join(deleted)}" if deleted else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["probe"]:
        return probe_main(argv[1:])
    if argv[:1] == ["table"]:
        return table_main(argv[1:])
    if argv[:1] == ["cleanup"]:
        return cleanup_main(argv[1:])
    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main())
