"""Model factory: any torchvision classification model, an optional CIFAR stem for ResNets, and
weights from torchvision (ImageNet), a state-dict file or one of our checkpoints.

Weights are loaded leniently in one precise sense: tensors whose SHAPE differs from the model's
(a new classification head, a different stem) are skipped and reported; a name that exists on only
one side is an error, because that means the file belongs to a different architecture.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torchvision
from torch import nn

from freeze.block_finder import BlockError
from freeze.blocks import Block, children_block_names, split_blocks
from freeze.pipeline.config import STEMS
from freeze.pipeline.registry import registration
from freeze.pipeline.runs import UnsafeFileError, load_torch_file

_log = logging.getLogger(__name__)

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # added by DDP / DataParallel and by torch.compile


class ModelError(Exception):
    """A model or weights problem, as one line naming the field or file and the accepted values."""


def classification_models() -> list[str]:
    return torchvision.models.list_models(module=torchvision.models)


# Your own models by name (model.arch): builder(num_classes) -> nn.Module, registered by a plugin module
# (freeze.pipeline.plugins) with @register_model("name").
MODELS: dict[str, Callable[[int], nn.Module]] = {}


def register_model(name: str) -> Callable[[Callable[[int], nn.Module]], Callable[[int], nn.Module]]:
    """Decorator: make ``builder(num_classes) -> nn.Module`` a ``model.arch`` the pipeline accepts.

    The builder returns the model with a fresh ``num_classes`` head as its last ``nn.Linear`` (the
    head ``model.weights`` never overwrites); blocks are cut by ``split_blocks`` as for any model, or
    named in ``model.blocks``.

    Raises:
        ModelError: the name is empty, a torchvision model's, or another builder's.
    """
    return registration("register_model", name, MODELS, classification_models, "a torchvision model", ModelError)


def check_arch(arch: str) -> None:
    """ModelError (one line naming model.arch and what is accepted) unless ``arch`` is a torchvision
    classification model name or a registered one (:func:`register_model`); config validation
    reports the same line."""
    names = classification_models()
    if arch in names or arch in MODELS:
        return
    close = difflib.get_close_matches(str(arch), names, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    families = sorted({re.match(r"(wide_)?[a-z]+", n).group(0) for n in names})
    raise ModelError(
        f"unknown model.arch {arch!r}{hint}: accepted are the {len(names)} torchvision classification "
        f"models, e.g. resnet18, resnet50, mobilenet_v3_small, efficientnet_b0, vgg11_bn "
        f"(families: {', '.join(families)}), and models registered by plugins.modules "
        f"({', '.join(sorted(MODELS)) or 'none registered'})"
    )


def _cifar_stem(model: nn.Module, arch: str) -> None:
    """3x3 stride-1 conv and no max-pool: keeps 32x32 inputs at 32x32 into layer1, the standard
    CIFAR ResNet; the ImageNet stem shrinks them to 8x8 first (16x fewer FLOPs, lower accuracy)."""
    conv = getattr(model, "conv1", None)
    if not (
        isinstance(conv, nn.Conv2d)
        and isinstance(getattr(model, "maxpool", None), nn.Module)
        and hasattr(model, "layer1")
    ):
        raise ModelError(
            f"model.stem='cifar' is supported only for ResNets (resnet*, resnext*, wide_resnet*), not {arch!r}"
        )
    model.conv1 = nn.Conv2d(conv.in_channels, conv.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision's ResNet
    model.maxpool = nn.Identity()


def imagenet_weights_file(arch: str) -> tuple[str, Path]:
    """The URL of torchvision's ImageNet weights for ``arch`` and the file torchvision reads them from
    without downloading (``<torch hub dir>/checkpoints/<file name>``)."""
    url = torchvision.models.get_model_weights(arch).DEFAULT.url
    return url, Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]


def imagenet_weights_placement(arch: str) -> str:
    """What an offline user does with the weights file: where to put it, or how to name it."""
    url, cached = imagenet_weights_file(arch)
    return f"put {cached.name} ({url}) at {cached}, or anywhere and pass model.weights=/path/to/{cached.name}"


def _imagenet_state_dict(arch: str) -> dict[str, torch.Tensor]:
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    try:
        return weights.get_state_dict(progress=False)
    except Exception as exc:  # offline: URLError / OSError; a broken download: RuntimeError
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ModelError(
            f"could not download the ImageNet weights for {arch} from {weights.url} ({reason}): "
            f"fetch that file where there is internet and {imagenet_weights_placement(arch)}"
        ) from None


def build_model(
    arch: str = "resnet18",
    num_classes: int = 10,
    stem: str = "imagenet",
    weights: str | Path = "none",
    logger: logging.Logger | None = None,
) -> nn.Module:
    """A torchvision classification model with a fresh ``num_classes`` head.

    ``stem``: "imagenet" (as torchvision builds it) or "cifar" (ResNets only). ``weights``: "none",
    "imagenet" (torchvision's download) or a path to a state dict / checkpoint. Weights initialise
    everything but the head, which is always freshly initialised: a head trained on another task
    predicts that task's classes confidently and wrongly even when its shape fits (the reference
    study left the ImageNet head in place). Tensors whose shape does not fit (a CIFAR stem) also
    keep their fresh initialization. Every tensor kept fresh is named on ``logger`` (default: this
    module's logger; the training loop passes the run's logger, so the list lands in the run's log).
    """
    check_arch(arch)
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"model.num_classes must be a positive integer, got {num_classes!r}")
    if stem not in STEMS:
        raise ModelError(f"model.stem must be one of {', '.join(STEMS)}, got {stem!r}")
    if arch in MODELS:
        if stem != "imagenet" or weights == "imagenet":
            raise ModelError(
                f"model.arch {arch!r} is your own model: model.stem=cifar and model.weights=imagenet are for "
                "torchvision's; accepted: model.stem=imagenet (as built) and model.weights none or a file"
            )
        model = MODELS[arch](num_classes)
        if not isinstance(model, nn.Module):
            raise ModelError(f"model.arch {arch!r}: its builder returned a {type(model).__name__}, not an nn.Module")
    else:
        # Every torchvision builder sizes its own head from num_classes (fc, classifier[-1], heads.head,
        # ...), so no architecture-specific head surgery is needed; pretrained tensors are loaded after.
        model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    if stem == "cifar":
        _cifar_stem(model, arch)
    if weights == "none":
        return model
    source: Mapping[str, torch.Tensor] | str | Path = _imagenet_state_dict(arch) if weights == "imagenet" else weights
    skipped = load_weights(model, source, keep_fresh=head_keys(model))
    if skipped:
        where = str(weights) if weights != "imagenet" else f"the ImageNet weights of {arch}"
        (logger or _log).info("model.weights %s: kept fresh %s (the head, or shape differs)", where, ", ".join(skipped))
    return model


def head_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the classifier head: the parameters of the model's last Linear module
    (``fc`` in ResNets, ``classifier.N`` in VGG/MobileNet/EfficientNet, ``heads.head`` in ViT)."""
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linears:
        return []
    head = linears[-1]
    return [f"{head}.{name}" for name, _ in model.get_submodule(head).named_parameters(recurse=False)]


def _read_state_dict(path: Path) -> Mapping[str, object]:
    if not path.is_file():
        raise ModelError(f"model.weights file {path} does not exist: give 'none', 'imagenet' or a path to a state dict")
    try:
        # Weights-only, never a full unpickle: a weights file is often downloaded, and a crafted
        # one would otherwise run code. Our own checkpoints load this way too.
        obj = load_torch_file(path)
    except UnsafeFileError as err:
        raise ModelError(f"model.weights: {err}") from None
    except Exception as exc:
        reason = type(exc).__name__
        raise ModelError(f"{path} is not a readable torch file ({reason}): give a state dict or a checkpoint") from None
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping):
        obj = obj["model"]  # one of our checkpoints
    if not (isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise ModelError(
            f"{path} holds no state dict: expected a dict of tensors or a checkpoint dict with key 'model'"
        )
    return obj


def state_dict_mismatch(
    own: Mapping[str, torch.Tensor], other: Mapping[str, object], shapes: bool = False
) -> str | None:
    """None when ``other`` has exactly the keys of ``own`` (and, with ``shapes``, their shapes);
    else one line with counts and an example, never the hundreds of names a model has."""
    unexpected = sorted(set(other) - set(own))
    missing = sorted(set(own) - set(other))
    if unexpected or missing:
        shown = ", ".join((unexpected[:2] + missing[:2])[:3])
        return f"{len(unexpected)} unexpected, {len(missing)} missing keys, e.g. {shown}"
    if shapes:
        reshaped = [k for k in own if tuple(getattr(other[k], "shape", ())) != tuple(own[k].shape)]
        if reshaped:
            key = reshaped[0]
            found = list(getattr(other[key], "shape", ()))
            return f"{len(reshaped)} tensors of another shape, e.g. {key} {found} instead of {list(own[key].shape)}"
    return None


def _strip_wrappers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for prefix in _WRAPPER_PREFIXES:
            key = key.removeprefix(prefix)
        out[key] = value
    return out


def load_weights(
    model: nn.Module, source: str | Path | Mapping[str, torch.Tensor], keep_fresh: Sequence[str] = ()
) -> list[str]:
    """Copy the tensors of ``source`` (a file path or a state dict) into ``model``, except the keys in
    ``keep_fresh``; return the keys not loaded: ``keep_fresh`` plus those whose shape differs."""
    where = str(source) if isinstance(source, (str, Path)) else "the given state dict"
    state = _read_state_dict(Path(source)) if isinstance(source, (str, Path)) else source
    state = _strip_wrappers(state)
    own = model.state_dict()
    mismatch = state_dict_mismatch(own, state)
    if mismatch:
        raise ModelError(f"{where} does not match the model ({mismatch}): is it a checkpoint of another architecture?")
    skipped = sorted(k for k, v in state.items() if k in keep_fresh or tuple(v.shape) != tuple(own[k].shape))
    if len(skipped) == len(own):
        raise ModelError(f"{where}: no tensor has the model's shape: is it a checkpoint of another architecture?")
    result = model.load_state_dict({k: v for k, v in state.items() if k not in skipped}, strict=False)
    if sorted(result.missing_keys) != skipped or result.unexpected_keys:  # guards the filtering above
        raise ModelError(f"{where}: loading left {result.missing_keys} unset")
    return skipped


def build_blocks(model: nn.Module, how: str | tuple) -> list[Block]:
    """``model`` cut as ``model.blocks`` says (freeze.pipeline.config.BlockSplit); ModelError (one
    line) when its names or globs do not cut this model."""
    if how == "default":
        names = None
    elif how == "children":
        names = children_block_names(model)
    else:  # the config's entries: a name or glob, or a group of them (a tuple)
        names = [n if isinstance(n, str) else list(n) for n in how]
    try:
        return split_blocks(model, names)
    except BlockError as err:
        raise ModelError(f"model.blocks: {err}") from None


def check_block_split(arch: str, stem: str, how: str | tuple) -> None:
    """ModelError (one line) when ``model.blocks``' own list does not cut ``arch``: checked on the
    model built on the meta device (no memory, no weights), before any run starts."""
    if isinstance(how, str):
        return  # the library's splits cut every model
    with torch.device("meta"):
        model = build_model(arch, num_classes=10, stem=stem)
    build_blocks(model, how)
