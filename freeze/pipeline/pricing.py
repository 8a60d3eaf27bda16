"""The pricing a ``horizon`` run trains with (freeze.policies.Pricing): each boundary's predicted
step time from the cost model for the machine and link the run is on, and the LR of every step
from the run's schedule.

- **step time**: :func:`freeze.pipeline.costmodel.predict_step` at every boundary, from the profile
  named by ``freeze.cost_profile`` (measured on this machine for this model, batch, core layout and
  optimizer, each checked against the run's: ``python -m experiments.profile_run --config <the run's config>``), the link fitted from
  the cost model's probes at the run's node count and cap, its fitted CPU share of communication, and
  the activation cache where the run has one (served from the first step at k >= 1, as the study's
  prediction assumes). With the bf16 hook a step sends half the bytes: the link's per-byte terms are
  halved. PowerSGD is not priced (the model has no term for its compression and error feedback).
- **re-wrap**: the first step after a DDP rebuild (one bucket of everything) less an ordinary one, at k = 0.
- **LR**: the schedule's factor at every step times ``optim.lr`` (freeze.pipeline.optim.lr_factor).

What cannot be priced is refused when the run starts, in one line naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

from freeze._atomic import atomic_write_text
from freeze.pipeline.cluster.spec import CLUSTER_CORES_ENV
from freeze.pipeline.config import Config, ConfigError
from freeze.pipeline.costmodel.link import LinkError
from freeze.pipeline.costmodel.model import predict_step
from freeze.pipeline.costmodel.profiler import NodeCores
from freeze.pipeline.costmodel.setting import (
    PROBE_DIR,
    comm_cpu_share,
    layout_name,
    probe_files,
    process_layout,
    run_cluster,
    run_link,
)
from freeze.pipeline.optim import lr_factor
from freeze.pipeline.preflight import PROFILE_COMMAND, check_profile_fits
from freeze.pipeline.runs import cpu_name
from freeze.policies import Pricing

# The pricing a run started with, in its run directory: what a resume prices with, so that an edited
# or replaced profile (or probe, or calibration) between two lives cannot change its decisions.
PRICING_FILE = "pricing.json"


def recorded_pricing(
    cfg: Config,
    run_dir: Path,
    steps_per_epoch: int,
    block_names: Sequence[str],
    base_lr: float,
    *,
    resuming: bool,
    write: bool,
) -> Pricing:
    """The run's pricing: on a resume from a checkpoint, the one its first life recorded in
    ``run_dir``; otherwise :func:`run_pricing` from the files the config names, recorded there
    (by the rank that ``write``s). A resumed run directory from before the record prices anew.

    Raises:
        ConfigError: what :func:`run_pricing` refuses, or a record that is not this run's (one line).
    """
    path = Path(run_dir) / PRICING_FILE
    if resuming and path.is_file():
        return _read_pricing(path, steps_per_epoch * cfg.train.epochs, len(block_names))
    pricing = run_pricing(cfg, steps_per_epoch, block_names, base_lr=base_lr)
    if write:
        atomic_write_text(path, json.dumps(dataclasses.asdict(pricing)))
    return pricing


def _read_pricing(path: Path, steps: int, num_blocks: int) -> Pricing:
    redo = "delete checkpoint.pt to re-run it from epoch 0"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        pricing = Pricing(
            step_time_s=record["step_time_s"],
            lr_per_step=record["lr_per_step"],
            rewrap_s=record["rewrap_s"],
            build_s=record.get("build_s", ()),
        )
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: the pricing this run started with cannot be read ({e}); {redo}") from None
    if len(pricing.step_time_s) != num_blocks or len(pricing.lr_per_step) != steps:
        raise ConfigError(
            f"{path}: prices {len(pricing.step_time_s)} boundaries over {len(pricing.lr_per_step)} steps, this run "
            f"has {num_blocks} blocks and {steps} steps; {redo}"
        )
    return pricing


def run_pricing(
    cfg: Config,
    steps_per_epoch: int,
    block_names: Sequence[str],
    probe_dir: Path = PROBE_DIR,
    base_lr: float | None = None,
) -> Pricing:
    """The run's :class:`~freeze.policies.Pricing` (module docstring).

    Args:
        cfg: the run's resolved config.
        steps_per_epoch: the run's optimizer steps per epoch.
        block_names: the model's block names, which the profile's must equal.
        probe_dir: where the cost model's probes and calibration are.
        base_lr: the LR the run trains at (optim.lr scaled with the global batch); None: optim.lr.

    Raises:
        ConfigError: one line naming the field: no profile, another model's, no probe for the link,
            or a comm hook the cost model does not describe.
    """
    step_time_s, rewrap_s = _step_times(cfg, block_names, probe_dir)
    total = steps_per_epoch * cfg.train.epochs
    lr0 = cfg.optim.lr if base_lr is None else base_lr
    lr = [lr0 * lr_factor(s, steps_per_epoch, total, cfg.schedule, lr0) for s in range(total)]
    return Pricing(step_time_s=step_time_s, lr_per_step=tuple(lr), rewrap_s=rewrap_s)


def _check_layout(cfg: Config, profiled: list[dict] | None, path: str) -> None:
    """The profile's processes, cores and threads must be the run's on this machine: a step's compute
    time depends on them (threads per process, processes sharing a core), so a profile from another
    layout or another machine would misprice every freeze."""
    layout = process_layout(cfg)
    # its shape was checked when the profile was read (freeze.pipeline.costmodel.profile)
    measured = None if profiled is None else [NodeCores(tuple(n["cores"]), n["threads"]) for n in profiled]
    if measured == layout:
        return
    where = "an unrecorded layout" if measured is None else f"core layout {layout_name(measured)}"
    named = os.environ.get(CLUSTER_CORES_ENV)
    source = f" (laid over {CLUSTER_CORES_ENV}={named})" if named else ""
    raise ConfigError(
        f"freeze.cost_profile: {path} was measured in {where}, this run's on this machine is "
        f"{layout_name(layout)}{source}; accepted: a profile in the run's layout, made here by `{PROFILE_COMMAND}`"
    )


def _check_machine(meta: dict, path: str) -> None:
    """A profile names the CPU it was measured on (profiles made before 2026-11-28 do not, and pass on
    their core layout alone): another CPU's costs would misprice every freeze. The host is not
    compared: a cluster's identical nodes share one profile."""
    measured_on = meta.get("cpu")
    if measured_on is None:
        return
    here = cpu_name()
    if measured_on != here:
        raise ConfigError(
            f"freeze.cost_profile: {path} was measured on {measured_on} (host {meta.get('host', '?')}), this "
            f"machine is {here}; accepted: a profile made on this kind of machine by `{PROFILE_COMMAND}`"
        )


