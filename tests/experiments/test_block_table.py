from pathlib import Path

from experiments import block_table

BLOCKS_DOC = Path(__file__).resolve().parents[2] / "docs" / "blocks.md"


def test_blocks_doc_holds_the_table_the_script_prints():
    """The family table in docs/blocks.md is generated, never typed: regenerate it when this fails."""
    assert block_table.main(["--check", str(BLOCKS_DOC)]) == 0


def test_markdown_rows_and_the_embedded_table():
    rows = [block_table.Row("ResNet", "resnet18", 10, 9536, 4_719_616, "fc")]
    table = block_table.markdown(rows)
    assert table.splitlines()[-1] == "| ResNet | resnet18 | 10 | 9.54 k - 4.72 M | `fc` |"
    readme = f"intro\n{block_table.START}\n{table}{block_table.END}\nrest"
    assert block_table.embedded_table(readme) == table
    assert block_table.embedded_table("no markers") is None
