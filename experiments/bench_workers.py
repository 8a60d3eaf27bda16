"""Worker side of ``experiments.bench``: one process per rank, every approach measured in it.

Each approach owns its own model replica: two DDP wrappers over one model would both reduce every
gradient. Rounds go over the boundaries k; at each k the approaches take turns step by step, so the
load of a shared machine hits all of them alike. Rank 0 gathers every rank's samples and pickles
them for the parent (:func:`launch`), which turns them into the CSV and the markdown report.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from freeze import Freezer, comm, split_blocks
from freeze.blocks import Block, frozen_names
from freeze.cache import CacheConfig, CacheSource, Cuts
from freeze.cache.cuts import to_device
from freeze.pipeline.log import get_logger
from freeze.testing import SpawnError, run_gloo_rank, spawn_and_collect

NUM_CLASSES = 10
RESNETS = ("resnet18", "resnet34", "resnet50")
# ResNet-18's module tree (10 blocks, 62 parameter tensors, BatchNorm buffers) at 4-8 channels: a
# step whose compute is negligible, so the host's work is what a timing shows (experiments.bench_host)
TINY_RESNET = "resnet18-tiny"
# torchvision's ViT-B/16, built at the bench's image size (a multiple of its 16-pixel patch), and the
# same class at 2 layers of width 32: ViT's code path in seconds (tests, the GPU check's dry run)
VITS = ("vit_b_16", "vit-tiny")
MODELS = RESNETS + ("mlp", TINY_RESNET) + VITS  # image models: every approach, and the cluster benchmark
# Hugging Face BertForSequenceClassification with random weights from a config (no download):
# "bert-base" is BertConfig()'s defaults, "bert-tiny" the same code path in seconds (tests, smoke runs).
TEXT_MODELS = ("bert-base", "bert-tiny")

ENGINE = "freeze_engine"
ENGINE_NO_MONITOR = "freeze_engine_no_monitor"
STATIC = "static_limit"
FIND_UNUSED = "find_unused"
PER_PARAMETER = "per_parameter"
NO_COMM = "no_comm"
ENGINE_CACHE = "freeze_engine_cache"
# A second static limit (its own replica and DDP) in the same rotation: it computes what the static
# limit computes, so its true ratio to it is 1.00 and its measured interval shows the machine's noise.
CONTROL = "static_control"
PREFIX_FORWARD = "prefix_forward"  # not a training step: the frozen prefix's no-grad forward alone
# Measured at every k; NO_COMM only at the phase boundaries, ENGINE_NO_MONITOR only at k=0,
# PREFIX_FORWARD beside ENGINE_CACHE where there is a prefix (k >= 1).
MAIN_APPROACHES = (ENGINE, STATIC, FIND_UNUSED, PER_PARAMETER, ENGINE_CACHE)
TEXT_APPROACHES = (ENGINE, ENGINE_CACHE, STATIC, CONTROL)  # the BERT rows (PREFIX_FORWARD added at k >= 1)


class StepTimes(NamedTuple):
    """Milliseconds of one timed step and of its phases (see :func:`timed_step`)."""

    step_ms: float
    forward_ms: float  # zero_grad + forward + loss
    backward_ms: float  # backward, including any blocking communication
    monitor_ms: float  # after_backward (the engine's monitor; 0 for the other approaches)
    optimizer_ms: float
    peak_mb: float = 0.0  # CUDA: the step's peak allocated memory above what was allocated at its start


class Sample(NamedTuple):
    """One measured step of one rank."""

    approach: str
    k: int
    round: int
    times: StepTimes
    allreduce_bytes: int | None  # None where no per-step count exists (the engine without monitor)


def bert_config(name: str):
    """The BertConfig of a TEXT_MODELS name."""
    from transformers import BertConfig  # imported only for the text models: it takes seconds

    if name == "bert-base":
        return BertConfig(num_labels=NUM_CLASSES)  # hidden 768, 12 layers, 12 heads, vocabulary 30522
    if name == "bert-tiny":
        return BertConfig(
            vocab_size=256,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            num_labels=NUM_CLASSES,
        )
    raise ValueError(f"model: '{name}' is not accepted; accepted: {', '.join(TEXT_MODELS)}")


def build_model(name: str, image_size: int) -> nn.Module:
    """A model of MODELS (input 3 x image_size x image_size) or TEXT_MODELS (random weights from
    the config, under the caller's torch seed; image_size is ignored)."""
    if name in TEXT_MODELS:
        from transformers import BertForSequenceClassification

        return BertForSequenceClassification(bert_config(name))
    if name in RESNETS:
        return getattr(torchvision.models, name)(num_classes=NUM_CLASSES)
    if name == "vit-tiny":
        return torchvision.models.VisionTransformer(
            image_size, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=NUM_CLASSES
        )
    if name in VITS:
        return getattr(torchvision.models, name)(num_classes=NUM_CLASSES, image_size=image_size)
    if name == TINY_RESNET:
        return tiny_resnet18()
    if name == "mlp":
        width = 128
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(3 * image_size * image_size, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, NUM_CLASSES),
        )
    raise ValueError(f"model: '{name}' is not accepted; accepted: {', '.join(MODELS + TEXT_MODELS)}")


