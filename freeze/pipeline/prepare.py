"""Everything one worker does before its first epoch: claim the run directory, load the data, build
the training objects, restore them from a checkpoint (the checkpoint's contents are defined here
too, beside their restore), and only then mark the run as started.

Every refusal (bad data sizes, a policy that does not fit the model, a checkpoint of another model)
comes before :func:`begin_run` writes the "running" manifest, so a refused run leaves no manifest
behind; once it is written, the run either completes or is marked failed.
"""

from __future__ import annotations

import dataclasses
import os
import random
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from freeze.blocks import Block
from freeze.cache import CacheConfig, CacheError
from freeze.freezer import Freezer
from freeze.pipeline.config import Config, ConfigError, config_to_toml, default_values
from freeze.pipeline.data import (
    DataError,
    DataSplit,
    DownloadError,
    EvalLoader,
    TrainLoader,
    load_dataset,
    optimizer_steps_per_epoch,
    split_validation,
)
from freeze.pipeline.distributed import WorkerContext, run_and_agree
from freeze.pipeline.models import (
    imagenet_weights_file,
    imagenet_weights_placement,
    state_dict_mismatch,
)
from freeze.pipeline.optim import build_optimizer, build_scheduler, global_batch, run_lr
from freeze.pipeline.preflight import check_policy_inputs, parse_policy_spec
from freeze.pipeline.pricing import recorded_pricing
from freeze.pipeline.run_lock import RunLock
from freeze.pipeline.runs import RunDir, RunError, environment_info, load_checkpoint, now_iso
from freeze.pipeline.schema import Manifest
from freeze.policies import Policy, PolicyError
from freeze.policies.base import same_policy


def load_data(cfg: Config, ctx: WorkerContext) -> DataSplit:
    """This worker's copy of the train / validation / test split."""

    def load():
        try:
            return load_dataset(
                cfg.data.dataset,
                cfg.data.root,
                download=cfg.data.download,
                synthetic_train_size=cfg.data.synthetic_train_size,
                synthetic_test_size=cfg.data.synthetic_test_size,
                synthetic_seed=cfg.data.synthetic_seed,
            )
        except DownloadError as err:
            raise DownloadError(f"{err}{_weights_also_needed(cfg)}") from None

    # One process per machine downloads or writes the files (and keeps what it read); the others
    # read them once it is done.
    arrays = run_and_agree(load, run_here=ctx.local_rank == 0, error_type=DataError)
    if arrays is None:
        arrays = load()
    return split_validation(arrays, cfg.data.val_size, cfg.run.seed, cfg.data.train_size, cfg.data.test_size)


def _weights_also_needed(cfg: Config) -> str:
    """The rest of an offline user's shopping list after the data: the ImageNet weights, when the run
    uses them and torchvision has no copy yet ("" otherwise). An offline cluster user had learned of
    the second file only on the second attempt (issue 32)."""
    if cfg.model.weights != "imagenet" or imagenet_weights_file(cfg.model.arch)[1].is_file():
        return ""
    return (
        f"; this run also needs the ImageNet weights of {cfg.model.arch}, not on this machine either: "
        f"{imagenet_weights_placement(cfg.model.arch)}"
    )


def _manifest(cfg: Config, ctx: WorkerContext, blocks: list[Block], policy: Policy, split: DataSplit) -> Manifest:
    return Manifest(
        run_name=cfg.run.name,
        study=cfg.run.study,
        group=cfg.run_group(),
        setting=cfg.run.setting,
        policy=policy.spec(),
        seed=cfg.run.seed,
        world_size=ctx.world_size,
        status="running",
        error=None,
        epochs_planned=cfg.train.epochs,
        epochs_done=0,
        block_names=[b.name for b in blocks],
        block_param_bytes=[b.param_bytes for b in blocks],
        num_classes=split.num_classes,
        test_images=len(split.test_y),
        config=tomllib.loads(config_to_toml(cfg)),
        **environment_info(ctx.device.type),
        start_time=now_iso(),
        end_time=None,
        load_avg_1min_start=round(os.getloadavg()[0], 2),
    )


def claim_run(cfg: Config, ctx: WorkerContext, run: RunDir, resume: bool) -> RunLock | None:
    """Rank 0 takes the run's lock (or checks its launcher's, see :mod:`freeze.pipeline.run_lock`)
    and writes config.toml after the checks of :meth:`RunDir.prepare`; a refusal stops every rank.
    Returns rank 0's lock (None on the other ranks); its holder releases it."""

    def claim() -> RunLock:
        lock = RunLock.for_worker(run.path)
        try:
            run.prepare(config_to_toml(cfg), resume, default_values())
        except BaseException:
            lock.discard_if_unstarted()
            lock.release()
            raise
        return lock

    return run_and_agree(claim, run_here=ctx.is_main, error_type=RunError)


