"""The run directory's contract, shared by its writer (the training loop) and its reader (the report).

A metrics.jsonl line is an :class:`EpochRecord` and manifest.json a :class:`Manifest`: the fields are
the keys, in the order they are written, and the annotations their JSON types. The writer constructs
them (a misspelt key is a TypeError), the report checks what it reads against the same fields, so
the two cannot drift apart. A field with a default is one the report does without when it is absent
(every current run writes every field). Imports nothing heavy: the report never imports torch.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Phases timed in every epoch, in the order a step visits them. Their sum is epoch_wall_s.
TRAIN_PHASES: tuple[str, ...] = ("data", "forward", "backward", "optimizer", "freezer")
# Evaluation is timed too (metrics.jsonl phase_s.eval) but is not training time: not in epoch_wall_s.
EVAL_PHASE = "eval"
PHASES: tuple[str, ...] = (*TRAIN_PHASES, EVAL_PHASE)

# The files of a run directory.
CONFIG_FILE = "config.toml"
MANIFEST_FILE = "manifest.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_FILE = "checkpoint.pt"  # what a resume needs; a complete run drops it for MODEL_FILE
MODEL_FILE = "model.pt"  # a complete run's final weights (a plain state dict)
LOG_FILE = "log.txt"
# metrics.jsonl keys earlier versions wrote, renamed since (python -m experiments.convert_runs renames
# them once): the report's hint for an unknown key depends on whether converting can help
LEGACY_RECORD_KEYS = {"boundary_during": "boundary_at_epoch_start"}

# manifest.json: a run's status ("running" also describes a run whose process was killed).
RUN_STATUSES: tuple[str, ...] = ("running", "complete", "interrupted", "failed")


@dataclass(frozen=True, kw_only=True)
class EpochRecord:
    """One line of metrics.jsonl: rank 0's record of one epoch."""

    epoch: int  # 0-based
    step: int | None = None  # optimizer steps so far, across epochs
    lr: float | None = None  # the first param group's, at the epoch's end
    boundary: int  # the boundary after the epoch's last policy evaluation
    # the boundary in force when the epoch's first step ran
    boundary_at_epoch_start: int | None = None
    frozen_param_fraction: float
    train_loss: float | None = None
    train_acc: float | None = None
    val_loss: float | None = None
    val_acc: float | None  # None for an epoch without evaluation (and without validation set)
    test_loss: float | None = None
    test_acc: float | None  # None for an epoch whose test set is not evaluated
    epoch_wall_s: float  # the training phases of this epoch, evaluation excluded
    cumulative_wall_s: float  # epoch_wall_s summed over the run's epochs so far
    phase_s: dict[str, float]  # seconds per phase (PHASES), evaluation included
    allreduce_bytes: int  # this rank's gradient bytes on the wire in the epoch
    allreduce_bytes_per_step: int | None = None  # ... in its last step
    rewraps: int | None = None  # DDP re-wraps so far (each boundary move costs one)
    rewrap_s: float | None = None  # seconds spent re-wrapping so far
    grad_norm: dict[str, Any]  # {"summed", "mean_step", "eta"}: per block, null where frozen or unseen
    # why the policy did (not) move the boundary: each evaluation of this epoch, in one line
    policy_evaluations: list[str] = dataclasses.field(default_factory=list)
    # [[step, boundary], ...], each boundary change of the epoch and the optimizer step it was taken
    # after (the Freezer's decisions, kept whole and across resumes). With each epoch's
    # boundary_at_epoch_start it gives the boundary at every step: what the planted-task score reads.
    boundary_steps: list[list[int]] = dataclasses.field(default_factory=list)
    cache: dict[str, Any] | None = None  # this rank's activation-cache figures (None without a cache)
    # [[step, epoch train s so far, accuracy], ...], the probes of train.probe_every_steps: accuracy
    # on a fixed validation subset read in the middle of epochs, off the clock (empty when off). With
    # the previous epochs' cumulative_wall_s they place a time to target between epoch ends.
    probes: list[list[float]] = dataclasses.field(default_factory=list)
    # rank 0's peak memory so far, in bytes (torch's peak allocation on a GPU, the process's peak RSS
    # on a CPU)
    peak_memory_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """manifest.json as a run begins it (:class:`RunEnd` adds how it ended; epochs_done grows)."""

    run_name: str | None = None
    study: str | None = None
    group: str
    setting: str | None = None  # the study setting ("" outside a study)
    policy: str  # the policy's spec
    seed: int
    world_size: int
    status: str  # one of RUN_STATUSES
    error: str | None = None  # why a run failed or was interrupted, in one line
    epochs_planned: int
    epochs_done: int
    block_names: list[str]
    block_param_bytes: list[int] | None = None
    # what chance level is, and how noisy a test accuracy near it is: the report flags an arm that
    # learned nothing (a pipeline check at chance read as a finding misled a new user, issue 32)
    num_classes: int | None = None
    test_images: int | None = None
    # the resolved config the run (re)started with: a resume checks config.toml against it
    config: dict[str, Any] | None = None
    git_commit: str | None = None  # the checkout's commit, "+dirty" when tracked files changed
    # one entry per start and resume: {"from_epoch", "git_commit", "start_time"}; git_commit above is
    # the last one's, so a run resumed on other code says which epochs ran on which (probe case 4)
    sessions: list[dict[str, Any]] | None = None
    versions: dict[str, Any] | None = None  # python, torch, torchvision, numpy
    hardware: dict[str, Any] | None = None  # cpu, cores, gpus, device
    # host, cores_allowed, runs_side_by_side, slurm (job id, nodes, partition): which runs' times pair
    placement: dict[str, Any] | None = None
    start_time: str | None = None  # local time with its UTC offset, to the second
    end_time: str | None = None
    # the machine's 1-minute load average as the run started (and, at its end, finished): what a
    # report says a timing was measured under on a shared machine
    load_avg_1min_start: float | None = None


