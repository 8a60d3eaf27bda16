"""The SLURM pieces that need no scheduler: options, the allocation read from the environment, the
sbatch script, a stage's folder, the executors' flags and slots, the time-limit check, and the
report's timing pairs. On the scheduler itself: tests/pipeline/test_slurm_cluster.py."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from freeze.pipeline.config import ConfigError
from freeze.pipeline.run import _rendezvous_argv
from freeze.pipeline.slurm import (
    SlurmEnvError,
    SlurmOptions,
    SlurmOptionsError,
    current_allocation,
    parse_slurm_options,
    srun_rank_env,
)
from freeze.pipeline.slurm.allocation import RDZV_PORT_BASE, expand_nodelist, rendezvous_port
from freeze.pipeline.slurm.options import parse_time_s
from freeze.pipeline.slurm.script import array_spec, sbatch_script
from freeze.pipeline.sweep import SweepError, expand
from freeze.pipeline.sweep.executor_args import add_executor_arguments, executor_from_args
from freeze.pipeline.sweep.executors import SerialExecutor
from freeze.pipeline.sweep.local_executor import LocalExecutor, plan_slots, visible_gpus
from freeze.pipeline.sweep.slurm_executor import SlurmExecutor, check_time_limit
from freeze.pipeline.sweep.stage import Stage

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "experiments" / "configs" / "smoke.toml"


def test_options_from_the_command_line_keep_a_node_lists_commas():
    options = parse_slurm_options(["partition=gpu,time=02:00:00,nodes=2", "nodelist=gpu[01-02],gpu7,max_parallel=8"])
    assert options == SlurmOptions(
        partition="gpu", time="02:00:00", nodes=2, nodelist="gpu[01-02],gpu7", max_parallel=8
    )
    assert options.time_limit_s == 7200


@pytest.mark.parametrize(
    "items, message",
    [
        (["partiton=gpu"], "slurm option 'partiton' is unknown; accepted: partition, nodes, time"),
        (["nodes=0"], "slurm option nodes=0: must be >= 1"),
        (["gpus_per_worker=one"], "slurm option gpus_per_worker='one': expected an integer"),
        (["time=2h"], "slurm option time='2h': accepted forms are MM, MM:SS, HH:MM:SS"),
        (["gpu"], "slurm option 'gpu': expected key=value"),
        (["partition="], "slurm option partition: empty value"),
        (["mem=lots"], "slurm option mem='lots': accepted: a size per node such as 64G"),
        (["poll_s=nan"], "slurm option poll_s=nan: expected a number of seconds > 0"),
        (["exclusive=yes"], "slurm option exclusive='yes': accepted: true, false"),
        # the warning would come at once: the task would requeue itself for ever
        (["time=2"], "slurm option time=2: 120 s leaves no time to train after start-up (60 s)"),
    ],
)
def test_a_bad_option_is_one_line_naming_it(items, message):
    with pytest.raises(SlurmOptionsError, match=None) as info:
        parse_slurm_options(items)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "text, seconds", [("30", 1800), ("5:30", 330), ("1:02:03", 3723), ("2-0", 172800), ("1-01:30", 91800)]
)
def test_slurm_time_formats(text, seconds):
    assert parse_time_s(text) == seconds


def test_the_allocation_from_slurms_variables():
    env = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "nodeA,nodeB", "SLURM_NODEID": "1", "SLURM_RESTART_COUNT": "2"}
    allocation = current_allocation(env)
    assert allocation.nodes == ("nodeA", "nodeB") and allocation.node_rank == 1 and allocation.head == "nodeA"
    # a requeued job never joins its previous life's rendezvous; two jobs on one node use two ports
    assert allocation.rendezvous_id == "1234-2"
    assert allocation.rendezvous_endpoint == f"nodeA:{rendezvous_port('1234')}"
    assert rendezvous_port("1234") != rendezvous_port("1235") and rendezvous_port("1234") >= RDZV_PORT_BASE
    assert current_allocation({}) is None
    with pytest.raises(SlurmEnvError, match="SLURM_NODEID=5 is not the index of one of the job's 2 nodes"):
        current_allocation({**env, "SLURM_NODEID": "5"})
    with pytest.raises(SlurmEnvError, match="SLURM_RESTART_COUNT='x' is not an integer"):
        current_allocation({**env, "SLURM_RESTART_COUNT": "x"})


def test_no_nodes_agent_hosts_the_rendezvous_store_the_batch_shell_hosts():
    # the batch shell hosts it (freeze.pipeline.slurm.store) and names its node: an agent hosting it
    # would take it away from the other nodes whenever it exited first
    env = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "nodeA,nodeB", "FREEZE_RDZV_STORE_HOST": "nodeB"}
    for node in ("0", "1"):
        argv = _rendezvous_argv(current_allocation({**env, "SLURM_NODEID": node}))
        assert f"--rdzv-endpoint=nodeB:{rendezvous_port('1234')}" in argv and "--rdzv-conf=is_host=0" in argv
    # a script of an older freeze starts no store and names none: node 0's agent hosts it, as then
    del env["FREEZE_RDZV_STORE_HOST"]
    hosts = [_rendezvous_argv(current_allocation({**env, "SLURM_NODEID": node}))[-1] for node in ("0", "1")]
    assert hosts == ["--rdzv-conf=is_host=1", "--rdzv-conf=is_host=0"]
    assert current_allocation({**env, "SLURM_NODEID": "0"}).rendezvous_endpoint == f"nodeA:{rendezvous_port('1234')}"


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu[01-03,07],cpu7", ("gpu01", "gpu02", "gpu03", "gpu07", "cpu7")),
        ("vm,localhost", ("vm", "localhost")),
        ("n[8-10]-ib", ("n8-ib", "n9-ib", "n10-ib")),
    ],
)
def test_node_lists_expand_as_slurm_does(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_srun_one_task_per_worker_gets_torchruns_variables():
    step = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_NODELIST": "gpu1,gpu2",
    }
    assert srun_rank_env(step) == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu1",
        "MASTER_PORT": str(rendezvous_port("77")),
    }
    # torchrun set RANK, a single task, a batch script's shell: nothing to derive
    assert srun_rank_env({**step, "RANK": "0"}) == {}
    assert srun_rank_env({**step, "SLURM_NTASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"}) == {}
    assert srun_rank_env({k: v for k, v in step.items() if k != "SLURM_STEP_ID"}) == {}
    with pytest.raises(SlurmEnvError, match="cannot read the task layout"):
        srun_rank_env({**step, "SLURM_STEP_TASKS_PER_NODE": "four"})


def test_array_spec_compresses_indices():
    assert array_spec([0, 1, 2, 5, 7, 8], 4) == "0-2,5,7-8%4"
    assert array_spec([3], 0) == "3"


def test_the_sbatch_script_requeues_itself_and_appends_its_log(tmp_path):
    options = SlurmOptions(
        partition="gpu", time="04:00:00", nodes=2, gpus_per_worker=1, constraint="h100", max_parallel=3, exclusive=True
    )
    text = sbatch_script(
        options,
        job_name="s-grid-1",
        stage_dir=tmp_path,
        indices=[0, 1, 4],
        nodes=2,
        nproc=4,
        python="/v/python",
        workdir=tmp_path,
    )
    for line in (
        "#SBATCH --array=0-1,4%3",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=04:00:00",
        "#SBATCH --constraint=h100",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --exclusive",
        # srun does not inherit --cpus-per-task on SLURM 22.05-23.02 (the workers would share one CPU)
        "srun --kill-on-bad-exit=1 --cpus-per-task=$SLURM_CPUS_PER_TASK /v/python -m freeze.pipeline.sweep.task "
        f"{tmp_path} $SLURM_ARRAY_TASK_ID &",
        # a life too short for an epoch requeues at most max_requeues times, not for ever
        '  if [ "${SLURM_RESTART_COUNT:-0}" -lt 20 ]; then',
        "trap requeue USR1",
    ):
        assert line in text.splitlines(), line
    # this task only: an array's first task has the array's own job id, which would requeue every task
    assert 'scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"' in text and "--mem" not in text
    # a run over 2 nodes: the batch shell hosts the rendezvous store from before srun until srun has
    # returned (after its wait loop: a USR1 that cuts a wait short must not stop it), so the store
    # outlives every node's agent; it names its node to the tasks
    lines = text.splitlines()
    export = lines.index('export FREEZE_RDZV_STORE_HOST="${SLURMD_NODENAME:-$(hostname)}"')
    store = lines.index("/v/python -m freeze.pipeline.slurm.store &")
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    loop = next(i for i, line in enumerate(lines) if line.startswith('while kill -0 "$task"'))
    stop = lines.index('kill -TERM "$store" 2>/dev/null')
    assert export < store < srun < loop < stop < lines.index('exit "$code"')
    one_node = sbatch_script(
        SlurmOptions(), job_name="j", stage_dir=tmp_path, indices=[0], nodes=1, nproc=1, python="p", workdir=tmp_path
    )
    # one node: torchrun's standalone rendezvous, no store to host
    assert "freeze.pipeline.slurm.store" not in one_node and "FREEZE_RDZV_STORE_HOST" not in one_node


def _fake_command(path: Path, body: str) -> str:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return str(path)


@pytest.mark.processes
def test_the_batch_shell_stops_the_store_only_after_srun_and_keeps_srun_s_exit_code(tmp_path):
    """The script itself, in bash, with srun, scontrol and the store replaced by commands that log
    what they see: the time limit's USR1 during srun requeues without stopping the store."""
    bin_dir, events = tmp_path / "bin", tmp_path / "events.log"
    bin_dir.mkdir()
    _fake_command(
        bin_dir / "srun",
        'echo "srun start $FREEZE_RDZV_STORE_HOST" >> "$EVENTS"; sleep 2\necho "srun end" >> "$EVENTS"; exit 3\n',
    )
    _fake_command(bin_dir / "scontrol", 'echo "scontrol $*" >> "$EVENTS"\n')
    python = _fake_command(
        tmp_path / "python",
        'trap \'echo "store stopped" >> "$EVENTS"; exit 0\' TERM\n'
        'echo "store $FREEZE_RDZV_STORE_HOST" >> "$EVENTS"; while true; do sleep 0.1; done\n',
    )
    script = tmp_path / "job.sbatch"
    script.write_text(
        sbatch_script(
            SlurmOptions(),
            job_name="j",
            stage_dir=tmp_path,
            indices=[0],
            nodes=2,
            nproc=1,
            python=python,
            workdir=tmp_path,
        )
    )
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "EVENTS": str(events),
        **{"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "0", "SLURMD_NODENAME": "n0"},
        "SLURM_CPUS_PER_TASK": "1",
    }
    shell = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "srun start" not in (events.read_text() if events.exists() else ""):
            assert time.monotonic() < deadline, "srun never started"
            time.sleep(0.05)
        shell.send_signal(signal.SIGUSR1)  # the time limit's warning, while srun runs
        output = shell.communicate(timeout=60)[0].decode()
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait()
    assert shell.returncode == 3, output  # srun's code, not the store's
    logged = events.read_text().splitlines()
    assert {"store n0", "srun start n0"} <= set(logged) and "scontrol requeue 7_0" in logged
    assert logged.index("srun end") < logged.index("store stopped") == len(logged) - 1, logged


