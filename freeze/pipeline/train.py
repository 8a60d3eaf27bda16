"""The training loop of one worker, in the shape of torchvision's classification reference: load the
data, start the run, build the training objects and resume (:mod:`freeze.pipeline.prepare`), then
per epoch ``train_one_epoch``, ``evaluate``, the epoch record and the checkpoint.

Exact resume: the data order and augmentation are functions of (seed, epoch), the model is
restored with the optimizer, scheduler, scaler, Freezer (boundary, monitor history, policy) and RNG
states, and every epoch's work depends on nothing else; a resumed run therefore ends with the same
parameters and freeze decisions as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from freeze.cache import CacheCounters
from freeze.freezer import Freezer
from freeze.monitor import relative_change
from freeze.pipeline.config import Config
from freeze.pipeline.data import EvalLoader
from freeze.pipeline.distributed import WorkerContext, all_reduce_sum, any_rank, from_rank0, run_and_agree
from freeze.pipeline.log import ProgressLine, get_logger, peak_memory_bytes
from freeze.pipeline.models import build_blocks, build_model
from freeze.pipeline.optim import global_batch, run_lr
from freeze.pipeline.plugins import load_plugins
from freeze.pipeline.prepare import (
    Training,
    begin_run,
    build_policy,
    build_training,
    checkpoint_state,
    claim_run,
    load_data,
    resume_training,
    validation_subset,
)
from freeze.pipeline.run_lock import RunLock
from freeze.pipeline.runs import RunDir, RunError, in_sweep, save_checkpoint
from freeze.pipeline.schema import EVAL_PHASE, PHASES, TRAIN_PHASES, EpochRecord
from freeze.pipeline.trackers import Trackers


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

    def train_seconds(self) -> float:
        """epoch_wall_s: every phase but evaluation."""
        return sum(self.seconds[p] for p in TRAIN_PHASES)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# one epoch: train, evaluate, record, save


@dataclass(frozen=True)
class EpochTraining:
    """What ``train_one_epoch`` measured, summed over every rank."""

    boundary_at_epoch_start: int
    frozen_param_fraction: float  # mean over the epoch's steps
    train_loss: float  # mean over every training image of the epoch
    train_acc: float
    allreduce_bytes: int
    cache: dict | None  # this rank's activation-cache figures (None without a cache)
    probes: list[list[float]] = field(default_factory=list)  # [step, epoch train s so far, probe val acc]


def observe_then_clip(freezer: Freezer, params: list, optimizer, scaler, grad_clip_norm: float) -> None:
    """Unscale, let the Freezer read the gradients the backward produced, then clip them.

    The monitor reads before clipping: clipped norms would be the clip threshold, not the
    gradients' own. fp16: a step GradScaler will skip for inf/NaN gradients is still counted, as
    skipped, so the step clock and the bytes per step stay in step with the loop."""
    scaler.unscale_(optimizer)
    grads = [p.grad for p in params if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads) if (scaler.is_enabled() or grad_clip_norm > 0) else None
    freezer.after_backward(skipped=scaler.is_enabled() and not bool(torch.isfinite(total_norm)))
    if grad_clip_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], grad_clip_norm, total_norm)


def train_step(
    t: Training,
    cfg: Config,
    device: torch.device,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    clock: PhaseClock,
    sums: torch.Tensor,
) -> tuple[torch.Tensor, float]:
    """One optimizer step over ``train.accumulate_steps`` micro-batches, with the Freezer's monitor
    and step-level policy. Adds loss sum, correct and count to ``sums``; returns the last
    micro-batch's loss (still on the device) and the seconds spent waiting for data."""
    freezer, optimizer, scaler, accum = t.freezer, t.optimizer, t.scaler, cfg.train.accumulate_steps
    data_s = 0.0
    for micro in range(accum):
        x, y, keys = next(batches)
        data_s += clock.lap("data")
        last = micro == accum - 1
        sync = contextlib.nullcontext() if last else freezer.module.no_sync()
        with sync:
            with _autocast(cfg.train.precision, device):
                logits = freezer.module(x, sample_ids=keys)
                loss = F.cross_entropy(logits, y, label_smoothing=cfg.train.label_smoothing)
            clock.lap("forward")
            scaler.scale(loss / accum).backward()
            clock.lap("backward")
        with torch.no_grad():
            sums[0] += loss.detach().double() * y.numel()
            sums[1] += (logits.argmax(1) == y).sum()
            sums[2] += y.numel()
    observe_then_clip(freezer, list(t.model.parameters()), optimizer, scaler, cfg.optim.grad_clip_norm)
    clock.lap("freezer")
    scaler.step(optimizer)
    scaler.update()
    t.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    clock.lap("optimizer")
    freezer.after_step()
    clock.lap("freezer")
    return loss.detach(), data_s


