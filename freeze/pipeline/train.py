"""The training loop of one worker: data, model, Freezer, optimizer, AMP, accumulation, eval,
metrics.jsonl and atomic per-epoch checkpoints with exact resume.

Exact resume: the data order and augmentation are functions of (seed, epoch), the model is
restored with the optimizer, scheduler, scaler, Freezer (boundary, monitor history, policy) and RNG
states, and every epoch's work depends on nothing else; a resumed run therefore ends with the same
parameters and freeze decisions as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from freeze import comm
from freeze.blocks import children_block_names, split_blocks
from freeze.cache import CacheConfig, CacheCounters
from freeze.freezer import Freezer
from freeze.monitor import relative_change
from freeze.pipeline.config import Config, config_to_toml
from freeze.pipeline.data import DataError, DataSplit, EvalLoader, TrainLoader, load_dataset, split_validation
from freeze.pipeline.distributed import WorkerContext, agree_on_error, barrier
from freeze.pipeline.log import ProgressLine, get_logger
from freeze.pipeline.models import build_model
from freeze.pipeline.optim import build_optimizer, build_scheduler
from freeze.pipeline.runs import RunDir, RunError, environment_info, load_checkpoint, now_iso, save_checkpoint
from freeze.policies import parse_policy

PHASES = ("data", "forward", "backward", "optimizer", "freezer", "eval")


@dataclass
class PhaseClock:
    """Seconds per phase, summed over an epoch. On CUDA each boundary synchronizes, otherwise
    asynchronous kernels would be billed to whichever phase happens to wait for them."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    _last: float = 0.0

    def start(self) -> None:
        self._sync()
        self._last = time.perf_counter()

    def lap(self, phase: str) -> float:
        self._sync()
        now = time.perf_counter()
        elapsed = now - self._last
        self.seconds[phase] += elapsed
        self._last = now
        return elapsed

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "fp16" and device.type != "cuda":
        raise RuntimeError("train.precision: 'fp16' needs a CUDA device (GradScaler); accepted on CPU: fp32, bf16")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@torch.no_grad()
def evaluate(model, loader: EvalLoader, precision: str, device: torch.device) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole set; ranks evaluate disjoint shards, counts all-reduced."""
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in loader:
        with _autocast(precision, device):
            logits = model(x)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += y.numel()
    if comm.is_distributed():
        reduced = totals.to(comm.collective_device())
        torch.distributed.all_reduce(reduced)
        totals = reduced.to(device)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count


def _build_blocks(model, how: str):
    return split_blocks(model, children_block_names(model) if how == "children" else None)


def _prepare_data(cfg: Config, ctx: WorkerContext) -> DataSplit:
    def load():
        return load_dataset(
            cfg.data.dataset,
            cfg.data.root,
            download=cfg.data.download,
            synthetic_train_size=cfg.data.synthetic_train_size,
            synthetic_test_size=cfg.data.synthetic_test_size,
            synthetic_seed=cfg.data.synthetic_seed,
        )

    # One process per machine downloads or writes the files (and keeps what it read); the others
    # read them once it is done.
    error, arrays = None, None
    if ctx.local_rank == 0:
        try:
            arrays = load()
        except DataError as e:
            error = str(e)
    error = agree_on_error(error)
    if error:
        raise DataError(error)
    barrier()
    if arrays is None:
        arrays = load()
    return split_validation(arrays, cfg.data.val_size, cfg.run.seed, cfg.data.train_size, cfg.data.test_size)


def _grad_norm_record(freezer: Freezer, epoch: int) -> dict:
    hist = freezer.history
    if not hist or hist[-1].epoch != epoch:
        return {"summed": None, "mean_step": None, "eta": None}
    eta = relative_change(hist[-2], hist[-1]) if len(hist) >= 2 else [None] * len(freezer.blocks)
    return {"summed": list(hist[-1].summed_grad_norm), "mean_step": list(hist[-1].mean_step_grad_norm), "eta": eta}


def _cache_record(freezer: Freezer, start: CacheCounters | None, samples_read: int) -> dict | None:
    """This rank's activation-cache figures for one epoch (None without a cache)."""
    if freezer.cache is None or start is None:
        return None
    now = freezer.cache.counters
    return {
        "level": freezer.cache.level,
        "bytes": freezer.cache.nbytes,
        "placement": None if freezer.cache.store is None else freezer.cache.store.placement,
        "build_s": now.build_s_total - start.build_s_total,
        "advance_s": now.advance_s_total - start.advance_s_total,
        "exchanged_bytes": now.exchanged_bytes_total - start.exchanged_bytes_total,
        "hit_rate": (now.hit_keys - start.hit_keys) / samples_read if samples_read else 0.0,
        "status": freezer.cache.status,
    }


