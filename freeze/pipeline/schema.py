"""Names shared by the writer of a run directory (the training loop) and its reader (the report).

The report reads run directories only and never imports the training code; both import these
names from here instead, so the two cannot drift apart. Imports nothing.
"""

from __future__ import annotations

# Phases timed in every epoch, in the order a step visits them. Their sum is epoch_wall_s.
TRAIN_PHASES: tuple[str, ...] = ("data", "forward", "backward", "optimizer", "freezer")
# Evaluation is timed too (metrics.jsonl phase_s.eval) but is not training time: not in epoch_wall_s.
EVAL_PHASE = "eval"
PHASES: tuple[str, ...] = (*TRAIN_PHASES, EVAL_PHASE)

# metrics.jsonl: the boundary in force when the epoch's first step ran ("boundary" is the one after
# the epoch's last policy evaluation).
BOUNDARY_AT_EPOCH_START = "boundary_at_epoch_start"
# Keys older run directories used for the same value: new name -> old name.
LEGACY_METRIC_KEYS: dict[str, str] = {BOUNDARY_AT_EPOCH_START: "boundary_during"}
