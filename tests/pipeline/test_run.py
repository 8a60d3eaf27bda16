"""freeze.pipeline.run's launcher side: the config is resolved once and the workers get the file."""

from pathlib import Path

import pytest

import freeze.pipeline.run as run_module
from freeze.pipeline.config import config_to_toml, load_config
from freeze.pipeline.runs import RunDir

SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "configs" / "smoke.toml"


@pytest.fixture
def launches(monkeypatch) -> list[tuple]:
    calls = []
    monkeypatch.setattr(run_module, "launch_local", lambda *args: calls.append(args) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return calls


def _overrides(tmp_path: Path) -> list[str]:
    return [f"run.out_dir={tmp_path / 'runs'}", "run.name=launched", "optim.lr=0.07", "dist.nproc=2"]


def test_launcher_writes_the_resolved_config_and_workers_get_only_that_file(tmp_path, launches):
    overrides = _overrides(tmp_path)
    assert run_module.main(["--config", str(SMOKE), *overrides]) == 0
    ((resolved, nproc, resume, max_restarts, lock),) = launches
    expected = load_config(SMOKE, overrides)
    assert resolved == RunDir(expected.run_dir()).config_path
    assert resolved.read_text() == config_to_toml(expected)  # every key written out, overrides applied
    assert load_config(resolved) == expected  # what each worker loads: no override strings left
    assert (nproc, resume, max_restarts) == (2, False, 0)  # dist.nproc is the one worker-count knob
    assert lock.run_dir == expected.run_dir() and not lock.delegated  # the launcher held the run meanwhile


def test_launcher_refuses_progress_without_resume_before_starting_workers(tmp_path, launches, capsys):
    overrides = _overrides(tmp_path)
    run_dir = RunDir(load_config(SMOKE, overrides).run_dir())
    run_dir.path.mkdir(parents=True)
    run_dir.metrics_path.write_text('{"epoch": 0}\n')
    assert run_module.main(["--config", str(SMOKE), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --resume" in err
    assert launches == [] and not run_dir.config_path.exists()


def test_nproc_flag_is_gone(tmp_path, launches):
    with pytest.raises(SystemExit):
        run_module.main(["--config", str(SMOKE), "--nproc", "2"])


def _started_run(config) -> RunDir:
    run = RunDir(config.run_dir())
    run.create(config_to_toml(config), {"run_name": config.run.name, "epochs_planned": 3, "epochs_done": 1}, False)
    return run


def test_an_interrupted_launch_marks_the_run_and_prints_the_resume_command(tmp_path, monkeypatch, capsys):
    """What the launcher does when its workers stopped on Ctrl-C (exit code 130): one line, the
    command typed plus --resume, and the manifest says "interrupted" instead of "running"."""
    overrides = _overrides(tmp_path)
    config = load_config(SMOKE, overrides)
    monkeypatch.setattr(run_module, "launch_local", lambda *args: _started_run(config) and 130)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run_module.main(["--config", str(SMOKE), *overrides]) == 130
    err = capsys.readouterr().err
    assert err == (
        f"interrupted: {config.run_dir()} keeps its completed epochs; resume with: "
        f"python -m experiments.run --config {SMOKE} {' '.join(overrides)} --resume\n"
    )
    assert RunDir(config.run_dir()).status() == "interrupted"


@pytest.mark.parametrize("in_sweep", [False, True])
def test_an_interrupted_single_process_run_speaks_unless_a_sweep_started_it(tmp_path, monkeypatch, capsys, in_sweep):
    from freeze.pipeline.train import WorkerOutcome

    config = load_config(SMOKE, [*_overrides(tmp_path), "dist.nproc=1"])
    run = _started_run(config)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("FREEZE_IN_SWEEP", "1" if in_sweep else "0")
    outcome = WorkerOutcome()
    outcome.started = True
    assert run_module._interrupted(config, None, outcome, ["--config", "c.toml"]) == 130
    assert run.status() == "interrupted"
    err = capsys.readouterr().err
    assert err == (
        ""
        if in_sweep
        else f"interrupted: {config.run_dir()} keeps its completed epochs; resume with: "
        "python -m experiments.run --config c.toml --resume\n"
    )
