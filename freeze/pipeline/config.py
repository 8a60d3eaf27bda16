"""The run configuration: nested frozen dataclasses, TOML in and out, ``section.key=value`` overrides.

A config is data. It is read from one TOML file, changed by command-line overrides, validated once
here at the edge (:func:`validate`), and written back beside the results with every default spelled
out (:func:`config_to_toml`), so a run directory alone says exactly what ran; the workers of a run
load that written file.

    config = load_config("experiments/configs/smoke.toml", ["optim.lr=0.05", "freeze.policy=autofreeze:percentile=50"])
    config.run_dir()                     # runs/<study>/<name>
    config_to_toml(config)               # the run directory's config.toml; load_config of it gives config back

Every bad input raises :class:`ConfigError` with one line naming the dotted key (or the file) and
what is accepted.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from freeze.checks import Range, did_you_mean, is_int, is_number, spell
from freeze.names import CacheMode, CommHook, StorageDtype
from freeze.pipeline.cluster.spec import DEFAULT_SUBNET, ClusterSpecError, parse_delay, parse_rate, parse_subnet


class ConfigError(ValueError):
    """A config file, override or value that is not accepted; the message is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).splitlines()))


def _f(default: Any, **bounds: float) -> Any:
    """A dataclass field with a numeric range (``ge``, ``gt``, ``le``, ``lt``)."""
    return field(default=default, metadata={"range": Range(**bounds)})


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    study: str = "default"
    out_dir: str = "runs"
    seed: int = _f(0, ge=0)
    group: str = ""  # "" -> the policy spec (see Config.run_group)
    # The environment a study compares arms in ("loopback", "cluster-1gbit"): the report compares
    # a group only with the baseline of the same setting and world size.
    setting: str = ""
    checkpoint_every_epochs: int = _f(1, ge=1)
    # A complete run keeps model.pt (final weights) and drops checkpoint.pt, the resume state (about
    # 90 MB for ResNet-18 with momentum), unless this is true: it is never resumed once complete.
    keep_checkpoint: bool = False


@dataclass(frozen=True)
class Augment:
    """``data.augment``, parsed once where the config is read (freeze.pipeline.augment applies it):
    ``crop-flip`` (a new random crop and flip per sample per epoch), ``views:V`` (V fixed views per
    sample) or ``none``."""

    kind: Literal["crop-flip", "views", "none"]
    views: int = 1  # V for "views", 1 otherwise

    @property
    def finite(self) -> bool:
        """Whether every training input is one of a fixed, finite set (identified by a key): what
        an activation cache needs."""
        return self.kind != "crop-flip"

    def spec(self) -> str:
        return f"views:{self.views}" if self.kind == "views" else self.kind


CROP_FLIP = Augment("crop-flip")  # the default: the standard CIFAR recipe
AUGMENT_ACCEPTED = "crop-flip, views:V (V >= 1 fixed views per sample), none"


def parse_augment(spec: object) -> Augment:
    """``"crop-flip"``, ``"views:V"`` (V >= 1) or ``"none"``; ConfigError (one line) otherwise."""
    if spec in ("crop-flip", "none"):
        return Augment(spec)
    match = re.fullmatch(r"views:([0-9]+)", spec) if isinstance(spec, str) else None
    if match and int(match.group(1)) >= 1:
        return Augment("views", int(match.group(1)))
    if isinstance(spec, bool):  # the key of earlier versions: their run directories are converted once
        raise ConfigError(
            f"data.augment: {_show(spec)} is not accepted (a run directory of an earlier version: "
            f"python -m experiments.convert_runs converts it once); accepted: {AUGMENT_ACCEPTED}"
        )
    raise ConfigError(f"data.augment: {_show(spec)} is not accepted; accepted: {AUGMENT_ACCEPTED}")


