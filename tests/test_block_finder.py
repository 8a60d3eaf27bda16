"""freeze.block_finder: the default split (a model's repeated layers, norms joined to their layer,
tied weights), globs, parameters owned by a parent module, forward order and the output layer."""

import pytest
import torch
import torchvision
from torch import nn

from freeze import BlockError, split_blocks
from tests.tiny_models import Scaled, Stack, TiedLM, TinyNet


# ------------------------------------------------------------------------------ the default rule
def test_default_split_is_unchanged_for_the_children_of_a_model_without_repeated_layers():
    """TinyNet's children are Conv+BN+ReLU stacks, not lists of layers: each stays one block."""
    assert [b.module_names for b in split_blocks(TinyNet())] == [("stem",), ("block1",), ("block2",), ("head",)]


def test_a_stage_of_one_block_is_still_split_into_its_block():
    model = torchvision.models.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1])
    assert [b.name for b in split_blocks(model)] == ["stem"] + [f"layer{i}.0" for i in range(1, 5)] + ["fc"]


def test_a_lone_norm_joins_the_layer_before_it_and_a_leading_one_the_layer_after_it():
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4), nn.Linear(4, 2))
    assert [b.module_names for b in split_blocks(model)] == [("0", "1", "2"), ("3",), ("4",)]


def test_a_norm_of_a_library_of_its_own_is_known_by_its_class_name():
    class LlamaRMSNorm(nn.Module):  # Hugging Face defines its norms as plain modules
        def __init__(self, width):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(width))

        def forward(self, x):
            return x * self.weight

    model = nn.Sequential(nn.Linear(4, 4), LlamaRMSNorm(4), nn.Linear(4, 4), nn.Linear(4, 2))
    assert [b.module_names for b in split_blocks(model)] == [("0", "1"), ("2",), ("3",)]


class PreNorm(nn.Module):
    """The pre-norm wrapper of much transformer code: a whole layer (``fn``) behind a LayerNorm."""

    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.norm(x))


class PreNormTransformer(nn.Module):
    def __init__(self, dim=8, depth=3):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.layers = nn.ModuleList(
            nn.ModuleList([PreNorm(dim, nn.Linear(dim, dim)), PreNorm(dim, nn.Linear(dim, dim))]) for _ in range(depth)
        )
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        x = self.embed(x)
        for attn, ff in self.layers:
            x = x + attn(x)
            x = x + ff(x)
        return self.head(x)


def test_a_wrapper_whose_class_name_ends_in_norm_is_a_layer_not_a_norm():
    """``PreNorm(dim, fn)`` holds a whole layer: only a module owning its parameters directly (no
    parameter-owning children) is taken for a norm by its class name."""
    blocks = split_blocks(PreNormTransformer())
    assert [b.name for b in blocks] == ["embed"] + [f"layers.{i}.{j}" for i in range(3) for j in range(2)] + ["head"]


def test_a_tied_weight_belongs_to_its_first_user_and_a_block_left_empty_disappears():
    model = TiedLM()
    blocks = split_blocks(model)
    assert [b.name for b in blocks] == ["embed", "layers.0", "layers.1", "layers.2"]
    assert blocks[0].params[0] is model.head.weight


# ---------------------------------------------------------------------------------------- globs
def test_a_glob_is_one_block_per_match_in_registration_order_not_alphabetical():
    blocks = split_blocks(Stack(), ["embed", "layers.*", "head"])
    assert [b.name for b in blocks] == ["embed"] + [f"layers.{i}" for i in range(12)] + ["head"]


def test_a_wildcard_stays_in_one_dotted_component_and_skips_parameter_free_modules():
    blocks = split_blocks(Stack(depth=2), ["embed", "layers.*.*", "head"])
    assert [b.name for b in blocks] == ["embed", "layers.0.0", "layers.1.0", "head"]  # no ReLU blocks


def test_globs_inside_a_list_entry_form_one_block():
    model = torchvision.models.resnet18()
    by_glob = split_blocks(model, [["conv1", "bn*"], "layer?.*", "fc"])
    assert [b.name for b in by_glob] == [b.name for b in split_blocks(model)]