def build_policy(cfg: Config, blocks: list[Block]) -> Policy:
    """The configured policy, refused (ConfigError) when it does not fit the model's blocks: a
    static:k=99 on a 10-block model must not run as k=9 under the name k=99."""
    policy = parse_policy_spec(cfg.freeze.policy)
    check_policy_inputs(cfg, policy)
    try:
        policy.initial_boundary(len(blocks))
    except PolicyError as err:
        raise ConfigError(f"freeze.policy: {err}; model.arch {cfg.model.arch} has {len(blocks)} blocks") from None
    return policy


def begin_run(
    cfg: Config,
    ctx: WorkerContext,
    run: RunDir,
    blocks: list[Block],
    policy: Policy,
    split: DataSplit,
    resume: bool,
    start_epoch: int = 0,
) -> None:
    """Rank 0 writes the "running" manifest: from here on the run completes or is marked failed.
    ``start_epoch``: the epoch training goes on from (the checkpoint's; 0 for a fresh start)."""
    run_and_agree(  # the manifest on rank 0 alone: it reads git and the machine
        lambda: run.begin(
            dataclasses.asdict(_manifest(cfg, ctx, blocks, policy, split)), resume=resume, from_epoch=start_epoch
        ),
        run_here=ctx.is_main,
        error_type=RunError,
    )


@dataclass
class Training:
    """What one worker trains with, built once by :func:`build_training`."""

    model: nn.Module
    freezer: Freezer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    loader: TrainLoader
    val_loader: EvalLoader | None  # None when data.val_size = 0
    test_loader: EvalLoader
    steps_per_epoch: int  # optimizer steps
    probe_loader: EvalLoader | None = None  # the fixed validation subset of train.probe_every_steps


def _check_batch_fits(cfg: Config, ctx: WorkerContext, n_train: int) -> None:
    global_batch = cfg.train.batch_size * ctx.world_size
    if global_batch > n_train:
        raise ConfigError(
            f"train.batch_size: {cfg.train.batch_size} per worker x {ctx.world_size} workers = {global_batch} "
            f"images per step, more than the {n_train} training images; accepted here: "
            f"1..{max(n_train // ctx.world_size, 1)}"
        )


def validation_subset(cfg: Config, ctx: WorkerContext, split: DataSplit) -> EvalLoader:
    """The first ``train.probe_val_size`` validation images: the same at every probe (the accuracy
    probes and a policy's held-out check)."""
    n = min(cfg.train.probe_val_size, len(split.val_y))
    return EvalLoader(split.val_x[:n], split.val_y[:n], cfg.train.eval_batch_size, ctx.rank, ctx.world_size, ctx.device)


def build_training(
    cfg: Config,
    ctx: WorkerContext,
    split: DataSplit,
    model: nn.Module,
    blocks: list[Block],
    policy: Policy,
    probe: Callable[[], float] | None = None,
    resuming: bool = False,
) -> Training:
    """The training objects; ConfigError when the batch or the accumulation does not fit the data,
    or the policy's pricing cannot be made (freeze.pipeline.pricing). ``probe``: the held-out loss
    for a policy with a held-out check (the Freezer's ``probe``); ``resuming``: the run will load a
    checkpoint, so a pricing policy prices with what the run recorded when it started."""
    _check_batch_fits(cfg, ctx, len(split.train_y))
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
    probe_loader = validation_subset(cfg, ctx, split) if cfg.train.probe_every_steps else None
    accum = cfg.train.accumulate_steps
    steps_per_epoch = optimizer_steps_per_epoch(cfg.train, len(loader))
    if steps_per_epoch < 1:
        raise ConfigError(
            f"train.accumulate_steps: {accum} micro-batches per optimizer step leave no step in an epoch of "
            f"{len(loader)} batches of {cfg.train.batch_size} per worker; accepted here: 1..{len(loader)}"
        )
    total_steps = steps_per_epoch * cfg.train.epochs

    # A policy that sets each block's learning rate needs a parameter group per block (freeze.blocks).
    optim = dataclasses.replace(cfg.optim, lr=run_lr(cfg.optim, global_batch(cfg.train, ctx.world_size)))
    optimizer = build_optimizer(model, optim, blocks if policy.needs().block_lr else None)
    scheduler = build_scheduler(optimizer, cfg.schedule, steps_per_epoch, total_steps, optim.lr)
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.train.precision == "fp16")
    ddp_kwargs = {"bucket_cap_mb": cfg.freeze.bucket_cap_mb}
    if ctx.device.type == "cuda":
        ddp_kwargs["device_ids"] = [ctx.device.index]
    pricing = None
    if policy.needs().pricing:
        names = [b.name for b in blocks]
        pricing = recorded_pricing(
            cfg, cfg.run_dir(), steps_per_epoch, names, optim.lr, resuming=resuming, write=ctx.is_main
        )
    try:
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
            track_summed_grads=cfg.freeze.track_summed_grads,
            cache=CacheConfig(
                mode=cfg.freeze.cache,
                budget_bytes=cfg.freeze.cache_budget_bytes,
                storage_dtype=cfg.freeze.cache_dtype,
                directory=str(cfg.run_dir()),  # a disk cache spills into the run directory
            ),
            cache_source=loader.cache_source() if cfg.freeze.cache != "off" else None,
            pricing=pricing,
            probe=probe,
        )
    except CacheError:
        raise  # naming its own fields (freeze.cache, freeze.cache_budget_bytes)
    except ValueError as e:  # the policy does not fit this run (the Freezer's one-line refusals): no traceback per rank
        raise ConfigError(f"freeze.policy: {e}") from None
    return Training(
        model, freezer, optimizer, scheduler, scaler, loader, val_loader, test_loader, steps_per_epoch, probe_loader
    )