@dataclass(frozen=True)
class DataConfig:
    # cifar10, a generated task (freeze.pipeline.data.DATASET_NAMES), or a name a plugin registered with
    # freeze.pipeline.data.register_dataset: checked where plugins are loaded (preflight, the worker)
    dataset: str = "cifar10"
    root: str = "data"
    download: bool = False
    val_size: int = _f(5000, ge=0)  # images held out of the training set
    train_size: int = _f(0, ge=0)  # 0 = all remaining training images, else the first N after the val split
    test_size: int = _f(0, ge=0)  # 0 = all
    augment: Augment = CROP_FLIP  # written and read as its spec: crop-flip | views:V | none
    synthetic_train_size: int = _f(20000, ge=1)
    synthetic_test_size: int = _f(4000, ge=1)
    synthetic_seed: int = _f(0, ge=0)


# The stem of a torchvision ResNet: ImageNet's (7x7 stride 2 + max-pool) or CIFAR's (3x3 stride 1).
Stem = Literal["imagenet", "cifar"]
STEMS: tuple[str, ...] = typing.get_args(Stem)


class BlockSplit:
    """The annotation of ``model.blocks`` (a marker: values stay plain): "default" (the library's
    split: the model's repeated layers), "children" (parameter-owning top-level children, the
    reference study's 7 groups of a ResNet), or a list with one entry per block in forward order, as
    ``freeze.split_blocks`` takes them: a module name, a glob (``"layer1.*"``: one block per matching
    module) or a list of names forming one block; the last entry is the head."""


BLOCK_SPLIT_KEYWORDS = ("default", "children")
BLOCK_SPLIT_ACCEPTED = (
    'default, children, or a list of 2 or more entries in forward order, each a module name, a glob ("layer1.*") '
    'or a list of names forming one block (e.g. [["conv1", "bn1"], "layer1.*", "layer2.*", "layer3.*", "layer4.*", "fc"])'
)


def parse_block_split(dotted: str, value: Any) -> str | tuple:
    """``model.blocks`` checked: a keyword, or the entries as a tuple (a group as a tuple of names)."""
    if isinstance(value, str):
        if value in BLOCK_SPLIT_KEYWORDS:
            return value
        raise ConfigError(f"{dotted}: {_show(value)} is not accepted; accepted: {BLOCK_SPLIT_ACCEPTED}")

    def name_ok(v: Any) -> bool:
        return isinstance(v, str) and bool(v.strip())

    def entry_ok(v: Any) -> bool:
        return name_ok(v) or (isinstance(v, (list, tuple)) and bool(v) and all(name_ok(n) for n in v))

    if not isinstance(value, (list, tuple)) or len(value) < 2 or not all(entry_ok(v) for v in value):
        raise ConfigError(f"{dotted}: {_show(value)} is not accepted; accepted: {BLOCK_SPLIT_ACCEPTED}")
    return tuple(v if isinstance(v, str) else tuple(v) for v in value)


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "resnet18"  # a torchvision classification model name
    stem: Stem = "imagenet"
    weights: str = "none"  # "none", "imagenet", or the path of an existing file
    blocks: BlockSplit = "default"  # how the model is cut into blocks: see BlockSplit


@dataclass(frozen=True)
class FreezeConfig:
    policy: str = "none"  # a policy spec, e.g. "autofreeze:percentile=50" (freeze.policies.parse_policy)
    interval_steps: int = _f(0, ge=0)  # 0 = evaluate once per epoch
    comm_hook: CommHook = "allreduce"
    bucket_cap_mb: float = _f(25.0, gt=0)
    # Record summed-gradient norms (eta heatmaps) also for policies that do not read them. Off by
    # default: it costs a few % of a step, which would bias timing comparisons against the baseline.
    track_summed_grads: bool = False
    # Activation cache of the frozen prefix (freeze.cache): off | memory | disk | auto. It needs
    # inputs that repeat exactly, so data.augment must be views:V or none.
    cache: CacheMode = "off"
    cache_budget_bytes: int = _f(0, ge=0)  # of one node (all its ranks' copies); 0 = a quarter of RAM
    cache_dtype: StorageDtype = "fp32"  # storage; bf16/fp16 halve it, fp32 is exact
    # The cost model's profile of this machine, for a policy that prices its freezes (horizon):
    # python -m experiments.profile_run --config <this config> writes one (freeze.pipeline.pricing).
    cost_profile: str = ""


