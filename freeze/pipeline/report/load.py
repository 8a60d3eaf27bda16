"""Read run directories (the contract in freeze/pipeline/runs.py and freeze/pipeline/schema.py) into
plain Python + pandas objects.

The report never imports the training code (only the names in :mod:`freeze.pipeline.schema`, which
imports nothing): a run directory is the only interface, so a report can be rebuilt from results
copied off the machines that trained. Every contract violation raises
:class:`ReportInputError` with one line naming the file (and line) at fault.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from freeze.checks import is_int, is_number
from freeze.pipeline.jsonl import JsonLinesError, read_json_lines
from freeze.pipeline.schema import (
    CONFIG_FILE,
    EVAL_PHASE,
    LEGACY_RECORD_KEYS,
    MANIFEST_FILE,
    METRICS_FILE,
    PHASES,
    RUN_STATUSES,
    TRAIN_PHASES,
    EpochRecord,
    Manifest,
    field_types,
    find_run_dirs,
    foreign_record_keys,
    required_fields,
)

_MANIFEST_TYPES = field_types(Manifest)
_RECORD_TYPES = field_types(EpochRecord)
_RECORD_REQUIRED = required_fields(EpochRecord)
# The numbers of a record, each a column of Run.metrics (phase_s and grad_norm are read apart). In
# the frame: the epoch, the fields the report does without, then those it requires.
_RECORD_SCALARS = tuple(k for k, kinds in _RECORD_TYPES.items() if set(kinds) <= {int, float, type(None)})
METRIC_COLUMNS = (
    "epoch",
    *(k for k in _RECORD_SCALARS if k not in _RECORD_REQUIRED),
    *(k for k in _RECORD_SCALARS if k in _RECORD_REQUIRED and k != "epoch"),
)
# Run.timing_kind's words after the processor, each a number and this suffix (a run alone leaves out
# "1 runs side by side"); timing_from_words reads them back (a run read from a per-seed row).
_TIMING_SUFFIXES = {"cores_allowed": " cores", "runs_side_by_side": " runs side by side"}
# A world of 0 workers or -5 planned epochs would divide by zero or count a run as complete.
_MANIFEST_MINIMUMS = {"seed": 0, "world_size": 1, "epochs_planned": 1, "epochs_done": 0}


class ReportInputError(ValueError):
    """A run directory (or the report's arguments) breaks the contract; the message is one line."""


@dataclass(frozen=True, eq=False)
class Run:
    """One run directory: its manifest, its resolved config (``{}`` without a config.toml) and its per-epoch metrics."""

    run_dir: Path
    manifest: dict
    config: dict
    metrics: pd.DataFrame  # one row per completed epoch, phase times as phase_<name>_s columns
    eta: np.ndarray  # epochs x blocks, NaN where the log has null
    # (cumulative train s, accuracy) of every probe of train.probe_every_steps, in order; () without
    probes: tuple[tuple[float, float], ...] = ()
    # (optimizer step, boundary after it) of every boundary change, in order (metrics.jsonl's
    # boundary_steps); () without changes, and in run directories older than that key
    boundary_steps: tuple[tuple[int, int], ...] = ()
    # the per-seed CSV this run was read back from (freeze.pipeline.report.rows), None for a run
    # directory: such a run has no bytes, phase times or per-block eta (NaN)
    rows_file: Path | None = None

    @property
    def from_rows(self) -> bool:
        return self.rows_file is not None

    @property
    def recorded_config(self) -> dict:
        """The config fields a per-seed row records (freeze.pipeline.report.rows): what a run is compared
        on when it, or the run it is compared with, was read back from a row."""
        return {
            "freeze": {"policy": self.policy, "comm_hook": self.comm_hook},
            "train": {"budget_fraction": self.budget_fraction},
        }

    @property
    def has_phase_times(self) -> bool:
        """Whether every epoch recorded its training phases' seconds (rows written before they carried
        them: no)."""
        columns = [f"phase_{phase}_s" for phase in TRAIN_PHASES]
        return bool(np.isfinite(self.metrics[columns].to_numpy(dtype=float)).all())

    @property
    def final_step(self) -> float:
        """Optimizer steps the run took: its last epoch record's step."""
        return float(self.metrics["step"].iloc[-1])

    @property
    def name(self) -> str:
        return str(self.manifest.get("run_name") or self.run_dir.name)

    @property
    def group(self) -> str:
        return self.manifest["group"]

    @property
    def policy(self) -> str:
        return self.manifest["policy"]

    @property
    def seed(self) -> int:
        return self.manifest["seed"]

    @property
    def setting(self) -> str:
        """The study setting ("" for runs made before settings existed, or outside a study)."""
        return str(self.manifest.get("setting") or "")

    @property
    def world_size(self) -> int:
        return self.manifest["world_size"]

    @property
    def status(self) -> str:
        return self.manifest["status"]

    @property
    def hardware(self) -> dict:
        """The manifest's hardware record ({} when missing or malformed)."""
        hw = self.manifest.get("hardware")
        return hw if isinstance(hw, dict) else {}

    @property
    def timing_fields(self) -> dict:
        """What sets a run's time on its hardware, as far as the manifest recorded it: the processor
        and, in manifests that have a placement, the cores it could use and how many runs shared the
        machine (a cluster's nodes differ; runs side by side share memory bandwidth)."""
        fields = {"processor": self.processor}
        placement = self.manifest.get("placement")
        if isinstance(placement, dict):
            for key in ("cores_allowed", "runs_side_by_side"):
                if placement.get(key) is not None:
                    fields[key] = placement[key]
        return fields

    def timed_like(self, other: Run) -> bool:
        """Whether two runs' times form a ratio: equal in every timing field both recorded (a run
        from before manifests recorded a placement pairs by processor alone)."""
        mine, theirs = self.timing_fields, other.timing_fields
        return all(mine[k] == theirs[k] for k in mine.keys() & theirs.keys())

    @property
    def timing_kind(self) -> str:
        """:attr:`timing_fields` in words, for the report's notes."""
        fields = self.timing_fields
        words = [str(fields["processor"])]
        if "cores_allowed" in fields:
            words.append(f"{fields['cores_allowed']}{_TIMING_SUFFIXES['cores_allowed']}")
        if fields.get("runs_side_by_side", 1) != 1:
            words.append(f"{fields['runs_side_by_side']}{_TIMING_SUFFIXES['runs_side_by_side']}")
        return ", ".join(words)

    @property
    def processor(self) -> str:
        """What the run computed on: its first GPU, else its CPU ("?" when unrecorded)."""
        gpus = self.hardware.get("gpus") or []
        return str(gpus[0] if gpus else self.hardware.get("cpu", "?"))

    @property
    def num_classes(self) -> int | None:
        """How many classes the run's data has (None: a run made before manifests recorded it)."""
        return self.manifest.get("num_classes")  # checked when read: an integer >= 1 or absent

    @property
    def test_images(self) -> int | None:
        """How many images its test accuracy is measured on (None: not recorded)."""
        return self.manifest.get("test_images")  # checked when read: an integer >= 1 or absent

    @property
    def comm_hook(self) -> str:
        """freeze.comm_hook: how its gradients travelled ("allreduce" for runs made before hooks)."""
        return str(self.config.get("freeze", {}).get("comm_hook", "allreduce"))

    @property
    def budget_fraction(self) -> float:
        """train.budget_fraction: the fraction of every epoch's steps it trained (1.0 for runs made
        before budgets existed)."""
        return float(self.config.get("train", {}).get("budget_fraction", 1.0))

    @property
    def block_names(self) -> list[str]:
        return [str(b) for b in self.manifest["block_names"]]

    @property
    def incomplete_reason(self) -> str | None:
        """Why this run must stay out of every mean, or None for a finished run."""
        done, planned = self.manifest["epochs_done"], self.manifest["epochs_planned"]
        if self.status != "complete":
            error = self.manifest.get("error")
            return f"{self.status}: {error}" if error else self.status
        if done < planned:
            return f"epochs_done {done} < epochs_planned {planned}"
        if len(self.metrics) < planned:
            return f"metrics.jsonl has {len(self.metrics)} of {planned} epochs"
        return None

    @property
    def is_complete(self) -> bool:
        return self.incomplete_reason is None


def timing_from_words(text: str) -> tuple[str, dict]:
    """:attr:`Run.timing_kind`'s words back into a processor and a placement; a placement that names
    its cores ran alone (timing_kind leaves out "1 runs side by side")."""
    words = [w.strip() for w in text.split(", ")]
    patterns = {key: re.compile(rf"(\d+){re.escape(suffix)}") for key, suffix in _TIMING_SUFFIXES.items()}
    placement = {}
    while len(words) > 1:
        found = next(((key, m) for key, p in patterns.items() if (m := p.fullmatch(words[-1]))), None)
        if found is None:
            break
        placement[found[0]] = int(found[1].group(1))
        words.pop()
    if "cores_allowed" in placement:
        placement.setdefault("runs_side_by_side", 1)
    return ", ".join(words) or "?", placement


def load_runs(runs_dir: str | Path) -> list[Run]:
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise ReportInputError(f"runs directory not found: {runs_dir}")
    run_dirs = find_run_dirs(runs_dir)
    if not run_dirs:
        raise ReportInputError(f"no run directories (a folder with manifest.json) found under {runs_dir}")
    return [load_run(d) for d in run_dirs]


def load_run(run_dir: Path) -> Run:
    manifest = read_manifest(run_dir / MANIFEST_FILE)
    metrics, eta, probes, boundary_steps = read_metrics(run_dir / METRICS_FILE, n_blocks=len(manifest["block_names"]))
    return Run(run_dir, manifest, read_config(run_dir / CONFIG_FILE), metrics, eta, probes, boundary_steps)


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ReportInputError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{path}: cannot read ({exc})") from None
    if not isinstance(manifest, dict):
        raise ReportInputError(f"{path}: expected a JSON object, got {type(manifest).__name__}")
    for key in required_fields(Manifest):
        (kind,) = _MANIFEST_TYPES[key]
        value = manifest.get(key)
        # bool is an int subclass; a seed of true is still a broken manifest.
        if not (is_int(value) if kind is int else isinstance(value, kind)):
            raise ReportInputError(f"{path}: key '{key}' must be {kind.__name__}, got {value!r}")
    for key, low in _MANIFEST_MINIMUMS.items():
        if manifest[key] < low:
            raise ReportInputError(f"{path}: key '{key}' must be an integer >= {low}, got {manifest[key]!r}")
    if manifest["epochs_done"] > manifest["epochs_planned"]:  # a run never trains past its plan
        raise ReportInputError(
            f"{path}: key 'epochs_done' must be an integer from 0 to epochs_planned "
            f"({manifest['epochs_planned']}), got {manifest['epochs_done']!r}"
        )
    for key in ("num_classes", "test_images"):  # absent in manifests older than these keys
        value = manifest.get(key)
        if value is not None and not (is_int(value) and value >= 1):
            raise ReportInputError(f"{path}: key '{key}' must be an integer >= 1, got {value!r}")
    if manifest["status"] not in RUN_STATUSES:
        raise ReportInputError(f"{path}: status {manifest['status']!r} is not one of {', '.join(RUN_STATUSES)}")
    return manifest


def read_config(path: Path) -> dict:
    """The resolved config (it tells a control from an arm: report.paired.is_control); a run without one
    is still reportable, as ``{}``."""
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{path}: not valid TOML ({exc})") from None


def read_metrics(
    path: Path, n_blocks: int
) -> tuple[pd.DataFrame, np.ndarray, tuple[tuple[float, float], ...], tuple[tuple[int, int], ...]]:
    """Parse metrics.jsonl with the run directory's own reader (:mod:`freeze.pipeline.jsonl`): a torn
    last line, left by a crash mid-append, is dropped as a resume would drop it. A run that died
    before its first epoch may have no metrics at all (empty frame). Returns the per-epoch frame, eta
    (epochs x blocks), the probes as (cumulative train s, accuracy) and the boundary changes as
    (optimizer step, boundary after it)."""
    rows: list[dict] = []
    eta_rows: list[list[float]] = []
    probes: list[tuple[float, float]] = []
    boundary_steps: list[tuple[int, int]] = []
    if path.is_file():
        try:
            numbered, _ = read_json_lines(path.read_bytes())
        except OSError as exc:
            raise ReportInputError(f"{path}: cannot read ({exc.strerror})") from None
        except JsonLinesError as exc:
            raise ReportInputError(f"{path}:{exc.line}: malformed metrics line ({exc.reason})") from None
        for line_no, record in numbered:
            row, eta = _parse_metrics_record(record, f"{path}:{line_no}", n_blocks)
            if rows and row["epoch"] <= rows[-1]["epoch"]:
                raise ReportInputError(
                    f"{path}:{line_no}: epoch {row['epoch']:g} does not follow epoch {rows[-1]['epoch']:g} "
                    "(lines must be in epoch order)"
                )
            before_s = rows[-1]["cumulative_wall_s"] if rows else 0.0
            probes += [(before_s + epoch_s, acc) for epoch_s, acc in _probes(record, f"{path}:{line_no}")]
            boundary_steps += _boundary_steps(record, f"{path}:{line_no}")
            rows.append(row)
            eta_rows.append(eta)
    columns = [*METRIC_COLUMNS, *(f"phase_{name}_s" for name in PHASES)]
    frame = pd.DataFrame(rows, columns=columns).astype(float).astype({"epoch": int})
    eta = np.array(eta_rows, dtype=float).reshape(len(eta_rows), n_blocks)
    return frame, eta, tuple(probes), tuple(boundary_steps)


def _probes(record: dict, where: str) -> list[tuple[float, float]]:
    """An epoch's probes as (epoch train s so far, accuracy); none when the record has none."""
    probes = record.get("probes", [])
    ok = isinstance(probes, list) and all(isinstance(p, list) and len(p) == 3 for p in probes)
    if not ok:
        raise ReportInputError(f"{where}: malformed metrics line (probes must be a list of [step, s, accuracy])")
    return [
        (_number(s, "probes", where, nullable=False), _number(acc, "probes", where, nullable=False))
        for _, s, acc in probes
    ]


def _boundary_steps(record: dict, where: str) -> list[tuple[int, int]]:
    """An epoch's boundary changes as (optimizer step, boundary after it); none in older run directories."""
    changes = record.get("boundary_steps", [])
    ok = isinstance(changes, list) and all(
        isinstance(c, list) and len(c) == 2 and all(is_int(v) and v >= 0 for v in c) for c in changes
    )
    if not ok:
        raise ReportInputError(
            f"{where}: malformed metrics line (boundary_steps must be a list of [step, boundary], integers >= 0)"
        )
    return [(int(step), int(boundary)) for step, boundary in changes]


def _check_record_keys(record: dict, where: str) -> None:
    """ReportInputError (one line) when ``record`` lacks a field of :class:`EpochRecord` the report
    requires, or has a key that is not one of its fields (a run directory of an older version)."""
    missing = [k for k in _RECORD_REQUIRED if k not in record]
    if missing:
        raise ReportInputError(f"{where}: malformed metrics line (missing keys: {', '.join(missing)})")
    unknown = foreign_record_keys(record)
    if any(k in LEGACY_RECORD_KEYS for k in unknown):
        raise ReportInputError(
            f"{where}: metrics line of an older version (keys {', '.join(unknown)}); convert the run "
            "directory once: python -m experiments.convert_runs <runs dir>"
        )
    if unknown:
        # no version of freeze wrote these (an edited or foreign file): converting cannot help, and
        # pointing there sent a user round a loop (reliability probe, case 24)
        raise ReportInputError(
            f"{where}: metrics line with keys no version of freeze writes: {', '.join(unknown)}; "
            "remove them from that line (accepted keys: the fields of freeze.pipeline.schema.EpochRecord)"
        )


def _parse_metrics_record(record: dict, where: str, n_blocks: int) -> tuple[dict, list[float]]:
    _check_record_keys(record, where)
    row = {}
    for key in _RECORD_SCALARS:
        nullable = type(None) in _RECORD_TYPES[key]
        row[key] = _number(record.get(key), key, where, nullable=nullable)
    _check_possible(row, where, n_blocks)
    phase_s = record["phase_s"]
    if not isinstance(phase_s, dict):
        raise ReportInputError(f"{where}: malformed metrics line (phase_s must be an object)")
    for name in PHASES:
        row[f"phase_{name}_s"] = _number(phase_s.get(name), f"phase_s.{name}", where, nullable=name == EVAL_PHASE)
    eta = record["grad_norm"].get("eta") if isinstance(record["grad_norm"], dict) else None
    if not isinstance(eta, list) or len(eta) != n_blocks:
        raise ReportInputError(
            f"{where}: malformed metrics line "
            f"(grad_norm.eta must be a list of {n_blocks} numbers or nulls, one per block)"
        )
    return row, [_number(v, "grad_norm.eta", where, nullable=True) for v in eta]


# Values of the right type that no run can write: refused, never averaged into a table (a test_acc
# of 1.7 read as +160 points in a paired table; reliability.md case 25).
_FRACTIONS = ("train_acc", "val_acc", "test_acc", "frozen_param_fraction")
_NON_NEGATIVE = (
    "epoch",
    "step",
    "epoch_wall_s",
    "cumulative_wall_s",
    "allreduce_bytes",
    "train_loss",
    "val_loss",
    "test_loss",
)


def _check_possible(row: dict, where: str, n_blocks: int) -> None:
    for key in _FRACTIONS:
        if key in row and not (math.isnan(row[key]) or 0.0 <= row[key] <= 1.0):
            raise ReportInputError(f"{where}: {key} = {row[key]:g} is impossible; accepted: a fraction in [0, 1]")
    for key in _NON_NEGATIVE:
        if key in row and row[key] < 0:  # NaN compares false: a null stays a null
            raise ReportInputError(f"{where}: {key} = {row[key]:g} is impossible; accepted: a number >= 0")
    if not float(row["epoch"]).is_integer():
        raise ReportInputError(f"{where}: epoch = {row['epoch']:g} is impossible; accepted: an integer >= 0")
    for key in ("boundary", "boundary_at_epoch_start"):
        value = row.get(key, math.nan)
        if not math.isnan(value) and not (float(value).is_integer() and 0 <= value <= n_blocks - 1):
            raise ReportInputError(
                f"{where}: {key} = {value:g} is impossible with {n_blocks} blocks; accepted: an integer 0..{n_blocks - 1}"
            )


def _number(value, key: str, where: str, nullable: bool) -> float:
    if value is None and nullable:
        return math.nan
    if not is_number(value):
        accepted = "a number or null" if nullable else "a number"
        raise ReportInputError(f"{where}: malformed metrics line ({key} must be {accepted}, got {value!r})")
    return float(value)