def tiny_resnet18() -> nn.Module:
    """torchvision's ResNet-18 with every layer rebuilt at 4-8 channels: the same modules, blocks and
    parameter tensors in the same order (split_blocks cuts it as it cuts ResNet-18)."""
    from torchvision.models.resnet import BasicBlock, ResNet

    model = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=NUM_CLASSES)
    model.inplanes = 4  # _make_layer reads and advances it, as ResNet.__init__ does
    model.conv1 = nn.Conv2d(3, 4, kernel_size=7, stride=2, padding=3, bias=False)
    model.bn1 = nn.BatchNorm2d(4)
    model.layer1 = model._make_layer(BasicBlock, 4, 2)
    model.layer2 = model._make_layer(BasicBlock, 8, 2, stride=2)
    model.layer3 = model._make_layer(BasicBlock, 8, 2, stride=2)
    model.layer4 = model._make_layer(BasicBlock, 8, 2, stride=2)
    model.fc = nn.Linear(8, NUM_CLASSES)
    return model


def run_model(module: nn.Module, x, **kwargs) -> torch.Tensor:
    """``module(**x)`` for a dict of inputs (a Hugging Face model), else ``module(x)``; the logits."""
    out = module(**x, **kwargs) if isinstance(x, dict) else module(x, **kwargs)
    return getattr(out, "logits", out)


def freeze_prefix(model: nn.Module, blocks: list[Block], k: int, frozen_eval: bool) -> None:
    """Blocks 0..k-1 frozen the plain way: requires_grad=False and grad=None (a zero gradient would
    still feed momentum). ``frozen_eval`` runs every module of them in eval, as the engine does
    (``frozen_mode="eval"``): BatchNorm on running statistics, dropout off; else all train."""
    for i, block in enumerate(blocks):
        for p in block.params:
            p.requires_grad_(i >= k)
            if i < k:
                p.grad = None
    model.train()
    if frozen_eval:
        for block in blocks[:k]:
            for mod in block.modules:
                mod.eval()


class _Runner:
    """One approach: a model replica, its optimizer and what runs forward/after backward."""

    def __init__(self, cfg: dict):
        torch.manual_seed(cfg["seed"])  # identical replicas on every rank and across approaches
        self.device = worker_device(cfg)
        self.model = build_model(cfg["model"], cfg["image_size"]).to(self.device)
        self.blocks = split_blocks(self.model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg["lr"], momentum=cfg.get("momentum", 0.9))
        self.k = -1
        self._bytes_last: int | None = 0

    @property
    def module(self) -> nn.Module:
        return self.model

    def set_k(self, k: int) -> None:
        if k != self.k:
            freeze_prefix(self.model, self.blocks, k, frozen_eval=True)
            self.k = k

    def communicate(self) -> None:
        """Runs right after loss.backward(), inside the backward phase."""

    def after_backward(self) -> None:
        """Runs between backward and the optimizer step (the engine's monitor)."""

    def step_bytes(self) -> int | None:
        return self._bytes_last

    def forward(self, x, keys: torch.Tensor) -> torch.Tensor:
        return run_model(self.module, x)


class _CountingDDPRunner(_Runner):
    def __init__(self, cfg: dict):
        super().__init__(cfg)
        self.counter = comm.CommCounter()
        self.ddp: DistributedDataParallel | None = None
        self._bytes_before = 0

    @property
    def module(self) -> nn.Module:
        return self.ddp

    def _wrap(self, **ddp_kwargs) -> None:
        self.ddp = None  # a live old wrapper would keep reducing into its own buckets
        self.ddp = DistributedDataParallel(self.model, **ddp_kwargs)
        self.ddp.register_comm_hook(self.counter, comm._counting_allreduce_hook)

    def communicate(self) -> None:
        self._bytes_last = self.counter.allreduce_bytes_total - self._bytes_before
        self._bytes_before = self.counter.allreduce_bytes_total