OptimizerName = Literal["sgd", "adamw"]  # what freeze.pipeline.optim.build_optimizer builds
OPTIMIZER_NAMES: tuple[str, ...] = typing.get_args(OptimizerName)


@dataclass(frozen=True)
class OptimConfig:
    name: OptimizerName = "sgd"
    lr: float = _f(0.1, gt=0)
    momentum: float = _f(0.9, ge=0, lt=1)
    nesterov: bool = False
    weight_decay: float = _f(1e-4, ge=0)
    betas: tuple[float, float] = _f((0.9, 0.999), ge=0, lt=1)
    eps: float = _f(1e-8, gt=0)
    grad_clip_norm: float = _f(0.0, ge=0)  # 0 = off
    # The global batch (per worker x workers x accumulation) ``lr`` was set for: the run's LR is
    # lr x its global batch / this (the linear scaling rule, Goyal et al. 2017), so a recipe run on
    # 8 workers instead of 4 keeps its recipe; 0: lr as given, whatever the batch.
    lr_reference_batch: int = _f(0, ge=0)


@dataclass(frozen=True)
class ScheduleConfig:
    name: Literal["constant", "step", "cosine", "exponential"] = "constant"
    warmup_epochs: float = _f(0.0, ge=0)
    step_size_epochs: int = _f(30, ge=1)
    gamma: float = _f(0.1, gt=0, le=1)
    min_lr: float = _f(0.0, ge=0)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = _f(50, ge=1)
    batch_size: int = _f(64, ge=1)  # per worker per micro-step
    accumulate_steps: int = _f(1, ge=1)
    label_smoothing: float = _f(0.0, ge=0, lt=1)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    grad_checkpointing: bool = False
    eval_every_epochs: int = _f(1, ge=1)  # the last epoch is always evaluated
    # "final": the test set only at the last epoch (the only test number a study may report; a
    # large test set evaluated every epoch would cost the study more than its training)
    test_eval: Literal["every-eval", "final"] = "every-eval"
    max_steps_per_epoch: int = _f(0, ge=0)  # 0 = full epoch
    # Budgeted training (Li, Yumer and Ramanan, ICLR 2020), the budget frontier a freezing arm must
    # beat: this fraction of every epoch's optimizer steps, with the LR schedule over the shorter run.
    budget_fraction: float = _f(1.0, gt=0, le=1)
    # Time to target that can see a late freeze: every N optimizer steps, accuracy on the first
    # probe_val_size validation images (a fixed subset), off the clock; 0 = no probes.
    probe_every_steps: int = _f(0, ge=0)
    probe_val_size: int = _f(1000, ge=1)
    eval_batch_size: int = _f(256, ge=1)


