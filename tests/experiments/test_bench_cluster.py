"""experiments.bench_cluster: the engine benchmark on an emulated cluster (tiny MLP where namespaces
work, skipped with the reason elsewhere) and how its section lands in BENCH.md."""

import csv

import pytest

from experiments import bench_cluster as bc
from experiments import bench_workers as bw
from experiments.bench.sections import splice_section
from freeze.pipeline import markdown
from freeze.pipeline.cluster.net import unavailable_reason

REASON = unavailable_reason()


def test_schedule_measures_only_the_approaches_asked_for():
    plan = bw.schedule((0, 1), phase_ks=(1,), rounds=1, approaches=bc.APPROACHES, monitor_cell=False)
    assert [set(names) for _, _, names in plan] == [set(bc.APPROACHES), set(bc.APPROACHES) | {bw.NO_COMM}]


def test_section_replaces_the_previous_one_and_keeps_the_rest(tmp_path):
    md = tmp_path / "BENCH.md"
    md.write_text("# Engine\n\ntable\n")
    splice_section(md, bc.SECTION, "first", before_others=False)
    splice_section(md, bc.SECTION, "second", before_others=False)
    text = md.read_text()
    assert text.startswith("# Engine\n\ntable\n") and "second" in text and "first" not in text
    assert text.count(markdown.markers(bc.SECTION)[0]) == 1


@pytest.mark.processes
@pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")
def test_two_nodes_tiny_mlp_end_to_end(tmp_path):
    (tmp_path / "BENCH.md").write_text("# Engine\n")
    code = bc.main(
        ["--nodes", "2", "--bandwidths", "1gbit", "--ks", "0,2", "--steps", "1", "--warmup", "1"]
        + ["--batch-size", "8", "--out-dir", str(tmp_path), "--deadline-s", "180"]
        + ["--model", "mlp"]
    )
    assert code == 0
    rows = list(csv.DictReader((tmp_path / "bench_cluster.csv").read_text().splitlines()))
    cells = {(a, k) for a in bc.APPROACHES for k in ("0", "2")} | {(bw.NO_COMM, "0")}  # no-comm at phase k=0
    assert {(r["approach"], r["k"]) for r in rows} == cells
    engine = {r["k"]: r for r in rows if r["approach"] == bw.ENGINE}
    assert all(r["bytes_match_trainable"] == "True" for r in engine.values())
    md = (tmp_path / "BENCH.md").read_text()
    assert md.startswith("# Engine\n") and "### 2 nodes, links 1gbit" in md


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--bandwidths", "1gb"], "cluster.bandwidth: '1gb' is not accepted"),
        (["--nodes", "1"], "cluster.nodes: expected an integer >= 2"),
        (["--ks", "0,12"], "--ks [12] not accepted; accepted: 0..9 for resnet18"),
        (["--steps", "0"], "must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, expected):
    assert bc.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and expected in err
