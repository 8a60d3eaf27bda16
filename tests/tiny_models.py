"""Tiny models for the tests: the structure that matters (conv + BN blocks, a head, stacks of layers, tied
and parent-owned parameters) at toy size."""

import torch
import torch.nn.functional as F
from torch import nn


class TinyNet(nn.Module):
    """Four parameter-owning blocks (stem, block1, block2, head) with BatchNorm, plus
    parameter-free modules in between (pool, flatten) that must not become blocks."""

    def __init__(self, num_classes: int = 5, width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.block1 = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.block2 = nn.Sequential(
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU()
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.flatten(self.pool(self.block2(self.block1(self.stem(x))))))


def global_batch(step: int, size: int, num_classes: int = 5, hw: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank for a given step (ranks then take their slice)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 3, hw, hw, generator=g)
    y = torch.randint(0, num_classes, (size,), generator=g)
    return x, y


def freezer_step(freezer, optimizer, step, batch=8):
    """One training step through ``freezer.module`` on ``global_batch(step, batch)``; returns the loss."""
    x, y = global_batch(step, batch)
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(freezer.module(x), y)
    loss.backward()
    freezer.after_backward()
    optimizer.step()
    return loss


class InstanceNormNet(nn.Sequential):
    """Three blocks whose norm layers are InstanceNorm with running statistics: not BatchNorm, yet
    updating buffers in train mode as BatchNorm does."""

    def __init__(self, num_classes: int = 5, width: int = 4):
        super().__init__(
            nn.Sequential(
                nn.Conv2d(3, width, 3, padding=1), nn.InstanceNorm2d(width, affine=True, track_running_stats=True)
            ),
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.InstanceNorm2d(width, track_running_stats=True)),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, num_classes),
        )


class SharedLayerNet(nn.Module):
    """``proj`` runs twice: first, and again after the trainable ``mid``. Frozen, its second call
    must pass the gradient on to ``mid`` (it runs with an input that requires grad)."""

    def __init__(self, num_classes: int = 5, width: int = 6):
        super().__init__()
        self.proj = nn.Linear(3 * 8 * 8, width)
        self.mid = nn.Linear(width, 3 * 8 * 8)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mid(torch.relu(self.proj(x.flatten(1)))))
        return self.head(self.proj(h))


class Stack(nn.Module):
    def __init__(self, depth=12):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(depth))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class TiedLM(Stack):
    """Embedding, a ModuleList of layers, and an output projection tied to the embedding."""

    def __init__(self, vocab=11, depth=3):
        super().__init__(depth)
        self.embed = nn.Embedding(vocab, 4)
        self.head = nn.Linear(4, vocab, bias=False)
        self.head.weight = self.embed.weight


class Scaled(nn.Module):
    """``scale`` is registered first but applied to the input of layers.2; ``temperature`` only
    touches the output of the head."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.temperature = nn.Parameter(torch.ones(1))
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.layers[1](self.layers[0](x))
        x = self.layers[2](x * self.scale)
        return self.head(x) / self.temperature