@dataclass(frozen=True, kw_only=True)
class RunEnd:
    """The manifest fields that record how a run ended, merged into its :class:`Manifest`."""

    status: str
    end_time: str
    load_avg_1min_end: float
    error: str | None


def required_fields(cls: type) -> tuple[str, ...]:
    """The fields of ``cls`` every record must have (those without a default), in field order."""
    return tuple(
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )


def field_types(cls: type) -> dict[str, tuple[type, ...]]:
    """Each field of ``cls`` and the JSON types its annotation accepts (``NoneType`` for null), as
    :func:`isinstance` takes them: ``int | None`` gives ``(int, NoneType)``, ``list[str]`` ``(list,)``."""
    hints = typing.get_type_hints(cls)
    return {name: _runtime_types(hint) for name, hint in hints.items()}


def _runtime_types(hint: Any) -> tuple[type, ...]:
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return tuple(typing.get_origin(m) or m for m in members)


def foreign_record_keys(record: dict) -> list[str]:
    """The keys of a metrics.jsonl record that are no field of :class:`EpochRecord` (legacy keys
    included: :data:`LEGACY_RECORD_KEYS` says which a conversion renames). The resume and the report
    refuse the same records, so a run the resume completes is one the report reads."""
    fields = {f.name for f in dataclasses.fields(EpochRecord)}
    return [key for key in record if key not in fields]


def run_name_part(text: str) -> str:
    """``text`` as part of a run directory's name (sweeps and studies name runs with it): each run
    of characters other than letters, digits and ``. = _ + -`` becomes one '-'."""
    return re.sub(r"[^A-Za-z0-9.=_+-]+", "-", text)


def find_run_dirs(folder: str | Path) -> list[Path]:
    """Every directory below ``folder`` (itself included) holding a manifest, sorted: the runs a
    report reads, a prune shrinks and a conversion converts."""
    return sorted(p.parent for p in Path(folder).rglob(MANIFEST_FILE) if p.is_file())
