"""A run directory's boundary trajectory: (optimizer steps, boundary k) per epoch, the input of the
cost model's :func:`freeze.pipeline.costmodel.predict_run`, and the training time the run measured.

    from freeze.pipeline.trajectory import read_trajectory
    t = read_trajectory("runs/offline-full/cluster-1gbit_autofreeze_seed=0")
    predict_run(profile, cluster, t.segments, cache=True).wall_s, t.train_s

The one reader of a trajectory, shared by ``python -m experiments.predict --run`` and the study's
prediction stage (freeze.pipeline.study.predict). It needs only the keys ``step`` and
``boundary_at_epoch_start`` per metrics.jsonl line, so a run
directory without a manifest (copied off a machine, or cut short) still has a trajectory.

An epoch's steps are charged to the boundary in force at its first step: a run records boundaries
per epoch, not per step, so a boundary that moved mid-epoch is charged from the next epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from freeze.checks import is_int, is_number
from freeze.pipeline.jsonl import JsonLinesError, read_json_lines
from freeze.pipeline.schema import METRICS_FILE


class TrajectoryError(ValueError):
    """A run directory without a readable trajectory; the message is one line naming the file."""


@dataclass(frozen=True)
class Trajectory:
    segments: tuple[tuple[int, int], ...]  # (optimizer steps, boundary at the epoch's start) per epoch
    train_s: float  # sum of epoch_wall_s: the training phases of every epoch, evaluation excluded

    @property
    def steps(self) -> int:
        return sum(steps for steps, _ in self.segments)


def read_trajectory(run_dir: str | Path) -> Trajectory:
    """The trajectory of ``run_dir``'s metrics.jsonl (a torn last line is dropped, as a resume drops it).

    Args:
        run_dir: a run directory.

    Raises:
        TrajectoryError: no metrics.jsonl, a malformed line, or a line without step or boundary.
    """
    path = Path(run_dir) / METRICS_FILE
    try:
        records, _ = read_json_lines(path.read_bytes())
    except FileNotFoundError:
        raise TrajectoryError(f"{run_dir}: no metrics.jsonl there") from None
    except OSError as e:
        raise TrajectoryError(f"{path}: cannot read ({e.strerror})") from None
    except JsonLinesError as e:
        raise TrajectoryError(f"{path}:{e.line}: {e.reason}") from None
    segments, previous_step, train_s = [], 0, 0.0
    for line_no, record in records:
        k = record.get("boundary_at_epoch_start")
        step = record.get("step")
        if not is_int(k) or not is_int(step) or step < previous_step:
            raise TrajectoryError(
                f"{path}:{line_no}: keys 'step' (a count that never decreases) and "
                "'boundary_at_epoch_start' (an integer) are needed"
            )
        segments.append((step - previous_step, k))
        previous_step = step
        wall_s = record.get("epoch_wall_s")
        train_s += wall_s if is_number(wall_s) else 0.0
    return Trajectory(tuple(segments), train_s)
