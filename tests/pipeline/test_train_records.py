"""What issue 35 added to each epoch record: the probes of train.probe_every_steps (accuracy on a
fixed validation subset between epoch ends, off the training clock, leaving the training itself
unchanged: a time to target that can see a late freeze) and the peak memory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import freeze.pipeline.run as run_module
from freeze.pipeline.config import ConfigError, load_config
from freeze.pipeline.report.load import load_run
from tests.processes import run_python

SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "configs" / "smoke.toml"


def _run(tmp_path: Path, name: str, *overrides: str) -> tuple[list[dict], dict]:
    # smoke.toml in one process, 3 steps of 8 images per epoch, 2 epochs; geometric freezes after epoch 1.
    small = ["train.batch_size=8", "train.max_steps_per_epoch=3"]
    args = ["--config", str(SMOKE), "dist.nproc=1", f"run.out_dir={tmp_path}", f"run.name={name}", *small, *overrides]
    assert run_module.main(args) == 0
    run = tmp_path / "smoke" / name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return records, torch.load(run / "model.pt", weights_only=True)


@pytest.mark.slow
def test_probes_read_the_fixed_subset_every_n_steps_off_the_clock_and_change_no_weight_and_memory_peaks_grow(
    tmp_path, monkeypatch
):
    from freeze.pipeline import runs

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(runs, "git_commit", lambda: None)  # the manifest's commit asks git: not this claim
    plain, plain_weights = _run(tmp_path, "plain")
    probed, probed_weights = _run(tmp_path, "probed", "train.probe_every_steps=4", "train.probe_val_size=40")
    assert [r["probes"] for r in plain] == [[], []]
    # every 4 steps, counted across epochs, and at the run's last step (6)
    assert [[p[0] for p in r["probes"]] for r in probed] == [[], [4, 6]]
    for record in probed:
        seconds = [p[1] for p in record["probes"]]
        assert seconds == sorted(seconds) and all(s <= record["epoch_wall_s"] for s in seconds)  # epoch train s so far
        # accuracy of 40 images: a multiple of 1/40
        assert all(0 <= p[2] <= 1 and round(p[2] * 40, 6) == int(round(p[2] * 40)) for p in record["probes"])
    assert all(torch.equal(plain_weights[k], probed_weights[k]) for k in plain_weights)
    assert [r["boundary"] for r in probed] == [r["boundary"] for r in plain]
    assert [r["val_acc"] for r in probed] == [r["val_acc"] for r in plain]
    # the peak memory of the process so far: positive, never decreasing, and at least the model's weights
    weights_bytes = sum(t.numel() * t.element_size() for t in probed_weights.values())
    peaks = [r["peak_memory_bytes"] for r in probed]
    assert peaks == sorted(peaks) and peaks[0] > weights_bytes
    # the report reads them as (cumulative train s, accuracy), epoch by epoch
    loaded = load_run(tmp_path / "smoke" / "probed")
    first_epoch_s = probed[0]["cumulative_wall_s"]
    assert loaded.probes == tuple(
        (p[1] + (first_epoch_s if e else 0.0), p[2]) for e, r in enumerate(probed) for p in r["probes"]
    )
    assert loaded.metrics["peak_memory_bytes"].tolist() == peaks


def test_probes_without_validation_images_are_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(SMOKE, ["data.val_size=0", "train.probe_every_steps=2"])
    assert str(err.value) == "train.probe_every_steps: the probes read validation images; accepted: data.val_size > 0"


@pytest.mark.processes
@pytest.mark.slow
def test_a_worker_s_peak_memory_is_its_own_not_the_peak_of_the_process_that_started_it():
    """ru_maxrss survives fork and exec on Linux: a worker started by a study holding 1.5 GB read at
    least 1.5 GB. VmHWM is the worker's own."""

    held = np.ones(1_500_000_000 // 8)  # touched: resident in this process
    code = "from freeze.pipeline.log import process_peak_rss_bytes; print(process_peak_rss_bytes())"
    child = run_python(["-c", code], timeout_s=120)
    assert child.returncode == 0, child.stderr
    assert int(child.stdout) < 1_000_000_000 < held.nbytes  # importing torch takes a few hundred MB