def checkpoint_state(t: Training, epochs_done: int, cumulative_wall_s: float) -> dict:
    """Everything :func:`resume_training` needs to continue bit-identically after ``epochs_done``."""
    return {
        "epoch": epochs_done,
        "cumulative_wall_s": cumulative_wall_s,
        "model": t.model.state_dict(),
        "optimizer": t.optimizer.state_dict(),
        "scheduler": t.scheduler.state_dict(),
        "scaler": t.scaler.state_dict(),
        "freezer": t.freezer.state_dict(),
        "rng": _rng_state(),
    }


_CHECKPOINT_KEYS = ("epoch", "cumulative_wall_s", "model", "optimizer", "scheduler", "scaler", "freezer", "rng")


def _check_checkpoint(ckpt: object, t: Training, path: Path) -> None:
    """RunError (one line) unless ``ckpt`` is a checkpoint of this model under this policy."""
    redo = "delete it to start the run from scratch, or choose another run.name"
    missing = [k for k in _CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise RunError(f"checkpoint {path} is not a checkpoint of this pipeline (no {', '.join(missing)}): {redo}")
    if not isinstance(ckpt["model"], dict) or not isinstance(ckpt["freezer"], dict):
        raise RunError(f"checkpoint {path}: 'model' and 'freezer' must be dicts: {redo}")
    mismatch = state_dict_mismatch(t.model.state_dict(), ckpt["model"], shapes=True)
    if mismatch:
        raise RunError(f"checkpoint {path} is of another model ({mismatch}): {redo}")
    spec, own_spec = ckpt["freezer"].get("policy_spec"), t.freezer.policy.spec()
    if not same_policy(spec, t.freezer.policy):
        raise RunError(
            f"checkpoint {path} was written under freeze.policy {spec!r}, this run uses {own_spec!r}: {redo}"
        )
    names, own_names = ckpt["freezer"].get("block_names"), [b.name for b in t.freezer.blocks]
    if names != own_names:
        count = len(names) if isinstance(names, list) else "?"
        raise RunError(
            f"checkpoint {path} splits the model into {count} blocks, this run into {len(own_names)} "
            f"(model.blocks): {redo}"
        )


def resume_training(t: Training, checkpoint_path: Path, device: torch.device) -> tuple[int, float]:
    """Restore every state from the checkpoint; returns (epochs done, cumulative_wall_s). RunError
    for a checkpoint that cannot be loaded safely or belongs to another model or policy."""
    ckpt = load_checkpoint(checkpoint_path, map_location=device)
    _check_checkpoint(ckpt, t, checkpoint_path)
    # The library owns the order (model, Freezer, optimizer): see Freezer.load_training_state_dict.
    t.freezer.load_training_state_dict({key: ckpt[key] for key in ("model", "freezer", "optimizer")})
    t.scheduler.load_state_dict(ckpt["scheduler"])
    t.scaler.load_state_dict(ckpt["scaler"])
    _set_rng_state(ckpt["rng"])
    return ckpt["epoch"], ckpt["cumulative_wall_s"]


def _rng_state() -> dict:
    """Every RNG's state as tensors and plain numbers, so the checkpoint loads with
    ``weights_only=True`` (numpy's own state tuple holds an ndarray, which that loader refuses)."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),  # MT19937's 624 uint32 words
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    keys = numpy["keys"].cpu().numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
