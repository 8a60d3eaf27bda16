"""experiments.bench: the real launcher and workers on 2 gloo ranks with a tiny MLP and a tiny BERT
(the BERT-base rows' code path), plus the pure parts.

No timing is asserted (the machine is shared); what must hold exactly is the shape of the CSV and the
bytes each approach all-reduces per step.
"""

import csv

import pytest

from experiments import bench_workers as bw
from experiments.bench import cli, config, sections, text_report
from experiments.bench.rows import CSV_COLUMNS, write_csv
from freeze import split_blocks
from freeze.pipeline import markdown

TINY = config.BenchConfig(
    workers=2,
    model="mlp",
    batch_size=4,
    image_size=4,
    steps=2,
    rounds=2,
    warmup=1,
    ks=(0, 2),
    phase_ks=(0,),
    collective_timeout_s=30.0,
    cache_keys=24,
    cache_chunk=8,
)


CLUSTER_SECTION = "<!-- cluster-bench:start -->\ncluster\n<!-- cluster-bench:end -->\n\nprose after it\n"


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    (tmp / "out").mkdir()
    (tmp / "out" / "BENCH.md").write_text("# old main table\n\n" + CLUSTER_SECTION, encoding="utf-8")
    cli.run_benchmark(TINY, tmp / "out", workdir=tmp / "rdzv", deadline_s=120.0, command="pytest tiny bench")
    with open(tmp / "out" / "bench.csv", newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        rows = {(r["approach"], int(r["k"])): r for r in reader}
    return header, rows, (tmp / "out" / "BENCH.md").read_text(encoding="utf-8")


def _param_bytes_from(k: int) -> int:
    blocks = split_blocks(bw.build_model("mlp", TINY.image_size))
    return sum(p.numel() * p.element_size() for b in blocks[k:] for p in b.params)


@pytest.mark.processes
def test_csv_has_one_row_per_approach_and_k(bench_run):
    header, rows, _ = bench_run
    assert tuple(header) == CSV_COLUMNS
    expected = {(a, k) for a in bw.MAIN_APPROACHES for k in (0, 2)}
    expected |= {(bw.NO_COMM, 0), (bw.ENGINE_NO_MONITOR, 0), (bw.PREFIX_FORWARD, 2)}
    assert set(rows) == expected
    for row in rows.values():
        assert int(row["steps"]) == TINY.rounds * TINY.steps
        assert int(row["rounds"]) == TINY.rounds
        assert float(row["median_ms"]) > 0
        assert float(row["iqr_ms"]) >= 0
    assert float(rows[(bw.ENGINE, 0)]["frozen_param_fraction"]) == 0.0
    assert 0.0 < float(rows[(bw.ENGINE, 2)]["frozen_param_fraction"]) < 1.0
    assert float(rows[(bw.STATIC, 2)]["ratio_to_static"]) == pytest.approx(1.0)
    # comm estimate only where a no-comm run exists
    assert rows[(bw.ENGINE, 0)]["comm_est_ms"] != ""
    assert rows[(bw.ENGINE, 2)]["comm_est_ms"] == ""


@pytest.mark.processes
def test_cache_rows_carry_build_and_advance_times(bench_run):
    _, rows, md = bench_run
    cached = rows[(bw.ENGINE_CACHE, 2)]
    assert float(cached["cache_build_s"]) > 0 and cached["cache_advance_s"] == ""  # up from k=0: no advance
    # the MLP's cut before block 2 is its second Linear's input: 128 fp32 values per key
    assert int(cached["cache_bytes"]) == TINY.cache_keys * 128 * 4
    assert rows[(bw.ENGINE_CACHE, 0)]["cache_build_s"] == ""
    # every key read from the store at the cut k=2, none computed; nothing to serve at k=0
    assert int(cached["cache_hit_keys"]) > 0 and cached["cache_miss_keys"] == "0" and cached["cache_cut"] == "2"
    assert rows[(bw.ENGINE_CACHE, 0)]["cache_hit_keys"] == "0"
    section = md.split("## Activation cache (engine + cache)", 1)[1]
    assert "| 2 |" in section and section.count("| met |") + section.count("| **MISSED**") == 2


@pytest.mark.processes
@pytest.mark.parametrize("approach", [bw.ENGINE, bw.STATIC, bw.PER_PARAMETER, bw.ENGINE_CACHE])
@pytest.mark.parametrize("k", [0, 2])
def test_bytes_per_step_equal_trainable_bytes(bench_run, approach, k):
    _, rows, _ = bench_run
    row = rows[(approach, k)]
    assert int(row["trainable_grad_bytes"]) == _param_bytes_from(k)
    assert int(row["allreduce_bytes_per_step"]) == _param_bytes_from(k)
    assert row["bytes_match_trainable"] == "True"  # every step, on every rank


@pytest.mark.processes
@pytest.mark.parametrize("k", [0, 2])
def test_find_unused_sends_every_gradient(bench_run, k):
    _, rows, _ = bench_run
    assert int(rows[(bw.FIND_UNUSED, k)]["allreduce_bytes_per_step"]) == _param_bytes_from(0)
    assert rows[(bw.FIND_UNUSED, k)]["bytes_match_trainable"] == ("True" if k == 0 else "False")
    assert rows[(bw.NO_COMM, 0)]["allreduce_bytes_per_step"] == "0"


@pytest.mark.processes
def test_markdown_report(bench_run):
    _, _, md = bench_run
    assert "`pytest tiny bench`" in md
    assert "| 2 |" in md and "| 0 |" in md  # main-table rows
    targets = md.split("## Targets", 1)[1].split("\n\n", 2)[1].splitlines()[2:]
    assert len(targets) == 6
    assert all(("| met |" in t) or ("| **MISSED**" in t) for t in targets)
    assert "bytes all-reduced per step = trainable gradient bytes | met |" in md
    # the main table is rewritten; what other commands spliced in after it stays
    assert "# old main table" not in md and md.endswith("\n\n" + CLUSTER_SECTION)


def test_schedule_visits_k_up_then_down_with_extra_cells():
    plan = bw.schedule((0, 1, 2), phase_ks=(2,), rounds=2)
    assert [(r, k) for r, k, _ in plan] == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (1, 0)]
    names = {(r, k): set(n) for r, k, n in plan}
    assert bw.ENGINE_NO_MONITOR in names[(0, 0)] and bw.ENGINE_NO_MONITOR not in names[(0, 1)]
    assert bw.NO_COMM in names[(1, 2)] and bw.NO_COMM not in names[(1, 0)]
    assert all(set(bw.MAIN_APPROACHES) <= n for n in names.values())


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="model 'vgg' is not accepted; accepted: resnet18"):
        config.BenchConfig(model="vgg").validate()
    with pytest.raises(ValueError, match="steps must be >= 1"):
        config.BenchConfig(steps=0).validate()
    with pytest.raises(ValueError, match=r"ks contains 4; accepted: 0..3"):
        config.BenchConfig(model="mlp", ks=(0, 4)).resolved(4)
    with pytest.raises(ValueError, match=r"phase_ks \[1\] are not among"):
        config.BenchConfig(model="mlp", ks=(0, 2), phase_ks=(1,)).resolved(4)
    resolved = config.BenchConfig(model="resnet18").resolved(10)
    assert resolved.ks == tuple(range(10)) and resolved.phase_ks == (0, 5, 8, 9)