def train_one_epoch(
    t: Training, cfg: Config, ctx: WorkerContext, epoch: int, clock: PhaseClock, logger: logging.Logger
) -> EpochTraining:
    """One pass over the training data; the epoch ends with the policy's end-of-epoch decision."""
    freezer = t.freezer
    progress = ProgressLine(logger, epoch, cfg.train.epochs, rank=ctx.rank, device=ctx.device)
    t.loader.set_epoch(epoch)
    freezer.train()
    boundary_at_epoch_start = freezer.boundary
    bytes_before = freezer.counters.allreduce_bytes_total
    frozen_fraction_sum = 0.0
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, count
    cache_start = dataclasses.replace(freezer.cache.counters) if freezer.cache is not None else None
    batches = t.loader.iter_keyed()
    probes: list[list[float]] = []
    clock.start()
    with progress:  # a bar on a terminal is erased even when a step raises
        for step in range(t.steps_per_epoch):
            step_start_s = time.perf_counter()
            frozen_fraction_sum += freezer.frozen_param_fraction
            loss, data_s = train_step(t, cfg, ctx.device, batches, clock, sums)
            # The loss stays on the device: the progress line reads it only when it prints.
            progress.update(step + 1, t.steps_per_epoch, loss, time.perf_counter() - step_start_s, data_s)
            if t.probe_loader is not None and _probe_due(freezer.counters.steps, t.steps_per_epoch, cfg):
                probe = probe_accuracy(t, cfg, ctx.device, clock)
                probes.append([freezer.counters.steps, clock.train_seconds(), probe])
    freezer.end_epoch(epoch)
    clock.lap("freezer")
    for evaluation in freezer.evaluations:  # why the boundary moved or stayed, in the run's log file
        if evaluation.epoch == epoch:
            logger.debug("policy: %s", evaluation.line())
    cache = _cache_record(freezer, cache_start, int(sums[2].item()))
    loss_sum, correct, count = all_reduce_sum(sums).tolist()
    return EpochTraining(
        boundary_at_epoch_start=boundary_at_epoch_start,
        frozen_param_fraction=frozen_fraction_sum / t.steps_per_epoch,
        train_loss=loss_sum / count,
        train_acc=correct / count,
        allreduce_bytes=freezer.counters.allreduce_bytes_total - bytes_before,
        cache=cache,
        probes=probes,
    )


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
    loss_sum, correct, count = all_reduce_sum(totals).tolist()
    return loss_sum / count, correct / count


def _enter_evaluation(t: Training) -> None:
    """Trainable BN statistics are rank-local since the last forward: evaluate with rank 0's, as
    DDP's next forward would, with the model in eval mode."""
    t.freezer.sync_buffers()
    t.freezer.eval()


def _probe_due(step: int, steps_per_epoch: int, cfg: Config) -> bool:
    """Every train.probe_every_steps steps, and at the run's last step: the baseline's last probe is
    the target's reference, and an arm that reaches it only at its last step must be seen doing so."""
    return step % cfg.train.probe_every_steps == 0 or step == steps_per_epoch * cfg.train.epochs


def probe_accuracy(t: Training, cfg: Config, device: torch.device, clock: PhaseClock) -> float:
    """Accuracy on the fixed validation subset in the middle of an epoch, billed to evaluation (off
    the training clock). Only evaluation reads the trainable BatchNorm statistics it syncs, so the
    training that follows is the same with probes or without."""
    _enter_evaluation(t)
    _, accuracy = evaluate(t.model, t.probe_loader, cfg.train.precision, device)
    t.freezer.train()
    clock.lap(EVAL_PHASE)
    return accuracy


