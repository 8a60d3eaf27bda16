"""freeze.pipeline.markdown: the one owner of a markdown table's syntax and of the markers of a
generated (or read) span of a hand-written file."""

import tomllib
from pathlib import Path

import pytest

from freeze.pipeline import markdown
from freeze.pipeline.substrate.report import SPANS
from tests.processes import run_python


def test_table_lines_escape_cells_and_align_columns():
    lines = markdown.table(["a|b", "n", "mid"], [["x|y", 1, "two\nlines"], ["", 2.5, None]], align="lrc")
    assert lines == [
        r"| a\|b | n | mid |",
        "|---|---:|:---:|",
        r"| x\|y | 1 | two lines |",
        "|  | 2.5 | None |",
    ]
    assert markdown.table(("a", "b"), [])[1] == "|---|---|"  # every column left by default
    assert markdown.table(("a", "b"), [("1", "2")], align=("r", "l"))[1] == "|---:|---|"


@pytest.mark.parametrize(
    "align, rows, message",
    [
        ("l", [], r"align 'l' needs one of l/r/c per column \(2 columns\)"),
        ("lx", [], "align 'lx' needs one of l/r/c"),
        ("", [("1",)], "row 0 has 1 cells for 2 columns"),
    ],
)
def test_table_refuses_a_row_or_alignment_of_another_width(align, rows, message):
    with pytest.raises(ValueError, match=message):
        markdown.table(("a", "b"), rows, align)


TEXT = "# T\n\n<!-- one:start -->\nold\n<!-- one:end -->\n\nprose\n<!-- two:start -->\n<!-- two:end -->\n"


def test_read_and_splice_a_span_keep_the_rest_byte_for_byte():
    assert markdown.read(TEXT, "one") == "old"
    assert markdown.read(TEXT, "two") == ""
    new = markdown.splice(TEXT, "one", "a\nb")
    assert new == TEXT.replace("\nold\n", "\na\nb\n")
    assert markdown.splice(new, "one", "old") == TEXT
    assert markdown.splice(TEXT, "two", "x") == TEXT.replace("<!-- two:start -->\n", "<!-- two:start -->\nx\n")
    assert markdown.span("one", "old") == "<!-- one:start -->\nold\n<!-- one:end -->"
    assert [name for name, _ in markdown.spans(TEXT)] == ["one", "two"]
    assert markdown.spans(TEXT)[0][1] == TEXT.index("<!-- one:start -->")
    assert markdown.has(TEXT, "one") and not markdown.has(TEXT, "three")


def test_a_marker_mentioned_inside_a_line_is_not_a_marker():
    text = "say `<!-- one:start -->` here\n" + TEXT
    assert markdown.read(text, "one") == "old" and len(markdown.spans(text)) == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("a\n", "REPORT.md: no <!-- one:start --> line"),
        ("<!-- one:start -->\nx\n", "REPORT.md: <!-- one:end --> is on 0 lines, expected on exactly one"),
        ("x\n<!-- one:end -->\n", "REPORT.md: <!-- one:start --> is on 0 lines, expected on exactly one"),
        (TEXT + TEXT, "REPORT.md: <!-- one:start --> is on 2 lines, expected on exactly one"),
        ("<!-- one:end -->\n<!-- one:start -->\n", "REPORT.md: <!-- one:end --> comes before <!-- one:start -->"),
    ],
)
def test_a_span_missing_or_doubled_is_one_line_naming_the_file_and_the_marker(text, message):
    for call in (
        lambda: markdown.splice(text, "one", "new", "REPORT.md"),
        lambda: markdown.read(text, "one", "REPORT.md"),
    ):
        with pytest.raises(markdown.MarkerError) as e:
            call()
        assert str(e.value) == message
    if "no <!--" not in message:  # neither marker: not a span, nothing to check
        with pytest.raises(markdown.MarkerError, match="REPORT.md: "):
            markdown.spans(text, "REPORT.md")


def test_span_names_are_plain_words():
    with pytest.raises(ValueError, match="span name 'a b'"):
        markdown.markers("a b")


@pytest.mark.processes
def test_the_module_imports_nothing_heavy():
    code = "import sys, freeze.pipeline.markdown; print(sorted(m for m in ('torch', 'numpy', 'pandas') if m in sys.modules))"
    child = run_python(["-c", code])
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "[]"


REPO = Path(__file__).resolve().parents[2]


def test_every_committed_span_is_well_formed_and_every_splicer_finds_its_own():
    from experiments import bench_cluster, block_table, validate_costmodel_report
    from experiments.bench import text_report

    for path in [REPO / "README.md", *REPO.glob("report/*.md"), *REPO.glob("docs/*.md")]:
        markdown.spans(path.read_text(encoding="utf-8"), path)  # raises on a missing or doubled marker
    owners = {
        "report/BENCH.md": (text_report.TEXT_SECTION, bench_cluster.SECTION, validate_costmodel_report.SECTION),
        "docs/blocks.md": (block_table.SPAN,),
        "README.md": ("example",),  # experiments.repeat_readme_example, tests/test_readme.py
        "docs/experiments.md": ("sweep-example",),  # tests/test_readme.py
    }
    for name, spans in owners.items():
        text = (REPO / name).read_text(encoding="utf-8")
        assert all(markdown.has(text, span, name) for span in spans), name
    # every committed study or score file splices into a page that exists and has spans for it (a page
    # moved without its file's report_md would be found at the end of hours of runs)
    pages = {}
    for config in sorted((REPO / "experiments" / "configs").glob("*.toml")):
        data = tomllib.loads(config.read_text(encoding="utf-8"))
        for section in ("study", "score"):
            if "report_md" in data.get(section, {}):
                pages[config.name] = data[section]["report_md"]
    assert {"study_fdsl32.toml", "study_frontier.toml", "planted_score.toml"} <= set(pages)
    for config, page in pages.items():
        if config != "study_offline.toml":  # the quick look: its --update-report splices nothing (its comment)
            assert markdown.spans((REPO / page).read_text(encoding="utf-8"), page), (config, page)
    substrate = (REPO / "report" / "substrate-study.md").read_text(encoding="utf-8")
    assert all(markdown.has(substrate, span, "report/substrate-study.md") for span in SPANS)
