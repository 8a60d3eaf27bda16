from pathlib import Path

from experiments import block_table
from freeze.pipeline import markdown

BLOCKS_DOC = Path(__file__).resolve().parents[2] / "docs" / "blocks.md"


def test_blocks_doc_holds_the_table_the_script_prints():
    """The family table in docs/blocks.md is generated, never typed: regenerate it when this fails."""
    assert block_table.main(["--check", str(BLOCKS_DOC)]) == 0


def test_markdown_rows_and_the_embedded_table():
    rows = [block_table.Row("ResNet", "resnet18", 10, 9536, 4_719_616, "fc")]
    table = block_table.markdown(rows)
    assert table.splitlines()[-1] == "| ResNet | resnet18 | 10 | 9.54 k - 4.72 M | `fc` |"
    readme = f"intro\n{markdown.span(block_table.SPAN, table.rstrip())}\nrest"
    assert block_table.embedded_table(readme) == table
    assert block_table.embedded_table("no markers") is None


def test_check_names_the_marker_a_hand_edit_lost(tmp_path, capsys):
    doc = tmp_path / "blocks.md"
    start, end = markdown.markers(block_table.SPAN)
    doc.write_text(f"intro\n{start}\n| old |\n")
    assert block_table.main(["--check", str(doc)]) == 1
    assert capsys.readouterr().out == f"block_table: {doc}: {end} is on 0 lines, expected on exactly one\n"
