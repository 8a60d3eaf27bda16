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


def test_ctrl_c_before_the_run_started_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the workers still import: exit 130, but no line at all (and a traceback per worker)."""
    overrides = _overrides(tmp_path)
    monkeypatch.setattr(run_module, "launch_local", lambda *args: 130)  # stopped before any manifest
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run_module.main(["--config", str(SMOKE), *overrides]) == 130
    run_dir = load_config(SMOKE, overrides).run_dir()
    assert capsys.readouterr().err == f"interrupted: {run_dir} had not started; nothing was kept\n"
    assert not (tmp_path / "runs").exists()


def test_ctrl_c_after_the_run_completed_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    overrides = _overrides(tmp_path)
    config = load_config(SMOKE, overrides)
    monkeypatch.setattr(run_module, "launch_local", lambda *args: _started_run(config).finish("complete") and 130)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run_module.main(["--config", str(SMOKE), *overrides]) == 130
    assert capsys.readouterr().err == f"interrupted: {config.run_dir()} had completed; its results are kept\n"
    assert RunDir(config.run_dir()).status() == "complete"


def test_a_second_ctrl_c_and_one_during_teardown_raise_no_traceback(tmp_path, monkeypatch):
    """Ctrl-C at the very end (16 lines) or twice (42 lines): KeyboardInterrupt raised inside
    teardown_worker's gc.collect(), past run_worker's handlers."""
    import signal

    handlers = {}
    monkeypatch.setattr(signal, "signal", lambda sig, handler: handlers.setdefault(sig, handler))
    monkeypatch.setattr(run_module._Interrupt, "seen", False)
    run_module._Interrupt.install()
    with pytest.raises(KeyboardInterrupt):
        handlers[signal.SIGINT](signal.SIGINT, None)
    assert handlers[signal.SIGINT](signal.SIGINT, None) is None  # the second one: already stopping
    assert handlers[signal.SIGTERM](signal.SIGTERM, None) is None

    def interrupted_teardown():
        raise KeyboardInterrupt  # what the handler raised from gc.collect()

    monkeypatch.setattr(run_module._Interrupt, "seen", False)
    monkeypatch.setattr(run_module._Interrupt, "install", lambda: None)
    monkeypatch.setattr(run_module, "setup_worker", lambda dist_config: None)
    monkeypatch.setattr(run_module, "teardown_worker", interrupted_teardown)
    monkeypatch.setattr(run_module, "train_worker", lambda *args: None)
    config = load_config(SMOKE, [*_overrides(tmp_path), "dist.nproc=1"])
    assert run_module.run_worker(config, resume=False) == 0  # the run finished; the launcher says the rest


@pytest.mark.processes
def test_a_worker_interrupted_while_it_imports_exits_130_quietly(tmp_path):
    from freeze.pipeline.lifetime import worker_argv
    from tests.processes import run_python

    (tmp_path / "slow_import.py").write_text("raise KeyboardInterrupt  # Ctrl-C during 'import torch'\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}
    done = run_python(worker_argv("slow_import"), env=env)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "")
