"""Tiny instances of every architecture family the default split knows, built from the real classes.

torchvision's and Hugging Face's own model classes (so their module layout and forward are the real
ones) at toy widths, depths and image sizes, so a forward and backward takes milliseconds. Nothing is
downloaded. ``FAMILIES`` maps a family name to how to build it, feed it and what its head is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torchvision
from torch import nn
from torchvision.models import convnext, efficientnet, mobilenetv3, regnet, resnet, swin_transformer, vgg
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.models.segmentation import deeplabv3, fcn

NUM_CLASSES = 10
VOCAB = 64
SEQ_LEN = 8


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], nn.Module]
    head: tuple[str, ...]  # module names of the last block (the classifier)
    inputs: str = "image"  # "image" (N, 3, H, W) | "tokens" (N, SEQ_LEN) of ids < VOCAB
    image_size: int = 32
    # Parameters owned directly by a parent module -> the module of the block that must own them.
    parent_params: tuple[tuple[str, str], ...] = ()
    # In the 2-rank run. Wide ResNet is left out there: torchvision's ResNet class fixes the widths
    # at 64..2048 channels, so even one block per stage is 19.5M parameters (measured 17.7 s of a
    # 102 s run on a loaded 2-core machine), and its blocks are the same Bottleneck class as ResNeXt's.
    ddp: bool = True


def _tiny_vgg() -> nn.Module:
    # torchvision's VGG always builds a 512*7*7 -> 4096 classifier (~120M parameters); build that on
    # the meta device, then give the same layout (Linear, ReLU, Dropout) x 2 + Linear tiny widths.
    with torch.device("meta"):
        model = torchvision.models.VGG(nn.Sequential(), num_classes=NUM_CLASSES, init_weights=False)
    model.features = vgg.make_layers([8, "M", 16, "M", 16, 16, "M"], batch_norm=True)
    model.avgpool = nn.AdaptiveAvgPool2d(1)
    model.classifier = nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(True),
        nn.Dropout(),
        nn.Linear(32, 32),
        nn.ReLU(True),
        nn.Dropout(),
        nn.Linear(32, 10),
    )
    return model


def _tiny_mobilenet_v3() -> nn.Module:
    conf = partial(mobilenetv3.InvertedResidualConfig, width_mult=1.0)
    setting = [
        conf(8, 3, 8, 8, True, "RE", 2, 1),
        conf(8, 3, 24, 16, False, "RE", 2, 1),
        conf(16, 5, 32, 16, True, "HS", 1, 1),
    ]
    return mobilenetv3.MobileNetV3(setting, last_channel=32, num_classes=NUM_CLASSES)


def _tiny_efficientnet_v1() -> nn.Module:
    setting = [efficientnet.MBConvConfig(1, 3, 1, 8, 8, 1), efficientnet.MBConvConfig(4, 3, 2, 8, 16, 2)]
    return efficientnet.EfficientNet(setting, dropout=0.2, num_classes=NUM_CLASSES)


def _tiny_efficientnet_v2() -> nn.Module:
    setting = [efficientnet.FusedMBConvConfig(1, 3, 1, 8, 8, 2), efficientnet.MBConvConfig(4, 3, 2, 8, 16, 2)]
    return efficientnet.EfficientNet(setting, dropout=0.2, num_classes=NUM_CLASSES, last_channel=32)


def _tiny_regnet() -> nn.Module:
    params = regnet.BlockParams.from_init_params(depth=4, w_0=8, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    return regnet.RegNet(params, num_classes=NUM_CLASSES, stem_width=8)


def _tiny_swin(v2: bool) -> nn.Module:
    extra = {"block": swin_transformer.SwinTransformerBlockV2, "downsample_layer": swin_transformer.PatchMergingV2}
    return swin_transformer.SwinTransformer(
        patch_size=[4, 4],
        embed_dim=8,
        depths=[2, 2],
        num_heads=[1, 2],
        window_size=[2, 2],
        num_classes=NUM_CLASSES,
        **(extra if v2 else {}),
    )


class TinyTextEncoder(nn.Module):
    """A model built from torch's own nn.TransformerEncoder: layers in an nn.ModuleList."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, NUM_CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(self.embed(ids))).mean(1))


def _tiny_segmentation(kind: str) -> nn.Module:
    """torchvision's FCN / DeepLabV3 with ``aux_loss``: its own classes (the aux head is registered
    after the main head, reads layer3 and runs after the main head), on a ResNet of one BasicBlock
    per stage instead of a dilated ResNet-50."""
    backbone = resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1])
    backbone = IntermediateLayerGetter(backbone, return_layers={"layer4": "out", "layer3": "aux"})
    aux = fcn.FCNHead(256, NUM_CLASSES)
    if kind == "fcn":
        return fcn.FCN(backbone, fcn.FCNHead(512, NUM_CLASSES), aux)
    return deeplabv3.DeepLabV3(backbone, deeplabv3.DeepLabHead(512, NUM_CLASSES), aux)


def _googlenet() -> nn.Module:
    # Its widths are fixed (13M parameters with the aux heads); a 32x32 image keeps a step fast. The
    # aux heads are registered after inception5b but run after inception4a and inception4d.
    return torchvision.models.GoogLeNet(num_classes=NUM_CLASSES, aux_logits=True, init_weights=False)


def _tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ_LEN,
        num_labels=NUM_CLASSES,
    )
    return BertForSequenceClassification(config)


