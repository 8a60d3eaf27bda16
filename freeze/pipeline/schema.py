"""Names shared by the writer of a run directory (the training loop) and its reader (the report).

The report reads run directories only and never imports the training code; both import these
names from here instead, so the two cannot drift apart. Imports nothing.
"""

from __future__ import annotations

import re

# Phases timed in every epoch, in the order a step visits them. Their sum is epoch_wall_s.
TRAIN_PHASES: tuple[str, ...] = ("data", "forward", "backward", "optimizer", "freezer")
# Evaluation is timed too (metrics.jsonl phase_s.eval) but is not training time: not in epoch_wall_s.
EVAL_PHASE = "eval"
PHASES: tuple[str, ...] = (*TRAIN_PHASES, EVAL_PHASE)

# metrics.jsonl: the boundary in force when the epoch's first step ran ("boundary" is the one after
# the epoch's last policy evaluation).
BOUNDARY_AT_EPOCH_START = "boundary_at_epoch_start"
# metrics.jsonl: [[step, boundary], ...], each boundary change of the epoch and the optimizer step it
# was taken after (the Freezer's decisions, kept whole and across resumes; older run directories lack
# it). With each epoch's boundary_at_epoch_start it gives the boundary at every step: what the
# planted-task score reads.
BOUNDARY_STEPS = "boundary_steps"
# metrics.jsonl: [[step, epoch train s so far, accuracy], ...], the probes of train.probe_every_steps:
# accuracy on a fixed validation subset read in the middle of epochs, off the clock (empty when off).
# With the previous epochs' cumulative_wall_s they place a time to target between epoch ends.
PROBES = "probes"
# metrics.jsonl: rank 0's peak memory so far, in bytes (torch's peak allocation on a GPU, the
# process's peak RSS on a CPU); absent in older run directories.
PEAK_MEMORY = "peak_memory_bytes"
# Keys older run directories used for the same value: new name -> old name.
LEGACY_METRIC_KEYS: dict[str, str] = {BOUNDARY_AT_EPOCH_START: "boundary_during"}

# The files of a run directory.
CONFIG_FILE = "config.toml"
MANIFEST_FILE = "manifest.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_FILE = "checkpoint.pt"  # what a resume needs; a complete run drops it for MODEL_FILE
MODEL_FILE = "model.pt"  # a complete run's final weights (a plain state dict)
LOG_FILE = "log.txt"

# manifest.json: a run's status ("running" also describes a run whose process was killed).
RUN_STATUSES: tuple[str, ...] = ("running", "complete", "interrupted", "failed")
# Keys every manifest has, and their JSON types, as the report checks them.
MANIFEST_KEYS: dict[str, type] = {
    "group": str,
    "policy": str,
    "seed": int,
    "world_size": int,
    "status": str,
    "epochs_planned": int,
    "epochs_done": int,
    "block_names": list,
}

# metrics.jsonl: keys every line has (the report requires them) ...
METRIC_KEYS: tuple[str, ...] = (
    "epoch",
    "boundary",
    "frozen_param_fraction",
    "val_acc",
    "test_acc",
    "epoch_wall_s",
    "cumulative_wall_s",
    "phase_s",
    "allreduce_bytes",
    "grad_norm",
)
# ... and numbers the report carries along when present (older run directories lack some).
METRIC_SCALARS_OPTIONAL: tuple[str, ...] = (
    "step",
    "lr",
    BOUNDARY_AT_EPOCH_START,
    "train_loss",
    "train_acc",
    "val_loss",
    "test_loss",
    "allreduce_bytes_per_step",
    "rewraps",
    "rewrap_s",
    PEAK_MEMORY,
)


def run_name_part(text: str) -> str:
    """``text`` as part of a run directory's name (sweeps and studies name runs with it): each run
    of characters other than letters, digits and ``. = _ + -`` becomes one '-'."""
    return re.sub(r"[^A-Za-z0-9.=_+-]+", "-", text)