@dataclass(frozen=True)
class DistConfig:
    nproc: int = _f(1, ge=1)  # workers run.py starts itself when not under torchrun
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Bounds each gloo send/receive (torch's process-group timeout), not a collective or the run: a
    # large broadcast over a slow link is many such operations. Raise it for slow links.
    timeout_s: int = _f(300, ge=1)
    threads_per_worker: int = _f(0, ge=0)  # 0 = cores / local workers


# The experiment trackers a run can write to (freeze.pipeline.trackers), each an optional package.
TrackerName = Literal["tensorboard", "wandb", "mlflow"]
TRACKER_NAMES: tuple[str, ...] = typing.get_args(TrackerName)


@dataclass(frozen=True)
class LogConfig:
    """Where rank 0 sends each epoch's record besides metrics.jsonl (freeze.pipeline.trackers)."""

    trackers: tuple[TrackerName, ...] = ()  # e.g. ["tensorboard", "wandb"]; on the command line "tensorboard,wandb"
    project: str = "freeze"  # the W&B project / MLflow experiment; TensorBoard writes into the run directory
    mlflow_uri: str = ""  # MLflow's tracking URI; "" = a file store mlruns/ beside the study's runs


@dataclass(frozen=True)
class PluginsConfig:
    """Your own code in the pipeline: modules imported before the config's names are resolved, whose
    ``@register_policy`` policies and ``@register_model`` builders the run, sweep and study then accept
    by name (docs/policies.md). Installed packages can also declare them under the entry-point group
    ``freeze.plugins``, imported always."""

    modules: tuple[str, ...] = ()  # importable module names, e.g. ["my_policies"]


@dataclass(frozen=True)
class ClusterConfig:
    """An emulated cluster on this machine (freeze.pipeline.cluster); nodes = 0: none."""

    nodes: int = _f(0, ge=0)  # 0 = no cluster; >= 2 network namespaces, dist.nproc workers each
    bandwidth: str = "1gbit"  # each node's link, each direction: tc rate ("100mbit", "1gbit") or "uncapped"
    latency: str = "0"  # one-way node-to-node delay, e.g. "0.2ms" (needs the kernel's netem qdisc)
    subnet: str = DEFAULT_SUBNET  # node addresses, inside the cluster's own namespaces only


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    log: LogConfig = field(default_factory=LogConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)

    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.study / self.run.name

    def run_group(self) -> str:
        """The variant label: runs that differ only in seed share it ("" means the policy spec)."""
        return self.run.group or self.freeze.policy


SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Config))


def _section_class(section: str) -> type:
    return typing.get_type_hints(Config)[section]


def section_keys(section: str) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(_section_class(section)))


# ---------------------------------------------------------------------------------------------
# dict <-> Config (structure only; types and ranges are checked by validate)


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict (tuples become lists), ready for TOML or JSON."""
    return {
        section: {
            f.name: _plain(getattr(getattr(config, section), f.name))
            for f in dataclasses.fields(_section_class(section))
        }
        for section in SECTIONS
    }


def _plain(value: Any) -> Any:
    """A config value as TOML and JSON spell it: a tuple as a list, a parsed value as its spec."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]  # model.blocks' groups too
    return value.spec() if isinstance(value, Augment) else value


def _unknown_key_error(section: str, key: str) -> ConfigError:
    keys = section_keys(section)
    hint = did_you_mean(key, keys, lambda k: f"'{section}.{k}'")
    return ConfigError(f"config: unknown key '{section}.{key}'{hint}; keys in [{section}]: {', '.join(keys)}")


def _unknown_section_error(section: str) -> ConfigError:
    hint = did_you_mean(section, SECTIONS, lambda s: f"[{s}]")
    return ConfigError(f"config: unknown section [{section}]{hint}; sections: {', '.join(SECTIONS)}")


def _check_table(section: str, values: Any) -> None:
    if not isinstance(values, dict):
        keys = ", ".join(section_keys(section))
        raise ConfigError(f"config: [{section}] must be a table of keys ({keys}), got {_show(values)}")


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build a Config from a nested dict; missing keys take their defaults. Checks keys and parses
    specs (data.augment), nothing else: :func:`validate` checks the values."""
    sections = {}
    for section, values in data.items():
        if section not in SECTIONS:
            raise _unknown_section_error(section)
        _check_table(section, values)
        keys = section_keys(section)
        for key in values:
            if key not in keys:
                raise _unknown_key_error(section, key)
        hints = typing.get_type_hints(_section_class(section))
        sections[section] = _section_class(section)(**{k: _typed(v, hints[k]) for k, v in values.items()})
    return Config(**sections)


def _typed(value: Any, hint: Any) -> Any:
    # Lists become tuples so that the frozen dataclass stays hashable and compares by value; a
    # spec string becomes its parsed value (data.augment), so every Config holds the typed value.
    if isinstance(value, list):
        return tuple(value)
    if hint is Augment and isinstance(value, str):
        return parse_augment(value)
    return value


# ---------------------------------------------------------------------------------------------
# validation


def _show(value: Any) -> str:
    """A value as an error message quotes it: strings in quotes, the rest as TOML spells them."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value) if isinstance(value, str) else spell(value)


