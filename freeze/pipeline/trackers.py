"""Experiment trackers: rank 0 sends each epoch's record to TensorBoard, Weights & Biases or MLflow.

One seam: a run's :class:`~freeze.pipeline.schema.EpochRecord` goes to metrics.jsonl (the record the
report reads) and then to every tracker ``log.trackers`` names, as scalars at the run's optimizer
step. Each tracker is an optional package, checked before any run starts (``preflight``: one line
naming the package to install). A tracker that fails while the run trains is dropped with one
warning, and the run goes on: a dashboard is never worth a lost run.

Runs are grouped the way a study is read: W&B's group and MLflow's tags carry the study, the arm
(the run's group), the setting and the seed, so a sweep's runs line up by arm. ``python -m
experiments.tensorboard runs/<study>`` writes TensorBoard files for run directories after the fact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import logging
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from freeze.pipeline.config import TRACKER_NAMES, Config, ConfigError, config_to_dict
from freeze.pipeline.schema import EpochRecord

# The package each tracker imports, and what to install for it.
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
TENSORBOARD_DIR = "tensorboard"  # inside the run directory

_log = logging.getLogger("freeze")


class EpochSink(Protocol):
    """Where an epoch's scalars go; ``close`` once when the run ends (or stops)."""

    def write(self, scalars: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def check_trackers(names: Iterable[str]) -> None:
    """ConfigError (one line) for a tracker whose package is not installed: refused before any run
    starts, not when the first epoch ends."""
    for name in names:
        if name not in TRACKER_NAMES:
            raise ConfigError(f"log.trackers: {name!r} is not accepted; accepted: {', '.join(TRACKER_NAMES)}")
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError(
                f"log.trackers: {name} needs the package {PACKAGES[name]}, which is not installed; "
                f"accepted: pip install {PACKAGES[name]}, or leave {name} out of log.trackers"
            )


def epoch_scalars(record: EpochRecord, block_names: list[str]) -> dict[str, float]:
    """The record's numbers by tracker name: losses and accuracies, the boundary and frozen share,
    bytes on the wire per step, times, the LR, and each block's gradient-norm change (the signal
    the gradient policies read); a value the epoch did not measure is left out."""
    values: dict[str, Any] = {
        "train/loss": record.train_loss,
        "train/acc": record.train_acc,
        "val/loss": record.val_loss,
        "val/acc": record.val_acc,
        "test/loss": record.test_loss,
        "test/acc": record.test_acc,
        "freeze/boundary": record.boundary,
        "freeze/frozen_param_fraction": record.frozen_param_fraction,
        "comm/allreduce_bytes_per_step": record.allreduce_bytes_per_step,
        "time/epoch_s": record.epoch_wall_s,
        "time/cumulative_s": record.cumulative_wall_s,
        "optim/lr": record.lr,
    }
    eta = record.grad_norm.get("eta") if isinstance(record.grad_norm, dict) else None
    for name, value in zip(block_names, eta or []):
        values[f"signal/eta/{name}"] = value
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def record_step(record: EpochRecord) -> int:
    """Where an epoch's scalars go on a tracker's axis: the run's optimizer step (its epoch in run
    directories older than the step count)."""
    return record.step if record.step is not None else record.epoch


_RECORD_KEYS = frozenset(f.name for f in dataclasses.fields(EpochRecord))


def record_of_line(line: Mapping[str, Any]) -> EpochRecord:
    """A metrics.jsonl line as an EpochRecord (keys an older run wrote and the record lost are left out)."""
    return EpochRecord(**{k: v for k, v in line.items() if k in _RECORD_KEYS})


def run_tags(config: Config) -> dict[str, str]:
    """What groups a run with its study's others: study, arm (the run's group), setting, seed, policy."""
    return {
        "study": config.run.study,
        "arm": config.run_group(),
        "setting": config.run.setting or "-",
        "seed": str(config.run.seed),
        "policy": config.freeze.policy,
    }


class TensorBoardSink:
    """Event files in ``<run dir>/tensorboard`` (point ``tensorboard --logdir runs/<study>`` at them)."""

    def __init__(self, config: Config, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))
        self.writer.add_text("run", ", ".join(f"{k}={v}" for k, v in run_tags(config).items()))

    def write(self, scalars: Mapping[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per run directory, resumed with it (its id derives from the run directory), in
    ``log.project``, grouped by study/arm; ``WANDB_MODE=offline`` keeps it on disk."""

    def __init__(self, config: Config, run_dir: Path):
        wandb = importlib.import_module("wandb")
        tags = run_tags(config)
        self.run = wandb.init(
            project=config.log.project,
            name=config.run.name,
            group=f"{tags['study']}/{tags['arm']}",
            job_type=tags["setting"],
            tags=[f"{k}={v}" for k, v in tags.items()],
            config=config_to_dict(config),
            dir=str(run_dir),
            id=_stable_id(run_dir),
            resume="allow",
            reinit="create_new",
        )

    def write(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowSink:
    """One MLflow run per run directory, in the experiment ``log.project``, with the config as params
    and the study/arm/setting/seed as tags; a file store ``mlruns/`` beside the study's runs unless
    ``log.mlflow_uri`` names a server."""

    def __init__(self, config: Config, run_dir: Path):
        mlflow = importlib.import_module("mlflow")
        uri = config.log.mlflow_uri
        if not uri:
            # MLflow 3 keeps its file store working but "in maintenance mode", refused unless allowed: the
            # default here needs no database package (mlflow-skinny has none); log.mlflow_uri names another
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir.parent.parent / "mlruns").as_uri()
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(config.log.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(config.log.project)
        self.run_id = self.client.create_run(experiment_id, run_name=config.run.name, tags=run_tags(config)).info.run_id
        params = {
            f"{section}.{key}": str(value)
            for section, values in config_to_dict(config).items()
            for key, value in values.items()
        }
        for key, value in params.items():
            self.client.log_param(self.run_id, key, value[:500])

    def write(self, scalars: Mapping[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.client.log_metric(self.run_id, name, value, step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MLflowSink}


class Trackers:
    """The run's trackers on rank 0 (none elsewhere); a tracker that fails is dropped, warned once."""

    def __init__(self, sinks: dict[str, EpochSink], block_names: list[str]):
        self.sinks = sinks
        self.block_names = block_names

    @classmethod
    def open(cls, config: Config, run_dir: Path, block_names: list[str], is_main: bool) -> Trackers:
        sinks: dict[str, EpochSink] = {}
        for name in config.log.trackers if is_main else ():
            try:
                sinks[name] = _SINKS[name](config, run_dir)
            except Exception as e:  # a tracker that cannot start costs its dashboard, not the run
                _warn(name, "start", e)
        return cls(sinks, block_names)

    def write(self, record: EpochRecord) -> None:
        if not self.sinks:
            return
        scalars = epoch_scalars(record, self.block_names)
        for name, sink in list(self.sinks.items()):
            try:
                sink.write(scalars, record_step(record))
            except Exception as e:
                _warn(name, "write", e)
                del self.sinks[name]

    def close(self) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                sink.close()
            except Exception as e:
                _warn(name, "close", e)
        self.sinks = {}


def _warn(name: str, what: str, error: Exception) -> None:
    _log.warning(
        "log.trackers: %s failed to %s (%s: %s); the run goes on without it", name, what, type(error).__name__, error
    )


def _stable_id(run_dir: Path) -> str:
    """A W&B run id from the run directory's path: a resumed run logs into the same W&B run."""
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]


def write_tensorboard(run_dirs: Iterable[Path]) -> int:
    """TensorBoard event files for existing run directories, from their metrics.jsonl (what the run
    logged, epoch by epoch); returns how many runs were written."""
    from freeze.pipeline.config import load_config
    from freeze.pipeline.runs import RunDir

    count = 0
    for run_dir in run_dirs:
        run = RunDir(run_dir)
        config = load_config(run.config_path, check_files=False)
        block_names = list(run.read_manifest().get("block_names") or [])
        sink = TensorBoardSink(config, run_dir)
        try:
            for line in run.epoch_records():
                record = record_of_line(line)
                sink.write(epoch_scalars(record, block_names), record_step(record))
        finally:
            sink.close()
        count += 1
    return count
