"""python -m experiments.convert_runs: a run directory of an earlier version, converted once, reads and
resumes as a current one (the report and the resume keep no branches for old versions)."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from experiments.convert_runs import convert_config, main
from freeze.pipeline.config import config_to_toml, load_config
from freeze.pipeline.report.load import ReportInputError, load_run
from freeze.pipeline.runs import RunDir

FIXTURE_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "runs" / "fixture_study" / "autofreeze-s0"
TORN_TAIL = b'{"epoch":3,"st'


def _old_run(tmp_path: Path) -> Path:
    """The fixture's run as an earlier version wrote it: boundary_during, data.augment = true, no
    run.keep_checkpoint (in config.toml and in the manifest's config), a torn last line; interrupted."""
    run_dir = tmp_path / "runs" / "old"
    shutil.copytree(FIXTURE_RUN, run_dir)
    metrics = run_dir / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    old_lines = [{("boundary_during" if k == "boundary_at_epoch_start" else k): v for k, v in r.items()} for r in lines]
    metrics.write_bytes("".join(json.dumps(r) + "\n" for r in old_lines).encode() + TORN_TAIL)
    # every key written out, as a run writes its config.toml, then as that version wrote it
    text = config_to_toml(load_config(run_dir / "config.toml", check_files=False))
    old_text = text.replace('augment = "crop-flip"\n', "augment = true\n").replace("keep_checkpoint = false\n", "")
    assert old_text.count("\n") == text.count("\n") - 1 and "augment = true" in old_text
    (run_dir / "config.toml").write_text(old_text)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest.update(status="interrupted", config=tomllib.loads(old_text))
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return run_dir


def test_an_old_run_directory_converts_once_and_then_reads_and_resumes_as_a_current_one(tmp_path, capsys):
    run_dir = _old_run(tmp_path)
    with pytest.raises(
        ReportInputError, match=r"metrics.jsonl:1: metrics line of an older version \(keys boundary_during\); convert"
    ):
        load_run(run_dir)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    assert main([str(tmp_path / "runs"), "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"would convert {run_dir}: metrics.jsonl, config.toml, manifest.json",
        "convert_runs: would convert 1 run(s); 0 already current",
    ]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before  # a dry run takes no lock either

    assert main([str(tmp_path / "runs")]) == 0
    assert "convert_runs: converted 1 run(s); 0 already current" in capsys.readouterr().out
    # the report reads it as the same run written by the current version
    converted, current = load_run(run_dir), load_run(FIXTURE_RUN)
    assert converted.metrics["boundary_at_epoch_start"].tolist() == [0.0, 1.0, 2.0]
    assert converted.metrics.equals(current.metrics)
    assert (run_dir / "metrics.jsonl").read_bytes().endswith(b"}\n" + TORN_TAIL)  # the torn line stays as it was
    # the current version loads its config and resumes it with that config
    config = load_config(run_dir / "config.toml", check_files=False)
    assert (config.data.augment.spec(), config.run.keep_checkpoint) == ("crop-flip", False)
    started = json.loads((run_dir / "manifest.json").read_text())["config"]
    assert (started["data"]["augment"], started["run"]["keep_checkpoint"]) == ("crop-flip", False)
    assert RunDir(run_dir).prepare(config_to_toml(config), resume=True) == "interrupted"

    assert main([str(tmp_path / "runs")]) == 0  # again: nothing left to convert
    assert capsys.readouterr().out.strip() == "convert_runs: converted 0 run(s); 1 already current"


def test_the_boolean_augment_becomes_its_name_and_keep_checkpoint_its_default():
    assert convert_config({"data": {"augment": True}}) == {
        "data": {"augment": "crop-flip"},
        "run": {"keep_checkpoint": False},
    }
    assert convert_config({"data": {"augment": False}, "run": {"keep_checkpoint": True}}) == {
        "data": {"augment": "none"},
        "run": {"keep_checkpoint": True},
    }


def test_a_folder_that_is_not_there_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'} is not a directory"


def test_a_file_that_is_not_utf8_is_one_line_and_nothing_changes(tmp_path, capsys):
    """Reliability.md case 21: a 26-line UnicodeDecodeError traceback."""
    run_dir = _old_run(tmp_path)
    (run_dir / "config.toml").write_bytes(b"\xff" + (run_dir / "config.toml").read_bytes())
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    assert main([str(tmp_path / "runs")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "config.toml: not UTF-8" in err and "left as it is" in err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.name in before} == before