def _specs(tmp_path, grid=None, overrides=()):
    return expand(str(SMOKE), "st", grid or {"run.seed": [0, 1]}, ["dist.nproc=1", *overrides], str(tmp_path / "runs"))


def test_a_stage_folder_gives_back_each_runs_config(tmp_path):
    specs = _specs(tmp_path)
    stage = Stage.of("grid", specs)
    stage.write(specs, nodes=2)
    assert stage.path.parent == tmp_path / "runs" / "st" / ".scheduler" and stage.path.name.startswith("grid-")
    assert stage.nodes == 2 and stage.job_name == f"st-{stage.path.name}"
    assert Stage.of("grid", specs, nodes=2).path != stage.path  # another node count: other tasks, never re-attached
    assert [stage.spec(i).config for i in range(2)] == [s.config for s in specs]
    with pytest.raises(SweepError, match="no run at index 2"):
        stage.spec(2)
    # a changed grid gets its own folder: a task queued for the old one never runs another run
    assert Stage.of("grid", _specs(tmp_path, {"run.seed": [0, 2]})).path != stage.path
    assert Stage.of("grid", specs).path == stage.path


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_executor_arguments(parser)
    return parser.parse_args(list(argv))


def test_executor_flags_that_do_not_fit_are_one_line():
    assert isinstance(executor_from_args(_args()), SerialExecutor)
    assert executor_from_args(_args("--executor", "local", "--parallel", "2")) == LocalExecutor(2)
    shared = executor_from_args(_args("--executor", "local", "--parallel", "4", "--share-gpus"))
    assert shared == LocalExecutor(4, share_gpus=True)
    slurm = executor_from_args(_args("--executor", "slurm", "--slurm", "partition=gpu", "--emit-sbatch"))
    assert slurm.options.partition == "gpu" and slurm.emit_only
    for argv, message in (
        (("--parallel", "2"), "--parallel is an option of --executor local"),
        (("--share-gpus",), "--share-gpus is an option of --executor local"),
        (("--slurm", "time=5"), "--slurm is an option of --executor slurm"),
        (("--emit-sbatch",), "--emit-sbatch is an option of --executor slurm"),
        (("--executor", "local"), "--executor local needs --parallel N"),
        (("--executor", "slurm", "--slurm", "colour=red"), "slurm option 'colour' is unknown"),
    ):
        with pytest.raises(SweepError) as info:
            executor_from_args(_args(*argv))
        assert str(info.value).startswith(message)


