"""Find the blocks of a model: its repeated layers, glob patterns, and parameters owned by a parent.

One rule covers every family (torchvision ResNet, VGG, DenseNet, MobileNet, EfficientNet, RegNet,
ConvNeXt, ViT, Swin, GoogLeNet, FCN and DeepLabV3 with their auxiliary heads; Hugging Face BERT and
GPT-2; any model built from ``nn.Sequential`` / ``nn.ModuleList`` stacks), with no per-family code
path:

1. A *layer container* is an ``nn.ModuleList`` / ``nn.ModuleDict`` that owns parameters, or an
   ``nn.Sequential`` whose parameter-owning children repeat a class (or whose only one is itself
   made of modules: a stage of one residual block): a stage of residual blocks, an encoder's layer
   list, VGG's conv stack. ``Conv2d + BatchNorm + ReLU`` in one ``Sequential`` is not one, nor is a
   ``Dropout + Linear`` classifier, so such a small unit stays whole.
2. Walking down from the model, a module is split into its children when it is a layer container,
   or when it has a layer container below it and is not itself one of the layers (a layer is only
   split again if it is a container, e.g. a stage inside a stage). Everything else that owns
   parameters is one unit. A model without any layer container gets its top-level children. Units
   are then put in forward order (below), so "before" and "earlier" in rules 3-5 mean in the
   forward pass.
3. A unit that is a lone normalization layer (BatchNorm, LayerNorm, RMSNorm, ... or a class whose
   name ends in ``Norm``/``Norm2d`` and that has no parameter-owning children, so that a
   ``PreNorm(dim, fn)`` wrapper around a whole layer stays a layer) joins the unit before it (the
   first one joins the next): a norm is not a layer of its own, it belongs to the layer whose
   output it normalizes. This is what makes a ResNet's ``conv1 + bn1`` one stem block and puts a
   final ``encoder.ln`` with the last encoder layer.
4. A parameter tied to an earlier unit (GPT-2's ``lm_head.weight`` is ``wte.weight``) belongs to the
   earlier unit, the one that uses it first; a unit left without parameters of its own disappears.
5. The last block, never frozen, is the *head*: the last block in forward order that the model's
   main output depends on, taken to be the first tensor its forward returns (a classifier's
   logits; ``logits`` of GoogLeNet's named tuple; ``"out"`` of a torchvision segmentation dict).
   Blocks after the head feed only other outputs (FCN's and DeepLabV3's ``aux_classifier`` runs
   after ``classifier``) and join it: never frozen, they always train, as without freezing. An
   auxiliary head that runs before the main one (GoogLeNet's ``aux1`` after ``inception4a``) stays
   a block where it runs: once it freezes, every block before it is frozen, so its loss could
   train nothing but itself; later in the list, or in the head, it would run before blocks listed
   in front of it and fail the Freezer's order check. When the main output depends on no block,
   the split is refused. ``split_blocks(model, head="fc")`` names the output layer and overrides
   this rule: the head is then the units inside that module and every unit after the first of them.

Forward order is the order in which a ``torch.fx`` symbolic trace of the model's forward, with every
unit an opaque leaf, first uses each unit (calls it or a module inside it, or reads its
parameters). The trace runs in training mode, the mode freezing acts in (GoogLeNet calls its aux
heads only in training); a unit it never reaches keeps its place after the unit registered before
it. When fx cannot trace the model (Hugging Face models), units stay in registration order, which is
forward order for every family above, and the last one is the head unless ``head=`` names it; the
Freezer checks the order at the first forward after a boundary change, and the tests check it on a
real forward.

Parameters owned directly by a parent of the blocks (ViT's ``class_token``, ``encoder.pos_embedding``)
belong to no unit; :func:`first_block_using` places each in the first block whose input depends on
it, read from the same kind of trace with every block as a leaf. Not a forward with hooks nor an
autograd-graph walk: both need an example input, which ``split_blocks(model)`` does not have (a ViT
checks its image size, a BERT takes token ids); fx needs none, works on the meta device, and follows
data flow rather than call order. Only the glue code between blocks is traced, so Python inside the
layers never matters; glue that branches on tensor values cannot be traced, and then a one-line
error asks to name the parameter in a block entry. The first user is the right block: in a later
block the parameter would get no gradient once its user is frozen (a frozen block runs under
``no_grad``, DDP then fails on a parameter that got no gradient); in an earlier one it would freeze
before the layer that reads it.
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from collections.abc import Iterable, Sequence

import torch.fx
from torch import nn

# What counts as a normalization layer (rule 3). Classes first; the name pattern catches norms that
# libraries define themselves (torchvision's LayerNorm2d subclasses nn.LayerNorm, but e.g. Hugging
# Face's LlamaRMSNorm and T5LayerNorm are plain nn.Modules), if they own their parameters directly.
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm*, SyncBatchNorm
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
)
NORM_CLASS_NAME = re.compile(r"Norm(\d+d)?$")
# Containers that hold a list of layers by construction (rule 1).
LAYER_LIST_TYPES: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict)
CONTAINER_TYPES: tuple[type[nn.Module], ...] = (nn.Sequential, *LAYER_LIST_TYPES)
GLOB_CHARS = frozenset("*?[")


class BlockError(ValueError):
    """A block specification that does not describe the model."""


def owns_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def is_layer_container(module: nn.Module) -> bool:
    """Rule 1: a list of layers (see the module docstring)."""
    kids = [c for c in module.children() if owns_params(c)]
    if not kids:
        return False
    if isinstance(module, LAYER_LIST_TYPES):
        return True
    if isinstance(module, nn.Sequential):
        if len(kids) == 1:  # a stage of one block (ResNet layer1 of [1, 1, 1, 1]), not a lone Linear
            return any(True for _ in kids[0].children())
        return max(Counter(type(c) for c in kids).values()) >= 2
    return False


def is_norm(module: nn.Module) -> bool:
    """Rule 3: a normalization layer. The class name counts only for a module owning its parameters
    directly: a ``PreNorm(dim, fn)`` wrapper holds a whole layer, a norm holds a weight and a bias."""
    if isinstance(module, NORM_TYPES):
        return True
    return bool(NORM_CLASS_NAME.search(type(module).__name__)) and not any(owns_params(c) for c in module.children())


def _qualify(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _has_layer_container_below(module: nn.Module) -> bool:
    return any(is_layer_container(m) for m in module.modules() if m is not module)


def _units(module: nn.Module, name: str, in_layer: bool) -> list[list[str]]:
    """Rule 2: the units under ``module`` (named ``name``); ``in_layer``: it is part of a layer."""
    if not owns_params(module):
        return []
    if is_layer_container(module):
        return _child_units(module, name, in_layer=True)
    if (not in_layer or isinstance(module, CONTAINER_TYPES)) and _has_layer_container_below(module):
        return _child_units(module, name, in_layer)
    return [[name]]


def _child_units(module: nn.Module, name: str, in_layer: bool) -> list[list[str]]:
    return [
        u for child_name, child in module.named_children() for u in _units(child, _qualify(name, child_name), in_layer)
    ]


def _join_norms(units: list[list[str]], modules: dict[str, nn.Module]) -> list[list[str]]:
    """Rule 3: a lone norm joins the unit before it; a leading one joins the unit after it."""
    out: list[list[str]] = []
    pending: list[str] = []  # leading norms waiting for a unit to join
    for unit in units:
        if len(unit) == 1 and is_norm(modules[unit[0]]) and len(units) > 1:
            if out:
                out[-1] = out[-1] + unit
            else:
                pending += unit
            continue
        out.append(pending + unit)
        pending = []
    return out if not pending else out + [pending]


def _drop_tied_only(units: list[list[str]], modules: dict[str, nn.Module]) -> list[list[str]]:
    """Rule 4: drop units whose every parameter is tied to an earlier unit."""
    seen: set[int] = set()
    out = []
    for unit in units:
        ids = {id(p) for name in unit for p in modules[name].parameters()}
        if ids - seen:
            out.append(unit)
        seen |= ids
    return out


def default_block_names(model: nn.Module, head: str | None = None) -> list[list[str]]:
    """The default split (rules 1-5 of the module docstring): module names, one list per block, in
    forward order, the last the head. ``head``: the module computing the output, when the trace
    cannot tell. Parameters owned directly by a parent are placed later, by ``split_blocks``."""
    modules = dict(model.named_modules())
    units = _child_units(model, "", in_layer=is_layer_container(model))
    try:
        graph: torch.fx.Graph | None = trace_glue(model, [n for u in units for n in u])
    except Exception:  # fx raises TraceError, TypeError, ValueError, ... from user code
        graph = None  # registration order, the last unit the head (unless named)
    if graph is not None:
        units = _in_forward_order(units, graph)
    blocks = _join_norms(_drop_tied_only(units, modules), modules)
    if not blocks:
        return blocks
    h = _head_index(model, blocks, graph, head)
    return blocks[:h] + [[n for block in blocks[h:] for n in block]]


def _owner(target: str, owner: dict[str, int]) -> int | None:
    """The index in ``owner`` of the module ``target`` (a module or parameter name) lies in."""
    name = target
    while name:
        if name in owner:
            return owner[name]
        name = name.rpartition(".")[0]
    return None


def _in_forward_order(units: list[list[str]], graph: torch.fx.Graph) -> list[list[str]]:
    """Units sorted by their first use in ``graph`` (a call of the unit or of a module inside it, or
    a read of its parameters); one the trace never reaches stays after the unit registered before it."""
    owner = {name: i for i, unit in enumerate(units) for name in unit}
    first: dict[int, int] = {}
    for position, node in enumerate(graph.nodes):
        if node.op in ("call_module", "get_attr"):
            i = _owner(node.target, owner)
            if i is not None:
                first.setdefault(i, position)
    keys, last = [], -1
    for i in range(len(units)):
        last = first.get(i, last)
        keys.append((last, i))
    return [units[i] for i in sorted(range(len(units)), key=keys.__getitem__)]


def _head_index(model: nn.Module, blocks: list[list[str]], graph: torch.fx.Graph | None, head: str | None) -> int:
    """Rule 5: the index of the head block (the blocks after it join it)."""
    model_name = type(model).__name__
    if head is not None:
        modules = dict(model.named_modules())
        if head == "" or head not in modules:
            top = ", ".join(n for n, _ in model.named_children())
            raise BlockError(f"split_blocks: head='{head}' names no module of the model; top-level modules: {top}")
        for i, block in enumerate(blocks):
            inside = any(n == head or n.startswith(head + ".") or head.startswith(n + ".") for n in block)
            if inside and owns_params(modules[head]):
                return i
        raise BlockError(
            f"split_blocks: head='{head}' owns no parameters of its own (parameter-free, or tied to an "
            "earlier block); name the module that computes the output"
        )
    if graph is None:
        return len(blocks) - 1
    output = next(n for n in graph.nodes if n.op == "output")
    returned: list[torch.fx.Node] = []
    torch.fx.node.map_arg(output.args[0], returned.append)
    owner = {name: i for i, block in enumerate(blocks) for name in block}
    feeding: set[int] = set()
    seen, frontier = set(returned[:1]), returned[:1]
    while frontier:
        node = frontier.pop()
        if node.op in ("call_module", "get_attr"):
            i = _owner(node.target, owner)
            if i is not None:
                feeding.add(i)
        for source in node.all_input_nodes:
            if source not in seen:
                seen.add(source)
                frontier.append(source)
    if not feeding:
        raise BlockError(
            f"split_blocks: the first tensor {model_name}.forward returns depends on no block, so its "
            "output layer is unknown; name it: split_blocks(model, head='fc')"
        )
    return max(feeding)


# ---------------------------------------------------------------------------------------- globs
def is_glob(name: str) -> bool:
    return any(c in GLOB_CHARS for c in name)


def glob_modules(model: nn.Module, pattern: str) -> list[str]:
    """Names of the parameter-owning modules matching ``pattern``, in ``model.named_modules()`` order
    (registration order: index order for ``ModuleList``/``Sequential``, so ``layer.10`` comes after
    ``layer.9``). A wildcard stays within one dotted component: ``encoder.layer.*`` matches
    ``encoder.layer.3`` but not ``encoder.layer.3.attention``."""
    parts = pattern.split(".")
    matches = [
        name
        for name, module in model.named_modules()
        if name
        and len(name.split(".")) == len(parts)
        and all(fnmatch.fnmatchcase(n, p) for n, p in zip(name.split("."), parts))
        and owns_params(module)
    ]
    if not matches:
        raise BlockError(f"split_blocks: pattern '{pattern}' matches no parameter-owning module")
    return matches


def expand_globs(model: nn.Module, names: Sequence[str | Sequence[str]]) -> list[list[str]]:
    """A glob given as a block expands to one block per match; inside a list entry, its matches
    join that entry's block."""
    spec: list[list[str]] = []
    for entry in names:
        if isinstance(entry, str):
            spec += [[m] for m in glob_modules(model, entry)] if is_glob(entry) else [[entry]]
        else:
            spec.append([m for n in entry for m in (glob_modules(model, n) if is_glob(n) else [n])])
    return spec