def _step_times(cfg: Config, block_names: Sequence[str], probe_dir: Path) -> tuple[tuple[float, ...], float]:
    path = cfg.freeze.cost_profile
    profile = check_profile_fits(cfg, path)  # none, unreadable, or another run's: one line
    if [b.name for b in profile.blocks] != list(block_names):
        raise ConfigError(
            f"freeze.cost_profile: {path} profiles blocks {[b.name for b in profile.blocks]}, this run's are "
            f"{list(block_names)}; accepted: a profile of this model (`{PROFILE_COMMAND}`)"
        )
    _check_layout(cfg, profile.meta.get("layout"), path)
    _check_machine(profile.meta, path)
    probes = probe_files(cfg, probe_dir)
    try:
        link = run_link(probes, cfg)
    except (OSError, LinkError) as e:
        raise ConfigError(
            f"cluster: no link to price this run's communication ({e}); accepted: a setting whose probes are in "
            f"{probe_dir} (python -m experiments.validate_costmodel writes them)"
        ) from None
    if cfg.freeze.comm_hook == "bf16":  # half the bytes on the wire and through the reduction
        link = dataclasses.replace(
            link,
            gamma_s_per_byte=link.gamma_s_per_byte / 2,
            bandwidth_bytes_per_s=None if link.bandwidth_bytes_per_s is None else link.bandwidth_bytes_per_s * 2,
        )
    cluster = run_cluster(cfg, link, comm_cpu_share(probe_dir)[0])
    cache = cfg.freeze.cache != "off"
    steps = [predict_step(profile, cluster, k, cache=cache).step_ms / 1e3 for k in range(profile.num_blocks)]
    first = predict_step(profile, cluster, 0, first_after_rewrap=True).step_ms / 1e3
    return tuple(steps), max(first - steps[0], 0.0)