def train_worker(cfg: Config, ctx: WorkerContext, resume: bool) -> dict:
    """Run (or resume) the configured run on this worker; returns the last metrics record."""
    run = RunDir(cfg.run_dir())
    # torchrun --max-restarts restarts every worker after a failure: continue from the checkpoint.
    resume = resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    logger = get_logger(ctx.rank, run.path / f"log.rank{ctx.rank}.txt" if ctx.is_main else None)
    torch.manual_seed(cfg.run.seed)  # model init: identical on all ranks, and the Freezer syncs anyway
    split = _prepare_data(cfg, ctx)
    num_classes = int(max(split.train_y.max(), split.test_y.max())) + 1
    model = build_model(cfg.model.arch, num_classes, cfg.model.stem, cfg.model.weights).to(ctx.device)
    blocks = _build_blocks(model, cfg.model.blocks)
    policy = parse_policy(cfg.freeze.policy)

    error = None
    if ctx.is_main:
        manifest = {
            "run_name": cfg.run.name,
            "study": cfg.run.study,
            "group": cfg.run_group(),
            "policy": policy.spec(),
            "seed": cfg.run.seed,
            "world_size": ctx.world_size,
            "status": "running",
            "error": None,
            "epochs_planned": cfg.train.epochs,
            "epochs_done": 0,
            "block_names": [b.name for b in blocks],
            "block_param_bytes": [b.param_bytes for b in blocks],
            **environment_info(ctx.device.type),
            "start_time": now_iso(),
            "end_time": None,
        }
        try:
            run.create(config_to_toml(cfg), manifest, resume=resume)
        except RunError as e:
            error = str(e)
    error = agree_on_error(error)
    if error:
        raise RunError(error)

    loader = TrainLoader(
        split.train_x,
        split.train_y,
        cfg.train.batch_size,
        ctx.rank,
        ctx.world_size,
        cfg.run.seed,
        augment=cfg.data.augment,
        device=ctx.device,
    )
    val_loader = (
        EvalLoader(split.val_x, split.val_y, cfg.train.eval_batch_size, ctx.rank, ctx.world_size, ctx.device)
        if len(split.val_y)
        else None
    )
    test_loader = EvalLoader(
        split.test_x, split.test_y, cfg.train.eval_batch_size, ctx.rank, ctx.world_size, ctx.device
    )
    accum = cfg.train.accumulate_steps
    steps_per_epoch = len(loader) // accum
    if cfg.train.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, cfg.train.max_steps_per_epoch)
    if steps_per_epoch < 1:
        raise RuntimeError(
            f"train.accumulate_steps={accum} leaves no optimizer step in an epoch of {len(loader)} batches"
        )
    total_steps = steps_per_epoch * cfg.train.epochs

    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.schedule, steps_per_epoch, total_steps, cfg.optim.lr)
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.train.precision == "fp16")
    ddp_kwargs = {"bucket_cap_mb": cfg.freeze.bucket_cap_mb}
    if ctx.device.type == "cuda":
        ddp_kwargs["device_ids"] = [ctx.device.index]
    freezer = Freezer(
        model,
        blocks,
        policy,
        optimizer=optimizer,
        epochs=cfg.train.epochs,
        steps_per_epoch=steps_per_epoch,
        interval_steps=cfg.freeze.interval_steps,
        ddp_kwargs=ddp_kwargs,
        comm_hook=cfg.freeze.comm_hook,
        grad_checkpointing=cfg.train.grad_checkpointing,
        track_summed_grads=cfg.freeze.track_summed_grads or None,
        cache=CacheConfig(
            mode=cfg.freeze.cache,
            budget_bytes=cfg.freeze.cache_budget_bytes,
            storage_dtype=cfg.freeze.cache_dtype,
            directory=str(run.path),
        ),
        cache_source=loader.cache_source() if cfg.freeze.cache != "off" else None,
    )

    start_epoch, cumulative_wall_s = 0, 0.0
    if resume and run.checkpoint_path.exists():
        ckpt = load_checkpoint(run.checkpoint_path, map_location=ctx.device)
        model.load_state_dict(ckpt["model"])
        freezer.load_state_dict(ckpt["freezer"])  # after the model: re-syncs frozen BN buffers from it
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        _set_rng_state(ckpt["rng"])
        start_epoch, cumulative_wall_s = ckpt["epoch"], ckpt["cumulative_wall_s"]
        logger.info("resumed %s at epoch %d (boundary %d)", run.path, start_epoch, freezer.boundary)
    if ctx.is_main:
        run.truncate_metrics(start_epoch)  # epochs after the checkpoint are re-run, not duplicated
    logger.info(
        "run %s: %d workers on %s, %d blocks, policy %s, %d steps/epoch",
        run.path,
        ctx.world_size,
        ctx.device,
        len(blocks),
        policy.spec(),
        steps_per_epoch,
    )

    record: dict = {}
    params = list(model.parameters())
    for epoch in range(start_epoch, cfg.train.epochs):
        clock = PhaseClock(ctx.device)
        progress = ProgressLine(logger, epoch, cfg.train.epochs, rank=ctx.rank, device=ctx.device)
        loader.set_epoch(epoch)
        freezer.train()
        boundary_during = freezer.boundary
        bytes_before = freezer.counters.allreduce_bytes_total
        frozen_fraction_sum = 0.0
        stats = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, count
        cache_start = dataclasses.replace(freezer.cache.counters) if freezer.cache is not None else None
        samples_read = 0
        batches = loader.iter_keyed()
        clock.start()
        for step in range(steps_per_epoch):
            step_start_s = time.perf_counter()
            frozen_fraction_sum += freezer.frozen_param_fraction
            data_s = 0.0
            for micro in range(accum):
                x, y, keys = next(batches)
                samples_read += y.numel()
                data_s += clock.lap("data")
                last = micro == accum - 1
                sync = contextlib.nullcontext() if last or not comm.is_distributed() else freezer.ddp.no_sync()
                with sync:
                    with _autocast(cfg.train.precision, ctx.device):
                        logits = freezer.forward(x, sample_ids=keys)
                        loss = F.cross_entropy(logits, y, label_smoothing=cfg.train.label_smoothing)
                    clock.lap("forward")
                    scaler.scale(loss / accum).backward()
                    clock.lap("backward")
                with torch.no_grad():
                    stats[0] += loss.detach().double() * y.numel()
                    stats[1] += (logits.argmax(1) == y).sum()
                    stats[2] += y.numel()
            scaler.unscale_(optimizer)
            step_ok = True
            if cfg.optim.grad_clip_norm > 0 or scaler.is_enabled():
                max_norm = cfg.optim.grad_clip_norm if cfg.optim.grad_clip_norm > 0 else float("inf")
                total_norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
                # fp16 only: GradScaler skips steps with overflowed gradients, and so must the monitor.
                step_ok = not scaler.is_enabled() or bool(torch.isfinite(total_norm))
            if step_ok:
                freezer.after_backward()
            clock.lap("freezer")
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            clock.lap("optimizer")
            freezer.after_step()
            clock.lap("freezer")
            progress.update(step + 1, steps_per_epoch, loss.item(), time.perf_counter() - step_start_s, data_s)
        freezer.end_epoch(epoch)
        clock.lap("freezer")
        epoch_wall_s = sum(clock.seconds[p] for p in PHASES if p != "eval")
        cumulative_wall_s += epoch_wall_s

        if comm.is_distributed():
            reduced = stats.to(comm.collective_device())
            torch.distributed.all_reduce(reduced)
            stats = reduced.to(ctx.device)
        train_loss, train_correct, train_count = stats.tolist()
        val_loss = val_acc = test_loss = test_acc = None
        if (epoch + 1) % cfg.train.eval_every_epochs == 0 or epoch + 1 == cfg.train.epochs:
            # Trainable BN statistics are rank-local since the last forward: evaluate with rank 0's,
            # as DDP's next forward would.
            comm.broadcast_from_rank0(list(model.buffers()))
            freezer.eval()
            if val_loader is not None:
                val_loss, val_acc = evaluate(model, val_loader, cfg.train.precision, ctx.device)
            test_loss, test_acc = evaluate(model, test_loader, cfg.train.precision, ctx.device)
            clock.lap("eval")
        record = {
            "epoch": epoch,
            "step": freezer.counters.steps,
            "lr": optimizer.param_groups[0]["lr"],
            "boundary": freezer.boundary,
            "boundary_during": boundary_during,
            "frozen_param_fraction": frozen_fraction_sum / steps_per_epoch,
            "train_loss": train_loss / train_count,
            "train_acc": train_correct / train_count,
            "val_loss": val_loss,
            "val_acc": val_acc,
            "test_loss": test_loss,
            "test_acc": test_acc,
            "epoch_wall_s": epoch_wall_s,
            "cumulative_wall_s": cumulative_wall_s,
            "phase_s": dict(clock.seconds),
            "allreduce_bytes": freezer.counters.allreduce_bytes_total - bytes_before,
            "allreduce_bytes_per_step": freezer.counters.allreduce_bytes_last_step,
            "rewraps": freezer.counters.rewraps,
            "rewrap_s": freezer.counters.rewrap_s_total,
            "grad_norm": _grad_norm_record(freezer, epoch),
            "cache": _cache_record(freezer, cache_start, samples_read),
        }
        logger.info(
            "epoch %d/%d  train loss %.4f acc %.4f  val acc %s  test acc %s  boundary %d->%d  %.1f s  %.2f MB/step",
            epoch + 1,
            cfg.train.epochs,
            record["train_loss"],
            record["train_acc"],
            "-" if val_acc is None else f"{val_acc:.4f}",
            "-" if test_acc is None else f"{test_acc:.4f}",
            boundary_during,
            freezer.boundary,
            epoch_wall_s,
            record["allreduce_bytes_per_step"] / 1e6,
        )
        last_epoch = epoch + 1 == cfg.train.epochs
        if ctx.is_main:
            run.append_metrics(record)
            if last_epoch or (epoch + 1) % cfg.run.checkpoint_every_epochs == 0:
                save_checkpoint(
                    {
                        "epoch": epoch + 1,
                        "cumulative_wall_s": cumulative_wall_s,
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(),
                        "freezer": freezer.state_dict(),
                        "rng": _rng_state(),
                    },
                    run.checkpoint_path,
                )
            run.update_manifest(epochs_done=epoch + 1)
        barrier()  # no rank runs ahead of a checkpoint it might have to resume from
    if ctx.is_main:
        run.finish("complete")
    return record