class StaticRunner(_CountingDDPRunner):
    """DDP built over a model whose prefix is already frozen: the best a dynamic scheme can reach.
    Frozen blocks in eval and frozen buffers ignored, as the engine does, so only dynamism differs."""

    def set_k(self, k: int) -> None:
        if k != self.k:
            self.ddp = None
            freeze_prefix(self.model, self.blocks, k, frozen_eval=True)
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                self.model, frozen_names(self.blocks, k)
            )
            self._wrap()
            self.k = k


class FindUnusedRunner(_CountingDDPRunner):
    """What most trainers do: one DDP built before freezing with find_unused_parameters=True, then
    requires_grad=False on the prefix. BatchNorm is left as model.train() sets it."""

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        self._wrap(find_unused_parameters=True)

    def set_k(self, k: int) -> None:
        if k != self.k:
            freeze_prefix(self.model, self.blocks, k, frozen_eval=False)
            self.k = k


class PerParameterRunner(_Runner):
    """The reference study's loop: plain model, then one blocking all-reduce per trainable gradient."""

    def communicate(self) -> None:
        world_size = dist.get_world_size()
        sent = 0
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
                sent += p.grad.numel() * p.grad.element_size()
        self._bytes_last = sent


class NoCommRunner(_Runner):
    """Plain model with the same frozen prefix and no communication: the compute floor."""


class EngineRunner(_Runner):
    """This project's Freezer; ``monitor=False`` never calls after_backward (monitor-overhead cell)."""

    def __init__(self, cfg: dict, monitor: bool = True):
        super().__init__(cfg)
        self.freezer = Freezer(self.model, self.blocks, optimizer=self.optimizer)
        self.monitor = monitor
        self.rewrap_ms: list[float] = []

    @property
    def module(self) -> nn.Module:
        return self.freezer.module

    def set_k(self, k: int) -> None:
        rewraps_before = self.freezer.counters.rewraps
        self.freezer.set_boundary(k)
        if self.freezer.counters.rewraps > rewraps_before:
            self.rewrap_ms.append(self.freezer.counters.rewrap_s_last * 1e3)
        self.freezer.train()
        self.k = k

    def after_backward(self) -> None:
        if self.monitor:
            self.freezer.after_backward()

    def step_bytes(self) -> int | None:
        # Without after_backward the counters are not updated: no per-step byte count exists.
        return self.freezer.counters.allreduce_bytes_last_step if self.monitor else None


def cache_images(cfg: dict) -> torch.Tensor:
    """The fixed training set the cache runner keys into (the same on every rank)."""
    gen = torch.Generator().manual_seed(cfg["seed"] + 10_000)
    return torch.randn(cfg["cache_keys"], 3, cfg["image_size"], cfg["image_size"], generator=gen)


