"""The one image normalization: every loader, probe and generator that feeds a network uint8 images
uses it, so "no augmentation" means exactly these values everywhere."""

from __future__ import annotations

import torch

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # per-channel mean of the 50k training images, [0, 1] scale
CIFAR10_STD = (0.2470, 0.2435, 0.2616)  # per-channel (population) std of the same images


def normalize_uint8(x: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float32 normalized with the CIFAR-10 mean/std (the one formula both
    loaders use, so "no augmentation" means exactly these values)."""
    mean = torch.tensor(CIFAR10_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, device=x.device).view(1, 3, 1, 1)
    return (x.float().div_(255.0) - mean) / std
