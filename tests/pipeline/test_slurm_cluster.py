"""Sweeps, multi-node runs, a study and preemption on a real SLURM cluster: two nodes of one CPU each
on this host (tests/slurm_cluster.py starts munged, slurmctld and two slurmd, and stops them by pid).
Skipped with one line where the cluster cannot start (no root). SLURM keeps no accounting here, as on
many clusters: the driver reads squeue and the run directories only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests import slurm_cluster
from tests.pipeline.tiny_runs import TINY_RUN
from tests.processes import python_env, run_python, start_python

pytestmark = [pytest.mark.processes, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "experiments" / "configs" / "smoke.toml"
# tiny runs of 1 worker (each test node has one CPU), the same bits wherever a run lands (threads
# change a conv's sums)
TINY = [*TINY_RUN, "dist.threads_per_worker=1"]
DEADLINE_S = 300.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    try:
        started = slurm_cluster.up(root)
    except slurm_cluster.ClusterUnavailable as e:
        pytest.skip(f"SLURM test cluster unavailable: {e}")
    yield started
    slurm_cluster.down(root)


def _env(cluster, tmp_path: Path) -> dict[str, str]:
    return python_env(**cluster.env(), FREEZE_DATA_ROOT=str(tmp_path / "data"))


def _sweep_file(tmp_path: Path, study: str, grid: str, overrides: list[str] = ()) -> Path:
    path = tmp_path / f"{study}.toml"
    extra = ", ".join(f'"{o}"' for o in [*TINY, f"data.root={tmp_path / 'data'}", *overrides])
    path.write_text(f'[sweep]\nbase = "{SMOKE}"\nstudy = "{study}"\noverrides = [{extra}]\n[grid]\n{grid}\n')
    return path


def _sweep(cluster, tmp_path: Path, sweep: Path, *slurm: str, out: str = "runs"):
    args = ["-m", "freeze.pipeline.sweep", "--sweep", str(sweep), "--out-dir", str(tmp_path / out)]
    args += ["--executor", "slurm", "--slurm", ",".join(["poll_s=0.5", *slurm])]
    return run_python(args, env=_env(cluster, tmp_path), timeout_s=DEADLINE_S)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def _weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _task_logs(study_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(study_dir.glob(".scheduler/*/logs/*.log")))


def _queued(cluster, name: str) -> list[str]:
    done = subprocess.run(
        ["squeue", "-h", "-n", name, "-o", "%i %T"], env=_env(cluster, Path("/")), capture_output=True, text=True
    )
    return done.stdout.split("\n")[:-1]


def test_a_sweep_is_a_job_array_each_run_trained_once_and_the_same_command_reattaches(cluster, tmp_path):
    sweep = _sweep_file(tmp_path, "array", '"freeze.policy" = ["none", "geometric:alpha=0.5"]\n"run.seed" = [0, 1]')
    done = _sweep(cluster, tmp_path, sweep, "max_parallel=2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "submitted job" in done.stdout and "4 runs as array tasks" in done.stdout
    assert "sweep: 4 ran (0 of them resumed), 0 skipped (complete), 0 busy (another writer), 0 failed" in done.stdout
    study = tmp_path / "runs" / "array"
    runs = sorted(p for p in study.iterdir() if (p / "manifest.json").exists())
    assert len(runs) == 4
    logs = _task_logs(study)
    for run in runs:
        manifest = _manifest(run)
        assert manifest["status"] == "complete" and [m["epoch"] for m in _metrics(run)] == [0, 1]  # trained once
        assert manifest["placement"]["slurm"]["array_task_id"] in {"0", "1", "2", "3"}
        assert logs.count(f"] {run.name}: starting") == 1
    assert "resuming" not in logs
    assert sorted(re.findall(r"== array task (\d): exit code (\d+)", logs)) == [(str(i), "0") for i in range(4)]
    assert {m["placement"]["slurm"]["nodelist"] for m in map(_manifest, runs)} <= {
        "vm",
        "localhost",
        os.uname().nodename,
    }
    # the same command again: every run is complete, nothing is submitted
    again = _sweep(cluster, tmp_path, sweep, "max_parallel=2")
    assert again.returncode == 0 and "submitted job" not in again.stdout
    assert "0 ran (0 of them resumed), 4 skipped (complete)" in again.stdout


def test_a_two_node_run_takes_its_ranks_from_the_allocation_and_ends_as_on_one_machine(cluster, tmp_path):
    sweep = _sweep_file(tmp_path, "nodes", '"run.seed" = [0]', ["freeze.policy=geometric:alpha=0.5"])
    done = _sweep(cluster, tmp_path, sweep, "nodes=2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "runs" / "nodes" / "seed=0"
    manifest = _manifest(run)
    assert manifest["status"] == "complete" and manifest["world_size"] == 2
    assert manifest["placement"]["slurm"]["nodelist"].count(",") == 1  # both nodes in one job
    block_bytes = manifest["block_param_bytes"]
    for m in _metrics(run):  # each step all-reduced exactly the gradients of the trainable blocks
        assert (
            m["allreduce_bytes_per_step"] == sum(block_bytes[m["boundary"] :])
            or m["boundary"] != m["boundary_at_epoch_start"]
        )
    assert any(m["boundary"] > 0 for m in _metrics(run))
    # the store was the batch shell's, not an agent's, and no node was left without it
    logs = _task_logs(tmp_path / "runs" / "nodes")
    assert "== array task 0: exit code 0" in logs
    assert "failed to shutdown the rendezvous" not in logs and "Traceback" not in logs, logs[-3000:]
    # the same run on 2 workers of one machine, without SLURM: the same bits
    local = run_python(
        [
            "-m",
            "experiments.run",
            "--config",
            str(SMOKE),
            *TINY,
            "dist.nproc=2",
            "freeze.policy=geometric:alpha=0.5",
            f"run.out_dir={tmp_path / 'local'}",
            "run.study=nodes",
            "run.name=seed=0",
            f"data.root={tmp_path / 'data'}",
        ],
        env=python_env(),
        timeout_s=DEADLINE_S,
    )
    assert local.returncode == 0, local.stderr[-3000:]
    assert _same_bits(_weights(run), _weights(tmp_path / "local" / "nodes" / "seed=0"))


def _wait_for(predicate, what: str, deadline_s: float = DEADLINE_S, poll_s: float = 0.2):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def _job_of(cluster, study_dir: Path) -> tuple[str, str]:
    (stage,) = (study_dir / ".scheduler").iterdir()
    name = f"{study_dir.name}-{stage.name}"
    lines = _wait_for(lambda: _queued(cluster, name), f"a queued task of {name}")
    return name, lines[0].split()[0]


def _start_driver(cluster, tmp_path: Path, args: list[str]) -> subprocess.Popen:
    """The sweep's driver on SLURM, left running (its output in driver.log) for a test to act meanwhile."""
    with open(tmp_path / "driver.log", "wb") as log:
        return start_python(
            [*args, "--executor", "slurm", "--slurm", "poll_s=0.5"],
            env=_env(cluster, tmp_path),
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _wait_for_epochs(run_dir: Path, epochs: int) -> None:
    metrics = run_dir / "metrics.jsonl"
    _wait_for(
        lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= epochs, f"{epochs} epochs", poll_s=0.05
    )


def _start_requeued_now(cluster, env: dict[str, str], name: str, job: str) -> None:
    """Once the requeued ``job`` (a task of the jobs named ``name``) is pending again, start it at
    once: SLURM holds a requeued job about 2 minutes (BeginTime), which a test need not wait out."""
    _wait_for(
        lambda: any(line.startswith(job) and "PENDING" in line for line in _queued(cluster, name)),
        f"{job} pending again",
    )
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env=env, check=True)


