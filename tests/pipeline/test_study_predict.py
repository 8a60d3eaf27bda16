"""The study's prediction stage: run directories, a profile and probes written here (nothing is
timed, no process is started), the predicted seconds, the table, missing probes, the study key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest

from freeze.pipeline.config import config_to_toml, load_config
from freeze.pipeline.costmodel import (
    CALIBRATION_FILE,
    CALIBRATION_FORMAT,
    Calibration,
    ClusterModel,
    Link,
    predict_run,
    save_calibration,
    save_profile,
)
from freeze.pipeline.study import cli, stages
from freeze.pipeline.study import predict as stage
from freeze.pipeline.sweep import SweepSummary
from freeze.pipeline.trajectory import TrajectoryError, read_trajectory
from tests.pipeline.test_costmodel import _probe, write_profile
from tests.pipeline.test_study import complete_manifest

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "experiments" / "configs" / "smoke.toml"
BATCH = 8  # the test profile's batch size (tests/pipeline/test_costmodel.write_profile)


def _config(study_dir: Path, group: str, seed: int, setting: str, *extra: str):
    overrides = [
        f"run.study={study_dir.name}",
        f"run.out_dir={study_dir.parent}",
        f"run.name={setting}_{group}_seed={seed}",
        f"run.group={group}",
        f"run.seed={seed}",
        f"run.setting={setting}",
        f"train.batch_size={BATCH}",
        *extra,
    ]
    return load_config(SMOKE, overrides, check_files=False)


def _write_run(config, epochs: list[tuple[int, int, float]]) -> Path:
    """A complete run directory: ``epochs`` = (optimizer steps, boundary at the epoch's start, epoch_wall_s)."""
    run_dir = config.run_dir()
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(config_to_toml(config))
    (run_dir / "manifest.json").write_text(json.dumps(complete_manifest(config, len(epochs), ["b0", "b1"])))
    lines, step, total_s = [], 0, 0.0
    for epoch, (steps, k, wall_s) in enumerate(epochs):
        step, total_s = step + steps, total_s + wall_s
        lines.append(
            {
                "epoch": epoch,
                "step": step,
                "boundary": k,
                "boundary_at_epoch_start": k,
                "frozen_param_fraction": 0.0,
                "val_acc": 0.5,
                "test_acc": 0.5,
                "epoch_wall_s": wall_s,
                "cumulative_wall_s": total_s,
                "phase_s": {"data": 0, "forward": 0, "backward": wall_s, "optimizer": 0, "freezer": 0, "eval": 1.0},
                "allreduce_bytes": 0,
                "grad_norm": {"eta": [None, None]},
            }
        )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run_dir


def _profile_for(tmp_path: Path, config):
    """The test's two-block profile (tests/pipeline/test_costmodel.py), named as the run's model and batch."""
    return write_profile(tmp_path, model=config.model.arch, batch_size=config.train.batch_size)


def _place_profile(tmp_path: Path, study_dir: Path, config) -> None:
    save_profile(_profile_for(tmp_path, config), stage.profile_path(study_dir, config))


def _probes(tmp_path: Path) -> Path:
    probe_dir = tmp_path / "probes"
    probe_dir.mkdir(exist_ok=True)
    (probe_dir / "probe-2xuncapped.json").write_text(json.dumps(_probe(2, None, 6e-9)))
    (probe_dir / "probe-2x1gbit.json").write_text(json.dumps(_probe(2, 1e9, 9e-9)))
    return probe_dir


def _no_measuring(config):
    raise AssertionError("the stage measured a profile it was given")


def test_single_worker_trajectory_is_worked_by_hand_and_the_table_follows(tmp_path):
    study_dir = tmp_path / "runs" / "s"
    single = ("dist.nproc=1",)
    # The test profile, one worker (no communication; the broadcast and all-reduces cost 0):
    #   k=0: forward 1 (overhead) + 5 + 5 = 11, backward b1 20 + b0 as first trainable 30 = 50,
    #        after 4  -> 65 ms
    #   k=1: forward 1 + 3 (b0 frozen) + 5 = 9, backward b1 as first 15, after 2 -> 26 ms
    # none:       30 steps at k=0 = 1.95 s, measured 2.0 and 3.0 s: errors -2.5 % and -35 %
    # static:     30 steps at k=1 = 0.78 s, measured 1.25 s twice: -37.6 %
    # autofreeze: 10 at k=0 then 20 at k=1 = 0.65 + 0.52 = 1.17 s, measured 1.3 s: -10 %
    runs = {
        ("none", 0): [(10, 0, 1.0), (20, 0, 1.0)],
        ("none", 1): [(10, 0, 1.5), (20, 0, 1.5)],
        ("static", 0): [(10, 1, 0.5), (20, 1, 0.75)],
        ("static", 1): [(10, 1, 0.5), (20, 1, 0.75)],
        ("autofreeze", 0): [(10, 0, 0.6), (20, 1, 0.7)],
    }
    policy = {"none": "none", "static": "static:k=1", "autofreeze": "autofreeze"}
    configs = {}
    for (group, seed), epochs in runs.items():
        configs[group, seed] = _config(study_dir, group, seed, "single", *single, f"freeze.policy={policy[group]}")
        _write_run(configs[group, seed], epochs)
    _place_profile(tmp_path, study_dir, configs["none", 0])
    table = stage.predict_study(study_dir, tmp_path / "no-probes-needed", log=print, measure=_no_measuring)

    profile = _profile_for(tmp_path, configs["none", 0])
    by_hand = predict_run(profile, ClusterModel(1, Link(0.0, None, 0.0)), [(10, 0), (20, 1)])
    assert by_hand.wall_s == pytest.approx(1.17)
    rows = table.data.set_index("group")
    assert rows.loc["autofreeze", "predicted_s"] == pytest.approx(1.17)
    assert rows.loc["autofreeze", "error_mean"] == pytest.approx((1.17 - 1.3) / 1.3)
    assert rows.loc["none", "n_runs"] == 2
    assert rows.loc["none", "measured_s"] == pytest.approx(2.5) and rows.loc["none", "predicted_s"] == pytest.approx(
        1.95
    )
    assert rows.loc["none", "error_mean"] == pytest.approx((-0.025 - 0.35) / 2)
    assert rows.loc["none", "error_worst_abs"] == pytest.approx(0.35)
    assert rows.loc["static", "measured_speedup"] == pytest.approx(2.5 / 1.25)
    assert rows.loc["static", "predicted_speedup"] == pytest.approx(1.95 / 0.78)
    static = next(r for r in table.display.to_dict("records") if r["group"] == "static")
    assert static["error % (mean)"] == "-37.6" and static["predicted speedup"] == "2.50x"
    assert any(note.startswith("measured = the runs' training wall time") for note in table.notes)


def test_cluster_run_uses_the_capped_probe_and_predict_run(tmp_path):
    study_dir = tmp_path / "runs" / "s"
    cluster = ("dist.nproc=1", "cluster.nodes=2", "cluster.bandwidth=1gbit")
    config = _config(study_dir, "none", 0, "cluster-1gbit", *cluster)
    _write_run(config, [(10, 0, 1.0), (20, 1, 1.0)])
    loopback = _config(study_dir, "none", 0, "loopback", "dist.nproc=2")
    _write_run(loopback, [(30, 0, 2.0)])
    for c in (config, loopback):
        if not stage.profile_path(study_dir, c).exists():  # one layout for both on a 2-core machine
            _place_profile(tmp_path, study_dir, c)
    table = stage.predict_study(study_dir, _probes(tmp_path), measure=_no_measuring)
    profile = _profile_for(tmp_path, config)
    # The probes' fit (tests/pipeline/test_costmodel.py, test_link_fitted_from_probes): alpha 1 ms per ring
    # step, gamma 1.2e-8 s/B, payload 1 / 9e-9 B/s on the 1 Gbit/s cap (89 % of it, so scaling the
    # fit to the same cap gives it back); loopback takes the uncapped fit (no payload cap).
    capped = Link(alpha_s=0.001, bandwidth_bytes_per_s=1 / 9e-9, gamma_s_per_byte=1.2e-8)
    expected = predict_run(profile, ClusterModel(2, capped, 0.5), [(10, 0), (20, 1)]).wall_s
    uncapped = predict_run(profile, ClusterModel(2, capped.with_bandwidth(None), 0.5), [(30, 0)]).wall_s
    rows = table.data.set_index("setting")
    assert rows.loc["cluster-1gbit", "predicted_s"] == pytest.approx(expected)
    assert rows.loc["loopback", "predicted_s"] == pytest.approx(uncapped)
    assert any("probe-2x1gbit.json" in note and "cluster-1gbit" in note for note in table.notes)


def test_the_calibration_beside_the_probes_sets_the_share_and_the_notes_say_so(tmp_path, monkeypatch):
    study_dir = tmp_path / "runs" / "s"
    config = _config(
        study_dir, "none", 0, "cluster-1gbit", "dist.nproc=1", "cluster.nodes=2", "cluster.bandwidth=1gbit"
    )
    _write_run(config, [(30, 0, 2.0)])
    _place_profile(tmp_path, study_dir, config)
    probe_dir = _probes(tmp_path)
    fitted_at = {"nodes": 2, "bandwidth": "1gbit", "k": 0, "cache": "off"}
    save_calibration(Calibration(0.12, fitted_at, "validate"), probe_dir / CALIBRATION_FILE)
    # The test profile's step hardly depends on the share, so the cluster the stage builds is checked.
    shares = []
    monkeypatch.setattr(
        stage,
        "predict_run",
        lambda p, cluster, *a, **kw: shares.append(cluster.comm_cpu_share) or predict_run(p, cluster, *a, **kw),
    )
    table = stage.predict_study(study_dir, probe_dir, measure=_no_measuring)
    assert shares == [0.12] and len(table.data) == 1
    assert any(note.startswith("comm_cpu_share 0.12 (fitted in") and "k 0" in note for note in table.notes)


def test_without_a_usable_calibration_the_share_is_the_default_and_the_note_says_why(tmp_path):
    assert stage.comm_cpu_share(tmp_path)[0] == stage.DEFAULT_COMM_CPU_SHARE == 0.5
    assert "no " in stage.comm_cpu_share(tmp_path)[1]
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"format": CALIBRATION_FORMAT, "comm_cpu_share": 3}))
    share, note = stage.comm_cpu_share(tmp_path)
    assert share == 0.5 and "comm_cpu_share 3: expected a number in [0, 1]" in note


