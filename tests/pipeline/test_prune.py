"""python -m experiments.prune: complete runs keep their final weights, not their resume checkpoint."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from freeze.pipeline.models import load_weights
from freeze.pipeline.prune import main
from tests.processes import start_python

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "runs" / "fixture_study"


def _study(tmp_path: Path) -> Path:
    """The report fixture's runs (complete, and one failed), each with a checkpoint of a tiny model."""
    runs = tmp_path / "runs"
    shutil.copytree(FIXTURE, runs / "fixture_study")
    for run_dir in (runs / "fixture_study").iterdir():
        model = torch.nn.Linear(4, 2)
        state = {"model": model.state_dict(), "optimizer": {"state": {}, "pad": torch.zeros(4096)}, "epoch": 3}
        torch.save(state, run_dir / "checkpoint.pt")
    return runs


def test_complete_runs_trade_their_checkpoint_for_their_final_weights(tmp_path, capsys):
    runs = _study(tmp_path)
    before = {p.parent.name: torch.load(p, weights_only=True)["model"] for p in runs.rglob("checkpoint.pt")}
    report_files = {p: p.read_bytes() for p in runs.rglob("*") if p.name in ("metrics.jsonl", "manifest.json")}
    assert main([str(runs), "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out and len(list(runs.rglob("checkpoint.pt"))) == 6
    assert main([str(runs)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("prune: removed 0 MB of checkpoint.pt in 5 complete run(s), kept their final weights in")
    assert out.endswith("1 left as they are (not complete, or pruned before)")
    failed = runs / "fixture_study" / "autofreeze-s2"
    assert json.loads((failed / "manifest.json").read_text())["status"] == "failed"
    assert (failed / "checkpoint.pt").is_file() and not (failed / "model.pt").exists()  # it may still resume
    for run_dir in (runs / "fixture_study").iterdir():
        if run_dir != failed:
            assert not (run_dir / "checkpoint.pt").exists()
            weights = torch.load(run_dir / "model.pt", weights_only=True)
            assert all(torch.equal(weights[k], before[run_dir.name][k]) for k in weights)
            assert load_weights(torch.nn.Linear(4, 2), run_dir / "model.pt") == []  # usable as model.weights
    assert all(p.read_bytes() == data for p, data in report_files.items())  # what the report reads is untouched
    assert main([str(runs)]) == 0  # again: nothing left to do
    assert "removed 0 MB of checkpoint.pt in 0 complete run(s)" in capsys.readouterr().out


def test_a_folder_that_is_not_there_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'} is not a directory"


@pytest.mark.processes
def test_temp_files_of_killed_writers_go_except_in_a_run_another_process_writes(tmp_path, capsys):
    """A writer killed mid-save leaves .checkpoint.pt.XXXXXXXX.tmp (78 MB in the probe); prune kept it."""
    import subprocess

    runs = _study(tmp_path)
    study = runs / "fixture_study"
    failed, busy = study / "autofreeze-s2", study / "none-s0"  # a run that may still resume; one being written
    holder = start_python(
        ["-c", f"from freeze.pipeline.run_lock import RunLock; RunLock.acquire({str(busy)!r}); "
         "print('locked', flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        for run_dir in (failed, busy):  # the busy run's is its writer's save in progress
            (run_dir / ".checkpoint.pt.abcd1234.tmp").write_bytes(b"\0" * 2_000_000)
        assert main([str(runs), "--dry-run"]) == 0
        assert "would remove 4 MB of temp files that killed writers left in 2 run(s)" in capsys.readouterr().out
        assert main([str(runs)]) == 0
    finally:
        holder.kill()
        holder.wait(timeout=30)
    out = capsys.readouterr().out
    assert "removed 2 MB of temp files that killed writers left in 1 run(s)" in out, out
    assert "1 busy (another process writes them)" in out
    assert not (failed / ".checkpoint.pt.abcd1234.tmp").exists() and (failed / "checkpoint.pt").is_file()
    assert (busy / ".checkpoint.pt.abcd1234.tmp").exists() and (busy / "checkpoint.pt").is_file()