def test_the_readme_names_for_bert_give_the_default_split():
    from tests.block_families import FAMILIES

    model = FAMILIES["hf_bert"].build()
    blocks = split_blocks(model, ["bert.embeddings", "bert.encoder.layer.*", "bert.pooler", "classifier"])
    assert [b.name for b in blocks] == [b.name for b in split_blocks(model)]
    assert len(blocks) == 3 + 3


def test_a_glob_matching_nothing_is_a_one_line_error():
    with pytest.raises(BlockError, match="pattern 'layer.*' matches no parameter-owning module") as e:
        split_blocks(Stack(), ["embed", "layer.*", "head"])
    assert "\n" not in str(e.value)


# ------------------------------------------------------------ parameters owned by a parent module
def test_a_parent_parameter_joins_the_first_block_whose_input_depends_on_it():
    blocks = split_blocks(Scaled())
    assert [b.name for b in blocks] == ["layers.0", "layers.1", "layers.2", "head"]
    assert blocks[2].param_names[0] == "scale"
    assert blocks[3].param_names[0] == "temperature"  # reaches the output through no block


def test_a_parent_parameter_can_be_named_in_a_block_entry():
    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=8, mlp_dim=16, num_classes=3
    )
    blocks = split_blocks(model, [["conv_proj", "class_token"], "encoder.layers.*", "encoder.ln", "heads"])
    assert blocks[0].param_names[-1] == "class_token"
    assert blocks[1].param_names[0] == "encoder.pos_embedding"  # placed by the trace
    assert blocks[1].name == "encoder.layers.encoder_layer_0"


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor value: torch.fx cannot trace it
            x = x * self.scale
        for layer in self.layers:
            x = layer(x)
        return x


def test_an_untraceable_forward_asks_for_the_parameter_to_be_named():
    with pytest.raises(BlockError, match="torch.fx could not trace Branchy.forward .*name each in a block") as e:
        split_blocks(Branchy())
    assert "\n" not in str(e.value)
    blocks = split_blocks(Branchy(), [["layers.0", "scale"], "layers.1", "layers.2"])
    assert blocks[0].param_names == ("layers.0.weight", "layers.0.bias", "scale")


def test_a_parent_parameter_the_forward_never_reads_is_a_one_line_error():
    model = Stack(depth=2)
    model.unused = nn.Parameter(torch.zeros(1))
    with pytest.raises(BlockError, match="parameter 'unused' is owned by a parent module and not used") as e:
        split_blocks(model)
    assert "\n" not in str(e.value)


def test_split_works_on_the_meta_device():
    with torch.device("meta"):
        model = torchvision.models.vit_b_16()
    blocks = split_blocks(model)
    assert len(blocks) == 14 and blocks[1].param_names[:2] == ("class_token", "encoder.pos_embedding")


