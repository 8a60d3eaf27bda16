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
from collections.abc import Sequence
from pathlib import Path

from freeze.pipeline.config import Config, ConfigError
from freeze.pipeline.costmodel.link import LinkError
from freeze.pipeline.costmodel.model import predict_step
from freeze.pipeline.costmodel.profile import ProfileError, load_profile
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
from freeze.policies import Pricing

PROFILE_COMMAND = "python -m experiments.profile_run --config <the run's config> [--set ...]"


def run_pricing(cfg: Config, steps_per_epoch: int, block_names: Sequence[str], probe_dir: Path = PROBE_DIR) -> Pricing:
    """The run's :class:`~freeze.policies.Pricing` (module docstring).

    Args:
        cfg: the run's resolved config.
        steps_per_epoch: the run's optimizer steps per epoch.
        block_names: the model's block names, which the profile's must equal.
        probe_dir: where the cost model's probes and calibration are.

    Raises:
        ConfigError: one line naming the field: no profile, another model's, no probe for the link,
            or a comm hook the cost model does not describe.
    """
    step_time_s, rewrap_s = _step_times(cfg, block_names, probe_dir)
    total = steps_per_epoch * cfg.train.epochs
    lr = [cfg.optim.lr * lr_factor(s, steps_per_epoch, total, cfg.schedule, cfg.optim.lr) for s in range(total)]
    return Pricing(step_time_s=step_time_s, lr_per_step=tuple(lr), rewrap_s=rewrap_s)


def _check_layout(cfg: Config, profiled: list[dict] | None, path: str) -> None:
    """The profile's processes, cores and threads must be the run's on this machine: a step's compute
    time depends on them (threads per process, processes sharing a core), so a profile from another
    layout or another machine would misprice every freeze."""
    layout = process_layout(cfg)
    measured = None if profiled is None else [NodeCores(tuple(n["cores"]), n["threads"]) for n in profiled]
    if measured == layout:
        return
    where = "an unrecorded layout" if measured is None else f"core layout {layout_name(measured)}"
    raise ConfigError(
        f"freeze.cost_profile: {path} was measured in {where}, this run's on this machine is "
        f"{layout_name(layout)}; accepted: a profile in the run's layout, made here by `{PROFILE_COMMAND}`"
    )


def _step_times(cfg: Config, block_names: Sequence[str], probe_dir: Path) -> tuple[tuple[float, ...], float]:
    path = cfg.freeze.cost_profile
    if not path:
        raise ConfigError(
            f"freeze.cost_profile: freeze.policy={cfg.freeze.policy} prices its freezes with the cost model and needs "
            f"a profile of this machine; accepted: the path of one, made by `{PROFILE_COMMAND}`"
        )
    try:
        profile = load_profile(path)
    except (OSError, ProfileError) as e:
        raise ConfigError(
            f"freeze.cost_profile: {path} cannot be read ({e}); accepted: a profile made by `{PROFILE_COMMAND}`"
        ) from None
    if [b.name for b in profile.blocks] != list(block_names):
        raise ConfigError(
            f"freeze.cost_profile: {path} profiles blocks {[b.name for b in profile.blocks]}, this run's are "
            f"{list(block_names)}; accepted: a profile of this model (`{PROFILE_COMMAND}`)"
        )
    if profile.batch_size != cfg.train.batch_size:
        raise ConfigError(
            f"freeze.cost_profile: {path} was measured at batch {profile.batch_size}, this run's is "
            f"{cfg.train.batch_size}; accepted: a profile at the run's batch size"
        )
    if profile.optimizer.split("(")[0] != cfg.optim.name:  # its label: "adamw(weight_decay=0.01)"
        raise ConfigError(
            f"freeze.cost_profile: {path} was measured with optimizer {profile.optimizer}, this run's is "
            f"{cfg.optim.name}; accepted: a profile with the run's optimizer"
        )
    _check_layout(cfg, profile.meta.get("layout"), path)
    if cfg.freeze.comm_hook.startswith("powersgd"):
        raise ConfigError(
            f"freeze.comm_hook: {cfg.freeze.comm_hook} is not priced by the cost model; accepted with "
            f"freeze.policy={cfg.freeze.policy}: allreduce, bf16"
        )
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