def test_a_requeued_run_resumes_bit_equal_to_an_uninterrupted_one(cluster, tmp_path):
    sweep = _sweep_file(tmp_path, "pre", '"run.seed" = [0]', ["train.epochs=8", "freeze.policy=geometric:alpha=0.5"])
    args = ["-m", "freeze.pipeline.sweep", "--sweep", str(sweep), "--out-dir", str(tmp_path / "runs")]
    driver = _start_driver(cluster, tmp_path, args)
    try:
        study = tmp_path / "runs" / "pre"
        _wait_for_epochs(study / "seed=0", 2)
        name, job = _job_of(cluster, study)
        env = _env(cluster, tmp_path)
        assert subprocess.run(["scontrol", "requeue", job], env=env).returncode == 0  # what preemption does
        _start_requeued_now(cluster, env, name, job)
        assert driver.wait(timeout=DEADLINE_S) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    logs = _task_logs(study)
    assert "(restart 0)" in logs and "(restart 1)" in logs and "seed=0: resuming" in logs
    assert "interrupted" in logs  # the first life stopped its worker with the completed epochs kept
    assert [m["epoch"] for m in _metrics(study / "seed=0")] == list(range(8))
    straight = run_python([*args[:-1], str(tmp_path / "straight")], env=python_env(), timeout_s=DEADLINE_S)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert _same_bits(_weights(study / "seed=0"), _weights(tmp_path / "straight" / "pre" / "seed=0"))