def _check_number(dotted: str, value: Any, kind: type, bounds: Range | None) -> int | float:
    """Type- and range-check one int or float; ints are accepted (and converted) for floats."""
    desc = "an integer" if kind is int else "a number"
    rng = bounds.describe() if bounds else ""
    expected = f"expected {desc}{' ' + rng if rng else ''}, got {_show(value)}"
    # bool is a subclass of int: `epochs = true` must not silently mean 1.
    if not (is_int(value) if kind is int else is_number(value)):
        raise ConfigError(f"{dotted}: {expected}")
    if kind is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{dotted}: expected a finite number{' ' + rng if rng else ''}, got {_show(value)}")
    if bounds and not bounds.contains(value):
        raise ConfigError(f"{dotted}: {expected}")
    return value


def _check_value(dotted: str, value: Any, hint: Any, bounds: Range | None) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        accepted = typing.get_args(hint)
        if not isinstance(value, str) or value not in accepted:
            raise ConfigError(f"{dotted}: {_show(value)} is not accepted; accepted: {', '.join(accepted)}")
        return value
    if origin is tuple and len(typing.get_args(hint)) == 2 and typing.get_args(hint)[1] is Ellipsis:
        # a list of names (log.trackers, plugins.modules): each one of the accepted (any name for
        # plain strings), none twice
        item = typing.get_args(hint)[0]
        accepted = typing.get_args(item)
        items = (value,) if isinstance(value, str) else value
        ok = isinstance(items, (list, tuple)) and all(isinstance(v, str) and v.strip() for v in items)
        if not ok or (accepted and not all(v in accepted for v in items)):
            kinds = ", ".join(accepted) if accepted else "non-empty names"
            raise ConfigError(f"{dotted}: {_show(value)} is not accepted; accepted: a list of {kinds}")
        if len(set(items)) != len(items):
            raise ConfigError(f"{dotted}: {_show(value)} names one twice; accepted: each of {', '.join(accepted)} once")
        return tuple(items)
    if origin is tuple:
        args = typing.get_args(hint)
        rng = f" {bounds.describe()}" if bounds else ""
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{dotted}: expected a list of {len(args)} numbers{rng}, got {_show(value)}")
        try:
            return tuple(_check_number(dotted, v, a, bounds) for v, a in zip(value, args))
        except ConfigError:
            raise ConfigError(f"{dotted}: expected a list of {len(args)} numbers{rng}, got {_show(value)}") from None
    if hint is Augment:
        return value if isinstance(value, Augment) else parse_augment(value)
    if hint is BlockSplit:
        return parse_block_split(dotted, value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{dotted}: expected true or false, got {_show(value)}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{dotted}: expected a string, got {_show(value)}")
        return value
    if hint in (int, float):
        return _check_number(dotted, value, hint, bounds)
    raise TypeError(f"{dotted}: no validation rule for annotation {hint!r}")


def _has_control_character(value: str) -> bool:
    return any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value)


def _check_path_component(dotted: str, value: str) -> None:
    # run.name and run.study become directory names under run.out_dir, and names in every table.
    if not value or value in (".", "..") or "/" in value or "\\" in value or _has_control_character(value):
        raise ConfigError(
            f"{dotted}: expected a non-empty name without '/' or control characters (it names a directory), "
            f"got {_show(value)}"
        )


def _check_no_control_characters(config: Config) -> None:
    # The OS refuses a NUL in a path ("embedded null byte" from deep inside a worker), and a newline
    # in one would break every one-line message that names it.
    for dotted, value in (
        ("run.out_dir", config.run.out_dir),
        ("data.root", config.data.root),
        ("model.weights", config.model.weights),
    ):
        if _has_control_character(value):
            raise ConfigError(f"{dotted}: expected no control characters, got {_show(value)}")