def test_slots_give_each_run_its_own_cores_and_gpus(monkeypatch):
    slots = plan_slots(2, [0, 1, 2, 3, 4], gpus=["0", "1", "2", "3"], gpus_per_run=2)
    assert [s.cores for s in slots] == [(0, 1), (2, 3)] and [s.gpus for s in slots] == [("0", "1"), ("2", "3")]
    assert slots[1].env(2) == {
        "FREEZE_RUNS_SIDE_BY_SIDE": "2",
        "FREEZE_TASK_CORES": "2,3",
        "OMP_NUM_THREADS": "2",
        "CUDA_VISIBLE_DEVICES": "2,3",
    }
    with pytest.raises(ConfigError, match="--parallel 3: each run needs its own cores and this process may use 2"):
        plan_slots(3, [0, 1], gpus=[], gpus_per_run=0)
    with pytest.raises(ConfigError, match="3 runs x dist.nproc=2 GPUs each need 6, and 4 are visible .--share-gpus"):
        plan_slots(3, list(range(8)), gpus=["0", "1", "2", "3"], gpus_per_run=2)
    # shared: every run on the same first GPU(s), each on its own cores (the 10x annealing contrast's 4 arms)
    shared = plan_slots(4, list(range(16)), gpus=["0"], gpus_per_run=1, share_gpus=True)
    assert [s.gpus for s in shared] == [("0",)] * 4 and [s.cores for s in shared][3] == (12, 13, 14, 15)
    with pytest.raises(ConfigError, match="--parallel 2 --share-gpus: the runs share dist.nproc=2 GPUs, and 1 are"):
        plan_slots(2, list(range(4)), gpus=["0"], gpus_per_run=2, share_gpus=True)
    # inside an allocation (or on a shared box) this process sees GPUs 4-7: a child's list names those
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert visible_gpus(4) == ["4", "5", "6", "7"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus(2) == ["0", "1"]


def test_slurm_refuses_what_it_cannot_run_before_submitting(tmp_path, monkeypatch):
    specs = _specs(tmp_path)
    with pytest.raises(ConfigError, match="cluster.nodes is the emulated cluster on one machine"):
        SlurmExecutor(SlurmOptions(), emit_only=True).check(_specs(tmp_path / "c", overrides=["cluster.nodes=2"]))
    with pytest.raises(ConfigError, match="dist.device='cuda' asks for GPUs and --slurm gpus_per_worker is 0"):
        SlurmExecutor(SlurmOptions(), emit_only=True).check(_specs(tmp_path, overrides=["dist.device=cuda"]))
    with pytest.raises(ConfigError, match="gpus_per_worker=1 with dist.device='cpu'"):
        SlurmExecutor(SlurmOptions(gpus_per_worker=1), emit_only=True).check(
            _specs(tmp_path, overrides=["dist.device=cpu"])
        )
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no sbatch here
    with pytest.raises(
        SweepError, match="sbatch, squeue, sinfo, scontrol, scancel not on PATH: --executor slurm runs on a SLURM login"
    ):
        SlurmExecutor(SlurmOptions()).check(specs)


def _complete_run(run_dir: Path, config_toml: str, epoch_walls: list[float]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(config_toml)
    (run_dir / "manifest.json").write_text(json.dumps({"status": "complete"}))
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"epoch": i, "epoch_wall_s": s}) + "\n" for i, s in enumerate(epoch_walls))
    )