@dataclass
class HeldOutLoss:
    """The Freezer's ``probe`` for a policy with a held-out check (horizon on probation): the loss
    on the first ``train.probe_val_size`` validation images (a fixed subset), between steps and billed
    to evaluation, off the training clock, as the accuracy probes are. The Freezer asks for it only at
    the evaluations its policy needs (a proposed freeze and the intervals of its probation)."""

    loader: EvalLoader
    precision: str
    device: torch.device
    freezer: Freezer | None = None  # set once the Freezer exists (it is built with this probe)
    clock: PhaseClock | None = None  # the running epoch's clock

    @classmethod
    def for_run(cls, cfg: Config, ctx: WorkerContext, split) -> HeldOutLoss:
        # data.val_size > 0 was checked where the policy was built (check_policy_inputs)
        return cls(validation_subset(cfg, ctx, split), cfg.train.precision, ctx.device)

    def __call__(self) -> float:
        if self.clock is not None:
            self.clock.lap("freezer")  # what ran before the probe
        self.freezer.sync_buffers()  # rank 0's BatchNorm statistics (the Freezer has switched to eval)
        loss, _ = evaluate(self.freezer.model, self.loader, self.precision, self.device)
        if self.clock is not None:
            self.clock.lap(EVAL_PHASE)
        return loss


def _evaluation_due(cfg: Config, epoch: int) -> bool:
    return (epoch + 1) % cfg.train.eval_every_epochs == 0 or epoch + 1 == cfg.train.epochs


def evaluate_epoch(
    t: Training, cfg: Config, device: torch.device, clock: PhaseClock, is_last_epoch: bool
) -> dict[str, float | None]:
    """Validation and test loss and accuracy (None for a set that is not evaluated)."""
    _enter_evaluation(t)
    val_loss = val_acc = None
    if t.val_loader is not None:
        val_loss, val_acc = evaluate(t.model, t.val_loader, cfg.train.precision, device)
    test_loss = test_acc = None
    if is_last_epoch or cfg.train.test_eval == "every-eval":
        test_loss, test_acc = evaluate(t.model, t.test_loader, cfg.train.precision, device)
    clock.lap(EVAL_PHASE)
    return {"val_loss": val_loss, "val_acc": val_acc, "test_loss": test_loss, "test_acc": test_acc}


def _grad_norm_record(freezer: Freezer, epoch: int) -> dict:
    hist = freezer.history
    if not hist or hist[-1].epoch != epoch:
        return {"summed": None, "mean_step": None, "eta": None}
    eta = relative_change(hist[-2], hist[-1]) if len(hist) >= 2 else [None] * len(freezer.blocks)
    return {"summed": list(hist[-1].summed_grad_norm), "mean_step": list(hist[-1].mean_step_grad_norm), "eta": eta}


def epoch_record(
    t: Training,
    epoch: int,
    train: EpochTraining,
    evaluation: dict[str, float | None],
    clock: PhaseClock,
    cumulative_wall_s: float,
) -> EpochRecord:
    """The epoch's line in metrics.jsonl (:class:`freeze.pipeline.schema.EpochRecord`)."""
    counters = t.freezer.counters
    return EpochRecord(
        epoch=epoch,
        step=counters.steps,
        lr=t.optimizer.param_groups[0]["lr"],
        boundary=t.freezer.boundary,
        boundary_at_epoch_start=train.boundary_at_epoch_start,
        frozen_param_fraction=train.frozen_param_fraction,
        train_loss=train.train_loss,
        train_acc=train.train_acc,
        **evaluation,
        epoch_wall_s=clock.train_seconds(),
        cumulative_wall_s=cumulative_wall_s,
        phase_s=dict(clock.seconds),
        allreduce_bytes=train.allreduce_bytes,
        allreduce_bytes_per_step=counters.allreduce_bytes_last_step,
        rewraps=counters.rewraps,
        rewrap_s=counters.rewrap_s_total,
        grad_norm=_grad_norm_record(t.freezer, epoch),
        policy_evaluations=[e.line() for e in t.freezer.evaluations if e.epoch == epoch],
        boundary_steps=[[d.step, d.boundary_after] for d in t.freezer.decisions if d.epoch == epoch],
        cache=train.cache,
        probes=train.probes,
        peak_memory_bytes=peak_memory_bytes(clock.device),
    )


def _log_epoch(logger: logging.Logger, record: EpochRecord, epochs: int) -> None:
    val_acc, test_acc = record.val_acc, record.test_acc
    logger.info(
        "epoch %d/%d  train loss %.4f acc %.4f  val acc %s  test acc %s  boundary %d->%d  %.1f s  %.2f MB/step",
        record.epoch + 1,
        epochs,
        record.train_loss,
        record.train_acc,
        "-" if val_acc is None else f"{val_acc:.4f}",
        "-" if test_acc is None else f"{test_acc:.4f}",
        record.boundary_at_epoch_start,
        record.boundary,
        record.epoch_wall_s,
        record.allreduce_bytes_per_step / 1e6,
    )
    if not math.isfinite(record.train_loss):  # it would still complete, and its accuracies would enter tables
        logger.warning(
            "epoch %d/%d: train loss %s: the run diverged (optim.lr too high, or data with nan); it goes on as "
            "configured, but its numbers mean nothing",
            record.epoch + 1,
            epochs,
            record.train_loss,
        )


