"""A training script shaped like torchvision's references/classification/train.py, with the Freezer
wired in as docs/library.md, "Freezing in your own training script", shows (the lines marked
``# freeze:``). Run under torchrun by tests/test_reference_script.py; tiny model, synthetic data.

Prints one JSON line per epoch (boundary, bytes per step, trainable bytes, EMA copy's trainable
flags) and, at the end, a checksum of the parameters.
"""

import argparse
import copy
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from freeze import Freezer, make_policy, split_blocks  # freeze:


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--resume", default="")
    return parser.parse_args()


def init_distributed_mode():
    if "WORLD_SIZE" not in os.environ:
        return False
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a lost rank fails, never hangs
    return True


def build_model(num_classes=5, width=8):
    def block(c_in, c_out, stride=1):
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())

    return nn.Sequential(
        block(3, width),
        block(width, width),
        block(width, 2 * width, 2),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes)),
    )


def make_loader(epoch, rank, world_size, steps=4, batch=8):
    g = torch.Generator().manual_seed(100 * epoch)
    data = [
        (torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(steps)
    ]
    local = batch // world_size
    return [(x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]) for x, y in data]


def train_one_epoch(model, criterion, optimizer, data_loader, freezer, model_ema, model_without_ddp):
    model.train()  # freezer.module.train(): frozen BatchNorm stays in eval
    for image, target in data_loader:
        output = model(image)
        loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        freezer.after_backward()  # freeze: once per optimizer step, before clipping and step()
        nn.utils.clip_grad_norm_(model_without_ddp.parameters(), 1.0)
        optimizer.step()
        with torch.no_grad():  # EMA over the bare model, as the reference's ExponentialMovingAverage
            for e, p in zip(model_ema.parameters(), model_without_ddp.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)


def save_on_master(state, path):
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = f"{path}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a killed job never leaves half a checkpoint


def main(args):
    distributed = init_distributed_mode()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    model = build_model()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    # was: model = DistributedDataParallel(model); model_without_ddp = model.module
    freezer = Freezer(  # freeze:
        model, split_blocks(model), make_policy("linear"), optimizer=optimizer, epochs=args.epochs
    )
    model, model_without_ddp = freezer.module, freezer.model  # freeze:
    model_ema = copy.deepcopy(model_without_ddp)  # a copy: not steered by the Freezer

    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=True)
        freezer.load_training_state_dict(checkpoint["train"])  # freeze: model, Freezer, optimizer, in order
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        model_ema.load_state_dict(checkpoint["model_ema"])
        start_epoch = checkpoint["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        t0 = time.perf_counter()
        loader = make_loader(epoch, rank, world_size)
        train_one_epoch(model, criterion, optimizer, loader, freezer, model_ema, model_without_ddp)
        bytes_per_step, trainable_bytes = freezer.counters.allreduce_bytes_last_step, freezer.trainable_grad_bytes
        freezer.end_epoch(epoch)  # freeze: the policy may move the boundary
        lr_scheduler.step()
        checkpoint = {
            "train": freezer.training_state_dict(),  # freeze: replaces "model" and "optimizer"
            "lr_scheduler": lr_scheduler.state_dict(),
            "model_ema": model_ema.state_dict(),
            "epoch": epoch,
        }
        save_on_master(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
        if distributed:
            dist.barrier()  # the next launch may resume from this checkpoint
        line = {
            "epoch": epoch,
            "boundary": freezer.boundary,
            "bytes_per_step": bytes_per_step,
            "trainable_bytes_during_epoch": trainable_bytes,
            "ema_all_trainable": all(p.requires_grad for p in model_ema.parameters()),
            "epoch_wall_s": round(time.perf_counter() - t0, 3),
        }
        print(json.dumps(line), flush=True)

    with torch.no_grad():
        checksum = float(sum(p.double().sum() * (i + 1) for i, p in enumerate(model_without_ddp.parameters())))
    freezer.close()  # freeze: drop the DDP wrapper before the group
    if distributed:
        dist.destroy_process_group()
    print(json.dumps({"checksum": checksum}))


if __name__ == "__main__":
    main(get_args())