def test_a_run_the_profile_cannot_predict_is_left_out_not_a_crash(tmp_path):
    study_dir = tmp_path / "runs" / "s"
    config = _config(
        study_dir,
        "static",
        0,
        "single",
        "dist.nproc=1",
        "freeze.policy=static:k=1",
        "freeze.cache=memory",
        "data.augment=views:1",
    )
    _write_run(config, [(10, 1, 1.0)])
    profile = _profile_for(tmp_path, config)
    blocks = [dataclasses.replace(b, cache_read_ms=None) for b in profile.blocks]  # a profile from before the cache
    save_profile(dataclasses.replace(profile, blocks=tuple(blocks)), stage.profile_path(study_dir, config))
    table = stage.predict_study(study_dir, tmp_path, measure=_no_measuring)
    assert table.data.empty
    assert any(
        n.startswith("left out 1 run(s): not predictable from profile") and "cache_read_ms" in n for n in table.notes
    )


def test_missing_probes_leave_those_settings_out_in_one_line(tmp_path, capsys):
    study_dir = tmp_path / "runs" / "s"
    cluster = _config(study_dir, "none", 0, "cluster-1gbit", "dist.nproc=1", "cluster.nodes=2")
    _write_run(cluster, [(10, 0, 1.0)])
    single = _config(study_dir, "none", 0, "single", "dist.nproc=1")
    _write_run(single, [(10, 0, 1.0)])
    _place_profile(tmp_path, study_dir, single)
    table = stage.predict_study(study_dir, tmp_path / "empty", measure=_no_measuring)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "probe-2x1gbit.json" in out[0] and "cluster-1gbit not predicted" in out[0]
    assert list(table.data["setting"]) == ["single"]  # the run needing no link is still predicted
    assert "left out 1 run(s): no link: probe file missing or unreadable" in table.notes