def test_the_time_limits_warning_requeues_only_its_own_task(cluster, tmp_path):
    """SLURM's USR1 warning before the time limit (--signal=B:USR1@S) to one array task: the script
    requeues that task, which resumes its run, and no other (the array's first task has the array's
    own job id: requeueing by it once requeued every task of a new user's sweep)."""
    sweep = _sweep_file(tmp_path, "warn", '"run.seed" = [0, 1]', ["train.epochs=8"])
    args = ["-m", "freeze.pipeline.sweep", "--sweep", str(sweep), "--out-dir", str(tmp_path / "runs")]
    driver = _start_driver(cluster, tmp_path, args)
    try:
        study = tmp_path / "runs" / "warn"
        _wait_for_epochs(study / "seed=0", 2)
        name, _ = _job_of(cluster, study)
        (task0,) = [line.split()[0] for line in _queued(cluster, name) if line.split()[0].endswith("_0")]
        env = _env(cluster, tmp_path)
        assert subprocess.run(["scancel", "--batch", "--signal=USR1", task0], env=env).returncode == 0
        _start_requeued_now(cluster, env, name, task0)
        assert driver.wait(timeout=DEADLINE_S) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    (stage,) = (study / ".scheduler").iterdir()
    first, second = ((stage / "logs" / f"{i}.log").read_text() for i in (0, 1))
    assert "== time limit near: requeueing" in first and "(restart 1)" in first and "seed=0: resuming" in first
    assert "(restart 1)" not in second and "requeueing" not in second
    assert "sweep: 2 ran (1 of them resumed)" in (tmp_path / "driver.log").read_text()
    assert [m["epoch"] for m in _metrics(study / "seed=0")] == list(range(8))


def _pid_training(config: Path) -> int | None:
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"freeze.pipeline.run" in cmdline and str(config).encode() in cmdline:
            return int(proc.name)
    return None


