"""Do cached activations equal a fresh forward of the frozen prefix on the benchmark's model?

    python -m experiments.cache_agreement                  # ResNet-18, 32x32, ImageNet stem, 1 thread
    python -m experiments.cache_agreement --stem cifar --threads 2

The cache is built once at k=1 in chunks of ``--chunk`` rows and advanced through every later
boundary; at each boundary the served entries of random batches (sizes 1, 7, 64 and all keys) are
compared with the prefix recomputed from the images at that batch size, in training mode with the
frozen BatchNorm in eval, as the training forward runs it. Prints the largest absolute difference
per boundary and batch size: 0 means bitwise equal. CPU kernels may pick a different algorithm per batch size, so
this is measured, not assumed.
"""

from __future__ import annotations

import argparse

import torch

from freeze import Freezer, split_blocks
from freeze.cache import CacheConfig, CacheSource
from freeze.pipeline import markdown
from freeze.pipeline.models import build_model

BATCH_SIZES = (1, 7, 64)


def max_differences(stem: str, keys: int, chunk: int, image_size: int, seed: int) -> list[tuple[int, int, list[float]]]:
    """(boundary, cut the cache holds, max |served - fresh| per batch size) for every boundary 1..L-1."""
    torch.manual_seed(seed)
    model = build_model("resnet18", 10, stem)
    images = torch.randn(keys, 3, image_size, image_size)
    with torch.no_grad():  # running statistics away from their initial 0/1, as after training
        model.train()
        for i in range(0, keys, 64):
            model(images[i : i + 64])
    source = CacheSource(lambda k: images[k], keys)
    freezer = Freezer(model, split_blocks(model), cache=CacheConfig("memory", chunk_samples=chunk), cache_source=source)
    out = []
    for k in range(1, len(freezer.blocks)):
        freezer.set_boundary(k)
        freezer.train()
        freezer.cache.before_training_forward()  # builds what the boundary change planned
        worst = []
        for size in (*BATCH_SIZES, keys):
            batch = torch.randperm(keys)[:size]
            fresh = freezer.cache.compute_prefix(images[batch], freezer.cache.level)
            served = freezer.cache.read(batch, torch.device("cpu"))
            worst.append((served - fresh).abs().max().item())
        out.append((k, freezer.cache.level, worst))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.cache_agreement", description=__doc__.split("\n")[0])
    p.add_argument("--stem", default="imagenet", choices=("imagenet", "cifar"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--keys", type=int, default=256)
    p.add_argument("--chunk", type=int, default=256, help="rows per build chunk (CacheConfig.chunk_samples)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"resnet18, {args.stem} stem, {args.image_size}x{args.image_size}, {args.threads} thread(s), {args.keys} keys"
    )
    sizes = [*BATCH_SIZES, args.keys]
    header = ["boundary", "cut", *(f"max abs diff, batch {b}" for b in sizes)]
    found = max_differences(args.stem, args.keys, args.chunk, args.image_size, args.seed)
    print("\n".join(markdown.table(header, ([k, level, *(f"{w:.3g}" for w in worst)] for k, level, worst in found))))


if __name__ == "__main__":
    main()
