"""Cached-feature tools for the substrate (docs/substrate.md): per-depth pooled features of a
ResNet, a converged multinomial logistic-regression probe, and batch-norm statistics on a dataset.

Depth follows the engine's blocks of a torchvision ResNet-18 (``model.blocks = "default"``): depth d
is the input of block d, i.e. the output of blocks 0..d-1: d=1 the stem (after the max-pool),
d=2..9 the eight residual blocks, so d=9 is the penultimate (globally pooled) feature the head reads.
Every function runs the model in eval mode, without gradients: these are probes, not training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freeze.pipeline.datasets.images import normalize_uint8
from freeze.pipeline.datasets.planted import DEPTH_MODULES

C_GRID = tuple(10.0**e for e in range(-4, 4))  # inverse L2 strength, as scikit-learn's C


class ProbeError(Exception):
    """A probe that cannot run on this model or data, as one line."""


def _check_resnet(model: nn.Module) -> None:
    names = dict(model.named_modules())
    missing = [m for m in DEPTH_MODULES if m not in names]
    if missing:
        raise ProbeError(f"per-depth probes need a torchvision ResNet-18/34 layout; the model lacks {missing[0]!r}")


@torch.no_grad()
def pooled_features(model: nn.Module, x_uint8: torch.Tensor, batch_size: int = 500) -> list[torch.Tensor]:
    """[N, C_d] globally average-pooled features at depths 1..9 (list index d-1) of ``x_uint8``."""
    _check_resnet(model)
    modules = dict(model.named_modules())
    out: list[list[torch.Tensor]] = [[] for _ in DEPTH_MODULES]
    current: dict[int, torch.Tensor] = {}
    hooks = [
        modules[name].register_forward_hook(lambda _m, _i, o, d=d: current.__setitem__(d, o.mean(dim=(2, 3))))
        for d, name in enumerate(DEPTH_MODULES)
    ]
    was_training = model.training
    model.eval()
    try:
        for begin in range(0, x_uint8.shape[0], batch_size):
            model(normalize_uint8(x_uint8[begin : begin + batch_size]))
            for d in range(len(DEPTH_MODULES)):
                out[d].append(current[d])
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return [torch.cat(parts) for parts in out]


@torch.no_grad()
def bn_shift(model: nn.Module, x_uint8: torch.Tensor, batch_size: int = 500) -> list[tuple[str, float, float]]:
    """Per BatchNorm layer (forward order): (name, mean |mu_data - mu_running| / sqrt(var_running),
    mean |log(var_data / var_running)|) over channels, where mu_data and var_data are the
    statistics of the layer's INPUT over all of ``x_uint8`` in an eval-mode forward pass: how far
    the frozen running statistics are from what the data produces."""
    sums: dict[str, list[torch.Tensor]] = {}
    norms = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]

    def hook(name):
        def record(_m, inputs):
            x = inputs[0].double()
            s = sums.setdefault(name, [torch.zeros(x.shape[1], dtype=torch.float64) for _ in range(2)] + [0])
            s[0] += x.sum(dim=(0, 2, 3))
            s[1] += (x * x).sum(dim=(0, 2, 3))
            s[2] += x.shape[0] * x.shape[2] * x.shape[3]

        return record

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in norms]
    was_training = model.training
    model.eval()
    try:
        for begin in range(0, x_uint8.shape[0], batch_size):
            model(normalize_uint8(x_uint8[begin : begin + batch_size]))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    rows = []
    for name, m in norms:
        s0, s1, count = sums[name]
        mu = s0 / count
        var = (s1 / count - mu * mu).clamp_min(1e-12)
        run_mu, run_var = m.running_mean.double(), m.running_var.double().clamp_min(1e-12)
        rows.append(
            (
                name,
                float(((mu - run_mu).abs() / run_var.sqrt()).mean()),
                float((var / run_var).log().abs().mean()),
            )
        )
    return rows


@dataclass(frozen=True)
class ProbeResult:
    c: float  # chosen inverse L2 strength
    val_acc: float
    test_acc: float
    val_by_c: dict[float, float]


def _standardise(train: torch.Tensor, *others: torch.Tensor) -> list[torch.Tensor]:
    mean, std = train.mean(0), train.std(0).clamp_min(1e-6)
    return [(t - mean) / std for t in (train, *others)]


def fit_logreg(x: torch.Tensor, y: torch.Tensor, num_classes: int, c: float, max_iter: int = 500) -> nn.Linear:
    """Multinomial logistic regression, L-BFGS to convergence, loss = sum CE + ||W||^2 / (2 C): the
    objective of scikit-learn's ``LogisticRegression(C=c, solver='lbfgs')`` (bias unpenalised)."""
    x = x.float()
    lin = nn.Linear(x.shape[1], num_classes)
    nn.init.zeros_(lin.weight)
    nn.init.zeros_(lin.bias)
    opt = torch.optim.LBFGS(
        lin.parameters(),
        lr=1.0,
        max_iter=max_iter,
        history_size=20,
        tolerance_grad=1e-7,
        tolerance_change=1e-10,
        line_search_fn="strong_wolfe",
    )
    n = x.shape[0]

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(lin(x), y) + (lin.weight**2).sum() / (2 * c * n)  # the objective / n
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return lin


@torch.no_grad()
def _accuracy(lin: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((lin(x.float()).argmax(1) == y).double().mean())


def linear_probe(
    train: tuple[torch.Tensor, torch.Tensor],
    val: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
    num_classes: int,
    c_grid: tuple[float, ...] = C_GRID,
    max_iter: int = 500,
) -> ProbeResult:
    """The Ericsson et al. protocol on cached features: standardise with the train statistics, fit
    one converged L-BFGS logistic regression per C, choose C on the validation split, report the
    chosen C's test accuracy (the fit on train only; test is never used for a choice)."""
    if train[0].shape[0] < 2 or val[0].shape[0] < 1:
        raise ProbeError("a linear probe needs at least 2 training and 1 validation samples")
    xtr, xva, xte = _standardise(train[0], val[0], test[0])
    val_by_c, fits = {}, {}
    for c in c_grid:
        fits[c] = fit_logreg(xtr, train[1], num_classes, c, max_iter)
        val_by_c[c] = _accuracy(fits[c], xva, val[1])
    best = max(c_grid, key=lambda c: (val_by_c[c], -abs(math.log10(c))))
    return ProbeResult(best, val_by_c[best], _accuracy(fits[best], xte, test[1]), val_by_c)