def test_a_killed_worker_fails_its_run_in_one_line_and_the_sweep_goes_on(cluster, tmp_path):
    sweep = _sweep_file(tmp_path, "kill", '"run.seed" = [0, 1]', ["train.epochs=6"])
    args = ["-m", "freeze.pipeline.sweep", "--sweep", str(sweep), "--out-dir", str(tmp_path / "runs")]
    driver = _start_driver(cluster, tmp_path, args)
    try:
        victim = tmp_path / "runs" / "kill" / "seed=0"
        _wait_for(lambda: (victim / "metrics.jsonl").exists(), "seed 0 training", poll_s=0.05)
        pid = _wait_for(lambda: _pid_training(victim / "config.toml"), "seed 0's worker")
        os.kill(pid, 9)
        assert driver.wait(timeout=DEADLINE_S) == 1
    finally:
        if driver.poll() is None:
            driver.kill()
    out = (tmp_path / "driver.log").read_text()
    assert "sweep: 2 ran (0 of them resumed), 0 skipped (complete), 0 busy (another writer), 1 failed" in out, out[
        -3000:
    ]
    error = _manifest(victim)["error"]
    assert _manifest(victim)["status"] == "failed" and "SIGKILL" in error and "\n" not in error
    assert f"failed: seed=0: {error} (log: " in out  # the one line, and where the task's log is
    assert _manifest(tmp_path / "runs" / "kill" / "seed=1")["status"] == "complete"


def test_a_study_goes_through_its_stages_on_slurm_and_reports(cluster, tmp_path):
    tiny = ", ".join(f'"{o}"' for o in [*TINY, "train.epochs=1", f"data.root={tmp_path / 'data'}"])
    study = tmp_path / "study.toml"
    study.write_text(
        f'[study]\nname = "tiny"\nfinetune = "{SMOKE}"\nseeds = [0]\norder_seed = 7\nmargin_points = 100\noverrides = [{tiny}]\n'
        '[settings]\nsingle = ["dist.nproc=1"]\n[arms]\nnone = ["freeze.policy=none"]\nautofreeze = []\n'
        '[search]\nsetting = "single"\nseeds = [100]\nqualify_margin_points = 100\n'
        '[search.candidates]\nautofreeze = ["static:k=2", "static:k=4"]\n'
    )
    args = ["-m", "experiments.study", "--config", str(study), "--out-dir", str(tmp_path / "runs")]
    done = run_python(
        [*args, "--executor", "slurm", "--slurm", "poll_s=0.5"], env=_env(cluster, tmp_path), timeout_s=DEADLINE_S
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the search's array, then (its choice made from its runs) the grid's array, then the report
    assert done.stdout.count("submitted job") == 2
    assert done.stdout.index("parameter search") < done.stdout.index("study grid") < done.stdout.index("== report:")
    report = tmp_path / "runs" / "tiny-report"
    assert (report / "paired.md").exists() and (report / "search.md").exists()
    chosen = _manifest(tmp_path / "runs" / "tiny" / "single_autofreeze_seed=0")
    assert chosen["policy"] in ("static:k=2", "static:k=4") and chosen["placement"]["slurm"]["job_id"]
    # with --emit-sbatch nothing is submitted: the scripts are written (the stages are complete: none to do)
    emitted = run_python(
        [*args, "--executor", "slurm", "--emit-sbatch"], env=_env(cluster, tmp_path), timeout_s=DEADLINE_S
    )
    assert emitted.returncode == 0 and "submitted job" not in emitted.stdout, emitted.stderr[-2000:]


def test_a_partition_it_lacks_and_a_request_it_can_never_start_are_one_line_each(cluster, tmp_path):
    sweep = _sweep_file(tmp_path, "bad", '"run.seed" = [0]')
    unknown = _sweep(cluster, tmp_path, sweep, "partition=gpu")
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr == "error: slurm option partition='gpu' is not a partition here; accepted: debug\n"
    # 3 nodes on a 2-node cluster: SLURM queues it for ever (PartitionConfig); the driver says so and cancels it
    never = _sweep(cluster, tmp_path, sweep, "nodes=3")
    assert never.returncode == 1, never.stdout[-2000:] + never.stderr[-2000:]
    (line,) = never.stderr.splitlines()
    assert (
        line.startswith("error: SLURM can never start this stage's pending tasks (PartitionConfig")
        and "cancelled" in line
    )
    assert _queued(cluster, f"bad-{next((tmp_path / 'runs' / 'bad' / '.scheduler').iterdir()).name}") == []
