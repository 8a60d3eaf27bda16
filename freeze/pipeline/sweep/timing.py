"""How long an epoch of a stage's runs takes, from runs already measured: the check that a
scheduler's time limit leaves room for at least one epoch (a task stopped before its first
checkpoint would be requeued for ever without progress).

A run's epoch is measured where it matters, on the compute nodes, by the runs themselves
(metrics.jsonl's epoch_wall_s); the cost model's prediction would need a profile of those nodes,
which the login node that submits cannot take. So the check reads complete runs already in the
study's folder whose config matches in everything that sets an epoch's length (data, model,
training, workers), whatever their policy, seed and name: the unfrozen epochs bound it.
"""

from __future__ import annotations

import tomllib

from freeze.pipeline.runs import RunDir, RunError
from freeze.pipeline.schema import CONFIG_FILE
from freeze.pipeline.sweep.grid import RunSpec

# The config sections an epoch's length does not depend on (run names, the freeze policy: an
# unfrozen epoch is the longest; the schedule's LR).
_IGNORED_SECTIONS = ("run", "freeze", "schedule", "optim")


def _shape(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in _IGNORED_SECTIONS}


def longest_epoch_s(specs: list[RunSpec]) -> tuple[float, str] | None:
    """(the longest epoch_wall_s, the run it was measured in) among complete runs beside ``specs``
    with the shape of one of them; None when none was measured."""
    from freeze.pipeline.config import config_to_toml

    shapes = [_shape(tomllib.loads(config_to_toml(s.config))) for s in specs]
    folders = {s.config.run_dir().parent for s in specs}
    best: tuple[float, str] | None = None
    for folder in folders:
        if not folder.is_dir():
            continue
        for run_dir in sorted(p for p in folder.iterdir() if (p / CONFIG_FILE).is_file()):
            try:
                if RunDir(run_dir).status() != "complete":
                    continue
                shape = _shape(tomllib.loads((run_dir / CONFIG_FILE).read_text(encoding="utf-8")))
            except (RunError, OSError, ValueError):
                continue
            if shape not in shapes:
                continue
            for epoch_s in _epoch_walls(RunDir(run_dir)):
                if best is None or epoch_s > best[0]:
                    best = (epoch_s, str(run_dir))
    return best


def _epoch_walls(run: RunDir) -> list[float]:
    """The run's epoch_wall_s values, from its metrics as every reader takes them (a torn last line
    dropped); none when the file cannot be read."""
    try:
        records = run.read_metrics()
    except (RunError, OSError):
        return []
    return [float(r["epoch_wall_s"]) for r in records if isinstance(r.get("epoch_wall_s"), int | float)]
