"""Where the frozen prefix ends, found by running the model: capture a block's input, serve it back.

The activation cache stores, per sample key, one tensor that the model's own forward computes with
blocks ``0 .. c-1`` frozen (the CUT ``c``): the input of block ``c``'s first module (an ENTRY cut:
the glue before block ``c`` is skipped too, e.g. a ResNet's pooling), or else the output of block
``c-1``'s last module (an EXIT cut: the glue runs live, e.g. a ViT adding its class token and
position embedding, parameters of the trainable block after the cut). Serving runs the model's own
forward again, its glue code, masks and control flow live, with one change: the modules of blocks
``0 .. c-1`` do not compute; they return zeros of their recorded output shapes, and the stored rows
enter at the cut. Nothing is traced, so whatever forward the Freezer can drive can be served (a
Hugging Face model, dict inputs), and nothing the forward decides is fixed at one moment (layer
drop, flags and ``self.training`` in the glue run as they would without the cache).

A cut is served only after the model has shown on a probe batch that serving it is exact:

1. the cut's tensor is one batched tensor (an entry module's first argument; alone, or beside
   non-tensors, in an exit module's output);
2. it is deterministic (two captures under different random states are bitwise equal) and per
   sample (a sample's row does not depend on the rest of its batch: no batch statistics);
3. serving it reproduces the model: the forward with stubs and stored rows returns bitwise what the
   full forward returns, from the same random state - and, for an entry cut, also after every
   parameter that a block at or after the cut owns outside its modules has changed (it must not be
   in the stored rows). This catches an earlier prefix value used after the cut (a skip
   connection, a DenseNet concatenation), a prefix module called again later (weight sharing), and
   glue that branches on the values the stubs replace.

Frozen blocks run as the Freezer runs them: every module in eval (``frozen_mode="eval"``, the
default: dropout off, as AutoFreeze and PipeTransformer run their frozen layers) or only their norm
layers with running statistics (``"train"``). Every probe restores the model's buffers and modes and
the random state it found, so probing changes nothing a run computes.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from freeze.blocks import Block, held_in_eval
from freeze.names import FROZEN_MODES


class CacheError(ValueError):
    """The activation cache cannot do what was asked; the message is one line."""


class _Reached(BaseException):
    """Raised by the capture hook to stop a forward at the cut (a BaseException, so that a model's
    own ``except Exception`` cannot swallow it)."""

    def __init__(self, value: Any):
        super().__init__()
        self.value = value


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple or list, else ``model(inputs)``:
    the convention by which a CacheSource's inputs are the model's arguments."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def batch_size(inputs: Any) -> int | None:
    """The leading size of the first tensor in ``inputs`` (None: no tensor)."""
    for leaf in pytree.tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return None


def to_device(inputs: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)


def outputs_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of two forward outputs of any structure."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


@dataclass(frozen=True)
class _Zeros:
    """What a stubbed module returns at batch size B: its recorded output with every tensor zero
    (or, for the cut's module, with the stored rows in place of its one batched tensor). A dimension
    that grew from the probe at batch 2 to the one at batch 3 is a batch dimension (B*heads
    included): its size at B follows the same line."""

    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]  # (size at 2, size at 3 per dim, dtype, device) for tensors; the value otherwise
    # The zeros of each batch size, allocated once: what a stub returns only feeds stubs and glue
    # whose values the cut replaces (the probe's served-equals-full check shows it), so glue that
    # writes into it in place changes nothing served, and a step need not allocate and clear them.
    _made: dict[int, list[torch.Tensor]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def record(cls, at2: Any, at3: Any) -> _Zeros | None:
        l2, s2 = pytree.tree_flatten(at2)
        l3, s3 = pytree.tree_flatten(at3)
        if s2 != s3:
            return None
        leaves = []
        for x, y in zip(l2, l3):
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == y.dim():
                leaves.append(("tensor", tuple(x.shape), tuple(y.shape), x.dtype, x.device))
            else:
                leaves.append(("value", x))
        return cls(s2, tuple(leaves))

    @property
    def batched(self) -> list[int]:
        """Positions of the leaves that are tensors with a batch dimension."""
        return [i for i, leaf in enumerate(self.leaves) if leaf[0] == "tensor" and leaf[1] != leaf[2]]

    def __call__(self, batch: int, rows: torch.Tensor | None = None) -> Any:
        if batch not in self._made:
            if len(self._made) >= 4:  # a few batch sizes (the last, uneven one) at a time
                self._made.clear()
            self._made[batch] = [self._zeros(leaf, batch) if leaf[0] == "tensor" else None for leaf in self.leaves]
        out = []
        for i, (leaf, zeros) in enumerate(zip(self.leaves, self._made[batch])):
            if leaf[0] == "value":
                out.append(leaf[1])
            elif rows is not None and i == self.batched[0]:
                out.append(rows)
            else:
                out.append(zeros)
        return pytree.tree_unflatten(out, self.spec)

    @staticmethod
    def _zeros(leaf: tuple, batch: int) -> torch.Tensor:
        _, at2, at3, dtype, device = leaf
        return torch.zeros([a + (batch - 2) * (b - a) for a, b in zip(at2, at3)], dtype=dtype, device=device)

    def rows_of(self, output: Any) -> torch.Tensor:
        """The batched tensor of one output of the module."""
        return pytree.tree_leaves(output)[self.batched[0]]


@contextlib.contextmanager
def probing(model: nn.Module) -> Iterator[None]:
    """Training mode, no autograd, and afterwards every buffer, module mode and random state as it
    was: a probe forward leaves no trace in the run."""
    modes = {m: m.training for m in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    py_state = random.getstate()
    devices = sorted({b.device.index for b in model.parameters() if b.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model.train()
        try:
            yield
        finally:
            random.setstate(py_state)
            for m, training in modes.items():
                m.training = training
            for b, saved in buffers:
                b.copy_(saved)


@contextlib.contextmanager
def frozen_semantics(blocks: Sequence[Block], frozen_mode: str) -> Iterator[None]:
    """Blocks ``blocks`` behave as frozen blocks do: in eval (or only their running-stat norms)."""
    saved = [(m, m.training) for m in held_in_eval(blocks, frozen_mode)]
    for m, _ in saved:
        m.training = False
    try:
        yield
    finally:
        for m, training in saved:
            m.training = training


def _not_run(batch: int) -> Any:
    raise CacheError("cache: a frozen block module that did not run in the probe forward ran while serving")


_NOT_RUN = _not_run


def _reseed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


@dataclass(frozen=True)
class Cut:
    """Where the stored tensor is taken: ``kind`` "entry" (the first argument of ``module``'s first
    call) or "exit" (what ``module`` returns at its ``nth`` call)."""

    kind: str
    module: nn.Module
    nth: int


class Cuts:
    """The model's blocks as its forward runs them, the cuts that can be served exactly, and the two
    operations on a cut: capture its tensor, serve stored rows in its place.

    Args:
        model: the bare model.
        blocks: its blocks, in forward order.
        probe_inputs: ``keys -> inputs`` on the model's device (the cache source's).
        num_keys: keys are 0..num_keys-1; the probe uses keys 0, 1, 2 (modulo num_keys).
        frozen_mode: "eval" or "train", how frozen blocks run (see the module docstring).
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[Block],
        probe_inputs: Callable[[torch.Tensor], Any],
        num_keys: int,
        frozen_mode: str = "eval",
    ):
        if frozen_mode not in FROZEN_MODES:
            raise CacheError(f"cache: frozen_mode '{frozen_mode}' is not accepted; accepted: {', '.join(FROZEN_MODES)}")
        self.model, self.blocks, self.frozen_mode = model, list(blocks), frozen_mode
        self._inputs = probe_inputs
        # keys (0, 1), (0, 1, 2) and (0, 2): two batch sizes, and sample 0 beside two others
        self._probe_keys = [torch.tensor(k) % num_keys for k in ((0, 1), (0, 1, 2), (0, 2))]
        self.entry: list[nn.Module | None] = [None] * len(self.blocks)  # each block's first module to run
        self.exit: list[tuple[nn.Module, int] | None] = [None] * len(self.blocks)  # last to return, nth call
        self._zeros: dict[nn.Module, Callable[..., Any] | None] = {}  # None: batch-dependent structure
        self._verdicts: dict[int, str] = {}  # cut -> "" (exact) or why not
        self.cut: dict[int, Cut] = {}  # the exact cuts found so far
        self.sample_meta: dict[int, tuple[torch.Size, torch.dtype, torch.memory_format]] = {}
        self._record()

    # ------------------------------------------------------------------ recording
    def _record(self) -> None:
        """One probe forward at batch 2 and one at batch 3: which module of each block runs first
        and which returns last, and what every block module returns (the stubs' zeros)."""
        owner = {m: i for i, b in enumerate(self.blocks) for m in b.modules}
        outputs: dict[nn.Module, list[Any]] = {m: [] for m in owner}
        calls: dict[nn.Module, int] = {}
        run = {"n": 0}

        def first_call(module, args):
            if self.entry[owner[module]] is None:
                self.entry[owner[module]] = module

        def record(module, args, output):
            calls[module] = calls.get(module, 0) + 1
            if run["n"] == 2:  # the batch-3 forward
                self.exit[owner[module]] = (module, calls[module])
            if len(outputs[module]) < run["n"]:  # the first call of each forward
                outputs[module].append(output)

        handles = [m.register_forward_pre_hook(first_call) for m in owner]
        handles += [m.register_forward_hook(record) for m in owner]
        try:
            with probing(self.model):
                for keys in self._probe_keys[:2]:
                    run["n"] += 1
                    calls.clear()
                    inputs = self._inputs(keys)
                    if batch_size(inputs) != keys.numel():
                        raise CacheError(
                            f"cache: cache_source.inputs({keys.numel()} keys) returned no batch of "
                            f"{keys.numel()} (a tensor, or a dict/tuple of tensors, with the batch first)"
                        )
                    call_model(self.model, inputs)
        except CacheError:
            raise
        except Exception as exc:  # the model's own error, at construction rather than at the first freeze
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CacheError(
                f"cache: the model's forward failed on cache_source.inputs(keys) ({type(exc).__name__}: {reason}); "
                "inputs(keys) must return the model's arguments: a tensor, a tuple (model(*inputs)) or a dict "
                "(model(**inputs))"
            ) from None
        finally:
            for h in handles:
                h.remove()
        for m, outs in outputs.items():
            if len(outs) == 2:
                self._zeros[m] = _Zeros.record(outs[0], outs[1])
            elif not outs:
                self._zeros[m] = _NOT_RUN

    # ------------------------------------------------------------------ which cuts are exact
    def why_not(self, cut: int) -> str:
        """ "" when serving the prefix before block ``cut`` is exact, else the reason (checked once)."""
        if cut not in self._verdicts:
            self._verdicts[cut] = self._check(cut)
        return self._verdicts[cut]

    def best(self, boundary: int) -> tuple[int | None, str]:
        """(the exact cut closest below or at ``boundary``, k >= 1, or None; why ``boundary`` itself is not)."""
        reason = ""
        for k in range(min(boundary, len(self.blocks) - 1), 0, -1):
            why = self.why_not(k)
            if not why:
                return k, reason
            reason = reason or why
        return None, reason or "no frozen prefix"

    def _check(self, cut: int) -> str:
        """Try the entry cut, then the exit cut; keep the first that is exact."""
        name = self.blocks[cut - 1].name
        stubs = [m for b in self.blocks[:cut] for m in b.modules]
        if any(self._zeros.get(m) is None for m in stubs):
            return f"a block up to '{name}' returns outputs whose structure depends on the batch"
        candidates = []
        if self.entry[cut] is not None:
            candidates.append(Cut("entry", self.entry[cut], 1))
        if self.exit[cut - 1] is not None and len(self._zeros[self.exit[cut - 1][0]].batched) == 1:
            candidates.append(Cut("exit", *self.exit[cut - 1]))
        if not candidates:
            return f"neither block '{name}' nor block '{self.blocks[cut].name}' passes one batched tensor on"
        why = ""
        for candidate in candidates:
            why = self._exact(cut, candidate)
            if not why:
                self.cut[cut] = candidate
                return ""
        return why

    def _exact(self, cut: int, where: Cut) -> str:
        try:
            return self._exact_or_raise(cut, where)
        except CacheError:  # the probe's forward did not reach the cut
            return f"the forward does not always reach the cut before block '{self.blocks[cut].name}' (skipped?)"

    def _exact_or_raise(self, cut: int, where: Cut) -> str:
        name = self.blocks[cut - 1].name
        two, three, other = (self._inputs(k) for k in self._probe_keys)
        with probing(self.model), frozen_semantics(self.blocks[:cut], self.frozen_mode):
            _reseed(1)
            first = self._capture(three, where)
            if not (isinstance(first, torch.Tensor) and first.dim() > 0 and first.shape[0] == 3):
                return f"no single batched tensor passes from block '{name}' to block '{self.blocks[cut].name}'"
            _reseed(2)
            if not torch.equal(first, self._capture(three, where)):
                return f"the prefix up to block '{name}' is random in training (dropout, random ops or branches)"
            if not torch.equal(self._capture(two, where)[:1], self._capture(other, where)[:1]):
                return f"the prefix up to block '{name}' mixes the samples of a batch (batch statistics)"
            with _changed(self._loose_params(cut) if where.kind == "entry" else []):
                _reseed(3)
                full = call_model(self.model, three)
                _reseed(3)
                with self._serving(cut, where, first):
                    served = call_model(self.model, three)
            if not outputs_equal(full, served):
                return (
                    f"the forward reads more of the prefix than the output of block '{name}' "
                    "(a skip connection, a shared module, or glue that branches on the prefix's values)"
                )
        self.sample_meta[cut] = (first.shape[1:], first.dtype, _memory_format(first))
        return ""

    def _loose_params(self, cut: int) -> list[nn.Parameter]:
        """Parameters of blocks ``cut ..`` that no module of their block owns (a ViT's class token):
        the glue reads them, so an entry cut must not hold them."""
        out = []
        for block in self.blocks[cut:]:
            owned = {id(p) for m in block.modules for p in m.parameters()}
            out += [p for p in block.params if id(p) not in owned]
        return out

    # ------------------------------------------------------------------ the two operations
    def capture(self, inputs: Any, cut: int, served: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
        """The tensor at ``cut`` for ``inputs``: the model runs up to it and no further, blocks before
        it frozen; ``served=(level, rows)`` serves ``rows`` at ``level`` on the way (an advance).
        Call under :func:`probing` or ``torch.no_grad()``, after :meth:`why_not` found ``cut`` exact."""
        with frozen_semantics(self.blocks[:cut], self.frozen_mode):
            return self._capture(inputs, self.cut[cut], served)

    def _capture(self, inputs: Any, where: Cut, served: tuple[int, torch.Tensor] | None = None) -> Any:
        seen = {"calls": 0}

        def reached_entry(mod, args, kwargs):
            raise _Reached(args[0] if args else None)

        def reached_exit(mod, args, output):
            seen["calls"] += 1
            if seen["calls"] == where.nth:
                raise _Reached(self._zeros[mod].rows_of(output))

        if where.kind == "entry":
            handle = where.module.register_forward_pre_hook(reached_entry, with_kwargs=True, prepend=True)
        else:
            handle = where.module.register_forward_hook(reached_exit)
        try:
            with self.serving(*served) if served is not None else contextlib.nullcontext():
                call_model(self.model, inputs)
        except _Reached as stop:
            return stop.value
        finally:
            handle.remove()
        raise CacheError("cache: the forward did not reach the cut")

    def serving(self, cut: int, rows: torch.Tensor) -> contextlib.AbstractContextManager:
        """Within it, a forward of the model computes nothing in blocks ``0 .. cut-1`` (their modules
        return zeros) and the stored ``rows`` enter at the cut."""
        return self._serving(cut, self.cut[cut], rows)

    @contextlib.contextmanager
    def _serving(self, cut: int, where: Cut, rows: torch.Tensor) -> Iterator[None]:
        batch = rows.shape[0]
        stubbed = [m for b in self.blocks[:cut] for m in b.modules]
        saved = [(m, m.__dict__.get("forward")) for m in stubbed]
        calls = {"n": 0}

        def exit_forward(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            zeros = self._zeros[where.module]
            return zeros(batch, rows) if calls["n"] == where.nth else zeros(batch)

        def inject(module, args, kwargs):
            calls["n"] += 1
            return ((rows, *args[1:]), kwargs) if calls["n"] == 1 else None

        for m in stubbed:
            zeros = self._zeros[m]
            exits_here = where.kind == "exit" and m is where.module
            m.__dict__["forward"] = exit_forward if exits_here else (lambda *a, _z=zeros, **k: _z(batch))
        handle = None
        if where.kind == "entry":
            handle = where.module.register_forward_pre_hook(inject, with_kwargs=True, prepend=True)
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()
            for m, forward in saved:
                if forward is None:
                    m.__dict__.pop("forward", None)
                else:
                    m.__dict__["forward"] = forward


@contextlib.contextmanager
def _changed(params: list[nn.Parameter]) -> Iterator[None]:
    """``params`` hold other values inside, their own values again after."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.mul_(-1.5).add_(0.25)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format
