"""Measure the cost-model profile a configured run is priced with (``freeze.cost_profile``, which the
``horizon`` policy needs): the run's model at its batch size, optimizer and core layout on this
machine, as the study's prediction stage profiles it (freeze.pipeline.study.predict.measure_profile).

    python -m experiments.profile_run --config experiments/configs/fdsl32_finetune.toml \\
        --set dist.nproc=2 --out runs/horizon/costmodel/profile-loopback.json

It takes about a minute on 2 cores for a ResNet-18 (5 timed and 2 warm-up steps per boundary, in the
run's layout, so nothing else should run beside it). An existing file is never overwritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from freeze.pipeline.interrupts import INTERRUPTED_EXIT, InterruptGuard, exit_on_interrupt_while_loading, exit_with

if __name__ == "__main__":  # torch loads below: a Ctrl-C meanwhile is one line
    exit_on_interrupt_while_loading("profile_run: interrupted before it began; no profile written")

from freeze.pipeline.cluster.spec import CLUSTER_CORES_ENV, ClusterSpecError, available_cores, run_cores
from freeze.pipeline.config import ConfigError, load_config
from freeze.pipeline.costmodel import noise_warnings, save_profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's config (TOML)")
    parser.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE", help="the run's overrides")
    parser.add_argument("--out", required=True, help="where the profile is written (never overwritten)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        print(f"--out: {out} exists; accepted: a new path (a profile is never overwritten)", file=sys.stderr)
        return 2
    with InterruptGuard() as interrupt:
        try:
            return _measure(args.config, args.set, out, interrupt)
        except BaseException as error:
            if not interrupt.caused(error):
                raise
        print(f"profile_run: interrupted: no profile written ({out} does not exist)", file=sys.stderr)
        return INTERRUPTED_EXIT


def _measure(config_path: str, overrides: list[str], out: Path, interrupt: InterruptGuard) -> int:
    try:
        config = load_config(config_path, overrides)
        _check_cores(run_cores())  # FREEZE_CLUSTER_CORES, when set, names the cores the layout is planned over
    except (ConfigError, ClusterSpecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from freeze.pipeline.study.predict import measure_profile  # torch only after the arguments are checked

    profile = measure_profile(config)
    if interrupt.seen:  # swallowed on its way: a profile measured while interrupted is not kept
        raise KeyboardInterrupt
    save_profile(profile, out)  # atomic: a Ctrl-C leaves the profile whole or absent
    for line in noise_warnings(profile, str(out)):
        print(f"warning: {line}", file=sys.stderr)
    print(
        f"profile of {profile.model} at batch {profile.batch_size} ({profile.optimizer}) in {out}, "
        f"measured in {profile.meta.get('wall_s', float('nan')):.0f} s"
    )
    return 0


def _check_cores(cores: list[int]) -> None:
    """The profiler pins its processes to the cores the layout is planned over: each must be one this
    process may run on (a foreign FREEZE_CLUSTER_CORES failed in the pinned child, as a traceback)."""
    own = available_cores()
    foreign = [c for c in cores if c not in own]
    if foreign:
        raise ClusterSpecError(
            f"{CLUSTER_CORES_ENV}={','.join(map(str, cores))}: cores {', '.join(map(str, foreign))} are not this "
            f"process's to run on (it may run on {', '.join(map(str, own))}); accepted: cores of this machine, "
            f"or {CLUSTER_CORES_ENV} unset outside an emulated cluster's node"
        )


if __name__ == "__main__":
    exit_with(main())
