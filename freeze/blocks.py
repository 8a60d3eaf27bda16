"""Split a model into the ordered list of blocks that freezing works on.

A boundary ``k`` freezes blocks ``0 .. k-1``. Blocks must be in forward order, own at least one
parameter each, and together own every parameter of the model exactly once: otherwise "freeze the
first k blocks" would leave parameters in no man's land or freeze them twice. :func:`split_blocks`
builds such blocks; :func:`check_partition` checks blocks made by hand (a parameter the user froze
may be in none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from freeze.block_finder import BlockError, default_block_names, expand_globs, first_block_using


@dataclass(frozen=True, eq=False)
class Block:
    name: str
    module_names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    param_names: tuple[str, ...]  # fully qualified, as in model.named_parameters()
    params: tuple[nn.Parameter, ...]

    def __repr__(self) -> str:
        # The generated repr printed every weight tensor (a new user's print(split_blocks(model))).
        return (
            f"Block({self.name!r}, modules={list(self.module_names)}, params={len(self.params)}, "
            f"numel={self.num_params:,}, bytes={self.param_bytes:,})"
        )

    @property
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def buffers(self) -> list[tuple[str, nn.Module, str]]:
        """(qualified name, owning module, attribute name) of every buffer in the block.

        Returns:
            One tuple per buffer, in module order; the name is qualified as in
            ``model.named_buffers()``.
        """
        out = []
        for mod_name, mod in zip(self.module_names, self.modules):
            for sub_name, sub in mod.named_modules():
                for buf_name, buf in sub.named_buffers(recurse=False):
                    if buf is None:
                        continue
                    prefix = ".".join(x for x in (mod_name, sub_name) if x)
                    out.append((f"{prefix}.{buf_name}", sub, buf_name))
        return out


def frozen_names(blocks: Sequence[Block], k: int) -> list[str]:
    """Qualified names of the parameters and buffers of blocks ``0 .. k-1``: what DDP must leave
    alone at boundary ``k`` (frozen parameters reduce nothing; frozen buffers must not be
    re-broadcast at every forward)."""
    return [n for b in blocks[:k] for n in b.param_names] + [n for b in blocks[:k] for n, _, _ in b.buffers()]


def check_partition(model: nn.Module, blocks: Sequence[Block]) -> None:
    """Raise a one-line ``BlockError`` unless ``blocks`` partition the parameters of ``model``.

    Every parameter of ``model`` that requires grad is in exactly one block, and no parameter is in
    two blocks or twice in one. A parameter the user froze (``requires_grad=False``) may be in no
    block: no boundary ever trains it. Blocks from :func:`split_blocks` always pass; hand-made ones
    may not, and then "freeze the first k blocks" would train what no block holds (the optimizer
    steps it, and ``trainable_grad_bytes`` leaves it out) or leave a parameter trainable in a later
    block once an earlier one froze it.

    Args:
        model: the model the blocks split.
        blocks: its blocks, in the order given to the Freezer.

    Raises:
        BlockError: naming the first offending parameter (blocks in order, then the model's
            parameters in ``named_parameters()`` order) and the fix.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    problem = f"blocks do not partition {type(model).__name__}"
    holder: dict[int, int] = {}  # parameter -> index of the block holding it
    for i, block in enumerate(blocks):
        for name, p in zip(block.param_names, block.params):
            if id(p) not in names:
                raise BlockError(
                    f"{problem}: block '{block.name}' holds '{name}', which is not a parameter of this model; "
                    "build the blocks with split_blocks(model) of the model you pass"
                )
            if id(p) in holder:
                first = holder[id(p)]
                where = (
                    f"twice in block '{block.name}'"
                    if first == i
                    else f"in block '{blocks[first].name}' and in block '{block.name}'"
                )
                raise BlockError(
                    f"{problem}: parameter '{names[id(p)]}' is {where}; list each parameter in one block "
                    "(split_blocks(model) does)"
                )
            holder[id(p)] = i
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in holder:
            raise BlockError(
                f"{problem}: parameter '{name}' requires grad and is in no block, so it would train at "
                "every boundary; add it to a block (split_blocks(model) places every parameter), or "
                "set its requires_grad=False to keep it frozen"
            )