def cache_sequences(cfg: dict) -> dict[str, torch.Tensor]:
    """The fixed text training set (the same on every rank): ``cache_keys`` sequences of ``seq_len``
    tokens, random ids, each with its own length drawn from seq_len/2 .. seq_len and the rest
    padding (id 0, attention_mask 0), as a padded fine-tuning batch has."""
    gen = torch.Generator().manual_seed(cfg["seed"] + 10_000)
    n, seq = cfg["cache_keys"], cfg["seq_len"]
    vocab = bert_config(cfg["model"]).vocab_size
    lengths = torch.randint(seq // 2, seq + 1, (n, 1), generator=gen)
    mask = (torch.arange(seq) < lengths).long()
    ids = torch.randint(1, vocab, (n, seq), generator=gen) * mask
    return {"input_ids": ids, "attention_mask": mask}


def source_inputs(cfg: dict) -> Callable[[torch.Tensor], object]:
    """keys -> the model's inputs for those keys: a batch of images, or a dict of input_ids and
    attention_mask (called as model(**inputs))."""
    if cfg["model"] in TEXT_MODELS:
        seqs = cache_sequences(cfg)
        return lambda keys: {name: t[keys] for name, t in seqs.items()}
    images = cache_images(cfg)
    return lambda keys: images[keys]


class CacheEngineRunner(EngineRunner):
    """The engine with a memory activation cache over ``cache_keys`` fixed inputs (images or
    sequences). At every k the cache is built afresh from the inputs (timed); on the way up it is
    first advanced from the previous k (timed), as training would."""

    def __init__(self, cfg: dict):
        _Runner.__init__(self, cfg)
        self.freezer = Freezer(
            self.model,
            self.blocks,
            optimizer=self.optimizer,
            cache=CacheConfig("memory", chunk_samples=cfg["cache_chunk"]),
            cache_source=CacheSource(inputs=source_inputs(cfg), num_keys=cfg["cache_keys"]),
        )
        self.monitor = True
        self.rewrap_ms: list[float] = []
        self.cache_events: list[tuple[str, int, float, int]] = []  # (build|advance, k, seconds, store bytes)
        # k -> [keys served from the store, keys computed because the store missed one, the cut served]
        self.served: dict[int, list] = {}

    def _timed_boundary(self, k: int, kind: str) -> None:
        counters = self.freezer.cache.counters
        before = counters.build_s_total + counters.advance_s_total
        self.freezer.set_boundary(k)
        self.freezer.cache.before_training_forward()  # what the next step would build, timed apart from it
        elapsed = counters.build_s_total + counters.advance_s_total - before
        if self.freezer.cache_active:
            self.cache_events.append((kind, k, elapsed, self.freezer.cache.nbytes))

    def set_k(self, k: int) -> None:
        if k == self.k:
            return
        if 0 < self.k < k:
            self._timed_boundary(k, "advance")
        self.freezer.set_boundary(0)  # drop, so that the build below starts from the images
        self._timed_boundary(k, "build")
        self.freezer.train()
        self.k = k

    def forward(self, x, keys: torch.Tensor) -> torch.Tensor:
        counters = self.freezer.cache.counters
        hits, misses = counters.hit_keys, counters.miss_keys
        out = run_model(self.freezer.module, x, sample_ids=keys)
        served = self.served.setdefault(self.k, [0, 0, None])
        served[0] += counters.hit_keys - hits
        served[1] += counters.miss_keys - misses
        served[2] = self.freezer.cache.level
        return out


class PrefixRunner(_Runner):
    """The frozen prefix's no-grad forward alone (blocks 0..k-1, frozen BN in eval), on its own
    replica: what the cache saves per step, measured in the same rotation as the steps."""

    forward_only = True

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        inputs = source_inputs(cfg)
        self.cuts = Cuts(self.model, self.blocks, lambda keys: to_device(inputs(keys), self.device), cfg["cache_keys"])
        self.prefix: Callable[[object], torch.Tensor] | None = None

    def set_k(self, k: int) -> None:
        if k != self.k:
            freeze_prefix(self.model, self.blocks, k, frozen_eval=True)
            if self.cuts.why_not(k):
                raise RuntimeError(f"bench: no exact cache cut at k={k}: {self.cuts.why_not(k)}")
            self.prefix = lambda x, k=k: self.cuts.capture(x, k)  # what the cache stores at k
            self.k = k

    def step_bytes(self) -> int | None:
        return None


def worker_device(cfg: dict) -> torch.device:
    """The device a rank computes on: its own GPU with ``device="cuda"`` (one rank per GPU), else the CPU."""
    if cfg.get("device", "cpu") == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Clock:
    """Marks within one step: host time on the CPU; on CUDA, events on the stream (the host only
    queues work, so host time would bill each kernel to whichever phase waits for it), read once
    at the end of the step, with the step's peak memory above what it started with."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        if self.cuda:
            self.start_bytes = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        self.device = device

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def phases_ms(self) -> tuple[list[float], float]:
        """Milliseconds between consecutive marks, and the peak MB (0 on the CPU)."""
        if not self.cuda:
            return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])], 0.0
        self.marks[-1].synchronize()
        peak_mb = (torch.cuda.max_memory_allocated(self.device) - self.start_bytes) / 2**20
        return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])], peak_mb


def timed_prefix(runner: PrefixRunner, x) -> StepTimes:
    dist.barrier()
    clock = _Clock(runner.device)
    clock.mark()
    with torch.no_grad():
        runner.prefix(x)
    clock.mark()
    (ms,), peak_mb = clock.phases_ms()
    return StepTimes(ms, ms, 0.0, 0.0, 0.0, peak_mb)


def timed_step(runner: _Runner, x, y: torch.Tensor, keys: torch.Tensor | None = None) -> StepTimes:
    """zero_grad + forward + loss | backward (+ blocking comm) | after_backward | optimizer step, ms."""
    if getattr(runner, "forward_only", False):
        return timed_prefix(runner, x)
    dist.barrier()  # every rank starts the clock together
    clock = _Clock(runner.device)
    clock.mark()
    runner.optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(runner.forward(x, keys), y)
    clock.mark()
    loss.backward()  # DDP's reducer waits for its all-reduces before backward returns
    runner.communicate()
    clock.mark()
    runner.after_backward()
    clock.mark()
    runner.optimizer.step()
    clock.mark()
    (forward, backward, monitor, optimizer), peak_mb = clock.phases_ms()
    return StepTimes(forward + backward + monitor + optimizer, forward, backward, monitor, optimizer, peak_mb)


def schedule(
    ks: tuple[int, ...],
    phase_ks: tuple[int, ...],
    rounds: int,
    approaches: tuple[str, ...] = MAIN_APPROACHES,
    monitor_cell: bool = True,
) -> list[tuple[int, int, tuple[str, ...]]]:
    """(round, k, approaches) groups. Boundaries go up in even rounds and down in odd ones, so the
    engine re-wraps in both directions and slow drift does not line up with k. ``monitor_cell``
    adds the engine without its monitor at k=0; NO_COMM runs at ``phase_ks``."""
    out = []
    for r in range(rounds):
        for k in ks if r % 2 == 0 else tuple(reversed(ks)):
            extra = ((ENGINE_NO_MONITOR,) if k == 0 and monitor_cell else ()) + ((NO_COMM,) if k in phase_ks else ())
            extra += (PREFIX_FORWARD,) if k > 0 and ENGINE_CACHE in approaches else ()
            names = tuple(approaches) + extra
            out.append((r, k, names))
    return out


def measure(cfg: dict, rank: int, log) -> dict:
    """Within a (round, k) group the approaches take turns step by step (order rotating every
    cycle), so each sees the same machine load: on a shared machine load changes within seconds."""
    makers = {
        ENGINE: lambda: EngineRunner(cfg),
        # Its own Freezer: skipping after_backward on the main one would fold the skipped steps'
        # bytes into its next per-step count.
        ENGINE_NO_MONITOR: lambda: EngineRunner(cfg, monitor=False),
        STATIC: lambda: StaticRunner(cfg),
        FIND_UNUSED: lambda: FindUnusedRunner(cfg),
        PER_PARAMETER: lambda: PerParameterRunner(cfg),
        NO_COMM: lambda: NoCommRunner(cfg),
        ENGINE_CACHE: lambda: CacheEngineRunner(cfg),
        PREFIX_FORWARD: lambda: PrefixRunner(cfg),
        CONTROL: lambda: StaticRunner(cfg),
    }
    gen = torch.Generator().manual_seed(cfg["seed"] + rank)
    device = worker_device(cfg)
    text = cfg["model"] in TEXT_MODELS
    # Every approach runs the fixed training set the cache keys into (a batch of random keys): the
    # cache refuses a forward whose inputs are not its source's inputs of those keys.
    inputs = source_inputs(cfg) if (text or "cache_keys" in cfg) else None
    shape = (cfg["batch_size"], 3, cfg["image_size"], cfg["image_size"])
    samples: list[Sample] = []
    plan = schedule(
        tuple(cfg["ks"]),
        tuple(cfg["phase_ks"]),
        cfg["rounds"],
        tuple(cfg.get("approaches", MAIN_APPROACHES)),
        cfg.get("monitor_cell", True),
    )
    # Only the approaches the plan runs: each holds a model replica (the cache runner also its images).
    runners: dict[str, _Runner] = {name: makers[name]() for name in makers if any(name in n for _, _, n in plan)}
    start_s = time.perf_counter()
    for index, (r, k, names) in enumerate(plan):
        for name in names:
            runners[name].set_k(k)
        for cycle in range(cfg["warmup"] + cfg["steps"]):
            shift = (cycle + r) % len(names)
            for name in names[shift:] + names[:shift]:
                # A fresh batch every step (outside the clock): a fixed batch would be memorised
                # and drive gradients towards denormals. Random keys of the fixed inputs, so that
                # every approach (the cache's included) runs the batch it keys.
                if inputs is not None:
                    keys = torch.randint(0, cfg["cache_keys"], (cfg["batch_size"],), generator=gen)
                    x = inputs(keys)
                    y = torch.randint(0, NUM_CLASSES, (cfg["batch_size"],), generator=gen)
                else:
                    x = torch.randn(shape, generator=gen)
                    y = torch.randint(0, NUM_CLASSES, (cfg["batch_size"],), generator=gen)
                    keys = torch.randint(0, cfg.get("cache_keys", 1), (cfg["batch_size"],), generator=gen)
                x, y = to_device((x, y), device)  # outside the clock, as a prefetching loader's batch
                times = timed_step(runners[name], x, y, keys)
                # Free the gradients outside the clock (the step's zero_grad sets them to None
                # anyway): idle replicas holding them would double the memory of a BERT-base run.
                runners[name].optimizer.zero_grad(set_to_none=True)
                if cycle >= cfg["warmup"]:
                    samples.append(Sample(name, k, r, times, runners[name].step_bytes()))
        done_s = time.perf_counter() - start_s
        log.info(
            f"bench: round {r + 1}/{cfg['rounds']} k={k} done ({index + 1}/{len(plan)} groups), {done_s:.0f} s elapsed"
        )
    engine = runners[ENGINE]
    return {
        "samples": samples,
        "rewrap_ms": engine.rewrap_ms,
        "cache_events": runners[ENGINE_CACHE].cache_events if ENGINE_CACHE in runners else [],
        "cache_served": runners[ENGINE_CACHE].served if ENGINE_CACHE in runners else {},
        "block_names": [b.name for b in engine.blocks],
        "block_param_bytes": [b.param_bytes for b in engine.blocks],
        "threads": torch.get_num_threads(),
    }


def worker_main(rank: int, cfg: dict, workdir: str) -> None:
    """Entry point of one spawned rank. Each writes ``rank<r>.pkl`` (ok or its traceback); rank 0's
    holds every rank's measurements."""
    torch.set_num_threads(cfg["threads_per_worker"])
    torch.set_flush_denormal(True)
    log = get_logger(rank)
    cuda = cfg.get("device", "cpu") == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())

    def body() -> list[dict] | None:
        result = measure(cfg, rank, log)
        gathered: list[dict] | None = [None] * cfg["workers"] if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        return gathered

    # On CUDA, NCCL (what a GPU job uses; one rank per GPU): gloo would stage every bucket on the host.
    run_gloo_rank(rank, cfg["workers"], workdir, cfg["collective_timeout_s"], body, "nccl" if cuda else "gloo")


