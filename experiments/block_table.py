"""The family table of docs/blocks.md: how the default ``split_blocks`` cuts the real-size models people fine-tune.

    python -m experiments.block_table            # markdown, as pasted into docs/blocks.md
    python -m experiments.block_table --check docs/blocks.md   # exit 1 if docs/blocks.md holds another table

Models are built with random weights (nothing is downloaded), on the meta device where the builder
allows it (no memory, no initialization time); Hugging Face models from their default configs,
when ``transformers`` is installed (``pip install .[hf]``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision
from torch import nn

from freeze import split_blocks
from freeze.pipeline import markdown as md

SPAN = "block-table"  # the span of docs/blocks.md that holds the table (freeze.pipeline.markdown)


@dataclass(frozen=True)
class Row:
    family: str
    model: str
    blocks: int
    min_params: int
    max_params: int
    head: str


def _torchvision(arch: str) -> Callable[[], nn.Module]:
    return lambda: torchvision.models.get_model(arch)


def _hf(config_class: str, model_class: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        return getattr(transformers, model_class)(getattr(transformers, config_class)())

    return build


# (family, model label, builder); one representative per family, the size people usually start from.
MODELS: list[tuple[str, str, Callable[[], nn.Module]]] = [
    ("ResNet", "resnet18", _torchvision("resnet18")),
    ("ResNet", "resnet50", _torchvision("resnet50")),
    ("ResNeXt", "resnext50_32x4d", _torchvision("resnext50_32x4d")),
    ("Wide ResNet", "wide_resnet50_2", _torchvision("wide_resnet50_2")),
    ("VGG", "vgg16_bn", _torchvision("vgg16_bn")),
    ("DenseNet", "densenet121", _torchvision("densenet121")),
    ("MobileNet V2", "mobilenet_v2", _torchvision("mobilenet_v2")),
    ("MobileNet V3", "mobilenet_v3_large", _torchvision("mobilenet_v3_large")),
    ("EfficientNet V1", "efficientnet_b0", _torchvision("efficientnet_b0")),
    ("EfficientNet V2", "efficientnet_v2_s", _torchvision("efficientnet_v2_s")),
    ("RegNet", "regnet_y_400mf", _torchvision("regnet_y_400mf")),
    ("ConvNeXt", "convnext_tiny", _torchvision("convnext_tiny")),
    ("ViT", "vit_b_16", _torchvision("vit_b_16")),
    ("Swin", "swin_t", _torchvision("swin_t")),
    ("Swin V2", "swin_v2_t", _torchvision("swin_v2_t")),
    (
        "BERT (HF)",
        "BertForSequenceClassification, bert-base config",
        _hf("BertConfig", "BertForSequenceClassification"),
    ),
    ("GPT-2 (HF)", "GPT2LMHeadModel, gpt2 config (tied embeddings)", _hf("GPT2Config", "GPT2LMHeadModel")),
]


def _build(builder: Callable[[], nn.Module]) -> nn.Module:
    try:
        with torch.device("meta"):
            return builder()
    except NotImplementedError:  # builders that compute with tensors (RegNet's widths) need real ones
        return builder()


def table_rows(models=MODELS) -> list[Row]:
    rows = []
    for family, label, builder in models:
        try:
            model = _build(builder)
        except ImportError as e:
            print(f"block_table: skipping {family}: {e} (pip install .[hf])", file=sys.stderr)
            continue
        blocks = split_blocks(model)
        sizes = [b.num_params for b in blocks]
        rows.append(Row(family, label, len(blocks), min(sizes), max(sizes), blocks[-1].name))
    return rows


def _count(n: int) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def markdown(rows: list[Row]) -> str:
    header = ("family", "model", "blocks", "parameters per block (min - max)", "head (last block)")
    cells = [
        (r.family, r.model, r.blocks, f"{_count(r.min_params)} - {_count(r.max_params)}", f"`{r.head}`") for r in rows
    ]
    return "\n".join(md.table(header, cells, align="llrll")) + "\n"


def embedded_table(readme: str, where: str | Path = "<text>") -> str | None:
    """The table in the block-table span of a README, or None when it has no such span.

    Raises:
        md.MarkerError: one of the span's markers is missing or doubled.
    """
    if not md.has(readme, SPAN, where):
        return None
    return md.read(readme, SPAN, where).strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.block_table", description=__doc__.splitlines()[0])
    parser.add_argument("--check", type=Path, metavar="README", help="compare with the table embedded in this file")
    args = parser.parse_args(argv)
    table = markdown(table_rows())
    if args.check is None:
        print(table, end="")
        return 0
    try:
        embedded = embedded_table(args.check.read_text(encoding="utf-8"), args.check)
    except md.MarkerError as e:
        print(f"block_table: {e}")
        return 1
    if embedded != table:
        start, end = md.markers(SPAN)
        print(f"block_table: the table in {args.check} differs from this output; paste it between {start} and {end}")
        print(table, end="")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
