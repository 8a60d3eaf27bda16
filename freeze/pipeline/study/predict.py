"""The study's prediction stage (``[study] predict = true``): after the grid and before the report,
the cost model (:mod:`freeze.pipeline.costmodel`) predicts every complete study run's training time, and the
report lays it beside the measured time (``predicted.md``/``.csv``, :mod:`freeze.pipeline.report.predicted`).

Per run, from its directory alone:

- **trajectory**: (steps, boundary) per epoch (:mod:`freeze.pipeline.trajectory`);
- **cache**: on when the resolved config's ``freeze.cache`` is not "off";
- **cluster**: ``ClusterModel(nodes, link)`` with nodes = ``cluster.nodes`` on an emulated cluster, else
  ``dist.nproc`` (workers on one node talking over loopback), and DDP's ``freeze.bucket_cap_mb``;
- **profile**: measured once on this machine per distinct model, batch size and core layout, saved as
  ``<study dir>/costmodel/profile-<arch>-<stem>-b<batch>-<layout>.json``, reused when present and
  never overwritten. The layout is how the run's processes sat on the cores: a cluster run has one
  process per node pinned as the cluster pins its nodes (freeze.pipeline.cluster.plan_cpus); a
  loopback run of P workers has P processes, each on its share of the cores with the threads its
  workers take (freeze.pipeline.distributed.worker_threads: cores // P, which is plan_cpus(P, 1)'s
  share). Where processes share a core the profile measures that sharing. It takes the profiler's
  default steps (5 timed and 2 warm-up per boundary, as ``python -m experiments.predict``), and its
  seconds are logged.

Assumptions, and why:

1. **Cluster link**: alpha, gamma and the payload share of a cap are fitted from the probes the cost
   model's validation took (``report/costmodel/probe-<N>xuncapped.json`` and ``probe-<N>x<cap>.json`` at
   the setting's node count N, freeze.pipeline.costmodel.link_from_probes and scaled_link, which give the
   validation's fit_link exactly), taken to hold on the day of the study. Probing inside the study
   would add minutes and its own noise. On the emulated cluster the forwarding shares the training
   cores, so gamma depends on the load the probe met.
2. **Loopback link**: the uncapped fit. Gloo over ``lo`` has no cap, and the uncapped probe is the
   measured link whose rate the CPU alone sets, as on loopback; its gamma also pays the veth and
   bridge forwarding that ``lo`` skips, so loopback communication is predicted somewhat too slow.
3. **comm_cpu_share** is the validation's fit (``report/costmodel/calibration.json``, written by
   ``python -m experiments.validate_costmodel`` at one measured point, which it names), so the study
   predicts with the configuration whose errors BENCH.md reports; without that file, ClusterModel's
   default (0.5, an even split), said in the notes. Never fitted to the study's own runs: that would make
   the predictions part measurement.
4. **The cache** serves every step at k >= 1 from the first (its build, in the freezer phase at the
   boundary change, is not modelled; ``auto`` counts as on).
5. Boundaries are recorded per epoch: a boundary that moved mid-epoch is charged from the next epoch.

Runs the model does not describe are left out, each reason counted in the table's notes: mixed
precision, gradient accumulation or checkpointing, the bf16 communication hook, AdamW, model.blocks =
children, a cluster with several workers per node or a link delay. Missing probe files leave that
setting's runs out with one line and never fail the study.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from freeze.pipeline.cluster.spec import parse_delay
from freeze.pipeline.config import Config, ConfigError, load_config
from freeze.pipeline.costmodel import (
    Link,
    LinkError,
    Profile,
    ProfileError,
    load_profile,
    predict_run,
    save_profile,
)
from freeze.pipeline.costmodel.setting import (
    DEFAULT_COMM_CPU_SHARE,
    PROBE_DIR,
    comm_cpu_share,
    layout_name,
    probe_files,
    process_layout,
    run_cluster,
    run_link,
)
from freeze.pipeline.report.load import Run, load_runs
from freeze.pipeline.report.predicted import predicted_table
from freeze.pipeline.report.tables import Table, complete_groups
from freeze.pipeline.schema import CONFIG_FILE
from freeze.pipeline.trajectory import Trajectory, TrajectoryError, read_trajectory

# The cost model's validation (python -m experiments.validate_costmodel): its probes at 2-4 nodes and
# its fitted comm_cpu_share, so the study predicts with the configuration BENCH.md validates.
PROFILE_DIR = "costmodel"  # in the study directory
IMAGE_SHAPE = (3, 32, 32)  # every dataset the pipeline reads (freeze.pipeline.data)


@dataclass(frozen=True)
class _Planned:
    """A run the model describes, with what its prediction needs."""

    run: Run
    config: Config
    trajectory: Trajectory
    probes: tuple[Path, ...]
    profile_path: Path


class _LeftOut(Exception):
    """Why a run is not predicted (a short reason, counted in the notes)."""


# ----------------------------------------------------------------------------------- the run's setup
def profile_path(study_dir: str | Path, config: Config) -> Path:
    """Where the profile the run needs is kept in the study directory.

    Args:
        study_dir: the folder of the study's run directories.
        config: the run's resolved config.
    """
    m = config.model
    step = "" if config.optim.name == "sgd" else f"-{config.optim.name}"  # SGD's profiles keep their first names
    name = f"profile-{m.arch}-{m.stem}-b{config.train.batch_size}-{layout_name(process_layout(config))}{step}.json"
    return Path(study_dir) / PROFILE_DIR / name


def unmodelled(config: Config) -> str | None:
    """Why the cost model does not describe a run with this config, or None."""
    t, cluster = config.train, config.cluster
    checks = (
        (t.precision != "fp32", f"train.precision = {t.precision} (the profile is fp32)"),
        (t.accumulate_steps != 1, "train.accumulate_steps > 1"),
        (t.grad_checkpointing, "train.grad_checkpointing"),
        (config.freeze.comm_hook != "allreduce", f"freeze.comm_hook = {config.freeze.comm_hook}"),
        (config.model.blocks != "default", f"model.blocks = {config.model.blocks} (the profiler's split is default)"),
        (cluster.nodes > 0 and config.dist.nproc != 1, "several workers per cluster node"),
        (cluster.nodes > 0 and parse_delay(cluster.latency) > 0, "cluster.latency > 0 (the probes had none)"),
    )
    return next((reason for bad, reason in checks if bad), None)


def _plan(run: Run, study_dir: Path, probe_dir: Path) -> _Planned:
    try:
        config = load_config(run.run_dir / CONFIG_FILE, check_files=False)
        trajectory = read_trajectory(run.run_dir)
    except (ConfigError, TrajectoryError) as e:
        raise _LeftOut(f"unreadable run directory ({e})") from None
    reason = unmodelled(config)
    if reason is not None:
        raise _LeftOut(reason)
    if (config.cluster.nodes or config.dist.nproc) != run.world_size:
        raise _LeftOut("world size differs from the config's nodes x workers (launched by hand?)")
    return _Planned(run, config, trajectory, probe_files(config, probe_dir), profile_path(study_dir, config))


# ----------------------------------------------------------------------------------- links, profiles
def describe_link(link: Link) -> str:
    rate = "uncapped" if link.bandwidth_bytes_per_s is None else f"{link.bandwidth_bytes_per_s * 8 / 1e6:.0f} Mbit/s"
    return (
        f"alpha {link.alpha_s * 1e6:.0f} us per ring step, payload {rate}, gamma {link.gamma_s_per_byte * 1e9:.2f} ns/B"
    )


def measure_profile(config: Config) -> Profile:
    """Profile the run's model at its batch size in its core layout on this machine: one spawned
    process per entry of :func:`process_layout`, the profiler's default steps; the seconds it took
    are in the profile's ``meta["wall_s"]``.

    Args:
        config: the run's resolved config.
    """
    from freeze.pipeline.costmodel.profiler import ProfileSpec, profile_model
    from freeze.pipeline.data import NUM_CLASSES
    from freeze.pipeline.models import build_model

    spec = ProfileSpec(
        model_name=config.model.arch,
        make_model=functools.partial(build_model, config.model.arch, NUM_CLASSES, config.model.stem),
        input_shape=IMAGE_SHAPE,
        num_classes=NUM_CLASSES,
        batch_size=config.train.batch_size,
        momentum=config.optim.momentum,
        optimizer=config.optim.name,
        weight_decay=config.optim.weight_decay,
    )
    return profile_model(spec, process_layout(config))


def _profile(plan: _Planned, log: Callable[[str], None], measure: Callable[[Config], Profile]) -> Profile:
    """The profile at plan.profile_path: read when present, else measured and saved (never overwritten)."""
    path = plan.profile_path
    if path.exists():
        try:
            return load_profile(path)
        except ProfileError as e:
            raise _LeftOut(f"unreadable profile ({e})") from None
    name = layout_name(process_layout(plan.config))
    log(f"predict: profiling {plan.config.model.arch} at batch {plan.config.train.batch_size} in layout {name} ...")
    try:
        profile = measure(plan.config)
    except (RuntimeError, TimeoutError, OSError) as e:
        log(f"predict: profiling failed: {str(e).splitlines()[0]}")
        raise _LeftOut("profiling failed") from None
    log(f"predict: profile {path} measured in {profile.meta.get('wall_s', float('nan')):.0f} s")
    try:
        save_profile(profile, path)
    except OSError as e:  # FileExistsError included: a profile is never overwritten
        log(f"predict: profile not saved ({e}); used for this report only")
    return profile


def _cached_profile(
    cache: dict[Path, Profile | str], plan: _Planned, log: Callable[[str], None], measure: Callable[[Config], Profile]
) -> Profile:
    """The plan's profile, read or measured once per path; a failure is remembered, not retried per run."""
    if plan.profile_path not in cache:
        try:
            cache[plan.profile_path] = _profile(plan, log, measure)
        except _LeftOut as e:
            cache[plan.profile_path] = str(e)
    found = cache[plan.profile_path]
    if isinstance(found, str):
        raise _LeftOut(found)
    return found