def _tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=2, n_positions=SEQ_LEN, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)  # tie_word_embeddings=True by default: lm_head.weight is wte.weight
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


_FAMILIES = [
    Family("resnet", partial(resnet.ResNet, resnet.BasicBlock, [1, 1, 1, 1], num_classes=NUM_CLASSES), ("fc",)),
    Family(
        "resnext",
        partial(resnet.ResNet, resnet.Bottleneck, [1, 1, 1, 1], groups=4, width_per_group=2, num_classes=NUM_CLASSES),
        ("fc",),
    ),
    Family(
        "wide_resnet",
        partial(resnet.ResNet, resnet.Bottleneck, [1, 1, 1, 1], width_per_group=128, num_classes=NUM_CLASSES),
        ("fc",),
        ddp=False,
    ),
    Family("vgg", _tiny_vgg, ("classifier.6",)),
    Family(
        "densenet",
        partial(
            torchvision.models.DenseNet,
            growth_rate=4,
            block_config=(2, 2, 2, 2),
            num_init_features=8,
            bn_size=2,
            num_classes=NUM_CLASSES,
        ),
        ("classifier",),
    ),
    Family(
        "mobilenet_v2",
        partial(
            torchvision.models.MobileNetV2,
            num_classes=NUM_CLASSES,
            width_mult=0.25,
            inverted_residual_setting=[[1, 8, 1, 1], [6, 8, 2, 2], [6, 16, 2, 2]],
        ),
        ("classifier",),
    ),
    Family("mobilenet_v3", _tiny_mobilenet_v3, ("classifier.3",)),
    Family("efficientnet_v1", _tiny_efficientnet_v1, ("classifier",)),
    Family("efficientnet_v2", _tiny_efficientnet_v2, ("classifier",)),
    Family("regnet", _tiny_regnet, ("fc",)),
    Family(
        "convnext",
        partial(
            convnext.ConvNeXt,
            [convnext.CNBlockConfig(8, 16, 2), convnext.CNBlockConfig(16, None, 2)],
            num_classes=NUM_CLASSES,
        ),
        ("classifier",),
    ),
    Family(
        "vit",
        partial(
            torchvision.models.VisionTransformer,
            image_size=32,
            patch_size=8,
            num_layers=3,
            num_heads=2,
            hidden_dim=32,
            mlp_dim=64,
            num_classes=NUM_CLASSES,
        ),
        ("heads",),
        parent_params=(
            ("class_token", "encoder.layers.encoder_layer_0"),
            ("encoder.pos_embedding", "encoder.layers.encoder_layer_0"),
        ),
    ),
    Family("swin", partial(_tiny_swin, v2=False), ("head",)),
    Family("swin_v2", partial(_tiny_swin, v2=True), ("head",)),
    Family("torch_transformer", TinyTextEncoder, ("head",), inputs="tokens"),
    # Auxiliary outputs: the head is the layer nearest the main output (the first one forward
    # returns); an aux head that runs after it joins it, one that runs earlier is a block where it
    # runs. Not in the 2-rank run: they add no case to DDP's, and GoogLeNet is 13M parameters.
    Family(
        "fcn_aux",
        partial(_tiny_segmentation, "fcn"),
        ("classifier.4", "aux_classifier.0", "aux_classifier.1", "aux_classifier.4"),
        ddp=False,
    ),
    Family(
        "deeplabv3_aux",
        partial(_tiny_segmentation, "deeplabv3"),
        ("classifier.4", "aux_classifier.0", "aux_classifier.1", "aux_classifier.4"),
        ddp=False,
    ),
    Family("googlenet_aux", _googlenet, ("fc",), ddp=False),
    Family("hf_bert", _tiny_bert, ("classifier",), inputs="tokens"),
    # Tied input/output embeddings: the tied weight belongs to wte (its first user), so lm_head owns
    # nothing of its own and the last block is the last layer with the final norm.
    Family("hf_gpt2", _tiny_gpt2, ("transformer.h.2", "transformer.ln_f"), inputs="tokens"),
]
FAMILIES: dict[str, Family] = {f.name: f for f in _FAMILIES}


def batch(family: Family, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if family.inputs == "tokens":
        x = torch.randint(0, VOCAB, (size, SEQ_LEN), generator=g)
    else:
        x = torch.randn(size, 3, family.image_size, family.image_size, generator=g)
    return x, torch.randint(0, NUM_CLASSES, (size,), generator=g)


def loss(family: Family, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a classifier (plus that of each auxiliary output, as their training does:
    every head gets a gradient); per-pixel cross-entropy against the image's label of a segmentation
    model; next-token cross-entropy of a language model."""
    out = model(input_ids=x) if family.name.startswith("hf_") else model(x)
    if hasattr(out, "_fields"):  # GoogLeNet in training: (logits, aux_logits2, aux_logits1)
        outputs = list(out)
    elif hasattr(out, "logits"):  # Hugging Face
        outputs = [out.logits]
    elif isinstance(out, dict):  # torchvision segmentation: {"out": ..., "aux": ...}, (N, C, H, W) each
        outputs = list(out.values())
    else:
        outputs = [out]
    logits = outputs[0]
    if logits.dim() == 3:  # a language model: predict token t+1 from tokens ..t
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    if logits.dim() == 4:
        return sum(nn.functional.cross_entropy(o, y[:, None, None].expand(-1, *o.shape[2:])) for o in outputs)
    return sum(nn.functional.cross_entropy(o, y) for o in outputs)