def test_runs_the_model_does_not_describe_are_left_out_with_the_reason(tmp_path):
    study_dir = tmp_path / "runs" / "s"
    _write_run(_config(study_dir, "none", 0, "single", "dist.nproc=1", "train.precision=bf16"), [(10, 0, 1.0)])
    table = stage.predict_study(study_dir, tmp_path, measure=_no_measuring)
    assert table.data.empty
    assert "left out 1 run(s): train.precision = bf16 (the profile is fp32)" in table.notes


def test_an_adamw_run_gets_its_own_profile_name(tmp_path):
    """AdamW is modelled (its profile times AdamW steps) under a name of its own; SGD keeps the old names."""
    study_dir = tmp_path / "runs" / "s"
    sgd = _config(study_dir, "none", 0, "single", "dist.nproc=1")
    adamw = _config(study_dir, "none", 0, "single", "dist.nproc=1", "optim.name=adamw", "optim.lr=1e-3")
    assert stage.unmodelled(adamw) is None
    assert stage.profile_path(study_dir, adamw).name == stage.profile_path(study_dir, sgd).name.replace(
        ".json", "-adamw.json"
    )


def test_trajectory_refuses_a_line_without_a_boundary(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"epoch": 0, "step": 3}) + "\n")
    with pytest.raises(TrajectoryError, match="boundary_at_epoch_start"):
        read_trajectory(tmp_path)
    # a torn last line (a crash mid-append) is dropped, as a resume drops it
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "boundary_at_epoch_start": 1}) + '\n{"step": 6, "bo')
    assert read_trajectory(tmp_path).segments == ((3, 1),)