def _check_weights(weights: str, check_files: bool) -> None:
    if weights in ("none", "imagenet") or not check_files:
        return
    accepted = "(accepted: none, imagenet, or a path to a weights file)"
    path = Path(weights)
    if not path.exists():
        raise ConfigError(f"model.weights: file {weights!r} does not exist {accepted}")
    if not path.is_file():
        raise ConfigError(f"model.weights: {weights!r} is not a file {accepted}")


def _check_cache(config: Config) -> None:
    if config.freeze.cache != "off" and not config.data.augment.finite:
        raise ConfigError(
            f"freeze.cache = {config.freeze.cache!r} needs inputs that repeat exactly, but data.augment = 'crop-flip' "
            "draws a new view every epoch (a cache would silently freeze it): use data.augment = 'views:V' or 'none'"
        )


def _check_cluster(cluster: ClusterConfig) -> None:
    if cluster.nodes == 1:
        raise ConfigError("cluster.nodes: expected 0 (no cluster) or >= 2 nodes, got 1")
    try:
        parse_rate(cluster.bandwidth)
        parse_delay(cluster.latency)
        parse_subnet(cluster.subnet, max(cluster.nodes, 1))
    except ClusterSpecError as err:
        raise ConfigError(str(err)) from None


def validate(config: Config, check_files: bool = True) -> Config:
    """Check every value of ``config``; return it normalized (ints in float fields become floats).

    ``check_files=False`` skips the existence check of ``model.weights``, for reading a finished
    run directory on a machine that does not have the weights file.
    """
    normalized = {}
    for section in SECTIONS:
        cls = _section_class(section)
        hints = typing.get_type_hints(cls, include_extras=False)
        values = {}
        for f in dataclasses.fields(cls):
            value = getattr(getattr(config, section), f.name)
            values[f.name] = _check_value(f"{section}.{f.name}", value, hints[f.name], f.metadata.get("range"))
        normalized[section] = cls(**values)
    config = Config(**normalized)

    _check_path_component("run.name", config.run.name)
    _check_path_component("run.study", config.run.study)
    if not config.run.out_dir:
        raise ConfigError("run.out_dir: expected a non-empty directory path, got ''")
    _check_no_control_characters(config)
    if config.optim.nesterov and config.optim.name == "sgd" and config.optim.momentum == 0:
        # torch.optim.SGD would refuse this only when the optimizer is built, inside every worker.
        raise ConfigError("optim.nesterov: true requires optim.momentum > 0, got optim.momentum = 0")
    _check_cluster(config.cluster)
    _check_weights(config.model.weights, check_files)
    _check_cache(config)
    if config.train.probe_every_steps and not config.data.val_size:
        raise ConfigError("train.probe_every_steps: the probes read validation images; accepted: data.val_size > 0")
    return config


# ---------------------------------------------------------------------------------------------
# loading, overrides, writing


def _parse_override_value(text: str) -> Any:
    """A TOML value when ``text`` is one (0.05, true, [0.9, 0.95], "x"), else the text itself."""
    try:
        parsed = tomllib.loads(f"value = {text}")
    except tomllib.TOMLDecodeError:
        return text
    # "1\nother = 2" parses too, but is not one value.
    return parsed["value"] if set(parsed) == {"value"} else text


def apply_override(data: dict[str, dict[str, Any]], override: str) -> None:
    """Apply one ``section.key=value`` to a nested dict in place (split at the first '=')."""
    dotted, sep, text = override.partition("=")
    dotted = dotted.strip()
    section, dot, key = dotted.partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"override {override!r}: expected section.key=value, e.g. optim.lr=0.05")
    if section not in SECTIONS:
        raise _unknown_section_error(section)
    if key not in section_keys(section):
        raise _unknown_key_error(section, key)
    value = _parse_override_value(text.strip())
    hint = typing.get_type_hints(_section_class(section))[key]
    if (hint in (str, Augment) or typing.get_origin(hint) is Literal) and not isinstance(value, str):
        # run.name=123 or run.name=true means the name "123"/"true", not a type error.
        value = text.strip()
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[-1] is Ellipsis and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]  # log.trackers=tensorboard,wandb
    data.setdefault(section, {})[key] = value