def save_epoch(
    t: Training, cfg: Config, ctx: WorkerContext, run: RunDir, lock: RunLock | None, record: EpochRecord
) -> None:
    """Rank 0 appends the record and (every run.checkpoint_every_epochs, and at the end) saves the
    checkpoint, while it still holds the run; no rank goes on before that is done, and a failed
    write (a full disk) stops every rank with one line naming the file."""
    epochs_done = record.epoch + 1

    def save() -> None:
        lock.check_held()  # a worker whose launcher died must not write after a new writer started
        try:
            run.append_metrics(dataclasses.asdict(record))
            if epochs_done == cfg.train.epochs or epochs_done % cfg.run.checkpoint_every_epochs == 0:
                save_checkpoint(checkpoint_state(t, epochs_done, record.cumulative_wall_s), run.checkpoint_path)
            run.update_manifest(epochs_done=epochs_done)
        except OSError as err:
            raise RunError(f"cannot write {err.filename or run.path}: {err.strerror or err}") from None

    # Also the barrier: no rank runs ahead of a checkpoint it might have to resume from.
    run_and_agree(save, run_here=ctx.is_main, error_type=RunError)


# ---------------------------------------------------------------------------------------------
# the worker


def finish_run(run: RunDir, lock: RunLock | None, final_weights: dict, keep_checkpoint: bool) -> None:
    """Rank 0: final weights to model.pt, the run marked complete, then (unless run.keep_checkpoint)
    checkpoint.pt deleted. In this order a kill at any point leaves a run that resumes (not yet
    complete, its checkpoint there) or a complete run with its weights (at worst its checkpoint too)."""
    if lock is not None:
        lock.check_held()
    try:
        run.write_final_weights(final_weights)
        run.finish("complete")
        if not keep_checkpoint:
            run.drop_checkpoint()
    except OSError as err:
        raise RunError(f"cannot write {err.filename or run.path}: {err.strerror or err}") from None


def announce_start(cfg: Config, ctx: WorkerContext, run: RunDir, logger: logging.Logger) -> None:
    """What this run is about to do, before the silent seconds of data and model set-up; and on
    every machine, where the results go. Under a c10d rendezvous torchrun numbers the nodes by
    arrival, so rank 0, which writes every result file, may run on any machine."""
    host0, path0 = from_rank0((socket.gethostname(), str(run.path.resolve())))
    threads = f"{ctx.threads} torch threads per worker ({ctx.cores} cores / {ctx.local_world_size} local workers"
    threads += ", dist.threads_per_worker)" if cfg.dist.threads_per_worker else ")"
    logger.info("run %s: %d workers on %s, %s; loading data", run.path, ctx.world_size, ctx.device, threads)
    if ctx.is_main:
        logger.info("results go to %s on %s (rank 0's machine)", path0, host0)
    elif ctx.local_rank == 0:  # rank 0's logger prints on its machine only; say it on every machine
        print(f"{socket.gethostname()}: rank 0 runs on {host0}; results go to {path0} there", flush=True)


@dataclass
class WorkerOutcome:
    """What the caller of :func:`train_worker` needs when it raises: whether the run had started
    (its "running" manifest written), i.e. whether an error is a refusal or a failed run."""

    started: bool = False


def train_worker(
    cfg: Config, ctx: WorkerContext, resume: bool, outcome: WorkerOutcome | None = None
) -> EpochRecord | None:
    """Run (or resume) the configured run on this worker; returns the last epoch's record (None when
    no epoch was left to run)."""
    outcome = outcome if outcome is not None else WorkerOutcome()
    run = RunDir(cfg.run_dir())
    # torchrun --max-restarts restarts every worker after a failure: continue from the checkpoint.
    # Agreed across ranks: on several nodes only the node whose worker failed counts a restart;
    # torchrun restarts the others for the membership change with their count unchanged.
    resume = any_rank(resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0)
    lock = claim_run(cfg, ctx, run, resume)
    try:
        return _train(cfg, ctx, run, lock, resume, outcome)
    except BaseException:
        if lock is not None and not outcome.started:
            lock.discard_if_unstarted()  # a refused run leaves nothing behind
        raise
    finally:
        if lock is not None:
            lock.release()


