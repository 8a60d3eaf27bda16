"""The run directory's contract (freeze.pipeline.schema), in process: the epoch record and the
manifest the training loop writes are what the report's loader accepts, field for field, and a
metrics line with a key missing or a key too many is refused in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freeze.pipeline import prepare, runs, train
from freeze.pipeline.config import Config
from freeze.pipeline.report.load import ReportInputError, load_run
from freeze.pipeline.runs import RunDir
from freeze.pipeline.schema import PHASES, EpochRecord, Manifest, required_fields
from freeze.policies import parse_policy

BLOCKS = [SimpleNamespace(name="stem", param_bytes=400), SimpleNamespace(name="head", param_bytes=120)]


def _epoch_record() -> EpochRecord:
    """Epoch 0 of a two-block run, built by train.epoch_record from what a worker holds after it."""
    freezer = SimpleNamespace(
        counters=SimpleNamespace(steps=12, allreduce_bytes_last_step=480, rewraps=1, rewrap_s_total=0.25),
        boundary=1,
        blocks=BLOCKS,
        history=[SimpleNamespace(epoch=0, summed_grad_norm=[2.0, 1.0], mean_step_grad_norm=[0.2, 0.1])],
        evaluations=[SimpleNamespace(epoch=0, line=lambda: "step 6: stem settled, boundary 0 -> 1")],
        decisions=[SimpleNamespace(epoch=0, step=6, boundary_after=1)],
    )
    t = SimpleNamespace(freezer=freezer, optimizer=SimpleNamespace(param_groups=[{"lr": 0.1}]))
    epoch = train.EpochTraining(
        boundary_at_epoch_start=0,
        frozen_param_fraction=0.4,
        train_loss=1.5,
        train_acc=0.5,
        allreduce_bytes=4800,
        cache=None,
        probes=[[6, 0.5, 0.25]],
    )
    clock = train.PhaseClock(torch.device("cpu"))
    clock.seconds = dict.fromkeys(PHASES, 0.5)
    evaluation = {"val_loss": 1.6, "val_acc": 0.45, "test_loss": 1.7, "test_acc": 0.4}
    return train.epoch_record(t, 0, epoch, evaluation, clock, cumulative_wall_s=2.5)


def _manifest(monkeypatch) -> Manifest:
    """The "running" manifest of that run, built by prepare._manifest (git's answer fixed: no process)."""
    monkeypatch.setattr(runs, "git_commit", lambda: "0123abc")
    ctx = SimpleNamespace(world_size=2, device=torch.device("cpu"))
    split = SimpleNamespace(num_classes=10, test_y=[0] * 50)
    return prepare._manifest(Config(), ctx, BLOCKS, parse_policy("none"), split)


def _write_run(tmp_path: Path, monkeypatch, record: dict) -> Path:
    """A run directory as RunDir writes it: the begun manifest, then the record appended."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.begin(dataclasses.asdict(_manifest(monkeypatch)), resume=False)
    run.append_metrics(record)
    return run.path


def test_the_record_the_training_loop_builds_is_what_the_report_reads(tmp_path, monkeypatch):
    record = _epoch_record()
    written = dataclasses.asdict(record)
    assert list(written) == [f.name for f in dataclasses.fields(EpochRecord)]  # every field, in field order
    loaded = load_run(_write_run(tmp_path, monkeypatch, written))
    row = loaded.metrics.iloc[0]
    assert row["boundary_at_epoch_start"] == 0 and row["boundary"] == 1 and row["step"] == 12
    assert row["val_acc"] == 0.45 and row["test_acc"] == 0.4 and row["phase_eval_s"] == 0.5
    assert row["peak_memory_bytes"] == record.peak_memory_bytes > 0
    assert loaded.probes == ((0.5, 0.25),)  # epoch train s so far, from a run's first epoch
    assert loaded.eta.shape == (1, 2) and np.isnan(loaded.eta).all()  # a first epoch has no change yet
    assert loaded.group == "none" and loaded.world_size == 2 and loaded.block_names == ["stem", "head"]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert list(manifest) == [f.name for f in dataclasses.fields(Manifest)]
    assert set(required_fields(Manifest)) <= set(manifest)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("grad_norm"), "malformed metrics line (missing keys: grad_norm)"),
        (lambda r: r.update(boundary_during=0), "metrics line of an older version (keys boundary_during); convert"),
        # no version wrote it: pointing at convert_runs sent a user round a loop (probe case 24)
        (lambda r: r.update(note="x"), "metrics line with keys no version of freeze writes: note; remove them"),
    ],
    ids=["missing", "older-version", "edited"],
)
def test_a_metrics_line_with_a_key_missing_or_too_many_is_refused_in_one_line(tmp_path, monkeypatch, change, message):
    record = dataclasses.asdict(_epoch_record())
    change(record)
    run_dir = _write_run(tmp_path, monkeypatch, record)
    with pytest.raises(ReportInputError) as refused:
        load_run(run_dir)
    assert f"{run_dir / 'metrics.jsonl'}:1: {message}" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_field_with_a_default_may_be_absent_and_reads_as_nothing_recorded(tmp_path, monkeypatch):
    record = dataclasses.asdict(_epoch_record())
    for name in ("step", "peak_memory_bytes", "probes", "cache"):
        assert name not in required_fields(EpochRecord)
        del record[name]
    loaded = load_run(_write_run(tmp_path, monkeypatch, record))
    assert np.isnan(loaded.metrics["step"].iloc[0]) and np.isnan(loaded.metrics["peak_memory_bytes"].iloc[0])
    assert loaded.probes == ()