def apply_value(data: dict[str, dict[str, Any]], dotted: str, value: Any) -> None:
    """Set one ``section.key`` to a typed value (a sweep's grid value, a study's seed) in place:
    no text round trip; validate checks its type and range like any other value."""
    section, _, key = dotted.partition(".")
    if section not in SECTIONS:
        raise _unknown_section_error(section)
    if key not in section_keys(section):
        raise _unknown_key_error(section, key)
    data.setdefault(section, {})[key] = value


def _in_file(err: ConfigError, path: Path) -> ConfigError:
    """The same one line, naming the config file the offending key was read from."""
    return ConfigError(f"config {path}: {str(err).removeprefix('config: ')}")


_LEADING_KEY = re.compile(r"^(?:config: )?'?([a-z_]+\.[a-z_]+)")


def _check_file_keys(data: dict[str, Any]) -> None:
    """Unknown sections and keys of a config file, before overrides mix keys of their own in."""
    for section, values in data.items():
        if section not in SECTIONS:
            raise _unknown_section_error(section)
        _check_table(section, values)
        for key in values:
            if key not in section_keys(section):
                raise _unknown_key_error(section, key)


def load_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    check_files: bool = True,
    values: Mapping[str, Any] | None = None,
) -> Config:
    """Read a TOML file (None: all defaults), apply ``section.key=value`` overrides, then the typed
    ``values`` (``{"section.key": value}``: a sweep's grid point, a study's names), and validate.

    An error about a key the file set names the file ("config experiments/configs/smoke.toml:
    unknown key 'train.epoch' ..."); one about an override's key does not (its caller names where
    the overrides came from: the command line, a sweep or a study file)."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config: file '{path}' does not exist") from None
        except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
            raise ConfigError(f"config: cannot read '{path}' as a UTF-8 text file: {err}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            # The tomllib message ends with "(at line L, column C)".
            raise ConfigError(f"config: '{path}' is not valid TOML: {err}") from None
        try:
            _check_file_keys(data)
        except ConfigError as err:
            raise _in_file(err, path) from None
    from_file = {f"{section}.{key}" for section, values in data.items() for key in values}
    for override in overrides:
        apply_override(data, override)
        from_file.discard(override.partition("=")[0].strip())
    for dotted, value in (values or {}).items():
        apply_value(data, dotted, value)
        from_file.discard(dotted)
    try:
        return validate(config_from_dict(data), check_files=check_files)
    except ConfigError as err:
        key = _LEADING_KEY.match(str(err))
        if path is not None and key and key.group(1) in from_file:
            raise _in_file(err, path) from None  # a value the file set (not one an override replaced)
        raise


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        out = []
        for ch in value:
            if ch in _TOML_ESCAPES:
                out.append(_TOML_ESCAPES[ch])
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, (bool, int, float)):
        # A float's repr is the shortest string that round-trips exactly; inf and nan as TOML spells them.
        return spell(value)
    raise TypeError(f"config_to_toml: cannot write a value of type {type(value).__name__}: {value!r}")


def default_values() -> dict[str, Any]:
    """Every key's default, as ``"section.key" -> value`` in the form config.toml holds it: what a key
    added after a run started resumes at (freeze.pipeline.runs.first_differing_key_of)."""
    return {
        f"{section}.{key}": value
        for section, values in config_to_dict(Config()).items()
        for key, value in values.items()
    }


def config_to_toml(config: Config) -> str:
    """The resolved config as TOML, every key written out; ``load_config`` of it gives it back."""
    lines = ["# Resolved config: every key written out (freeze.pipeline.config.config_to_toml)."]
    for section, values in config_to_dict(config).items():
        lines.append("")
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"