def test_a_time_limit_shorter_than_a_measured_epoch_is_refused(tmp_path):
    from freeze.pipeline.config import config_to_toml

    specs = _specs(tmp_path)
    check_time_limit(specs, 60)  # nothing measured yet: nothing to refuse
    # a complete run of the same shape (another policy and seed) measured a 95 s epoch
    other = _specs(tmp_path, {"run.seed": [9]}, ["freeze.policy=static:k=2"])[0]
    _complete_run(other.config.run_dir(), config_to_toml(other.config), [95.0, 40.0])
    with pytest.raises(
        SweepError, match=r"a task's life trains at most 60 s .* shorter than one epoch \(95 s measured in"
    ):
        check_time_limit(specs, 60)
    check_time_limit(specs, 120)
    # a run of another shape (a larger batch) says nothing about these runs' epochs
    check_time_limit(_specs(tmp_path / "b", overrides=["train.batch_size=64"]), 60)


def test_emit_sbatch_writes_a_stage_and_its_script_and_submits_nothing(tmp_path, capsys):
    from freeze.pipeline.sweep.cli import main

    sweep = tmp_path / "s.toml"
    sweep.write_text(
        f'[sweep]\nbase = "{SMOKE}"\nstudy = "em"\noverrides = ["dist.nproc=1"]\n[grid]\n"run.seed" = [0, 1, 2]\n'
    )
    argv = ["--sweep", str(sweep), "--out-dir", str(tmp_path / "runs"), "--executor", "slurm", "--emit-sbatch"]
    assert main([*argv, "--slurm", "partition=gpu,time=30,max_parallel=2"]) == 0
    out = capsys.readouterr().out
    (script,) = (tmp_path / "runs" / "em" / ".scheduler").glob("sweep-*/job.sbatch")
    assert f"submit it with: sbatch {script}" in out and "3 runs written into an sbatch script, not run" in out
    text = script.read_text()
    assert "#SBATCH --array=0-2%2" in text and "#SBATCH --partition=gpu" in text and "#SBATCH --time=30" in text
    assert not any((tmp_path / "runs" / "em").glob("seed=*"))  # no run started


