"""A grid of runs (policies x parameters x seeds x worker counts x any config key), one after another.

    python -m experiments.sweep --sweep experiments/configs/sweep_smoke.toml --dry-run  # list the runs
    python -m experiments.sweep --sweep experiments/configs/sweep_smoke.toml            # run them

Sweep file (docs/experiments.md, "Sweeps"; a learnable ablation to copy: "Your own ablation",
experiments/configs/sweep_ablation.toml; sweep_smoke.toml below is a pipeline check only):

    [sweep]                                          # accepted keys: base, study, overrides
    base = "experiments/configs/smoke.toml"          # the run config every run starts from
    study = "smoke-sweep"                            # runs/<study>/<run-name>/
    overrides = ["train.epochs=2"]                   # applied to every run (section.key=value)
    [grid]                                           # the cartesian product of these config keys
    "freeze.policy" = ["none", "geometric:alpha=0.5"]
    "run.seed" = [0, 1, 2]

Run names join the grid values (none_seed=0); runs that differ only in run.seed share a group.

Every run's config is resolved and validated once, before anything runs (:func:`expand`); each run
then starts from the resolved config.toml written into its run directory.

Re-running a sweep skips complete runs, resumes interrupted or failed ones from their checkpoint
and never overwrites a result. A failing run is recorded as failed (its manifest holds the error)
and the sweep goes on; the summary says what ran, what was skipped and what failed. The sweep holds
each run's lock while it runs it (:mod:`freeze.pipeline.run_lock`): a run another process writes
(a second sweep on the same study) is left to it and reported as busy, with that process's pid and
host; two sweeps of one study thus share its runs, each run trained once. The exit code is 0 only
when every run is complete.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from freeze.pipeline.config import Config, ConfigError, load_config
from freeze.pipeline.distributed import check_hardware
from freeze.pipeline.failures import killed_line, record_failure
from freeze.pipeline.lifetime import launcher_env, worker_argv
from freeze.pipeline.preflight import preflight
from freeze.pipeline.run import INTERRUPTED_EXIT_CODE, exported, launch_cluster, launch_local, prepare_run_dir
from freeze.pipeline.run_lock import RunBusyError, RunLock
from freeze.pipeline.runs import IN_SWEEP_ENV, RunDir, RunError
from freeze.pipeline.schema import run_name_part

SEED_KEY = "run.seed"


class SweepError(ValueError):
    """A sweep file that cannot be expanded; one line naming the file and the key."""


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its resolved config (validated once, in :func:`expand`)."""

    config: Config

    @property
    def name(self) -> str:
        return self.config.run.name

    @property
    def group(self) -> str:
        return self.config.run_group()


@dataclass
class SweepSummary:
    ran: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    busy: list[tuple[str, str]] = field(default_factory=list)  # another process writes them
    failed: list[tuple[str, str]] = field(default_factory=list)
    interrupted: list[str] = field(default_factory=list)  # Ctrl-C or SIGTERM: resumed by the next invocation

    @property
    def ok(self) -> bool:
        """Every run is complete: none failed, none left to another writer."""
        return not self.failed and not self.busy and not self.interrupted

    def lines(self) -> list[str]:
        out = [
            f"sweep: {len(self.ran)} ran ({len(self.resumed)} of them resumed), "
            f"{len(self.skipped)} skipped (complete), {len(self.busy)} busy (another writer), "
            f"{len(self.failed)} failed"
        ]
        out += [f"  busy: {name}: {error}" for name, error in self.busy]
        out += [f"  failed: {name}: {error}" for name, error in self.failed]
        return out


def _slug(key: str, value) -> str:
    short = key.split(".")[-1]
    text = str(value)
    return run_name_part(text if key == "freeze.policy" else f"{short}={text}")


