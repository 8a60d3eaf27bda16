"""The horizon overhead bench (experiments/bench/horizon_overhead.py) on the CPU, tiny: every variant
interleaved, the monitor alone timed per configuration, both files written; the numbers it reports
come from a full run (report/horizon/overhead)."""

import csv

from experiments.bench import horizon_overhead


def test_the_overhead_bench_times_every_variant_and_the_monitor_alone(tmp_path):
    args = ["--device", "cpu", "--rounds", "2", "--steps", "2", "--probe-images", "8", "--out", str(tmp_path)]
    assert horizon_overhead.main(args) == 0
    with open(tmp_path / "horizon_overhead.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * len(horizon_overhead.VARIANTS)
    assert {r["variant"] for r in rows} == {"none", "none-again", "payoff", "horizon"}
    text = (tmp_path / "horizon_overhead.md").read_text()
    assert all(f"| {name} |" in text for name in horizon_overhead.MONITORS) and "One held-out check" in text
