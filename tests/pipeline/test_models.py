import logging
import urllib.error

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from freeze.pipeline.models import ModelError, build_model, head_keys, load_weights


def _error_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def five_class_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return build_model("resnet18", num_classes=5).state_dict()


def test_resnet18_imagenet_and_cifar_stems():
    imagenet = build_model("resnet18", num_classes=10)
    assert imagenet.conv1.kernel_size == (7, 7) and isinstance(imagenet.maxpool, nn.MaxPool2d)
    assert imagenet(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    cifar = build_model("resnet18", num_classes=10, stem="cifar")
    conv = cifar.conv1
    assert (conv.kernel_size, conv.stride, conv.padding, conv.bias) == ((3, 3), (1, 1), (1, 1), None)
    assert isinstance(cifar.maxpool, nn.Identity)
    # the CIFAR stem keeps 32x32 into layer1 instead of 8x8
    assert nn.Sequential(cifar.conv1, cifar.maxpool)(torch.randn(1, 3, 32, 32)).shape[-1] == 32
    assert cifar(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_other_families_get_a_sized_head():
    model = build_model("mobilenet_v3_small", num_classes=7)
    assert model.classifier[-1].out_features == 7
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_bad_arch_and_stem_are_one_clear_line():
    with pytest.raises(ModelError) as err:
        build_model("resnet19")
    assert "unknown model.arch 'resnet19'" in _error_line(err) and "resnet18" in str(err.value)
    with pytest.raises(ModelError) as err:
        build_model("resnet18", stem="tiny")
    assert "imagenet, cifar" in _error_line(err)
    with pytest.raises(ModelError) as err:
        build_model("mobilenet_v3_small", stem="cifar")
    assert "only for ResNets" in _error_line(err)


def test_head_of_another_size_is_skipped_and_the_rest_loaded_bit_exactly(tmp_path, five_class_state):
    path = tmp_path / "five.pt"
    torch.save(five_class_state, path)
    torch.manual_seed(2)
    model = build_model("resnet18", num_classes=10)
    fresh_fc = model.fc.weight.detach().clone()
    assert load_weights(model, path) == ["fc.bias", "fc.weight"]
    loaded = model.state_dict()
    for key, value in five_class_state.items():
        if not key.startswith("fc."):
            assert torch.equal(loaded[key], value), key
    assert torch.equal(model.fc.weight, fresh_fc)


def test_checkpoint_with_ddp_prefix_and_training_state(tmp_path, five_class_state):
    checkpoint = {
        "model": {f"module.{k}": v for k, v in five_class_state.items()},
        "epoch": 3,
        "rng": {"numpy": {"keys": torch.arange(624), "pos": 624}, "python": (3, tuple(range(625)), None)},
    }
    path = tmp_path / "checkpoint.pt"
    torch.save(checkpoint, path)
    model = build_model("resnet18", num_classes=5)
    assert load_weights(model, path) == []
    assert torch.equal(model.layer4[1].conv2.weight, five_class_state["layer4.1.conv2.weight"])
    # numpy objects are not plain data: such a file is refused, never loaded with a full unpickle.
    torch.save({**checkpoint, "legacy_rng": np.random.get_state()}, path)
    with pytest.raises(ModelError, match=r"refers to numpy\.\S+, which is not a tensor or plain data") as err:
        load_weights(model, path)
    assert "\n" not in str(err.value)


def test_stem_mismatch_skips_conv1_and_build_model_logs_it(tmp_path, caplog):
    path = tmp_path / "cifar_stem.pt"
    torch.save(build_model("resnet18", num_classes=10, stem="cifar").state_dict(), path)
    with caplog.at_level(logging.INFO, logger="freeze.pipeline.models"):
        model = build_model("resnet18", num_classes=10, weights=str(path))
    assert model.conv1.kernel_size == (7, 7)
    assert "conv1.weight" in caplog.text and "fc.weight" in caplog.text  # the head is always kept fresh
    assert load_weights(build_model("resnet18", num_classes=10), path) == [
        "conv1.weight"
    ]  # load_weights alone: shape rule only


def test_bad_weight_files_name_the_path(tmp_path):
    model = build_model("resnet18")
    cases = {
        "missing.pt": None,
        "list.pt": [1, 2, 3],
        "text.pt": "this is not a torch file",
        "resnet34.pt": torchvision.models.resnet34(num_classes=10).state_dict(),
    }
    expected = {
        "missing.pt": "does not exist",
        "list.pt": "holds no state dict",
        "text.pt": "not a readable torch file",
        "resnet34.pt": "does not match the model",
    }
    for name, content in cases.items():
        path = tmp_path / name
        if name == "text.pt":
            path.write_text(content)
        elif content is not None:
            torch.save(content, path)
        with pytest.raises(ModelError) as err:
            load_weights(model, path)
        assert str(path) in _error_line(err) and expected[name] in str(err.value), name


def test_imagenet_weights_offline_and_online(monkeypatch, five_class_state):
    def offline(url, *args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", offline)
    with pytest.raises(ModelError) as err:
        build_model("resnet18", weights="imagenet")
    assert "could not download the ImageNet weights for resnet18" in _error_line(err)
    assert "model.weights=/path/to/resnet18-" in str(err.value)

    torch.manual_seed(3)
    imagenet_state = build_model("resnet18", num_classes=1000).state_dict()
    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", lambda url, *a, **k: imagenet_state)
    model = build_model("resnet18", num_classes=10, weights="imagenet")
    assert torch.equal(model.layer1[0].conv1.weight, imagenet_state["layer1.0.conv1.weight"])
    assert model.fc.out_features == 10


def test_head_is_fresh_even_when_its_shape_fits(tmp_path):
    """A same-shaped head from another task must not be loaded: it would predict that task's
    classes (the reference study's 'head left in place' bug in another form)."""
    torch.manual_seed(0)
    source = build_model("resnet18", num_classes=10)
    path = tmp_path / "source.pt"
    torch.save({"model": source.state_dict()}, path)
    torch.manual_seed(1)
    model = build_model("resnet18", num_classes=10, weights=str(path))
    assert head_keys(model) == ["fc.weight", "fc.bias"]
    assert not torch.equal(model.fc.weight, source.fc.weight)
    for name, tensor in source.state_dict().items():
        if not name.startswith("fc."):
            assert torch.equal(model.state_dict()[name], tensor), name
    assert head_keys(build_model("mobilenet_v3_small", num_classes=7)) == ["classifier.3.weight", "classifier.3.bias"]


def test_kept_fresh_weights_are_named_in_the_run_log(tmp_path):
    from freeze.pipeline.log import get_logger

    path = tmp_path / "cifar_stem.pt"
    torch.save(build_model("resnet18", num_classes=10, stem="cifar").state_dict(), path)
    log_file = tmp_path / "log.rank0.txt"
    logger = get_logger(0, log_file)  # the run's logger, as train_worker builds it
    try:
        build_model("resnet18", num_classes=10, weights=str(path), logger=logger)
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            handler.close()
    text = log_file.read_text()
    assert "kept fresh" in text and "conv1.weight" in text and "fc.weight" in text


def test_an_explicit_block_split_from_the_config_cuts_the_model_and_round_trips(tmp_path):
    """model.blocks takes split_blocks' own entries (names, globs, groups) from a config (issue 47)."""
    from freeze.pipeline.config import config_to_toml, load_config
    from freeze.pipeline.models import build_blocks
    from freeze.pipeline.preflight import preflight

    entries = '[["conv1", "bn1"], "layer1.*", "layer2", "layer3", "layer4", "fc"]'
    config = load_config(None, [f"model.blocks={entries}"])
    assert config.model.blocks == (("conv1", "bn1"), "layer1.*", "layer2", "layer3", "layer4", "fc")
    preflight(config)  # cut on the meta device: no weights, no memory
    blocks = build_blocks(build_model("resnet18", num_classes=10), config.model.blocks)
    assert [b.name for b in blocks] == ["stem", "layer1.0", "layer1.1", "layer2", "layer3", "layer4", "fc"]
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path) == config  # written out and read back (a resume compares them)


@pytest.mark.parametrize(
    "value, expected",
    [
        ('["fc"]', "accepted: default, children, or a list of 2 or more entries"),
        ('["conv1", ""]', "accepted: default, children, or a list"),
        ("layers", "'layers' is not accepted; accepted: default, children"),
        ('["conv1", "layer9.*", "fc"]', "model.blocks: "),  # no such module in a ResNet-18: split_blocks' line
    ],
)
def test_a_block_split_that_cannot_cut_the_model_is_one_line_before_any_run(value, expected):
    from freeze.pipeline.config import ConfigError, load_config
    from freeze.pipeline.preflight import preflight

    with pytest.raises(ConfigError) as refused:
        preflight(load_config(None, [f"model.blocks={value}"]))
    assert expected in str(refused.value) and "\n" not in str(refused.value)
