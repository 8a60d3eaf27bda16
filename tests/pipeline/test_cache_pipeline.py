"""The activation cache inside the training pipeline: it changes the time, never the result."""

import json

import pytest
import torch

from tests.pipeline.test_pipeline import _common, _final, _run

pytestmark = pytest.mark.processes

# freezeout from 30 % of the run, decided every 2 steps: the cache is built mid-epoch and advanced.
# One worker: the exchange between ranks is tested in tests/test_cache.py.
CACHED = [
    "data.augment=views:2",
    "dist.nproc=1",
    "freeze.policy=freezeout:t0=0.3",
    "data.train_size=128",
    "train.epochs=2",
    "train.eval_every_epochs=2",
]


def test_parameters_with_the_cache_equal_those_without(tmp_path):
    for name, extra in (("off", []), ("memory", ["freeze.cache=memory"])):
        proc = _run(_common(tmp_path, name) + CACHED + extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt_off, metrics_off, _ = _final(tmp_path, "off")
    ckpt_on, metrics_on, _ = _final(tmp_path, "memory")
    assert [m["boundary"] for m in metrics_on] == [m["boundary"] for m in metrics_off]
    assert metrics_on[-1]["boundary"] >= 2
    for name, ref in ckpt_off["model"].items():
        assert torch.equal(ckpt_on["model"][name], ref), name
    assert all(m["cache"] is None for m in metrics_off)
    cache = [m["cache"] for m in metrics_on]
    assert cache[-1]["hit_rate"] > 0 and cache[-1]["bytes"] > 0 and cache[-1]["level"] >= 1
    assert sum(c["build_s"] for c in cache) > 0
    assert [step["op"] for step in ckpt_on["freezer"]["cache"]["lineage"]][:2] == ["build", "advance"]


def test_memory_cache_over_budget_mid_run_stops_with_one_line(tmp_path):
    # The boundary first moves at 30 % of the run; the stem's output for 256 keys (128 images x 2
    # views) does not fit in 1000 bytes: the run stops there, marked failed, with one line.
    proc = _run(_common(tmp_path, "tight") + CACHED + ["freeze.cache=memory", "freeze.cache_budget_bytes=1000"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "freeze.cache_budget_bytes" in lines[0] and "1,000 bytes" in lines[0], proc.stderr
    manifest = json.loads((tmp_path / "runs" / "smoke" / "tight" / "manifest.json").read_text())
    assert manifest["status"] == "failed"