def _check_profile(profile: Profile, plan: _Planned) -> None:
    config = plan.config
    if (profile.model, profile.batch_size) != (config.model.arch, config.train.batch_size):
        raise _LeftOut(
            f"profile {plan.profile_path.name} is not {config.model.arch} at batch {config.train.batch_size}"
        )
    if [b.name for b in profile.blocks] != plan.run.block_names:
        raise _LeftOut(f"the run's blocks differ from profile {plan.profile_path.name}'s")
    if any(not 0 <= k < profile.num_blocks for _, k in plan.trajectory.segments):
        raise _LeftOut("a boundary outside the profile's blocks")


# ----------------------------------------------------------------------------------- the stage
def predict_run_s(
    profile: Profile, link: Link, config: Config, trajectory: Trajectory, comm_cpu_share: float = DEFAULT_COMM_CPU_SHARE
) -> float:
    """Predicted training seconds of one run (module docstring).

    Args:
        profile: the run's profile (its model, batch and core layout).
        link: the run's link.
        config: the run's resolved config (cluster or workers, bucket size, cache).
        trajectory: the run's (steps, boundary) per epoch.
        comm_cpu_share: the cost model's fitted CPU share of communication (:func:`comm_cpu_share`).

    Raises:
        ValueError: the profile cannot predict this run (e.g. no cache_read_ms for a cached boundary).
    """
    cluster = run_cluster(config, link, comm_cpu_share)
    return predict_run(profile, cluster, trajectory.segments, cache=config.freeze.cache != "off").wall_s