SAMPLE_FIELDS = StepTimes._fields


def combine_ranks(ranks: list[dict]) -> dict[tuple[str, int], dict[str, np.ndarray]]:
    """Per (approach, k): each step's times as the slowest rank's (the one the others wait for),
    bytes as rank 0 counted them. Ranks run the same schedule, so samples line up by index."""
    per_rank: list[list[Sample]] = [r["samples"] for r in ranks]
    if len({len(s) for s in per_rank}) != 1:
        raise RuntimeError("bench: ranks recorded different numbers of steps")
    cells: dict[tuple[str, int], dict[str, list]] = {}
    for steps in zip(*per_rank):
        first = steps[0]
        cell = cells.setdefault(
            (first.approach, first.k), {f: [] for f in SAMPLE_FIELDS} | {"bytes": [], "round": [], "bytes_agree": []}
        )
        for field in SAMPLE_FIELDS:
            cell[field].append(max(getattr(s.times, field) for s in steps))
        cell["bytes"].append(first.allreduce_bytes)
        cell["bytes_agree"].append(len({s.allreduce_bytes for s in steps}) == 1)
        cell["round"].append(first.round)
    return {key: {f: np.asarray(v) for f, v in cell.items()} for key, cell in cells.items()}


def threads_per_worker(workers: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


def launch(cfg: dict, workdir: Path, deadline_s: float) -> list[dict]:
    """Spawn the ranks (file:// rendezvous in ``workdir``), wait with a deadline, kill leftovers;
    return every rank's measurements as gathered by rank 0."""
    workers = cfg["workers"]
    worker_cfg = cfg | {"threads_per_worker": threads_per_worker(workers)}
    try:
        payloads = spawn_and_collect(
            worker_main,
            (worker_cfg, str(workdir)),
            workers,
            workdir,
            deadline_s,
            threads_per_proc=worker_cfg["threads_per_worker"],
        )
    except TimeoutError:
        raise TimeoutError(f"bench: workers did not finish within {deadline_s:.0f} s") from None
    except SpawnError as e:  # raised outside worker_main's try, or killed (e.g. out of memory)
        raise RuntimeError(f"bench: {e}") from None
    for r, payload in enumerate(payloads):
        if not payload["ok"]:
            raise RuntimeError(f"bench: rank {r} failed:\n{payload['error']}")
    return payloads[0]["result"]
