"""The new-user trial's own script (report/newcomer_trial.md), kept so its runs can be repeated:
mp.spawn on 2 gloo ranks, a tiny CNN, synthetic data, held-out evaluation sharded over the ranks,
2-micro-batch accumulation, an LR scheduler, a checkpoint per epoch and resume. ``--mistake`` runs
one of the slips the trial probed.

    python report/newcomer_trial_script.py --ckpt /tmp/ck.pt [--stop-after E] [--mistake no-eval-mode]
"""

import argparse
import contextlib
import hashlib
import os

import torch
import torch.multiprocessing as mp
from torch import nn

from freeze import CacheSource, Freezer, comm, make_policy, split_blocks


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(conv_block(3, 8), conv_block(8, 16), conv_block(16, 16))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))

    def forward(self, x):
        return self.head(self.features(x))


def make_data(seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (192,), generator=g)
    patterns = torch.randn(4, 3, 8, 8, generator=g)
    x = torch.randn(192, 3, 8, 8, generator=g) + patterns[y]  # learnable: a pattern per class, plus noise
    return x[:128], y[:128], x[128:], y[128:]  # 128 train, 64 held out


def worker(rank, world, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    seed, epochs, micro_batches = 0, args.epochs, 2
    torch.manual_seed(seed)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    images, labels, val_x, val_y = make_data(seed)
    blocks = split_blocks(model)
    freezer = Freezer(
        model,
        blocks,
        make_policy(args.policy),
        epochs=epochs,
        optimizer=optimizer,
        cache=None if args.cache == "off" else args.cache,
        cache_source=CacheSource(lambda keys: images[keys], num_keys=len(images)),
    )
    if rank == 0:
        print("blocks:", [b.name for b in blocks])
    start = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=True)
        freezer.load_training_state_dict(state)
        scheduler.load_state_dict(state["scheduler"])
        start = state["epoch"] + 1
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(start, epochs):
        if args.mistake == "model-train":
            model.train()  # the habit: the bare model's train(), not freezer.train()
        else:
            freezer.train()
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed + epoch))
        for batch in order.view(4, -1):  # 4 global batches of 32
            keys = batch.chunk(comm.world_size())[comm.rank()]
            optimizer.zero_grad(set_to_none=True)
            for i, micro in enumerate(keys.chunk(micro_batches)):
                last = i == micro_batches - 1
                with contextlib.nullcontext() if last else freezer.module.no_sync():
                    x = images[micro]
                    if args.mistake == "augment":  # a fresh random view every epoch, with the cache on
                        x = x + 0.5 * torch.randn(
                            x.shape, generator=torch.Generator().manual_seed(epoch * 1000 + int(micro[0]))
                        )
                    if args.mistake == "no-sample-ids":
                        out = freezer.module(x)
                    else:
                        out = freezer.module(x, sample_ids=micro)
                    (loss_fn(out, labels[micro]) / micro_batches).backward()
            freezer.after_backward()
            optimizer.step()
        scheduler.step()
        freezer.end_epoch(epoch)

        # held-out evaluation, sharded over ranks and all-reduced
        if args.mistake != "no-eval-mode":
            freezer.eval()
        if args.mistake != "no-sync-buffers":
            freezer.sync_buffers()
        shard = torch.arange(len(val_x)).chunk(world)[rank]
        with torch.no_grad() if args.mistake != "no-grad-missing" else contextlib.nullcontext():
            logits = freezer.module(val_x[shard])
            stats = torch.tensor(
                [
                    loss_fn(logits, val_y[shard]).item() * len(shard),
                    (logits.argmax(1) == val_y[shard]).sum().item(),
                    len(shard),
                ]
            )
        torch.distributed.all_reduce(stats)
        if rank == 0:
            print(
                f"epoch {epoch} boundary {freezer.boundary} val loss {stats[0] / stats[2]:.4f} acc {stats[1] / stats[2]:.3f}"
            )
        if rank == 0:
            state = {**freezer.training_state_dict(), "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(state, args.ckpt + ".tmp")
            os.replace(args.ckpt + ".tmp", args.ckpt)
        torch.distributed.barrier()  # the checkpoint is on disk before anyone may stop
        if args.stop_after is not None and epoch == args.stop_after:
            break
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in freezer.model.parameters())).hexdigest()
    print(f"rank {rank} params sha256 {digest[:16]}")
    if rank == 0 and os.environ.get("SAVE_PARAMS"):
        torch.save([p.detach().clone() for p in freezer.model.parameters()], os.environ["SAVE_PARAMS"])
    if rank == 0 and epoch == epochs - 1:
        print(freezer.explain())
    freezer.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--stop-after", type=int, default=None)
    p.add_argument("--policy", default="freezeout:t0=0.3")
    p.add_argument("--cache", default="memory")
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--mistake", default="", help="probe: no-eval-mode, no-grad-missing, model-train, no-sync-buffers")
    args = p.parse_args()
    mp.spawn(worker, args=(2, args), nprocs=2)