def predict_study(
    study_dir: str | Path,
    probe_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    measure: Callable[[Config], Profile] | None = None,
) -> Table:
    """The predicted-vs-measured table of every complete run under ``study_dir``.

    Args:
        study_dir: the folder of the study's run directories (runs/<study>); profiles go to its costmodel/.
        probe_dir: where the probe files and the calibration are (default report/costmodel).
        log: where progress and the one-line messages go.
        measure: how a missing profile is measured (default: :func:`measure_profile`).

    Raises:
        ReportInputError: the run directories break their contract (the report would stop on it too).
    """
    study_dir, probe_dir = Path(study_dir), Path(probe_dir or PROBE_DIR)
    measure = measure or measure_profile
    share, share_note = comm_cpu_share(probe_dir)
    runs = load_runs(study_dir)
    left_out: Counter[str] = Counter()
    planned = []
    for members in complete_groups(runs).values():
        for run in members:
            try:
                planned.append(_plan(run, study_dir, probe_dir))
            except _LeftOut as e:
                left_out[str(e)] += 1
    links, notes = _links(planned, left_out, log)
    profiles: dict[Path, Profile | str] = {}
    predicted_s = {}
    for plan in planned:
        if links.get(plan.probes) is None:
            continue
        try:
            profile = _cached_profile(profiles, plan, log, measure)
            _check_profile(profile, plan)
        except _LeftOut as e:
            left_out[str(e)] += 1
            continue
        try:
            predicted_s[plan.run.run_dir] = predict_run_s(
                profile, links[plan.probes], plan.config, plan.trajectory, share
            )
        except ValueError as e:  # ProfileError and LinkError included
            left_out[f"not predictable from profile {plan.profile_path.name} ({e})"] += 1
    for path, profile in profiles.items():
        if isinstance(profile, Profile):
            notes.append(
                f"profile {path}: {profile.threads} thread(s) per process, {profile.nodes_per_core} process(es) per core"
            )
    notes += [f"left out {n} run(s): {reason}" for reason, n in sorted(left_out.items())]
    notes.append(share_note)
    notes.append(
        "assumptions (the probes' link on the day of the study, loopback as the uncapped link, the validation's "
        "comm_cpu_share, cache reads from the first step at k >= 1): freeze/pipeline/study/predict.py"
    )
    return predicted_table(runs, predicted_s, notes)


