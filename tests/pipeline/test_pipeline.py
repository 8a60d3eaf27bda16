"""End-to-end runs of freeze.pipeline.run on tiny synthetic data (real processes, real gloo); the
refusals before any worker starts, in this process."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import freeze.pipeline.run as run_module
from tests.processes import REPO, python_env, run_python, start_python

SMOKE = REPO / "experiments" / "configs" / "smoke.toml"
# 3 epochs of 4 steps, a policy evaluation every 2 steps: autofreeze makes decisions within the run.
TINY = ["freeze.interval_steps=2", "train.epochs=3", "data.train_size=256", "train.batch_size=32"]


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_python(["-m", "freeze.pipeline.run", *args], env=env)


def _common(tmp_path: Path, name: str) -> list[str]:
    return [
        "--config",
        str(SMOKE),
        f"run.out_dir={tmp_path / 'runs'}",
        f"run.name={name}",
        f"data.root={tmp_path / 'data'}",
        "run.keep_checkpoint=true",  # these tests compare the final resume state (Freezer decisions)
        *TINY,
    ]


def _final(tmp_path: Path, name: str) -> tuple[dict, list[dict], dict]:
    run_dir = tmp_path / "runs" / "smoke" / name
    ckpt = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return ckpt, metrics, manifest


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("pipeline")
    (tmp_path / "tmp").mkdir()  # the launch's temp dir, to see what it leaves there
    proc = _run(_common(tmp_path, "straight") + ["dist.nproc=2"], env=python_env(TMPDIR=str(tmp_path / "tmp")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path, _final(tmp_path, "straight")


@pytest.mark.processes
def test_two_worker_run_end_to_end(uninterrupted):
    tmp_path, (ckpt, metrics, manifest) = uninterrupted
    assert manifest["status"] == "complete" and manifest["world_size"] == 2
    # Nothing left in the temp dir (torchrun's agent left a torchelastic_* folder per launch).
    assert list((tmp_path / "tmp").iterdir()) == []
    assert manifest["load_avg_1min_start"] >= 0 and manifest["load_avg_1min_end"] >= 0  # what it ran under
    # what the report needs to tell an arm that learned nothing (issue 32): 10 synthetic-target classes
    assert manifest["num_classes"] == 10 and manifest["test_images"] == 128  # smoke.toml: data.test_size
    # run.keep_checkpoint=true: the resume checkpoint stays beside the final weights, which equal its model
    weights = torch.load(tmp_path / "runs" / "smoke" / "straight" / "model.pt", weights_only=True)
    assert weights.keys() == ckpt["model"].keys() and all(torch.equal(weights[k], v) for k, v in ckpt["model"].items())
    assert [m["epoch"] for m in metrics] == [0, 1, 2]
    block_bytes = manifest["block_param_bytes"]
    for m in metrics:
        # every step all-reduces exactly the gradients of the blocks trainable at the end of the epoch
        assert (
            m["allreduce_bytes_per_step"] == sum(block_bytes[m["boundary"] :])
            or m["boundary"] != m["boundary_at_epoch_start"]
        )
        assert 0.0 <= m["test_acc"] <= 1.0 and m["val_acc"] is not None
        assert set(m["phase_s"]) == {"data", "forward", "backward", "optimizer", "freezer", "eval"}
        assert m["epoch_wall_s"] > 0 and len(m["grad_norm"]["summed"]) == len(block_bytes)
        # the decision log: one line per policy evaluation of the epoch (interval of 2 steps: 2 per epoch)
        assert len(m["policy_evaluations"]) == 2 and all("boundary" in line for line in m["policy_evaluations"])
        # ... and each boundary change as [step, boundary after], at an evaluation's step; the last
        # is the epoch's boundary
        changes = m["boundary_steps"]
        assert all(s in (m["step"] - 2, m["step"]) for s, _ in changes)
        assert (changes[-1][1] if changes else m["boundary_at_epoch_start"]) == m["boundary"]
    assert any(m["boundary_steps"] for m in metrics)  # autofreeze moved the boundary within the run
    assert metrics[-1]["cumulative_wall_s"] == pytest.approx(sum(m["epoch_wall_s"] for m in metrics))
    assert len(ckpt["freezer"]["monitor"]["history"]) == 6  # 12 steps / interval of 2
    # the writer keeps the contract the report reads (freeze.pipeline.schema owns its keys)
    from dataclasses import fields

    from freeze.pipeline.schema import RUN_STATUSES, EpochRecord, Manifest, RunEnd, field_types, required_fields

    types = field_types(Manifest)
    assert all(isinstance(manifest[k], types[k]) for k in required_fields(Manifest))
    assert manifest["status"] in RUN_STATUSES
    assert set(manifest) <= {f.name for f in (*fields(Manifest), *fields(RunEnd))}
    assert all(list(m) == [f.name for f in fields(EpochRecord)] for m in metrics)


@pytest.mark.processes
def test_killed_worker_is_restarted_and_resumes_to_the_same_result(uninterrupted, tmp_path):
    """torchrun --max-restarts 1: one worker is SIGKILLed after the first checkpoint; all workers
    restart, resume from the checkpoint, and finish with the uninterrupted run's exact parameters
    and freeze decisions."""
    straight_tmp, (ref_ckpt, ref_metrics, _) = uninterrupted
    args = _common(straight_tmp, "killed") + ["dist.nproc=2"]
    torchrun = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        f"--log-dir={tmp_path / 'torchrun-logs'}",  # a user's plain torchrun: its logs here, not in /tmp
        "-m",
        "freeze.pipeline.run",
        *args,
    ]
    proc = start_python(torchrun, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ckpt_path = straight_tmp / "runs" / "smoke" / "killed" / "checkpoint.pt"
    deadline = time.monotonic() + 180
    try:
        while not ckpt_path.exists():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within the deadline"
            time.sleep(0.05)
        workers = _children(proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "resumed" in out
    ckpt, metrics, manifest = _final(straight_tmp, "killed")
    assert manifest["status"] == "complete"
    # the manifest keeps both starts, the second at the checkpoint's epoch the workers went on from
    resumed_at = int(re.search(r"resumed \S+ at epoch (\d+)", out).group(1))
    assert [s["from_epoch"] for s in manifest["sessions"]] == [0, resumed_at] and resumed_at >= 1
    assert [m["epoch"] for m in metrics] == [0, 1, 2]  # re-run epochs are not duplicated
    assert [m["boundary"] for m in metrics] == [m["boundary"] for m in ref_metrics]
    assert ckpt["freezer"]["decisions"] == ref_ckpt["freezer"]["decisions"]
    for name, ref in ref_ckpt["model"].items():
        assert torch.equal(ckpt["model"][name], ref), name


@pytest.mark.processes
def test_completed_run_is_never_overwritten(uninterrupted):
    tmp_path, _ = uninterrupted
    before = (tmp_path / "runs" / "smoke" / "straight" / "metrics.jsonl").read_bytes()
    proc = _run(_common(tmp_path, "straight") + ["dist.nproc=2"])
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "is complete" in proc.stderr
    assert (tmp_path / "runs" / "smoke" / "straight" / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optim.name=adam", "optim.name"),
        ("train.epochs=0", "train.epochs"),
        ("freeze.policy=autofreeze:pct=5", "percentile"),
        ("model.weights=/nonexistent.pt", "model.weights"),
        ("data.dataset=imagenet", "data.dataset"),
    ],
)
def test_bad_config_is_one_line_and_writes_nothing(tmp_path, capsys, override, expected):
    # The launcher refuses before it starts a worker: its main() in this process is the command.
    assert run_module.main(_common(tmp_path, "bad") + [override]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_missing_dataset_is_one_line_error(tmp_path, capsys):
    # dist.nproc=1: this process is the worker, and refuses before the run starts
    threads = torch.get_num_threads()
    assert run_module.main(_common(tmp_path, "nodata") + ["data.dataset=cifar10", "dist.nproc=1"]) == 2
    assert torch.get_num_threads() == threads  # the worker's thread count was this process's for a while only
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "cifar-10-batches-py" in lines[0], err
    assert not (tmp_path / "runs" / "smoke" / "nodata" / "manifest.json").exists()


@pytest.mark.processes
def test_recipe_options_run_together(tmp_path):
    """AdamW + cosine with warm-up + label smoothing + bf16 autocast + 2-step gradient accumulation +
    gradient checkpointing + gradient clipping + step-level policy evaluation, in one short run."""
    proc = _run(
        _common(tmp_path, "recipe")
        + [
            "dist.nproc=1",
            "train.epochs=1",
            "optim.name=adamw",
            "optim.lr=0.001",
            "schedule.name=cosine",
            "schedule.warmup_epochs=0.5",
            "train.label_smoothing=0.1",
            "train.precision=bf16",
            "train.accumulate_steps=2",
            "train.grad_checkpointing=true",
            "train.batch_size=16",
            "optim.grad_clip_norm=1e-6",
            "freeze.track_summed_grads=true",  # the gradient statistics checked below (policy none reads none)
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, metrics, manifest = _final(tmp_path, "recipe")
    assert manifest["status"] == "complete"
    (m,) = metrics
    assert m["step"] == 256 // 16 // 2  # one optimizer step per 2 micro-batches
    assert m["lr"] == pytest.approx(0.0, abs=1e-12)  # cosine ends at min_lr = 0 after the last step
    assert m["train_loss"] > 0 and 0.0 <= m["test_acc"] <= 1.0
    # The monitor reads the gradients before clipping: clipped ones would all be below 1e-6.
    assert min(n for n in m["grad_norm"]["mean_step"] if n is not None) > 1e-3


@pytest.mark.processes
def test_readme_smoke_run_says_what_it_does_and_shows_a_freeze(tmp_path):
    """README's first command, `python -m experiments.run --config experiments/configs/smoke.toml
    dist.nproc=2` (only where its files go is changed): it says what it does before the first
    epoch, the boundary moves and the bytes per step drop within the run, and it ends with the run
    directory and the command that makes its report."""
    readme = (REPO / "README.md").read_text()
    assert "python -m experiments.run --config experiments/configs/smoke.toml dist.nproc=2" in readme
    out_dir, data = tmp_path / "runs", tmp_path / "data"
    proc = _run(["--config", str(SMOKE), "dist.nproc=2", f"run.out_dir={out_dir}", f"data.root={data}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = out_dir / "smoke" / "smoke"
    lines = [line.split(" ", 1)[1] if line[:2].isdigit() else line for line in proc.stdout.splitlines()]
    assert lines[0] == f"run {run_dir}: starting 2 workers"
    assert lines[1].startswith(f"run {run_dir}: 2 workers on cpu,") and "torch threads per worker" in lines[1]
    assert lines[2].startswith(f"results go to {run_dir.resolve()} on ")
    assert lines[3].startswith("data: 256 train / 64 val / 128 test images of synthetic-target in ")
    assert lines[4].startswith("model: resnet18 (weights none), 10 blocks, built in ")
    assert lines[-2:] == [f"done: results in {run_dir}", f"report: python -m report {run_dir.parent}"]

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # complete: the final weights stay, the resume checkpoint (90 MB for ResNet-18 with momentum) goes
    assert (run_dir / "model.pt").is_file() and not (run_dir / "checkpoint.pt").exists()
    weights = torch.load(run_dir / "model.pt", weights_only=True)
    assert "fc.weight" in weights and all(isinstance(v, torch.Tensor) for v in weights.values())
    moved = [m["epoch"] for m in metrics if m["boundary"] > 0]
    assert moved, "the smoke run froze nothing"
    after = [m for m in metrics if m["boundary_at_epoch_start"] > 0]
    assert after and after[0]["allreduce_bytes_per_step"] < metrics[0]["allreduce_bytes_per_step"]


@pytest.mark.processes
def test_an_annealed_clock_runs_on_two_workers_with_a_group_per_block(tmp_path):
    """Issue 46: at:anneal=W in the pipeline: one optimizer group per block (the factors need it),
    the freeze where the hard clock's would be, and the body's learning rate at zero by then."""
    args = _common(tmp_path, "annealed") + ["dist.nproc=2", "freeze.policy=at:k=2,t=0.5,anneal=0.25"]
    proc = _run(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt, metrics, manifest = _final(tmp_path, "annealed")
    groups = ckpt["optimizer"]["param_groups"]
    assert len(groups) == len(manifest["block_param_bytes"])
    assert manifest["policy"] == "at:k=2,t=0.5,anneal=0.25"
    assert [m["boundary"] for m in metrics] == [0, 2, 2]  # 12 steps: due at step 6, evaluated every 2
    # between steps every group holds the schedule's LR (the factor is on only inside optimizer.step)
    assert len({g["lr"] for g in groups}) == 1


def test_freezeout_as_published_needs_the_runs_cosine(tmp_path):
    from freeze.pipeline.config import ConfigError, load_config
    from freeze.pipeline.preflight import preflight

    base = [f"run.out_dir={tmp_path}", "freeze.policy=freezeout:t0=0.5,anneal=true"]
    with pytest.raises(ConfigError, match=r"^schedule: name=constant, .*accepted: schedule.name=cosine"):
        preflight(load_config(SMOKE, [*base, "schedule.name=constant"], check_files=False))
    with pytest.raises(ConfigError, match="warmup_epochs=0"):
        preflight(load_config(SMOKE, [*base, "schedule.name=cosine", "schedule.warmup_epochs=1"], check_files=False))
    preflight(load_config(SMOKE, [*base, "schedule.name=cosine"], check_files=False))
