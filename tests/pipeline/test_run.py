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