def test_a_slurm_task_keeps_to_its_cpus_where_slurm_does_not_bind_them(monkeypatch):
    """TaskPlugin=task/none leaves the whole machine in a task's affinity mask: two tasks on one node
    each ran a thread per core (a new user's trial: epochs 8-15x slower than alone)."""
    import os

    from freeze.pipeline.runs import cores_allowed

    mask = len(os.sched_getaffinity(0))
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    assert cores_allowed() == 1
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(mask + 8))  # never more than the mask
    assert cores_allowed() == mask
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    assert cores_allowed() == mask


def test_a_run_refused_in_its_task_is_summed_up_by_its_one_line(tmp_path):
    """A run refused before it started (no CIFAR-10 offline) leaves nothing in its run directory:
    the driver names the task's own error line instead of 'ended with the run absent'."""
    from freeze.pipeline.sweep import SweepSummary
    from freeze.pipeline.sweep.executors import record_outcome

    (spec,) = _specs(tmp_path, {"run.seed": [0]})
    log = tmp_path / "0.log"
    log.write_text("== array task 0\nerror: could not download cifar-10 into data (no network)\n")
    summary = SweepSummary()
    record_outcome(summary, spec, False, log)
    assert summary.failed == [(spec.name, f"could not download cifar-10 into data (no network) (log: {log})")]


def test_sweep_overrides_on_the_command_line_apply_to_every_run_and_owned_keys_are_refused(tmp_path, capsys):
    from freeze.pipeline.sweep.cli import main

    sweep = tmp_path / "s.toml"
    sweep.write_text(f'[sweep]\nbase = "{SMOKE}"\nstudy = "ov"\n[grid]\n"run.seed" = [0, 1]\n')
    assert main(["--sweep", str(sweep), "--dry-run", "dist.nproc=1"]) == 0
    for override, says in (
        ("run.seed=3", "override 'run.seed=3': its grid varies it"),
        ("run.out_dir=x", "override 'run.out_dir=x': the sweep sets it for every run; accepted: any other "),
        ("dist.nproc=many", "dist.nproc"),
    ):
        assert main(["--sweep", str(sweep), "--dry-run", override]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
