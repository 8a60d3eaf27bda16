"""PowerSGD gradient compression (Vogels et al., NeurIPS 2019) whose state survives the Freezer's re-wraps.

torch's ``powerSGD_hook`` keys its error feedback and warm-start memories by DDP bucket index. The
Freezer builds a new DDP wrapper whenever the boundary moves, and every wrapper rebuilds its buckets
after its first iteration, so bucket ``i`` of the new wrapper holds other parameters than bucket
``i`` of the old one: torch's state would be added to the wrong gradients, or fail on a length
mismatch. Here the same algorithm keeps its state per parameter name instead: the error of a
parameter that stays trainable carries over a re-wrap, the state of one that froze is dropped, and
the iteration count (the vanilla warm-up) is the run's, not the wrapper's.

The arithmetic follows torch's hook step for step (its helpers ``_should_compress`` and
``_orthogonalize``, its order of the low-rank factors, its seeding of a fresh Q), so with stable
buckets and every matrix compressed it gives torch's gradients bit for bit
(tests/test_powersgd_ddp.py). One difference: torch also keeps an "error" for the tensors it sends
uncompressed (the local gradient minus the mean, which sums to zero over the ranks); here only
compressed matrices have error feedback.

The bytes counted are those of the three tensors each bucket hands to ``all_reduce``: the
uncompressed tensors, the P factors and the Q factors (during the warm-up: the whole bucket).
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations at runtime.

from collections import defaultdict
from collections.abc import Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize, _should_compress

# Iterations of plain all-reduce before compression starts. torch's default is 1000 and its advice
# is about 10 % of the run; the study's runs have 170-680 steps, so 17 (10 % of the shortest).
# torch requires >= 2 because its bucket-keyed memories go stale when DDP rebuilds its buckets after
# iteration 1; the per-parameter memories here do not, so any value >= 0 is correct.
WARMUP_ITERATIONS = 17
# torch's default: compress a matrix only when its factors are under half its size.
MIN_COMPRESSION_RATE = 2.0
# Added to each column norm when orthogonalizing: an all-zero gradient column (a dead unit) would
# otherwise divide by zero and put NaN into every later step's error feedback.
ORTHOGONALIZATION_EPSILON = 1e-8


class PowerSGDState:
    """Hyperparameters and per-parameter state of PowerSGD, kept across DDP wrappers.

    Args:
        matrix_rank: the rank of the low-rank approximation (1 or 4 in the accepted hooks).
        warmup_iterations: iterations of plain all-reduce first.
        seed: seeds the random initial Q factors (the same on every rank: they must agree).
    """

    def __init__(self, matrix_rank: int, warmup_iterations: int = WARMUP_ITERATIONS, seed: int = 0):
        self.matrix_rank, self.warmup_iterations, self.seed = int(matrix_rank), int(warmup_iterations), int(seed)
        self.iteration = 0  # backward passes all-reduced so far (the last bucket of each counts it)
        self.error: dict[str, torch.Tensor] = {}  # name -> what compression left out of (local grad + error)
        self.q_memory: dict[str, torch.Tensor] = {}  # name -> last averaged Q (warm start)
        self.rng = np.random.RandomState(self.seed)  # as torch's hook: one draw seeds each batch of fresh Qs
        self._names: dict[int, str] = {}  # id(parameter) -> qualified name, for the current wrapper

    @property
    def compressing(self) -> bool:
        return self.iteration >= self.warmup_iterations

    def attach(self, named_trainable: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """A new DDP wrapper over these parameters: drop the state of parameters no longer trained
        (their error would never be applied, and one unfrozen later starts afresh), keep the rest."""
        named = list(named_trainable)
        self._names = {id(p): name for name, p in named}
        kept = {name for name, _ in named}
        self.error = {n: t for n, t in self.error.items() if n in kept}
        self.q_memory = {n: t for n, t in self.q_memory.items() if n in kept}

    def names_of(self, bucket: dist.GradBucket) -> list[str]:
        return [self._names[id(p)] for p in bucket.parameters()]

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Plain containers and tensors (``torch.load(..., weights_only=True)`` reads them)."""
        _, keys, pos, has_gauss, cached_gaussian = self.rng.get_state()
        return {
            "matrix_rank": self.matrix_rank,
            "warmup_iterations": self.warmup_iterations,
            "seed": self.seed,
            "iteration": self.iteration,
            "error": {n: t.detach().clone() for n, t in self.error.items()},
            "q_memory": {n: t.detach().clone() for n, t in self.q_memory.items()},
            "rng": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            },
        }

    def check_saved(self, state: dict) -> None:
        """Refuse a :meth:`state_dict` saved with another rank or warm-up."""
        saved = (state["matrix_rank"], state["warmup_iterations"])
        if saved != (self.matrix_rank, self.warmup_iterations):
            raise ValueError(
                f"Freezer.load_state_dict: the checkpoint's PowerSGD has rank {saved[0]} and warm-up {saved[1]}, "
                f"this Freezer's rank {self.matrix_rank} and warm-up {self.warmup_iterations}; resume with the "
                "saving run's comm_hook"
            )

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` saved with the same rank and warm-up."""
        self.check_saved(state)
        self.seed, self.iteration = int(state["seed"]), int(state["iteration"])
        self.error = {n: t.clone() for n, t in state["error"].items()}
        self.q_memory = {n: t.clone() for n, t in state["q_memory"].items()}
        rng = state["rng"]
        keys = rng["keys"].numpy().astype(np.uint32)
        self.rng.set_state(("MT19937", keys, rng["pos"], rng["has_gauss"], rng["cached_gaussian"]))


def compress_and_allreduce(
    state: PowerSGDState, bucket: dist.GradBucket, group
) -> tuple[torch.futures.Future[torch.Tensor], int]:
    """One bucket through PowerSGD (past the warm-up): returns the future of the averaged bucket and
    the bytes handed to ``all_reduce`` (uncompressed tensors, P factors, Q factors)."""
    world = group.size()
    buffer = bucket.buffer()
    matrices, names, uncompressed = _split(state, bucket)
    for name, m in zip(names, matrices):
        if name in state.error:
            m.add_(state.error[name])
    local = [m.clone() for m in matrices]  # local gradient + error, before compression
    ranks = [min(*m.shape[1:], state.matrix_rank) for m in matrices]
    # All P factors of the bucket in one tensor, all Q factors in another: one all-reduce each.
    p_all, ps = _factors(buffer, [(m.shape[1], r) for m, r in zip(matrices, ranks)])
    q_all, qs = _factors(buffer, [(m.shape[2], r) for m, r in zip(matrices, ranks)])
    _start_qs(state, names, qs)
    for m, p, q in zip(matrices, ps, qs):
        torch.bmm(m, q, out=p)
    plain = torch.cat([t.view(-1) for t in uncompressed]) if uncompressed else buffer.new_empty(0)
    sent_bytes = (plain.numel() + p_all.numel() + q_all.numel()) * buffer.element_size()

    # The three all-reduces run here, one after the other, not chained with Future.then: DDP hands
    # its buckets over in the same order on every rank, but a callback runs when its rank's previous
    # all-reduce ends, so with several buckets in flight one rank could issue bucket 1's P before
    # bucket 0's Q while another did the reverse: a collective mismatch gloo aborts on (resnet18 on 2
    # local ranks, whose gradients fill several buckets). The cost: no overlap of this bucket's
    # compression with the rest of the backward pass.
    dist.all_reduce(plain, group=group)
    plain.div_(world)
    offset = 0
    for t in uncompressed:
        t.copy_(plain[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    dist.all_reduce(p_all, group=group)
    for p in ps:
        _orthogonalize(p, ORTHOGONALIZATION_EPSILON)
    for m, p, q in zip(matrices, ps, qs):
        torch.bmm(m.transpose(1, 2), p, out=q)
    dist.all_reduce(q_all, group=group)
    q_all.div_(world)
    for m, p, q in zip(matrices, ps, qs):
        torch.bmm(p, q.transpose(1, 2), out=m)  # m is a view of the bucket: the averaged gradient
    if buffer.is_cuda:
        torch.cuda.synchronize(buffer.device)  # as torch's hook: failures without it (pytorch#54838)
    if bool(torch.isfinite(q_all).all()):
        for name, m, q, before in zip(names, matrices, qs, local):
            state.error[name] = (before - m)[0]
            state.q_memory[name] = q[0].clone()
    else:
        # Some rank's gradient overflowed (fp16: GradScaler skips this step, seeing the NaN left in
        # the bucket). Kept, its error and Q would put NaN into every later step; every rank holds
        # the same averaged Q, so every rank forgets this bucket's state alike.
        for name in names:
            state.error.pop(name, None)
            state.q_memory.pop(name, None)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future, sent_bytes


def _split(state: PowerSGDState, bucket: dist.GradBucket) -> tuple[list[torch.Tensor], list[str], list[torch.Tensor]]:
    """The bucket's gradients that compression pays for, as (1, n, m) views in torch's order (grouped
    by shape, in order of first appearance), their names, and the rest (vectors, small matrices)."""
    by_shape: dict[torch.Size, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    uncompressed = []
    for name, grad in zip(state.names_of(bucket), bucket.gradients()):
        if grad.dim() >= 2:
            matrix = grad.view(grad.shape[0], -1)
            n, m = matrix.shape
            if _should_compress(n, m, min(n, m, state.matrix_rank), MIN_COMPRESSION_RATE)[0]:
                by_shape[matrix.shape].append((name, matrix.unsqueeze(0)))
                continue
        uncompressed.append(grad)
    ordered = [item for group in by_shape.values() for item in group]
    return [m for _, m in ordered], [n for n, _ in ordered], uncompressed


def _factors(like: torch.Tensor, shapes: list[tuple[int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat tensor (device and dtype of ``like``) and its (1, rows, cols) views, in order."""
    flat = like.new_empty(sum(rows * cols for rows, cols in shapes))
    views, offset = [], 0
    for rows, cols in shapes:
        views.append(flat[offset : offset + rows * cols].view(1, rows, cols))
        offset += rows * cols
    return flat, views


def _start_qs(state: PowerSGDState, names: list[str], qs: list[torch.Tensor]) -> None:
    """Each Q from its warm-start memory, or, where none exists, random (drawn as torch's hook
    does: one seed per bucket from the state's generator, so every rank draws the same); then
    orthogonalized."""
    fresh = [q for name, q in zip(names, qs) if name not in state.q_memory]
    if fresh:
        generator = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
        for q in fresh:
            q.copy_(torch.randn(*q.shape, generator=generator, dtype=q.dtype))
    for name, q in zip(names, qs):
        if name in state.q_memory:
            q.copy_(state.q_memory[name])
        _orthogonalize(q, ORTHOGONALIZATION_EPSILON)
