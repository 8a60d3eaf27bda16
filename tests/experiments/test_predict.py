"""experiments.predict: a profile and probes written by the test, a run directory's trajectory, and
one-line errors for bad input. Nothing is timed."""

import csv
import json
from pathlib import Path

import pytest

from experiments import predict
from tests.pipeline.test_costmodel import _probe, write_profile

FIXTURE_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "runs" / "fixture_study" / "autofreeze-s0"


def _inputs(tmp_path):
    profile = write_profile(tmp_path)
    probes = []
    for name, cap, slope in (("uncapped", None, 6e-9), ("capped", 1e9, 9e-9)):
        path = tmp_path / f"probe-{name}.json"
        path.write_text(json.dumps(_probe(2, cap, slope)))
        probes += ["--probe", str(path)]
    return profile, ["--profile", str(tmp_path / "profile.json"), *probes]


def test_run_trajectory_is_read_per_epoch():
    segments, info = predict.run_segments(FIXTURE_RUN)
    # steps 100, 200, 300 with boundary_at_epoch_start 0, 1, 2
    assert segments == [(100, 0), (100, 1), (100, 2)]
    assert info["measured_wall_s"] == pytest.approx(240.0) and info["arch"] == "resnet18"


def test_table_csv_figure_and_run_prediction(tmp_path, capsys):
    profile, args = _inputs(tmp_path)
    out = tmp_path / "out"
    code = predict.main([*args, "--workers", "2,4", "--bandwidth", "1gbit,uncapped", "--cache", "--out-dir", str(out)])
    assert code == 0
    rows = list(csv.DictReader((out / "predict.csv").read_text().splitlines()))
    # 2 worker counts x 2 links x (cache off, on) x 2 boundaries
    assert len(rows) == 16 and {r["k"] for r in rows} == {"0", "1"}
    assert (out / "predict.png").stat().st_size > 0
    # cache on at k = 0 changes nothing
    on, off = (
        next(r for r in rows if r["k"] == "0" and r["cache"] == c and r["workers"] == "2") for c in ("True", "False")
    )
    assert on["step_ms"] == off["step_ms"]


def test_run_with_boundaries_outside_the_profile_is_refused(tmp_path, capsys):
    _, args = _inputs(tmp_path)
    # the fixture run reaches k = 2; the test profile has blocks 0 and 1
    assert predict.main([*args, "--run", str(FIXTURE_RUN), "--out-dir", str(tmp_path / "o")]) == 2
    assert "boundaries [2]" in capsys.readouterr().err


def test_run_prediction_sums_the_segments(tmp_path):
    profile, args = _inputs(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {"epoch": 0, "step": 10, "boundary_at_epoch_start": 0},
        {"epoch": 1, "step": 30, "boundary_at_epoch_start": 1},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out"
    assert (
        predict.main([*args, "--workers", "2", "--bandwidth", "1gbit", "--run", str(run), "--out-dir", str(out)]) == 0
    )
    text = (out / "predict.md").read_text()
    assert "30 optimizer steps in 2 epochs" in text


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--bandwidth", "fast"], "--bandwidth"),
        (["--comm-cpu-share", "2"], "--comm-cpu-share"),
        (["--run", "/nonexistent"], "metrics.jsonl"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, message):
    _, args = _inputs(tmp_path)
    assert predict.main([*args, *extra, "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_markdown_table_bytes():
    """The table's text, pinned as it was when it was written by hand (before freeze.pipeline.markdown)."""
    same = {"workers": 2, "bandwidth": "1gbit", "compute_ms": 12.34, "exposed_comm_ms": 5.0, "optimizer_ms": 0.44}
    same |= {"step_ms": 17.78, "speedup_vs_k0": 1.5, "allreduce_bytes": 44.7e6}
    rows = [{**same, "cache": cache, "k": k} for cache, k in ((False, 0), (True, 3))]
    assert predict.markdown(rows, "## H") == (
        "## H\n\n"
        "| workers | link | cache | k | compute ms | exposed comm ms | optimizer ms | step ms | x vs k=0 | MB/step |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
        "| 2 | 1gbit | off | 0 | 12.3 | 5.0 | 0.4 | 17.8 | 1.50 | 44.7 |\n"
        "| 2 | 1gbit | on | 3 | 12.3 | 5.0 | 0.4 | 17.8 | 1.50 | 44.7 |"
    )


def test_nodes_times_workers_per_node_is_one_ring_paced_by_the_link_between_nodes(tmp_path, capsys):
    """2 nodes x 8 GPUs could not be described (--workers was nodes with one worker each; F-C8)."""
    _, args = _inputs(tmp_path)
    out = {}
    for name, workers in (("2x8", ["--workers", "2", "--workers-per-node", "8"]), ("16x1", ["--workers", "16"])):
        out[name] = tmp_path / name
        assert predict.main([*args, *workers, "--bandwidth", "1gbit", "--out-dir", str(out[name])]) == 0
    rows = {name: list(csv.DictReader((d / "predict.csv").read_text().splitlines())) for name, d in out.items()}
    assert [(r["workers"], r["nodes"]) for r in rows["2x8"]] == [("16", "2")] * 2
    # the same ring of 16 on the same link: the same step, whichever way the workers sit
    assert [r["step_ms"] for r in rows["2x8"]] == [r["step_ms"] for r in rows["16x1"]]
    assert "8 workers per node" in (out["2x8"] / "predict.md").read_text()
    # the test's profile records no spread: said on stderr and in the tables, not silently ranked
    assert "records no spread of its step times" in capsys.readouterr().err
    assert "**Warning**" in (out["16x1"] / "predict.md").read_text()
