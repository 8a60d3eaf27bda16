"""Issue 50: the weak cases of the reliability probe (43 fault cases) after its first round, each now
refused in one line where it is first seen, or said; never a traceback or a silent number.

Cases: 9 (a hand-edited cost profile), 10 (FREEZE_CLUSTER_CORES), 13 (a diverged run), 24 (a resume
of a metrics line with a foreign key), 25 (impossible manifest values), 37 (a read-only report
folder), 22 and 42 (Ctrl-C at any instant of report, convert_runs and profile_run)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from freeze.pipeline.cluster.spec import CLUSTER_CORES_ENV, ClusterSpecError, run_cores
from freeze.pipeline.costmodel import ProfileError, load_profile
from freeze.pipeline.interrupts import INTERRUPTED_EXIT, InterruptGuard
from tests.processes import start_python

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "report/horizon/profile-loopback-adamw.json"
SMOKE = REPO / "experiments/configs/smoke.toml"
FIXTURE_RUNS = REPO / "tests/fixtures/runs"


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# ----------------------------------------------------------------------- case 9: a hand-edited profile
def _edited_profile(tmp_path: Path, edit) -> Path:
    profile = json.loads(PROFILE.read_text())
    edit(profile)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(profile))
    return path


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda p: p.update(meta="measured by hand"), "profile meta: expected an object"),
        (lambda p: p["meta"].update(layout="c0t1-c1t1"), "profile meta.layout: expected a list of"),
        (lambda p: p["meta"]["layout"][0].update(threads="1"), "profile meta.layout[0]: expected a list of"),
        (lambda p: p["meta"]["layout"][1].pop("threads"), "profile meta.layout[1]: expected a list of"),
        (lambda p: p["blocks"][3].update(forward_ms=1e308), "blocks[3] (layer2.0).forward_ms: expected a number from"),
        (lambda p: p.update(forward_overhead_ms=1e308), "forward_overhead_ms: expected a number from 0 to 3.6e+06"),
    ],
)
def test_a_hand_edited_profile_is_refused_in_one_line_naming_the_field(tmp_path, edit, expected):
    """Was: ValueError/TypeError tracebacks from both ranks, 1e308 ms reaching the workers as an
    infinite price, and threads "1" refused with "measured in c0t1-c1t1, this run's is c0t1-c1t1"."""
    path = _edited_profile(tmp_path, edit)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert expected in _one_line(str(err.value)) and str(path) in str(err.value)


def test_the_launcher_refuses_a_malformed_profile_before_any_worker(tmp_path):
    from freeze.pipeline.config import ConfigError, load_config
    from freeze.pipeline.preflight import check_profile_fits

    path = _edited_profile(tmp_path, lambda p: p.update(meta=["not", "an", "object"]))
    config = load_config(REPO / "experiments/configs/fdsl32_finetune.toml", ["optim.name=adamw"], check_files=False)
    with pytest.raises(ConfigError) as err:
        check_profile_fits(config, str(path))
    assert _one_line(str(err.value)).startswith(f"freeze.cost_profile: {path} cannot be read")


# ----------------------------------------------------------------------- case 10: FREEZE_CLUSTER_CORES
@pytest.mark.parametrize("named", ["0,one", "0,,1", "0,0", "-1", " 0"])
def test_a_malformed_or_foreign_cluster_cores_variable_is_refused_naming_it(monkeypatch, named):
    monkeypatch.setenv(CLUSTER_CORES_ENV, named)
    with pytest.raises(ClusterSpecError) as err:
        run_cores()
    assert _one_line(str(err.value)).startswith(f"{CLUSTER_CORES_ENV}={named!r}: accepted:")


@pytest.mark.parametrize(
    "cores, says",
    [
        ("0,one", f"error: {CLUSTER_CORES_ENV}='0,one': accepted"),
        # a well-formed list of cores this process cannot run on (the probe's case 10: 23 lines, exit 1)
        ("4096,4097", f"error: {CLUSTER_CORES_ENV}=4096,4097: cores 4096, 4097 are not this process's to run on"),
    ],
)
def test_profile_run_refuses_a_bad_cluster_cores_variable_before_measuring(monkeypatch, capsys, tmp_path, cores, says):
    """Was: a 21-line ClusterSpecError traceback from inside the measurement (malformed), and a
    23-line OSError traceback from the pinned child (foreign cores)."""
    import experiments.profile_run as profile_run

    monkeypatch.setenv(CLUSTER_CORES_ENV, cores)
    out = tmp_path / "profile.json"
    assert profile_run.main(["--config", str(SMOKE), "--out", str(out)]) == 2
    assert _one_line(capsys.readouterr().err).startswith(says)
    assert not out.exists()


def test_a_layout_laid_over_the_variable_names_it_when_it_does_not_match(monkeypatch):
    """Was: `5,6` (or `0`) blamed the profile without naming the variable that moved the layout."""
    from freeze.pipeline.config import ConfigError, load_config
    from freeze.pipeline.pricing import run_pricing

    monkeypatch.setenv(CLUSTER_CORES_ENV, "0")
    overrides = ["optim.name=adamw", "optim.weight_decay=0.01", "freeze.policy=horizon:exchange=10"]
    overrides += ["dist.nproc=2", f"freeze.cost_profile={PROFILE}"]
    cfg = load_config(REPO / "experiments/configs/fdsl32_finetune.toml", overrides, check_files=False)
    with pytest.raises(ConfigError) as err:
        run_pricing(cfg, 34, [b.name for b in load_profile(PROFILE).blocks])
    assert f"(laid over {CLUSTER_CORES_ENV}=0)" in _one_line(str(err.value))


# ----------------------------------------------------------------------- case 13: a diverged run
def test_a_diverged_epoch_is_a_warning_in_the_log(caplog):
    """Was: the run completed with train loss nan and nothing said so."""
    from freeze.pipeline.schema import EpochRecord
    from freeze.pipeline.train import _log_epoch

    fields = dict.fromkeys(EpochRecord.__dataclass_fields__, 0)
    record = EpochRecord(**{**fields, "train_loss": float("nan"), "val_acc": None, "test_acc": None})
    logger = logging.getLogger("freeze.test.diverged")
    with caplog.at_level(logging.INFO, logger=logger.name):
        _log_epoch(logger, record, epochs=3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "epoch 1/3: train loss nan: the run diverged" in warnings[0]


# ----------------------------------------------------------------------- case 25: impossible manifests
@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"epochs_done": 50, "epochs_planned": 5}, "key 'epochs_done' must be an integer from 0 to epochs_planned (5)"),
        ({"num_classes": 0}, "key 'num_classes' must be an integer >= 1, got 0"),
        ({"test_images": "many"}, "key 'test_images' must be an integer >= 1"),
    ],
)
def test_a_manifest_with_impossible_values_is_refused_by_the_report(tmp_path, changes, expected):
    from freeze.pipeline.report import ReportInputError
    from freeze.pipeline.report.load import read_manifest

    manifest = {"group": "g", "policy": "none", "seed": 0, "world_size": 2, "status": "complete"}
    manifest.update(epochs_planned=2, epochs_done=2, block_names=["a", "b"], num_classes=10)
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, **changes}))
    with pytest.raises(ReportInputError) as err:
        read_manifest(tmp_path / "manifest.json")
    assert expected in _one_line(str(err.value))


# ----------------------------------------------------------------------- case 37: a read-only folder
def test_a_report_folder_that_cannot_be_written_is_refused_before_the_work(tmp_path, monkeypatch, capsys):
    """Was: a 20-line OSError traceback after the tables were computed, exit 1. Root passes every
    permission check, so the read-only file system is what the write check meets."""
    import tempfile

    from freeze.pipeline.report.cli import main

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    out = tmp_path / "report"
    out.mkdir()
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    assert main([str(FIXTURE_RUNS), "--out", str(out)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert (
        line
        == f"report: error: output folder {out}: {out} cannot be written (Read-only file system); give a writable folder"
    )
    assert list(out.iterdir()) == []


def test_a_disk_that_fills_up_mid_report_is_one_line_and_keeps_the_earlier_report(tmp_path, monkeypatch, capsys):
    """The probe's case 37 on a full 64 kB tmpfs: the folder was left holding part of the report
    (summary.md written, summary.tex not, the earlier figures gone). Now it is built aside and moved
    in whole, so the earlier report stays as it was and the line says so."""
    import freeze.pipeline.report.build as build
    from freeze.pipeline.report.cli import main

    out = tmp_path / "report"
    out.mkdir()
    earlier = {"summary.md": "an earlier report's table", "pareto.png": "an earlier report's figure"}
    for name, text in earlier.items():
        (out / name).write_text(text)
    written = []

    def fills_up(path, text, *args, **kwargs):
        if written:
            raise OSError(28, "No space left on device", str(path))
        written.append(path)
        Path(path).write_text(text)

    monkeypatch.setattr(build, "atomic_write_text", fills_up)
    assert main([str(FIXTURE_RUNS), "--out", str(out)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"report: error: cannot write {out / 'summary.tex'}: No space left on device;")
    assert line.endswith("the output folder holds the report it held before: free space and run it again")
    assert {p.name: p.read_text() for p in out.iterdir()} == earlier  # nothing of this one, no build folder


# ----------------------------------------------------------------------- cases 22 and 42: Ctrl-C
def test_an_interrupted_report_leaves_the_earlier_one_whole(tmp_path, monkeypatch, capsys):
    """Was: a cut mid-figures left the earlier report's figures beside this one's tables (then: the
    earlier figures removed first, the folder holding part of this report)."""
    import freeze.pipeline.report.plots as plots
    from freeze.pipeline.report.cli import main

    out = tmp_path / "report"
    out.mkdir()
    earlier = {"main.md": "an earlier report's table", "accuracy_vs_time.png": "an earlier report's figure"}
    for name, text in earlier.items():
        (out / name).write_text(text)

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "write_plots", cut)
    assert main([str(FIXTURE_RUNS), "--out", str(out)]) == INTERRUPTED_EXIT
    assert _one_line(capsys.readouterr().err).startswith("report: interrupted: the output folder holds the report")
    assert {p.name: p.read_text() for p in out.iterdir()} == earlier


def test_a_report_replaces_the_earlier_one_whole_and_drops_its_figures_it_did_not_draw(tmp_path, capsys):
    """A complete report over an earlier one: every file of this one, no figure of the earlier one
    that this one did not draw, no build folder of its own; the build folder a killed report left (its
    lock held by nobody) is removed, that of a report building beside it (its lock held) is kept."""
    from freeze.pipeline.report.build import STAGING_LOCK, STAGING_PREFIX
    from freeze.pipeline.report.cli import main

    out = tmp_path / "report"
    killed, building = out / f"{STAGING_PREFIX}killed", out / f"{STAGING_PREFIX}building"
    for folder in (killed, building):
        folder.mkdir(parents=True)
        (folder / STAGING_LOCK).touch()
    (out / "eta_of_a_group_gone.png").write_text("an earlier report's figure")
    (out / "main.md").write_text("an earlier report's table")
    holder = os.open(building / STAGING_LOCK, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: it conflicts even within this process
        assert main([str(FIXTURE_RUNS), "--out", str(out), "--formats", "md,png"]) == 0
    finally:
        os.close(holder)
    names = {p.name for p in out.iterdir()}
    assert "eta_of_a_group_gone.png" not in names and not killed.exists()
    assert [n for n in names if n.startswith(STAGING_PREFIX)] == [building.name]
    assert {"main.md", "paired.md", "tables.md", "accuracy_vs_time.png"} <= names
    assert (out / "main.md").read_text() != "an earlier report's table"


def test_a_ctrl_c_while_the_report_moves_in_lands_after_the_last_file(tmp_path, monkeypatch, capsys):
    """The renames into the folder are the one moment a Ctrl-C could leave half of each report: it is
    held until the last one and then ends the command as interrupted, the new report whole."""
    import freeze.pipeline.report.build as build
    from freeze.pipeline.report.cli import main

    out = tmp_path / "report"
    out.mkdir()
    (out / "main.md").write_text("an earlier report's table")
    renames, real_replace = [], os.replace

    def replace_under_ctrl_c(src, dst):
        if Path(dst).parent == out:  # a rename into the folder, not a file written in the build folder
            if not renames:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # where the handler would run
            renames.append(Path(dst).name)
        real_replace(src, dst)

    monkeypatch.setattr(build.os, "replace", replace_under_ctrl_c)
    assert main([str(FIXTURE_RUNS), "--out", str(out), "--formats", "md"]) == INTERRUPTED_EXIT
    assert _one_line(capsys.readouterr().err).startswith("report: interrupted:")
    assert len(renames) > 10 and sorted(p.name for p in out.iterdir()) == sorted(renames)
    assert (out / "main.md").read_text() != "an earlier report's table"


def test_a_rename_that_fails_part_way_says_the_folder_holds_part_of_the_report(tmp_path, monkeypatch, capsys):
    import freeze.pipeline.report.build as build
    from freeze.pipeline.report.cli import main

    out = tmp_path / "report"
    renames, real_replace = [], os.replace

    def fails_second(src, dst):
        if Path(dst).parent == out:  # a rename into the folder, not a file written in the build folder
            if renames:
                raise OSError(5, "Input/output error", str(dst))
            renames.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(build.os, "replace", fails_second)
    assert main([str(FIXTURE_RUNS), "--out", str(out), "--formats", "md"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.endswith(
        "Input/output error; the output folder holds part of this report: run it again once it can be written"
    )
    assert [p.name for p in out.iterdir()] == ["summary.md"]  # the first rename; no build folder left


def test_a_ctrl_c_a_library_swallows_still_ends_the_report_as_interrupted(tmp_path, monkeypatch, capsys):
    """Was: once in the probe the interrupt was dropped in a weakref callback inside matplotlib and the
    report ended with exit 0 as if complete."""
    import freeze.pipeline.report.build as build
    from freeze.pipeline.report.cli import main

    def swallowing(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)  # the handler runs here
        except KeyboardInterrupt:
            pass  # what "Exception ignored in: <weakref callback>" amounts to
        return {}

    monkeypatch.setattr(build, "build_report", swallowing)
    assert main([str(FIXTURE_RUNS), "--out", str(tmp_path / "report")]) == INTERRUPTED_EXIT
    assert _one_line(capsys.readouterr().err).startswith("report: interrupted:")


def test_the_guard_gives_the_previous_handler_back():
    before = signal.getsignal(signal.SIGINT)
    with InterruptGuard() as guard:
        assert signal.getsignal(signal.SIGINT) != before and not guard.seen
    assert signal.getsignal(signal.SIGINT) is before


def test_convert_runs_says_interrupted_when_a_ctrl_c_was_swallowed(tmp_path, monkeypatch, capsys):
    import experiments.convert_runs as convert_runs

    runs = tmp_path / "runs"
    shutil.copytree(FIXTURE_RUNS, runs)

    def swallowing(run_dir, dry_run=False):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
        except KeyboardInterrupt:
            pass
        return []

    monkeypatch.setattr(convert_runs, "convert_run", swallowing)
    assert convert_runs.main([str(runs)]) == INTERRUPTED_EXIT
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("interrupted: 0 run(s) converted before it, the one it was converting maybe in part")


@pytest.mark.processes
@pytest.mark.parametrize(
    ("command", "finished"),
    [
        (["-m", "report", str(FIXTURE_RUNS), "--out", "{tmp}/report"], "report: wrote"),
        (["-m", "experiments.convert_runs", "{tmp}", "--dry-run"], "convert_runs: would convert"),
        (["-m", "experiments.profile_run", "--config", str(SMOKE), "--out", "{tmp}/profile.json"], "profile of"),
    ],
    ids=["report", "convert_runs", "profile_run"],
)
@pytest.mark.parametrize("after_s", [0.4, 1.5])
def test_a_ctrl_c_at_any_instant_is_one_line_and_exit_130(tmp_path, command, finished, after_s):
    """Was: in the first second (torch, pandas, matplotlib loading) a 40-70-line traceback, killed by
    SIGINT; profile_run's spawned children printed theirs too. The signal goes to the whole process
    group, as a terminal's Ctrl-C does."""
    argv = [part.replace("{tmp}", str(tmp_path)) for part in command]
    child = start_python(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(after_s)
    ended_before = child.poll() is not None
    if not ended_before:
        os.killpg(child.pid, signal.SIGINT)
    try:
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    if ended_before or finished in out:  # its work was done (a signal in the interpreter's exit kills it quietly)
        pytest.skip(f"the command finished before the signal (exit {child.returncode}); nothing to check")
    assert child.returncode == INTERRUPTED_EXIT, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "interrupted" in err
    assert not (tmp_path / "profile.json").exists()