# --- the study command ----------------------------------------------------------------------------

STUDY = f"""
[study]
name = "tiny"
finetune = "{SMOKE}"
seeds = [0, 1]
overrides = ["train.batch_size={BATCH}"]
predict = true
[settings]
single = ["dist.nproc=1"]
[arms]
none = ["freeze.policy=none"]
static = ["freeze.policy=static:k=1"]
"""


def _fake_runner(specs, log=print, eta=None):
    """Stands in for training: a complete run directory per spec, k=1 from the first step for static."""
    for spec in specs:
        k = 1 if spec.config.freeze.policy.startswith("static") else 0
        _write_run(spec.config, [(10, k, 1.0), (10, k, 1.0)])
    return SweepSummary(ran=[s.name for s in specs])


def test_study_predicts_once_reuses_the_profile_and_splices_the_table(tmp_path, monkeypatch, capsys):
    measured = []

    def measure(config):
        measured.append(config.run.name)
        return _profile_for(tmp_path / "profile-src", config)

    (tmp_path / "profile-src").mkdir()
    monkeypatch.setattr(stages, "run_specs", _fake_runner)
    monkeypatch.setattr(stage, "measure_profile", measure)
    report_md = tmp_path / "REPORT.md"
    report_md.write_text("<!-- predicted:start -->\nold\n<!-- predicted:end -->\n")
    path = tmp_path / "study.toml"
    path.write_text(STUDY.replace("predict = true", f'predict = true\nreport_md = "{report_md}"'))
    out_dir = tmp_path / "runs"
    assert cli.main(["--config", str(path), "--out-dir", str(out_dir), "--update-report"]) == 0
    assert len(measured) == 1  # one layout for the 4 runs
    profiles = list((out_dir / "tiny" / "costmodel").glob("profile-*.json"))
    assert len(profiles) == 1
    frame = pd.read_csv(out_dir / "tiny-report" / "predicted.csv")
    assert sorted(frame["group"]) == ["none", "static"] and set(frame["n_runs"]) == {2}
    # 20 steps at k=0: 20 x 65 ms; at k=1: 20 x 26 ms (worked in the first test); measured 2 s each
    assert frame.set_index("group")["predicted_speedup"]["static"] == pytest.approx(65 / 26)
    text = report_md.read_text()
    assert "\nold\n" not in text and "| measured train s (mean) |" in text
    # A second study run reuses the saved profile and never rewrites it.
    before = profiles[0].read_bytes()
    monkeypatch.setattr(
        stages, "run_specs", lambda specs, log=print, eta=None: SweepSummary(skipped=[s.name for s in specs])
    )
    assert cli.main(["--config", str(path), "--out-dir", str(out_dir)]) == 0
    assert len(measured) == 1 and profiles[0].read_bytes() == before
    assert cli.main(["--config", str(path), "--dry-run", "--out-dir", str(out_dir)]) == 0
    assert "predict   every study run's training time" in capsys.readouterr().out


def test_predict_key_must_be_a_boolean(tmp_path, capsys):
    path = tmp_path / "study.toml"
    path.write_text(STUDY.replace("predict = true", 'predict = "yes"'))
    assert cli.main(["--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "predict must be true or false, got 'yes'" in err and err.count("\n") == 1


def test_repo_study_files_opt_in_only_for_the_full_study():
    from freeze.pipeline.study.plan import read_study

    configs = REPO / "experiments" / "configs"
    assert read_study(configs / "study_offline_full.toml").predict is True
    assert read_study(configs / "study_offline.toml").predict is False  # the quick study stays under 10 minutes
