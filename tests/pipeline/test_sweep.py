"""A tiny sweep end to end: interrupted, re-run (skip complete, resume the rest), failures
recorded, and the report's main table checked against numbers computed here from metrics.jsonl."""

import csv
import json
import math
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from freeze.pipeline.study import splice_tables
from freeze.pipeline.sweep import SweepError, expand, read_sweep
from tests.processes import REPO, start_python

SMOKE = REPO / "experiments" / "configs" / "smoke.toml"
TINY = ["train.epochs=2", "data.train_size=128", "train.batch_size=32", "dist.nproc=1", "freeze.interval_steps=2"]


def _write_sweep(tmp_path: Path, grid: str, name: str = "sweep.toml", overrides: tuple[str, ...] = ()) -> Path:
    overrides = TINY + [f"data.root={tmp_path / 'data'}", *overrides]
    path = tmp_path / name
    path.write_text(f'[sweep]\nbase = "{SMOKE}"\nstudy = "tiny"\noverrides = {json.dumps(overrides)}\n[grid]\n{grid}\n')
    return path


def _sweep(path: Path, out_dir: Path, **kw) -> subprocess.Popen:
    args = ["-m", "freeze.pipeline.sweep", "--sweep", str(path), "--out-dir", str(out_dir)]
    return start_python(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


GRID = '"freeze.policy" = ["none", "static:k=3"]\n"run.seed" = [0, 1]'


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sweep")
    path = _write_sweep(tmp_path, GRID)
    out_dir = tmp_path / "runs"
    first = out_dir / "tiny" / "none_seed=0" / "manifest.json"
    second_metrics = out_dir / "tiny" / "none_seed=1" / "metrics.jsonl"
    proc = _sweep(path, out_dir)
    deadline = time.monotonic() + 180
    try:  # interrupt the sweep once run 2 has finished an epoch
        while not (first.exists() and second_metrics.exists() and second_metrics.read_text().strip()):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    interrupted = json.loads((out_dir / "tiny" / "none_seed=1" / "manifest.json").read_text())
    proc = _sweep(path, out_dir)
    out, _ = proc.communicate(timeout=300)
    return tmp_path, out_dir / "tiny", interrupted, proc.returncode, out


@pytest.mark.processes
def test_rerun_skips_complete_and_resumes_interrupted(swept):
    _, runs, interrupted, code, out = swept
    assert interrupted["status"] == "running"  # killed, not finished
    assert code == 0, out
    assert "none_seed=0: complete, skipped" in out
    assert "none_seed=1: resuming" in out
    assert "4 ran" not in out and "1 skipped (complete), 0 busy (another writer), 0 failed" in out
    # each run's closing report hint is left out: the sweep's own summary says what comes next
    # the sweep ends by saying it, once (issue 32: it printed no report command at all)
    assert out.count("done: results in") == 3 and out.count("report: python -m report") == 1
    assert out.rstrip().splitlines()[-1] == f"report: python -m report {runs}"
    # whole-sweep eta after each run, from the runs trained start to end here (the resumed one is no sample)
    assert "eta: 2 of 4 runs done; time left known after the first run trained here" in out
    assert "eta: 3 of 4 runs done; about " in out and "(1 run x " in out and "eta: all 4 runs done" in out
    for name in ("none_seed=0", "none_seed=1", "static-k=3_seed=0", "static-k=3_seed=1"):
        manifest = json.loads((runs / name / "manifest.json").read_text())
        assert manifest["status"] == "complete", name
        lines = (runs / name / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["epoch"] for line in lines] == [0, 1]


def _final(runs: Path, name: str, key: str) -> float:
    lines = (runs / name / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])[key]