# ------------------------------------------------------------- forward order and the output layer
class RegisteredBackwards(nn.Module):
    """Modules registered in the reverse of the order the forward runs them."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 2)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.embed = nn.Linear(3, 4)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_units_are_in_forward_order_not_registration_order():
    blocks = split_blocks(RegisteredBackwards())
    assert [b.name for b in blocks] == ["embed", "layers.0", "layers.1", "layers.2", "head"]


class EarlyAux(Stack):
    """An auxiliary head registered last but run after layers.0, GoogLeNet-style, in training only."""

    def __init__(self):
        super().__init__(depth=3)
        self.aux = nn.Linear(4, 2)

    def forward(self, x):
        x = self.layers[0](self.embed(x))
        aux = self.aux(x) if self.training else None
        out = self.head(self.layers[2](self.layers[1](x)))
        return {"out": out, "aux": aux} if self.training else out


def test_an_aux_head_that_runs_early_is_a_block_where_it_runs_also_when_split_in_eval_mode():
    model = EarlyAux().eval()
    blocks = split_blocks(model)
    assert [b.name for b in blocks] == ["embed", "layers.0", "aux", "layers.1", "layers.2", "head"]
    assert not any(m.training for m in model.modules()), "the trace runs in training mode and restores the modes"


class LateAux(Stack):
    """An auxiliary head that reads layers.1 and runs after the main head."""

    def __init__(self):
        super().__init__(depth=3)
        self.aux = nn.Linear(4, 2)

    def forward(self, x):
        x1 = self.layers[1](self.layers[0](self.embed(x)))
        return self.head(self.layers[2](x1)), self.aux(x1)


def test_an_aux_head_that_runs_after_the_main_head_joins_it():
    blocks = split_blocks(LateAux())
    assert [b.name for b in blocks] == ["embed", "layers.0", "layers.1", "layers.2", "head+aux"]


@pytest.mark.parametrize("build", ["fcn_resnet50", "deeplabv3_resnet50"])
def test_torchvisions_segmentation_models_with_aux_loss_keep_the_main_output_conv_in_the_head(build):
    """correctness_exp/e9: aux_classifier.4, registered last, was the head and classifier.4 froze."""
    with torch.device("meta"):
        model = getattr(torchvision.models.segmentation, build)(aux_loss=True, weights=None, weights_backbone=None)
    blocks = split_blocks(model)
    assert blocks[-1].module_names == ("classifier.4", "aux_classifier.0", "aux_classifier.1", "aux_classifier.4")
    assert all(name.startswith(("backbone.", "classifier.")) for b in blocks[:-1] for name in b.module_names)


def test_googlenets_aux_heads_are_blocks_where_they_run():
    """correctness_exp/e9: aux1 and aux2, registered after inception5b, made the first forward raise
    BlockOrderError. tests/test_block_families.py runs the real forward at every boundary."""
    with torch.device("meta"):
        model = torchvision.models.googlenet(aux_logits=True, init_weights=False, weights=None).eval()
    names = [b.name for b in split_blocks(model)]
    assert names[names.index("aux1") - 1] == "inception4a.branch4.1"
    assert names[names.index("aux2") - 1] == "inception4d.branch4.1"
    assert names[-1] == "fc"


class UntraceableLateAux(LateAux):
    def forward(self, x):
        x = self.embed(x)
        if x.sum() > 0:  # control flow on a tensor value: torch.fx cannot trace it
            x = -x
        return super().forward(x)


class FeaturesFirst(Stack):
    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x, self.head(x)  # features first: the default takes them for the main output


def test_head_names_the_output_layer_when_the_trace_cannot_tell():
    # Untraceable: registration order, and aux (registered last) would be the head.
    assert split_blocks(UntraceableLateAux())[-1].name == "aux"
    assert [b.name for b in split_blocks(UntraceableLateAux(), head="head")][-2:] == ["layers.2", "head+aux"]
    # The first returned tensor is not the main output: its last layer would be the head.
    assert split_blocks(FeaturesFirst(depth=3))[-1].name == "layers.2+head"
    assert [b.name for b in split_blocks(FeaturesFirst(depth=3), head="head")][-2:] == ["layers.2", "head"]


class ReturnsItsInputFirst(Stack):
    def forward(self, x):
        return x * 2, super().forward(x)


@pytest.mark.parametrize(
    "model, kwargs, message",
    [
        (
            ReturnsItsInputFirst(depth=2),
            {},
            r"the first tensor ReturnsItsInputFirst.forward returns depends on no block.*head=",
        ),
        (
            Stack(depth=2),
            {"head": "nope"},
            "head='nope' names no module of the model; top-level modules: embed, layers, head",
        ),
        (Stack(depth=2), {"head": "layers.0.1"}, "head='layers.0.1' owns no parameters of its own"),
        (Stack(depth=2), {"head": "head", "names": ["embed", "layers.*", "head"]}, "head= is for the default split"),
    ],
)
def test_an_output_layer_that_cannot_be_placed_is_a_one_line_error(model, kwargs, message):
    with pytest.raises(BlockError, match=message) as e:
        split_blocks(model, **kwargs)
    assert "\n" not in str(e.value)
    if not kwargs:
        assert split_blocks(model, head="head")[-1].name == "head"