def test_cli_quick_sets_defaults_that_explicit_flags_override():
    parse = cli.get_args_parser().parse_args
    assert cli.config_from_args(parse([])).steps == config.BenchConfig().steps
    quick = cli.config_from_args(parse(["--quick"]))
    assert (quick.steps, quick.rounds) == (config.QUICK_STEPS, config.QUICK_ROUNDS)
    assert cli.config_from_args(parse(["--quick", "--steps", "7"])).steps == 7
    assert cli.config_from_args(parse(["--ks", "0,5,9"])).ks == (0, 5, 9)


def test_cli_rejects_bad_input(capsys):
    assert cli.main(["--model", "mlp", "--steps", "0"]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--ks", "a,b"])


def test_a_crash_while_writing_the_csv_keeps_the_previous_file(tmp_path, monkeypatch):
    import freeze._atomic

    rows = [dict.fromkeys(CSV_COLUMNS, 1)]
    write_csv(rows, tmp_path / "bench.csv")
    before = (tmp_path / "bench.csv").read_bytes()
    assert before.startswith(b"approach,k,") and before.endswith(b"\r\n")  # csv's own line ends, as before

    def dying_fsync(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(freeze._atomic.os, "fsync", dying_fsync)
    with pytest.raises(KeyboardInterrupt):
        write_csv([dict.fromkeys(CSV_COLUMNS, 2)], tmp_path / "bench.csv")
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["bench.csv"]
    assert (tmp_path / "bench.csv").read_bytes() == before


def test_combine_ranks_takes_the_slowest_rank_and_rank0_bytes():
    def sample(step_ms: float, nbytes: int | None) -> bw.Sample:
        return bw.Sample(bw.ENGINE, 2, 1, bw.StepTimes(step_ms, 1.0, step_ms - 2.0, 0.5, 0.5), nbytes)

    cells = bw.combine_ranks([{"samples": [sample(10.0, 64)]}, {"samples": [sample(12.0, 32)]}])
    cell = cells[(bw.ENGINE, 2)]
    assert cell["step_ms"].tolist() == [12.0] and cell["backward_ms"].tolist() == [10.0]
    assert cell["bytes"].tolist() == [64] and cell["bytes_agree"].tolist() == [False]
    assert cell["round"].tolist() == [1]


# ---------------------------------------------------------------------------------------- BERT rows
BERT_TINY = config.BenchConfig.for_model(
    "bert-tiny",
    batch_size=2,
    seq_len=12,
    steps=2,
    rounds=2,
    warmup=1,
    ks=(0, 2, 4),
    collective_timeout_s=30.0,
    cache_keys=12,
    cache_chunk=4,
)


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory):
    """The BERT rows of a tiny config, spliced into a BENCH.md that already holds other sections."""
    tmp = tmp_path_factory.mktemp("bench-bert")
    (tmp / "out").mkdir()
    before = "# Freezing under DDP\n\nmain table\n\n<!-- cluster-bench:start -->\ncluster\n<!-- cluster-bench:end -->\n"
    (tmp / "out" / "BENCH.md").write_text(before, encoding="utf-8")
    cli.run_benchmark(BERT_TINY, tmp / "out", workdir=tmp / "rdzv", deadline_s=180.0, command="pytest tiny bert")
    with open(tmp / "out" / "bench_bert-tiny.csv", newline="", encoding="utf-8") as f:
        rows = {(r["approach"], int(r["k"])): r for r in csv.DictReader(f)}
    return rows, (tmp / "out" / "BENCH.md").read_text(encoding="utf-8")


def _bert_param_bytes_from(k: int) -> int:
    blocks = split_blocks(bw.build_model("bert-tiny", 0))
    return sum(p.numel() * p.element_size() for b in blocks[k:] for p in b.params)


@pytest.mark.processes
def test_bert_rows_one_per_approach_and_k(bert_run):
    rows, _ = bert_run
    expected = {(a, k) for a in bw.TEXT_APPROACHES for k in (0, 2, 4)} | {(bw.PREFIX_FORWARD, k) for k in (2, 4)}
    assert set(rows) == expected
    for row in rows.values():
        assert int(row["steps"]) == BERT_TINY.rounds * BERT_TINY.steps and float(row["median_ms"]) > 0


@pytest.mark.processes
@pytest.mark.parametrize("approach", bw.TEXT_APPROACHES)
@pytest.mark.parametrize("k", [0, 2, 4])
def test_bert_bytes_per_step_equal_trainable_bytes(bert_run, approach, k):
    rows, _ = bert_run
    row = rows[(approach, k)]
    assert int(row["trainable_grad_bytes"]) == _bert_param_bytes_from(k)
    assert int(row["allreduce_bytes_per_step"]) == _bert_param_bytes_from(k)
    assert row["bytes_match_trainable"] == "True"  # every step, on every rank


@pytest.mark.processes
@pytest.mark.parametrize("k", [2, 4])
def test_bert_cache_rows_serve_every_key_at_the_cut(bert_run, k):
    rows, _ = bert_run
    cached = rows[(bw.ENGINE_CACHE, k)]
    assert int(cached["cache_hit_keys"]) > 0 and cached["cache_miss_keys"] == "0"
    assert cached["cache_cut"] == str(k)  # the stored tensor enters block k: the whole prefix is skipped
    assert float(cached["cache_build_s"]) > 0
    # one hidden state per token: seq_len x hidden fp32 per key
    assert int(cached["cache_bytes"]) == BERT_TINY.cache_keys * BERT_TINY.seq_len * 32 * 4
    assert (cached["cache_advance_s"] == "") == (k == 2)  # advanced from k=2 on the way up


@pytest.mark.processes
def test_bert_control_is_a_second_static_limit(bert_run):
    rows, _ = bert_run
    for k in (0, 2, 4):
        assert rows[(bw.CONTROL, k)]["allreduce_bytes_per_step"] == rows[(bw.STATIC, k)]["allreduce_bytes_per_step"]
        assert float(rows[(bw.CONTROL, k)]["ratio_to_static"]) > 0


@pytest.mark.processes
def test_bert_section_is_spliced_before_the_other_sections(bert_run):
    _, md = bert_run
    start, end = markdown.markers(text_report.TEXT_SECTION)
    assert md.startswith("# Freezing under DDP\n\nmain table\n\n" + start)
    assert md.index(end) < md.index("<!-- cluster-bench:start -->") and md.endswith("<!-- cluster-bench:end -->\n")
    section = md.split(start, 1)[1].split(end, 1)[0]
    assert "`pytest tiny bert`" in section and "no GPU" in section
    assert "| bytes all-reduced per step = trainable gradient bytes" in section and "| met | every k |" in section
    assert "| the cache serves every key at the cut k, at every k >= 1 | met | every k |" in section
    assert "| the control holds 1.00" in section
    for k in (0, 2, 4):
        assert f"\n| {k} | " in section


def test_splice_replaces_its_section_and_the_main_rewrite_keeps_the_others(tmp_path):
    path = tmp_path / "BENCH.md"
    section = markdown.span(text_report.TEXT_SECTION, "bert v1")
    sections.splice_section(
        path, text_report.TEXT_SECTION, "bert v1", before_others=True
    )  # no file: created with a title
    assert path.read_text(encoding="utf-8").endswith(section + "\n")
    path.write_text("# T\n\nmain\n\n" + section + "\n\n<!-- x:start -->\nx\n<!-- x:end -->\n", encoding="utf-8")
    sections.splice_section(path, text_report.TEXT_SECTION, "bert v2", before_others=True)
    text = path.read_text(encoding="utf-8")
    assert "bert v1" not in text and text.count("bert v2") == 1 and text.endswith("<!-- x:end -->\n")
    assert sections.spliced_sections(path) == text[text.index(markdown.markers(text_report.TEXT_SECTION)[0]) :]


def test_a_broken_span_of_bench_md_is_refused_before_anything_runs(tmp_path, capsys):
    path = tmp_path / "BENCH.md"
    start, end = markdown.markers("cluster-bench")
    path.write_text(f"# T\n\n{start}\nx\n", encoding="utf-8")  # the end marker was deleted by hand
    message = f"{path}: {end} is on 0 lines, expected on exactly one"
    with pytest.raises(markdown.MarkerError, match=message):
        sections.splice_section(path, "cluster-bench", "y", before_others=False)  # no second section appended
    assert cli.main(["--out-dir", str(tmp_path), "--quick"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert path.read_text(encoding="utf-8") == f"# T\n\n{start}\nx\n"


def test_bert_config_defaults_and_refusals():
    base = cli.config_from_args(cli.get_args_parser().parse_args(["--model", "bert-base"]))
    assert (base.ks, base.batch_size, base.seq_len, base.cache_keys, base.momentum) == ((0, 4, 8, 12), 2, 128, 64, 0.0)
    assert base.resolved(15).phase_ks == ()
    quick = cli.config_from_args(cli.get_args_parser().parse_args(["--model", "bert-base", "--quick"]))
    assert (quick.steps, quick.rounds) == (config.TEXT_QUICK_STEPS, config.TEXT_QUICK_ROUNDS)
    explicit = cli.config_from_args(cli.get_args_parser().parse_args(["--model", "bert-base", "--batch-size", "8"]))
    assert explicit.batch_size == 8
    assert cli.config_from_args(cli.get_args_parser().parse_args([])).batch_size == config.BenchConfig().batch_size
    with pytest.raises(ValueError, match=r"seq_len must be 2..128 for bert-tiny"):
        config.BenchConfig.for_model("bert-tiny", seq_len=129).validate()
    with pytest.raises(ValueError, match="phase_ks is for the image models"):
        config.BenchConfig.for_model("bert-tiny", phase_ks=(0,)).validate()


def test_the_main_rewrite_keeps_the_sections_other_commands_spliced_in(tmp_path):
    path = tmp_path / "BENCH.md"
    tail = "<!-- cluster-bench:start -->\ncluster\n<!-- cluster-bench:end -->\n\nprose\n"
    path.write_text("# old main table\n\n" + tail, encoding="utf-8")
    assert sections.spliced_sections(path) == tail
    assert sections.spliced_sections(tmp_path / "missing.md") == ""
