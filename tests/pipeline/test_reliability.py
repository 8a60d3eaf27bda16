"""Reliability of the pipeline (issue 10): a file never runs code, one writer per run directory,
no worker outlives its launcher, and user errors are one line.

The malicious files carry a payload that would create a marker file when unpickled; each test
shows the load refused in one line and no marker."""

import contextlib
import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from freeze.pipeline.data import DataError, read_cifar10, write_synthetic_cifar
from freeze.pipeline.models import ModelError, build_model, load_weights
from freeze.pipeline.runs import RunError, load_checkpoint
from tests.processes import run_python, start_python


class _Payload:
    """Unpickling this calls os.system("touch <marker>"): what a crafted file would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "PWNED"
    # The payload works when loaded the old way: the tests below would see the marker.
    with open(tmp_path / "probe.pkl", "wb") as f:
        pickle.dump(_Payload(path), f)
    with open(tmp_path / "probe.pkl", "rb") as f:
        pickle.load(f)
    assert path.exists()
    path.unlink()
    return path


# ----------------------------------------------------------------------------- a file never runs code
def test_crafted_checkpoint_is_refused_on_resume(tmp_path, marker):
    path = tmp_path / "checkpoint.pt"
    torch.save({"epoch": 1, "model": {}, "rng": _Payload(marker)}, path)
    with pytest.raises(RunError) as err:
        load_checkpoint(path)
    message = _one_line(err)
    assert str(path) in message and "posix.system" in message and "refused" in message
    assert not marker.exists()


def test_crafted_weights_file_is_refused_without_a_full_unpickle(tmp_path, marker):
    path = tmp_path / "weights.pt"
    torch.save({"conv1.weight": torch.zeros(1), "x": _Payload(marker)}, path)
    with pytest.raises(ModelError) as err:
        load_weights(build_model("resnet18", num_classes=10), path)
    message = _one_line(err)
    assert message.startswith("model.weights:") and "posix.system" in message
    assert not marker.exists()


@pytest.mark.parametrize("synthetic", [True, False], ids=["generated", "official"])
def test_crafted_cifar_batch_is_refused_even_beside_a_synthetic_marker(tmp_path, marker, synthetic):
    write_synthetic_cifar(tmp_path / "data", "source", 20, 10, seed=0)
    folder = tmp_path / "data" / "cifar-10-batches-py"
    assert (folder / "SYNTHETIC.json").is_file()  # it once switched the md5 check off
    with open(folder / "data_batch_1", "wb") as f:
        pickle.dump({b"data": _Payload(marker), b"labels": [0]}, f)
    with pytest.raises(DataError) as err:
        read_cifar10(tmp_path / "data", synthetic=synthetic)
    message = _one_line(err)
    # generated data: the unpickler refuses the global; official data: the md5 check comes first
    expected = "global posix.system" if synthetic else "fails the official md5 checksum"
    assert "data_batch_1" in message and expected in message
    assert not marker.exists()


def test_our_own_checkpoint_loads_weights_only(tmp_path):
    from freeze.pipeline.prepare import _rng_state, _set_rng_state

    path = tmp_path / "c.pt"
    torch.save({"rng": _rng_state()}, path)
    import numpy as np

    expected = np.random.rand()
    _set_rng_state(torch.load(path, weights_only=True)["rng"])
    assert np.random.rand() == expected  # numpy's RNG survives the tensor form exactly


# ----------------------------------------------------------------------------- one writer per run
def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    import socket

    from freeze.pipeline.run_lock import RunBusyError, RunLock

    with RunLock.acquire(tmp_path / "run"), pytest.raises(RunBusyError) as err:
        RunLock.acquire(tmp_path / "run")
    message = _one_line(err)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    RunLock.acquire(tmp_path / "run").release()  # released: the next writer gets it


def _hold_lock(run_dir: Path) -> subprocess.Popen:
    code = (
        "import sys, time\n"
        "from freeze.pipeline.run_lock import RunLock\n"
        f"lock = RunLock.acquire({str(run_dir)!r})\n"
        "print('locked', flush=True)\n"
        "time.sleep(120)\n"
    )
    holder = start_python(["-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.processes
def test_a_killed_holder_leaves_no_stale_lock_and_its_temp_files_go(tmp_path):
    from freeze.pipeline.run_lock import RunBusyError, RunLock

    run_dir = tmp_path / "run"
    holder = _hold_lock(run_dir)
    try:
        with pytest.raises(RunBusyError, match=f"pid {holder.pid} on host"):
            RunLock.acquire(run_dir)
        (run_dir / ".checkpoint.pt.abcd1234.tmp").write_bytes(b"\0" * 100)  # a write it never finished
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with RunLock.acquire(run_dir):  # the kernel dropped the dead holder's flock
        assert not (run_dir / ".checkpoint.pt.abcd1234.tmp").exists()


def test_a_restarted_worker_removes_the_temp_file_its_killed_predecessor_left(tmp_path, monkeypatch):
    """Under --max-restarts rank 0 works under its launcher's lock (delegated): the launcher cleaned
    up when it took the lock, before any worker ran, so a temp file of a worker killed mid-save
    (78 MB in the probe) stayed in the run after it completed."""
    from freeze.pipeline.run_lock import TOKEN_ENV, RunLock

    run_dir = tmp_path / "run"
    with RunLock.acquire(run_dir) as launcher:
        stale = run_dir / ".checkpoint.pt.abcd1234.tmp"
        stale.write_bytes(b"\0" * 100)  # the first worker's save, cut short by SIGKILL
        monkeypatch.setenv(TOKEN_ENV, launcher.token)
        restarted = RunLock.for_worker(run_dir)
        assert restarted.delegated and not stale.exists()
        assert (run_dir / ".lock").is_file()  # the lock file itself is never a temp file


@pytest.mark.processes
def test_resume_is_refused_while_another_process_writes_the_run(tmp_path, capsys):
    import freeze.pipeline.run as run_module

    overrides = [f"run.out_dir={tmp_path / 'runs'}", "run.name=r", "dist.nproc=1"]
    holder = _hold_lock(tmp_path / "runs" / "smoke" / "r")
    try:
        assert run_module.main(["--config", str(SMOKE), "--resume", *overrides]) == 2
    finally:
        holder.kill()
        holder.wait(timeout=30)
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"pid {holder.pid}" in err and "one writer per run" in err


# ------------------------------------------------------------------------------------- no orphans
SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "configs" / "smoke.toml"


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("launcher", ["run", "sweep"])
def test_workers_die_with_a_sigkilled_launcher(tmp_path, launcher):
    """experiments.run with dist.nproc=2 (torchrun's agent in the launcher, 2 workers) and a sweep
    (its single-process run is a subprocess): SIGKILL the launcher, the workers are gone."""
    overrides = [
        f"run.out_dir={tmp_path / 'runs'}",
        f"data.root={tmp_path / 'data'}",
        "train.epochs=100",  # still training when it is killed
        "dist.timeout_s=60",
    ]
    if launcher == "run":
        cmd = ["-m", "freeze.pipeline.run", "--config", str(SMOKE), "dist.nproc=2", *overrides]
        n_workers = 2
    else:
        sweep = tmp_path / "sweep.toml"
        listed = ", ".join(f'"{o}"' for o in [*overrides, "dist.nproc=1"])
        sweep.write_text(f'[sweep]\nbase = "{SMOKE}"\nstudy = "s"\noverrides = [{listed}]\n')
        cmd = ["-m", "freeze.pipeline.sweep", "--sweep", str(sweep), "--out-dir", str(tmp_path / "runs")]
        n_workers = 1
    launcher_proc = start_python(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    workers: list[int] = []
    try:

        def started() -> list[int]:
            found = _children(launcher_proc.pid)
            return found if len(found) >= n_workers else []

        workers = _wait_for(started, 120, f"{n_workers} workers")
        launcher_proc.kill()
        launcher_proc.wait(timeout=30)
        _wait_for(lambda: not any(_alive(p) for p in workers), 10, "the workers to die with their launcher")
    finally:
        launcher_proc.kill()
        for pid in workers:  # never leave a stray process, even when the test fails
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------ every user error: one line, exit 2
@pytest.mark.parametrize(
    "override, key",
    [
        ("train.precision=fp16", "train.precision"),
        ("dist.device=cuda", "dist.device"),
        ("dist.backend=nccl", "dist.backend"),
    ],
)
def test_hardware_the_machine_lacks_is_refused_before_anything_starts(tmp_path, capsys, override, key):
    import freeze.pipeline.run as run_module

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the request is accepted")
    argv = ["--config", str(SMOKE), f"run.out_dir={tmp_path / 'runs'}", "dist.nproc=2", override]
    assert run_module.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: {key}:") and "accepted" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "overrides, key",
    [(["train.batch_size=1000"], "train.batch_size"), (["train.accumulate_steps=50"], "train.accumulate_steps")],
)
def test_a_batch_larger_than_the_data_is_refused_and_leaves_no_run(tmp_path, capsys, overrides, key):
    """Was: a traceback (accumulate_steps), or a manifest at "running" forever (batch_size)."""
    import freeze.pipeline.run as run_module

    argv = ["--config", str(SMOKE), f"run.out_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}"]
    assert run_module.main([*argv, "dist.nproc=1", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {key}:") and "accepted here: 1.." in err
    assert not (tmp_path / "runs" / "smoke").exists()


def test_a_policy_the_freezer_refuses_for_this_run_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    """Reliability.md case 11: the Freezer's one-line refusal (horizon with too few evaluations) arrived as
    a ValueError traceback from every rank, exit 1."""
    import freeze.pipeline.prepare as prepare
    import freeze.pipeline.run as run_module

    def refuse(*args, **kwargs):
        raise ValueError(
            "Freezer: policy 'horizon:...' needs 3 evaluations before its first decision and this run has 2"
        )

    monkeypatch.setattr(prepare, "Freezer", refuse)
    argv = [
        "--config",
        str(SMOKE),
        f"run.out_dir={tmp_path / 'runs'}",
        f"data.root={tmp_path / 'data'}",
        "dist.nproc=1",
    ]
    assert run_module.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: freeze.policy: Freezer: policy 'horizon:...' needs 3 evaluations")
    assert not any("Traceback" in line for line in err)


def test_control_character_in_run_name_is_one_line():
    from freeze.pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(SMOKE, ["run.name=a\nb"])
    assert _one_line(err).startswith("run.name:")


@pytest.mark.parametrize(
    "table, expected",
    [
        (
            'base = "b.toml"\nstudy = "s"\noverides = ["train.epochs=1"]',
            "unknown key(s) 'overides' under [sweep]; accepted: base, study, overrides",
        ),
        ('base = 3\nstudy = "s"', "'base' under [sweep] must be a string, got 3"),
    ],
)
def test_sweep_table_keys_are_checked(tmp_path, table, expected):
    from freeze.pipeline.sweep import SweepError, read_sweep

    path = tmp_path / "sweep.toml"
    path.write_text(f"[sweep]\n{table}\n")
    with pytest.raises(SweepError) as err:
        read_sweep(path)
    assert expected in _one_line(err)


def test_report_manifest_numbers_must_make_sense(tmp_path):
    import json

    from freeze.pipeline.report import ReportInputError
    from freeze.pipeline.report.load import read_manifest

    manifest = {"group": "g", "policy": "none", "seed": 0, "world_size": 2, "status": "complete"}
    manifest.update(epochs_planned=2, epochs_done=2, block_names=["a", "b"])
    for key, value in (("world_size", 0), ("epochs_planned", -5)):
        (tmp_path / "manifest.json").write_text(json.dumps({**manifest, key: value}))
        with pytest.raises(ReportInputError, match=f"key '{key}' must be an integer >= 1"):
            read_manifest(tmp_path / "manifest.json")


def test_report_drops_a_torn_last_line_and_names_a_line_that_is_not_utf8(tmp_path):
    from freeze.pipeline.report import ReportInputError
    from freeze.pipeline.report.load import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"epoch": 0, "train_lo')  # a crash mid-append: the run's own reader drops it
    frame, *_ = read_metrics(path, n_blocks=2)
    assert len(frame) == 0
    path.write_bytes(b'\xff\xfe{"epoch": 0}\n{"epoch": 1}\n')
    with pytest.raises(ReportInputError) as err:
        read_metrics(path, n_blocks=2)
    assert f"{path}:1:" in _one_line(err) and "not UTF-8" in str(err.value)


def test_report_out_that_is_a_file_is_refused_before_the_work(tmp_path):
    from freeze.pipeline.report import ReportInputError, build_report

    (tmp_path / "out").write_text("a file")
    with pytest.raises(ReportInputError) as err:
        build_report(tmp_path / "no-runs-here", tmp_path / "out" / "sub")
    assert "is a file, not a directory" in _one_line(err)


def test_checkpoint_of_another_architecture_is_one_short_line():
    from freeze.pipeline.models import state_dict_mismatch

    own = build_model("resnet18", num_classes=10).state_dict()
    other = {"features.0.weight": torch.zeros(1)}  # a VGG key
    message = state_dict_mismatch(own, other)
    assert "\n" not in message and len(message) < 200 and message.startswith(f"1 unexpected, {len(own)} missing keys")


@pytest.mark.processes
def test_a_second_sweep_leaves_a_run_another_process_writes_and_says_so(tmp_path):
    """Was: both sweeps trained the run, interleaved its epochs and exited 0."""
    from freeze.pipeline.sweep import expand, run_specs

    (spec,) = expand(str(SMOKE), "s", {}, ["dist.nproc=1"], str(tmp_path / "runs"))
    holder = _hold_lock(spec.config.run_dir())
    try:
        summary = run_specs([spec], log=lambda line: None)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert not summary.ok and summary.ran == [] and [name for name, _ in summary.busy] == [spec.name]
    assert f"pid {holder.pid}" in summary.busy[0][1]
    assert not (spec.config.run_dir() / "manifest.json").exists()  # nothing written by the second sweep


def test_checkpoint_of_another_policy_is_one_line_naming_both(tmp_path):
    """A checkpoint copied from a run of another policy (same model, same config otherwise): its
    boundary and policy state would be loaded under this run's policy. Refused, naming both specs."""

    from freeze import Freezer, make_policy, split_blocks
    from freeze.pipeline.prepare import resume_training

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    blocks = split_blocks(model)
    writer, own = Freezer(model, blocks, make_policy("static", k=1)), Freezer(model, blocks, make_policy("none"))
    path = tmp_path / "checkpoint.pt"
    state = {"epoch": 1, "cumulative_wall_s": 1.0, "model": model.state_dict(), "freezer": writer.state_dict()}
    torch.save({**state, "optimizer": {}, "scheduler": {}, "scaler": {}, "rng": {}}, path)
    with pytest.raises(RunError) as err:
        resume_training(SimpleNamespace(model=model, freezer=own), path, torch.device("cpu"))
    message = _one_line(err)
    assert str(path) in message and "freeze.policy 'static:k=1'" in message and "this run uses 'none'" in message
    writer.close()
    own.close()


# ------------------------------------------------------------------ Ctrl-C: one line, and the command that resumes
@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and signals as on Linux")
@pytest.mark.parametrize("nproc", [2, 1])
def test_ctrl_c_on_a_run_says_interrupted_in_one_line_with_the_resume_command(tmp_path, nproc):
    """Ctrl-C (SIGINT to the terminal's process group) printed about 100 lines of per-rank
    KeyboardInterrupt tracebacks and left the manifest "running". Now: one line naming the exact
    command that resumes, status "interrupted", exit code 130; that command then completes the run."""
    runs, repo = tmp_path / "runs", Path(__file__).resolve().parents[2]
    # 8 epochs of about a second: interrupted after the first, the rest is what the resume runs
    args = ["--config", str(SMOKE), f"dist.nproc={nproc}", "train.epochs=8", f"run.out_dir={runs}"]
    args += [f"data.root={tmp_path / 'data'}"]
    proc = start_python(
        ["-m", "experiments.run", *args],
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives a command
    )
    metrics = runs / "smoke" / "smoke" / "metrics.jsonl"
    try:
        _wait_for(lambda: metrics.is_file() and metrics.read_text().strip(), 180, "the first epoch")
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "death signal" not in err, err
    interrupted = [line for line in err.splitlines() if line.startswith("interrupted: ")]
    assert len(interrupted) == 1, err
    command = interrupted[0].split("resume with: ", 1)[1]
    assert command == " ".join(["python -m experiments.run", *args, "--resume"])
    manifest = json.loads((runs / "smoke" / "smoke" / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    done = run_python(command.split()[1:], cwd=repo)  # the printed command resumes it
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((runs / "smoke" / "smoke" / "manifest.json").read_text())["status"] == "complete"


# ------------------------------------------------------------------ a worker killed by a signal we did not send
def _local_rank(pid: int) -> int | None:
    """LOCAL_RANK in the environment torchrun gave worker ``pid`` (None if it is gone)."""
    try:
        environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [entry.split(b"=", 1)[1] for entry in environ if entry.startswith(b"LOCAL_RANK=")]
    return int(found[0]) if found else None


def sigkill_worker(launcher_pid: int, local_rank: int, n_workers: int = 2) -> None:
    """SIGKILL the worker of ``launcher_pid`` with ``local_rank``, as the out-of-memory killer would."""

    def started() -> list[int]:
        found = _children(launcher_pid)
        return found if len(found) >= n_workers else []

    (victim,) = [pid for pid in _wait_for(started, 60, "the workers") if _local_rank(pid) == local_rank]
    os.kill(victim, signal.SIGKILL)


@pytest.mark.parametrize(
    "exitcodes, expected",
    [
        # the killed rank, then its peer stopped by the agent (130), in one second or in either order
        ({0: -9, 1: 130}, (1, "worker 0", "SIGKILL")),
        ({1: 130, 0: -9}, (1, "worker 0", "SIGKILL")),
        ({0: 1, 1: -9}, (1, "worker 1", "SIGKILL")),  # the peer's gloo error came first: still the kill
        ({0: 130, 1: 1}, (1, "worker 1", "code 1")),  # a Python error on rank 1, rank 0 stopped
        ({0: 130, 1: 2}, (2, None, None)),  # refused: the worker said why
        ({0: 130, 1: -15}, (130, None, None)),  # every worker stopped from outside: interrupted
    ],
)
def test_the_worker_that_failed_is_blamed_not_the_one_the_agent_stopped(exitcodes, expected):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from freeze.pipeline.failures import worker_failure

    failures = [ProcessFailure(rank, 1000 + rank, code, "/nonexistent") for rank, code in exitcodes.items()]
    code, line, killed = worker_failure(failures)
    want_code, who, what = expected
    assert code == want_code
    assert killed == (what == "SIGKILL")
    if who is None:
        assert line is None
    else:
        assert line.startswith(f"{who} (pid 100") and what in line and "\n" not in line


def _sigkill_a_worker_after_an_epoch(
    module_args: list[str], repo: Path, metrics: Path, local_rank: int, timeout_s: float, what: str
) -> tuple[subprocess.Popen, str, str]:
    """Start ``python -m <module_args>`` in a session of its own, wait until ``metrics`` holds an
    epoch, SIGKILL the worker with ``local_rank`` and collect the exit (every process of the session
    is gone afterwards, whatever happened). Returns the process, its stdout and its stderr."""
    proc = start_python(
        ["-m", *module_args],
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for(lambda: metrics.is_file() and metrics.read_text().strip(), 180, what)
        sigkill_worker(proc.pid, local_rank=local_rank)
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, out, err


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and signals as on Linux")
def test_a_sigkilled_worker_fails_the_run_naming_it_and_the_signal(tmp_path):
    """Was: the peer, stopped by torchrun with SIGTERM, was blamed ("worker 1 exited with code 130"),
    the run recorded "interrupted" and exit 130, so a sweep or study stopped there."""
    runs, repo = tmp_path / "runs", Path(__file__).resolve().parents[2]
    args = ["--config", str(SMOKE), "dist.nproc=2", "train.epochs=8", f"run.out_dir={runs}"]
    args += [f"data.root={tmp_path / 'data'}", "dist.timeout_s=60"]
    metrics = runs / "smoke" / "smoke" / "metrics.jsonl"
    proc, out, err = _sigkill_a_worker_after_an_epoch(
        ["experiments.run", *args], repo, metrics, 0, 90, "the first epoch"
    )
    assert proc.returncode == 1, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "worker 0 (pid" in errors[0] and "signal SIGKILL" in errors[0], err
    assert "interrupted" not in err, err
    assert "Traceback" not in err, err
    manifest = json.loads((runs / "smoke" / "smoke" / "manifest.json").read_text())
    assert manifest["status"] == "failed", manifest
    assert "worker 0" in manifest["error"] and "SIGKILL" in manifest["error"]


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and signals as on Linux")
def test_a_sweep_goes_on_after_a_sigkilled_worker(tmp_path):
    """Was: the run was recorded "interrupted" and the sweep stopped with exit 130 before run 2."""
    runs, repo = tmp_path / "runs", Path(__file__).resolve().parents[2]
    sweep = tmp_path / "sweep.toml"
    overrides = [f"data.root={tmp_path / 'data'}", "dist.nproc=2", "dist.timeout_s=60"]
    listed = ", ".join(f'"{o}"' for o in overrides)
    # run 1 (8 epochs) is killed after its first; run 2 (1 epoch) must still run
    sweep.write_text(
        f'[sweep]\nbase = "{SMOKE}"\nstudy = "s"\noverrides = [{listed}]\n[grid]\n"train.epochs" = [8, 1]\n'
    )
    metrics = runs / "s" / "epochs=8" / "metrics.jsonl"
    command = ["experiments.sweep", "--sweep", str(sweep), "--out-dir", str(runs)]
    proc, stdout, stderr = _sigkill_a_worker_after_an_epoch(command, repo, metrics, 1, 240, "run 1's first epoch")
    out = stdout + stderr  # both streams, as the sweep's user sees them
    assert proc.returncode == 1, out
    killed = json.loads((runs / "s" / "epochs=8" / "manifest.json").read_text())
    assert killed["status"] == "failed" and "worker 1" in killed["error"] and "SIGKILL" in killed["error"], killed
    assert json.loads((runs / "s" / "epochs=1" / "manifest.json").read_text())["status"] == "complete", out
    assert "1 failed" in out and "Traceback" not in out, out


# ------------------------------------------------------------------ a full disk at start-up: one line, exit 2
def _no_space(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_when_a_new_run_takes_its_lock_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Was: one line and exit 2, but an empty new run directory holding a 0-byte .lock."""
    import freeze.pipeline.run as run_module

    monkeypatch.setattr(os, "pwrite", _no_space)  # the lock's holder record is the first write
    argv = [
        "--config",
        str(SMOKE),
        f"run.out_dir={tmp_path / 'runs'}",
        f"data.root={tmp_path / 'data'}",
        "dist.nproc=2",
    ]
    assert run_module.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: cannot write ") and "No space left on device" in err
    assert not (tmp_path / "runs").exists()


def test_a_full_disk_at_a_resume_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Was: a 30-line OSError traceback from run_launcher (config.toml's write) and exit 1."""
    import freeze.pipeline.run as run_module
    import freeze.pipeline.runs as runs_module
    from freeze.pipeline.config import config_to_toml, load_config
    from freeze.pipeline.runs import RunDir

    overrides = [f"run.out_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}", "dist.nproc=2"]
    config = load_config(SMOKE, overrides)
    run = RunDir(config.run_dir())
    run.create(config_to_toml(config), {"run_name": "smoke"}, resume=False)
    run.append_metrics({"epoch": 0})
    run.mark_interrupted()
    before = {p.name: p.read_bytes() for p in run.path.iterdir()}
    monkeypatch.setattr(runs_module, "atomic_write_text", _no_space)
    assert run_module.main(["--config", str(SMOKE), "--resume", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: cannot write {run.config_path}: No space left on device"
    after = {p.name: p.read_bytes() for p in run.path.iterdir() if p.name != ".lock"}  # the lock file stays
    assert after == before  # nothing changed, nothing lost


def test_a_full_disk_at_a_sweeps_resume_fails_that_run_in_one_line(tmp_path, monkeypatch):
    """Was: a 29-line traceback that ended the sweep."""
    import freeze.pipeline.runs as runs_module
    from freeze.pipeline.config import config_to_toml
    from freeze.pipeline.runs import RunDir
    from freeze.pipeline.sweep import expand, run_specs

    (spec,) = expand(str(SMOKE), "s", {}, ["dist.nproc=2", f"data.root={tmp_path / 'data'}"], str(tmp_path / "runs"))
    run = RunDir(spec.config.run_dir())
    run.create(config_to_toml(spec.config), {"run_name": spec.name}, resume=False)
    run.append_metrics({"epoch": 0})
    run.mark_interrupted()
    monkeypatch.setattr(runs_module, "atomic_write_text", _no_space)
    lines: list[str] = []
    summary = run_specs([spec], log=lines.append)
    assert summary.failed == [(spec.name, f"cannot write {run.config_path}: No space left on device")]
    assert run.status() == "interrupted"  # still resumable once there is space


# ------------------------------------------------------------------ metrics.jsonl that a resume cannot continue
def _interrupted_run_with_metrics(tmp_path, metrics: bytes):
    from freeze.pipeline.config import config_to_toml, load_config
    from freeze.pipeline.runs import RunDir

    overrides = [f"run.out_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}", "dist.nproc=2"]
    config = load_config(SMOKE, overrides)
    run = RunDir(config.run_dir())
    run.create(config_to_toml(config), {"run_name": "smoke"}, resume=False)
    run.metrics_path.write_bytes(metrics)
    run.mark_interrupted()
    return run, overrides


@pytest.mark.parametrize(
    "metrics, expected",
    [
        (b'garbage{\n{"epoch":1}\n', "line 1: not valid JSON"),
        (b'{"epoch":0}\n{"loss":1}\n', "a record has no integer 'epoch'"),
        # reliability case 24: accepted, and the report then refused the run the resume completed
        (b'{"epoch":0,"note":"x"}\n', "epoch 0 has keys no version of freeze writes: note"),
        (b'{"epoch":0,"boundary_during":1}\n', "written by an older version (keys boundary_during)"),
    ],
)
def test_a_bad_middle_metrics_line_refuses_the_resume_before_any_worker_starts(tmp_path, capsys, metrics, expected):
    """Was: one line from rank 0 after the run was marked running, a ~45-line traceback from rank 1
    (already training), and the interrupted run rewritten as failed."""
    import freeze.pipeline.run as run_module

    run, overrides = _interrupted_run_with_metrics(tmp_path, metrics)
    assert run_module.main(["--config", str(SMOKE), "--resume", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: cannot resume {run.path}: ") and expected in err, err
    assert "run.name" in err and run.status() == "interrupted"


@pytest.mark.processes
def test_a_resume_whose_metrics_lack_the_checkpoints_epochs_is_refused(tmp_path):
    """Was: the resume went on from the checkpoint and the run was marked complete with epochs
    missing from metrics.jsonl, so nothing re-ran them."""
    from freeze.pipeline.runs import RunDir

    repo = Path(__file__).resolve().parents[2]
    args = ["--config", str(SMOKE), "dist.nproc=1", "train.epochs=1", "run.keep_checkpoint=true"]
    args += [f"run.out_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}"]
    first = run_python(["-m", "experiments.run", *args], cwd=repo)
    assert first.returncode == 0, first.stderr[-2000:]
    run = RunDir(tmp_path / "runs" / "smoke" / "smoke")
    run.update_manifest(status="interrupted")  # as if stopped after its checkpoint of epoch 1
    run.metrics_path.unlink()
    again = run_python(["-m", "experiments.run", *args, "--resume"], cwd=repo)
    assert again.returncode == 2, again.stderr[-2000:]
    err = again.stderr.strip()
    assert "\n" not in err and "checkpoint is at epoch 1, but the run has no metrics.jsonl" in err, err
    assert run.status() == "interrupted" and not run.metrics_path.exists()
    run.metrics_path.write_text('{"epoch":0}\n')  # epoch 0's record back: the resume goes on
    assert run.check_metrics_cover(1) is None
    run.metrics_path.write_text('{"epoch":1}\n')
    with pytest.raises(RunError, match=r"metrics.jsonl lacks epoch\(s\) 0;"):
        run.check_metrics_cover(2)


def test_an_edited_config_toml_resumed_through_itself_is_refused(tmp_path, capsys, monkeypatch):
    """Was: accepted (the stored file is the --config file, so they agree), the new optim.lr
    silently overridden by the checkpoint's optimizer state, and config.toml misdescribing the run."""
    import freeze.pipeline.run as run_module
    from freeze.pipeline import runs
    from freeze.pipeline.config import config_to_toml, load_config
    from freeze.pipeline.prepare import _manifest
    from freeze.pipeline.runs import RunDir

    monkeypatch.setattr(runs, "git_commit", lambda: None)  # the manifest's commit asks git: not this claim

    config = load_config(SMOKE, [f"run.out_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}", "dist.nproc=2"])
    run = RunDir(config.run_dir())
    context = SimpleNamespace(world_size=2, device=torch.device("cpu"))
    split = SimpleNamespace(num_classes=10, test_y=torch.zeros(128))
    manifest = _manifest(config, context, [], SimpleNamespace(spec=lambda: config.freeze.policy), split)
    run.create(config_to_toml(config), dataclasses.asdict(manifest), resume=False)  # what rank 0 writes at the start
    run.append_metrics({"epoch": 0})
    run.mark_interrupted()
    edited = run.config_path.read_text().replace("lr = 0.05", "lr = 0.5")
    assert edited != run.config_path.read_text()
    run.config_path.write_text(edited)
    assert run_module.main(["--config", str(run.config_path), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the run started with optim.lr = 0.05" in err and "this config has 0.5" in err, err
    assert run.status() == "interrupted" and run.config_path.read_text() == edited  # nothing changed
    run.config_path.write_text(config_to_toml(config))  # put back: the same command goes on
    assert run.prepare(config_to_toml(config), resume=True) == "interrupted"


# ------------------------------------------------------------------ a collective past dist.timeout_s: one line
def _recv_that_times_out(rank: int, world_size: int) -> str | None:
    """Rank 0 waits for a tensor rank 1 never sends (rank 1 stays alive past the timeout)."""
    import torch.distributed as dist

    if rank == 0:
        try:
            dist.recv(torch.zeros(1), src=1)
        except RuntimeError as err:
            return str(err)
        return None
    time.sleep(6)
    return None


@pytest.mark.processes
def test_a_collective_timeout_is_one_line_naming_dist_timeout_s(tmp_path, monkeypatch, capsys):
    """Was: a gloo traceback from every rank (148 lines on the emulated cluster) and no line naming
    the setting that bounds it."""
    import freeze.pipeline.run as run_module
    from freeze.pipeline.config import config_to_toml, load_config
    from freeze.pipeline.runs import RunDir
    from tests.distributed_harness import run_distributed

    gloo_message, _ = run_distributed(_recv_that_times_out, 2, tmp_path / "gloo", collective_timeout_s=2.0)
    assert gloo_message and "Timed out" in gloo_message  # what gloo says, on 2 real ranks

    config = load_config(SMOKE, [f"run.out_dir={tmp_path / 'runs'}", "dist.nproc=1", "dist.timeout_s=2"])
    run = RunDir(config.run_dir())

    def train_until_the_timeout(cfg, ctx, resume, outcome):
        run.create(config_to_toml(cfg), {"run_name": cfg.run.name}, resume=False)
        outcome.started = True
        raise RuntimeError(gloo_message)

    monkeypatch.setattr(run_module._Interrupt, "install", lambda: None)
    monkeypatch.setattr(run_module._Interrupt, "seen", False)
    monkeypatch.setattr(run_module, "setup_worker", lambda dist_config: None)
    monkeypatch.setattr(run_module, "teardown_worker", lambda: None)
    monkeypatch.setattr(run_module, "train_worker", train_until_the_timeout)
    assert run_module.run_worker(config, resume=False) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "exceeded dist.timeout_s = 2 s" in err and "not to the run" in err, err
    assert run.status() == "failed" and "dist.timeout_s" in run.read_manifest()["error"]


def test_ctrl_c_in_the_report_and_in_profile_run_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    """Reliability probe case 42: both printed a 28-73-line KeyboardInterrupt traceback; profile_run
    must leave no partial profile (it writes atomically, after measuring)."""
    import experiments.profile_run as profile_run
    import freeze.pipeline.report.build as report_build
    import freeze.pipeline.report.cli as report_cli
    import freeze.pipeline.study.predict as predict

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report_build, "build_report", interrupted)
    assert report_cli.main([str(tmp_path), "--out", str(tmp_path / "report")]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("report: interrupted:")

    monkeypatch.setattr(predict, "measure_profile", interrupted)
    out = tmp_path / "profile.json"
    smoke = Path(__file__).parents[2] / "experiments" / "configs" / "smoke.toml"
    assert profile_run.main(["--config", str(smoke), "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"profile_run: interrupted: no profile written ({out} does not exist)"] and not out.exists()