@pytest.mark.processes
def test_report_main_table_matches_hand_computation(swept):
    from freeze.pipeline.report import build_report

    tmp_path, runs, *_ = swept
    written = build_report(runs, tmp_path / "report", formats=("md", "csv"))
    with open(tmp_path / "report" / "main.csv") as f:
        rows = {r["group"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"none", "static-k=3"}
    base = [_final(runs, f"none_seed={s}", "test_acc") for s in (0, 1)]
    static = [_final(runs, f"static-k=3_seed={s}", "test_acc") for s in (0, 1)]
    row = rows["static-k=3"]
    assert float(row["test_acc_mean"]) == pytest.approx(np.mean(static), abs=1e-12)
    expected_half = stats.t.ppf(0.975, 1) * np.std(static, ddof=1) / np.sqrt(2)
    assert float(row["test_acc_ci95"] or 0.0) == pytest.approx(expected_half, abs=1e-12)
    assert float(row["diff_points"]) == pytest.approx(100 * (np.mean(static) - np.mean(base)), abs=1e-9)
    if np.std(np.array(static) - np.array(base)) > 0:
        assert row["test"] == "paired"
        assert float(row["p_value"]) == pytest.approx(stats.ttest_rel(static, base).pvalue, rel=1e-9)
    static_time = np.mean([_final(runs, f"static-k=3_seed={s}", "cumulative_wall_s") for s in (0, 1)])
    assert float(row["wall_min"]) == pytest.approx(static_time / 60, rel=1e-12)
    ratios = [
        _final(runs, f"none_seed={s}", "cumulative_wall_s") / _final(runs, f"static-k=3_seed={s}", "cumulative_wall_s")
        for s in (0, 1)
    ]  # the speedup is the geometric mean of the per-seed ratios, as in the paired table
    assert float(row["speedup"]) == pytest.approx(math.sqrt(ratios[0] * ratios[1]), rel=1e-12)
    gb = (
        np.mean(
            [
                sum(
                    json.loads(line)["allreduce_bytes"]
                    for line in (runs / f"static-k=3_seed={s}" / "metrics.jsonl").read_text().splitlines()
                )
                for s in (0, 1)
            ]
        )
        / 1e9
    )
    assert float(row["allreduce_gb"]) == pytest.approx(gb, abs=1e-12)
    frozen = np.mean(
        [
            json.loads(line)["frozen_param_fraction"]
            for s in (0, 1)
            for line in (runs / f"static-k=3_seed={s}" / "metrics.jsonl").read_text().splitlines()
        ]
    )
    assert float(row["frozen_fraction"]) == pytest.approx(frozen, abs=1e-12)
    assert frozen > 0.0
    # REPORT.md-style splicing of the generated table
    doc = tmp_path / "REPORT.md"
    doc.write_text("intro\n<!-- main:start -->\nold\n<!-- main:end -->\nend\n")
    assert splice_tables(doc, tmp_path / "report") == ["main"]
    assert (tmp_path / "report" / "main.md").read_text().strip() in doc.read_text()
    assert "old" not in doc.read_text()
    assert any(str(p).endswith("main.md") for p in written.values())


def _file_size_limit(max_bytes: int):
    """A ``preexec_fn`` that caps every file the sweep and its workers write (``ulimit -f``, as a
    batch system or a quota sets it): a write past the cap fails with EFBIG (Python ignores SIGXFSZ)."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


@pytest.mark.processes
def test_failing_run_is_recorded_and_the_sweep_goes_on(tmp_path):
    # A failure only the run itself can meet: its first checkpoint outgrows the file-size limit
    # (resnet18 with SGD momentum ~90 MB, mobilenet_v3_small ~12 MB, limit 40 MB). 2 workers: the
    # sweep hosts torchrun's agent in-process for these; a worker failure must come back as a failed
    # run, not as an exception that ends the sweep.
    grid = '"model.arch" = ["resnet18", "mobilenet_v3_small"]\n"freeze.policy" = ["none"]\n"dist.nproc" = [2]'
    path = _write_sweep(tmp_path, grid, overrides=["train.epochs=1"])
    proc = _sweep(path, tmp_path / "runs", preexec_fn=_file_size_limit(40_000_000))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, out
    failed_dir = tmp_path / "runs" / "tiny" / "arch=resnet18_none_nproc=2"
    failed = json.loads((failed_dir / "manifest.json").read_text())
    assert failed["status"] == "failed", failed
    assert "checkpoint.pt" in failed["error"] and "File too large" in failed["error"]
    assert not [p.name for p in failed_dir.iterdir() if p.name.endswith((".pt", ".tmp"))]  # nothing half-written
    ok = json.loads((tmp_path / "runs" / "tiny" / "arch=mobilenet_v3_small_none_nproc=2" / "manifest.json").read_text())
    assert ok["status"] == "complete" and ok["world_size"] == 2
    assert "1 failed" in out and "failed: arch=resnet18_none_nproc=2: RunError: cannot write" in out


def test_bad_sweep_files_are_one_line_errors(tmp_path):
    with pytest.raises(SweepError, match="does not exist"):
        read_sweep(tmp_path / "missing.toml")
    bad = _write_sweep(tmp_path, '"optim.name" = ["adam"]')
    sweep = read_sweep(bad)
    with pytest.raises(SweepError, match=r"optim\.name: 'adam' is not accepted; accepted: sgd, adamw") as e:
        expand(sweep["base"], sweep["study"], sweep["grid"], sweep["overrides"])
    assert "\n" not in str(e.value)


def test_a_key_error_names_the_file_it_came_from(tmp_path, capsys):
    """A grid or override key of the sweep file names the sweep file; a key of the base config
    names the base file (and the sweep that uses it)."""
    from freeze.pipeline.sweep import main

    sweep = _write_sweep(tmp_path, '"freeze.polcy" = ["none"]')
    assert main(["--sweep", str(sweep), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: sweep file {sweep}: run polcy=none: ")
    assert "unknown key 'freeze.polcy' (did you mean 'freeze.policy'?); keys in [freeze]: policy" in err
    base = tmp_path / "base.toml"
    base.write_text(SMOKE.read_text().replace("[optim]", "[optim]\nlrr = 0.1", 1))
    sweep = tmp_path / "base_typo.toml"
    sweep.write_text(f'[sweep]\nbase = "{base}"\nstudy = "x"\n[grid]\n"run.seed" = [0]\n')
    assert main(["--sweep", str(sweep), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: sweep file {sweep}: ")
    assert f"config {base}: unknown key 'optim.lrr' (did you mean 'optim.lr'?); keys in [optim]: name, lr" in err


def test_each_run_starts_from_its_resolved_config_file(tmp_path, monkeypatch):
    import freeze.pipeline.sweep as sweep_module
    from freeze.pipeline.config import config_to_toml, load_config

    launched = []
    monkeypatch.setattr(
        sweep_module.runner, "launch_local", lambda path, nproc, resume, lock: launched.append(path) or 0
    )
    grid = {"freeze.policy": ["none", "static:k=3"], "dist.nproc": [2]}
    specs = expand(str(SMOKE), "tiny", grid, ["train.epochs=1"], str(tmp_path / "runs"))
    assert [s.name for s in specs] == ["none_nproc=2", "static-k=3_nproc=2"]
    assert sweep_module.run_specs(specs, log=lambda _: None).ran == [s.name for s in specs]
    for spec, path in zip(specs, launched):
        assert path == spec.config.run_dir() / "config.toml"
        assert path.read_text() == config_to_toml(spec.config)
        assert load_config(path) == spec.config


def test_a_grid_key_under_sweep_is_refused_not_run_once(tmp_path, capsys):
    """A guessed file with the grid under [sweep] used to dry-run as one run of the base config."""
    from freeze.pipeline.sweep import main

    guessed = tmp_path / "guessed.toml"
    guessed.write_text(
        f'[sweep]\nbase = "{SMOKE}"\nstudy = "x"\n"freeze.policy" = ["none", "static:k=2"]\nseeds = [0, 1, 2]\n'
    )
    assert main(["--sweep", str(guessed), "--dry-run"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and captured.out == ""
    assert "unknown key(s) 'freeze.policy', 'seeds' under [sweep]; accepted: base, study, overrides" in err


def test_an_unquoted_dotted_grid_key_says_to_quote_it(tmp_path, capsys):
    """TOML reads freeze.policy = [...] under [grid] as a table; the one line names the fix."""
    from freeze.pipeline.sweep import main

    unquoted = tmp_path / "unquoted.toml"
    unquoted.write_text(f'[sweep]\nbase = "{SMOKE}"\nstudy = "x"\n[grid]\nfreeze.policy = ["none", "static:k=2"]\n')
    assert main(["--sweep", str(unquoted), "--dry-run"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and captured.out == ""
    assert 'grid key freeze.policy is read as a table; quote dotted keys: "freeze.policy" = [...]' in err


def test_study_dry_run_lists_the_runs_of_the_readme_command(capsys, monkeypatch):
    """README, several machines: `python -m experiments.study --config .../study_cifar10.toml --dry-run`."""
    from freeze.pipeline.study import main

    monkeypatch.chdir(REPO)  # the README's command runs from the checkout's root
    assert main(["--config", "experiments/configs/study_cifar10.toml", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # the search (baseline + 11 candidates on seeds 100-103), then 31 arms (the frontier's 5 among them) x 5 seeds
    assert lines[-1] == "0 pretraining, 48 search and 155 study runs" and len(lines) == 204
    # docs/study.md plans with the count the dry run prints (it said 27: issue 32)
    study_md = (REPO / "docs" / "study.md").read_text()
    assert "203 runs" in study_md and '"0 pretraining, 48 search and 155 study runs"' in study_md
    assert sum(line.startswith("search    ") for line in lines) == 48
    assert "study     none_seed=0  (none)" in lines[48:79]


def test_an_interrupted_run_stops_the_sweep_and_the_next_run_never_starts(tmp_path, monkeypatch, capsys):
    # Seen in a study on the emulated cluster: the cluster's launcher catches Ctrl-C/SIGTERM to remove
    # its namespaces and returns 130, and the sweep went on with the next run, so neither Ctrl-C nor
    # `kill` could stop it. An interrupted run (130) must end the sweep with one line and code 130.
    import freeze.pipeline.sweep as sweep_module

    launched = []
    monkeypatch.setattr(
        sweep_module.runner, "launch_local", lambda path, nproc, resume, lock: launched.append(path) or 130
    )
    grid = '"freeze.policy" = ["none", "static:k=3"]\n"dist.nproc" = [2]'
    path = _write_sweep(tmp_path, grid, overrides=["train.epochs=1"])
    assert sweep_module.main(["--sweep", str(path), "--out-dir", str(tmp_path / "runs")]) == 130
    assert len(launched) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [sweep_module.INTERRUPTED_MESSAGE]
    # the run is called interrupted, not FAILED (exit code 130)
    assert "[1/2] none_nproc=2: interrupted (its completed epochs are kept)" in captured.out
    assert "FAILED" not in captured.out


def test_a_local_launch_gives_back_the_signal_handlers_torchrun_takes(monkeypatch):
    # torchrun's agent replaces SIGINT/SIGTERM handlers and never restores them; after one local run
    # a sweep's Ctrl-C raised torch's SignalException instead of KeyboardInterrupt (found in review).
    import torch.distributed.run as torchrun

    from freeze.pipeline import run as run_module

    def fake_agent(args):  # what torch's launcher does to the handlers
        signal.signal(signal.SIGINT, lambda *a: None)
        signal.signal(signal.SIGTERM, lambda *a: None)

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(torchrun, "run", fake_agent)
    assert run_module.launch_local(Path("unused.toml"), 2) == 0
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_eta_covers_the_whole_sweep_from_fresh_runs_only(tmp_path, monkeypatch):
    """A newcomer waited through `make study` and a sweep with only "[k/9]": no time left for the whole."""
    import freeze.pipeline.sweep as sweep_module

    eta = sweep_module.WorkEta(runs_total=10)
    eta.record(None)  # skipped as complete: done, but no sample of a run's length
    assert eta.line() == "eta: 1 of 10 runs done; time left known after the first run trained here"
    eta.record(30.0)
    eta.record(90.0)
    assert eta.line() == "eta: 3 of 10 runs done; about 7 min left (7 runs x 60 s, the mean of the 2 trained here)"
    eta.runs_total = 200
    assert "about 3 h 17 min left" in eta.line()

    # run_specs prints one such line after every run, and a study's stages share one WorkEta
    monkeypatch.setattr(sweep_module.runner, "launch_local", lambda path, nproc, resume, lock: 0)
    specs = expand(str(SMOKE), "tiny", {"run.seed": [0, 1]}, ["train.epochs=1"], str(tmp_path / "runs"))
    logged: list[str] = []
    shared = sweep_module.WorkEta(runs_total=5)
    sweep_module.run_specs(specs, log=logged.append, eta=shared)
    assert [line for line in logged if line.startswith("eta: ")][0].startswith("eta: 1 of 5 runs done; about ")
    assert shared.runs_done == 2 and len(shared.fresh_run_wall_s) == 2


def test_sweep_help_points_to_the_docs_page_that_has_the_section(capsys):
    import freeze.pipeline.sweep as sweep_module

    with pytest.raises(SystemExit):
        sweep_module.main(["--help"])
    assert 'docs/experiments.md, "Sweeps"' in capsys.readouterr().out
    assert "## Sweeps" in (REPO / "docs" / "experiments.md").read_text()


@pytest.mark.processes
def test_two_runs_side_by_side_each_on_its_own_core_end_as_one_after_another(tmp_path):
    """--executor local: runs side by side, each pinned to its own cores, each in its own task
    process; the manifests say the machine was shared, and the results are those of a serial sweep."""
    from tests.processes import run_python

    path = _write_sweep(tmp_path, '"run.seed" = [0, 1]', overrides=("dist.threads_per_worker=1",))
    args = ["-m", "freeze.pipeline.sweep", "--sweep", str(path)]
    side = run_python([*args, "--out-dir", str(tmp_path / "side"), "--executor", "local", "--parallel", "2"])
    assert side.returncode == 0, side.stdout[-3000:] + side.stderr[-3000:]
    assert "started on cores 0" in side.stdout and "started on cores 1" in side.stdout
    assert "sweep: 2 ran (0 of them resumed), 0 skipped (complete), 0 busy (another writer), 0 failed" in side.stdout
    serial = run_python([*args, "--out-dir", str(tmp_path / "serial")])
    assert serial.returncode == 0, serial.stderr[-3000:]
    import torch

    for seed in (0, 1):
        run = tmp_path / "side" / "tiny" / f"seed={seed}"
        placement = json.loads((run / "manifest.json").read_text())["placement"]
        assert placement["runs_side_by_side"] == 2 and placement["cores_allowed"] == 1
        a = torch.load(run / "model.pt", weights_only=True)
        b = torch.load(tmp_path / "serial" / "tiny" / f"seed={seed}" / "model.pt", weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_budgets_add_the_baseline_at_fewer_steps_after_each_baseline_run(tmp_path, capsys):
    """A user's own ablation asks the project's question: each seed block holds its own frontier."""
    from freeze.pipeline.sweep import main

    path = _write_sweep(tmp_path, '"run.seed" = [0, 1]\n"freeze.policy" = ["none", "static:k=3"]')
    path.write_text(path.read_text().replace("[grid]", "budgets = [0.5, 0.7]\n[grid]"))
    sweep = read_sweep(path)
    specs = expand(sweep["base"], sweep["study"], sweep["grid"], sweep["overrides"], budgets=sweep["budgets"])
    assert [s.name for s in specs] == [
        "seed=0_none", "seed=0_budget-0.5", "seed=0_budget-0.7", "seed=0_static-k=3",
        "seed=1_none", "seed=1_budget-0.5", "seed=1_budget-0.7", "seed=1_static-k=3",
    ]  # fmt: skip
    budget = {s.name: s.config for s in specs}["seed=1_budget-0.7"]
    assert (budget.freeze.policy, budget.train.budget_fraction, budget.run.group) == ("none", 0.7, "budget-0.7")
    # a budget run is the baseline on fewer steps even when the base file names another policy
    specs = expand(sweep["base"], sweep["study"], sweep["grid"], [*sweep["overrides"], "freeze.policy=autofreeze"],
                   budgets=[0.5])  # fmt: skip
    assert {s.name: s.config.freeze.policy for s in specs}["seed=0_budget-0.5"] == "none"
    assert {s.config.train.budget_fraction for s in specs if "budget" not in s.name} == {1.0}
    # the budget runs own train.budget_fraction: a command-line value would change them silently
    assert main(["--sweep", str(path), "--dry-run", "train.budget_fraction=0.9"]) == 2
    assert "override 'train.budget_fraction=0.9': its grid varies it" in capsys.readouterr().err


@pytest.mark.parametrize(
    "budgets, grid, expected",
    [
        ("[1.5]", '"freeze.policy" = ["none"]', r"budgets = \[1.5\]; accepted: a list of distinct fractions"),
        ("[0.5, 0.5]", '"freeze.policy" = ["none"]', "accepted: a list of distinct fractions"),
        ("[0.5]", '"freeze.policy" = ["static:k=3"]', 'accepted: "none" in grid."freeze.policy"'),
        ("[0.5]", '"freeze.policy" = ["none"]\n"train.budget_fraction" = [0.5]', "both set it"),
        # one frontier per setting: budgets of several learning rates would mix into one
        ("[0.5]", '"freeze.policy" = ["none"]\n"optim.lr" = [0.1, 0.01]', "budgets with grid keys optim.lr"),
    ],
)
def test_bad_budgets_are_one_line_before_any_run(tmp_path, budgets, grid, expected):
    path = _write_sweep(tmp_path, grid)
    path.write_text(path.read_text().replace("[grid]", f"budgets = {budgets}\n[grid]"))
    with pytest.raises(SweepError, match=expected) as refused:
        read_sweep(path)
    assert "\n" not in str(refused.value)
