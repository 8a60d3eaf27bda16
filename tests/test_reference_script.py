"""A torchvision-reference-style script with the Freezer wired in (tests/reference_style_train.py,
as docs/library.md, "Freezing in your own training script", shows) runs under torchrun with 2
ranks: bytes per step equal the trainable bytes, the boundary moves, an EMA deepcopy is not
steered, a launch resumed from an epoch checkpoint ends bit-identical to an
uninterrupted one."""

import json
from pathlib import Path

import pytest

from freeze.testing import local_torchrun_command
from tests.processes import REPO, run_command

pytestmark = pytest.mark.processes

SCRIPT = REPO / "tests" / "reference_style_train.py"
EPOCHS = 4


def _torchrun(tmp_path: Path, name: str, *script_args: str) -> list[list[dict]]:
    """One launch with 2 local ranks; returns each rank's JSON lines."""
    out_dir = tmp_path / name
    out_dir.mkdir()
    cmd = local_torchrun_command(
        SCRIPT, out_dir / "logs", "--epochs", str(EPOCHS), "--output-dir", str(out_dir), *script_args
    )  # one stdout file per rank
    # the timeout is the parent's deadline: subprocess.run kills the launcher, whose ranks then stop
    proc = run_command(cmd, cwd=out_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = sorted((out_dir / "logs").glob("**/stdout.log"))
    assert len(logs) == 2
    return [[json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")] for log in logs]


def test_reference_style_script_trains_checkpoints_and_resumes_under_torchrun(tmp_path):
    full = _torchrun(tmp_path, "full")
    # as a job killed after epoch 1 would: a new launch from the checkpoint that epoch left
    resumed = _torchrun(tmp_path, "resumed", "--resume", str(tmp_path / "full" / "model_1.pth"))

    for rank_lines in full:
        epochs = rank_lines[:-1]
        assert [e["epoch"] for e in epochs] == list(range(EPOCHS))
        assert all(e["bytes_per_step"] == e["trainable_bytes_during_epoch"] > 0 for e in epochs)
        assert epochs[-1]["boundary"] > 0  # linear freezes blocks before the run ends
        assert len({e["trainable_bytes_during_epoch"] for e in epochs}) > 1  # fewer bytes once frozen
        assert all(e["ema_all_trainable"] for e in epochs)  # the deepcopy is not frozen with the model
    assert full[0][-1]["checksum"] == full[1][-1]["checksum"]  # ranks identical

    for rank_lines in resumed:
        assert [e["epoch"] for e in rank_lines[:-1]] == [2, 3]
    assert [e["boundary"] for e in resumed[0][:-1]] == [e["boundary"] for e in full[0][2:-1]]
    assert resumed[0][-1]["checksum"] == full[0][-1]["checksum"]  # resume is exact
