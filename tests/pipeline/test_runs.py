import json
import logging
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch

import freeze.pipeline.runs as runs
from freeze._atomic import atomic_write_bytes, atomic_write_json, atomic_write_text
from freeze.pipeline.failures import record_failure
from freeze.pipeline.log import ProgressLine, get_logger
from freeze.pipeline.runs import (
    RunDir,
    RunError,
    environment_info,
    load_checkpoint,
    now_iso,
    save_checkpoint,
)

CONFIG_A = '[optim]\nname = "sgd"\nlr = 0.1\n\n[train]\nepochs = 3\n'
CONFIG_B = '[optim]\nname = "sgd"\nlr = 0.05\n\n[train]\nepochs = 3\n'
MANIFEST = {"run_name": "r", "study": "s", "epochs_planned": 3, "epochs_done": 0}


def leftovers(directory):
    """Files an interrupted atomic write would leave behind."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_atomic_writes(tmp_path):
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    atomic_write_text(tmp_path / "t.txt", "héllo\n")
    atomic_write_json(tmp_path / "j.json", {"a": [1, 2.5, None]})
    atomic_write_text(tmp_path / "t.txt", "second")  # replaces
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "second"
    assert json.loads((tmp_path / "j.json").read_text()) == {"a": [1, 2.5, None]}
    assert leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "j.json", "t.txt"]


def test_checkpoint_round_trip(tmp_path):
    path = tmp_path / "checkpoint.pt"
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "epoch": 4, "rng": torch.get_rng_state()}
    save_checkpoint(state, path)
    loaded = load_checkpoint(path)
    assert loaded["epoch"] == 4
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert torch.equal(loaded["rng"], state["rng"])
    assert leftovers(tmp_path) == []


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"epoch": 1}, path)
    before = path.read_bytes()

    def dying_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")  # something is on disk when the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"epoch": 2}, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert load_checkpoint(path) == {"epoch": 1}
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage"])
def test_corrupt_checkpoint_gives_one_line_naming_the_file(tmp_path, damage):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"w": torch.ones(100)}, path)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "empty": b"", "garbage": b"not a checkpoint"}[damage])
    with pytest.raises(RunError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and str(path) in message and "corrupt" in message
    with pytest.raises(RunError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")


def test_create_and_finish(tmp_path):
    run = RunDir(tmp_path / "runs" / "s" / "r")
    assert run.status() == "absent"
    run.create(CONFIG_A, MANIFEST, resume=False)
    assert run.status() == "running"
    assert run.config_path.read_text() == CONFIG_A
    manifest = run.read_manifest()
    assert manifest["run_name"] == "r" and manifest["status"] == "running"
    assert manifest["error"] is None and manifest["end_time"] is None and manifest["start_time"]
    run.update_manifest(epochs_done=2, block_names=["a", "b"])
    assert run.read_manifest()["epochs_done"] == 2
    run.finish("complete")
    manifest = run.read_manifest()
    assert manifest["status"] == "complete" and manifest["end_time"] and manifest["block_names"] == ["a", "b"]
    assert leftovers(run.path) == []


def test_the_cause_of_a_failure_outlives_its_consequence_written_at_the_same_moment(tmp_path):
    """A SIGKILLed worker's node agent records the cause while the surviving rank 0 records "a
    peer's connection was lost": each change of the manifest is a locked compare-and-set, so the
    consequence, checked while the cause is being written, sees "failed" and keeps it (CI once
    ended with the consequence, when both read "running" before either wrote)."""
    run = RunDir(tmp_path / "r")
    run.create(CONFIG_A, MANIFEST, resume=False)
    survivor = threading.Thread(target=record_failure, args=(run.path, "a peer worker's connection was lost"))
    with run._manifest_lock():  # the agent, between reading "running" and writing the cause
        survivor.start()
        survivor.join(timeout=0.5)
        assert survivor.is_alive()  # waits for the lock instead of reading a status about to change
        run._merge_into_manifest({"status": "failed", "error": "node at 10.0.0.2: worker 0 was killed by SIGKILL"})
    survivor.join(timeout=10)
    assert not survivor.is_alive()
    assert run.read_manifest()["error"].endswith("killed by SIGKILL")
    record_failure(run.path, "node at 10.0.0.2: the cause, named later", replace_failed=True)
    assert run.read_manifest()["error"] == "node at 10.0.0.2: the cause, named later"  # the agent's line wins


@pytest.mark.parametrize("resume", [False, True])
def test_complete_run_is_never_recreated(tmp_path, resume):
    run = RunDir(tmp_path / "r")
    run.create(CONFIG_A, MANIFEST, resume=False)
    run.append_metrics({"epoch": 0})
    run.finish("complete")
    before = run.manifest_path.read_bytes()
    with pytest.raises(RunError, match=r"is complete; it is never overwritten: choose another run.name"):
        run.create(CONFIG_A, MANIFEST, resume=resume)
    assert run.manifest_path.read_bytes() == before


@pytest.mark.parametrize("progress", ["metrics", "checkpoint"])
def test_partial_run_needs_resume(tmp_path, progress):
    run = RunDir(tmp_path / "r")
    run.create(CONFIG_A, {**MANIFEST, "start_time": "2020-01-01T00:00:00+00:00"}, resume=False)
    if progress == "metrics":
        run.append_metrics({"epoch": 0})
    else:
        save_checkpoint({"epoch": 0}, run.checkpoint_path)
    run.finish("failed", error="killed\nby a signal")
    assert run.read_manifest()["error"] == "killed by a signal"
    with pytest.raises(RunError, match="--resume"):
        run.create(CONFIG_A, MANIFEST, resume=False)
    run.create(CONFIG_A, {**MANIFEST, "epochs_done": 1}, resume=True)
    manifest = run.read_manifest()
    assert manifest["status"] == "running" and manifest["error"] is None and manifest["epochs_done"] == 1
    assert manifest["start_time"] == "2020-01-01T00:00:00+00:00"  # the run started at its first start


def test_failed_run_without_progress_starts_over(tmp_path):
    run = RunDir(tmp_path / "r")
    run.create(CONFIG_A, MANIFEST, resume=False)
    run.finish("failed", error="out of memory")
    run.create(CONFIG_B, MANIFEST, resume=False)
    assert run.status() == "running" and run.config_path.read_text() == CONFIG_B


def test_resume_with_different_config_names_the_key(tmp_path):
    run = RunDir(tmp_path / "r")
    run.create(CONFIG_A, MANIFEST, resume=False)
    run.append_metrics({"epoch": 0})
    with pytest.raises(RunError) as info:
        run.create(CONFIG_B, MANIFEST, resume=True)
    message = str(info.value)
    assert "optim.lr" in message and "0.1" in message and "0.05" in message
    assert len(message.splitlines()) == 1
    assert run.config_path.read_text() == CONFIG_A  # untouched
    with pytest.raises(RunError, match="train.seed"):
        run.create(CONFIG_A + "seed = 1\n", MANIFEST, resume=True)  # an added key differs too
    # Same data, other formatting: accepted.
    run.create(CONFIG_A.replace("lr = 0.1", "lr   =   0.1"), MANIFEST, resume=True)


def test_half_written_metrics_line_is_dropped_and_repaired(tmp_path):
    run = RunDir(tmp_path / "r")
    run.create(CONFIG_A, MANIFEST, resume=False)
    run.append_metrics({"epoch": 0, "train_loss": 2.5})
    run.append_metrics({"epoch": 1, "train_loss": 1.5})
    with open(run.metrics_path, "ab") as f:
        f.write(b'{"epoch": 2, "train_lo')  # the process died here
    assert [r["epoch"] for r in run.read_metrics()] == [0, 1]
    run.append_metrics({"epoch": 2, "train_loss": 1.0})  # must not glue onto the torn line
    assert [r["epoch"] for r in run.read_metrics()] == [0, 1, 2]
    assert run.metrics_path.read_text().count("\n") == 3
    # A zero-filled tail (what some filesystems leave after a crash) is dropped as well.
    with open(run.metrics_path, "ab") as f:
        f.write(b"\0" * 16 + b"\n")
    assert [r["epoch"] for r in run.read_metrics()] == [0, 1, 2]
    run.append_metrics({"epoch": 3})
    assert [r["epoch"] for r in run.read_metrics()] == [0, 1, 2, 3]
    assert b"\0" not in run.metrics_path.read_bytes()


def test_corrupt_middle_metrics_line_is_an_error(tmp_path):
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    run.metrics_path.write_text('{"epoch": 0}\nnot json\n{"epoch": 2}\n')
    with pytest.raises(RunError, match=r"metrics.jsonl: line 2: not valid JSON"):
        run.read_metrics()


def test_truncate_metrics(tmp_path):
    run = RunDir(tmp_path / "r")
    run.create(CONFIG_A, MANIFEST, resume=False)
    assert run.read_metrics() == []
    for epoch in range(5):
        run.append_metrics({"epoch": epoch, "lr": 0.1 / (epoch + 1)})
    kept = run.truncate_metrics(3)
    assert [r["epoch"] for r in kept] == [0, 1, 2]
    assert run.read_metrics() == kept
    assert kept[2]["lr"] == 0.1 / 3
    assert leftovers(run.path) == []
    run.append_metrics({"epoch": 3})
    assert [r["epoch"] for r in run.read_metrics()] == [0, 1, 2, 3]


def test_environment_info_keys(monkeypatch):
    # git_commit asks git (a process): the two tests below check its value; here only the keys.
    monkeypatch.setattr(runs, "git_commit", lambda: "0" * 40)
    info = environment_info()
    assert set(info) == {"git_commit", "versions", "hardware", "placement"}
    assert set(info["placement"]) == {"host", "cores_allowed", "runs_side_by_side", "slurm"}
    assert set(info["versions"]) == {"python", "torch", "torchvision", "numpy"}
    assert info["versions"]["torch"] == torch.__version__
    assert set(info["hardware"]) == {"cpu", "cores", "gpus", "device"}
    assert isinstance(info["hardware"]["cpu"], str) and info["hardware"]["cpu"]
    assert info["hardware"]["cores"] >= 1
    assert info["hardware"]["device"] in ("cpu", "cuda")
    assert environment_info(device="cpu")["hardware"]["device"] == "cpu"
    json.dumps(info)  # goes into manifest.json as is
    # where it ran, for the report's timing pairs: side by side as the local executor says, the SLURM job
    monkeypatch.setenv(runs.SIDE_BY_SIDE_ENV, "2")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-02]")
    placement = environment_info()["placement"]
    assert placement["runs_side_by_side"] == 2 and placement["slurm"]["job_id"] == "41"
    assert placement["slurm"]["nodelist"] == "gpu[01-02]"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d", now_iso())


@pytest.mark.processes
@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_commit_and_dirty_suffix(tmp_path, monkeypatch):
    def git(*args):
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "f.txt").write_text("1")
    git("add", "f.txt")
    git("commit", "-q", "-m", "first")
    head = git("rev-parse", "HEAD")
    monkeypatch.setattr(runs, "_REPO_DIR", tmp_path)
    assert runs.git_commit() == head
    (tmp_path / "f.txt").write_text("2")
    assert runs.git_commit() == head + "+dirty"
    monkeypatch.setattr(runs, "_REPO_DIR", tmp_path / "not-a-repo")
    assert runs.git_commit() is None


@pytest.mark.processes
@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_commit_of_this_repository_unpatched():
    """The manifest's git_commit is this checkout's HEAD, found from the package's own location (no
    patched path: the layout move had made it null in every manifest while the patched test passed)."""
    repo_root = Path(runs.__file__).resolve().parents[2]
    if not (repo_root / ".git").exists():
        pytest.skip("the package is not in a git checkout (an installed or unpacked copy)")

    def git(*args):
        done = subprocess.run(["git", *args], cwd=repo_root, check=True, capture_output=True, text=True)
        return done.stdout.strip()

    head = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    assert environment_info()["git_commit"] == (head + "+dirty" if dirty else head)


def test_logger_is_rank_aware(tmp_path, capsys):
    log0 = get_logger(0, tmp_path / "rank0.txt")
    log0 = get_logger(0, tmp_path / "rank0.txt")  # reconfiguring must not duplicate lines
    log1 = get_logger(1, tmp_path / "rank1.txt")
    log0.info("hello from zero")
    log0.debug("zero detail")
    log1.info("hello from one")
    log1.warning("one is worried")
    out, err = capsys.readouterr()
    assert out.count("hello from zero") == 1 and "zero detail" not in out
    assert "hello from one" not in out + err
    assert "one is worried" in err and "[rank 1]" in err
    for handler in log0.handlers + log1.handlers:
        handler.flush()
    assert "zero detail" in (tmp_path / "rank0.txt").read_text()
    rank1_file = (tmp_path / "rank1.txt").read_text()
    assert "hello from one" in rank1_file and "one is worried" in rank1_file
    for logger in (log0, log1):
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            handler.close()


def test_progress_line_rate_and_format():
    clock = [0.0]
    logger = logging.getLogger("freeze.test.progress")
    progress = ProgressLine(logger, epoch=2, num_epochs=50, every_s=10.0, clock=lambda: clock[0])
    lines = []
    for step in range(1, 101):
        clock[0] = step * 0.5  # 0.5 s per step
        line = progress.update(step, 100, loss=1.0 if step <= 20 else 3.0, step_s=0.095, data_s=0.001)
        if line:
            lines.append((step, line))
    assert [s for s, _ in lines] == [20, 40, 60, 80, 100]  # every 10 s, and the last step
    step, first = lines[0]
    assert re.fullmatch(
        r"epoch 3/50 \[ 20/100\]  eta 0:00:40  loss 1\.000  step 95\.0 ms  data 1\.0 ms  mem \d+\.\d\d GB", first
    ), first
    assert "loss 3.000" in lines[1][1]  # a mean over the steps since the previous line
    assert "[100/100]  eta 0:00:00" in lines[-1][1]
    quiet = ProgressLine(logger, epoch=0, num_epochs=1, rank=1, every_s=0.0)
    assert quiet.update(1, 1, 1.0, 0.1, 0.0) is None


def test_progress_line_keeps_a_tensor_loss_off_the_host_until_it_prints():
    clock = [0.0]
    progress = ProgressLine(logging.getLogger("freeze.test.progress"), 0, 1, every_s=10.0, clock=lambda: clock[0])
    for step in (1, 2):
        clock[0] = step
        assert progress.update(step, 3, torch.tensor(step, dtype=torch.float32), 0.1, 0.0) is None
    # Still a tensor after two steps: nothing was read back (a .item() per step syncs the device).
    assert isinstance(progress.window_loss, torch.Tensor)
    clock[0] = 3
    line = progress.update(3, 3, torch.tensor(3.0), 0.1, 0.0)
    assert "loss 2.000" in line


def test_a_key_added_after_the_run_started_resumes_at_its_default_and_at_no_other_value(tmp_path):
    """A run started before optim.lr_reference_batch existed resumes under today's config, which holds
    it at its default (0: the LR as given); a resume that changes it is refused as any other change."""
    from freeze.pipeline.config import default_values

    defaults = default_values()
    assert defaults["optim.lr_reference_batch"] == 0
    run = RunDir(tmp_path / "r")
    run.create(CONFIG_A, MANIFEST, resume=False)
    run.append_metrics({"epoch": 0})
    with_new_key = CONFIG_A.replace("[optim]\n", "[optim]\nlr_reference_batch = 0\n")
    assert with_new_key != CONFIG_A
    run.prepare(with_new_key, resume=True, defaults=defaults)
    other = CONFIG_A.replace("[optim]\n", "[optim]\nlr_reference_batch = 256\n")
    (run.path / "config.toml").write_text(CONFIG_A)
    with pytest.raises(RunError, match="optim.lr_reference_batch was None, now 256"):
        run.prepare(other, resume=True, defaults=defaults)


def test_the_manifest_keeps_every_sessions_commit_and_the_epoch_it_continued_from(tmp_path):
    """Reliability probe case 4: a run resumed on other code kept only the last commit, so nothing
    said that its first epochs ran on the earlier one."""
    run = RunDir(tmp_path / "r")
    run.create(CONFIG_A, {**MANIFEST, "git_commit": "aaa", "start_time": "2020-01-01T00:00:00+00:00"}, resume=False)
    run.append_metrics({"epoch": 0})
    run.update_manifest(epochs_done=1)
    run.finish("interrupted", error="Ctrl-C")
    run.create(
        CONFIG_A, {**MANIFEST, "git_commit": "bbb+dirty", "start_time": "2020-01-02T00:00:00+00:00"}, resume=True
    )
    manifest = run.read_manifest()
    assert manifest["git_commit"] == "bbb+dirty"
    assert manifest["sessions"] == [
        {"from_epoch": 0, "git_commit": "aaa", "start_time": "2020-01-01T00:00:00+00:00"},
        {"from_epoch": 1, "git_commit": "bbb+dirty", "start_time": "2020-01-02T00:00:00+00:00"},
    ]


def test_a_manifest_of_an_older_version_gets_its_first_session_from_what_it_kept(tmp_path):
    run = RunDir(tmp_path / "r")
    run.create(CONFIG_A, {**MANIFEST, "git_commit": "aaa", "start_time": "2020-01-01T00:00:00+00:00"}, resume=False)
    run.append_metrics({"epoch": 0})
    old = run.read_manifest()
    del old["sessions"]
    run.manifest_path.write_text(json.dumps({**old, "epochs_done": 2, "status": "interrupted"}))
    run.create(CONFIG_A, {**MANIFEST, "git_commit": "bbb", "start_time": "2020-01-02T00:00:00+00:00"}, resume=True)
    sessions = run.read_manifest()["sessions"]
    assert [(s["from_epoch"], s["git_commit"]) for s in sessions] == [(0, "aaa"), (2, "bbb")]
