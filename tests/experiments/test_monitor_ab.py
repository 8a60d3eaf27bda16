"""The monitor A/B bench (experiments/bench/monitor_ab.py) on the CPU: it loads the baseline from git,
interleaves every variant and writes both files; the numbers themselves are measured on a GPU."""

import csv
import shutil

import pytest

from experiments.bench import monitor_ab


@pytest.mark.processes  # git show
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git (the baseline is read from a commit)")
def test_the_ab_bench_interleaves_every_variant_and_writes_its_files(tmp_path):
    assert (
        monitor_ab.main(
            ["--baseline-rev", "HEAD", "--device", "cpu", "--rounds", "2", "--steps", "1", "--out", str(tmp_path)]
        )
        == 0
    )
    with open(tmp_path / "monitor_ab.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * len(monitor_ab.VARIANTS) * 2  # rounds x variants x track_summed
    assert {(r["variant"], r["track_summed"]) for r in rows} == {
        (v, s) for v in monitor_ab.VARIANTS for s in ("False", "True")
    }
    text = (tmp_path / "monitor_ab.md").read_text()
    assert "this-again" in text and "baseline" in text


@pytest.mark.processes  # git show
def test_a_baseline_commit_that_does_not_exist_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as err:
        monitor_ab.baseline_monitor_class("no-such-revision-0000")
    assert "--baseline-rev" in str(err.value) and "\n" not in str(err.value)


def test_an_unknown_device_is_refused_naming_the_accepted_ones(tmp_path, capsys):
    with pytest.raises(SystemExit):
        monitor_ab.main(["--baseline-rev", "HEAD", "--device", "tpu", "--out", str(tmp_path)])
    assert "accepted: cpu, cuda" in capsys.readouterr().err
