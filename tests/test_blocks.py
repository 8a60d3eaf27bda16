import pytest
import torchvision
from torch import nn

from freeze import BlockError, split_blocks
from freeze.blocks import Block, check_partition, frozen_names, tracks_running_stats
from tests.tiny_models import Scaled, TiedLM, TinyNet


def test_resnet18_splits_into_stem_residual_blocks_and_head():
    model = torchvision.models.resnet18(num_classes=10)
    blocks = split_blocks(model)
    assert [b.name for b in blocks] == ["stem"] + [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)] + ["fc"]
    assert sum(b.num_params for b in blocks) == sum(p.numel() for p in model.parameters())
    assert blocks[0].module_names == ("conv1", "bn1")
    assert blocks[-1].param_bytes == (512 * 10 + 10) * 4


@pytest.mark.parametrize("depth, residual_blocks", [(34, 16), (50, 16)])
def test_deeper_resnets(depth, residual_blocks):
    model = getattr(torchvision.models, f"resnet{depth}")()
    assert len(split_blocks(model)) == residual_blocks + 2


def test_children_split_is_the_reference_studys_seven_groups():
    model = torchvision.models.resnet18()
    names = [n for n, m in model.named_children() if any(True for _ in m.parameters())]
    assert names == ["conv1", "bn1", "layer1", "layer2", "layer3", "layer4", "fc"]
    assert [b.name for b in split_blocks(model, names)] == names


def test_generic_model_uses_parameter_owning_children_in_order():
    blocks = split_blocks(TinyNet())
    assert [b.name for b in blocks] == ["stem", "block1", "block2", "head"]  # pool/flatten own nothing
    norms = [[s for m in b.modules for s in m.modules() if tracks_running_stats(s)] for b in blocks]
    assert [len(n) for n in norms] == [1, 1, 1, 0]
    assert {n for n, _, _ in blocks[0].buffers()} == {
        "stem.1.running_mean",
        "stem.1.running_var",
        "stem.1.num_batches_tracked",
    }


@pytest.mark.parametrize(
    "names, message",
    [
        (["stem", "nope", "head"], "no module named 'nope'"),
        (["stem", "block1", "block2"], "belong to no block: head.weight"),
        (["stem", "stem.0", "block1", "block2", "head"], "claimed by block 'stem' and by block 'stem.0'"),
        (["stem", "pool", "block1", "block2", "head"], "block 'pool' owns no parameters"),
    ],
)
def test_bad_block_specs_are_one_line_errors(names, message):
    with pytest.raises(BlockError, match=message) as e:
        split_blocks(TinyNet(), names)
    assert "\n" not in str(e.value)


def test_multi_module_block():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    blocks = split_blocks(model, [["0", "1"], "2"])
    assert [b.name for b in blocks] == ["0+1", "2"]
    assert blocks[0].param_names == ("0.weight", "0.bias", "1.weight", "1.bias")


def test_frozen_names_are_the_parameters_and_buffers_of_the_prefix():
    model = TinyNet()
    blocks = split_blocks(model)
    assert frozen_names(blocks, 0) == []
    names = frozen_names(blocks, 2)
    assert set(names) == {n for n, _ in model.named_parameters() if n.startswith(("stem.", "block1."))} | {
        n for n, _ in model.named_buffers() if n.startswith(("stem.", "block1."))
    }
    assert len(names) == len(set(names))


def test_naming_a_module_whose_parameters_are_all_tied_is_a_one_line_error():
    with pytest.raises(BlockError, match=r"block 'head' owns no parameters of its own \(.*tied to block embed\)") as e:
        split_blocks(TiedLM(), ["embed", "layers.*", "head"])
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ blocks that partition the model
def _with_extra_params(block: Block, names: tuple[str, ...], params: tuple[nn.Parameter, ...]) -> Block:
    """``block`` also holding ``params`` (hand-made blocks, as a user could build them)."""
    return Block(block.name, block.module_names, block.modules, block.param_names + names, block.params + params)


def test_blocks_from_split_blocks_partition_the_model_also_with_tied_weights():
    for model in (TinyNet(), TiedLM(), Scaled()):
        check_partition(model, split_blocks(model))


def test_a_trainable_parameter_in_no_block_is_a_one_line_error():
    """correctness_exp/e15: without the stem in a block, 'freeze the first 2 blocks' trained the stem."""
    model = TinyNet()
    with pytest.raises(BlockError, match="parameter 'stem.0.weight' requires grad and is in no block") as e:
        check_partition(model, split_blocks(model)[1:])
    assert "\n" not in str(e.value)


def test_a_parameter_the_user_froze_may_be_in_no_block():
    model = TinyNet()
    model.stem.requires_grad_(False)
    check_partition(model, split_blocks(model)[1:])


def test_a_parameter_in_two_blocks_is_a_one_line_error():
    """correctness_exp/e15: the stem's conv listed again in the head stayed trainable when the stem froze."""
    model = TinyNet()
    blocks = split_blocks(model)
    blocks[3] = _with_extra_params(blocks[3], ("stem.0.weight",), (model.stem[0].weight,))
    with pytest.raises(BlockError, match="parameter 'stem.0.weight' is in block 'stem' and in block 'head'") as e:
        check_partition(model, blocks)
    assert "\n" not in str(e.value)


def test_a_parameter_twice_in_one_block_is_a_one_line_error():
    model = TinyNet()
    blocks = split_blocks(model)
    blocks[1] = _with_extra_params(blocks[1], ("block1.0.weight",), (model.block1[0].weight,))
    with pytest.raises(BlockError, match="parameter 'block1.0.weight' is twice in block 'block1'") as e:
        check_partition(model, blocks)
    assert "\n" not in str(e.value)


def test_a_block_holding_a_parameter_of_another_model_is_a_one_line_error():
    model, other = TinyNet(), TinyNet()
    with pytest.raises(BlockError, match="block 'stem' holds 'stem.0.weight', which is not a parameter of") as e:
        check_partition(model, split_blocks(other))
    assert "\n" not in str(e.value)


def test_a_block_prints_as_its_name_modules_and_sizes_not_its_tensors():
    model = TinyNet()
    text = repr(split_blocks(model)[0])
    assert text.startswith("Block('stem', modules=['stem']") and "tensor" not in text and "\n" not in text