def _links(
    planned: list[_Planned], left_out: Counter, log: Callable[[str], None]
) -> tuple[dict[tuple[Path, ...], Link | None], list[str]]:
    """One link per distinct probe set; a missing or unreadable probe leaves its runs out, said in one line."""
    links: dict[tuple[Path, ...], Link | None] = {}
    settings: dict[tuple[Path, ...], set[str]] = defaultdict(set)
    notes, missing, broken = [], set(), []
    for plan in planned:
        settings[plan.probes].add(plan.run.setting or "(no setting)")
        if plan.probes in links:
            continue
        absent = [p for p in plan.probes if not p.is_file()]
        links[plan.probes] = None
        if absent:
            missing.update(absent)
            continue
        try:
            links[plan.probes] = run_link(plan.probes, plan.config)
        except LinkError as e:
            broken.append(str(e))
    for probes, link in links.items():
        names = ", ".join(sorted(settings[probes]))
        if link is None:
            left_out["no link: probe file missing or unreadable"] += sum(p.probes == probes for p in planned)
            continue
        if not probes:
            notes.append(f"{names}: one worker, no communication")
            continue
        notes.append(f"link of {names}: {' + '.join(map(str, probes))} ({describe_link(link)})")
    if missing or broken:
        lost = sorted({s for probes, link in links.items() if link is None for s in settings[probes]})
        what = f"{', '.join(map(str, sorted(missing)))} missing" if missing else ""
        what = "; ".join(filter(None, [what, *broken]))
        log(
            f"predict: {what} (python -m experiments.cluster probe writes them): setting(s) {', '.join(lost)} not predicted"
        )
    return links, notes
