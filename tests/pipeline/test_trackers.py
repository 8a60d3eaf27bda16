"""Experiment trackers (freeze.pipeline.trackers): the one seam an epoch record goes through to
TensorBoard, W&B and MLflow, tested with the real packages in their offline modes, a missing
package refused in one line before any run, and a tracker that fails never losing the run."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from freeze.pipeline.config import ConfigError, load_config
from freeze.pipeline.schema import EpochRecord
from freeze.pipeline.trackers import TENSORBOARD_DIR, Trackers, check_trackers, epoch_scalars, record_of_line, run_tags
from tests.processes import REPO, run_python

SMOKE = REPO / "experiments" / "configs" / "smoke.toml"
FIXTURE_RUN = REPO / "tests" / "fixtures" / "runs" / "fixture_study" / "autofreeze-s0"


def record(epoch: int = 0, **changes) -> EpochRecord:
    line = json.loads((FIXTURE_RUN / "metrics.jsonl").read_text().splitlines()[epoch])
    return dataclasses.replace(record_of_line(line), **changes)


def config(*overrides: str):
    return load_config(SMOKE, list(overrides), check_files=False)


def test_trackers_are_named_in_the_config_and_checked_there():
    assert config("log.trackers=tensorboard,mlflow").log.trackers == ("tensorboard", "mlflow")
    assert config().log.trackers == ()
    with pytest.raises(
        ConfigError, match=r"^log.trackers: .*'neptune'.* accepted: a list of tensorboard, wandb, mlflow"
    ):
        config("log.trackers=neptune")
    with pytest.raises(ConfigError, match="names one twice"):
        config("log.trackers=wandb,wandb")


def test_a_tracker_whose_package_is_missing_is_refused_in_one_line_before_any_run(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        check_trackers(["wandb"])
    assert str(err.value) == (
        "log.trackers: wandb needs the package wandb, which is not installed; accepted: pip install wandb, or leave "
        "wandb out of log.trackers"
    )
    from freeze.pipeline.preflight import preflight

    with pytest.raises(ConfigError, match="log.trackers: wandb needs the package wandb"):
        preflight(config("log.trackers=wandb"))


def test_an_epoch_is_scalars_at_its_step_and_a_run_is_tagged_by_study_arm_setting_and_seed():
    epoch = record(1)
    scalars = epoch_scalars(epoch, ["stem", "block1", "head"])
    assert scalars["train/loss"] == epoch.train_loss and scalars["freeze/boundary"] == epoch.boundary
    assert scalars["comm/allreduce_bytes_per_step"] == epoch.allreduce_bytes_per_step
    assert all(isinstance(v, float) for v in scalars.values())
    assert "test/acc" not in epoch_scalars(dataclasses.replace(epoch, test_acc=None), [])  # not measured: left out
    cfg = config("run.study=s", "run.group=arm", "run.seed=3", "run.setting=loopback")
    assert run_tags(cfg) == {
        "study": "s",
        "arm": "arm",
        "setting": "loopback",
        "seed": "3",
        "policy": cfg.freeze.policy,
    }


class Broken:
    def __init__(self):
        self.closed = False

    def write(self, scalars, step):
        raise OSError("disk full")

    def close(self):
        self.closed = True


class Kept:
    def __init__(self):
        self.seen = []

    def write(self, scalars, step):
        self.seen.append((step, scalars["train/loss"]))

    def close(self):
        pass


def test_a_tracker_that_fails_is_dropped_with_one_warning_and_the_others_go_on(caplog):
    broken, kept = Broken(), Kept()
    trackers = Trackers({"wandb": broken, "tensorboard": kept}, [])
    trackers.write(record(0))
    trackers.write(record(1))
    assert [s for s, _ in kept.seen] == [record(0).step, record(1).step]
    assert list(trackers.sinks) == ["tensorboard"]
    warnings = [r.getMessage() for r in caplog.records if "log.trackers" in r.getMessage()]
    assert warnings == ["log.trackers: wandb failed to write (OSError: disk full); the run goes on without it"]


def test_tensorboard_event_files_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = Trackers.open(config("log.trackers=tensorboard"), tmp_path, ["stem", "block1", "head"], is_main=True)
    for epoch in range(3):
        trackers.write(record(epoch))
    trackers.close()
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    events.Reload()
    losses = [(e.step, round(e.value, 6)) for e in events.Scalars("train/loss")]
    assert losses == [(record(e).step, round(record(e).train_loss, 6)) for e in range(3)]
    assert "freeze/boundary" in events.Tags()["scalars"]
    # only rank 0 writes
    assert Trackers.open(config("log.trackers=tensorboard"), tmp_path / "r1", [], is_main=False).sinks == {}


@pytest.mark.processes
def test_mlflow_file_store_reads_back(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    run_dir = tmp_path / "runs" / "s" / "r"
    run_dir.mkdir(parents=True)
    cfg = config("log.trackers=mlflow", "run.study=s", "run.name=r", "log.project=ablation")
    trackers = Trackers.open(cfg, run_dir, [], is_main=True)
    for epoch in range(3):
        trackers.write(record(epoch))
    trackers.close()
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "runs" / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("ablation")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags["study"] == "s" and run.data.params["optim.lr"] == str(cfg.optim.lr)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, round(m.value, 6)) for m in history] == [
        (record(e).step, round(record(e).train_loss, 6)) for e in range(3)
    ]


@pytest.mark.processes
def test_wandb_offline_writes_its_run_into_the_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = Trackers.open(config("log.trackers=wandb", "run.name=r"), tmp_path, [], is_main=True)
    assert list(trackers.sinks) == ["wandb"], "wandb did not start"
    for epoch in range(2):
        trackers.write(record(epoch))
    trackers.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")) and (runs[0] / "files").is_dir()


@pytest.mark.processes
def test_a_run_writes_tensorboard_while_it_trains_and_the_command_writes_it_after_the_fact(tmp_path):
    pytest.importorskip("tensorboard")
    args = [
        "-m",
        "freeze.pipeline.run",
        "--config",
        str(SMOKE),
        f"run.out_dir={tmp_path / 'runs'}",
        f"data.root={tmp_path / 'data'}",
        "train.epochs=2",
        "data.train_size=256",
        "train.batch_size=32",
        "log.trackers=tensorboard",
    ]
    proc = run_python(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next((tmp_path / "runs").glob("*/*/manifest.json")).parent
    assert list((run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    # after the fact, from metrics.jsonl alone
    copied = tmp_path / "old" / "run"
    shutil.copytree(FIXTURE_RUN, copied)
    proc = run_python(["-m", "experiments.to_tensorboard", str(tmp_path / "old")])
    assert proc.returncode == 0 and "wrote 1 run(s)" in proc.stdout, proc.stderr
    assert list((copied / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_python(["-m", "experiments.to_tensorboard", str(empty)])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
