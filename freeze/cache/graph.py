"""Cut a model's forward graph at a freeze boundary: prefix (blocks < k), tail (blocks >= k).

The model is traced once with ``torch.fx``. Block modules are LEAVES of the trace (as torchvision's
feature-extraction tracer does with its leaf modules): their own hooks run (the Freezer's no_grad
hooks, activation checkpointing), their train/eval behaviour is read at run time rather than baked
into the graph, and every node belongs to at most one block by its qualified name. Parameter-free
code between blocks (a ResNet's relu, max-pool, flatten) belongs to no block.

The cut at boundary k sits before the first node of any block >= k. It is valid only if exactly ONE
tensor value crosses it (a ResNet block boundary; not a point inside a DenseNet dense block, where
every earlier feature map is still needed) and no block < k is used after it (weight sharing).
The graph is traced in training mode, the mode in which the tail runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from freeze.blocks import Block


class CacheError(ValueError):
    """The activation cache cannot do what was asked; the message is one line."""


class _BlockLeafTracer(fx.Tracer):
    """Block modules are leaves; so are torch.nn modules that contain no block; everything else
    (including containers of blocks) is traced through."""

    def __init__(self, block_modules: set[str], block_ancestors: set[str]):
        super().__init__()
        self.block_modules = block_modules
        self.block_ancestors = block_ancestors

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.block_modules:
            return True
        if module_qualified_name in self.block_ancestors:
            return False
        return super().is_leaf_module(m, module_qualified_name)


@dataclass(frozen=True)
class Cut:
    """The cut before block ``k``: ``position`` indexes the graph's node list; ``value`` is the one
    node that crosses it (None with ``reason`` when the cut is not valid)."""

    k: int
    position: int
    value: fx.Node | None
    reason: str = ""

    @property
    def valid(self) -> bool:
        return self.value is not None


def _owner(name: str, prefixes: list[tuple[str, int]]) -> int | None:
    for prefix, index in prefixes:
        if name == prefix or name.startswith(prefix + "."):
            return index
    return None


class SplitGraph:
    """The traced model, which block each node belongs to, and the cut at every boundary."""

    def __init__(self, model: nn.Module, blocks: list[Block]):
        self.model = model
        self.num_blocks = len(blocks)
        names = {n: i for i, b in enumerate(blocks) for n in b.module_names}
        ancestors = {".".join(n.split(".")[:d]) for n in names for d in range(1, n.count(".") + 1)}
        # Longest names first: "layer1.0" must win over a block named "layer1" if both existed.
        prefixes = sorted(names.items(), key=lambda kv: -len(kv[0]))
        modes = {m: m.training for m in model.modules()}
        model.train()  # the tail runs in training mode; trace the code paths it will take
        try:
            graph = _BlockLeafTracer(set(names), ancestors).trace(model)
        except Exception as exc:  # fx raises many types (TraceError, TypeError, NotImplementedError...)
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CacheError(
                f"cache: caching needs an fx-traceable model; torch.fx could not trace {type(model).__name__} ({reason})"
            ) from None
        finally:
            for m, training in modes.items():
                m.training = training
        self.graph = graph
        self.nodes: list[fx.Node] = list(graph.nodes)
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            raise CacheError(
                f"cache: the model's forward takes {len(placeholders)} inputs; caching needs exactly one input tensor"
            )
        self.input = placeholders[0]
        self.output = next(n for n in self.nodes if n.op == "output")
        self.index = {n: i for i, n in enumerate(self.nodes)}
        # A parameter a block owns directly (ViT's class_token) is read by a get_attr node.
        loose = {name: i for i, b in enumerate(blocks) for name in b.param_names}
        self.member: dict[fx.Node, int | None] = {n: self._member(n, prefixes, loose) for n in self.nodes}
        self.cuts = [self._cut(k) for k in range(self.num_blocks)]
        self.full = fx.GraphModule(model, graph)
        self._shapes: dict[fx.Node, tuple[torch.Size, torch.dtype, torch.memory_format]] | None = None

    @staticmethod
    def _member(node: fx.Node, prefixes: list[tuple[str, int]], loose: dict[str, int]) -> int | None:
        if node.op == "get_attr" and str(node.target) in loose:
            return loose[str(node.target)]
        if node.op in ("call_module", "get_attr"):
            return _owner(str(node.target), prefixes)
        return None

    def _cut(self, k: int) -> Cut:
        if k == 0:
            return Cut(0, 0, self.input)
        position = min(
            (i for i, n in enumerate(self.nodes) if self.member[n] is not None and self.member[n] >= k),
            default=len(self.nodes),
        )
        after = self.nodes[position:]
        reused = sorted({self.member[n] for n in after if self.member[n] is not None and self.member[n] < k})
        if reused:
            return Cut(k, position, None, f"block(s) {reused} are used again after block {k} starts")
        crossing = [n for n in self.nodes[:position] if any(self.index[u] >= position for u in n.users)]
        if len(crossing) != 1:
            shown = ", ".join(n.name for n in crossing[:4]) + (" ..." if len(crossing) > 4 else "")
            return Cut(
                k,
                position,
                None,
                f"{len(crossing)} values cross the cut before block {k} ({shown}); caching needs exactly one",
            )
        return Cut(k, position, crossing[0])

    # ------------------------------------------------------------------ segments
    def segment(self, start: int, end: int | None) -> fx.GraphModule:
        """The graph from the cut before block ``start`` (0: the model's input) to the cut before
        block ``end`` (None: the model's output), sharing the model's modules and parameters."""
        a = self.cuts[start]
        if not a.valid or (end is not None and not self.cuts[end].valid):
            raise CacheError(f"cache: no valid cut at boundary {start if not a.valid else end}")
        stop = len(self.nodes) - 1 if end is None else self.cuts[end].position  # the output node is last
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {a.value: g.placeholder("x")}
        for n in self.nodes[a.position : stop]:
            if n.op == "placeholder" or n in env:
                continue
            env[n] = g.node_copy(n, lambda m: env[m])
        out = self.output.args[0] if end is None else self.cuts[end].value
        g.output(fx.node.map_arg(out, lambda m: env[m]))
        # GraphModule copies each referenced submodule BY REFERENCE from the root: no parameter copies.
        return fx.GraphModule(self.model, g, class_name=f"Segment_{start}_{'end' if end is None else end}")

    # ------------------------------------------------------------------ sizes
    @torch.no_grad()
    def probe(self, sample: torch.Tensor) -> None:
        """Record the shape of every cut's value from one forward of ``sample`` (two samples or more:
        the batch dimension is checked), in eval mode so that no running statistic moves."""
        modes = {m: m.training for m in self.model.modules()}
        self.model.eval()
        try:
            ShapeProp(self.full).propagate(sample)
        finally:
            for m, training in modes.items():
                m.training = training
        shapes = {}
        for cut in self.cuts:
            meta = cut.value.meta.get("tensor_meta") if cut.valid else None
            if cut.valid and (
                meta is None or not isinstance(meta.shape, torch.Size) or meta.shape[:1] != sample.shape[:1]
            ):
                self.cuts[cut.k] = Cut(
                    cut.k,
                    cut.position,
                    None,
                    f"the value crossing the cut before block {cut.k} is not one batched tensor",
                )
                continue
            if cut.valid:
                shapes[cut.value] = (meta.shape[1:], meta.dtype, meta.memory_format or torch.contiguous_format)
        self._shapes = shapes

    @property
    def probed(self) -> bool:
        return self._shapes is not None

    def sample_shape(self, k: int) -> tuple[torch.Size, torch.dtype, torch.memory_format]:
        """(shape without the batch dimension, dtype, memory format) of the value at cut k."""
        if self._shapes is None:
            raise RuntimeError("SplitGraph.sample_shape: call probe() first")
        return self._shapes[self.cuts[k].value]

    def best_cut(self, boundary: int) -> Cut | None:
        """The valid cut closest below or at ``boundary`` (k >= 1), or None."""
        for k in range(min(boundary, self.num_blocks - 1), 0, -1):
            if self.cuts[k].valid:
                return self.cuts[k]
        return None