def _train(
    cfg: Config, ctx: WorkerContext, run: RunDir, lock: RunLock | None, resume: bool, outcome: WorkerOutcome
) -> EpochRecord | None:
    logger = get_logger(ctx.rank, run.path / f"log.rank{ctx.rank}.txt" if ctx.is_main else None)
    announce_start(cfg, ctx, run, logger)
    torch.manual_seed(cfg.run.seed)  # model init: identical on all ranks, and the Freezer syncs anyway
    start_s = time.perf_counter()
    # your own datasets, models and policies, by name (a plain torchrun ran no preflight)
    load_plugins(cfg)
    split = load_data(cfg, ctx)
    logger.info(
        "data: %d train / %d val / %d test images of %s in %.1f s",
        len(split.train_y),
        len(split.val_y),
        len(split.test_y),
        cfg.data.dataset,
        time.perf_counter() - start_s,
    )
    start_s = time.perf_counter()
    model = build_model(cfg.model.arch, split.num_classes, cfg.model.stem, cfg.model.weights, logger=logger)
    model = model.to(ctx.device)
    blocks = build_blocks(model, cfg.model.blocks)
    logger.info(
        "model: %s (weights %s), %d blocks, built in %.1f s",
        cfg.model.arch,
        cfg.model.weights or "none",
        len(blocks),
        time.perf_counter() - start_s,
    )
    policy = build_policy(cfg, blocks)
    held_out = HeldOutLoss.for_run(cfg, ctx, split) if policy.needs().probe else None
    resuming = resume and run.checkpoint_path.exists()
    t = build_training(cfg, ctx, split, model, blocks, policy, probe=held_out, resuming=resuming)
    if held_out is not None:
        held_out.freezer = t.freezer

    start_epoch, cumulative_wall_s = 0, 0.0
    if resuming:
        start_epoch, cumulative_wall_s = resume_training(t, run.checkpoint_path, ctx.device)
        # before begin_run: a refused resume keeps its status, and every rank stops on it
        run_and_agree(lambda: run.check_metrics_cover(start_epoch), run_here=ctx.is_main, error_type=RunError)
        logger.info("resumed %s at epoch %d (boundary %d)", run.path, start_epoch, t.freezer.boundary)
    begin_run(cfg, ctx, run, blocks, policy, split, resume, start_epoch)
    outcome.started = True
    if ctx.is_main:
        run.truncate_metrics(start_epoch)  # epochs after the checkpoint are re-run, not duplicated
    logger.info("training: policy %s, %d epochs of %d steps", policy.spec(), cfg.train.epochs, t.steps_per_epoch)
    if cfg.optim.lr_reference_batch:
        samples = global_batch(cfg.train, ctx.world_size)
        logger.info(
            "optim.lr %g set for a global batch of %d (optim.lr_reference_batch): %g at this run's %d",
            cfg.optim.lr,
            cfg.optim.lr_reference_batch,
            run_lr(cfg.optim, samples),
            samples,
        )

    record = None
    trackers = Trackers.open(cfg, run.path, [b.name for b in blocks], ctx.is_main)  # rank 0's, after metrics.jsonl
    try:
        for epoch in range(start_epoch, cfg.train.epochs):
            clock = PhaseClock(ctx.device)
            if held_out is not None:
                held_out.clock = clock
            train = train_one_epoch(t, cfg, ctx, epoch, clock, logger)
            cumulative_wall_s += clock.train_seconds()
            evaluation = dict.fromkeys(("val_loss", "val_acc", "test_loss", "test_acc"))
            if _evaluation_due(cfg, epoch):
                evaluation = evaluate_epoch(t, cfg, ctx.device, clock, epoch + 1 == cfg.train.epochs)
            record = epoch_record(t, epoch, train, evaluation, clock, cumulative_wall_s)
            _log_epoch(logger, record, cfg.train.epochs)
            save_epoch(t, cfg, ctx, run, lock, record)
            trackers.write(record)
    finally:
        trackers.close()
    t.freezer.close()  # releases the DDP wrapper, so that teardown_worker can stop the group's threads
    if ctx.is_main:
        finish_run(run, lock, t.model.state_dict(), cfg.run.keep_checkpoint)
        logger.info("done: results in %s", run.path)
        if not in_sweep():  # a sweep or a study says what comes next itself
            logger.info("report: python -m report %s", run.path.parent)  # writes <study dir>-report/
    return record
