"""The cost model's one fitted factor, kept where its predictions can find it.

``comm_cpu_share`` (:class:`freeze.pipeline.costmodel.ClusterModel`) is the share of a node's CPU that gloo's
ring takes from the backward while both run. It is fitted at one measured point
(:func:`freeze.pipeline.costmodel.fit_comm_cpu_share`) by ``python -m experiments.validate_costmodel``, which
writes it beside its profiles and probes as ``calibration.json`` (``format:
freeze-costmodel-calibration/1``)::

    format
    comm_cpu_share        in [0, 1]
    fitted_at             {nodes, bandwidth, k, cache}: the point it was fitted at
    source                the command that measured that point

Anything else that predicts on the same machine (the study's prediction stage) reads it, so the
predictions it reports are the validated configuration's, not an assumed even split.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from freeze._atomic import atomic_write_json
from freeze.checks import is_number

CALIBRATION_FORMAT = "freeze-costmodel-calibration/1"
CALIBRATION_FILE = "calibration.json"  # its name beside the validation's profiles and probes


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message is one line naming the field."""


@dataclass(frozen=True)
class Calibration:
    comm_cpu_share: float
    fitted_at: dict
    source: str


def save_calibration(c: Calibration, path: str | Path) -> None:
    """Write ``c`` as JSON, atomically; an existing file is refused (fits are never overwritten).

    Args:
        c: the calibration.
        path: the JSON file to create.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"calibration: {path} exists; never overwritten: choose another path")
    atomic_write_json(path, {"format": CALIBRATION_FORMAT, **asdict(c)})


def load_calibration(path: str | Path) -> Calibration:
    """Read a file written by :func:`save_calibration`.

    Args:
        path: the file.

    Raises:
        CalibrationError: unreadable, another format, or a share outside [0, 1].
    """
    path = Path(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CalibrationError(f"{path}: not a readable calibration ({e})") from None
    if not isinstance(d, dict) or d.get("format") != CALIBRATION_FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise CalibrationError(f"{path}: format {got!r}, expected {CALIBRATION_FORMAT!r}")
    share = d.get("comm_cpu_share")
    if not is_number(share) or not math.isfinite(share) or not 0 <= share <= 1:
        raise CalibrationError(f"{path}: comm_cpu_share {share!r}: expected a number in [0, 1]")
    fitted_at, source = d.get("fitted_at", {}), d.get("source", "")
    if not isinstance(fitted_at, dict) or not isinstance(source, str):
        raise CalibrationError(f"{path}: fitted_at must be a table and source a string")
    return Calibration(float(share), fitted_at, source)
