"""The config's checks that need torch: ``model.arch`` is a torchvision classification model, and
``freeze.policy`` parses against the policy registry, and what a policy needs beside it (a cost
profile, held-out images) is there.

They are kept out of :func:`freeze.pipeline.config.load_config`, so that reading a config imports
neither torch nor torchvision (every launcher, sweep expansion and report read one). Whatever starts
runs calls :func:`preflight` once per config, before the first run starts: the launcher
(:mod:`freeze.pipeline.run`), a sweep for each of its points, a study for each of its runs. A worker
parses the policy once, where it builds it (:func:`parse_policy_spec`), which is its own check under
a plain ``torchrun``.
"""

from __future__ import annotations

from pathlib import Path

from freeze.freezer.clock import RunClock
from freeze.pipeline.config import Config, ConfigError
from freeze.pipeline.costmodel.profile import Profile, ProfileError, load_profile
from freeze.pipeline.data import DataError, check_dataset, planned_steps_per_epoch
from freeze.pipeline.log import progress_choice
from freeze.pipeline.models import ModelError, check_arch, check_block_split
from freeze.pipeline.plugins import load_plugins
from freeze.pipeline.trackers import check_trackers
from freeze.policies import Policy, parse_policy


def preflight(config: Config) -> None:
    """ConfigError (one line naming the field and what is accepted) for an unknown ``model.arch`` or
    a ``freeze.policy`` that does not parse (after importing the plugins that may register them)."""
    load_plugins(config)
    try:
        check_arch(config.model.arch)
        check_block_split(config.model.arch, config.model.stem, config.model.blocks)
        check_dataset(config.data.dataset)
    except (ModelError, DataError) as err:
        raise ConfigError(str(err)) from None
    policy = parse_policy_spec(config.freeze.policy)
    check_policy_inputs(config, policy)
    check_run_length(config, policy)
    check_trackers(config.log.trackers)
    progress_choice()  # FREEZE_PROGRESS, read by every rank-0 worker: refused here, not mid-run


def check_policy_inputs(config: Config, policy: Policy) -> None:
    """ConfigError (one line) when what ``policy`` needs beside the config is not there: a cost
    profile for a policy that prices its freezes, held-out images for one that checks them. The
    launcher calls it through :func:`preflight`, a worker where it builds the policy (plain torchrun)."""
    needs = policy.needs()
    if needs.pricing:  # the workers read the profile itself (freeze.pipeline.pricing)
        check_profile_fits(config, config.freeze.cost_profile)
    schedule = config.schedule
    if needs.cosine_run and (schedule.name != "cosine" or schedule.warmup_epochs or schedule.min_lr):
        # its per-block factors are the ratio of each block's cosine to the run's (freeze.policies.rules)
        raise ConfigError(
            f"schedule: name={schedule.name}, warmup_epochs={schedule.warmup_epochs}, min_lr={schedule.min_lr}; "
            f"freeze.policy={policy.spec()} anneals each block against the run's cosine to zero, as published; "
            "accepted: schedule.name=cosine with warmup_epochs=0 and min_lr=0"
        )
    if needs.probe and not config.data.val_size:
        raise ConfigError(
            f"data.val_size: freeze.policy={policy.name} checks its freezes on held-out images; accepted: "
            "data.val_size > 0, or the policy's probation=0"
        )


def check_run_length(config: Config, policy: Policy) -> None:
    """ConfigError (one line) for a run asked fewer times than a pricing policy needs before its
    first decision, counted from the config before any data is read (the Freezer's own check,
    :meth:`freeze.freezer.clock.RunClock.check_evaluations`): found in the launcher, not when the
    run's turn comes hours into a study (reliability probe, case 11)."""
    needs = policy.needs()
    if not needs.pricing:  # as the Freezer: only a priced run is refused for its length
        return
    steps_per_epoch = planned_steps_per_epoch(config)
    if steps_per_epoch is None:
        return  # the dataset's size is known only once read: the worker checks
    clock = RunClock(config.train.epochs, steps_per_epoch, config.freeze.interval_steps)
    try:
        clock.check_evaluations(needs, policy.spec())
    except ValueError as err:
        raise ConfigError(f"freeze.interval_steps: {config.freeze.interval_steps}; {err}") from None


PROFILE_COMMAND = "python -m experiments.profile_run --config <the run's config> [--set ...]"


def check_profile_fits(config: Config, path: str | None) -> Profile:
    """The profile at ``path``, refused (ConfigError, one line) when it cannot price this run on any
    machine: none, unreadable, another batch size, optimizer or process count, or a comm hook the cost
    model does not describe. The application's one refusal of a pricing policy without its pricing (the
    library's is the Freezer's): checked where runs are planned (a login node too) and again where the
    worker prices, which adds what only the machine that trains can check: the exact cores and the
    CPU (freeze.pipeline.pricing)."""
    if not path or not Path(path).is_file():
        raise ConfigError(
            f"freeze.cost_profile: {path or 'not set'}; freeze.policy={config.freeze.policy} prices its freezes "
            f"with a cost-model profile of this machine; accepted: the path of one, made by `{PROFILE_COMMAND}`"
        )
    try:
        profile = load_profile(path)
    except (OSError, ProfileError) as e:
        raise ConfigError(
            f"freeze.cost_profile: {path} cannot be read ({e}); accepted: a profile made by `{PROFILE_COMMAND}`"
        ) from None
    if profile.batch_size != config.train.batch_size:
        raise ConfigError(
            f"freeze.cost_profile: {path} was measured at batch {profile.batch_size}, this run's is "
            f"{config.train.batch_size}; accepted: a profile at the run's batch size"
        )
    if profile.optimizer.split("(")[0] != config.optim.name:  # its label: "adamw(weight_decay=0.01)"
        raise ConfigError(
            f"freeze.cost_profile: {path} was measured with optimizer {profile.optimizer}, this run's is "
            f"{config.optim.name}; accepted: a profile with the run's optimizer"
        )
    layout = profile.meta.get("layout")
    processes = config.cluster.nodes or config.dist.nproc
    if isinstance(layout, list) and len(layout) != processes:
        raise ConfigError(
            f"freeze.cost_profile: {path} was measured with {len(layout)} processes, this run has {processes} "
            f"(dist.nproc, or cluster.nodes); accepted: a profile of the run's layout, made by `{PROFILE_COMMAND}`"
        )
    if config.freeze.comm_hook.startswith("powersgd"):
        raise ConfigError(
            f"freeze.comm_hook: {config.freeze.comm_hook} is not priced by the cost model; accepted with "
            f"freeze.policy={config.freeze.policy}: allreduce, bf16"
        )
    return profile


def parse_policy_spec(spec: str) -> Policy:
    """The policy ``freeze.policy`` names; ConfigError (one line) when it does not parse."""
    try:
        return parse_policy(spec)
    except ValueError as err:
        message = str(err)
        raise ConfigError(message if message.startswith("freeze.policy") else f"freeze.policy: {message}") from None
