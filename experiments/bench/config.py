"""What one bench run measures: :class:`BenchConfig`, its defaults per model, checked once."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from experiments import bench_workers as bw

QUICK_STEPS, QUICK_ROUNDS = 4, 1
BENCH_MODELS = bw.MODELS + bw.TEXT_MODELS
# The text models' defaults (a BERT-base step on one core takes seconds, a ResNet-18 one 1/4 s):
# 128 tokens (the usual GLUE fine-tuning length) x 2 sequences per worker keep a k=0 step at a few
# seconds, so one round over k = 0,4,8,12 with 4 approaches + the prefix takes a few minutes. No
# momentum: 4 BERT-base replicas per rank (engine, engine + cache, static, control) each hold the
# model, DDP's buckets and, with momentum, one more copy: ~1.75 GB per rank less without it.
TEXT_DEFAULTS = {
    "batch_size": 2,
    "steps": 4,
    "rounds": 2,
    "warmup": 1,
    "cache_keys": 64,
    "cache_chunk": 8,
    "momentum": 0.0,
}
TEXT_DEFAULT_KS = {"bert-base": (0, 4, 8, 12)}  # embeddings + 3, 7, 11 encoder layers frozen
TEXT_QUICK_STEPS, TEXT_QUICK_ROUNDS = 2, 1


@dataclass(frozen=True)
class BenchConfig:
    workers: int = 2
    model: str = "resnet18"
    batch_size: int = 64  # per worker
    image_size: int = 32
    steps: int = 7  # timed steps per approach per (round, k)
    rounds: int = 2  # passes over every k (up, then down); medians pool all rounds
    warmup: int = 2  # untimed steps per approach per (round, k): DDP rebuilds its buckets after the first iteration
    ks: tuple[int, ...] | None = None  # None: every boundary 0 .. blocks-1
    phase_ks: tuple[int, ...] | None = None  # no-comm runs here; None: 0, middle, the last two
    lr: float = 0.01
    momentum: float = 0.9  # SGD's
    seed: int = 0
    collective_timeout_s: float = 300.0
    cache_keys: int = 2048  # inputs the cache runner keys into: "one epoch" for the build target
    cache_chunk: int = 256  # rows per cache build chunk
    seq_len: int = 128  # text models: tokens per sequence (image models: unused)
    device: str = "cpu"  # "cuda": one NCCL rank per GPU, CUDA events for timing (experiments/gpu_check.py)

    @classmethod
    def for_model(cls, model: str, **overrides) -> BenchConfig:
        """The defaults of ``model`` (a text model's are smaller: see TEXT_DEFAULTS), then ``overrides``."""
        base = dict(TEXT_DEFAULTS, ks=TEXT_DEFAULT_KS.get(model)) if model in bw.TEXT_MODELS else {}
        return cls(model=model, **(base | overrides))

    @property
    def text(self) -> bool:
        return self.model in bw.TEXT_MODELS

    def validate(self) -> None:
        for name in ("workers", "batch_size", "image_size", "steps", "rounds", "warmup", "cache_keys", "cache_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench: {name} must be >= 1, got {getattr(self, name)}")
        if self.model not in BENCH_MODELS:
            raise ValueError(f"bench: model '{self.model}' is not accepted; accepted: {', '.join(BENCH_MODELS)}")
        if not self.lr > 0:
            raise ValueError(f"bench: lr must be > 0, got {self.lr}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"bench: device '{self.device}' is not accepted; accepted: cpu, cuda")
        if self.device == "cuda" and not torch.cuda.device_count() >= self.workers:
            raise ValueError(
                f"bench: device cuda needs one GPU per worker ({self.workers} workers, {torch.cuda.device_count()} "
                "GPUs visible; NCCL runs one rank per GPU)"
            )
        if not 0 <= self.momentum < 1:
            raise ValueError(f"bench: momentum must be in [0, 1), got {self.momentum}")
        if self.text:
            max_len = bw.bert_config(self.model).max_position_embeddings
            if not 2 <= self.seq_len <= max_len:
                raise ValueError(f"bench: seq_len must be 2..{max_len} for {self.model}, got {self.seq_len}")
            if self.phase_ks:
                raise ValueError(f"bench: phase_ks is for the image models; {self.model} has no no-comm run")

    def resolved(self, num_blocks: int) -> BenchConfig:
        """ks / phase_ks filled in and checked against the model's blocks."""
        ks = tuple(range(num_blocks)) if self.ks is None else tuple(sorted(set(self.ks)))
        for k in ks:
            if not 0 <= k <= num_blocks - 1:
                raise ValueError(f"bench: ks contains {k}; accepted: 0..{num_blocks - 1} for {self.model}")
        if self.text:
            return replace(self, ks=ks, phase_ks=())
        default_phase = {0, num_blocks // 2, num_blocks - 2, num_blocks - 1}
        phase = default_phase if self.phase_ks is None else set(self.phase_ks)
        stray = sorted(phase - set(ks)) if self.phase_ks is not None else []
        if stray:
            raise ValueError(f"bench: phase_ks {stray} are not among the measured ks {list(ks)}")
        return replace(self, ks=ks, phase_ks=tuple(sorted(phase & set(ks))))