# ------------------------------------------------------------------ parameters owned by a parent
class _BlocksAsLeaves(torch.fx.Tracer):
    """Traces only the glue between blocks: every block module is an opaque call."""

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)


def trace_glue(model: nn.Module, leaves: Iterable[str]) -> torch.fx.Graph:
    """A ``torch.fx`` graph of ``model.forward`` with every module named in ``leaves`` an opaque
    call, traced in training mode (the mode freezing acts in: GoogLeNet runs its auxiliary heads only
    there). The modes are set and restored module by module, without calling ``train()``.

    Raises:
        whatever fx raises on code it cannot trace (TraceError, TypeError, ValueError, ...).
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        for m, _ in modes:
            m.training = True
        return _BlocksAsLeaves(set(leaves)).trace(model)
    finally:
        for m, mode in modes:
            m.training = mode


def first_block_using(
    model: nn.Module, block_modules: Sequence[Sequence[str]], param_names: Sequence[str]
) -> list[int]:
    """For each of ``param_names`` (parameters owned directly by a parent of the blocks), the index
    of the first block, in forward order, whose input depends on it; the last block (the head, never
    frozen) if it reaches the output through no block.

    Raises BlockError when the model cannot be traced with ``torch.fx`` (Python control flow on
    tensor values in the code between blocks) or does not use a parameter in its forward.
    """
    leaf_block = {name: i for i, names in enumerate(block_modules) for name in names}
    shown = ", ".join(param_names)
    try:
        graph = trace_glue(model, leaf_block)
    except Exception as e:  # fx raises TraceError, TypeError, AttributeError, ... from user code
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise BlockError(
            f"split_blocks: cannot tell which block uses {shown} (owned directly by a parent module): "
            f"torch.fx could not trace {type(model).__name__}.forward ({reason}); "
            f"name each in a block entry, e.g. names=[['embed', '{param_names[0]}'], ...]"
        ) from None
    position = {node: i for i, node in enumerate(graph.nodes)}
    placed = []
    for pname in param_names:
        frontier = [n for n in graph.nodes if n.op == "get_attr" and n.target == pname]
        if not frontier:
            raise BlockError(
                f"split_blocks: parameter '{pname}' is owned by a parent module and not used in "
                f"{type(model).__name__}.forward; name it in a block entry"
            )
        first, seen = None, set(frontier)
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if user in seen:
                    continue
                seen.add(user)
                if user.op == "call_module" and user.target in leaf_block:
                    # Nothing downstream of a block call runs before it: stop here.
                    if first is None or position[user] < position[first]:
                        first = user
                else:
                    frontier.append(user)
        placed.append(leaf_block[first.target] if first is not None else len(block_modules) - 1)
    return placed