def block_param_groups(blocks: Sequence[Block], **options: object) -> list[dict]:
    """One optimizer parameter group per block, in block order: what a policy that sets each
    block's learning rate (``at:anneal=W``, ``freezeout:anneal=true``) needs, e.g.
    ``torch.optim.SGD(block_param_groups(blocks), lr=0.1, momentum=0.9)``.

    Args:
        blocks: the model's blocks, as given to the Freezer.
        **options: group options every group gets (lr, weight_decay, ...); the optimizer's defaults
            fill the rest.
    """
    return [{"params": list(block.params), **options} for block in blocks]


def held_in_eval(blocks: Sequence[Block], frozen_mode: str) -> list[nn.Module]:
    """The modules of (frozen) ``blocks`` that run in eval under ``frozen_mode``."""
    return [
        m
        for b in blocks
        for mod in b.modules
        for m in mod.modules()
        if frozen_mode == "eval" or tracks_running_stats(m)
    ]


def tracks_running_stats(module: nn.Module) -> bool:
    """True for a norm layer whose train-mode forward updates running statistics."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats


def children_block_names(model: nn.Module) -> list[list[str]]:
    """Parameter-owning top-level children, one block each (for a ResNet: conv1, bn1, layer1..4, fc,
    the reference study's 7 freezable groups).

    Args:
        model: the model to split; children without parameters (ReLU, pooling) are skipped.

    Returns:
        ``[[name], ...]`` in registration order, ready for :func:`split_blocks`.
    """
    return [[n] for n, m in model.named_children() if any(True for _ in m.parameters())]


def _block_name(names: Sequence[str]) -> str:
    return "stem" if list(names) == ["conv1", "bn1"] else "+".join(names)


def _nested(a: str, b: str) -> bool:
    """One dotted name is the other or lies inside it ('stem' and 'stem.0')."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


@dataclass
class _Draft:
    """A block being assembled: what it names, and the parameters it owns so far."""

    names: list[str]
    module_names: list[str]
    param_names: list[str]
    params: list[nn.Parameter]


def split_blocks(
    model: nn.Module, names: Sequence[str | Sequence[str]] | None = None, *, head: str | None = None
) -> list[Block]:
    """Ordered freezable blocks of ``model``; boundary k freezes blocks 0..k-1, the last is the head.

    Args:
        model: the model to split (any device, also ``meta``).
        names: one entry per block, in forward order, or ``None`` for the default split
            (:func:`freeze.block_finder.default_block_names`: the model's repeated layers in forward
            order, e.g. stem, each residual block, fc for a ResNet; the head is the block nearest the
            main output, see rule 5 there). An entry is a module name (``"pooler"``), a glob that
            becomes one block per matching parameter-owning module (``"encoder.layer.*"``, in
            registration order; ``*`` stays within one dotted component), or a list of module
            names, globs and parameter names forming ONE block (``["conv1", "bn1"]``,
            ``["conv_proj", "class_token"]``). The last entry is the head.
        head: with the default split only: the module that computes the model's output (``"fc"``),
            for when the default cannot tell (a model ``torch.fx`` cannot trace, whose units are then
            in registration order, with an auxiliary head registered last; or a forward whose first
            returned tensor is not the main output). The last block is then every unit inside
            ``head`` and every unit after the first of them in forward order (an auxiliary head that
            runs after the main one joins it; it is never frozen).

    Every parameter ends in exactly one block. A parameter tied to several named modules belongs
    to the first block naming it. A parameter owned directly by a parent of the named modules (ViT's
    ``class_token``) and not named itself joins the first block whose input depends on it
    (:func:`freeze.block_finder.first_block_using`). Anything else is a one-line ``BlockError``.
    """
    if names is not None and head is not None:
        raise BlockError("split_blocks: head= is for the default split; with names=[...] the last entry is the head")
    spec = default_block_names(model, head) if names is None else expand_globs(model, names)
    if not spec:
        raise BlockError("split_blocks: the model has no parameter-owning modules to freeze")
    drafts, unclaimed = _claim_parameters(model, spec)
    _place_parent_params(model, drafts, unclaimed)
    modules = dict(model.named_modules())
    return [
        Block(
            _block_name(d.names),
            tuple(d.module_names),
            tuple(modules[n] for n in d.module_names),
            tuple(d.param_names),
            tuple(d.params),
        )
        for d in drafts
    ]


def _claim_parameters(model: nn.Module, spec: list[list[str]]) -> tuple[list[_Draft], list[str]]:
    """One draft per entry of ``spec`` with its modules and the parameters it names first, and the
    names of the parameters no entry names (``named_parameters()`` order), for the parents' rule."""
    modules = dict(model.named_modules())
    named_params = dict(model.named_parameters())
    param_ids = {id(p): n for n, p in named_params.items()}
    claimed: dict[int, tuple[int, str]] = {}  # parameter -> (block index, the name that claimed it)
    drafts = [_Draft(list(entry), [], [], []) for entry in spec]
    for i, (entry, draft) in enumerate(zip(spec, drafts)):
        if not entry:
            raise BlockError("split_blocks: an empty block entry (a block needs at least one module name)")
        for name in entry:
            module_name, params = _entry_member(model, modules, named_params, name)
            if module_name is not None:
                draft.module_names.append(module_name)
            for p in params:
                if id(p) not in claimed:
                    claimed[id(p)] = (i, name)
                    draft.param_names.append(param_ids[id(p)])
                    draft.params.append(p)
                elif _nested(claimed[id(p)][1], name):
                    raise BlockError(
                        f"split_blocks: parameter '{param_ids[id(p)]}' is claimed by block "
                        f"'{_block_name(drafts[claimed[id(p)][0]].names)}' and by block '{_block_name(entry)}'"
                    )
                # else: tied to a module of an earlier entry, which owns it (it uses it first)
        if not draft.params:
            raise _owns_nothing(entry, drafts, claimed, modules)
    return drafts, [n for n, p in named_params.items() if id(p) not in claimed]


def _entry_member(
    model: nn.Module, modules: dict[str, nn.Module], named_params: dict[str, nn.Parameter], name: str
) -> tuple[str | None, list[nn.Parameter]]:
    """What one name of a block entry stands for: (the module's name, its parameters) for a module,
    (None, [the parameter]) for a parameter name."""
    if name in modules and name != "":
        return name, list(modules[name].parameters())
    if name in named_params:
        return None, [named_params[name]]
    top = ", ".join(n for n, _ in model.named_children())
    raise BlockError(f"split_blocks: no module named '{name}' in the model; top-level modules: {top}")


def _owns_nothing(
    entry: list[str], drafts: list[_Draft], claimed: dict[int, tuple[int, str]], modules: dict[str, nn.Module]
) -> BlockError:
    """The error for an entry that claimed no parameter: its modules have none, or earlier blocks
    hold every one of them (tied weights)."""
    earlier = {
        _block_name(drafts[claimed[id(p)][0]].names) for n in entry if n in modules for p in modules[n].parameters()
    }
    why = f" of its own (its parameters are tied to block {', '.join(sorted(earlier))})" if earlier else ""
    return BlockError(
        f"split_blocks: block '{_block_name(entry)}' owns no parameters{why} (parameter-free modules are not blocks)"
    )


def _place_parent_params(model: nn.Module, drafts: list[_Draft], unclaimed: list[str]) -> None:
    """Unclaimed parameters owned directly by a parent of the blocks' modules (or by the model
    itself) go to the first block that uses them; any other unclaimed parameter is an error."""
    block_modules = [n for d in drafts for n in d.module_names]

    def owned_by_a_parent(param_name: str) -> bool:
        owner = param_name.rpartition(".")[0]
        return owner == "" or any(m.startswith(owner + ".") for m in block_modules)

    orphans = [n for n in unclaimed if not owned_by_a_parent(n)]
    if orphans:
        shown = ", ".join(orphans[:5]) + (" ..." if len(orphans) > 5 else "")
        raise BlockError(f"split_blocks: {len(orphans)} parameter(s) belong to no block: {shown}")
    if not unclaimed:
        return
    named_params = dict(model.named_parameters())
    placed = first_block_using(model, [d.module_names for d in drafts], unclaimed)
    for i, draft in enumerate(drafts):
        # Ahead of the block's own parameters: the parent uses them on the way into the block.
        loose = [n for n, b in zip(unclaimed, placed) if b == i]
        draft.param_names[:0] = loose
        draft.params[:0] = [named_params[n] for n in loose]
