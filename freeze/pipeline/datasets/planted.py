"""Planted-boundary tasks (research note substrate.md, section 7.1, "P1: residual-subspace readout"):
target tasks whose optimal static freeze boundary d is known by construction, d in {3, 5, 7}.

Images are FDSL-32 target images; labels are a LINEAR readout of the pretrained network's own depth-d
features z_d (h_d, the output of blocks 0..d-1, average-pooled to 2x2 and flattened), restricted to
the directions that its next blocks discard: ridge-regress z_d on z_{d+2} (z_{d+1} for d=5), take the top 16
principal directions U of the residual, k-means (K = 10) on u = U^T z_d, label = nearest centroid
(linear in z_d). Samples near a cluster boundary (margin below the calibration pool's 40th
percentile) are dropped and the classes balanced. Freezing k <= d then keeps every bit the label
needs; freezing k > d freezes blocks that discard it.

The readout (standardisation, ridge, U, centroids, margin threshold) is fitted once per d on a
fixed calibration pool of 6,000 target images and then applied to any (n, seed, split): the task is
a pure function of (d, n, seed, split) and of the committed weights (their sha256 is checked).

Fine-tune planted tasks with ``data.augment = "none"``: a crop or flip moves the 2x2 pooling cells,
so a view's label would differ from its image's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from freeze.pipeline.datasets import fdsl
from freeze.pipeline.datasets.images import normalize_uint8
from freeze.pipeline.datasets.weights import WEIGHTS_FILE, verify
from freeze.pipeline.models import build_model

PLANTED_VERSION = 2  # bump whenever the labels change: the generator's or the committed weights'
TASKS = ("d3", "d5", "d7")
NUM_CLASSES = 10
_SUBSPACE = 16
_RIDGE = 10.0
_MARGIN_QUANTILE = 0.4
_CALIBRATION = (6000, 990001)  # (images, seed) of the calibration pool: fdsl32 target, split "test"
_MAX_ROUNDS = 12
# How many blocks deeper the features are whose linear span the labels avoid. Two for d=3 and d=7;
# one for d=5 (version 2), the research note's remedy when probe(d+1) stays too high: regressed on
# z_7, planted-d5 kept 89.8 % at k=6 against 99.3 % at k=5 (report/substrate/planted.md, version 1).
_DEEPER = {3: 2, 5: 1, 7: 2}


# ResNet-18's depth d = 1..9 (block outputs) by module name; the probes read the same depths.
DEPTH_MODULES = (
    "maxpool",
    "layer1.0",
    "layer1.1",
    "layer2.0",
    "layer2.1",
    "layer3.0",
    "layer3.1",
    "layer4.0",
    "layer4.1",
)  # depth d = 1..9 is the output of DEPTH_MODULES[d - 1]


def depth_of(task: str) -> int:
    if task not in TASKS:
        raise ValueError(f"planted task must be one of {', '.join(TASKS)}, got {task!r}")
    return int(task[1:])


@torch.no_grad()
def depth_maps(model: torch.nn.Module, x_uint8: torch.Tensor, depths: list[int], batch_size: int = 500) -> dict:
    """depth -> [N, D] features: the output of blocks 0..d-1 average-pooled to 2x2 (1x1 maps stay
    1x1), flattened. Eval mode, no gradients."""
    modules = dict(model.named_modules())
    current: dict[int, torch.Tensor] = {}
    hooks = [
        modules[DEPTH_MODULES[d - 1]].register_forward_hook(
            lambda _m, _i, o, d=d: current.__setitem__(d, F.adaptive_avg_pool2d(o, min(2, o.shape[-1])).flatten(1))
        )
        for d in depths
    ]
    out: dict[int, list[torch.Tensor]] = {d: [] for d in depths}
    was_training = model.training
    model.eval()
    try:
        for begin in range(0, x_uint8.shape[0], batch_size):
            model(normalize_uint8(x_uint8[begin : begin + batch_size]))
            for d in depths:
                out[d].append(current[d])
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return {d: torch.cat(v).double() for d, v in out.items()}


@dataclass(frozen=True)
class Readout:
    d: int
    mean: torch.Tensor
    std: torch.Tensor
    basis: torch.Tensor  # [D, m]
    centroids: torch.Tensor  # [K, m]
    threshold: float  # margin (2nd - 1st nearest distance) below which a sample is dropped
    residual_share: float  # share of z_d's variance the next two blocks do not carry linearly

    def assign(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = ((z - self.mean) / self.std) @ self.basis
        dist = torch.cdist(u, self.centroids)
        two = dist.topk(2, largest=False).values
        return dist.argmin(1), two[:, 1] - two[:, 0]


def _kmeans(u: torch.Tensor, k: int, seed: int, iters: int = 60, restarts: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    best, best_inertia = None, float("inf")
    for _ in range(restarts):
        centres = [u[torch.randint(0, u.shape[0], (1,), generator=gen)]]
        for _ in range(1, k):  # k-means++
            d2 = torch.cdist(u, torch.cat(centres)).min(1).values ** 2
            centres.append(u[torch.multinomial(d2 / d2.sum(), 1, generator=gen)])
        c = torch.cat(centres)
        for _ in range(iters):
            a = torch.cdist(u, c).argmin(1)
            c = torch.stack([u[a == j].mean(0) if (a == j).any() else c[j] for j in range(k)])
        inertia = float((torch.cdist(u, c).min(1).values ** 2).sum())
        if inertia < best_inertia:
            best, best_inertia = c, inertia
    return best


def fit_readout(model: torch.nn.Module, x_uint8: torch.Tensor, d: int, seed: int = 0) -> Readout:
    """The planted readout of depth ``d`` fitted on ``x_uint8`` (the calibration pool)."""
    deeper = min(d + _DEEPER.get(d, 2), 9)
    z = depth_maps(model, x_uint8, [d, deeper])
    zd, zn = z[d], z[deeper]
    mean, std = zd.mean(0), zd.std(0).clamp_min(1e-6)
    a = (zn - zn.mean(0)) / zn.std(0).clamp_min(1e-6)
    b = (zd - mean) / std
    w = torch.linalg.solve(a.T @ a + _RIDGE * torch.eye(a.shape[1], dtype=a.dtype), a.T @ b)
    resid = b - a @ w
    residual_share = float(resid.var(0).sum() / b.var(0).sum())
    _, _, vh = torch.linalg.svd(resid - resid.mean(0), full_matrices=False)
    basis = vh[:_SUBSPACE].T.contiguous()
    u = b @ basis
    centroids = _kmeans(u, NUM_CLASSES, seed)
    dist = torch.cdist(u, centroids).topk(2, largest=False).values
    margin = dist[:, 1] - dist[:, 0]
    threshold = float(torch.quantile(margin, _MARGIN_QUANTILE))
    return Readout(d, mean, std, basis, centroids, threshold, residual_share)


@lru_cache(maxsize=4)
def model_and_readout(task: str):
    """The committed pretrained network (its sha256 checked) and the readout fitted for ``task``."""
    verify(WEIGHTS_FILE)
    torch.manual_seed(0)
    model = build_model("resnet18", NUM_CLASSES, "imagenet", WEIGHTS_FILE)
    n, seed = _CALIBRATION
    x, _ = fdsl.render_fdsl_split("target", n, seed, "test")
    return model, fit_readout(model, torch.from_numpy(x), depth_of(task))


def render_planted_split(task: str, n: int, seed: int, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``n`` class-balanced FDSL-32 target images with planted depth-d labels (see module doc)."""
    d = depth_of(task)
    model, readout = model_and_readout(task)
    per_class = [n // NUM_CLASSES + (c < n % NUM_CLASSES) for c in range(NUM_CLASSES)]
    kept_x: list[list[np.ndarray]] = [[] for _ in range(NUM_CLASSES)]
    have = [0] * NUM_CLASSES
    for round_ in range(_MAX_ROUNDS):
        x, _ = fdsl.render_fdsl_split("target", max(2 * n, 200), seed * 1000 + round_, split)
        y, margin = readout.assign(depth_maps(model, torch.from_numpy(x), [d])[d])
        for c in range(NUM_CLASSES):
            idx = torch.nonzero((y == c) & (margin >= readout.threshold)).flatten().numpy()
            take = idx[: per_class[c] - have[c]]
            kept_x[c].append(x[take])
            have[c] += take.size
        if have == per_class:
            break
    else:
        short = [c for c in range(NUM_CLASSES) if have[c] < per_class[c]]
        raise ValueError(f"planted task {task}: class {short[0]} has {have[short[0]]} of {per_class[short[0]]} images")
    images = np.concatenate([np.concatenate(k) for k in kept_x])
    labels = np.concatenate([np.full(per_class[c], c, np.int64) for c in range(NUM_CLASSES)])
    order = np.random.default_rng([seed, d, ("train", "test").index(split)]).permutation(n)
    return images[order], labels[order]


def planted_class_names(task: str) -> tuple[str, ...]:
    return tuple(f"{task}-cluster{c}" for c in range(NUM_CLASSES))
