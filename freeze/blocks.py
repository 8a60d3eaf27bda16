"""Split a model into the ordered list of blocks that freezing works on.

A boundary ``k`` freezes blocks ``0 .. k-1``. Blocks must be in forward order, own at least one
parameter each, and together own every parameter of the model exactly once: otherwise "freeze the
first k blocks" would leave parameters in no man's land or freeze them twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn


class BlockError(ValueError):
    """A block specification that does not describe the model."""


@dataclass(frozen=True, eq=False)
class Block:
    name: str
    module_names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    param_names: tuple[str, ...]  # fully qualified, as in model.named_parameters()
    params: tuple[nn.Parameter, ...]

    @property
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def buffers(self) -> list[tuple[str, nn.Module, str]]:
        """(qualified name, owning module, attribute name) of every buffer in the block."""
        out = []
        for mod_name, mod in zip(self.module_names, self.modules):
            for sub_name, sub in mod.named_modules():
                for buf_name, buf in sub.named_buffers(recurse=False):
                    if buf is None:
                        continue
                    prefix = ".".join(x for x in (mod_name, sub_name) if x)
                    out.append((f"{prefix}.{buf_name}", sub, buf_name))
        return out

    def running_stat_norms(self) -> list[nn.Module]:
        """Norm layers of the block that keep running statistics (BatchNorm, InstanceNorm with
        ``track_running_stats=True``, any ``_NormBase`` tracking them): frozen, each stays in eval."""
        return [sub for mod in self.modules for sub in mod.modules() if tracks_running_stats(sub)]


def frozen_names(blocks: Sequence[Block], k: int) -> list[str]:
    """Qualified names of the parameters and buffers of blocks ``0 .. k-1``: what DDP must leave
    alone at boundary ``k`` (frozen parameters reduce nothing; frozen buffers must not be
    re-broadcast at every forward)."""
    return [n for b in blocks[:k] for n in b.param_names] + [n for b in blocks[:k] for n, _, _ in b.buffers()]


def tracks_running_stats(module: nn.Module) -> bool:
    """True for a norm layer whose train-mode forward updates running statistics."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats


def _is_torchvision_resnet(model: nn.Module) -> bool:
    return all(hasattr(model, a) for a in ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4", "fc")) and all(
        isinstance(getattr(model, f"layer{i}"), nn.Sequential) for i in range(1, 5)
    )


def default_block_names(model: nn.Module) -> list[list[str]]:
    """The default split: ResNets by residual block, anything else by top-level children that own
    parameters (registration order, which for ``nn.Sequential``-style models is forward order)."""
    if _is_torchvision_resnet(model):
        names: list[list[str]] = [["conv1", "bn1"]]
        for i in range(1, 5):
            layer = getattr(model, f"layer{i}")
            names += [[f"layer{i}.{j}"] for j in range(len(layer))]
        names.append(["fc"])
        return names
    return children_block_names(model)


def children_block_names(model: nn.Module) -> list[list[str]]:
    """Parameter-owning top-level children, one block each (for a ResNet: conv1, bn1, layer1..4, fc,
    the reference study's 7 freezable groups)."""
    return [[n] for n, m in model.named_children() if any(True for _ in m.parameters())]


def _block_name(module_names: Sequence[str]) -> str:
    return "stem" if list(module_names) == ["conv1", "bn1"] else "+".join(module_names)


def split_blocks(model: nn.Module, names: Sequence[str | Sequence[str]] | None = None) -> list[Block]:
    """Ordered freezable blocks of ``model``.

    ``names``: one entry per block, in forward order; an entry is a module name (``"layer1"``) or a
    list of module names that form one block (``["conv1", "bn1"]``). ``None`` picks
    :func:`default_block_names`.
    """
    spec = default_block_names(model) if names is None else [[n] if isinstance(n, str) else list(n) for n in names]
    if not spec:
        raise BlockError("split_blocks: the model has no parameter-owning modules to freeze")
    modules = dict(model.named_modules())
    param_ids = {id(p): n for n, p in model.named_parameters()}
    owner: dict[int, str] = {}
    blocks: list[Block] = []
    for entry in spec:
        if not entry:
            raise BlockError("split_blocks: an empty block entry (a block needs at least one module name)")
        mods = []
        for mod_name in entry:
            if mod_name not in modules or mod_name == "":
                top = ", ".join(n for n, _ in model.named_children())
                raise BlockError(f"split_blocks: no module named '{mod_name}' in the model; top-level modules: {top}")
            mods.append(modules[mod_name])
        block_name = _block_name(entry)
        pnames, params = [], []
        for mod in mods:
            for p in mod.parameters():
                if id(p) in owner:
                    raise BlockError(
                        f"split_blocks: parameter '{param_ids[id(p)]}' is claimed by block "
                        f"'{owner[id(p)]}' and by block '{block_name}'"
                    )
                owner[id(p)] = block_name
                pnames.append(param_ids[id(p)])
                params.append(p)
        if not params:
            raise BlockError(
                f"split_blocks: block '{block_name}' owns no parameters (parameter-free modules are not blocks)"
            )
        blocks.append(Block(block_name, tuple(entry), tuple(mods), tuple(pnames), tuple(params)))
    orphans = [n for n, p in model.named_parameters() if id(p) not in owner]
    if orphans:
        shown = ", ".join(orphans[:5]) + (" ..." if len(orphans) > 5 else "")
        raise BlockError(f"split_blocks: {len(orphans)} parameter(s) belong to no block: {shown}")
    return blocks