def read_toml(path: str | Path, kind: str) -> dict:
    """A sweep or study file as a dict; a missing file or bad TOML is one SweepError line."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SweepError(f"{kind} file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SweepError(f"{kind} file {path} cannot be read as UTF-8 text: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{kind} file {path}: {e}") from None


SWEEP_KEYS = ("base", "study", "overrides")


def read_sweep(path: str | Path) -> dict:
    data = read_toml(path, "sweep")
    unknown = set(data) - {"sweep", "grid"}
    if unknown:
        raise SweepError(f"sweep file {path}: unknown table(s) {', '.join(sorted(unknown))}; accepted: sweep, grid")
    sweep = data.get("sweep")
    if not isinstance(sweep, dict):
        raise SweepError(f"sweep file {path}: needs a [sweep] table with 'base' and 'study'")
    # A key meant for [grid] (or misspelled) would otherwise be ignored: the sweep would run the base
    # config once instead of the grid, silently.
    unknown = set(sweep) - set(SWEEP_KEYS)
    if unknown:
        raise SweepError(
            f"sweep file {path}: unknown key(s) {', '.join(repr(k) for k in sorted(unknown))} under [sweep]; "
            f"accepted: {', '.join(SWEEP_KEYS)} (grid values go under [grid])"
        )
    if "base" not in sweep or "study" not in sweep:
        raise SweepError(f"sweep file {path}: needs a [sweep] table with 'base' and 'study'")
    for key in ("base", "study"):
        if not isinstance(sweep[key], str):
            raise SweepError(f"sweep file {path}: '{key}' under [sweep] must be a string, got {sweep[key]!r}")
    overrides = sweep.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise SweepError(f'sweep file {path}: overrides must be a list of "section.key=value" strings')
    grid = data.get("grid", {})
    if not isinstance(grid, dict):
        raise SweepError(f'sweep file {path}: [grid] must be a table of "section.key" = [values]')
    for key, values in grid.items():
        if isinstance(values, dict):  # TOML reads an unquoted freeze.policy = [...] as a table
            dotted = _first_dotted_key(key, values)
            raise SweepError(
                f'sweep file {path}: grid key {dotted} is read as a table; quote dotted keys: "{dotted}" = [...]'
            )
        if not isinstance(values, list) or not values:
            raise SweepError(f'sweep file {path}: grid."{key}" must be a non-empty list')
    return {"base": sweep["base"], "study": sweep["study"], "overrides": list(sweep.get("overrides", [])), "grid": grid}


def _first_dotted_key(key: str, table: dict) -> str:
    """``freeze`` + ``{"policy": [...]}`` -> ``freeze.policy``: the key as the user typed it."""
    while isinstance(table, dict) and table:
        key, table = f"{key}.{next(iter(table))}", next(iter(table.values()))
    return key


def expand(base: str, study: str, grid: dict, overrides: list[str], out_dir: str | None = None) -> list[RunSpec]:
    """Cartesian product of the grid, validated against the base config before anything runs."""
    keys = list(grid)
    specs = []
    for values in itertools.product(*(grid[k] for k in keys)):
        pairs = list(zip(keys, values))
        point = {**dict(pairs), "run.study": study}  # typed, as the sweep file holds them
        if pairs:  # an empty grid is one run that keeps the config's own run.name and run.group
            name = "_".join(_slug(k, v) for k, v in pairs)
            group = "_".join(_slug(k, v) for k, v in pairs if k != SEED_KEY) or name
            point |= {"run.name": name, "run.group": group}
        if out_dir is not None:
            point["run.out_dir"] = str(out_dir)
        try:
            config = load_config(base, overrides, check_files=False, values=point)
            preflight(config)  # every point refused before the first run starts, not hours in
        except ConfigError as e:
            raise SweepError(f"run {'_'.join(_slug(k, v) for k, v in pairs) or base}: {e}") from None
        specs.append(RunSpec(config))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise SweepError("sweep: two grid points map to the same run name; make the grid values distinct")
    return specs


def dry_run_lines(specs: list[RunSpec]) -> list[str]:
    """What ``--dry-run`` prints: where the runs go, then one run name per line."""
    studies = sorted({str(Path(s.config.run.out_dir) / s.config.run.study) for s in specs})
    return [f"{len(specs)} run{'' if len(specs) == 1 else 's'} in {', '.join(studies)}/:"] + [
        f"  {spec.name}" for spec in specs
    ]


def _launch(config: Config, resume: bool, lock: RunLock) -> int:
    """Run one resolved config to its end under ``lock`` (held here); returns the exit code."""
    resolved = prepare_run_dir(config, resume)
    if config.cluster.nodes:  # one torchrun agent per emulated node (freeze.pipeline.cluster)
        return launch_cluster(config, resolved, resume, lock=lock)
    if config.dist.nproc > 1:
        # Workers are separate processes either way; hosting torchrun's agent here saves a
        # launcher process (interpreter + torch import, ~3 s) per run.
        return launch_local(resolved, config.dist.nproc, resume, lock=lock)
    # A single-process run trains in its own process, so a crash cannot take the sweep down; it
    # dies with the sweep and works under the sweep's lock (launcher_env, lock.env).
    cmd = [sys.executable, *worker_argv("freeze.pipeline.run"), "--config", str(resolved)]
    env = {**os.environ, **launcher_env(), **lock.env()}
    code = subprocess.run(cmd + (["--resume"] if resume else []), env=env).returncode
    if code < 0 and -code not in (signal.SIGINT, signal.SIGTERM):  # killed (the OOM killer): it recorded nothing
        line = killed_line("the run's process", -code)
        print(f"error: {line}", file=sys.stderr)
        record_failure(config.run_dir(), line, replace_failed=True)
        return 1
    return code


# INTERRUPTED_EXIT_CODE (run.py): what a launcher returns when it was interrupted (Ctrl-C or
# SIGTERM) and stopped its workers. The emulated cluster's launcher catches the interrupt to remove
# its namespaces and returns it too, so the sweep must stop on it rather than start the next run.
INTERRUPTED_MESSAGE = "interrupted: completed runs are kept; run the same command again to resume the rest"


def _run_one(spec: RunSpec, tag: str, summary: SweepSummary, log) -> None:
    """Run ``spec`` unless it is complete or another process writes it; record the outcome.
    Raises KeyboardInterrupt when the run was interrupted: the sweep stops there."""
    run = RunDir(spec.config.run_dir())
    try:
        if run.status() == "complete":  # checked before the lock: a complete run is not touched
            summary.skipped.append(spec.name)
            log(f"{tag}: complete, skipped")
            return
        lock = RunLock.acquire(run.path)
    except RunBusyError as e:
        summary.busy.append((spec.name, str(e)))
        log(f"{tag}: BUSY ({e})")
        return
    except RunError as e:
        summary.failed.append((spec.name, str(e)))
        log(f"{tag}: FAILED ({e})")
        return
    with lock:
        try:
            status = run.status()  # again, now that no one else writes it
        except RunError as e:
            summary.failed.append((spec.name, str(e)))
            return
        if status == "complete":  # another sweep finished it meanwhile
            summary.skipped.append(spec.name)
            log(f"{tag}: complete, skipped")
            return
        resume = run.has_progress()
        log(f"{tag}: {'resuming' if resume else 'starting'}")
        start_s = time.perf_counter()
        try:
            code = _launch(spec.config, resume, lock)
        except RunError as e:  # e.g. resuming a run directory written with another config
            lock.discard_if_unstarted()
            summary.failed.append((spec.name, str(e)))
            log(f"{tag}: FAILED ({e})")
            return
        if code != 0:
            lock.discard_if_unstarted()  # refused before it started: nothing left behind
        if code not in (0, INTERRUPTED_EXIT_CODE):
            record_failure(run.path, f"exit code {code}")  # started, and no worker said why
    summary.ran.append(spec.name)
    if resume:
        summary.resumed.append(spec.name)
    if code == INTERRUPTED_EXIT_CODE:
        run.mark_interrupted()
        summary.interrupted.append(spec.name)
        log(f"{tag}: interrupted (its completed epochs are kept)")
        raise KeyboardInterrupt
    if code != 0:
        error = f"exit code {code}"
        with contextlib.suppress(RunError):  # no manifest, or an unreadable one: the exit code is all we know
            error = run.read_manifest().get("error") or error
        summary.failed.append((spec.name, error))
        log(f"{tag}: FAILED ({error})")
    else:
        log(f"{tag}: complete in {time.perf_counter() - start_s:.1f} s")


@dataclass
class WorkEta:
    """Time left for a whole sweep or study, from the wall times of the runs trained start to end in
    this invocation (a run skipped as complete, resumed or failed says nothing about a fresh run's
    length). A study shares one across its stages, so the estimate covers every run still to come."""

    runs_total: int
    runs_done: int = 0
    fresh_run_wall_s: list[float] = field(default_factory=list)

    def record(self, fresh_run_wall_s: float | None) -> None:
        """One more run is done; ``fresh_run_wall_s``: its wall time when it trained from its start."""
        self.runs_done += 1
        if fresh_run_wall_s is not None:
            self.fresh_run_wall_s.append(fresh_run_wall_s)

    def line(self) -> str:
        left = self.runs_total - self.runs_done
        if left <= 0:
            return f"eta: all {self.runs_total} runs done"
        if not self.fresh_run_wall_s:
            return f"eta: {self.runs_done} of {self.runs_total} runs done; time left known after the first run trained here"
        mean_s = sum(self.fresh_run_wall_s) / len(self.fresh_run_wall_s)
        return (
            f"eta: {self.runs_done} of {self.runs_total} runs done; about {_duration(left * mean_s)} left "
            f"({left} runs x {mean_s:.0f} s, the mean of the {len(self.fresh_run_wall_s)} trained here)"
        )


def _duration(seconds: float) -> str:
    """45 s, 12 min, 3 h 05 min."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def run_specs(specs: list[RunSpec], log=print, eta: WorkEta | None = None) -> SweepSummary:
    """Run every spec in turn (:func:`_run_one`); the summary says what happened to each. After each
    run, a line of ``eta`` (default: one for these runs alone) says how much of the work is left."""
    summary = SweepSummary()
    eta = eta or WorkEta(len(specs))
    with exported({IN_SWEEP_ENV: "1"}):  # the runs' workers inherit it (see runs.IN_SWEEP_ENV)
        for i, spec in enumerate(specs, 1):
            start_s, fresh_before = time.perf_counter(), _fresh_complete(summary)
            _run_one(spec, f"[{i}/{len(specs)}] {spec.name}", summary, log)
            eta.record(time.perf_counter() - start_s if _fresh_complete(summary) > fresh_before else None)
            log(eta.line())
    return summary


def _fresh_complete(summary: SweepSummary) -> int:
    """How many runs trained from their start to complete so far (for :class:`WorkEta`)."""
    failed = {name for name, _ in summary.failed}
    return sum(1 for name in summary.ran if name not in failed and name not in summary.resumed)


def check_runnable_here(specs: list[RunSpec]) -> None:
    """ConfigError (one line naming the run and the key) for a run that asks for hardware this
    machine lacks: refused before the first run starts, not after the others have run."""
    for spec in specs:
        try:
            check_hardware(spec.config)
        except ConfigError as e:
            raise ConfigError(f"run {spec.name}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", required=True, help="sweep TOML file")
    parser.add_argument("--out-dir", default=None, help="override run.out_dir for every run")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and exit")
    args = parser.parse_args(argv)
    try:
        sweep = read_sweep(args.sweep)
        try:
            specs = expand(sweep["base"], sweep["study"], sweep["grid"], sweep["overrides"], args.out_dir)
        except SweepError as e:  # a grid or override key of the sweep file (the base file names itself)
            raise SweepError(f"sweep file {args.sweep}: {e}") from None
        if not args.dry_run:  # a dry run lists names for other machines: this one's hardware is moot
            check_runnable_here(specs)
    except (SweepError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("\n".join(dry_run_lines(specs)))
        return 0
    try:
        summary = run_specs(specs)
    except KeyboardInterrupt:
        print(INTERRUPTED_MESSAGE, file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    for line in summary.lines():
        print(line)
    # what comes next, as a single run says it (the runs' own hint is off inside a sweep)
    print(f"report: python -m report {specs[0].config.run_dir().parent}" if specs else "sweep: no runs")
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
